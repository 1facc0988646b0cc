"""`eagle3 dtypes`: the dtype each job runs in here (auto: measured, kept per machine) and why."""

from __future__ import annotations

import argparse

from rich.console import Console

from eagle3.cli.subcommand import Subcommand, fail
from eagle3.core.params import ParamsError, load_params


def _arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--params", default="params.yaml")
    parser.add_argument("--remeasure", action="store_true", help="forget this machine's kept measurement")


def _run(args: argparse.Namespace) -> int:
    """Resolve (measuring where needed) and print the dtypes the pipeline would use here."""
    from eagle3.core.device import machine  # loads torch
    from eagle3.dtypes.decisions import forget_params, resolve, table
    from eagle3.train.prepare import dtype_shapes

    try:
        params = load_params(args.params)
    except ParamsError as err:
        return fail(err, soft_wrap=False)
    shapes = dtype_shapes(params)
    if args.remeasure:
        forget_params(params, shapes)
    Console().print(table(resolve(params, shapes)))
    Console().print(f"on {machine()}; `dvc repro` records these in artifacts/dtypes/")
    return 0


SUBCOMMAND = Subcommand(
    "dtypes", "the dtype each job runs in here (auto: measured, kept per machine) and why", _arguments, _run
)
