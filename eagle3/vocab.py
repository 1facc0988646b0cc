"""Draft vocabulary: the K most frequent target tokens under the loss mask, as d2t / t2d.

Convention (SGLang / EAGLE-3): draft ids are the chosen target ids sorted ascending, and
    target_id = draft_id + d2t[draft_id]        d2t: int64 [K]
    t2d[target_id] = target_id is in the draft vocabulary    t2d: bool [V]
K >= V gives the identity (d2t all zero, t2d all true).

vocab.json records the mapping file's sha256 and the features it was counted from, so a
mapping that is damaged, or copied from another run, is refused by name before training.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from safetensors import SafetensorError
from safetensors.torch import load, save

from eagle3.core.inputs import InputError
from eagle3.core.stageio import write_bytes, write_json

MAPPING = "mapping.safetensors"
META = "vocab.json"


def draft_size(requested: int, vocab_size: int) -> int:
    """The draft vocabulary a `vocab.size` of `requested` gives a target of `vocab_size` tokens:
    a size at or above the target's vocabulary is the whole vocabulary (the identity mapping)."""
    return min(requested, vocab_size)


def draft_to_target_ids(d2t: torch.Tensor) -> torch.Tensor:
    """Target id of every draft slot: target = draft + d2t[draft] (SGLang's d2t convention)."""
    return torch.arange(len(d2t), device=d2t.device) + d2t.long()


def target_to_draft_slots(d2t: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Draft slot of every target id, -1 for ids outside the draft vocabulary (int64 [V])."""
    slots = torch.full((vocab_size,), -1, dtype=torch.long, device=d2t.device)
    slots[draft_to_target_ids(d2t)] = torch.arange(len(d2t), device=d2t.device)
    return slots


@dataclass
class VocabMap:
    d2t: torch.Tensor  # int64 [K]
    t2d: torch.Tensor  # bool [V]
    counts: np.ndarray  # int64 [V], loss-masked occurrences per target token
    distinct_seen: int  # target tokens that occur at all under the mask

    @property
    def draft_size(self) -> int:
        return len(self.d2t)

    @property
    def draft_to_target(self) -> torch.Tensor:
        return draft_to_target_ids(self.d2t)

    @property
    def unseen_filled(self) -> int:
        """Draft slots filled with never-seen tokens (lowest ids first) because K > distinct_seen."""
        return max(0, self.draft_size - self.distinct_seen)

    def coverage(self) -> float:
        total = int(self.counts.sum())
        return float(self.counts[self.draft_to_target.numpy()].sum() / total) if total else 0.0


def count_tokens(input_ids: np.ndarray, loss_mask: np.ndarray, vocab_size: int) -> np.ndarray:
    ids = input_ids[loss_mask.astype(bool)].astype(np.int64)
    if ids.size and (ids.min() < 0 or ids.max() >= vocab_size):
        raise ValueError(
            f"token ids outside the target vocabulary 0..{vocab_size - 1}: features from another model?"
        )
    return np.bincount(ids, minlength=vocab_size)


def frequency_order(counts: np.ndarray) -> np.ndarray:
    """Target ids by descending count, ties broken by ascending id."""
    return np.lexsort((np.arange(len(counts)), -counts))


def build_vocab_map(counts: np.ndarray, size: int) -> VocabMap:
    vocab_size = len(counts)
    k = draft_size(size, vocab_size)
    chosen = np.sort(frequency_order(counts)[:k])
    d2t = torch.from_numpy(chosen - np.arange(k)).to(torch.int64)
    t2d = torch.zeros(vocab_size, dtype=torch.bool)
    t2d[torch.from_numpy(chosen)] = True
    return VocabMap(d2t=d2t, t2d=t2d, counts=counts, distinct_seen=int((counts > 0).sum()))


def adopted_vocab_map(counts: np.ndarray, d2t: torch.Tensor, t2d: torch.Tensor) -> VocabMap:
    """A given mapping (a warm-start drafter's) with this run's counts, for its coverage."""
    if len(t2d) != len(counts):
        raise ValueError(f"t2d covers {len(t2d)} target tokens, the counts {len(counts)}")
    return VocabMap(d2t=d2t.long(), t2d=t2d.bool(), counts=counts, distinct_seen=int((counts > 0).sum()))


def coverage_of(token_ids: list[int], t2d: torch.Tensor) -> float:
    """Fraction of `token_ids` inside the draft vocabulary (t2d [V] bool): on tokens the
    vocabulary was not built from (e.g. the target's benchmark answers), what it really covers."""
    if not token_ids:
        return 0.0
    return float(t2d.cpu()[torch.tensor(token_ids, dtype=torch.long)].float().mean())


def coverage_curve(counts: np.ndarray, sizes: list[int]) -> list[tuple[int, float]]:
    """Coverage at each K of `sizes` (capped at V, V itself added), from one sort of the counts."""
    total = counts.sum()
    cumulative = np.cumsum(np.sort(counts)[::-1])
    grid = sorted({draft_size(k, len(counts)) for k in sizes} | {len(counts)})
    return [(k, float(cumulative[k - 1] / total) if total else 0.0) for k in grid]


def save_vocab_map(vocab: VocabMap, out_dir: Path, meta: dict) -> None:
    data = save({"d2t": vocab.d2t.contiguous(), "t2d": vocab.t2d.contiguous()})
    write_bytes(out_dir / MAPPING, data)
    write_json(out_dir / META, meta | {"mapping_sha256": hashlib.sha256(data).hexdigest()})


def load_mapping(folder: str | Path) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """(d2t int64 [K], t2d bool [V], metadata) of a vocab-map output folder; InputError naming
    the file when it is unreadable or is not the mapping its vocab.json describes."""
    folder = Path(folder)
    path, meta_path = folder / MAPPING, folder / META
    if not path.exists():
        raise FileNotFoundError(f"{folder} holds no {MAPPING}: run the vocab-map stage first")
    rerun = "re-run the vocab-map stage (dvc repro vocab-map)"
    try:
        meta = json.loads(meta_path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as err:
        raise InputError(f"{meta_path} is missing or not valid JSON ({err}); {rerun}") from None
    data = path.read_bytes()
    digest = hashlib.sha256(data).hexdigest()
    if meta.get("mapping_sha256", digest) != digest:  # absent in mappings written before it was recorded
        raise InputError(
            f"{path} is not the mapping {meta_path} describes (damaged, or from another run); {rerun}"
        )
    try:
        tensors = load(data)
        d2t, t2d = tensors["d2t"], tensors["t2d"]
    except (SafetensorError, KeyError) as err:
        raise InputError(f"{path} is not a d2t/t2d mapping ({err}); {rerun}") from None
    if d2t.dtype != torch.int64 or t2d.dtype != torch.bool or d2t.dim() != 1 or t2d.dim() != 1:
        raise InputError(f"{path}: d2t must be int64 [K] and t2d bool [V]; {rerun}")
    return d2t, t2d, meta
