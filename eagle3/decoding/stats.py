"""Ratio metrics of a speculative-eval run per category, and bootstrap intervals over prompts.

Every metric is a ratio of sums over prompts (tokens / verifications, tokens / seconds), as in
the headline numbers, so a long answer weighs more than a short one. The intervals resample
whole prompts: a prompt's verifications, tokens and seconds stay together, and its speculative,
plain and prompt-lookup timings are drawn together (paired), which is what lets the difference
of two speedups have an interval narrower than either speedup's.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, fields

import numpy as np

RESAMPLES = 2000
LEVEL = 0.95


@dataclass(frozen=True)
class Totals:
    """Per-prompt counts as float arrays [n], or their sums over sets of prompts (see `sum_over`).
    The prompt-lookup fields are None when the peer did not run."""

    steps: np.ndarray  # target verifications of the speculative decoder
    accepted: np.ndarray  # accepted draft tokens, over all its verifications
    spec_tokens: np.ndarray
    spec_s: np.ndarray
    base_tokens: np.ndarray
    base_s: np.ndarray
    lookup_tokens: np.ndarray | None = None
    lookup_s: np.ndarray | None = None

    @classmethod
    def of(cls, **columns: Sequence[float] | None) -> Totals:
        return cls(**{k: None if v is None else np.asarray(v, dtype=np.float64) for k, v in columns.items()})

    def __len__(self) -> int:
        return len(self.steps)

    def sum_over(self, index: np.ndarray) -> Totals:
        """Sums over the prompts in `index` along its last axis: [m] -> one total, [B, m] -> [B]."""
        return Totals(
            **{
                f.name: None if (col := getattr(self, f.name)) is None else col[index].sum(axis=-1)
                for f in fields(self)
            }
        )


def _ratio(num: np.ndarray, den: np.ndarray) -> np.ndarray:
    # NaN where undefined (no verification, no time): a resample of such prompts says nothing.
    num, den = np.asarray(num, dtype=np.float64), np.asarray(den, dtype=np.float64)
    out = np.full(np.broadcast_shapes(num.shape, den.shape), np.nan)
    np.divide(num, den, out=out, where=den > 0)
    return out


def acceptance_length(t: Totals) -> np.ndarray:
    """Tokens per verification, the bonus token included (= mean accepted + 1)."""
    return _ratio(t.accepted + t.steps, t.steps)


def acceptance_rate(t: Totals, k: int) -> np.ndarray:
    return _ratio(t.accepted, t.steps * k)


def speedup(t: Totals) -> np.ndarray:
    return _ratio(_ratio(t.spec_tokens, t.spec_s), _ratio(t.base_tokens, t.base_s))


def lookup_speedup(t: Totals) -> np.ndarray:
    return _ratio(_ratio(t.lookup_tokens, t.lookup_s), _ratio(t.base_tokens, t.base_s))


def point_metrics(t: Totals, k: int) -> dict[str, float]:
    """The ratio metrics of one set of prompts (summed totals)."""
    metrics = {
        "acceptance_length": float(acceptance_length(t)),
        "acceptance_rate": float(acceptance_rate(t, k)),
        "speedup": float(speedup(t)),
    }
    if t.lookup_s is not None:
        metrics["prompt_lookup_speedup"] = float(lookup_speedup(t))
    return metrics


def per_category(per_prompt: Totals, categories: Sequence[str], k: int) -> dict[str, dict[str, float]]:
    """{category: {num_prompts, acceptance_length, ...}}, categories in order of first appearance."""
    if len(categories) != len(per_prompt):
        raise ValueError(f"{len(categories)} categories for {len(per_prompt)} prompts")
    labels = np.asarray(categories, dtype=object)
    out: dict[str, dict[str, float]] = {}
    for category in dict.fromkeys(categories):
        index = np.flatnonzero(labels == category)
        out[category] = {"num_prompts": len(index), **point_metrics(per_prompt.sum_over(index), k)}
    return out


def resample_index(n: int, seed: int, resamples: int = RESAMPLES) -> np.ndarray:
    """[resamples, n] prompt indices drawn with replacement; the same seed, the same draws."""
    return np.random.default_rng(seed).integers(0, n, size=(resamples, n))


def percentile_interval(samples: np.ndarray, level: float = LEVEL) -> dict[str, float] | None:
    """The central `level` percentile interval of the finite samples; None when there are none."""
    finite = samples[np.isfinite(samples)]
    if finite.size == 0:
        return None
    tail = 100 * (1 - level) / 2
    lo, hi = np.percentile(finite, [tail, 100 - tail])
    return {"lo": float(lo), "hi": float(hi)}


def bootstrap_samples(per_prompt: Totals, seed: int, resamples: int = RESAMPLES) -> dict[str, np.ndarray]:
    """Each metric over the same `resamples` bootstrap resamples of the prompts (paired)."""
    sums = per_prompt.sum_over(resample_index(len(per_prompt), seed, resamples))
    spec = speedup(sums)
    samples = {"acceptance_length": acceptance_length(sums), "speedup": spec}
    if sums.lookup_s is not None:
        lookup = lookup_speedup(sums)
        samples["prompt_lookup_speedup"] = lookup
        samples["speedup_minus_prompt_lookup"] = spec - lookup
    return samples


def bootstrap_intervals(
    per_prompt: Totals, seed: int, resamples: int = RESAMPLES, level: float = LEVEL
) -> dict[str, dict[str, float] | None]:
    """{"<metric>_ci": {"lo", "hi"}}: percentile intervals over resampled prompts. A dict, not a
    list, because `dvc exp show` and MLflow show nested numbers but drop lists."""
    if len(per_prompt) == 0:
        return {}
    samples = bootstrap_samples(per_prompt, seed, resamples)
    return {f"{name}_ci": percentile_interval(values, level) for name, values in samples.items()}
