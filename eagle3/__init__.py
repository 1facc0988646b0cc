"""eagle3: trains EAGLE-3 drafters for a target LLM and measures what they buy.

The folder list is the map, foundations first (stages/ calls into it; cli/ only reads results):
    core/               params schema, deterministic stage outputs, input errors, packaged files,
                        the machine and its dtypes, MLflow glue; imports nothing else of eagle3
    verifier/           the target model: load it, render text as it reads it, capture, patch-check
    sglang/             everything SGLang (its layer_ids.py is the one piece verifier/ and drafter/ read)
    data/               conversations, the feature store, the extraction loop
    vocab.py            the draft vocabulary (d2t/t2d) and its coverage
    drafter/            the EAGLE-3 draft model, its export and warm start
    train/              the TTT unroll, the loop, simulated acceptance
    decoding/           speculative decoding and its evaluation
    dtype_decisions.py  what each `auto` dtype resolves to here (the dtypes stage)
    cli/                the `eagle3` command and reports; no stage imports it
"""
