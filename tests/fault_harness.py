"""bench/faults.py (no package: loaded by path, once) and its tiny project with patch-check,
extract and vocab-map run, which tests/test_faults.py and tests/test_online.py both start from."""

from __future__ import annotations

import importlib.util
import shutil
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _load():
    if "faults" in sys.modules:
        return sys.modules["faults"]
    spec = importlib.util.spec_from_file_location("faults", REPO / "bench" / "faults.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["faults"] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


faults = _load()


def build_stages(root: Path) -> Path:
    """The tiny project (faults.TINY) with patch-check, extract and vocab-map run."""
    project = faults.make_project(root)
    for stage in ("patch_check", "extract", "vocab_map"):
        faults.must_run(project, stage)
    return project


def copy_project(built: Path, root: Path) -> Path:
    """A copy of a built project for a test to change (files and mtimes as they were)."""
    return Path(shutil.copytree(built, root / "project", copy_function=shutil.copy2))
