"""`eagle3 params check [FILE]`: validate a params file and print the resolved values."""

from __future__ import annotations

import argparse

from rich.console import Console
from rich.syntax import Syntax

from eagle3.cli.subcommand import Subcommand, fail
from eagle3.core.params import ParamsError, load_params


def params_check(path: str) -> int:
    import yaml

    console = Console()
    try:
        params = load_params(path)
    except ParamsError as err:
        return fail(err.one_line(), markup=False)
    console.print(f"[green]{path} is valid[/]; resolved params:")
    console.print(Syntax(yaml.safe_dump(params.model_dump(), sort_keys=False), "yaml"))
    from eagle3.dtypes.decisions import resolve, table  # loads torch
    from eagle3.train.prepare import dtype_shapes

    # never measures: `eagle3 dtypes` does
    console.print(table(resolve(params, dtype_shapes(params), measure=False)))
    return 0


def _arguments(parser: argparse.ArgumentParser) -> None:
    actions = parser.add_subparsers(dest="action", required=True)
    check = actions.add_parser("check", help="validate a params file and print the resolved values")
    check.add_argument("file", nargs="?", default="params.yaml")


SUBCOMMAND = Subcommand("params", "params.yaml tools", _arguments, lambda args: params_check(args.file))
