"""`eagle3 report`: the comparison table plus a report (markdown, HTML, PNG plots) that picks the
best size (eagle3/sweep/ decides and writes it)."""

from __future__ import annotations

import argparse

from rich.console import Console

from eagle3.cli.commands.compare import experiment_arguments, read_rows, warn_of_leftover_workers
from eagle3.cli.subcommand import Subcommand, fail


def _arguments(parser: argparse.ArgumentParser) -> None:
    experiment_arguments(parser)
    parser.add_argument("--out", default="report", help="folder for report.md, report.html, PNGs")
    parser.add_argument(
        "--plan-target",
        metavar="TARGET",
        help="also each size's planned cost on this target (as `eagle3 plan --target`: config.json, "
        "HF folder or packaged name), and its ratio to the 32,768 row's",
    )
    parser.add_argument(
        "--shapes",
        metavar="FILE",
        help="`python -m bench.trees ... --json FILE` of a TTT sweep's drafters at the same shapes: "
        "instead of the vocabulary report, which TTT to train and which shape to serve (depth.md)",
    )
    parser.add_argument(
        "--ttt-cost",
        metavar="FILE",
        help="with --shapes: `python -m bench.ttt --json FILE`, each TTT length's train time per token",
    )
    parser.add_argument(
        "--paired",
        metavar="FILE",
        help="`python -m bench.drafters ... --json FILE`: a paired-speedup column, and ties by the "
        "paired intervals",
    )


def _run(args: argparse.Namespace) -> int:
    from eagle3.cli.commands.compare import print_comparison
    from eagle3.core.inputs import InputError
    from eagle3.core.params import ParamsError
    from eagle3.sweep.costs import PlanTarget
    from eagle3.sweep.experiments import ExperimentsError
    from eagle3.sweep.paired import Paired
    from eagle3.sweep.render import write_report

    if args.shapes:
        return _depth_report(args)
    warn_of_leftover_workers()
    try:  # the files first: a bad one fails before `dvc exp show` runs
        plan_target = PlanTarget.read(args.plan_target) if args.plan_target else None
        paired = Paired.read(args.paired) if args.paired else None
        rows = read_rows(args)
    except (ExperimentsError, ParamsError, InputError) as err:
        return fail(err)
    console = Console()
    print_comparison(rows, console)
    verdict, files = write_report(rows, args.out, plan_target, paired)
    console.print(f"\n{verdict.paragraph}\n", highlight=False)
    console.print(f"report: {files[0]} and {files[1]} (plots: {len(files) - 2} PNGs in {args.out})")
    return 0


def _depth_report(args: argparse.Namespace) -> int:
    import json
    from pathlib import Path

    from eagle3.core.inputs import InputError
    from eagle3.sweep.depth import ShapeRun, decide

    try:
        run = ShapeRun.read(args.shapes)
        costs = json.loads(Path(args.ttt_cost).read_text()) if args.ttt_cost else None
        verdict = decide(run, costs)
    except (InputError, OSError, json.JSONDecodeError) as err:
        return fail(err)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "depth.md").write_text(verdict.markdown)
    Console().print(f"{verdict.paragraph}\nreport: {out / 'depth.md'}", highlight=False)
    return 0


SUBCOMMAND = Subcommand(
    "report",
    "the comparison table plus a report (markdown, HTML, PNG plots) that picks the best size; "
    "with --shapes, the TTT length to train and the shape to serve",
    _arguments,
    _run,
)
