"""The feature store: sharded safetensors of hidden states, a manifest, and a token file.

Layout of `artifacts/extract/`:
  shard-00000.safetensors  per-token rows of `shard_samples` samples, concatenated:
                           input_ids int32 [N], loss_mask uint8 [N], aux_hidden bf16 [N, 3H],
                           last_hidden bf16 [N, H], offsets int64 [S + 1] (sample i = rows
                           offsets[i]:offsets[i+1]); a top-N store (SGLang's top logprobs,
                           manifest `target_topk`: N) holds target_topk_ids int32 [N, n] and
                           target_topk_logprobs float32 [N, n] instead of last_hidden: row t
                           is the target's top-n prediction of token t + 1, best first; an
                           online store (manifest `features`: "online") holds the tokens only
                           (input_ids, loss_mask, offsets): training computes the features.
                           An fp8 store (extract.store_dtype: float8_e4m3fn, manifest "dtype")
                           holds aux_hidden and last_hidden as float8_e4m3fn with one float32
                           scale per row beside each (aux_scale [N], last_scale [N]): row amax /
                           448, 1 for a zero row; quantized from the bf16 rows
                           (eagle3/data/wire.py, as the SGLang hook's fp8 pieces are), so the
                           same features give the same bytes. Reads return bf16 (fp8 x scale)
  tokens.safetensors       input_ids, loss_mask and offsets of all samples, so vocab-map
                           never reads hidden states
  manifest.json            schema version, target fingerprint, aux layer ids, dtype, and per
                           shard: samples, tokens, sha256; the token file's sha256, the hash of
                           the config that made it, and a checksum of the manifest itself; for
                           the in-process target (hf), `capture_threads`: the torch threads its
                           forwards ran at, which online training's forwards run at too

While extraction runs, its shards and `journal.json` (the shards finished so far) live in the
work folder beside it, `artifacts/extract.partial/`, which DVC does not manage: `dvc exp run`
checks out the committed store before it runs the stage again, deleting whatever a killed run
left in the out. The out is not touched until the new store is complete: intact shards of the
last store are hard-linked into the work folder, not moved, the token file and the sealed manifest
are written there last, and then the work folder replaces the out (renames: `publish_store`, or
the extract stage's commit of all its outputs, eagle3/core/stage_commit.py). A run that fails or
is killed leaves the last store as it was (or, killed between the two renames, no store and a
complete work folder, which the next run publishes without recomputing a shard).

A shard file appears only once complete (written to a temporary name, then renamed), and its
sha256 is recorded, so a truncated, corrupted or deleted shard, a damaged token file and an
edited manifest are detected before use, each by name. A re-run of the same config keeps every
intact shard (from the journal, or from the manifest of a finished run) and recomputes only the
damaged or missing ones. Hidden states that are not finite are refused before they are stored.
"""

from __future__ import annotations

import bisect
import json
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save as save_tensors

from eagle3.core.inputs import InputError
from eagle3.core.stageio import sha256_file, sha256_json, write_bytes, write_json
from eagle3.data.wire import FP8, dequantize_rows, quantize_rows
from eagle3.target.fingerprint import Fingerprint

SCHEMA_VERSION = 1
MANIFEST = "manifest.json"
JOURNAL = "journal.json"
TOKENS = "tokens.safetensors"
FEATURE_KEYS = ("input_ids", "loss_mask", "aux_hidden", "last_hidden")
TOPK_KEYS = ("input_ids", "loss_mask", "aux_hidden", "target_topk_ids", "target_topk_logprobs")
TOKEN_KEYS = ("input_ids", "loss_mask")  # an online store: features are computed while training
SHARD_NAME = re.compile(r"shard-(\d{5})\.safetensors")
STORE_DTYPES = ("bfloat16", FP8)  # extract.store_dtype: how hidden states are kept
SCALES = {"aux_hidden": "aux_scale", "last_hidden": "last_scale"}  # an fp8 store's row scales
RERUN = "re-run the extract stage (dvc repro extract): it recomputes only what is damaged"


class CorruptStoreError(InputError):
    """A store file differs from what its manifest recorded (or the manifest from what was written)."""


def shard_name(index: int) -> str:
    return f"shard-{index:05d}.safetensors"


@dataclass
class Sample:
    """One sample's features. What training needs of the target's own prediction is either its
    final-norm state (last_hidden, recomputed into logits with the lm_head) or its top-N."""

    input_ids: torch.Tensor  # int32 [T]
    loss_mask: torch.Tensor  # uint8 [T]
    aux_hidden: torch.Tensor | None = None  # bf16 [T, 3H]; None: tokens only (an online store)
    last_hidden: torch.Tensor | None = None  # bf16 [T, H]
    target_topk_ids: torch.Tensor | None = None  # int32 [T, N]: top-N prediction of token t + 1
    target_topk_logprobs: torch.Tensor | None = None  # float32 [T, N], best first

    @property
    def keys(self) -> tuple[str, ...]:
        if self.aux_hidden is None:
            return TOKEN_KEYS
        return FEATURE_KEYS if self.last_hidden is not None else TOPK_KEYS

    def tokens_only(self) -> Sample:
        """The sample as an online store keeps it: its tokens, no features."""
        return Sample(self.input_ids, self.loss_mask)


def pack(samples: list[Sample]) -> dict[str, torch.Tensor]:
    keys = samples[0].keys
    if any(s.keys != keys for s in samples):
        raise ValueError("a shard mixes samples of different kinds (last_hidden, top-N, tokens only)")
    lengths = torch.tensor([0] + [len(s.input_ids) for s in samples], dtype=torch.int64)
    packed = {key: torch.cat([getattr(s, key) for s in samples]).contiguous() for key in keys}
    packed["offsets"] = torch.cumsum(lengths, 0)
    return packed


def check_finite(index: int, samples: list[Sample]) -> None:
    """InputError naming the first sample whose captured states hold NaN or Inf: a drafter
    trained on them learns nothing (its loss turns NaN), so they are refused before storing."""
    for i, sample in enumerate(samples):
        for key in ("aux_hidden", "last_hidden", "target_topk_logprobs"):
            value = getattr(sample, key)
            if value is None:
                continue
            # a logprob may be -inf (a probability that underflowed), never NaN or above 0
            bad = value.isnan() | (value > 0) if key == "target_topk_logprobs" else ~torch.isfinite(value)
            if bad.any():
                token = int(bad.any(dim=-1).nonzero()[0, 0])
                raise InputError(
                    f"extract: the target produced NaN or Inf {key} for sample {i} of shard {index} "
                    f"(token {token} of {len(sample.input_ids)}); nothing was stored for this shard. "
                    "The target's weights or its dtype overflow: try target.dtype: float32"
                )


def feature_bytes_per_token(hidden: int, dtype: str = "bfloat16", target_topk: int | None = None) -> int:
    """Bytes of one token's features in a shard (no ids or mask): aux_hidden [3H] with last_hidden
    [H], or with the top-N (id int32 + logprob float32); bf16 rows, or fp8 rows and a float32
    scale per row."""
    fp8 = dtype == FP8
    rows = 3 * hidden * (1 if fp8 else 2) + (4 if fp8 else 0)
    if target_topk:
        return rows + target_topk * 8
    return rows + hidden * (1 if fp8 else 2) + (4 if fp8 else 0)


def write_shard(folder: Path, index: int, samples: list[Sample], dtype: str = "bfloat16") -> dict:
    """Write one complete shard atomically and return its manifest entry. `dtype`
    (extract.store_dtype) float8_e4m3fn stores the hidden states quantized per row (SCALES)."""
    if dtype not in STORE_DTYPES:
        raise ValueError(f"store dtype {dtype!r} is none of {', '.join(STORE_DTYPES)}")
    check_finite(index, samples)  # on the bf16 rows, before anything is quantized
    path = folder / shard_name(index)
    tensors = pack(samples)
    if dtype == FP8:
        for key, scale in SCALES.items():
            if key in tensors:  # a top-N store has no last_hidden, an online one no states
                tensors[key], tensors[scale] = quantize_rows(tensors[key])
    write_bytes(path, save_tensors(tensors))
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


def _entry(path: Path, sha256: str) -> dict:
    """A shard's manifest entry from the shard itself (a record may have been edited)."""
    with safe_open(str(path), framework="pt") as f:
        offsets = f.get_tensor("offsets")
    return {"file": path.name, "samples": len(offsets) - 1, "tokens": int(offsets[-1]), "sha256": sha256}


def work_folder(out: Path) -> Path:
    """Where an extraction into `out` keeps its shards and journal until it completes: beside the
    DVC out, so DVC never deletes them, and on the same filesystem, so shards move by rename."""
    return out.with_name(out.name + ".partial")


def _recorded_shards(folder: Path, config_hash: str) -> list[dict]:
    """Shard entries recorded by an earlier run of the same config: the journal of an
    interrupted run, else the manifest of a finished one; [] when there is neither."""
    for name in (JOURNAL, MANIFEST):
        try:
            record = json.loads((folder / name).read_text())
        except (OSError, ValueError):
            continue  # absent or unreadable: nothing to vouch for shards
        if isinstance(record, dict) and record.get("config_hash") == config_hash:
            shards = record.get("shards")
            return [e for e in shards if isinstance(e, dict)] if isinstance(shards, list) else []
    return []


def resume_shards(out: Path, config_hash: str) -> dict[int, dict]:
    """The intact shards of an earlier run of the same config, by index, gathered in the work
    folder under a journal (every shard not vouched for is removed from it); the out is left as it
    is until the new store replaces it whole. A shard is vouched for by the work folder's journal
    or manifest (a completed store not yet published) or the out's journal or manifest (a finished
    store being repaired, or a run from before the work folder) and kept only when its bytes still
    hash to the recorded sha256, so a re-run recomputes only damaged or missing shards."""
    work = work_folder(out)
    work.mkdir(parents=True, exist_ok=True)
    found: dict[int, Path] = {}
    done: dict[int, dict] = {}
    for entry in _recorded_shards(work, config_hash) + _recorded_shards(out, config_hash):
        match = SHARD_NAME.fullmatch(str(entry.get("file")))
        if not match or int(match[1]) in done:
            continue
        # in either folder: a run killed while moving its shards into the out left some there
        for shard in (work / match[0], out / match[0]):
            if shard.is_file() and sha256_file(shard) == entry.get("sha256"):
                found[int(match[1])] = shard
                done[int(match[1])] = _entry(shard, entry["sha256"])  # counts from the shard, not the record
                break
    # journal first: it vouches for each shard in either folder, so a kill while moving loses none
    write_journal(work, config_hash, [done[i] for i in sorted(done)])
    kept = {shard.name for shard in found.values()}
    for stale in work.iterdir():  # unvouched shards, a completed store's files, killed writes' temps
        if stale.name not in kept and stale.name != JOURNAL:
            stale.unlink()
    for shard in found.values():
        if shard.parent != work:  # the out keeps its own: a link, not a move (or a copy where links fail)
            (work / shard.name).unlink(missing_ok=True)  # a damaged copy of the same name
            _link_or_copy(shard, work / shard.name)
    return done


def _link_or_copy(src: Path, dst: Path) -> None:
    try:
        os.link(src, dst)
    except OSError:
        write_bytes(dst, src.read_bytes())


def publish_store(out: Path) -> None:
    """The completed work folder replaces the out: the last store is renamed aside, the work
    folder renamed into place, the old store removed. Killed between the renames, the out is
    missing and the work folder complete: `resume_shards` keeps every shard (its manifest vouches)."""
    work, aside = work_folder(out), out.with_name(out.name + ".replaced")
    if aside.exists():
        shutil.rmtree(aside)
    if out.exists():
        os.replace(out, aside)
    os.replace(work, out)
    if aside.exists():
        shutil.rmtree(aside)


def write_journal(folder: Path, config_hash: str, shards: list[dict]) -> None:
    write_json(folder / JOURNAL, {"config_hash": config_hash, "shards": shards})


def manifest_checksum(manifest: dict) -> str:
    """sha256 of the manifest's content without its own checksum (sorted keys: any edit shows)."""
    return sha256_json({k: v for k, v in manifest.items() if k != "checksum"})


def write_manifest(folder: Path, manifest: dict, config_hash: str) -> dict:
    """Write the manifest of a finished store, sealed: the token file's sha256, the config hash
    (a re-run of the same config reuses the intact shards) and a checksum of the whole."""
    manifest = manifest | {"config_hash": config_hash, "tokens_sha256": sha256_file(folder / TOKENS)}
    manifest["checksum"] = manifest_checksum(manifest)
    write_json(folder / MANIFEST, manifest)
    return manifest


class FeatureStore:
    """Read access to an extracted feature folder; tensors are memory-mapped, not loaded."""

    def __init__(self, folder: str | Path):
        self.folder = Path(folder)
        path = self.folder / MANIFEST
        if not path.exists():
            raise FileNotFoundError(f"{self.folder} holds no {MANIFEST}: run the extract stage first")
        try:
            self.manifest = json.loads(path.read_text(encoding="utf-8"))
        except ValueError as err:  # not JSON, not UTF-8
            raise CorruptStoreError(f"{path} is not valid JSON ({err}); {RERUN}") from None
        if not isinstance(self.manifest, dict) or self.manifest.get("schema_version") != SCHEMA_VERSION:
            version = self.manifest.get("schema_version") if isinstance(self.manifest, dict) else None
            raise CorruptStoreError(f"{path}: schema_version {version} is not {SCHEMA_VERSION}; {RERUN}")
        # Stores written before the checksum existed have none; any edit to a sealed one shows.
        if "checksum" in self.manifest and self.manifest["checksum"] != manifest_checksum(self.manifest):
            raise CorruptStoreError(f"{path} was edited after extraction (its checksum differs); {RERUN}")
        self.shards = self.manifest.get("shards")
        if not isinstance(self.shards, list) or not all(
            isinstance(e, dict) and {"file", "samples", "sha256"} <= e.keys() for e in self.shards
        ):
            raise CorruptStoreError(f"{path}: 'shards' is not a list of file/samples/sha256 entries; {RERUN}")
        self.keys = TOKEN_KEYS if self.online else TOPK_KEYS if self.target_topk else FEATURE_KEYS
        self.dtype = self.manifest.get("dtype", "bfloat16")  # stores built in code may not say
        if self.dtype not in STORE_DTYPES:
            raise CorruptStoreError(
                f"{path}: dtype {self.dtype!r} is none of {', '.join(STORE_DTYPES)}; {RERUN}"
            )
        self._starts = [0]
        for shard in self.shards:
            self._starts.append(self._starts[-1] + shard["samples"])
        self._open: dict[int, tuple] = {}

    def __len__(self) -> int:
        return self._starts[-1]

    @property
    def fingerprint(self) -> Fingerprint:
        return Fingerprint.from_json(self.manifest.get("fingerprint"), str(self.folder / MANIFEST))

    @property
    def aux_layers(self) -> list[int]:
        return self.manifest["aux_layers"]

    @property
    def online(self) -> bool:
        """True for a store of tokens only (extract.features: online): training computes the features."""
        return self.manifest.get("features") == "online"

    @property
    def capture_threads(self) -> int | None:
        """The torch threads the in-process target's forwards ran at (None: a server's store, or one
        written before the count was recorded)."""
        return self.manifest.get("capture_threads")

    @property
    def target_topk(self) -> int | None:
        """N for a store of the target's top-N predictions; None for one of last_hidden rows."""
        return self.manifest.get("target_topk")

    def verify(self) -> None:
        """Raise CorruptStoreError naming the first file (shard or token file) whose bytes differ
        from the manifest, or that is missing."""
        for shard in self.shards:
            self._verify_file(shard["file"], shard["sha256"])
        self.verify_tokens()

    def verify_tokens(self) -> None:
        if "tokens_sha256" in self.manifest:  # absent in stores written before it was recorded
            self._verify_file(TOKENS, self.manifest["tokens_sha256"])

    def _verify_file(self, name: str, sha256: str) -> None:
        path = self.folder / name
        if not path.is_file():
            raise CorruptStoreError(f"{path} is missing; {RERUN}")
        if sha256_file(path) != sha256:
            raise CorruptStoreError(
                f"{path} is corrupt or truncated: sha256 differs from {MANIFEST}; {RERUN}"
            )

    def _shard(self, index: int):
        if index not in self._open:
            handle = safe_open(str(self.folder / self.shards[index]["file"]), framework="pt")
            self._open[index] = (handle, handle.get_tensor("offsets").tolist())
        return self._open[index]

    def shard_offsets(self, index: int) -> list[int]:
        """Shard `index`'s row offsets: sample j of it is rows offsets[j]:offsets[j + 1]."""
        return self._shard(index)[1]

    def sample(self, i: int) -> dict[str, torch.Tensor]:
        if not 0 <= i < len(self):
            raise IndexError(f"sample {i} outside 0..{len(self) - 1}")
        shard = bisect.bisect_right(self._starts, i) - 1
        handle, offsets = self._shard(shard)
        local = i - self._starts[shard]
        lo, hi = offsets[local], offsets[local + 1]
        if self.dtype != FP8:
            return {key: handle.get_slice(key)[lo:hi] for key in self.keys}

        # the same keys and dtypes as a bf16 store's: readers never see the fp8 rows or scales
        def read(key: str) -> torch.Tensor:
            rows = handle.get_slice(key)[lo:hi]
            if key not in SCALES:
                return rows
            return dequantize_rows(rows, handle.get_slice(SCALES[key])[lo:hi]).to(torch.bfloat16)

        return {key: read(key) for key in self.keys}

    def tokens(self) -> dict[str, torch.Tensor]:
        """input_ids, loss_mask and offsets of all samples, checked against the manifest first."""
        self.verify_tokens()
        path = self.folder / TOKENS
        try:
            with safe_open(str(path), framework="pt") as f:
                return {key: f.get_tensor(key) for key in f.keys()}
        except (OSError, SafetensorError) as err:  # only reachable for stores without tokens_sha256
            raise CorruptStoreError(f"{path} is unreadable ({err}); {RERUN}") from None
