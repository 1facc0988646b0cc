"""The rule that turns measured timings into a dtype, kept apart from the measuring so it can be
tested on recorded measurements.

A job's work is made of parts (decoding: a one-token step and a verify step), each timed in
float32 and bf16 on several interleaved reps. A rep's cost is the parts' times weighted as the
job spends them; its bf16/float32 cost ratio is one sample, and the decision reads the samples'
median and a distribution-free confidence interval for it:

- bf16 where the whole interval lies below BF16_WINS: bf16 saves at least 15%, clearly;
- float32 where the whole interval lies above FLOAT32_WINS: bf16 is clearly slower;
- otherwise a tie, resolved to the machine class's default (tie_default), never by the noise.

The two thresholds sit apart, and each class's default lies on the side its measurements fall
(decoding, bf16/float32 cost: ~0.83 on the AMX Xeon of the README's default row, 0.92-1.02 on a
Zen 4 with AVX512-BF16 and no AMX; the drafter's step 0.75-0.80 on that Zen 4), so a decision
could flip only on a machine measuring past the far threshold, not by a rep's noise near one.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence

# The measured times of a job's parts: {dtype: {part: [seconds per rep]}}.
Timings = Mapping[str, Mapping[str, Sequence[float]]]

BF16_WINS = 0.85
FLOAT32_WINS = 1.0
CONFIDENCE = 0.9
# The dtype a tie resolves to. AMX multiplies bf16 natively (the README's default row was
# measured in bf16 on an AMX Xeon: verify step 42.7 ms against 58.7 ms in float32); elsewhere
# float32, in which speculative output equals plain greedy token for token (bf16 rounding flips
# near-tied argmaxes) and which a bf16 dot-product instruction alone does not clearly beat.
TIE_DEFAULT = {"gpu": "bfloat16", "amx": "bfloat16", "avx512_bf16": "float32", "no_native_bf16": "float32"}
# The drafter's precision never changes the output (the target verifies every token), so the
# reason to prefer float32 at a tie is gone: its tie takes bf16 wherever bf16 is native. On the
# Zen 4 its step measured 0.75-0.80 of float32's time, with intervals reaching 0.88: near
# BF16_WINS, where a float32 default would toss a coin.
DRAFT_TIE_DEFAULT = {
    "gpu": "bfloat16",
    "amx": "bfloat16",
    "avx512_bf16": "bfloat16",
    "no_native_bf16": "float32",
}
# Tokens a speculative step generates, for weighting its parts: the README's default row accepts
# 2.00; the official EAGLE code 2.09-2.15 with the shipped drafters at tree 5/8/16.
TYPICAL_ACCEPTANCE = 2.0
# Per generated token, plain greedy decoding spends one one-token step and speculative decoding
# 1/acceptance verify steps; speculative-eval runs both in eval.dtype (its speedup divides them),
# so the decode decision weighs both as the eval spends them. The prompt-lookup peer's 5-token
# verifications lie between the two. Drafting is eval.drafter_dtype's own decision ("draft").
WEIGHTS: dict[str, dict[str, float]] = {
    "prefill": {"prefill": 1.0},
    "train": {"step": 1.0},
    "decode": {"one-token step": 1.0, "verify step": 1 / TYPICAL_ACCEPTANCE},
    "draft": {"draft step": 1.0},
}


def median_interval(values: Sequence[float], confidence: float = CONFIDENCE) -> tuple[float, float]:
    """A distribution-free interval for the median of `values`: the order statistics j and
    n+1-j, with j the largest whose binomial tail leaves at least `confidence` inside."""
    ordered = sorted(values)
    n = len(ordered)
    tail = (1 - confidence) / 2
    j = 0  # 0-based index of the lower bound
    while j + 1 < n - j - 1 and sum(math.comb(n, i) for i in range(j + 2)) / 2**n <= tail:
        j += 1
    return ordered[j], ordered[n - 1 - j]


def cost_ratios(job: str, times: Timings) -> list[float]:
    """Per rep: the bf16 cost over the float32 cost, each part weighted as `job` spends it."""
    weights = WEIGHTS[job]
    if set(times["float32"]) != set(weights) or set(times["bfloat16"]) != set(weights):
        raise ValueError(f"a {job} measurement times {sorted(weights)} (got {sorted(times['float32'])})")

    def cost(dtype: str, rep: int) -> float:
        return sum(w * times[dtype][part][rep] for part, w in weights.items())

    reps = len(next(iter(times["float32"].values())))
    return [cost("bfloat16", rep) / cost("float32", rep) for rep in range(reps)]


def tie_default(job: str, machine_class: str) -> str:
    """The dtype a tie of `job` resolves to on a machine of `machine_class`."""
    return (DRAFT_TIE_DEFAULT if job == "draft" else TIE_DEFAULT)[machine_class]


def decide(job: str, times: Timings, machine_class: str) -> dict:
    """The decision for `job` from its timings on a machine of `machine_class`: {"choice",
    "verdict" (bf16 wins / float32 wins / tie), "ratio" (median), "interval", "parts" (each
    part's median per dtype, ms)}."""
    ratios = cost_ratios(job, times)
    low, high = median_interval(ratios)
    if high < BF16_WINS:
        choice, verdict = "bfloat16", "bf16 wins"
    elif low > FLOAT32_WINS:
        choice, verdict = "float32", "float32 wins"
    else:
        choice, verdict = tie_default(job, machine_class), "tie"
    parts = {
        dtype: {part: round(statistics.median(t) * 1000, 3) for part, t in by_part.items()}
        for dtype, by_part in times.items()
    }
    return {
        "choice": choice,
        "verdict": verdict,
        "ratio": round(statistics.median(ratios), 4),
        "interval": [round(low, 4), round(high, 4)],
        "ratios": [round(r, 4) for r in ratios],
        "parts_ms": parts,
    }


def explain(decision: dict, machine_class: str) -> str:
    """One line: the measured ratio, its interval, and which side of the rule it fell on."""
    low, high = decision["interval"]
    measured = f"bf16/float32 cost {decision['ratio']:.2f} [{low:.2f}, {high:.2f}]"
    if decision["verdict"] == "tie":
        return f"{measured}: a tie -> {decision['choice']}, the {machine_class} default"
    return f"{measured}: {decision['verdict']}"
