"""`eagle3 ui`: the MLflow UI on this repo's tracking store, in the foreground."""

from __future__ import annotations

import argparse
import os
import subprocess

from rich.console import Console

from eagle3.cli.subcommand import Subcommand, fail
from eagle3.core.params import ParamsError, load_params


def _arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--port", type=int, default=5000)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--params", default="params.yaml")


def _run(args: argparse.Namespace) -> int:
    from eagle3.cli.ui import UI_ENV, ui_command

    try:
        cmd = ui_command(load_params(args.params), args.port, args.host)
    except ParamsError as err:
        return fail(err, soft_wrap=False)
    Console(stderr=True).print(f"MLflow UI on http://{args.host}:{args.port} ({cmd[5]})", highlight=False)
    try:
        return subprocess.run(cmd, env=os.environ | UI_ENV).returncode
    except KeyboardInterrupt:
        return 0


SUBCOMMAND = Subcommand("ui", "the MLflow UI on this repo's tracking store (localhost)", _arguments, _run)
