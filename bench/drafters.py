"""Drafters on one target in one run: which decodes faster, with paired intervals.

    python -m bench.drafters drafters/smollm2-135m-instruct-full OTHER_DRAFTER [MORE ...]
        [--prompts 24] [--tokens 128] [--mode tree --k 2 --topk 4 --budget 6] [--lookup 4]
        [--lookup-branch 0] [--json FILE]

Deciding whether a new drafter replaces a shipped one: each prompt is decoded plain,
by each drafter's engine (drafter alone, as SGLang and vLLM serve it; with --lookup-branch N,
its tree carries eagle3's N-token prompt-lookup branch, eval.lookup_tokens) and, with --lookup N, by
transformers' prompt lookup, back to back in rotating order, so machine noise hits all alike.
Greedy acceptance is deterministic; speeds are not. Every figure has a bootstrap interval over
prompts, and the differences are paired (the same resampled prompts for both sides,
eagle3/decoding/stats.py): B leads A only where the interval of B - A lies above 0.

Two or more drafters (A, B, C, ... in the order given): each after the first is paired against
the first, the reference (e.g. the 32K drafter of a vocabulary sweep). --json FILE writes, per
drafter, acceptance length and speedup vs plain with their intervals, the paired intervals of
both minus the reference's and of its speedup minus every other drafter's, with the machine and
the command line: `eagle3 report --paired FILE` reads it (and, where the file holds every size of
a sweep, ranks the sizes by this one run).
"""

from __future__ import annotations

import argparse
import json
import math
import shlex
import statistics
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np

from bench.decoding import DraftShape, add_decoding_args, load_drafters, mtbench_prompts
from eagle3.core.device import machine
from eagle3.decoding.engine import Generation, greedy_decode
from eagle3.decoding.evaluate import decode_prompts, generation_totals, prompt_lookup_decode
from eagle3.decoding.setup import depth_warning
from eagle3.decoding.stats import Totals, acceptance_length, percentile_interval, resample_index, speedup
from eagle3.drafter.export import load_drafter_config, trained_ttt_length

Decoder = tuple[str, Callable[[list[int]], Generation]]


def print_rates(pid: str, generations: dict[str, Generation]) -> None:
    """One line per prompt: each decoder's tokens/s, in the order they ran."""
    line = ", ".join(f"{name} {_rate(g):.1f}" for name, g in generations.items())
    print(f"  {pid}: tokens/s {line}", flush=True)


def _rate(g: Generation) -> float:
    return len(g.tokens) / g.seconds


def _totals(rows: list[dict[str, Generation]], name: str) -> Totals:
    return generation_totals([r[name] for r in rows], [r["plain"] for r in rows])


def _ci(iv: dict[str, float] | None) -> str:
    return f"[{iv['lo']:.3f}, {iv['hi']:.3f}]" if iv else "[n/a]"


def _number(x: np.ndarray | float) -> float | None:
    value = float(x)
    return value if math.isfinite(value) else None  # NaN (no verification, no time): JSON null


def labels(count: int) -> list[str]:
    """A, B, C, ...: the drafters' names in the output, in the order given."""
    return [chr(ord("A") + i) for i in range(count)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "drafters",
        nargs="+",
        metavar="DRAFTER",
        help="exported drafter folders, two or more: the first (A, e.g. the shipped one) is the reference, "
        "each other (B, C, ...: the candidates) is paired against it",
    )
    add_decoding_args(
        ap,
        prompts=24,
        tokens=128,
        lookup=4,
        shape=DraftShape(mode="tree", k=2, topk=4, budget=6),
        lookup_help="prompt_lookup_num_tokens of the peer (0 = skip)",
    )
    ap.add_argument(
        "--lookup-branch",
        type=int,
        default=0,
        help="eval.lookup_tokens: an N-token prompt-lookup branch in each drafter's tree (0 = alone)",
    )
    ap.add_argument("--seed", type=int, default=0, help="of the bootstrap resamples")
    ap.add_argument("--json", metavar="FILE", help="also write the figures as JSON (eagle3 report --paired)")
    args = ap.parse_args()
    if args.prompts < 1:
        ap.error("--prompts: at least 1")
    if not 2 <= len(args.drafters) <= 26:
        ap.error("drafters: two to 26 folders (the first is the reference)")

    paths = dict(zip(labels(len(args.drafters)), map(Path, args.drafters), strict=True))
    for name, path in paths.items():
        if warning := depth_warning(args.k, trained_ttt_length(path, default=1)):
            print(f"{name} ({path}): {warning}")
    setups = load_drafters(args.target, args.dtype, paths, args.drafter_dtype)
    setup_a = setups["A"]
    settings = {"mode": args.mode, "k": args.k, "topk": args.topk, "tree_budget": args.budget}
    settings["lookup_tokens"] = args.lookup_branch
    engines = {name: s.engine(**settings) for name, s in setups.items()}
    model, eos, n = setup_a.target.model, setup_a.eos, args.tokens

    decoders: list[Decoder] = [("plain", lambda ids: greedy_decode(model, ids, n, eos))]
    decoders += [(name, lambda ids, e=engine: e.generate(ids, n, eos)) for name, engine in engines.items()]
    if args.lookup:
        decoders.append(("lookup", lambda ids: prompt_lookup_decode(model, ids, n, eos, args.lookup)))

    drafter_dtype = str(setup_a.drafter_dtype).removeprefix("torch.")
    print("machine:", machine(), "| drafters in", drafter_dtype)
    for name, path in paths.items():
        print(f"{name}: {path}")
    tree = f" topk={args.topk} budget={args.budget}" if args.mode == "tree" else ""
    how = f"with a {args.lookup_branch}-token lookup branch" if args.lookup_branch else "drafters alone"
    print(f"{args.prompts} MT-bench prompts x {n} tokens, {args.mode} k={args.k}{tree}, {how}")
    rows = decode_prompts(decoders, mtbench_prompts(setup_a.target, args.prompts), on_prompt=print_rates)
    summary = summarize(rows, list(paths), bool(args.lookup), args.seed)
    report(summary)
    if args.json:
        drafters = {
            name: {"path": str(path), "name": path.resolve().name, "draft_vocab_size": _draft_size(path)}
            for name, path in paths.items()
        }
        run = {
            "machine": machine(),
            "command": "python -m bench.drafters " + shlex.join(sys.argv[1:]),
            "target": args.target,
            "dtype": args.dtype,
            "drafter_dtype": drafter_dtype,
            "settings": settings | {"prompts": args.prompts, "tokens": n, "lookup": args.lookup},
        }
        Path(args.json).write_text(json.dumps(to_json(summary, drafters, run), indent=2) + "\n")
        print(f"json: {args.json}")


def _draft_size(path: Path) -> int | None:
    try:
        return load_drafter_config(path).draft_vocab_size
    except (FileNotFoundError, ValueError, KeyError):
        return None


def summarize(rows: list[dict[str, Generation]], drafters: list[str], lookup: bool, seed: int) -> dict:
    """The figures of a run, as plain data: per decoder (each drafter, then "lookup" when it ran)
    its speedup over plain decoding and, for drafters, acceptance length, each with a 95% bootstrap
    interval over prompts; per drafter after the first, the paired differences against the first
    (the reference) over the same resampled prompts, and its speedup minus every other drafter's
    (keyed by label); per drafter, its speedup minus prompt lookup's. NaN (no verification, no
    time) is None."""
    names = [*drafters, "lookup"] if lookup else list(drafters)
    totals = {name: _totals(rows, name) for name in names}
    whole = {name: t.sum_over(np.arange(len(rows))) for name, t in totals.items()}
    index = resample_index(len(rows), seed)
    sums = {name: t.sum_over(index) for name, t in totals.items()}
    reference = drafters[0]
    out: dict = {"prompts": len(rows), "seed": seed, "reference": reference, "decoders": {}}
    for name in names:
        entry: dict = {}
        if name != "lookup":
            entry["acceptance_length"] = _number(acceptance_length(whole[name]))
            entry["acceptance_length_ci"] = percentile_interval(acceptance_length(sums[name]))
            entry["steps"] = float(whole[name].steps)
        entry["speedup"] = _number(speedup(whole[name]))
        entry["speedup_ci"] = percentile_interval(speedup(sums[name]))
        entry["median_speedup_per_prompt"] = statistics.median(
            _rate(r[name]) / _rate(r["plain"]) for r in rows
        )
        entry["greedy_match"] = sum(r[name].tokens == r["plain"].tokens for r in rows)
        if name != "lookup" and name != reference:
            # X minus the reference; tokens/s as a ratio, in which plain decoding's own noise cancels
            diff = {
                "acceptance_length": (acceptance_length(whole[name]), acceptance_length(whole[reference])),
                "speedup": (speedup(whole[name]), speedup(whole[reference])),
            }
            diff_samples = {
                "acceptance_length": acceptance_length(sums[name]) - acceptance_length(sums[reference]),
                "speedup": speedup(sums[name]) - speedup(sums[reference]),
            }
            for key, (x, ref) in diff.items():
                entry[f"{key}_minus_reference"] = _number(x - ref)
                entry[f"{key}_minus_reference_ci"] = percentile_interval(diff_samples[key])
            entry["tokens_per_s_over_reference"] = _number(
                speedup(whole[name]) / speedup(whole[reference]) - 1
            )
            entry["tokens_per_s_over_reference_ci"] = percentile_interval(
                speedup(sums[name]) / speedup(sums[reference]) - 1
            )
        if name != "lookup":
            # every other drafter too, so a report can tie any two sizes, not only one with the reference
            for key, measure in (("speedup", speedup), ("acceptance_length", acceptance_length)):
                entry[f"{key}_minus_drafter"] = {
                    other: {
                        "value": _number(measure(whole[name]) - measure(whole[other])),
                        "ci": percentile_interval(measure(sums[name]) - measure(sums[other])),
                    }
                    for other in drafters
                    if other != name
                }
        if lookup and name != "lookup":
            entry["speedup_minus_prompt_lookup"] = _number(speedup(whole[name]) - speedup(whole["lookup"]))
            entry["speedup_minus_prompt_lookup_ci"] = percentile_interval(
                speedup(sums[name]) - speedup(sums["lookup"])
            )
        out["decoders"][name] = entry
    return out


def report(summary: dict) -> None:
    """Each decoder against plain decoding, then the paired comparisons (95% intervals)."""
    decoders, n, reference = summary["decoders"], summary["prompts"], summary["reference"]
    for name, d in decoders.items():
        line = f"{name}:"
        if name != "lookup":
            line += (
                f" acceptance length {_f(d['acceptance_length'])} {_ci(d['acceptance_length_ci'])} "
                f"({d['steps']:.0f} steps),"
            )
        print(
            f"{line} speedup {_f(d['speedup'])}x {_ci(d['speedup_ci'])}, "
            f"median per prompt {d['median_speedup_per_prompt']:.2f}x, greedy match {d['greedy_match']}/{n}"
        )
    # X over the reference in tokens/s: plain decoding's own noise cancels out of this ratio
    for name, d in decoders.items():
        if "acceptance_length_minus_reference" in d:
            longer = _f(d["acceptance_length_minus_reference"], "+.3f")
            print(
                f"{name} - {reference}: acceptance length {longer} "
                f"{_ci(d['acceptance_length_minus_reference_ci'])}, tokens/s "
                f"{_f(d['tokens_per_s_over_reference'], '+.3f')} {_ci(d['tokens_per_s_over_reference_ci'])} "
                "(paired)"
            )
    for name, d in decoders.items():
        if "speedup_minus_prompt_lookup" in d:
            print(
                f"{name} - prompt lookup: speedup {_f(d['speedup_minus_prompt_lookup'], '+.3f')} "
                f"{_ci(d['speedup_minus_prompt_lookup_ci'])} (paired)"
            )


def _f(value: float | None, fmt: str = ".3f") -> str:
    return format(float("nan") if value is None else value, fmt)


def to_json(summary: dict, drafters: dict[str, dict], run: dict) -> dict:
    """The --json file (`eagle3 report --paired` reads it): the run (machine, command line,
    settings), then one entry per drafter in the order given, the reference first, each with its
    folder's path, name and draft vocabulary size beside its figures; prompt lookup's apart."""
    decoders = summary["decoders"]
    ref = summary["reference"]
    out = run | {"prompts": summary["prompts"], "seed": summary["seed"], "reference": drafters[ref]["path"]}
    out["drafters"] = [
        {"label": name, "reference": name == ref, **meta, **decoders[name]} for name, meta in drafters.items()
    ]
    if "lookup" in decoders:
        out["prompt_lookup"] = decoders["lookup"]
    return out


if __name__ == "__main__":
    main()
