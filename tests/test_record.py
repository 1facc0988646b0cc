"""The committed record is of the code beside it: in a clean clone of the commit, `dvc status`
finds no stage whose code or params changed since dvc.lock was written. Only what a clone cannot
have may differ: outputs not in its DVC cache, dependencies that are other stages' outputs, and
the dtypes stage, which DVC runs every time. A change that touches a stage's deps re-runs the
default `dvc repro` and commits dvc.lock, metrics/ and plots/ with it (CONTRIBUTING.md)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from background import project_env

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[1]
OUTPUTS = "artifacts/"  # every stage's outs (git-ignored): a clone has none of them


def stale_entries(status: dict) -> list[str]:
    """'stage: what changed' for every code or params dep that differs from dvc.lock."""
    stale = []
    for stage, entries in status.items():
        for entry in entries:
            if not isinstance(entry, dict):
                continue  # "always changed"
            for dep, change in entry.get("changed deps", {}).items():
                if dep == "params.yaml" or isinstance(change, dict):
                    stale += [f"{stage}: param {key} {how}" for key, how in change.items()]
                elif not dep.startswith(OUTPUTS):
                    stale.append(f"{stage}: {dep} {change}")
    return stale


def test_the_stale_check_names_stage_and_file():
    status = {
        "train": [
            {"changed deps": {"eagle3/train": "modified", "artifacts/extract": "deleted"}},
            {"changed outs": {"artifacts/train/drafter": "not in cache"}},
        ],
        "speculative-eval": [{"changed deps": {"params.yaml": {"eval.drafter_dtype": "modified"}}}],
        "dtypes": ["always changed"],
    }
    assert stale_entries(status) == [
        "train: eagle3/train modified",
        "speculative-eval: param eval.drafter_dtype modified",
    ]


def test_dvc_lock_is_the_record_of_the_committed_code(tmp_path):
    clone = tmp_path / "clone"
    subprocess.run(["git", "clone", "-q", str(REPO), str(clone)], check=True, timeout=300)
    done = subprocess.run(
        [sys.executable, "-m", "dvc", "status", "--json"],
        cwd=clone,
        env=project_env(),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr
    stale = stale_entries(json.loads(done.stdout or "{}"))
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=clone, capture_output=True, text=True)
    assert not stale, (
        f"dvc.lock at {head.stdout.strip()} is not the record of the code beside it (re-run the default "
        "`dvc repro` and commit dvc.lock, metrics/ and plots/):\n  " + "\n  ".join(stale)
    )
