"""The `eagle3` command: params validation and a look at what the pipeline produced."""

from __future__ import annotations

import argparse

from eagle3.cli.commands import compare, dtypes, params, pipeline, plan, preset, report, serve, ship, ui
from eagle3.cli.subcommand import Subcommand

# Every subcommand, in the order `eagle3 --help` lists them; each file holds its arguments and run.
SUBCOMMANDS: tuple[Subcommand, ...] = tuple(
    module.SUBCOMMAND for module in (params, pipeline, preset, ship, serve, compare, report, plan, dtypes, ui)
)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="eagle3", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    for sub in SUBCOMMANDS:
        sub.arguments(commands.add_parser(sub.name, help=sub.help))
    args = parser.parse_args(argv)
    return next(sub for sub in SUBCOMMANDS if sub.name == args.command).run(args)
