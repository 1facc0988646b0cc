"""params.yaml is written in the form DVC writes it back: `dvc exp run -S key=value` changes that
key's line and no other (DVC's round trip turns `null` into an empty value, flow lists into block
lists, and drops a comment or blank line after a list it replaces)."""

from __future__ import annotations

import difflib
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml
from background import project_env, run_detached
from dvc.utils.hydra import apply_overrides  # what `dvc exp run -S` writes params files with
from project_copy import DVC, GIT_DVC_INIT

from eagle3.core.params import flatten

REPO = Path(__file__).resolve().parents[1]


def changed_lines(diff: list[str]) -> list[str]:
    """The removed and added lines of a unified diff."""
    return [line for line in diff if line[:1] in "+-" and not line.startswith(("+++", "---"))]


def other_value(value: object) -> object:
    """A value of the key's kind that differs from `value`, as a -S override spells it (a list:
    one more item)."""
    if isinstance(value, list):
        return "[" + ",".join(str(v) for v in [*value, 3]) + "]"
    if value is None:
        return 3
    if isinstance(value, bool):
        return str(not value).lower()
    if isinstance(value, (int, float)):
        return value + 1
    return f"{value}x"


def test_params_yaml_is_a_fixed_point_of_dvcs_writer(tmp_path):
    path = shutil.copy(REPO / "params.yaml", tmp_path / "params.yaml")
    apply_overrides(path, ["vocab.size=8192"])  # the committed value: a round trip only
    assert Path(path).read_text() == (REPO / "params.yaml").read_text()


@pytest.mark.parametrize("key", sorted(flatten(yaml.safe_load((REPO / "params.yaml").read_text()))))
def test_one_override_changes_one_line(tmp_path, key):
    before = (REPO / "params.yaml").read_text()
    value = flatten(yaml.safe_load(before))[key]
    path = shutil.copy(REPO / "params.yaml", tmp_path / "params.yaml")
    apply_overrides(path, [f"{key}={other_value(value)}"])
    after = Path(path).read_text()
    changed = changed_lines(difflib.unified_diff(before.splitlines(), after.splitlines(), lineterm="", n=0))
    if isinstance(value, list):
        assert changed == ["+  - 3"], changed
    else:
        leaf = key.rsplit(".", 1)[1]
        assert [line[:1] for line in changed] == ["-", "+"], changed
        assert [line[1:].split(":")[0].strip() for line in changed] == [leaf, leaf], changed
    assert yaml.safe_load(after) is not None  # still YAML


@pytest.mark.slow
def test_dvc_exp_run_set_param_leaves_a_one_line_diff(tmp_path):
    """The real command, in a git + DVC repo of this params.yaml and one stage reading `vocab`."""
    repo = tmp_path / "repo"
    repo.mkdir()
    shutil.copy(REPO / "params.yaml", repo / "params.yaml")
    (repo / "dvc.yaml").write_text(
        "stages:\n  echo:\n    cmd: python -c \"open('out.txt', 'w').write('ran')\"\n"
        "    params: [vocab]\n    outs: [out.txt]\n"
    )
    env, log = project_env(), tmp_path / "dvc.log"
    for cmd in (
        *GIT_DVC_INIT,
        ["git", "add", "-A"],
        ["git", "commit", "-qm", "params"],
        [*DVC, "exp", "run", "-S", "vocab.size=16384"],
    ):
        done = run_detached(cmd, repo, log, env)
        assert done.returncode == 0, log.read_text()[-3000:]
    diff = subprocess.run(
        ["git", "diff", "--unified=0", "params.yaml"], cwd=repo, capture_output=True, text=True, check=True
    ).stdout
    changed = changed_lines(diff.splitlines())
    assert [line.split(" #")[0].rstrip() for line in changed] == ["-  size: 8192", "+  size: 16384"], diff
    assert changed[0].index("#") == changed[1].index("#")  # the comment stays in its column
