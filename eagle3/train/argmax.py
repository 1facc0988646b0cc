"""The target's greedy next token at every stored position, computed once per feature store.

Training needs, at every position, whether the target's full-vocabulary argmax lies inside the draft
vocabulary. That argmax is a [T, H] x [H, V] product over every stored token (~19 minutes for 4.36M
tokens on a 2-core CPU, docs/results/2026-12-03-0855-4m-drafter-shipped.md), the same for every run
on those features, whatever its learning rate, epochs or vocab.size. So it is kept in the machine
cache (eagle3.core.cache), keyed by the features' manifest, the head's bytes and the machine, and a
later run or a resume reads it back; a pass killed halfway keeps what it wrote (at least once a
minute) and the next run computes only the rest. Each sample is multiplied alone, in fixed row
blocks, so a value never depends on which samples were computed with it: a run from the cache and a
run without one train the same bytes, and under torchrun the ranks split the samples between them.
"""

from __future__ import annotations

import hashlib
import io
import time
from pathlib import Path

import torch
from torch import Tensor

from eagle3.core.cache import cache_root
from eagle3.core.device import machine
from eagle3.core.stageio import write_bytes
from eagle3.data.store import FeatureStore
from eagle3.train.distributed import SINGLE_PROCESS, Dist, all_gather_dict

# Bump when the way the argmax is computed changes: older cache files are then never read.
VERSION = 2  # 2: blocks padded to ROW_MULTIPLE rows
ROWS = 2048  # rows per product: bounds the [rows, V] logits of a long sample
ROW_MULTIPLE = 64
CHUNK = 64  # samples per rank between exchanges (and chances to write the cache)
WRITE_EVERY_S = 60.0  # the cache is rewritten whole, so not after every chunk


def cache_file(features_sha256: str, head: Tensor) -> Path:
    """Where the argmax of these features under this head (its bytes, dtype and device) on this
    machine (CPU or GPU, torch, threads: bf16 products round differently across them) is kept."""
    weights = hashlib.sha256(head.detach().cpu().contiguous().view(torch.uint8).numpy()).hexdigest()
    shape = (str(head.dtype), tuple(head.shape), head.device.type)
    parts = (VERSION, features_sha256, weights, shape, machine())
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
    buffer = io.BytesIO()
    torch.save(kept, buffer)
    write_bytes(path, buffer.getvalue())  # atomic: a reader sees the old file or the whole new one


@torch.no_grad()
def target_argmax(
    store: FeatureStore,
    samples: list[int],
    head: Tensor,
    features_sha256: str | None = None,
    d: Dist = SINGLE_PROCESS,
) -> dict[int, Tensor]:
    """{sample: int32 [T]} the target's argmax at each position, from its last_hidden rows and
    the full lm_head `head` [V, H]. With `features_sha256` (of the store's manifest) the values
    are read from and added to the machine cache. Under torchrun (`d`) each rank reads and
    multiplies every world-th missing sample (at the anchors' scale the last_hidden rows are
    hundreds of GB) and the ranks exchange what they computed."""
    path = cache_file(features_sha256, head) if features_sha256 else None
    kept = _read(path) if path else {}
    missing = [s for s in samples if s not in kept]
    written = time.monotonic()
    # in chunks, the cache written as it grows: a run killed during a pass of hours resumes it
    step = CHUNK * d.world
    for i in range(0, len(missing), step):
        mine = missing[i : i + step][d.rank :: d.world]
        kept.update(all_gather_dict({s: _argmax(store, s, head) for s in mine}, d))
        last = i + step >= len(missing)
        if path and d.main and (last or time.monotonic() - written > WRITE_EVERY_S):
            _write(path, kept)
            written = time.monotonic()
    return {s: kept[s] for s in samples}


def _argmax(store: FeatureStore, s: int, head: Tensor) -> Tensor:
    return argmax_rows(store.sample(s)["last_hidden"], head)


@torch.no_grad()
def argmax_rows(last_hidden: Tensor, head: Tensor) -> Tensor:
    """int32 [T]: the target's argmax from one sample's final-norm rows, in fixed row blocks (a
    value never depends on the samples computed beside it; online training calls it too). Each
    block is zero-padded to a multiple of ROW_MULTIPLE rows: a product per sample length would
    leave oneDNN kernels and [rows, V] logits of every size behind, and memory grew with them."""
    hidden = last_hidden.to(head.device, head.dtype)
    blocks = []
    for i in range(0, len(hidden), ROWS):
        block = hidden[i : i + ROWS]
        rows = len(block)
        block = torch.nn.functional.pad(block, (0, 0, 0, -rows % ROW_MULTIPLE))
        blocks.append((block @ head.T).argmax(-1)[:rows])
    return torch.cat(blocks).to("cpu", torch.int32)
