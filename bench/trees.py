"""Draft shapes (chains and trees) of one or more drafters against plain greedy and prompt
lookup, in one run.

    python -m bench.trees [--drafter drafters/smollm2-135m-instruct-4m] [--prompts 24]
        [--tokens 128] [--shapes chain:2 tree:2:8:10 tree:3:6:10 ...] [--dtype float32]
    python -m bench.trees --drafter 4m=drafters/smollm2-135m-instruct-4m --drafter deep=DIR
        --shapes 4m:chain:2 4m:tree:2:4:6 deep:chain:3 deep:chain:5 deep:tree:5:4:8 [--json FILE]
    python -m bench.trees --drafter a=DIR --drafter b=DIR --shapes a:chain:3 b:chain:3 ...
        --domains chat=12,code=24,math=24,long=4      # speculative-eval's domains, figures per domain
    python -m bench.trees --drafter e3=DIR --drafter df=DFLASH_DIR --shapes e3:tree:5:8:16 df:block

A shape is `[NAME:]chain:K` or `[NAME:]tree:K:TOPK:BUDGET[:LOOKUP]` (eval.k, eval.topk,
eval.tree_budget, eval.lookup_tokens: a prompt-lookup branch grafted onto the tree) for an
EAGLE-3 drafter, `[NAME:]block` for a DFlash one (its block, one drafter forward a step); NAME
picks a drafter given as `--drafter NAME=DIR` (default: the first). Both families decode on one
loaded target. A shape deeper than its drafter's trained TTT length is measured with a warning
(its extra steps were never trained). Each prompt
is decoded by every decoder back to back, in rotating order, so machine noise hits all alike;
every speculative output must equal plain greedy's (the run stops otherwise). Prints, per shape
(per domain with --domains), the acceptance length with its 95% bootstrap interval over prompts,
the share of steps that accept at least 1, 2, ... drafts (where a deeper level stops paying),
draft and verify ms per step and the pooled speedup with its interval, then each shape minus the
first, paired over the same resampled prompts. The machine comes first: figures from another CPU
do not compare.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np
import yaml

from bench.decoding import add_decoding_args, domain_prompts, load_drafters, mtbench_prompts, parse_domains
from bench.drafters import summarize as paired_figures
from eagle3.core.device import machine
from eagle3.decoding.engine import Generation, greedy_decode
from eagle3.decoding.evaluate import Diverged, decode_prompts, prompt_lookup_decode
from eagle3.decoding.setup import depth_warning
from eagle3.drafter.dflash_export import drafter_kind
from eagle3.drafter.export import trained_ttt_length

MODES = ("chain", "tree", "block")
SHAPE_FORMS = "[NAME:]chain:K, [NAME:]tree:K:TOPK:BUDGET[:LOOKUP] (EAGLE-3) or [NAME:]block (DFlash)"


def parse_shape(text: str) -> tuple[str | None, dict]:
    """`[NAME:]chain:K`, `[NAME:]tree:K:TOPK:BUDGET[:LOOKUP]` or `[NAME:]block` -> (drafter name
    or None, engine settings)."""
    fields = text.split(":")
    name = None if fields[0] in MODES else fields.pop(0)
    mode, *numbers = fields or [""]
    if mode == "block" and not numbers:
        return name, {"mode": "block"}
    if mode == "chain" and len(numbers) == 1:
        return name, {"mode": "chain", "k": int(numbers[0])}
    if mode == "tree" and len(numbers) in (3, 4):
        k, topk, budget, lookup = map(int, numbers + ["0"] * (4 - len(numbers)))
        return name, {"mode": "tree", "k": k, "topk": topk, "tree_budget": budget, "lookup_tokens": lookup}
    raise SystemExit(f"bad shape {text!r}: expected {SHAPE_FORMS}")


def family(folder: Path) -> str:
    """eagle3 or dflash; a folder without an export is a random EAGLE-3 drafter."""
    return drafter_kind(folder) if (folder / "config.json").exists() else "eagle3"


def check_family(text: str, name: str, settings: dict, kind: str) -> None:
    """A block shape needs a DFlash drafter, a chain or a tree an EAGLE-3 one."""
    wants = "dflash" if settings["mode"] == "block" else "eagle3"
    if kind != wants:
        form = "[NAME:]block" if kind == "dflash" else "[NAME:]chain:K or [NAME:]tree:K:TOPK:BUDGET[:LOOKUP]"
        raise SystemExit(f"shape {text!r}: drafter {name!r} is {kind}, whose shapes are {form}")


def parse_drafters(specs: list[str]) -> dict[str, Path]:
    """`DIR` or `NAME=DIR` per --drafter -> {name: folder}; an unnamed one is named by its folder."""
    drafters: dict[str, Path] = {}
    for spec in specs:
        name, sep, folder = spec.partition("=")
        path = Path(folder if sep else name)
        name = name if sep else path.name
        if name in drafters or name in MODES:
            raise SystemExit(f"--drafter {spec!r}: the name {name!r} is taken; give each NAME=DIR")
        drafters[name] = path
    return drafters


def rate(generations: list[Generation]) -> float:
    return sum(len(g.tokens) for g in generations) / sum(g.seconds for g in generations)


def reach(generations: list[Generation], depth: int) -> list[float]:
    """Per draft position 1..depth, the share of verifications that accept at least that many
    of the drafter's own tokens: position p pays only while this stays well above 0."""
    accepted = np.asarray([a for g in generations for a in g.drafter_accepted])
    return [float((accepted >= p).mean()) if accepted.size else 0.0 for p in range(1, depth + 1)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--drafter", action="append", metavar="[NAME=]DIR", help="repeatable")
    add_decoding_args(ap, prompts=24, tokens=128, lookup=4)
    ap.add_argument("--shapes", nargs="+", default=["chain:2", "tree:2:4:6", "tree:2:6:8", "tree:2:8:10"])
    ap.add_argument("--seed", type=int, default=0, help="of the bootstrap resamples")
    ap.add_argument("--json", metavar="FILE", help="also write the figures as JSON")
    ap.add_argument(
        "--domains",
        metavar="NAME=N,...",
        help="speculative-eval's domains instead of --prompts MT-bench first turns, figures per domain "
        "(e.g. chat=12,code=24,math=24,long=4)",
    )
    args = ap.parse_args()
    paths = parse_drafters(args.drafter or ["drafters/smollm2-135m-instruct-4m"])
    first = next(iter(paths))
    shapes: dict[str, tuple[str, dict]] = {}
    kinds = {name: family(path) for name, path in paths.items()}
    for text in args.shapes:
        name, settings = parse_shape(text)
        name = name or first
        if name not in paths:
            raise SystemExit(f"shape {text!r}: no --drafter named {name!r} (named: {', '.join(paths)})")
        check_family(text, name, settings, kinds[name])
        label = text if len(paths) == 1 or text.startswith(f"{name}:") else f"{name}:{text}"
        shapes[label] = (name, settings)
    for label, (name, settings) in shapes.items():
        # a random drafter (no config) has no depth; a DFlash one drafts its trained block
        if settings["mode"] != "block" and (paths[name] / "config.json").exists():
            if warning := depth_warning(settings["k"], trained_ttt_length(paths[name], default=1)):
                print(f"{label}: {warning}")

    setups = load_drafters(args.target, args.dtype, paths, args.drafter_dtype)
    print("machine:", machine())
    for name, path in paths.items():
        random = "" if (path / "config.json").exists() else " (random: measures overhead)"
        print(f"drafter {name}: {path}{random}")
    print(f"drafters in {str(setups[first].drafter_dtype).removeprefix('torch.')}")
    for name, settings in shapes.values():
        if settings["mode"] == "block":
            settings["block_size"] = setups[name].drafter.cfg.block_size
    target, eos = setups[first].target, setups[first].eos
    engines = {label: setups[name].engine(**settings) for label, (name, settings) in shapes.items()}
    n = args.tokens
    if args.domains:
        listed = domain_prompts(setups[first], parse_domains(args.domains), n)
        domains, prompts = [d for d, _, _ in listed], [(pid, ids) for _, pid, ids in listed]
    else:
        prompts = mtbench_prompts(target, args.prompts)
        domains = ["mtbench"] * len(prompts)

    decoders: list[tuple[str, Callable[[list[int]], Generation]]] = [
        ("plain", lambda ids: greedy_decode(target.model, ids, n, eos))
    ]
    if args.lookup:
        decoders.append(("lookup", lambda ids: prompt_lookup_decode(target.model, ids, n, eos, args.lookup)))
    decoders += [(label, lambda ids, e=e: e.generate(ids, n, eos)) for label, e in engines.items()]

    try:
        rows = decode_prompts(decoders, prompts, must_match=list(engines))
    except Diverged as err:
        raise SystemExit(f"{err.name} diverged from plain greedy on prompt {err.index}") from None
    depths = {
        label: engine.max_depth if shapes[label][1]["mode"] == "block" else shapes[label][1]["k"]
        for label, engine in engines.items()
    }
    by_domain = {}
    for domain in dict.fromkeys(domains):
        part = [row for row, d in zip(rows, domains, strict=True) if d == domain]
        runs = {name: [row[name] for row in part] for name, _ in decoders}
        by_domain[domain] = figures = summarize(part, depths, args.seed)
        print(f"--- {domain}")
        report(runs, figures, args, len(part))
    if args.json:
        out = {
            "machine": machine(),
            "command": "python -m bench.trees " + shlex.join(sys.argv[1:]),
            "drafters": {name: str(path) for name, path in paths.items()},
            # what `eagle3 report --shapes` needs to tell a TTT sweep's points apart: each drafter's
            # trained TTT length and the params that made it (its folder's params.yaml, if any)
            "ttt_lengths": {
                name: trained_ttt_length(path, default=1)
                for name, path in paths.items()
                if (path / "config.json").exists() and kinds[name] == "eagle3"
            },
            "kinds": kinds,
            "train_params": {name: _params(path) for name, path in paths.items()},
            "settings": {label: {"drafter": name, **s} for label, (name, s) in shapes.items()},
            "prompts": {d: domains.count(d) for d in by_domain},
            "tokens": n,
            "dtype": args.dtype,
            "domains": by_domain,
        }
        Path(args.json).write_text(json.dumps(out, indent=2) + "\n")
        print(f"json: {args.json}")


def _params(folder: Path) -> dict | None:
    shipped = folder / "params.yaml"
    return yaml.safe_load(shipped.read_text()) if shipped.exists() else None


def summarize(rows: list[dict[str, Generation]], depths: dict[str, int], seed: int) -> dict[str, dict]:
    """Per shape: bench/drafters.py's figures (acceptance length and speedup over plain with 95%
    bootstrap intervals over prompts; after the first shape, both minus the first's, paired),
    plus the drafter's own share of the acceptance, the reach of each draft position and the
    ms per step."""
    paired = paired_figures(rows, list(depths), lookup=False, seed=seed)["decoders"]
    out: dict[str, dict] = {}
    for label, depth in depths.items():
        gens = [row[label] for row in rows]
        steps = sum(len(g.accepted) for g in gens)
        out[label] = paired[label] | {
            "drafter_acceptance_length": 1 + sum(sum(g.drafter_accepted) for g in gens) / steps,
            "reach": reach(gens, depth),
            "draft_ms_per_step": 1000 * sum(g.draft_s for g in gens) / steps,
            "verify_ms_per_step": 1000 * sum(g.verify_s for g in gens) / steps,
        }
    return out


def _ci(iv: dict[str, float] | None, fmt: str = ".2f") -> str:
    return f"[{iv['lo']:{fmt}}, {iv['hi']:{fmt}}]" if iv else "[n/a]"


def report(
    runs: dict[str, list[Generation]], figures: dict[str, dict], args: argparse.Namespace, n: int
) -> None:
    base = rate(runs["plain"])
    print(f"plain greedy: {base:.2f} tok/s ({1000 / base:.1f} ms/token), {n} prompts x {args.tokens} tokens")
    if args.lookup:
        print(f"prompt lookup ({args.lookup} tokens): {rate(runs['lookup']) / base:.3f}x")
    # "drafter" = the drafter's own share of the acceptance length (the lookup branch's excluded)
    width = max(14, *map(len, figures))
    print(
        f"{'shape':<{width}} {'accept len [95% CI]':>22} {'drafter':>8} {'draft ms':>9} {'verify ms':>10} "
        f"{'speedup [95% CI]':>24}  share of steps accepting >= 1, 2, ..."
    )
    for label, f in figures.items():
        accept = f"{f['acceptance_length']:.3f} {_ci(f['acceptance_length_ci'])}"
        spd = f"{f['speedup']:.3f}x {_ci(f['speedup_ci'])}"
        share = " ".join(f"{r:.3f}" for r in f["reach"])
        print(
            f"{label:<{width}} {accept:>22} {f['drafter_acceptance_length']:>8.3f} "
            f"{f['draft_ms_per_step']:>9.1f} {f['verify_ms_per_step']:>10.1f} {spd:>24}  {share}"
        )
    first = next(iter(figures))
    for label, f in list(figures.items())[1:]:
        print(
            f"{label} - {first}: acceptance {f['acceptance_length_minus_reference']:+.3f} "
            f"{_ci(f['acceptance_length_minus_reference_ci'], '+.3f')}, "
            f"speedup {f['speedup_minus_reference']:+.3f} "
            f"{_ci(f['speedup_minus_reference_ci'], '+.3f')} (paired)"
        )


if __name__ == "__main__":
    main()
