"""`eagle3 pipeline write|check`: the derived files (dvc.yaml, params.yaml) from their declarations.

write: each derived file that is not current is written again (after a merge, or a change to a
stage, a param or a stage's imports). check: exit 2 with one line per problem when a file is not
current or a declaration is wrong; what tests/test_pipeline.py runs.
"""

from __future__ import annotations

import argparse

from rich.console import Console

from eagle3.cli.subcommand import Subcommand, fail


def _run(args: argparse.Namespace) -> int:
    from eagle3.derived.files import SOURCES, DeclarationError, check, write

    if args.action == "check":
        if found := check():
            for line in found:
                fail(line, markup=False)
            return 2
        Console().print(f"{', '.join(SOURCES)} are current", highlight=False)
        return 0
    try:
        written = write()
    except DeclarationError as err:
        for line in err.problems:
            fail(line, markup=False)
        return 2
    Console().print(f"wrote {', '.join(written)}" if written else f"{', '.join(SOURCES)} were current")
    return 0


def _arguments(parser: argparse.ArgumentParser) -> None:
    actions = parser.add_subparsers(dest="action", required=True)
    actions.add_parser("write", help="write dvc.yaml and params.yaml from their declarations")
    actions.add_parser("check", help="fail unless dvc.yaml and params.yaml are what their declarations give")


SUBCOMMAND = Subcommand("pipeline", "dvc.yaml and params.yaml from their declarations", _arguments, _run)
