"""End to end on real DVC, real MLflow (sqlite) and the real SmolLM2, at tiny sizes:
stage skipping, experiment tracking (workspace and temp-dir experiments), bad params."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import mlflow
import pytest
import yaml
from background import project_env
from conftest import SHAREGPT_SAMPLE
from project_copy import copy_code
from test_compare import render

from eagle3.sweep.experiments import dvc_experiments

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[1]
TINY = {
    "target": {"dtype": "float32"},
    "data": {"source": str(SHAREGPT_SAMPLE), "num_samples": 6, "max_length": 40},
    "extract": {"shard_samples": 3, "batch_tokens": 128},
    "vocab": {"size": 500},
}


def run(cmd: list[str], cwd: Path, check: bool = True, timeout: float = 900) -> subprocess.CompletedProcess:
    # Captured output is safe only for commands that leave no process behind: `dvc queue start`
    # goes through tests/background.py instead (its daemon would hold these pipes open).
    done = subprocess.run(cmd, cwd=cwd, env=project_env(), capture_output=True, text=True, timeout=timeout)
    if check and done.returncode != 0:
        raise AssertionError(f"{cmd} failed:\n{done.stdout}\n{done.stderr}")
    return done


def dvc(*args: str, cwd: Path, check: bool = True) -> subprocess.CompletedProcess:
    return run([sys.executable, "-m", "dvc", *args], cwd, check)


def write_params(project: Path, overrides: dict) -> None:
    params = yaml.safe_load((REPO / "params.yaml").read_text())
    for section, values in overrides.items():
        params[section].update(values)
    (project / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))


@pytest.fixture(scope="module")
def project(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("project")
    copy_code(root)
    write_params(root, TINY)
    run(["git", "init", "-q"], root)
    run(["git", "config", "user.email", "ci@example.com"], root)
    run(["git", "config", "user.name", "ci"], root)
    dvc("init", "-q", cwd=root)
    dvc("config", "core.analytics", "false", cwd=root)
    run(["git", "add", "-A"], root)
    run(["git", "commit", "-qm", "tiny project"], root)
    dvc("repro", "vocab-map", cwd=root)
    run(["git", "add", "-A"], root)
    run(["git", "commit", "-qm", "baseline"], root)
    return root


def mlflow_runs(project: Path) -> list:
    mlflow.set_tracking_uri(f"sqlite:///{project / 'mlflow.db'}")
    return mlflow.search_runs(search_all_experiments=True, output_format="list")


def test_vocab_experiment_skips_patch_check_and_extract(project):
    shards = {p.name: p.stat().st_mtime_ns for p in (project / "artifacts/extract").glob("shard-*")}
    out = dvc("exp", "run", "vocab-map", "-S", "vocab.size=200", "-n", "small-vocab", cwd=project).stdout
    assert "Stage 'patch-check' didn't change, skipping" in out
    assert "Stage 'extract' didn't change, skipping" in out
    assert "Running stage 'vocab-map'" in out
    assert shards == {p.name: p.stat().st_mtime_ns for p in (project / "artifacts/extract").glob("shard-*")}
    metrics = json.loads((project / "metrics/vocab-map.json").read_text())
    assert metrics["draft_vocab_size"] == 200

    runs = [r for r in mlflow_runs(project) if r.data.tags.get("DVC_EXP_NAME") == "small-vocab"]
    assert len(runs) == 1
    run = runs[0]
    assert run.data.params["vocab.size"] == "200"
    assert 0 < run.data.metrics["coverage"] <= 1
    assert run.data.metrics["num_tokens"] > 0  # extract was skipped, its metrics are still in the run
    assert run.data.tags["DVC_EXP_BASELINE_REV"]
    assert str(project / "mlartifacts") in run.info.artifact_uri

    shown = json.loads(dvc("exp", "show", "--json", cwd=project).stdout)
    assert "small-vocab" in json.dumps(shown) and "coverage" in json.dumps(shown)


def test_a_family_key_that_leaves_the_layers_alone_skips_the_extraction(project):
    # under drafter.kind eagle3, dflash.num_layers names no layer captured: patch-check re-runs on
    # it and writes the same report, the extraction's only say in which layers, so DVC skips it
    out = dvc(
        "exp", "run", "--temp", "extract", "-S", "dflash.num_layers=3", "-n", "dflash-shape", cwd=project
    )
    assert "Running stage 'patch-check'" in out.stdout
    assert "Stage 'extract' didn't change, skipping" in out.stdout


def test_a_key_of_the_other_family_reruns_vocab_map_alone(project, tmp_path):
    # train lists no family key: vocab-map lists them all and records the family's own in
    # vocab.json, train's dep (eagle3/drafter/family.py). Under eagle3 a dflash key re-runs
    # vocab-map to the same bytes, and DVC skips train. In a copy: the baseline has no train run.
    copy = tmp_path / "copy"
    shutil.copytree(project, copy, symlinks=True)
    dvc("repro", "train", cwd=copy)
    mapping = (copy / "artifacts/vocab-map/vocab.json").read_bytes()
    params = yaml.safe_load((copy / "params.yaml").read_text())
    params["dflash"]["loss_decay"] = params["dflash"]["loss_decay"] / 2
    (copy / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    out = dvc("repro", "train", cwd=copy).stdout
    assert "Running stage 'vocab-map'" in out
    assert "Stage 'train' didn't change, skipping" in out
    assert (copy / "artifacts/vocab-map/vocab.json").read_bytes() == mapping
    params["vocab"]["size"] -= 100  # the family's own key: a new mapping, a new drafter
    (copy / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    assert "Running stage 'train'" in dvc("repro", "train", cwd=copy).stdout


def test_temp_dir_experiment_is_tracked_at_the_repo_root(project):
    # --temp runs in a throw-away copy, as queued experiments do; the run must land in the repo's store
    dvc("exp", "run", "--temp", "vocab-map", "-S", "vocab.size=100", "-n", "temp-vocab", cwd=project)
    runs = [r for r in mlflow_runs(project) if r.data.tags.get("DVC_EXP_NAME") == "temp-vocab"]
    assert len(runs) == 1 and runs[0].data.params["vocab.size"] == "100"
    assert "coverage" in runs[0].data.metrics


def test_targeted_experiment_leaves_out_the_metrics_of_stages_it_did_not_run(project):
    # `dvc exp run extract` commits vocab-map.json as the baseline left it: another extraction's
    targeted_run = ["exp", "run", "--temp", "extract", "-S", "data.num_samples=4", "-n", "fewer-samples"]
    exp = dvc(*targeted_run, cwd=project)
    assert "Running stage 'extract'" in exp.stdout and "vocab-map" not in exp.stdout
    rows = {r.name: r for r in dvc_experiments(project)}
    targeted = rows["fewer-samples"]
    baseline = next(r for name, r in rows.items() if name in ("main", "master"))
    assert targeted.stale == ("vocab-map",) and "coverage" not in targeted.metrics
    assert targeted.metrics["num_samples"] == 4  # the stage that ran keeps its figures
    assert baseline.stale == () and 0 < baseline.metrics["coverage"] <= 1
    assert "fewer-samples: vocab-map did not run" in " ".join(render(list(rows.values())).split())


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"vocab": {"size": 0}}, "vocab.size: Input should be greater than or equal to 1 (got 0)"),
        ({"vocab": {"colour": 1}}, "vocab.colour: unknown key"),
        ({"data": {"num_samples": "lots"}}, "data.num_samples: Input should be a valid integer"),
        (
            {"extract": {"aux_layers": [1, 14, 31]}},
            "extract.aux_layers: layer ids [31] are outside the target",
        ),
    ],
)
def test_invalid_params_fail_clearly_and_write_nothing(project, overrides, message):
    before = {p: p.read_bytes() for p in (project / "artifacts").rglob("*") if p.is_file()}
    lock = (project / "dvc.lock").read_bytes()
    write_params(project, TINY | overrides)
    try:
        failed = dvc("repro", "vocab-map", cwd=project, check=False)
    finally:
        write_params(project, TINY)
    assert failed.returncode != 0
    assert message in " ".join((failed.stdout + failed.stderr).split())
    # refused by the first stage, before the dtypes stage measures (a loaded machine may decide
    # another dtype) and before any later stage starts
    assert "Running stage 'patch-check'" not in failed.stdout, failed.stdout
    after = {p: p.read_bytes() for p in (project / "artifacts").rglob("*") if p.is_file()}
    assert after == before and (project / "dvc.lock").read_bytes() == lock
