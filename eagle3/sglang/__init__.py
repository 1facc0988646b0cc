"""Everything this project does with SGLang: what it relies on (supported versions, layer ids,
server args), the HTTP client, hidden-state rows, the patch-check against the HF reference,
extraction on SGLang servers, and speculative-eval on SGLang's own speculative decoding."""
