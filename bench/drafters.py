"""Two drafters on one target in one run: which decodes faster, with paired intervals.

    python -m bench.drafters drafters/smollm2-135m-instruct-full OTHER_DRAFTER
        [--prompts 24] [--tokens 128] [--mode tree --k 2 --topk 4 --budget 6] [--lookup 4]

Deciding whether a new drafter replaces a shipped one: each prompt is decoded plain,
by each drafter's engine (drafter alone, as SGLang and vLLM serve it) and, with --lookup N, by
transformers' prompt lookup, back to back in rotating order, so machine noise hits all alike.
Greedy acceptance is deterministic; speeds are not. Every figure has a bootstrap interval over
prompts, and the differences are paired (the same resampled prompts for both sides,
eagle3/decoding/stats.py): B leads A only where the interval of B - A lies above 0.
"""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Callable
from pathlib import Path

import numpy as np

from bench.decoding import mtbench_prompts
from eagle3.core.device import DTYPES, machine
from eagle3.core.params import TargetParams
from eagle3.decoding.engine import Generation, greedy_decode
from eagle3.decoding.evaluate import decode_prompts, generation_totals, prompt_lookup_decode
from eagle3.decoding.setup import DecodingSetup, check_draft_depth
from eagle3.decoding.stats import Totals, acceptance_length, percentile_interval, resample_index, speedup
from eagle3.drafter.export import trained_ttt_length

Decoder = tuple[str, Callable[[list[int]], Generation]]


def print_rates(pid: str, generations: dict[str, Generation]) -> None:
    """One line per prompt: each decoder's tokens/s, in the order they ran."""
    line = ", ".join(f"{name} {_rate(g):.1f}" for name, g in generations.items())
    print(f"  {pid}: tokens/s {line}", flush=True)


def _rate(g: Generation) -> float:
    return len(g.tokens) / g.seconds


def _totals(rows: list[dict[str, Generation]], name: str) -> Totals:
    return generation_totals([r[name] for r in rows], [r["plain"] for r in rows])


def _ci(samples: np.ndarray) -> str:
    iv = percentile_interval(samples)
    return f"[{iv['lo']:.3f}, {iv['hi']:.3f}]" if iv else "[n/a]"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("a", help="exported drafter folder A (e.g. the shipped one)")
    ap.add_argument("b", help="exported drafter folder B (the candidate)")
    ap.add_argument("--target", default="smollm2-135m-instruct")
    ap.add_argument("--dtype", default="float32", choices=sorted(DTYPES))
    ap.add_argument("--drafter-dtype", default="auto", choices=["auto", *sorted(DTYPES)])
    ap.add_argument("--prompts", type=int, default=24)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--mode", default="tree", choices=["chain", "tree"])
    ap.add_argument("--k", type=int, default=2)
    ap.add_argument("--topk", type=int, default=4)
    ap.add_argument("--budget", type=int, default=6)
    ap.add_argument("--lookup", type=int, default=4, help="prompt_lookup_num_tokens of the peer (0 = skip)")
    ap.add_argument("--seed", type=int, default=0, help="of the bootstrap resamples")
    args = ap.parse_args()
    if args.prompts < 1:
        ap.error("--prompts: at least 1")

    paths = {"A": Path(args.a), "B": Path(args.b)}
    for path in paths.values():
        check_draft_depth(args.k, trained_ttt_length(path, default=1))
    target = TargetParams(source=args.target, dtype=args.dtype)
    setup_a = DecodingSetup.load(target, paths["A"], args.drafter_dtype)
    setups = {"A": setup_a, "B": setup_a.with_drafter(paths["B"])}
    settings = {"mode": args.mode, "k": args.k, "topk": args.topk, "tree_budget": args.budget}
    engines = {name: s.engine(**settings) for name, s in setups.items()}
    model, eos, n = setup_a.target.model, setup_a.eos, args.tokens

    decoders: list[Decoder] = [
        ("plain", lambda ids: greedy_decode(model, ids, n, eos)),
        ("A", lambda ids: engines["A"].generate(ids, n, eos)),
        ("B", lambda ids: engines["B"].generate(ids, n, eos)),
    ]
    if args.lookup:
        decoders.append(("lookup", lambda ids: prompt_lookup_decode(model, ids, n, eos, args.lookup)))

    print("machine:", machine(), "| drafters in", str(setup_a.drafter_dtype).removeprefix("torch."))
    for name, path in paths.items():
        print(f"{name}: {path}")
    tree = f" topk={args.topk} budget={args.budget}" if args.mode == "tree" else ""
    print(f"{args.prompts} MT-bench prompts x {n} tokens, {args.mode} k={args.k}{tree}, drafters alone")
    rows = decode_prompts(decoders, mtbench_prompts(setup_a.target, args.prompts), on_prompt=print_rates)
    report(rows, [name for name, _ in decoders if name != "plain"], args.seed)


def report(rows: list[dict[str, Generation]], names: list[str], seed: int) -> None:
    """Each decoder against plain decoding, then the paired comparisons (95% intervals)."""
    totals = {name: _totals(rows, name) for name in names}
    whole = {name: t.sum_over(np.arange(len(rows))) for name, t in totals.items()}
    index = resample_index(len(rows), seed)
    sums = {name: t.sum_over(index) for name, t in totals.items()}
    for name in names:
        line = f"{name}:"
        if name != "lookup":
            length, ci = acceptance_length(whole[name]), _ci(acceptance_length(sums[name]))
            line += f" acceptance length {length:.3f} {ci} ({whole[name].steps:.0f} steps),"
        median = statistics.median(_rate(r[name]) / _rate(r["plain"]) for r in rows)
        match = sum(r[name].tokens == r["plain"].tokens for r in rows)
        print(
            f"{line} speedup {speedup(whole[name]):.3f}x {_ci(speedup(sums[name]))}, "
            f"median per prompt {median:.2f}x, greedy match {match}/{len(rows)}"
        )
    # B over A in tokens/s: plain decoding's own noise cancels out of this ratio
    longer = acceptance_length(whole["B"]) - acceptance_length(whole["A"])
    longer_ci = _ci(acceptance_length(sums["B"]) - acceptance_length(sums["A"]))
    faster = speedup(whole["B"]) / speedup(whole["A"]) - 1
    faster_ci = _ci(speedup(sums["B"]) / speedup(sums["A"]) - 1)
    print(f"B - A: acceptance length {longer:+.3f} {longer_ci}, tokens/s {faster:+.3f} {faster_ci} (paired)")
    if "lookup" in names:
        for x in ("A", "B"):
            diff = speedup(whole[x]) - speedup(whole["lookup"])
            diff_ci = _ci(speedup(sums[x]) - speedup(sums["lookup"]))
            print(f"{x} - prompt lookup: speedup {diff:+.3f} {diff_ci} (paired)")


if __name__ == "__main__":
    main()
