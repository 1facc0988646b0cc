"""Training checkpoints: save and load the whole training state, safely.

A checkpoint holds the trainable weights, optimizer, scheduler, RNG states, the data position
(epoch, batch) and the history so far, so a resumed run replays exactly what the uninterrupted
one did. It holds only tensors and plain Python values (the numpy RNG state is stored as a
tensor), so it loads with `torch.load(weights_only=True)`: no pickled code runs from disk.
It carries the sha256 of its content; a damaged checkpoint, or one of other params, inputs or
training code, is reported by name and not resumed (the run starts afresh and overwrites it).
"""

from __future__ import annotations

import hashlib
import io
import random
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from eagle3.core.stageio import write_bytes
from eagle3.drafter.model import Eagle3Drafter

CHECKPOINT = "last.pt"


def trainable_state(drafter: Eagle3Drafter) -> dict[str, Tensor]:
    """The drafter's state without the frozen target embedding (the target has it)."""
    return {k: v for k, v in drafter.state_dict().items() if not k.startswith("embed_tokens.")}


def rng_state() -> dict:
    """torch, python, numpy (and CUDA) RNG states, as weights_only-loadable values."""
    # numpy's state as (name, keys as an int64 tensor, pos, has_gauss, gauss): weights_only
    # loading refuses numpy arrays
    name, keys, pos, has_gauss, gauss = np.random.get_state()
    numpy_state = (name, torch.from_numpy(keys.astype(np.int64)), pos, has_gauss, gauss)
    state = {"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": numpy_state}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    name, keys, pos, has_gauss, gauss = state["numpy"]
    np.random.set_state((name, keys.numpy().astype(np.uint32), pos, has_gauss, gauss))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def digest(state: object) -> str:
    """sha256 of a checkpoint's content: tensors by dtype, shape and bytes, containers in order
    (dicts by key), everything else by repr (exact for ints, floats, strings, None)."""
    h = hashlib.sha256()

    def feed(obj: object) -> None:
        if isinstance(obj, Tensor):
            t = obj.detach().cpu().contiguous()
            h.update(f"T{t.dtype}{tuple(t.shape)}".encode())
            h.update(t.reshape(-1).view(torch.uint8).numpy())  # no copy: the buffer itself
        elif isinstance(obj, dict):
            h.update(b"{")
            for key in sorted(obj, key=repr):
                h.update(repr(key).encode())
                feed(obj[key])
            h.update(b"}")
        elif isinstance(obj, (list, tuple)):
            h.update(b"[" if isinstance(obj, list) else b"(")
            for item in obj:
                feed(item)
            h.update(b"]")
        else:
            h.update(repr(obj).encode())

    feed(state)
    return h.hexdigest()


def write_checkpoint(path: Path, state: dict) -> None:
    """Write `state` with its sha256, atomically (an interruption leaves the last one intact)."""
    buffer = io.BytesIO()
    torch.save(state | {"sha256": digest(state)}, buffer)
    write_bytes(path, buffer.getvalue())


def read_checkpoint(path: Path, run_key: str) -> tuple[dict | None, str]:
    """(the checkpoint's state, "") when `path` is an intact checkpoint of this run, else
    (None, why not): absent, unreadable or damaged, or written for other params, inputs or training code."""
    if not path.exists():
        return None, ""
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:  # noqa: BLE001 - truncated zip, refused pickle, ...: all mean damaged
        why = f"{type(err).__name__}; or written before checkpoints were weights-only"
        return None, f"{path} is damaged ({why}); starting afresh"
    content = {k: v for k, v in state.items() if k != "sha256"} if isinstance(state, dict) else None
    if content is None or state.get("sha256") != digest(content):
        return None, f"{path} is damaged (its content differs from its sha256); starting afresh"
    if state["key"] != run_key:
        why = "was written for other params, inputs or training code"
        return None, f"{path} {why}; not resumed, starting afresh"
    return state, ""
