"""SGLang speculative decoding as this project names it: the one mapping from the eval params'
draft shape to SGLang's flags (shared by speculative-eval's sglang backend and `eagle3
serve-command`), the server checks before any decoding, and what one response says.

Shape names (recorded on SGLang 0.5.23, tests/fixtures/sglang/SPEC.md):
  chain, eval.k drafts: --speculative-num-steps k --speculative-eagle-topk 1
      --speculative-num-draft-tokens k + 1 (SGLang's count includes the token the drafts extend);
  tree, depth eval.k, eval.topk children, eval.tree_budget drafts: steps k, topk, budget + 1.
SGLang picks its tree's draft tokens among topk + (k - 1) * topk^2 expanded candidates, so a
budget above that cannot be served.
DFLASH (a DFlash block drafter): only --speculative-algorithm DFLASH and the drafter; SGLang
fixes num_steps and topk at 1 and verifies block_size tokens a step (the drafter's config).
NGRAM (SGLang's n-gram speculation, the peer that needs no training): eval.prompt_lookup_tokens
drafts per step -> --speculative-num-draft-tokens prompt_lookup_tokens + 1, SGLang's defaults
for the rest (a BFS tree of up to 10 branches over an n-gram trie of everything it served).

A response's meta_info carries, per request: spec_verify_ct (verification steps),
spec_num_correct_drafts, spec_correct_drafts_histogram (steps by number of correct drafts,
index 0..steps) and spec_accept_length = completion_tokens / spec_verify_ct, which counts the
prefill's token; 1 + correct / verify steps is the per-step figure comparable to the hf
backend's drafter_acceptance_length.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from eagle3.sglang.server_args import SUPPORTED_VERSIONS

EAGLE3, DFLASH, NGRAM = "EAGLE3", "DFLASH", "NGRAM"
# server args recorded with every result: what decides the numbers
RECORDED_ARGS = (
    "dtype",
    "attention_backend",
    "tp_size",
    "disable_radix_cache",
    "speculative_algorithm",
    "speculative_draft_model_path",
    "speculative_num_steps",
    "speculative_eagle_topk",
    "speculative_num_draft_tokens",
    "speculative_ngram_max_bfs_breadth",
    "speculative_ngram_max_trie_depth",
)


class SpecServerError(ValueError):
    """A server that cannot give this evaluation's numbers: one line naming it and why."""


@dataclass(frozen=True)
class SpecShape:
    """SGLang's speculative flags for one draft shape."""

    num_steps: int
    topk: int
    num_draft_tokens: int

    def flags(self) -> list[str]:
        return [
            "--speculative-num-steps",
            str(self.num_steps),
            "--speculative-eagle-topk",
            str(self.topk),
            "--speculative-num-draft-tokens",
            str(self.num_draft_tokens),
        ]

    def describe(self) -> str:
        return f"steps {self.num_steps}, topk {self.topk}, {self.num_draft_tokens} draft tokens"


def eagle3_shape(mode: str, k: int, topk: int, tree_budget: int) -> SpecShape:
    """SGLang's EAGLE-3 shape for the eval params' (see the module doc)."""
    if mode == "tree":
        return SpecShape(k, topk, tree_budget + 1)
    return SpecShape(k, 1, k + 1)


def dflash_shape(block_size: int) -> SpecShape:
    """What a DFLASH server reports for a drafter of this block size (see the module doc)."""
    return SpecShape(1, 1, block_size)


def servable(shape: SpecShape) -> str | None:
    """Why SGLang cannot serve this shape, or None."""
    if shape.topk == 1:
        return None  # a chain: SGLang drafts exactly num_steps tokens
    candidates = shape.topk + (shape.num_steps - 1) * shape.topk**2
    if shape.num_draft_tokens - 1 > candidates:
        return (
            f"{shape.num_draft_tokens - 1} draft tokens, but SGLang selects them among the "
            f"{candidates} candidates of {shape.num_steps} steps of top-{shape.topk}"
        )
    return None


def eagle3_flags(drafter: str | Path, shape: SpecShape) -> list[str]:
    return ["--speculative-algorithm", EAGLE3, "--speculative-draft-model-path", str(drafter), *shape.flags()]


def dflash_flags(drafter: str | Path) -> list[str]:
    return ["--speculative-algorithm", DFLASH, "--speculative-draft-model-path", str(drafter)]


def ngram_flags(draft_tokens: int) -> list[str]:
    return ["--speculative-algorithm", NGRAM, "--speculative-num-draft-tokens", str(draft_tokens + 1)]


def recorded_args(info: dict) -> dict:
    return {"version": str(info.get("version"))} | {key: info.get(key) for key in RECORDED_ARGS}


def check_version(url: str, info: dict) -> str:
    version = str(info.get("version"))
    if version not in SUPPORTED_VERSIONS:
        raise SpecServerError(
            f"{url} runs SGLang {version}; supported: {', '.join(SUPPORTED_VERSIONS)} (the versions "
            "whose speculative responses are recorded in tests/fixtures/sglang)"
        )
    return version


def check_server(
    url: str,
    info: dict,
    algorithm: str | None,
    shape: SpecShape | None = None,
    draft_tokens: int | None = None,
) -> dict:
    """The recorded args of a server, after checking that it runs a supported version and the
    speculative algorithm (None = plain decoding) and shape this evaluation asks for."""
    check_version(url, info)
    running = info.get("speculative_algorithm")
    if algorithm is None and running:
        raise SpecServerError(
            f"{url} runs speculative decoding ({running}); the baseline must be a plain server"
        )
    if algorithm is not None and running != algorithm:
        what = f"runs {running}" if running else "is not speculative (no --speculative-algorithm)"
        raise SpecServerError(f"{url} {what}; this server must run --speculative-algorithm {algorithm}")
    if shape is not None:
        served = SpecShape(
            int(info.get("speculative_num_steps") or 0),
            int(info.get("speculative_eagle_topk") or 0),
            int(info.get("speculative_num_draft_tokens") or 0),
        )
        if served != shape:
            raise SpecServerError(
                f"{url} serves {served.describe()}; the eval params ask for {shape.describe()} "
                f"({' '.join(shape.flags())})"
            )
    if draft_tokens is not None and int(info.get("speculative_num_draft_tokens") or 0) != draft_tokens + 1:
        raise SpecServerError(
            f"{url} drafts {info.get('speculative_num_draft_tokens')} tokens (root included); "
            f"eval.prompt_lookup_tokens asks for --speculative-num-draft-tokens {draft_tokens + 1}"
        )
    return recorded_args(info)


@dataclass(frozen=True)
class SpecResponse:
    """What one /generate response says about its decoding."""

    output_ids: list[int]
    seconds: float  # the server's own end-to-end latency (prefill included)
    verify_steps: int  # 0 for a plain server
    correct_drafts: int
    histogram: list[int]  # verification steps by number of correct drafts (index 0..)

    @classmethod
    def parse(cls, url: str, response: dict, speculative: bool) -> SpecResponse:
        meta = response.get("meta_info") or {}
        missing = [k for k in ("e2e_latency", "completion_tokens") if k not in meta]
        if speculative:
            missing += [k for k in ("spec_verify_ct", "spec_num_correct_drafts") if k not in meta]
        if missing or not isinstance(response.get("output_ids"), list):
            what = ", ".join(missing) or "output_ids"
            raise SpecServerError(f"{url} answered without {what}: not the layout recorded for SGLang")
        steps = int(meta.get("spec_verify_ct") or 0) if speculative else 0
        correct = int(meta.get("spec_num_correct_drafts") or 0) if speculative else 0
        histogram = [int(n) for n in meta.get("spec_correct_drafts_histogram") or []]
        if speculative and (
            sum(histogram) != steps or sum(i * n for i, n in enumerate(histogram)) != correct
        ):
            raise SpecServerError(
                f"{url}: spec_correct_drafts_histogram {histogram} does not add up to {steps} verify steps "
                f"and {correct} correct drafts"
            )
        return cls(
            [int(t) for t in response["output_ids"]], float(meta["e2e_latency"]), steps, correct, histogram
        )

    def accepted(self) -> list[int]:
        """Correct drafts per verification step, grouped by count (SGLang keeps no order)."""
        return [count for count, steps in enumerate(self.histogram) for _ in range(steps)]
