"""Where eagle3 keeps what it computes once per machine (converted targets, dtype decisions):
~/.cache/eagle3, or $EAGLE3_CACHE."""

from __future__ import annotations

import os
from pathlib import Path


def cache_root() -> Path:
    return Path(os.environ.get("EAGLE3_CACHE", Path.home() / ".cache" / "eagle3"))
