"""MLflow glue: one MLflow run per pipeline run / DVC experiment, shared by all its stages.

DVC runs each stage in its own process, so the stages find their common run by a tag: the
hash of the validated params plus the DVC experiment name and git revision. The embedded
default store is anchored at the repo root taken from DVC_ROOT, because a queued
`dvc exp run` executes in a temporary copy that is deleted afterwards (a relative URI would
lose the run); DVC points DVC_ROOT at the parent repo for those. DVC also sets DVC_EXP_NAME
for every `dvc exp run` (queued or not, dvc/repo/experiments/queue/base.py), which names the run.

`dvc queue start -j N` runs N experiments at once: their stages open the same sqlite store
together, and MLflow's first-time schema migration is not safe against that, so opening the
store and finding/creating the experiment and run happen under a file lock.

Tracking is best-effort: a store that is unreachable or locked costs one warning line, never a
stage's outputs or metrics (those are written whether or not MLflow answers, and the next stage
that reaches the store logs the upstream metrics files again).
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import tempfile
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from pathlib import Path
from typing import Any

from filelock import FileLock
from rich.console import Console
from rich.markup import escape

from eagle3.core.params import Params, flatten
from eagle3.core.pipeline import STAGES_WITH_METRICS, metrics_path
from eagle3.core.stageio import read_json

RUN_KEY_TAG = "eagle3.run_key"
# MLflow retries a dead server for minutes by default (7 retries, backoff factor 2); a stage
# should give up in seconds and keep its outputs. A user's own settings win.
HTTP_RETRY_DEFAULTS = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "2", "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "1"}
STORE_LOCK_TIMEOUT_S = 600

_console = Console(stderr=True)


def warn_tracking_failed(uri: str, err: BaseException) -> None:
    """One line, not a traceback: what failed and that nothing of the stage was lost."""
    reason = (str(err).strip().splitlines() or [""])[0][:200]
    _console.print(
        f"[yellow]warning:[/] MLflow tracking at {escape(uri)} failed ({type(err).__name__}: "
        f"{escape(reason)}); this stage's outputs and metrics are written, only the MLflow run misses them",
        soft_wrap=True,
    )


def repo_root() -> Path:
    return Path(os.environ.get("DVC_ROOT") or Path.cwd()).resolve()


def tracking_uri(params: Params) -> str:
    if os.environ.get("MLFLOW_TRACKING_URI"):
        return os.environ["MLFLOW_TRACKING_URI"]
    if params.tracking.uri:
        return params.tracking.uri
    return f"sqlite:///{repo_root() / 'mlflow.db'}"


def store_lock(uri: str) -> AbstractContextManager[Any]:
    """A lock across processes for a local sqlite store (a server serializes on its own).
    It lives in the temp dir, keyed by the database path, to leave the repo clean."""
    if not uri.startswith("sqlite:///"):
        return nullcontext()
    key = hashlib.sha256(uri.removeprefix("sqlite:///").encode()).hexdigest()[:16]
    return FileLock(Path(tempfile.gettempdir()) / f"eagle3-mlflow-{key}.lock", timeout=STORE_LOCK_TIMEOUT_S)


def git_revision(cwd: Path | None = None) -> str:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=cwd, capture_output=True, text=True, check=True
        )
        return out.stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def run_tags() -> dict[str, str]:
    tags = {"git_revision": os.environ.get("DVC_EXP_BASELINE_REV") or git_revision()}
    for var in ("DVC_EXP_NAME", "DVC_EXP_BASELINE_REV"):
        if os.environ.get(var):
            tags[var] = os.environ[var]
    return tags


def run_key(params: Params) -> str:
    tags = run_tags()
    material = json.dumps(
        {"params": params.flat(), "exp": tags.get("DVC_EXP_NAME", ""), "rev": tags["git_revision"]},
        sort_keys=True,
        default=str,
    )
    return hashlib.sha256(material.encode()).hexdigest()[:16]


def numeric_metrics(metrics: dict[str, Any]) -> dict[str, float]:
    """Flatten nested metrics into MLflow's {name: float}; non-numbers and NaN are dropped."""
    return {
        name: float(value)
        for name, value in flatten(metrics).items()
        if isinstance(value, (bool, int, float)) and value == value
    }


class StageRun:
    """What a stage may log; a no-op when tracking is disabled or once the store has failed
    (warned about once: a long training run keeps going without its MLflow run)."""

    def __init__(self, mlflow_module: Any | None, run_id: str | None, uri: str = ""):
        self._mlflow = mlflow_module
        self.run_id = run_id
        self._uri = uri

    def _call(self, method: str, *args: Any, **kwargs: Any) -> None:
        if self._mlflow is None:
            return
        try:
            getattr(self._mlflow, method)(*args, **kwargs)
        except Exception as err:  # noqa: BLE001 - any store failure: warn once, stop tracking
            warn_tracking_failed(self._uri, err)
            self._mlflow = None

    def log_metrics(self, metrics: dict[str, Any], step: int | None = None) -> None:
        flat = numeric_metrics(metrics)
        if flat:
            self._call("log_metrics", flat, step=step)

    def set_tags(self, tags: dict[str, Any]) -> None:
        """Text facts of the run (machine, resolved dtypes): MLflow metrics are numbers only."""
        if tags:
            self._call("set_tags", {k: str(v) for k, v in tags.items()})

    def log_artifact(self, path: str | Path, artifact_path: str | None = None) -> None:
        if Path(path).exists():
            self._call("log_artifact", str(path), artifact_path=artifact_path)

    def end(self, status: str = "FINISHED") -> None:
        self._call("end_run", status)


def _experiment_id(mlflow: Any, name: str) -> str:
    experiment = mlflow.get_experiment_by_name(name)
    if experiment is not None:
        return experiment.experiment_id
    artifacts = (repo_root() / "mlartifacts").as_uri()
    try:
        return mlflow.create_experiment(name, artifact_location=artifacts)
    except mlflow.exceptions.MlflowException:
        # another process (on a shared server) created it first
        return mlflow.get_experiment_by_name(name).experiment_id


def _find_or_create_run(mlflow: Any, experiment_id: str, key: str, params: Params) -> str:
    found = mlflow.search_runs(
        experiment_ids=[experiment_id],
        filter_string=f"tags.`{RUN_KEY_TAG}` = '{key}'",
        output_format="list",
        max_results=1,
    )
    if found:
        return found[0].info.run_id
    tags = run_tags() | {RUN_KEY_TAG: key}
    name = tags.get("DVC_EXP_NAME") or f"repro-{key[:8]}"
    run = mlflow.start_run(experiment_id=experiment_id, run_name=name, tags=tags)
    mlflow.log_params({k: json.dumps(v) if isinstance(v, list) else v for k, v in params.flat().items()})
    mlflow.end_run()
    return run.info.run_id


@contextmanager
def pipeline_run(params: Params, stage: str) -> Iterator[StageRun]:
    """The MLflow run of this pipeline run, opened for `stage`.

    On entry, the metrics files of the stages upstream of `stage` are logged too: DVC may
    have skipped those stages, and the run must still show the whole pipeline's numbers.
    """
    if not params.tracking.enabled:
        yield StageRun(None, None)
        return
    for name, value in HTTP_RETRY_DEFAULTS.items():
        os.environ.setdefault(name, value)
    import mlflow  # slow import, only when tracking is on

    uri = tracking_uri(params)
    try:
        mlflow.set_tracking_uri(uri)
        with store_lock(uri):
            experiment_id = _experiment_id(mlflow, params.tracking.experiment)
            run_id = _find_or_create_run(mlflow, experiment_id, run_key(params), params)
        mlflow.start_run(run_id=run_id)
    except Exception as err:  # noqa: BLE001 - unreachable, locked, broken: the stage goes on
        warn_tracking_failed(uri, err)
        yield StageRun(None, None)
        return
    run = StageRun(mlflow, run_id, uri)
    run.set_tags({f"eagle3.stage.{stage}": "ran"})
    for upstream in STAGES_WITH_METRICS[: STAGES_WITH_METRICS.index(stage)]:
        path = metrics_path(upstream)
        if path.exists():
            run.log_metrics(read_json(path))
    try:
        yield run
    except BaseException:
        run.end("FAILED")
        raise
    run.end()
