"""The target's greedy next token at every stored position, computed once per feature store.

Training needs, at every position, whether the target's full-vocabulary argmax lies inside the
draft vocabulary. That argmax is a [T, H] x [H, V] product over every stored token: 19 minutes
for 4.36M tokens on a 2-core CPU (docs/results.md, 2026-12-03 10:00), the same for every run on
those features, whatever its learning rate, epochs or vocab.size. So it is kept in the machine
cache (eagle3.core.cache), keyed by the features' manifest and everything the product depends
on, and a later run reads it back. Each sample is multiplied alone, so a value never depends on
which samples were computed with it: a run from the cache and a run without one train the same
bytes.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import torch
from torch import Tensor

from eagle3.core.cache import cache_root
from eagle3.data.store import FeatureStore


def cache_file(features_sha256: str, head: Tensor) -> Path:
    """Where the argmax of these features under this head (dtype, shape, threads) is kept."""
    parts = (
        features_sha256,
        str(head.dtype),
        str(tuple(head.shape)),
        torch.__version__,
        torch.get_num_threads(),
    )
    key = hashlib.sha256(repr(parts).encode()).hexdigest()[:24]
    return cache_root() / "target-argmax" / f"{key}.pt"


def _read(path: Path) -> dict[int, Tensor]:
    if not path.exists():
        return {}
    try:
        kept = torch.load(path, weights_only=True)
    except Exception:  # a damaged cache file costs a recomputation, never a wrong value
        return {}
    return kept if isinstance(kept, dict) else {}


def _write(path: Path, kept: dict[int, Tensor]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_suffix(f".{os.getpid()}.partial")
    torch.save(kept, partial)
    partial.replace(path)  # atomic: a reader sees the old file or the whole new one


@torch.no_grad()
def target_argmax(
    store: FeatureStore, samples: list[int], head: Tensor, features_sha256: str | None = None
) -> dict[int, Tensor]:
    """{sample: int32 [T]} the target's argmax at each position, from its last_hidden rows and
    the full lm_head `head` [V, H]. With `features_sha256` (of the store's manifest) the values
    are read from and added to the machine cache."""
    path = cache_file(features_sha256, head) if features_sha256 else None
    kept = _read(path) if path else {}
    missing = [s for s in samples if s not in kept]
    for s in missing:
        hidden = store.sample(s)["last_hidden"].to(head.device, head.dtype)
        kept[s] = (hidden @ head.T).argmax(-1).to("cpu", torch.int32)
    if path and missing:
        _write(path, kept)
    return {s: kept[s] for s in samples}
