"""The speculative-eval comparison: plain greedy, the speculative engine and transformers'
prompt-lookup decoding, interleaved per prompt, plus the metrics and the divergence check.

Interleaving (and rotating the order per prompt) spreads machine noise, e.g. other jobs on
a shared CPU, evenly over the three decoders; the first prompt is run once untimed to warm
up allocators and kernels.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from transformers import PreTrainedModel

from eagle3.decoding.divergence import Divergence, check_divergence
from eagle3.decoding.engine import Generation, SpecEngine, greedy_decode
from eagle3.decoding.stats import Totals, bootstrap_intervals, per_category, point_metrics
from eagle3.train.simulate import position_shares
from eagle3.vocab import coverage_of


@dataclass
class PromptResult:
    id: str
    prompt_tokens: int
    baseline: Generation
    spec: Generation
    lookup: Generation | None = None
    divergence: Divergence | None = None

    @property
    def match(self) -> bool:
        return self.baseline.tokens == self.spec.tokens

    def as_dict(self) -> dict:
        """The deterministic part (no timings): what the stage keeps as its output."""
        out = {
            "id": self.id,
            "prompt_tokens": self.prompt_tokens,
            "new_tokens": len(self.spec.tokens),
            "baseline_new_tokens": len(self.baseline.tokens),
            "greedy_match": self.match,
            "steps": len(self.spec.accepted),
            "accepted": self.spec.accepted,
            "spec_tokens": self.spec.tokens,
        }
        if not self.match:
            out["baseline_tokens"] = self.baseline.tokens
        if self.lookup is not None:
            out["prompt_lookup_match"] = self.lookup.tokens == self.baseline.tokens
        if self.divergence is not None:
            out["divergence"] = self.divergence.as_dict()
        return out


@dataclass
class EvalOutcome:
    """What either backend's evaluation hands the stage: the same metrics and rows, MLflow tags,
    the lines to print, and the row keys the lossless check compares."""

    metrics: dict
    rows: list[dict]
    tags: dict[str, str]
    report: list
    compared: tuple[str, str] = ("baseline", "speculative")
    engine: str = "speculative"


@dataclass
class EvalRun:
    results: list[PromptResult] = field(default_factory=list)


def prompt_lookup_decode(
    model: PreTrainedModel,
    prompt_ids: list[int],
    max_new_tokens: int,
    eos_ids: frozenset[int],
    num_tokens: int,
) -> Generation:
    """transformers' prompt-lookup decoding (greedy), the peer the drafter must beat."""
    start = time.perf_counter()
    ids = torch.tensor([prompt_ids])
    out = model.generate(
        input_ids=ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=max_new_tokens,
        do_sample=False,
        prompt_lookup_num_tokens=num_tokens,
        eos_token_id=sorted(eos_ids),
        pad_token_id=min(eos_ids),
    )
    tokens = out[0, len(prompt_ids) :].tolist()
    return Generation(tokens=tokens, seconds=time.perf_counter() - start)


def decode_rotated(
    decoders: Sequence[tuple[str, Callable[[list[int]], Generation]]], ids: list[int], index: int
) -> dict[str, Generation]:
    """Prompt number `index` through every decoder back to back, the order rotated by the index so
    that machine noise (and any carry-over from the decoder before) hits all of them alike."""
    shift = index % len(decoders)
    return {name: decode(ids) for name, decode in decoders[shift:] + decoders[:shift]}


class Diverged(Exception):
    """A decoder that must be lossless produced other tokens than the reference decoder."""

    def __init__(self, name: str, reference: str, index: int) -> None:
        super().__init__(f"{name} diverged from {reference} on prompt {index}")
        self.name, self.reference, self.index = name, reference, index


def decode_prompts(
    decoders: Sequence[tuple[str, Callable[[list[int]], Generation]]],
    prompts: Sequence[tuple[str, list[int]]],
    must_match: Sequence[str] = (),
    on_prompt: Callable[[str, dict[str, Generation]], None] | None = None,
) -> list[dict[str, Generation]]:
    """Every prompt (id, token ids) through every decoder in rotating order (decode_rotated), after
    one untimed warm-up of each decoder on the first prompt: per prompt, each decoder's Generation.

    `must_match`: the decoders whose tokens must equal the first decoder's (the reference); the
    first prompt where one differs raises Diverged, the run stopped there (bench/trees.py).
    `on_prompt(id, generations)` after each prompt, e.g. to print its rates (bench/drafters.py).
    """
    if prompts:  # warm-up, untimed
        for _, decode in decoders:
            decode(prompts[0][1])
    reference = decoders[0][0]
    rows = []
    for i, (pid, ids) in enumerate(prompts):
        rows.append(decode_rotated(decoders, ids, i))
        for name in must_match:
            if rows[-1][name].tokens != rows[-1][reference].tokens:
                raise Diverged(name, reference, i)
        if on_prompt is not None:
            on_prompt(pid, rows[-1])
    return rows


def run_comparison(
    engine: SpecEngine,
    prompts: Sequence[tuple[str, list[int]]],
    max_new_tokens: int,
    eos_ids: frozenset[int],
    prompt_lookup_tokens: int | None = None,
    check: bool = True,
    on_prompt: Callable[[PromptResult], None] | None = None,
) -> EvalRun:
    """Decode every prompt three ways, interleaved; judge every divergence when `check`."""
    model = engine.model
    decoders: list[tuple[str, Callable[[list[int]], Generation]]] = [
        ("baseline", lambda ids: greedy_decode(model, ids, max_new_tokens, eos_ids)),
        ("spec", lambda ids: engine.generate(ids, max_new_tokens, eos_ids)),
    ]
    if prompt_lookup_tokens:
        n_lookup = prompt_lookup_tokens
        decoders.append(
            ("lookup", lambda ids: prompt_lookup_decode(model, ids, max_new_tokens, eos_ids, n_lookup))
        )
    if prompts:  # warm-up, untimed
        warm = prompts[0][1]
        greedy_decode(model, warm, 4, eos_ids)
        engine.generate(warm, 8, eos_ids)
        if prompt_lookup_tokens:
            prompt_lookup_decode(model, warm, 4, eos_ids, prompt_lookup_tokens)
    run = EvalRun()
    block = engine.max_depth + 1  # the width of a chain verification (a tree's deepest path + root)
    for i, (pid, ids) in enumerate(prompts):
        outputs = decode_rotated(decoders, ids, i)
        result = PromptResult(pid, len(ids), outputs["baseline"], outputs["spec"], outputs.get("lookup"))
        if check and not result.match:
            result.divergence = check_divergence(
                model, ids, result.baseline.tokens, result.spec.tokens, block
            )
        run.results.append(result)
        if on_prompt is not None:
            on_prompt(result)
    return run


def _rate(tokens: int, seconds: float) -> float:
    return tokens / seconds if seconds > 0 else 0.0


def per_position_acceptance(results: Sequence[PromptResult], k: int) -> dict[str, float]:
    """{position: P(the draft at that position is accepted | the one before it was)}, 1..k."""
    accepted = torch.tensor([a for r in results for a in r.spec.accepted], dtype=torch.float64)
    return position_shares(accepted, k)  # one definition: the train stage's simulated shares too


def summarize(run: EvalRun, k: int, greedy: bool) -> dict:
    """The metrics of a comparison (docs/drafters.md, "Decoding shape"); `k` is the most draft
    tokens a step can accept (SpecEngine.max_depth), the denominator of acceptance_rate."""
    results = run.results
    accepted = torch.tensor([a for r in results for a in r.spec.accepted], dtype=torch.float64)
    steps = accepted.shape[0]
    spec_tokens = sum(len(r.spec.tokens) for r in results)
    base_tokens = sum(len(r.baseline.tokens) for r in results)
    spec_s = sum(r.spec.seconds for r in results)
    base_s = sum(r.baseline.seconds for r in results)
    tps, base_tps = _rate(spec_tokens, spec_s), _rate(base_tokens, base_s)
    per_position = per_position_acceptance(results, k)
    drafter_accepted = sum(a for r in results for a in r.spec.drafter_accepted)
    metrics = {
        "num_prompts": len(results),
        "new_tokens": spec_tokens,
        "steps": steps,
        "acceptance_length": float(accepted.mean()) + 1 if steps else 0.0,
        "acceptance_rate": float(accepted.sum()) / (steps * k) if steps else 0.0,
        # the drafter's own share: without a lookup branch equal to acceptance_length
        "drafter_acceptance_length": drafter_accepted / steps + 1 if steps else 0.0,
        "per_position_acceptance": per_position,
        "tokens_per_s": tps,
        "baseline_tokens_per_s": base_tps,
        "speedup": tps / base_tps if base_tps else 0.0,
        "draft_ms_per_step": 1000 * sum(r.spec.draft_s for r in results) / max(steps, 1),
        "verify_ms_per_step": 1000 * sum(r.spec.verify_s for r in results) / max(steps, 1),
        "prefill_ms_per_prompt": 1000 * sum(r.spec.prefill_s for r in results) / max(len(results), 1),
    }
    lookups = [r.lookup for r in results if r.lookup is not None]
    if lookups:
        look_tps = _rate(sum(len(g.tokens) for g in lookups), sum(g.seconds for g in lookups))
        metrics["prompt_lookup_tokens_per_s"] = look_tps
        metrics["prompt_lookup_speedup"] = look_tps / base_tps if base_tps else 0.0
        metrics["prompt_lookup_greedy_match"] = sum(
            r.lookup.tokens == r.baseline.tokens for r in results if r.lookup is not None
        ) / len(lookups)
    if greedy:
        divergences = [r.divergence for r in results if r.divergence is not None]
        metrics["greedy_match"] = sum(r.match for r in results) / max(len(results), 1)
        metrics["divergences"] = len(divergences)
        metrics["unexplained_divergences"] = sum(not d.explained for d in divergences)
        metrics["lossless"] = all(d.explained for d in divergences)
    return metrics


def prompt_totals(run: EvalRun) -> Totals:
    """The per-prompt counts the ratio metrics and their intervals are computed from."""
    results = run.results
    lookup = bool(results) and all(r.lookup is not None for r in results)
    return generation_totals(
        [r.spec for r in results],
        [r.baseline for r in results],
        [r.lookup for r in results] if lookup else None,
    )


def generation_totals(
    spec: Sequence[Generation], base: Sequence[Generation], lookup: Sequence[Generation] | None = None
) -> Totals:
    """Per-prompt counts of a speculative decoder's generations against plain decoding's of the
    same prompts (and prompt lookup's, when given)."""
    return Totals.of(
        steps=[len(g.accepted) for g in spec],
        accepted=[sum(g.accepted) for g in spec],
        spec_tokens=[len(g.tokens) for g in spec],
        spec_s=[g.seconds for g in spec],
        base_tokens=[len(g.tokens) for g in base],
        base_s=[g.seconds for g in base],
        lookup_tokens=[len(g.tokens) for g in lookup] if lookup else None,
        lookup_s=[g.seconds for g in lookup] if lookup else None,
    )


def summarize_spread(run: EvalRun, categories: Sequence[str], k: int, seed: int) -> dict:
    """Beside summarize(): `per_category` metrics (`categories` aligned with the results) and
    bootstrap intervals over prompts, `<metric>_ci` (see eagle3/decoding/stats.py)."""
    totals = prompt_totals(run)
    return {"per_category": per_category(totals, categories, k), **bootstrap_intervals(totals, seed)}


def per_domain(run: EvalRun, domains: Sequence[str], k: int, seed: int) -> dict[str, dict]:
    """{domain: its prompts' acceptance length and speedup with bootstrap intervals, prompt
    lookup's speedup, and acceptance by draft position}, `domains` aligned with the results."""
    if len(domains) != len(run.results):
        raise ValueError(f"{len(domains)} domains for {len(run.results)} prompts")
    out = {}
    for domain in dict.fromkeys(domains):
        part = EvalRun([r for r, d in zip(run.results, domains, strict=True) if d == domain])
        totals = prompt_totals(part)
        figures = point_metrics(totals.sum_over(np.arange(len(totals))), k)
        figures.pop("acceptance_rate")
        out[domain] = {
            "num_prompts": len(totals),
            **figures,
            **bootstrap_intervals(totals, seed),
            "per_position_acceptance": per_position_acceptance(part.results, k),
        }
    return out


def headline_by_domain(metrics: dict) -> dict[str, Any]:
    """What `dvc exp show` leads with (metrics/domains.json): acceptance length under each domain's
    name and speedup over plain decoding under `x.<domain>`, at two decimals (the intervals are
    tenths wide; metrics/speculative-eval.json keeps every digit). Short names and short values
    keep the eight columns, and the params that differ beside them, within 120 columns."""
    domains = metrics["per_domain"]
    return {d: round(m["acceptance_length"], 2) for d, m in domains.items()} | {
        "x": {d: round(m["speedup"], 2) for d, m in domains.items()}
    }


def eval_coverage(run: EvalRun, t2d: torch.Tensor) -> float:
    """Coverage out of sample: of the target's own answers to the benchmark, the share of tokens
    the draft vocabulary holds (vocab-map's coverage is over the training tokens it counted)."""
    return round(coverage_of([t for r in run.results for t in r.baseline.tokens], t2d), 6)


def unexplained(rows: list[dict], baseline: str = "baseline", spec: str = "speculative") -> list[str]:
    """One line per divergence in the results rows that rounding does not explain."""
    return [
        f"prompt {row['id']}: token {d['index']}: {baseline} {d['baseline_token']} vs {spec} "
        f"{d['spec_token']}, logit gap {d['gap']:.4g} > rounding tolerance {d['tolerance']:.4g}"
        for row in rows
        if (d := row.get("divergence")) and not d["explained"]
    ]
