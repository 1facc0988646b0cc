"""Experiments as rows: what `dvc exp show --json` or the MLflow tracking store holds about
each run of the pipeline, reduced to the params, metrics and measuring machine that
`eagle3 compare` and `eagle3 report` need. Both sources give the same rows."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from eagle3.core.params import flatten
from eagle3.core.pipeline import STAGE_BY_NAME, STAGES
from eagle3.sweep.depth import shape_name

# The facts (not numbers) of where a row was measured, per stage metrics file.
DTYPE_KEYS = {"extract": "dtype", "train": "dtype", "speculative-eval": "dtype"}
DTYPE_LABELS = {"extract": "extract", "train": "train", "speculative-eval": "eval"}
TEXT_METRICS = ("dtype", "drafter_dtype", "machine")
SPEED_DTYPES = ("eval", "drafter")  # the dtypes that set speculative-eval's speeds
UNFINISHED = ("queued", "running", "failed")  # DVC executor states whose metrics are not their own


class ExperimentsError(ValueError):
    """Bad input (no experiments, unknown names, an unreadable source): one line for the user."""


@dataclass(frozen=True)
class Experiment:
    name: str
    params: dict[str, Any]  # flat: "vocab.size" -> 8192
    metrics: dict[str, Any]  # flat, every stage merged: "coverage", "acceptance_length_ci.lo"
    machine: str | None = None  # where speculative-eval measured the speeds
    dtypes: dict[str, str] = field(default_factory=dict)  # extract, train, eval, drafter
    stale: tuple[str, ...] = ()  # stages whose metrics were left out: not re-run for this row

    def number(self, key: str) -> float | None:
        value = self.metrics.get(key)
        return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None

    @property
    def backend(self) -> str:
        """The engine speculative-eval decoded with (eval.backend; runs before it existed: hf)."""
        return str(self.params.get("eval.backend") or "hf")

    @property
    def label(self) -> str:
        """The row's name, with the eval backend when it is not this project's own engine."""
        return self.name if self.backend == "hf" else f"{self.name} [{self.backend}]"

    @property
    def draft_vocab_size(self) -> int | None:
        """The size actually used: vocab.size above the target's vocabulary becomes the full one."""
        size = self.number("draft_vocab_size")
        if size is None:
            size = self.params.get("vocab.size")
        return int(size) if isinstance(size, (int, float)) else None

    @property
    def kind(self) -> str:
        """The drafter family (drafter.kind; runs before it existed: eagle3)."""
        return str(self.params.get("drafter.kind") or "eagle3")

    @property
    def decoded_at(self) -> str | None:
        """The shape speculative-eval drafted at, from the row's params ("tree 5/8/16", "block 8"):
        acceptance compares only at one shape, or as each drafter at its own serving shape."""
        p = self.params
        if self.kind == "dflash":
            size = p.get("dflash.block_size")
            return None if size is None else f"DFlash {shape_name({'mode': 'block', 'block_size': size})}"
        keys = ("mode", "k", "topk", "tree_budget", "lookup_tokens")
        settings = {key: p.get(f"eval.{key}") for key in keys}
        if None in (settings["mode"], settings["k"]) or (
            settings["mode"] == "tree" and None in (settings["topk"], settings["tree_budget"])
        ):
            return None
        return f"EAGLE-3 {shape_name(settings)}"

    @property
    def measured_on(self) -> tuple[str | None, tuple[tuple[str, str], ...]]:
        """Speeds compare only between rows with equal machine and decoding dtypes. The speeds
        compared are speculative-eval's, so extract and train dtypes are left out (a queued
        experiment that skipped extraction has no extract dtype in its MLflow run)."""
        return self.machine, tuple(sorted((k, v) for k, v in self.dtypes.items() if k in SPEED_DTYPES))


# metrics file -> the stage that writes it (speculative-eval writes two)
METRICS_OWNER = {
    out.path.as_posix(): stage.name for stage in STAGES for out in stage.outputs if out.kind == "metrics"
}


def _stage_rows(stage_metrics: dict[str, dict[str, Any]]) -> tuple[dict[str, Any], str | None, dict]:
    """Merge per-stage metrics (pipeline order) into one flat dict, pulling out machine and dtypes."""
    merged: dict[str, Any] = {}
    dtypes: dict[str, str] = {}
    machine = None
    for stage, metrics in stage_metrics.items():
        if stage in DTYPE_KEYS and metrics.get(DTYPE_KEYS[stage]):
            dtypes[DTYPE_LABELS[stage]] = str(metrics[DTYPE_KEYS[stage]])
        if stage == "speculative-eval":
            machine = metrics.get("machine")
            if metrics.get("drafter_dtype"):
                dtypes["drafter"] = str(metrics["drafter_dtype"])
        merged |= {k: v for k, v in flatten(metrics).items() if k not in TEXT_METRICS}
    return merged, machine, dtypes


def stale_stages(lock: dict[str, Any]) -> set[str]:
    """The stages of a dvc.lock whose entry predates an input rebuilt since, directly or through
    another stale stage. A targeted `dvc exp run ... train` re-runs train only and commits the
    workspace's speculative-eval metrics as they were: another drafter's figures."""
    stages = lock.get("stages") or {}
    made_by = {
        out.get("path"): (name, out.get("md5"))
        for name, stage in stages.items()
        for out in stage.get("outs") or []
    }
    stale: set[str] = set()
    grew = True
    while grew:
        grew = False
        for name, stage in stages.items():
            if name in stale:
                continue
            for dep in stage.get("deps") or []:
                maker = made_by.get(dep.get("path"))
                if maker and (maker[0] in stale or maker[1] != dep.get("md5")):
                    stale.add(name)
                    grew = True
                    break
    return stale


FileReader = Callable[[str, str], "str | None"]  # (rev or "workspace", path) -> the file's text


def git_file_reader(repo: str | Path, workspace: bool = True) -> FileReader:
    """A file as committed at a revision of `repo`; the file itself for the workspace, unless the
    rows come from elsewhere (a saved JSON file: its workspace is not this one)."""

    def read(rev: str, path: str) -> str | None:
        if rev == "workspace":
            file = Path(repo) / path
            return file.read_text() if workspace and file.exists() else None
        done = subprocess.run(["git", "show", f"{rev}:{path}"], cwd=repo, capture_output=True, text=True)
        return done.stdout if done.returncode == 0 else None

    return read


def _stage_files(rev: str, shown: dict[str, Any], read: FileReader | None) -> dict[str, dict[str, Any]]:
    """Each metrics file of a row: those DVC showed, and every other stage's from the row's commit
    (dvc.yaml shows only the per-domain headline, SHOWN_METRICS; the rest are plain outputs)."""
    files = {path: c["data"] for path, c in shown.items() if isinstance(c, dict) and c.get("data")}
    for path in METRICS_OWNER:
        if path not in files and read and (text := read(rev, path)):
            try:
                files[path] = json.loads(text)
            except json.JSONDecodeError:
                continue  # a file cut short by a failed run is not a measurement
    return files


def _from_dvc_state(name: str, state: dict[str, Any], read: FileReader | None) -> Experiment | None:
    data = state.get("data") or {}
    rev = state.get("rev") or ""
    # each metrics file under the stage that writes it, in pipeline order: a later stage's keys
    # win, as they did when every file was in dvc.yaml's metrics list
    by_stage: dict[str, dict[str, Any]] = {}
    for path, content in _stage_files(rev, data.get("metrics") or {}, read).items():
        by_stage.setdefault(METRICS_OWNER.get(path, Path(path).stem), {}).update(content)
    order = {name: i for i, name in enumerate(STAGE_BY_NAME)}
    stage_metrics = dict(sorted(by_stage.items(), key=lambda kv: order.get(kv[0], len(order))))
    lock_text = read(rev, "dvc.lock") if read else None
    lock = yaml.safe_load(lock_text) if lock_text else None
    stale = tuple(s for s in stage_metrics if s in stale_stages(lock or {}))
    stage_metrics = {s: m for s, m in stage_metrics.items() if s not in stale}
    if not stage_metrics:
        return None  # queued, running or failed: nothing measured
    params = (data.get("params") or {}).get("params.yaml", {}).get("data") or {}
    metrics, machine, dtypes = _stage_rows(stage_metrics)
    return Experiment(name, flatten(params), metrics, machine, dtypes, stale)


def from_dvc_json(shown: list[dict[str, Any]], read: FileReader | None = None) -> list[Experiment]:
    """Rows of `dvc exp show --json`: each baseline commit, then its experiments (latest rev).
    With `read`, the stage metrics files come from each row's commit, and a stage's metrics are
    left out of a row whose dvc.lock says it is stale."""
    rows: list[Experiment] = []
    for baseline in shown:
        rev = baseline.get("rev") or ""
        name = baseline.get("name") or ("workspace" if rev == "workspace" else rev[:7])
        if row := _from_dvc_state(name, baseline, read):
            rows.append(row)
        for exp in baseline.get("experiments") or []:
            revs = exp.get("revs") or []
            if not revs or (exp.get("executor") or {}).get("state") in UNFINISHED:
                continue  # a running one shows its baseline's metrics until it finishes
            name = exp.get("name") or revs[0].get("name") or (revs[0].get("rev") or "")[:7]
            if row := _from_dvc_state(name, revs[0], read):
                rows.append(row)
    # the workspace usually repeats its baseline or an applied experiment: keep the named row
    named = [(r.params, r.metrics) for r in rows if r.name != "workspace"]
    return [r for r in rows if r.name != "workspace" or (r.params, r.metrics) not in named]


def dvc_experiments(repo: str | Path = ".", all_commits: bool = False) -> list[Experiment]:
    """Run `dvc exp show --json` in `repo` and read its rows."""
    cmd = [sys.executable, "-m", "dvc", "exp", "show", "--json"] + (["--all-commits"] if all_commits else [])
    done = subprocess.run(cmd, cwd=repo, capture_output=True, text=True)
    if done.returncode != 0:
        lines = (done.stderr or done.stdout).strip().splitlines()
        raise ExperimentsError(f"`dvc exp show` failed in {repo}: {lines[-1] if lines else 'no output'}")
    return from_dvc_json(json.loads(done.stdout or "[]"), git_file_reader(repo))


def read_dvc_json(path: str | Path) -> list[Experiment]:
    """Rows of a saved `dvc exp show --json > FILE` (stale stages told apart where the current
    directory's git repository holds the revisions)."""
    try:
        return from_dvc_json(json.loads(Path(path).read_text()), git_file_reader(".", workspace=False))
    except FileNotFoundError as err:
        raise ExperimentsError(f"{path} does not exist") from err
    except (json.JSONDecodeError, AttributeError, TypeError) as err:
        raise ExperimentsError(f"{path} is not the output of `dvc exp show --json` ({err})") from err


def _param_value(text: str) -> Any:
    # MLflow keeps params as strings: str() of YAML scalars (None -> "None"), lists as JSON
    if text == "None":
        return None
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError:
        return text


def mlflow_experiments(uri: str, experiment: str) -> list[Experiment]:
    """One row per MLflow run of `experiment` (oldest first); a DVC experiment re-run keeps its last run."""
    from mlflow.tracking import MlflowClient  # slow import

    client = MlflowClient(tracking_uri=uri)
    found = client.get_experiment_by_name(experiment)
    if found is None:
        raise ExperimentsError(f"no MLflow experiment '{experiment}' in {uri}: run the pipeline first")
    runs = client.search_runs([found.experiment_id], order_by=["attributes.start_time ASC"])
    rows: dict[str, Experiment] = {}
    for run in runs:
        tags = run.data.tags
        dtypes = {
            label: tags[tag]
            for label, tag in (
                ("extract", "extract.dtype"),
                ("train", "train.dtype"),
                ("eval", "eval.dtype"),
                ("drafter", "eval.drafter_dtype"),
            )
            if tags.get(tag)
        }
        params = {k: _param_value(v) for k, v in run.data.params.items()}
        name = run.info.run_name or run.info.run_id[:8]
        rows[name] = Experiment(name, params, dict(run.data.metrics), tags.get("eval.machine"), dtypes)
    return list(rows.values())


def select(experiments: list[Experiment], names: list[str] | None, source: str) -> list[Experiment]:
    """The named experiments (all when none are named); an unknown name or no rows is an error."""
    if not experiments:
        raise ExperimentsError(
            f"no experiments with metrics in {source}: run `dvc repro` or `dvc exp run` first"
        )
    if not names:
        return experiments
    known = {e.name: e for e in experiments}
    unknown = [n for n in names if n not in known]
    if unknown:
        raise ExperimentsError(
            f"unknown experiment{'s' if len(unknown) > 1 else ''} {', '.join(map(repr, unknown))} "
            f"in {source} (known: {', '.join(known)})"
        )
    return [known[n] for n in names]


def load_experiments(
    source: str = "dvc",
    json_file: str | None = None,
    all_commits: bool = False,
    params_file: str = "params.yaml",
) -> tuple[list[Experiment], str]:
    """Rows from `dvc exp show --json` (run here, or a saved FILE) or from the MLflow store that
    params.yaml's tracking section names; also says where they came from, for messages."""
    if json_file:
        return read_dvc_json(json_file), json_file
    if source == "mlflow":
        from eagle3.core.params import load_params
        from eagle3.core.tracking import tracking_uri

        params = load_params(params_file)
        uri = tracking_uri(params)
        return mlflow_experiments(uri, params.tracking.experiment), f"MLflow ({uri})"
    return dvc_experiments(".", all_commits), "`dvc exp show`"
