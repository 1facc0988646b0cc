"""patch-check for the SGLang backend: the servers run a supported version in the right mode,
the requested layers come back for every prompt position and decode step, and the rows agree
with the HF float32 reference within the bf16 tolerance measured in tests/fixtures/sglang; so
do the target's top-N logprobs (sglang_target: top_logprobs), position by position.

Every server of both pools is checked on the same few conversations (the ones recorded in the
fixtures), rendered by the caller exactly as extraction renders them (eagle3/sglang/patch_check.py).
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

import torch
from torch import Tensor

from eagle3.core.layer_ids import LayerIdRule
from eagle3.data.wire import dequantize_rows, quantize_rows
from eagle3.sglang.client import ServerPool
from eagle3.sglang.handover import HookTransport
from eagle3.sglang.rows import generate_body, prefill_body, request_rows
from eagle3.sglang.server_args import check_pool_args
from eagle3.target.fingerprint import Fingerprint, ServedBy
from eagle3.target.patch_check import PatchCheckError

CHECK_CONVERSATIONS = (
    (
        "What is the capital of France?",
        "The capital of France is Paris, a city known for the Eiffel Tower, art museums and cafes.",
    ),
    (
        "Write a haiku about autumn.",
        "Crisp leaves drift and fall,\ngolden light on quiet paths,\nthe year exhales slow.",
    ),
    (
        "Explain recursion in one sentence.",
        "Recursion is when a function solves a problem by calling itself on smaller copies of that "
        "same problem.",
    ),
)
GENERATE_TOKENS = 16
# SGLang bf16 against HF float32, recorded on SmolLM2: worst row cosine 0.99703 (layer 14,
# one row), worst per-layer mean 0.99985. The bounds leave room for other prompts, not for a
# wrong layer or a shifted position (those score far lower).
MIN_ROW_COSINE = 0.995
MIN_MEAN_COSINE = 0.9995

# SGLang bf16 top logprobs against HF float32 (tests/fixtures/sglang/LOGPROBS.md): at least
# MIN_TOP1_AGREEMENT of the positions must have the same best token (recorded: 0.968-0.984, the
# misses near-ties), and the logprob SGLang gives its best token must lie within
# MAX_TOP1_LOGPROB_ERROR of the reference's for that token (recorded: 0.158). A shifted position
# or another model agrees on few positions and misses by whole nats.
MIN_TOP1_AGREEMENT = 0.9
MAX_TOP1_LOGPROB_ERROR = 0.5

# input ids -> {"layer_<L>": [T, H], "final_norm": [T, H], "log_probs": [T, V]} in float32
# (the fixtures' naming; log_probs row t is the prediction of token t + 1)
Reference = Callable[[list[int]], dict[str, Tensor]]


def hf_reference(model: torch.nn.Module, aux_layers: list[int]) -> Reference:
    """The reference from a transformers model: layer L = hidden_states[L + 1]."""

    @torch.no_grad()
    def reference(ids: list[int]) -> dict[str, Tensor]:
        out = model(torch.tensor([ids]), output_hidden_states=True)
        states = out.hidden_states
        ref = {f"layer_{layer}": states[layer + 1][0].float() for layer in aux_layers}
        return ref | {"final_norm": states[-1][0].float(), "log_probs": out.logits[0].float().log_softmax(-1)}

    return reference


def agreement(rows: Tensor, reference: dict[str, Tensor], names: list[str]) -> dict[str, dict]:
    """Per slice of `rows` (one per name, in order): min and mean cosine against the reference."""
    width = rows.shape[1] // len(names)
    result = {}
    for i, name in enumerate(names):
        cos = torch.nn.functional.cosine_similarity(
            rows[:, i * width : (i + 1) * width], reference[name], dim=-1
        )
        result[name] = {"min_cosine": round(cos.min().item(), 6), "mean_cosine": round(cos.mean().item(), 6)}
    return result


def logprob_agreement(ids: Tensor, logprobs: Tensor, log_probs: Tensor) -> dict:
    """A server's top-n (ids, logprobs [T, n]) against the reference's log_probs [T, V]."""
    reference_best = log_probs.argmax(-1)
    error = (logprobs[:, 0] - log_probs.gather(-1, ids[:, :1].long())[:, 0]).abs()
    return {
        "top1_agreement": round((ids[:, 0].long() == reference_best).float().mean().item(), 6),
        "max_top1_logprob_error": round(error.max().item(), 6),
        "mean_top1_logprob_error": round(error.mean().item(), 6),
    }


def _failures(where: str, scores: dict[str, dict]) -> list[str]:
    failed = []
    for name, s in scores.items():
        if "top1_agreement" in s:
            worst = s["max_top1_logprob_error"]
            if s["top1_agreement"] < MIN_TOP1_AGREEMENT or worst > MAX_TOP1_LOGPROB_ERROR:
                failed.append(
                    f"{where} {name}: best token agrees at {s['top1_agreement']} of positions (needs >= "
                    f"{MIN_TOP1_AGREEMENT}), its logprob is off by up to {s['max_top1_logprob_error']} "
                    f"(needs <= {MAX_TOP1_LOGPROB_ERROR})"
                )
        elif s["min_cosine"] < MIN_ROW_COSINE or s["mean_cosine"] < MIN_MEAN_COSINE:
            failed.append(
                f"{where} {name}: min cosine {s['min_cosine']} (needs >= {MIN_ROW_COSINE}), "
                f"mean {s['mean_cosine']} (needs >= {MIN_MEAN_COSINE})"
            )
    return failed


def check_pools(
    aux: ServerPool, final: ServerPool | None, aux_layers: list[int], rule: LayerIdRule
) -> tuple[dict, dict | None]:
    """Version and mode of every server (cheap: no model needed); the args records of both pools
    (None for the final-state pool where there is none: sglang_target top_logprobs)."""
    aux_args = check_pool_args({u: aux.server_info(u) for u in aux.urls}, "aux", aux_layers, rule)
    if final is None:
        return aux_args, None
    final_args = check_pool_args({u: final.server_info(u) for u in final.urls}, "final", aux_layers, rule)
    if aux_args["version"] != final_args["version"] or aux_args["dtype"] != final_args["dtype"]:
        raise ValueError(
            f"aux servers run SGLang {aux_args['version']} ({aux_args['dtype']}), final-state servers "
            f"{final_args['version']} ({final_args['dtype']}): serve both kinds from one build and dtype"
        )
    return aux_args, final_args


def run_sglang_patch_check(
    aux: ServerPool,
    final: ServerPool | None,
    prefill_inputs: list[list[int]],
    generate_prompt: list[int],
    hidden_size: int,
    aux_layers: list[int],
    reference: Reference,
    top_logprobs: int | None = None,
) -> list[dict]:
    """Compare every server's rows (and with `top_logprobs` N, the aux requests' top-N
    logprobs) with `reference` on `prefill_inputs` (prefill) and on a greedy answer to
    `generate_prompt` (decode steps); raise PatchCheckError listing every disagreement, else
    return the per-check scores. `final` is None when the top logprobs replace it."""
    names = [f"layer_{layer}" for layer in aux_layers]
    checks, failed = [], []

    def scored(rows, want: dict[str, Tensor], keys: list[str], states: Tensor) -> dict[str, dict]:
        scores = agreement(states, want, keys)
        if rows.top_ids is not None:
            scores["top_logprobs"] = logprob_agreement(rows.top_ids, rows.top_logprobs, want["log_probs"])
        return scores

    pools = [(aux, "aux", 3 * hidden_size, names, top_logprobs)]
    if final is not None:
        pools.append((final, "final", hidden_size, ["final_norm"], None))
    for ids in prefill_inputs:
        want = reference(ids)
        for pool, kind, width, keys, top in pools:
            for url in pool.urls:
                rows = request_rows(
                    ServerPool([url], pool.timeout_s), prefill_body(ids, top), width, f"{kind} rows"
                )
                scores = scored(rows, want, keys, rows.prefill)
                failed += _failures(f"{url} prefill of {len(ids)} tokens,", scores)
                checks.append({"server": kind, "kind": "prefill", "tokens": len(ids), "agreement": scores})
    # decode-step rows: the server's own answer, fed back to the reference
    for url in aux.urls:
        body = generate_body(generate_prompt, GENERATE_TOKENS, [], ignore_eos=True, top_logprobs=top_logprobs)
        rows = request_rows(ServerPool([url], aux.timeout_s), body, 3 * hidden_size, "aux rows")
        fed = generate_prompt + rows.output_ids[:-1]
        scores = scored(rows, reference(fed), names, torch.cat([rows.prefill, rows.decode]))
        failed += _failures(f"{url} generation of {len(rows.output_ids)} tokens,", scores)
        checks.append({"server": "aux", "kind": "generate", "tokens": len(fed), "agreement": scores})
    if failed:
        raise PatchCheckError("SGLang rows disagree with the HF reference: " + "; ".join(failed))
    return checks


def check_transport(
    aux: ServerPool, transport: HookTransport, inputs: list[list[int]], width: int, copies: int = 4
) -> dict:
    """Every aux server's hook rows against the JSON rows of the same forwards, bit for bit:
    each request asks for both (return_hidden_states and a request id), each input is sent
    `copies` times at once, so the server batches requests into shared forwards and the hook
    must split them right; an fp8 hook's rows must equal the feature store's quantization of the
    JSON rows. Raises PatchCheckError naming the first mismatch."""
    compared, dtypes = 0, set()
    for url in aux.urls:
        one = ServerPool([url], aux.timeout_s)

        def both(ids: list[int], one: ServerPool = one, url: str = url) -> tuple[Tensor, Tensor]:
            rid = transport.new_rid()
            try:
                # logprobs from position 0 keep SGLang off its prefix cache: the copies share prefixes
                response = one.generate(url, prefill_body(ids, 1) | {"rid": rid})
                states = (response.get("meta_info") or {}).get("hidden_states") or [[]]
                given = torch.tensor(states[0], dtype=torch.float32).reshape(-1, width)
                return given, transport.collect(rid, len(ids), width, url, "aux rows")
            finally:
                transport.discard(rid, len(ids))

        sent = [ids for ids in inputs for _ in range(copies)]
        with ThreadPoolExecutor(len(sent)) as pool:
            pairs = list(pool.map(both, sent))
        for ids, (given, handed) in zip(sent, pairs, strict=True):
            # a prefill split over forwards returns the last chunk's JSON rows only: compare those
            tail = handed[max(len(ids) - len(given), 0) :]
            if len(given) and given.shape == tail.shape and not torch.equal(given, tail):
                # an fp8 hook: its rows must be the feature store's quantization of the JSON rows
                fp8, scales = quantize_rows(given.to(torch.bfloat16))
                if torch.equal(dequantize_rows(fp8, scales), tail):
                    dtypes.add("float8_e4m3fn")
                    compared += len(given)
                    continue
            if len(given) == 0 or not torch.equal(given, tail):
                bad = (given != tail).any(-1).nonzero()[0, 0].item() if given.shape == tail.shape else 0
                raise PatchCheckError(
                    f"{url}: the hook's rows of a {len(ids)}-token prefill differ from the JSON rows "
                    f"of the same forward (first at position {len(ids) - len(given) + bad})"
                )
            dtypes.add("bfloat16")
            compared += len(given)
    requests = len(inputs) * copies * len(aux.urls)
    if len(dtypes) > 1:
        raise PatchCheckError("the servers' hooks write different dtypes (bf16 and fp8): serve one")
    return {
        "transport": transport.name,
        "requests": requests,
        "rows": compared,
        "bitwise_equal": True,  # bf16: the JSON rows; fp8: the store's quantization of them
        "hook_dtype": dtypes.pop(),
    }


def sglang_fingerprint(
    base: Fingerprint,
    aux_args: dict,
    final_args: dict | None,
    rule: LayerIdRule,
    top_logprobs: int | None = None,
) -> Fingerprint:
    """The transformers fingerprint of the local target files, with the engine replaced by SGLang
    and what the target's prediction comes from (top-N logprobs, or the final-state servers)."""
    return replace(
        base,
        engine="sglang",
        engine_version=aux_args["version"],
        dtype=aux_args["dtype"],
        torch_version=None,  # the servers' torch, not this process's
        servers=ServedBy(aux_args, final_args, top_logprobs, rule.family),
    )
