"""A failing stage changes nothing, under real `dvc repro`: a bad param, a missing file,
a dead server, a refusal inside the stage and a SIGKILL while the stage writes its outputs each
leave artifacts/, metrics/ and plots/ byte for byte as they were, and DVC records none of them.
A SIGKILL while the stage swaps its new outputs in is finished by the next run, and `dvc status`
then agrees with the files. The mechanism: every out `persist: true` in dvc.yaml, and
eagle3/core/stage_commit.py (unit tests in tests/test_stage_commit.py)."""

from __future__ import annotations

import hashlib
import json
import shutil
import socket
from pathlib import Path

import fault_harness as faults
import pytest
import torch
import yaml
from background import project_env, run_detached
from project_copy import DVC, GIT_DVC_INIT, copy_code
from tiny_drafters import tiny_drafter_config

from eagle3.core.stage_commit import AREA, journal_path
from eagle3.drafter import Eagle3Drafter, export_drafter

# the session's tiny project may be built in this module's setup (tests/test_faults.py says why)
pytestmark = [pytest.mark.timeout(1800), pytest.mark.slow]

WRITTEN = ("artifacts", "metrics", "plots")
# Fault injection at a point, not a time: a SIGKILL of the vocab-map stage (only: DVC loads this
# too) right after its first write into the staging area ("write"), or after the second of its
# outputs is renamed into place ("swap"). PYTHONPATH puts it in the stage DVC starts.
KILL_HOOK = """
import os, signal, sys
_when, _real, _swapped = os.environ.get("EAGLE3_TEST_KILL"), os.replace, []

def _replace(src, dst, *args, **kwargs):
    _real(src, dst, *args, **kwargs)
    if not sys.argv[0].endswith(os.path.join("stages", "vocab_map.py")):
        return
    staging = os.path.join(".stage-commit", "vocab-map", "new")
    if _when == "write" and staging in str(dst):
        os.kill(os.getpid(), signal.SIGKILL)
    if _when == "swap" and staging in str(src) and staging not in str(dst):
        _swapped.append(dst)
        if len(_swapped) == 2:
            os.kill(os.getpid(), signal.SIGKILL)

if _when:
    os.replace = _replace
"""


def snapshot(repo: Path) -> dict[str, str]:
    """sha256 of every file under artifacts/, metrics/ and plots/ (hidden ones included)."""
    return {
        str(p.relative_to(repo)): hashlib.sha256(p.read_bytes()).hexdigest()
        for top in WRITTEN
        for p in sorted((repo / top).rglob("*"))
        if p.is_file()
    }


def dvc(repo: Path, *args: str, env: dict[str, str] | None = None, log: str = "dvc.log"):
    done = run_detached([*DVC, *args], repo, repo.parent / log, env or project_env(), timeout=600)
    return done.returncode, (repo.parent / log).read_text()


@pytest.fixture(scope="module")
def repo(faults_stages, tmp_path_factory) -> Path:
    """A git + DVC repo of this pipeline and the fixture's tiny params whose commit records the
    fixture's patch-check, extract and vocab-map in dvc.lock (committed as they are, not re-run)."""
    root = tmp_path_factory.mktemp("failed-stages")
    repo = copy_code(root / "repo")
    faults.write_params(repo)
    for rel in ("artifacts/patch-check", faults.EXTRACT, "artifacts/vocab-map", "metrics", "plots"):
        shutil.copytree(faults_stages / rel, repo / rel)
    for cmd in (
        *GIT_DVC_INIT,
        [*DVC, "repro", "dtypes"],
        [*DVC, "commit", "-f", "patch-check", "extract", "vocab-map"],
        ["git", "add", "-A"],
        ["git", "commit", "-qm", "baseline"],
    ):
        done = run_detached(cmd, repo, root / "setup.log", project_env(), timeout=600)
        assert done.returncode == 0, (root / "setup.log").read_text()[-3000:]
    (root / "hook").mkdir()
    (root / "hook" / "sitecustomize.py").write_text(KILL_HOOK)
    return repo


def closed_port() -> int:
    with socket.socket() as s:  # bound, never listening: connections are refused
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def other_targets_drafter(folder: Path) -> str:
    """A drafter exported for a 32-wide target: vocab-map counts the tokens, then refuses it."""
    torch.manual_seed(0)
    export_drafter(Eagle3Drafter(tiny_drafter_config()), folder, dtype=torch.float32)
    return str(folder)


BAD = {
    # class: (stage, params changed, what its one line says)
    "pydantic error": ("vocab-map", {"vocab": {"size": 0}}, "vocab.size: Input should be greater than"),
    "missing file": ("extract", {"data": {"source": "{root}/missing.jsonl"}}, "missing.jsonl"),
    "dead URL": (
        "patch-check",
        {"extract": {"backend": "sglang", "sglang_url": "http://127.0.0.1:{port}"}},
        "127.0.0.1:{port}",
    ),
    "refusal inside the stage": (
        "vocab-map",
        {"train": {"init": "{drafter}"}},
        "was made for another target",
    ),
}


def with_params(repo: Path, changes: dict) -> None:
    params = yaml.safe_load((repo / "params.yaml").read_text())
    for section, values in changes.items():
        params[section].update(values)
    (repo / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))


@pytest.mark.parametrize("case", BAD)
def test_a_failing_stage_leaves_every_output_byte_for_byte(repo, case):
    stage, changes, expected = BAD[case]
    fill = {"root": repo.parent, "port": closed_port()}
    if case == "refusal inside the stage":
        fill["drafter"] = other_targets_drafter(repo.parent / "other-target-drafter")
    changes = {
        section: {k: v.format(**fill) if isinstance(v, str) else v for k, v in values.items()}
        for section, values in changes.items()
    }
    committed = (repo / "params.yaml").read_text()
    before = snapshot(repo)
    try:
        with_params(repo, changes)
        code, log = dvc(repo, "repro", "-s", stage, log=f"{case}.log")
    finally:
        (repo / "params.yaml").write_text(committed)
    assert code != 0, log[-3000:]
    # the stage's one line: params are checked first ("error: invalid params"), then the rest
    failures = [line for line in log.splitlines() if line.startswith((f"{stage} failed:", "error:"))]
    assert len(failures) == 1 and expected.format(**fill) in failures[0], log[-3000:]
    assert snapshot(repo) == before
    assert not (repo / AREA).exists()
    # nothing recorded: with the committed params back, DVC finds the stage as it was
    code, status = dvc(repo, "status", stage, "--json", log=f"{case}-status.log")
    assert code == 0 and json.loads(status.strip().splitlines()[-1]) == {}, status


def test_a_killed_stage_leaves_every_output_and_the_next_run_finishes(repo):
    committed = (repo / "params.yaml").read_text()
    before = snapshot(repo)
    hooked = project_env() | {"PYTHONPATH": str(repo.parent / "hook")}
    try:
        with_params(repo, {"vocab": {"size": 400}})
        # killed after writing part of its new outputs: the old ones stand, all of them
        code, log = dvc(repo, "repro", "-s", "vocab-map", env=hooked | {"EAGLE3_TEST_KILL": "write"})
        assert code != 0 and snapshot(repo) == before, log[-3000:]
        assert not journal_path("vocab-map", repo).exists()  # staged files only, git-ignored

        # killed after two of its three outputs were renamed into place: the journal says so
        code, log = dvc(repo, "repro", "-s", "vocab-map", env=hooked | {"EAGLE3_TEST_KILL": "swap"})
        assert code != 0 and journal_path("vocab-map", repo).exists(), log[-3000:]

        code, log = dvc(repo, "repro", "-s", "vocab-map", log="resumed.log")  # as the user would
        assert code == 0, log[-3000:]
        resumed = snapshot(repo)
        assert not (repo / AREA).exists()
        assert json.loads((repo / "metrics/vocab-map.json").read_text())["draft_vocab_size"] == 400
        code, status = dvc(repo, "status", "vocab-map", "--json", log="resumed-status.log")
        assert code == 0 and json.loads(status.strip().splitlines()[-1]) == {}, status

        # the same bytes as an uninterrupted run of the same params
        assert faults.run(repo, "vocab_map").returncode == 0
        assert snapshot(repo) == resumed
    finally:  # the last test of the module: the outputs stay those of vocab.size 400
        (repo / "params.yaml").write_text(committed)
