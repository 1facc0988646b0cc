"""Acceptance by draft position, two speculative-eval runs side by side (our engine vs SGLang),
with bootstrap intervals over prompts: the cross-engine check of docs/scale-out.md "Speculative-eval on
SGLang". Both runs must cover the same prompts with the same draft shape.

  python -m bench.positions HF_RESULTS.json SGLANG_RESULTS.json [--depth K]

Reads each run's artifacts/speculative-eval/results.json: the hf backend's per-step `accepted`
counts, the sglang backend's `correct_drafts_histogram` per prompt. Position p's acceptance is
P(at least p drafts accepted | at least p - 1), as `per_position_acceptance` in the metrics.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

from eagle3.decoding.stats import percentile_interval, resample_index


def step_counts(results: Path, depth: int) -> tuple[list[str], np.ndarray]:
    """(prompt ids, [prompts, depth + 1] verification steps by number of accepted drafts)."""
    rows = json.loads(results.read_text())["prompts"]
    counts = np.zeros((len(rows), depth + 1))
    for i, row in enumerate(rows):
        if "correct_drafts_histogram" in row:
            hist = row["correct_drafts_histogram"][: depth + 1]
            counts[i, : len(hist)] = hist
        else:
            for accepted in row["accepted"]:
                counts[i, min(accepted, depth)] += 1
    return [str(r["id"]) for r in rows], counts


def per_position(counts: np.ndarray) -> np.ndarray:
    """[..., depth] conditional acceptance from [..., depth + 1] summed step counts."""
    reached = counts[..., ::-1].cumsum(-1)[..., ::-1]  # steps with >= p accepted, p = 0..depth
    with np.errstate(invalid="ignore", divide="ignore"):
        return reached[..., 1:] / reached[..., :-1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("ours", type=Path)
    parser.add_argument("sglang", type=Path)
    parser.add_argument("--depth", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    ids_a, a = step_counts(args.ours, args.depth)
    ids_b, b = step_counts(args.sglang, args.depth)
    if ids_a != ids_b:
        raise SystemExit(f"the runs cover different prompts: {ids_a} vs {ids_b}")
    index = resample_index(len(ids_a), args.seed)
    print("| draft position | our engine [95% CI] | SGLang [95% CI] |")
    print("| --- | --- | --- |")
    for label, fn in [(f"{p + 1}", lambda c, p=p: per_position(c)[..., p]) for p in range(args.depth)] + [
        ("acceptance length", lambda c: 1 + (c * np.arange(c.shape[-1])).sum(-1) / c.sum(-1))
    ]:
        cells = []
        for counts in (a, b):
            value = float(fn(counts.sum(0)))
            ci = percentile_interval(fn(counts[index].sum(1)))
            cells.append(f"{value:.3f} [{ci['lo']:.3f}, {ci['hi']:.3f}]" if ci else f"{value:.3f}")
        print(f"| {label} | {cells[0]} | {cells[1]} |")
    print(f"\n{len(ids_a)} prompts; steps: ours {int(a.sum())}, SGLang {int(b.sum())}")


if __name__ == "__main__":
    main()
