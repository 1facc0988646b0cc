"""patch-check for the SGLang backend: the servers run a supported version in the right mode,
the requested layers come back for every prompt position and decode step, and the rows agree
with the HF float32 reference within the bf16 tolerance measured in tests/fixtures/sglang.

Every server of both pools is checked on the same few conversations (the ones recorded in the
fixtures), rendered by the caller exactly as extraction renders them (eagle3/data/sglang_extract.py).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from eagle3.target.patch_check import PatchCheckError
from eagle3.target.sglang_client import ServerPool
from eagle3.target.sglang_engine import LayerIdRule, check_pool_args
from eagle3.target.sglang_rows import generate_body, prefill_body, request_rows

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

# input ids -> {"layer_<L>": [T, H], "final_norm": [T, H]} in float32 (the fixtures' naming)
Reference = Callable[[list[int]], dict[str, Tensor]]


def hf_reference(model: torch.nn.Module, aux_layers: list[int]) -> Reference:
    """The reference from a transformers model: layer L = hidden_states[L + 1]."""

    @torch.no_grad()
    def reference(ids: list[int]) -> dict[str, Tensor]:
        states = model(torch.tensor([ids]), output_hidden_states=True).hidden_states
        out = {f"layer_{layer}": states[layer + 1][0].float() for layer in aux_layers}
        return out | {"final_norm": states[-1][0].float()}

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


def _failures(where: str, scores: dict[str, dict]) -> list[str]:
    return [
        f"{where} {name}: min cosine {s['min_cosine']} (needs >= {MIN_ROW_COSINE}), "
        f"mean {s['mean_cosine']} (needs >= {MIN_MEAN_COSINE})"
        for name, s in scores.items()
        if s["min_cosine"] < MIN_ROW_COSINE or s["mean_cosine"] < MIN_MEAN_COSINE
    ]


def check_pools(
    aux: ServerPool, final: ServerPool, aux_layers: list[int], rule: LayerIdRule
) -> tuple[dict, dict]:
    """Version and mode of every server (cheap: no model needed); the args records of both pools."""
    aux_args = check_pool_args({u: aux.server_info(u) for u in aux.urls}, "aux", aux_layers, rule)
    final_args = check_pool_args({u: final.server_info(u) for u in final.urls}, "final", aux_layers, rule)
    if aux_args["version"] != final_args["version"] or aux_args["dtype"] != final_args["dtype"]:
        raise ValueError(
            f"aux servers run SGLang {aux_args['version']} ({aux_args['dtype']}), final-state servers "
            f"{final_args['version']} ({final_args['dtype']}): serve both kinds from one build and dtype"
        )
    return aux_args, final_args


def run_sglang_patch_check(
    aux: ServerPool,
    final: ServerPool,
    prefill_inputs: list[list[int]],
    generate_prompt: list[int],
    hidden_size: int,
    aux_layers: list[int],
    reference: Reference,
) -> list[dict]:
    """Compare every server's rows with `reference` on `prefill_inputs` (prefill) and on a greedy
    answer to `generate_prompt` (decode steps); raise PatchCheckError listing every
    disagreement, else return the per-check scores."""
    names = [f"layer_{layer}" for layer in aux_layers]
    checks, failed = [], []
    for ids in prefill_inputs:
        want = reference(ids)
        for pool, kind, width, keys in (
            (aux, "aux", 3 * hidden_size, names),
            (final, "final", hidden_size, ["final_norm"]),
        ):
            for url in pool.urls:
                rows = request_rows(
                    ServerPool([url], pool.timeout_s), prefill_body(ids), width, f"{kind} rows"
                )
                scores = agreement(rows.prefill, want, keys)
                failed += _failures(f"{url} prefill of {len(ids)} tokens,", scores)
                checks.append({"server": kind, "kind": "prefill", "tokens": len(ids), "agreement": scores})
    # decode-step rows: the server's own answer, fed back to the reference
    for url in aux.urls:
        body = generate_body(generate_prompt, GENERATE_TOKENS, [], ignore_eos=True)
        rows = request_rows(ServerPool([url], aux.timeout_s), body, 3 * hidden_size, "aux rows")
        fed = generate_prompt + rows.output_ids[:-1]
        scores = agreement(torch.cat([rows.prefill, rows.decode]), reference(fed), names)
        failed += _failures(f"{url} generation of {len(rows.output_ids)} tokens,", scores)
        checks.append({"server": "aux", "kind": "generate", "tokens": len(fed), "agreement": scores})
    if failed:
        raise PatchCheckError("SGLang rows disagree with the HF reference: " + "; ".join(failed))
    return checks


def sglang_fingerprint(base: dict, aux_args: dict, final_args: dict, rule: LayerIdRule) -> dict:
    """The transformers fingerprint of the local target files, with the engine replaced by SGLang."""
    fp = {k: v for k, v in base.items() if k not in ("engine", "engine_version", "torch_version", "dtype")}
    return fp | {
        "engine": "sglang",
        "engine_version": aux_args["version"],
        "dtype": aux_args["dtype"],
        "server_args": aux_args,
        "final_server_args": final_args,
        "layer_id_family": rule.family,
    }
