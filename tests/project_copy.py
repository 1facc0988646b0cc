"""A copy of this project's code in a scratch folder, for tests that run the stages as DVC does.

What to copy is read from dvc.yaml: every top-level folder a stage lists as a dependency (except
artifacts/, which the stages write), so a stage that starts depending on another folder does
not break every test that builds a project (it did once: tools/sglang_cpu)."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
DVC = [sys.executable, "-m", "dvc"]
# What every test git + DVC repo starts with: a committer, and DVC quiet and offline.
GIT_DVC_INIT = (
    ["git", "init", "-q"],
    ["git", "config", "user.email", "ci@example.com"],
    ["git", "config", "user.name", "ci"],
    [*DVC, "init", "-q"],
    [*DVC, "config", "core.analytics", "false"],
)
WRITTEN = {"artifacts", "metrics", "plots"}


def code_folders() -> list[str]:
    stages = yaml.safe_load((REPO / "dvc.yaml").read_text())["stages"]
    tops = {dep.split("/")[0] for stage in stages.values() for dep in stage.get("deps", [])}
    return sorted(name for name in tops - WRITTEN if (REPO / name).is_dir())


def copy_code(project: Path, *, pipeline: bool = True) -> Path:
    """Copy the stages' code into `project`; with `pipeline`, also dvc.yaml and .gitignore."""
    project.mkdir(parents=True, exist_ok=True)
    for name in code_folders():
        shutil.copytree(REPO / name, project / name, ignore=shutil.ignore_patterns("__pycache__"))
    if pipeline:
        for name in ("dvc.yaml", ".gitignore"):
            shutil.copy(REPO / name, project / name)
    return project
