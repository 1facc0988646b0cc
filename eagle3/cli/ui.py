"""`eagle3 ui`: the MLflow UI on this repo's tracking store, on localhost only."""

from __future__ import annotations

import sys

from eagle3.core.params import Params
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
