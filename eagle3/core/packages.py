"""Where an installed data or model package keeps its files."""

from __future__ import annotations

import importlib.util
from pathlib import Path


def package_dir(package: str, missing: str) -> Path:
    """The folder of `package`, found without importing it: the model and data packages'
    __init__ modules pull dependencies we deliberately do not install (llama-cpp, ray).
    `missing` is the error shown when it is not installed (it should say how to install it)."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(missing)
    return Path(next(iter(spec.submodule_search_locations)))
