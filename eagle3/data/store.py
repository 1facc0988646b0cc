"""The feature store: sharded safetensors of hidden states, a manifest, and a token file.

Layout of `artifacts/extract/`:
  shard-00000.safetensors  per-token rows of `shard_samples` samples, concatenated:
                           input_ids int32 [N], loss_mask uint8 [N], aux_hidden bf16 [N, 3H],
                           last_hidden bf16 [N, H], offsets int64 [S + 1] (sample i = rows
                           offsets[i]:offsets[i+1])
  tokens.safetensors       input_ids, loss_mask and offsets of all samples, so vocab-map
                           never reads hidden states
  manifest.json            schema version, target fingerprint, aux layer ids, dtype, and per
                           shard: samples, tokens, sha256
  journal.json             only while extraction is incomplete: the shards finished so far

A shard file appears only once complete (written to a temporary name, then renamed), and its
sha256 is recorded, so a truncated or corrupted shard is always detected.
"""

from __future__ import annotations

import bisect
import json
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save as save_tensors

from eagle3.stageio import read_json, write_bytes, write_json
from eagle3.target.load import sha256_file

SCHEMA_VERSION = 1
MANIFEST = "manifest.json"
JOURNAL = "journal.json"
TOKENS = "tokens.safetensors"
FEATURE_KEYS = ("input_ids", "loss_mask", "aux_hidden", "last_hidden")


class CorruptStoreError(RuntimeError):
    pass


def shard_name(index: int) -> str:
    return f"shard-{index:05d}.safetensors"


@dataclass
class Sample:
    input_ids: torch.Tensor  # int32 [T]
    loss_mask: torch.Tensor  # uint8 [T]
    aux_hidden: torch.Tensor  # bf16 [T, 3H]
    last_hidden: torch.Tensor  # bf16 [T, H]


def pack(samples: list[Sample]) -> dict[str, torch.Tensor]:
    lengths = torch.tensor([0] + [len(s.input_ids) for s in samples], dtype=torch.int64)
    packed = {key: torch.cat([getattr(s, key) for s in samples]).contiguous() for key in FEATURE_KEYS}
    packed["offsets"] = torch.cumsum(lengths, 0)
    return packed


def write_shard(folder: Path, index: int, samples: list[Sample]) -> dict:
    """Write one complete shard atomically and return its manifest entry."""
    path = folder / shard_name(index)
    write_bytes(path, save_tensors(pack(samples)))
    return {
        "file": path.name,
        "samples": len(samples),
        "tokens": sum(len(s.input_ids) for s in samples),
        "sha256": sha256_file(path),
    }


def write_tokens(
    folder: Path, input_ids: torch.Tensor, loss_mask: torch.Tensor, offsets: torch.Tensor
) -> None:
    tensors = {"input_ids": input_ids.contiguous(), "loss_mask": loss_mask.contiguous(), "offsets": offsets}
    write_bytes(folder / TOKENS, save_tensors(tensors))


def read_journal(folder: Path, config_hash: str) -> list[dict]:
    """Finished shards of an interrupted run with the same config; [] when starting afresh."""
    path = folder / JOURNAL
    if not path.exists():
        return []
    journal = read_json(path)
    if journal.get("config_hash") != config_hash:
        return []
    done = []
    for entry in journal["shards"]:
        shard = folder / entry["file"]
        if not shard.exists() or sha256_file(shard) != entry["sha256"]:
            break  # resume from the last shard that is intact
        done.append(entry)
    return done


def write_journal(folder: Path, config_hash: str, shards: list[dict]) -> None:
    write_json(folder / JOURNAL, {"config_hash": config_hash, "shards": shards})


class FeatureStore:
    """Read access to an extracted feature folder; tensors are memory-mapped, not loaded."""

    def __init__(self, folder: str | Path):
        self.folder = Path(folder)
        path = self.folder / MANIFEST
        if not path.exists():
            raise FileNotFoundError(f"{self.folder} holds no {MANIFEST}: run the extract stage first")
        self.manifest = json.loads(path.read_text())
        if self.manifest.get("schema_version") != SCHEMA_VERSION:
            raise CorruptStoreError(
                f"{path}: schema_version {self.manifest.get('schema_version')} is not {SCHEMA_VERSION}"
            )
        self.shards = self.manifest["shards"]
        self._starts = [0]
        for shard in self.shards:
            self._starts.append(self._starts[-1] + shard["samples"])
        self._open: dict[int, tuple] = {}

    def __len__(self) -> int:
        return self._starts[-1]

    @property
    def fingerprint(self) -> dict:
        return self.manifest["fingerprint"]

    @property
    def aux_layers(self) -> list[int]:
        return self.manifest["aux_layers"]

    def verify(self) -> None:
        """Raise CorruptStoreError naming the first shard whose bytes differ from the manifest."""
        for shard in self.shards:
            path = self.folder / shard["file"]
            if not path.exists():
                raise CorruptStoreError(f"{path} is missing")
            if sha256_file(path) != shard["sha256"]:
                raise CorruptStoreError(f"{path} is corrupt or truncated: sha256 differs from {MANIFEST}")

    def _shard(self, index: int):
        if index not in self._open:
            handle = safe_open(str(self.folder / self.shards[index]["file"]), framework="pt")
            self._open[index] = (handle, handle.get_tensor("offsets").tolist())
        return self._open[index]

    def sample(self, i: int) -> dict[str, torch.Tensor]:
        if not 0 <= i < len(self):
            raise IndexError(f"sample {i} outside 0..{len(self) - 1}")
        shard = bisect.bisect_right(self._starts, i) - 1
        handle, offsets = self._shard(shard)
        local = i - self._starts[shard]
        lo, hi = offsets[local], offsets[local + 1]
        return {key: handle.get_slice(key)[lo:hi] for key in FEATURE_KEYS}

    def tokens(self) -> dict[str, torch.Tensor]:
        with safe_open(str(self.folder / TOKENS), framework="pt") as f:
            return {key: f.get_tensor(key) for key in f.keys()}
