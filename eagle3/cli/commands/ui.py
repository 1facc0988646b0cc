"""`eagle3 ui`: the MLflow UI on this repo's tracking store, on localhost only, in the foreground."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

from rich.console import Console

from eagle3.cli.subcommand import Subcommand, fail
from eagle3.core.params import Params, ParamsError, load_params
from eagle3.core.tracking import tracking_uri

# The server's background job runner (GenAI judges, trace rollups) starts a pool of processes
# that browsing runs never uses: too much for a 2-core machine that is also training.
UI_ENV = {"MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}


def ui_command(params: Params, port: int = 5000, host: str = "127.0.0.1") -> list[str]:
    """`mlflow server` on the store the stages log to (tracking.uri / MLFLOW_TRACKING_URI / the
    repo's mlflow.db); artifacts are read where the runs recorded them (<repo>/mlartifacts)."""
    return [
        sys.executable, "-m", "mlflow", "server",
        "--backend-store-uri", tracking_uri(params),
        "--host", host,
        "--port", str(port),
        "--workers", "1",
    ]  # fmt: skip


def _arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--port", type=int, default=5000)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--params", default="params.yaml")


def _run(args: argparse.Namespace) -> int:
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
