"""eagle3/core/stage_commit.py: a stage's outputs are replaced all together when it succeeds and
not at all when it fails or is killed; a kill during the swap is finished by the next run.
tests/test_failed_stages.py runs the real stages under real `dvc repro`."""

from __future__ import annotations

import hashlib
import signal
import subprocess
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path

import pytest

from eagle3.core.stage_commit import AREA, STAGE_OUTPUTS, StagedOutputs, journal_path, staged_outputs

TRAIN = STAGE_OUTPUTS["train"]  # a folder and four files


def tree(root: Path) -> dict[str, str]:
    """sha256 of every file under root (hidden ones included), by relative path."""
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


def write_outputs(place: Callable[[str], Path], version: str, skip: tuple[str, ...] = ()) -> None:
    """The train stage's outputs, `version` in each, at `place(output)` (the project's or staged)."""
    for out in TRAIN:
        if out in skip:
            continue
        path = place(out)
        if out == "artifacts/train/drafter":
            path.mkdir(parents=True, exist_ok=True)
            (path / "config.json").write_text(f"{version} config")
            (path / f"{version}.safetensors").write_text(f"{version} weights")
        else:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(f"{version} {out}")


def test_success_replaces_every_output_and_failure_none(tmp_path):
    write_outputs(tmp_path.joinpath, "old")
    old = tree(tmp_path)
    with pytest.raises(RuntimeError, match="refused"), staged_outputs("train", tmp_path) as staged:
        write_outputs(staged.path, "new", skip=TRAIN[2:])
        raise RuntimeError("refused after writing part of the new outputs")
    assert tree(tmp_path) == old and not (tmp_path / AREA).exists()

    with staged_outputs("train", tmp_path) as staged:
        write_outputs(staged.path, "new", skip=("plots/sim_acceptance.csv",))
    assert sorted(tree(tmp_path)) == [
        "artifacts/train/drafter/config.json",
        "artifacts/train/drafter/new.safetensors",  # the old folder's files went with it
        "metrics/train.json",
        "plots/train_acc_by_position.csv",
        "plots/train_curve.csv",
    ]  # an output this run did not write is removed, as DVC would have before running it
    assert (tmp_path / "metrics/train.json").read_text() == "new metrics/train.json"
    assert not (tmp_path / AREA).exists()


def test_only_the_stages_outputs_can_be_staged(tmp_path):
    staged = StagedOutputs("vocab-map", tmp_path)
    with pytest.raises(ValueError, match="metrics/train.json is not an output of stage vocab-map"):
        staged.path("metrics/train.json")
    assert staged.path("plots") == tmp_path / AREA / "vocab-map/new/plots"  # a folder of outputs


KILLER = textwrap.dedent(
    """
    import os, signal, sys
    from pathlib import Path
    from eagle3.core.stage_commit import staged_outputs

    root, when = Path(sys.argv[1]), sys.argv[2]
    real_replace, swaps = os.replace, []

    def replace(src, dst):  # SIGKILL at a chosen rename: the fault, at a point and not a time
        real_replace(src, dst)
        if when == "swap" and "/new/" in str(src):
            swaps.append(dst)
            if len(swaps) == 2:
                os.kill(os.getpid(), signal.SIGKILL)

    os.replace = replace
    with staged_outputs("train", root) as staged:
        sys.path.insert(0, sys.argv[3])
        from test_stage_commit import write_outputs

        write_outputs(staged.path, "new", skip=("plots/train_curve.csv",) if when == "write" else ())
        if when == "write":  # part of the new outputs written, not all
            os.kill(os.getpid(), signal.SIGKILL)
    """
)


def killed(root: Path, when: str) -> None:
    done = subprocess.run([sys.executable, "-c", KILLER, str(root), when, str(Path(__file__).parent)])
    assert done.returncode == -signal.SIGKILL


def test_killed_while_writing_leaves_every_output_as_it_was(tmp_path):
    write_outputs(tmp_path.joinpath, "old")
    old = tree(tmp_path)
    killed(tmp_path, "write")
    outputs = {k: v for k, v in tree(tmp_path).items() if not k.startswith(AREA)}
    assert outputs == old  # staged files only, in the git-ignored staging area
    assert StagedOutputs("train", tmp_path).recover() is False  # the next run: nothing to finish
    assert tree(tmp_path) == old and not (tmp_path / AREA).exists()


def test_killed_while_swapping_is_finished_by_the_next_run(tmp_path):
    write_outputs(tmp_path.joinpath, "old")
    killed(tmp_path, "swap")
    assert journal_path("train", tmp_path).exists()
    assert StagedOutputs("train", tmp_path).recover() is True
    expected = tmp_path.parent / "expected"
    write_outputs(expected.joinpath, "new")
    assert tree(tmp_path) == tree(expected) and not (tmp_path / AREA).exists()


def test_a_top_folder_on_another_filesystem_stages_inside_it(tmp_path):
    """artifacts/ a mount elsewhere: renames cannot cross devices, so its staging is inside it.
    Shown with a symlink to /dev/shm (tmpfs) where that is another device than tmp_path."""
    shm = Path("/dev/shm")
    if not shm.is_dir() or shm.stat().st_dev == tmp_path.stat().st_dev:
        pytest.skip("no tmpfs at /dev/shm on another device than the test's folder")
    elsewhere = Path(subprocess.check_output(["mktemp", "-d", "-p", str(shm)], text=True).strip())
    try:
        (tmp_path / "artifacts").symlink_to(elsewhere)
        write_outputs(tmp_path.joinpath, "old")
        with staged_outputs("train", tmp_path) as staged:
            assert staged.path("artifacts/train/drafter").is_relative_to(tmp_path / "artifacts")
            assert staged.path("metrics/train.json").is_relative_to(tmp_path / AREA)
            write_outputs(staged.path, "new")
        assert (tmp_path / "artifacts/train/drafter/config.json").read_text() == "new config"
        assert sorted(p.name for p in elsewhere.iterdir()) == ["train"]
    finally:
        subprocess.run(["rm", "-rf", str(elsewhere)], check=True)
