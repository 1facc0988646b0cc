"""The `eagle3` command: params validation and a look at what the pipeline produced."""

from __future__ import annotations

import argparse
import sys

from rich.console import Console
from rich.syntax import Syntax

from eagle3.params import ParamsError, load_params


def params_check(path: str) -> int:
    import yaml

    console = Console()
    try:
        params = load_params(path)
    except ParamsError as err:
        Console(stderr=True).print(f"[bold red]error:[/] {err}", highlight=False)
        return 2
    console.print(f"[green]{path} is valid[/]; resolved params:")
    console.print(Syntax(yaml.safe_dump(params.model_dump(), sort_keys=False), "yaml"))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="eagle3", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    params_cmd = commands.add_parser("params", help="params.yaml tools")
    params_sub = params_cmd.add_subparsers(dest="action", required=True)
    check = params_sub.add_parser("check", help="validate a params file and print the resolved values")
    check.add_argument("file", nargs="?", default="params.yaml")
    args = parser.parse_args(argv)
    if args.command == "params" and args.action == "check":
        return params_check(args.file)
    parser.error("unknown command")
    return 2


if __name__ == "__main__":
    sys.exit(main())
