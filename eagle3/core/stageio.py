"""Small, deterministic file writers shared by the stages.

Outputs must be byte-identical for the same params and inputs (so DVC never invalidates a
descendant for nothing), and must never be left half-written: everything goes through a
temporary file that is renamed into place.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import tempfile
from pathlib import Path
from typing import Any


def _clean(value: Any) -> Any:
    # JSON has no NaN/inf; None keeps the file valid and readable by `dvc exp show`.
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {str(k): _clean(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_clean(v) for v in value]
    return value


def write_bytes(path: str | Path, data: bytes) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.chmod(tmp, 0o644)  # mkstemp makes 0600; outputs are meant to be shared
        os.replace(tmp, path)
    except BaseException as err:
        Path(tmp).unlink(missing_ok=True)  # a full disk leaves no half-written temp file behind
        if isinstance(err, OSError) and err.filename is None:  # a failed write() names no file
            raise OSError(err.errno, err.strerror, str(path)) from err
        raise


def sha256_file(path: str | Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def sha256_files(files: list[Path]) -> str:
    """One digest of several files: each name and its sha256, in name order."""
    digest = hashlib.sha256()
    for path in sorted(files, key=lambda p: p.name):
        digest.update(path.name.encode())
        digest.update(sha256_file(path).encode())
    return digest.hexdigest()


def code_sha256(package: Path, parts: tuple[str, ...]) -> str:
    """One digest of a package's .py files under these folders (or these files), by their paths
    in the package and their bytes: what keys resumable work to the code that computed it."""
    paths = [package / part for part in parts]
    files = sorted(f for path in paths for f in (path.rglob("*.py") if path.is_dir() else [path]))
    return sha256_json({str(f.relative_to(package)): sha256_file(f) for f in files})


def sha256_json(obj: Any) -> str:
    """Digest of a JSON-able value, independent of key order (config and run keys)."""
    return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()


def write_json(path: str | Path, obj: Any) -> None:
    """Deterministic JSON (sorted keys, fixed indent), written atomically."""
    text = json.dumps(_clean(obj), indent=2, sort_keys=True) + "\n"
    write_bytes(path, text.encode())


def write_csv(path: str | Path, header: list[str], rows: list[list[Any]]) -> None:
    lines = [",".join(header)] + [",".join(_fmt(v) for v in row) for row in rows]
    write_bytes(path, ("\n".join(lines) + "\n").encode())


def _fmt(value: Any) -> str:
    return f"{value:.6g}" if isinstance(value, float) else str(value)


def read_json(path: str | Path) -> Any:
    return json.loads(Path(path).read_text())
