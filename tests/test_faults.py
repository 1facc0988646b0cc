"""The quick subset of the fault harness (bench/faults.py; the full one kills every stage at 10
seeded points and runs the repo's corruption, queue and bad-input tests): one SIGKILL of
extraction and its resume, an unreachable and a locked MLflow store, and a disk that fills."""

from __future__ import annotations

import importlib.util
import random
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("faults", REPO / "bench" / "faults.py")
faults = importlib.util.module_from_spec(spec)
spec.loader.exec_module(faults)


@pytest.fixture(scope="module")
def project(tmp_path_factory) -> Path:
    root = faults.make_project(tmp_path_factory.mktemp("faults"))
    for stage in ("patch_check", "extract", "vocab_map"):
        faults.must_run(root, stage)
    return root


def survived(tally) -> bool:
    return tally.injected > 0 and tally.survived == tally.injected and tally.lost == 0


def test_killed_extraction_resumes_to_the_same_bytes(project):
    ex = faults.EXTRACT
    tally = faults.killed_and_resumed(project, "extract", [ex], ex, [ex], 1, random.Random(0))
    assert survived(tally), tally.notes


def test_unreachable_or_locked_mlflow_costs_one_line_not_the_outputs(project):
    tally = faults.tracking_unavailable(project)
    assert tally.injected == 2 and survived(tally), tally.notes


def test_full_disk_fails_in_one_line_and_the_rerun_resumes(project):
    tally = faults.disk_full(project, tmpfs=False)
    assert survived(tally), tally.notes
