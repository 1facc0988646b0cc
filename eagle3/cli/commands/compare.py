"""`eagle3 compare`: the experiments side by side (vocab size, coverage, acceptance, draft cost,
speed, machine). `eagle3 report` reads them the same way (experiment_arguments, read_rows)."""

from __future__ import annotations

import argparse

from rich.console import Console

from eagle3.cli.subcommand import Subcommand, fail


def experiment_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("names", nargs="*", help="experiments to show (default: all with metrics)")
    parser.add_argument("--source", choices=("dvc", "mlflow"), default="dvc", help="where to read")
    parser.add_argument("--json", help="a saved `dvc exp show --json` output instead of running it")
    parser.add_argument("--all-commits", action="store_true", help="experiments of every commit (dvc)")
    parser.add_argument("--params", default="params.yaml", help="names the MLflow store and experiment")


def warn_of_leftover_workers() -> None:
    from eagle3.cli.queue_workers import leftover_worker_warning

    if warning := leftover_worker_warning():
        Console(stderr=True).print(f"[yellow]warning:[/] {warning}", highlight=False, soft_wrap=True)


def read_rows(args: argparse.Namespace) -> list:
    """The selected experiments as rows (ExperimentsError, ParamsError or InputError: bad input)."""
    from eagle3.sweep.experiments import load_experiments, select

    rows, where = load_experiments(args.source, args.json, args.all_commits, args.params)
    return select(rows, args.names, where)


def _run(args: argparse.Namespace) -> int:
    from eagle3.cli.compare import print_comparison
    from eagle3.core.inputs import InputError
    from eagle3.core.params import ParamsError
    from eagle3.sweep.experiments import ExperimentsError

    warn_of_leftover_workers()
    try:
        rows = read_rows(args)
    except (ExperimentsError, ParamsError, InputError) as err:
        return fail(err)
    print_comparison(rows, Console())
    return 0


SUBCOMMAND = Subcommand(
    "compare",
    "compare experiments: vocab size, coverage, acceptance, draft cost, speed, machine",
    experiment_arguments,
    _run,
)
