"""Per-category metrics and bootstrap intervals over prompts, on synthetic per-prompt counts."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from eagle3.decoding.stats import (
    Totals,
    acceptance_length,
    bootstrap_intervals,
    bootstrap_samples,
    per_category,
    percentile_interval,
    point_metrics,
    resample_index,
    speedup,
)


def totals(n: int = 1, **overrides) -> Totals:
    """n identical prompts (10 verifications, 15 accepted, 26 tokens in 1 s vs 2 s plain), or `overrides`."""
    columns = {
        "steps": [10] * n,
        "accepted": [15] * n,
        "spec_tokens": [26] * n,
        "spec_s": [1.0] * n,
        "base_tokens": [26] * n,
        "base_s": [2.0] * n,
        "lookup_tokens": [26] * n,
        "lookup_s": [1.6] * n,
    }
    return Totals.of(**(columns | overrides))


def test_identical_prompts_give_zero_width_intervals_at_the_point_estimate():
    cis = bootstrap_intervals(totals(12), seed=0)
    point = {"acceptance_length": 2.5, "speedup": 2.0, "prompt_lookup_speedup": 1.25}
    point["speedup_minus_prompt_lookup"] = 0.75
    assert set(cis) == {f"{name}_ci" for name in point}
    for name, value in point.items():
        ci = cis[f"{name}_ci"]
        assert ci["lo"] == ci["hi"] == pytest.approx(value)


def test_acceptance_length_is_a_ratio_of_sums_over_the_resampled_prompts():
    # Prompt A: 1 verification, nothing accepted (length 1); B: 9 verifications, 27 accepted
    # (length 4). A resample holds A twice (1.0), B twice (4.0) or both: pooled 37/10 = 3.7; a
    # mean of per-prompt ratios would give 2.5 there instead.
    t = totals(2, steps=[1, 9], accepted=[0, 27])
    values = set(np.round(bootstrap_samples(t, seed=0)["acceptance_length"], 12))
    assert values == {1.0, 3.7, 4.0}
    # P(AA) = P(BB) = 1/4, so the 2.5% and 97.5% percentiles are the extremes.
    assert bootstrap_intervals(t, seed=0)["acceptance_length_ci"] == {"lo": 1.0, "hi": 4.0}


def test_speedup_resamples_pool_tokens_and_seconds_of_both_decoders():
    # Same tokens, spec 1 s vs plain 2 s on A and 3 s vs 3 s on B: pooled (both) speedup 5/4.
    t = totals(2, spec_tokens=[10, 10], spec_s=[1.0, 3.0], base_tokens=[10, 10], base_s=[2.0, 3.0])
    values = set(np.round(bootstrap_samples(t, seed=1)["speedup"], 12))
    assert values == {2.0, 1.25, 1.0}


def test_vectorised_bootstrap_equals_resampling_prompt_by_prompt():
    rng = np.random.default_rng(7)
    n = 9
    t = totals(
        n,
        steps=rng.integers(5, 40, n),
        accepted=rng.integers(0, 60, n),
        spec_tokens=rng.integers(20, 128, n),
        spec_s=rng.uniform(0.5, 4, n),
        base_tokens=rng.integers(20, 128, n),
        base_s=rng.uniform(1, 6, n),
        lookup_tokens=rng.integers(20, 128, n),
        lookup_s=rng.uniform(1, 5, n),
    )
    samples = bootstrap_samples(t, seed=3, resamples=50)
    for b, rows in enumerate(resample_index(n, seed=3, resamples=50)):
        s = {name: sum(getattr(t, name)[i] for i in rows) for name in ("steps", "accepted")}
        assert samples["acceptance_length"][b] == pytest.approx((s["accepted"] + s["steps"]) / s["steps"])
        rate = {
            d: sum(getattr(t, f"{d}_tokens")[i] for i in rows) / sum(getattr(t, f"{d}_s")[i] for i in rows)
            for d in ("spec", "base", "lookup")
        }
        assert samples["speedup"][b] == pytest.approx(rate["spec"] / rate["base"])
        assert samples["prompt_lookup_speedup"][b] == pytest.approx(rate["lookup"] / rate["base"])
        assert samples["speedup_minus_prompt_lookup"][b] == pytest.approx(
            (rate["spec"] - rate["lookup"]) / rate["base"]
        )


def test_interval_matches_the_normal_approximation_on_many_prompts():
    # One verification per prompt: acceptance length = 1 + mean accepted, whose 95% interval is
    # about mean +- 1.96 sd / sqrt(n). A 90% interval (1.645) or a wrong percentile scale fails.
    n = 400
    accepted = np.random.default_rng(0).integers(0, 4, n)
    t = totals(n, steps=[1] * n, accepted=accepted)
    ci = bootstrap_intervals(t, seed=0)["acceptance_length_ci"]
    mean, half = 1 + accepted.mean(), 1.96 * accepted.std() / np.sqrt(n)
    assert ci["lo"] < mean < ci["hi"]
    assert (ci["hi"] - ci["lo"]) / 2 == pytest.approx(half, rel=0.1)
    assert (ci["lo"] + ci["hi"]) / 2 == pytest.approx(mean, abs=0.1 * half)


def test_paired_difference_cancels_the_shared_noise():
    # Both decoders are exactly 2x plain on every prompt while plain's speed varies a lot: each
    # speedup varies with the resample, their difference on the same resample is always 0.
    rng = np.random.default_rng(5)
    base_s = rng.uniform(1, 10, 30)
    t = totals(
        30, base_s=base_s, spec_s=base_s / 2, lookup_s=base_s / 2, spec_tokens=rng.integers(10, 99, 30)
    )
    t = replace(t, base_tokens=t.spec_tokens, lookup_tokens=t.spec_tokens)
    cis = bootstrap_intervals(t, seed=0)
    assert cis["speedup_ci"] == {"lo": pytest.approx(2.0), "hi": pytest.approx(2.0)}
    assert cis["speedup_minus_prompt_lookup_ci"] == {"lo": pytest.approx(0.0), "hi": pytest.approx(0.0)}
    # Speculative seconds unrelated to plain's: now the speedup varies across resamples.
    t2 = replace(t, spec_s=rng.uniform(1, 10, 30))
    ci = bootstrap_intervals(t2, seed=0)["speedup_ci"]
    assert ci["hi"] - ci["lo"] > 0.1


def test_seeded_and_deterministic():
    rng = np.random.default_rng(2)
    t = totals(20, steps=rng.integers(1, 30, 20), accepted=rng.integers(0, 30, 20))
    assert bootstrap_intervals(t, seed=4) == bootstrap_intervals(t, seed=4)
    assert bootstrap_intervals(t, seed=4) != bootstrap_intervals(t, seed=5)


def test_no_prompt_lookup_and_no_prompts():
    t = Totals.of(
        steps=[3, 4], accepted=[1, 2], spec_tokens=[5, 7], spec_s=[1, 1], base_tokens=[5, 7], base_s=[2, 2]
    )
    assert set(bootstrap_intervals(t, seed=0)) == {"acceptance_length_ci", "speedup_ci"}
    assert "prompt_lookup_speedup" not in point_metrics(t.sum_over(np.arange(2)), k=2)
    assert bootstrap_intervals(totals(0), seed=0) == {}


def test_undefined_ratios_are_nan_and_give_no_interval():
    t = totals(3, steps=[0, 0, 0], accepted=[0, 0, 0])  # every prompt ended at its prefill token
    assert np.isnan(acceptance_length(t.sum_over(np.arange(3))))
    assert bootstrap_intervals(t, seed=0)["acceptance_length_ci"] is None
    assert percentile_interval(np.array([np.nan, 1.0, 3.0]), level=1.0) == {"lo": 1.0, "hi": 3.0}
    assert np.isnan(speedup(totals(1, base_s=[0.0]).sum_over(np.arange(1))))


def test_per_category_pools_each_category_in_order_of_appearance():
    t = totals(
        4,
        steps=[10, 2, 30, 4],
        accepted=[10, 2, 15, 0],
        spec_tokens=[20, 4, 45, 4],
        spec_s=[1.0, 1.0, 2.0, 1.0],
        base_tokens=[20, 4, 45, 4],
        base_s=[3.0, 1.0, 2.0, 1.0],
    )
    got = per_category(t, ["stem", "math", "stem", "math"], k=2)
    assert list(got) == ["stem", "math"]
    assert got["stem"] == {
        "num_prompts": 2,
        "acceptance_length": pytest.approx(65 / 40),
        "acceptance_rate": pytest.approx(25 / 80),
        "speedup": pytest.approx((65 / 3) / (65 / 5)),
        "prompt_lookup_speedup": pytest.approx((52 / 3.2) / (65 / 5)),
    }
    assert got["math"]["acceptance_length"] == pytest.approx(8 / 6)
    with pytest.raises(ValueError, match="3 categories for 4 prompts"):
        per_category(t, ["a", "b", "c"], k=2)


def test_pooled_category_equals_the_headline_metrics():
    from eagle3.decoding.engine import Generation
    from eagle3.decoding.evaluate import EvalRun, PromptResult, summarize, summarize_spread

    def result(pid: str, accepted: list[int], n: int, secs: float) -> PromptResult:
        spec = Generation(tokens=list(range(n)), seconds=secs, accepted=accepted)
        base = Generation(tokens=list(range(n)), seconds=2 * secs + 1)
        return PromptResult(pid, 5, base, spec, lookup=Generation(tokens=list(range(n)), seconds=1.5 * secs))

    run = EvalRun([result("a", [0, 1, 2], 7, 1.0), result("b", [3, 3], 9, 2.0), result("c", [1], 3, 0.5)])
    headline = summarize(run, k=3, greedy=True)
    spread = summarize_spread(run, ["all"] * 3, k=3, seed=0)
    pooled = spread["per_category"]["all"]
    assert pooled["num_prompts"] == 3
    for key in ("acceptance_length", "acceptance_rate", "speedup", "prompt_lookup_speedup"):
        assert pooled[key] == pytest.approx(headline[key])
    for key in ("acceptance_length", "speedup", "prompt_lookup_speedup"):
        ci = spread[f"{key}_ci"]
        assert ci["lo"] <= headline[key] <= ci["hi"]
    assert set(headline) & set(spread) == set()  # summarize()'s keys are untouched


def test_console_table_and_interval_line():
    from rich.console import Console

    from eagle3.decoding.report import category_table, interval_line

    t = totals(4)
    metrics = point_metrics(t.sum_over(np.arange(4)), k=4) | {"num_prompts": 4}
    metrics |= {"per_category": per_category(t, ["a", "a", "b", "b"], k=4), **bootstrap_intervals(t, seed=0)}
    console = Console(record=True, width=120)
    console.print(category_table(metrics))
    text = console.export_text()
    assert "prompt lookup speedup" in text and "2.500" in text and "1.250" in text
    assert text.count("2.000") == 3  # speedup of a, b and all
    line = interval_line(metrics)
    assert "acceptance length [2.500, 2.500]" in line and "speedup - prompt lookup [0.750, 0.750]" in line
