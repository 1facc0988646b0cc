"""Training batches from the feature store: a held-out split, length-bucketed rows, lazy reads.

One sample per row (cut at `seq_len`), right-padded: attention is then plain causal, which is
what the drafter sees at inference. Rows of similar length are batched together (sorted within
shuffled pools) so little is spent on padding. The batches of an epoch are a pure function of
(seed, epoch), so a run's data position is just (epoch, batch index) and a resumed run sees
exactly the batches it would have seen. A batch's rows come from a row reader: `StoredFeatures`
reads hidden states through safetensors' memory map, never all at once; an online store's
`OnlineFeatures` (online.py) computes them from the target.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from itertools import pairwise
from typing import Protocol

import torch
from torch import Tensor

from eagle3.data.store import FeatureStore
from eagle3.dtypes.policy import resolve_dtype
from eagle3.train.argmax import target_argmax
from eagle3.train.distributed import SINGLE_PROCESS, Dist

POOL_BATCHES = 16  # batches per sorting pool: more = less padding, less randomness
# Batches are padded to a multiple of this width, so a run sees at most seq_len / WIDTH_MULTIPLE
# matmul shapes: every new shape makes oneDNN build and cache kernels (up to 1024), and their
# churn fragments the heap, so peak RSS grew with the steps taken (see ttt.ROW_MULTIPLE).
WIDTH_MULTIPLE = 32


@dataclass
class Batch:
    input_ids: Tensor  # int64 [B, T]
    loss_mask: Tensor  # bool [B, T]: assistant tokens
    in_draft: Tensor  # bool [B, T]: the target's (full-vocab) argmax at t is in the draft vocab
    real: Tensor  # bool [B, T]: False on padding
    position_ids: Tensor  # int64 [B, T]
    aux_hidden: Tensor  # [B, T, 3H]
    # the target's prediction of token t + 1: its final-norm state, or (a top-N store) its top-N
    last_hidden: Tensor | None = None  # [B, T, H]
    topk_ids: Tensor | None = None  # int64 [B, T, N], best first
    topk_logprobs: Tensor | None = None  # float32 [B, T, N]

    @property
    def num_tokens(self) -> int:
        return int(self.real.sum())

    def to(self, device: torch.device) -> Batch:
        def moved(t: Tensor | None) -> Tensor | None:
            return None if t is None else t.to(device, non_blocking=True)

        return Batch(*(moved(getattr(self, f.name)) for f in fields(self)))


def split_samples(num_samples: int, heldout_fraction: float, seed: int) -> tuple[list[int], list[int]]:
    """(train, held-out) sample indices; a seeded permutation, at least one sample in each."""
    if num_samples < 2:
        raise ValueError(f"the feature store holds {num_samples} sample(s); training needs at least 2")
    order = torch.randperm(num_samples, generator=torch.Generator().manual_seed(seed)).tolist()
    n_held = min(num_samples - 1, max(1, round(num_samples * heldout_fraction)))
    return sorted(order[n_held:]), sorted(order[:n_held])


class StoredFeatures:
    """Rows of a feature store: its tensors, and the target's argmax computed beforehand."""

    def __init__(self, store: FeatureStore, in_draft: dict[int, Tensor]):
        self.store, self.in_draft, self.keys = store, in_draft, store.keys

    def rows(self, samples: list[int]) -> dict[int, dict[str, Tensor]]:
        return {s: self.store.sample(s) | {"in_draft": self.in_draft[s]} for s in samples}


class RowReader(Protocol):
    """Per sample: input_ids, loss_mask, in_draft and the feature keys it names in `keys`."""

    keys: tuple[str, ...]

    def rows(self, samples: list[int]) -> dict[int, dict[str, Tensor]]: ...


def sample_lengths(store: FeatureStore) -> list[int]:
    """Every sample's token count, from the shards' offsets (no hidden state is read)."""
    return [hi - lo for i in range(len(store.shards)) for lo, hi in pairwise(store.shard_offsets(i))]


class BatchSource:
    """Batches of one split; `batch(samples)` reads their rows from the reader."""

    def __init__(self, reader: RowReader, samples: list[int], lengths: list[int], seq_len: int):
        self.reader, self.samples, self.seq_len = reader, samples, seq_len
        self.lengths = {s: min(lengths[s], seq_len) for s in samples}

    @property
    def num_tokens(self) -> int:
        return sum(self.lengths.values())

    def epoch_batches(self, epoch: int, seed: int, batch_size: int) -> list[list[int]]:
        """The epoch's batches of sample ids; a last partial batch is dropped (unless it is the only one)."""
        g = torch.Generator().manual_seed(seed * 100_003 + epoch)
        order = [self.samples[i] for i in torch.randperm(len(self.samples), generator=g).tolist()]
        pool = batch_size * POOL_BATCHES
        batches = []
        for lo in range(0, len(order), pool):
            chunk = sorted(order[lo : lo + pool], key=lambda s: (self.lengths[s], s))
            batches += [chunk[i : i + batch_size] for i in range(0, len(chunk), batch_size)]
        full = [b for b in batches if len(b) == batch_size] or batches[:1]
        return [full[i] for i in torch.randperm(len(full), generator=g).tolist()]

    def fixed_batches(self, batch_size: int) -> list[list[int]]:
        """Unshuffled, length-sorted batches covering every sample (held-out evaluation)."""
        order = sorted(self.samples, key=lambda s: (self.lengths[s], s))
        return [order[i : i + batch_size] for i in range(0, len(order), batch_size)]

    def batch(self, samples: list[int], dtype: torch.dtype | None = None) -> Batch:
        longest = max(self.lengths[s] for s in samples)
        width = min(-(-longest // WIDTH_MULTIPLE) * WIDTH_MULTIPLE, max(self.seq_len, longest))
        b = len(samples)
        ids = torch.zeros(b, width, dtype=torch.int64)
        mask = torch.zeros(b, width, dtype=torch.bool)
        in_draft = torch.zeros(b, width, dtype=torch.bool)
        real = torch.zeros(b, width, dtype=torch.bool)
        # per-position feature -> its padded [B, T, ...] tensor: aux_hidden and the target's keys,
        # as the store holds them (last_hidden, or the top-N ids and logprobs)
        keys = [k for k in self.reader.keys if k not in ("input_ids", "loss_mask")]
        padded: dict[str, Tensor] = {}
        rows = self.reader.rows(samples)
        for r, s in enumerate(samples):
            feats = rows[s]
            n = self.lengths[s]
            if not padded:
                for key in keys:
                    kind = torch.int64 if key == "target_topk_ids" else feats[key].dtype
                    padded[key] = torch.zeros(b, width, feats[key].shape[-1], dtype=kind)
            ids[r, :n] = feats["input_ids"][:n].long()
            mask[r, :n] = feats["loss_mask"][:n].bool()
            in_draft[r, :n] = feats["in_draft"][:n]
            real[r, :n] = True
            for key, tensor in padded.items():
                tensor[r, :n] = feats[key][:n]
        aux, last = padded["aux_hidden"], padded.get("last_hidden")
        if dtype is not None:
            aux, last = aux.to(dtype), None if last is None else last.to(dtype)
        pos = torch.arange(width).expand(b, width).contiguous()
        return Batch(
            ids,
            mask,
            in_draft,
            real,
            pos,
            aux,
            last,
            padded.get("target_topk_ids"),
            padded.get("target_topk_logprobs"),
        )


def target_in_draft(
    store: FeatureStore,
    samples: list[int],
    lm_head: Tensor,
    t2d: Tensor,
    features_sha256: str | None = None,
    d: Dist = SINGLE_PROCESS,
) -> dict[int, Tensor]:
    """Per sample: is the target's full-vocabulary argmax inside the draft vocab?

    A top-N store holds the argmax; otherwise it is computed from last_hidden with every row of
    the target lm_head (the training steps then multiply only the K draft rows), once per feature
    store on this machine (eagle3/train/argmax.py)."""
    if store.target_topk is not None:
        return {s: t2d[store.sample(s)["target_topk_ids"][:, 0].long()].clone() for s in samples}
    argmax = target_argmax(store, samples, argmax_head(lm_head), features_sha256, d)
    return {s: t2d[ids.long()] for s, ids in argmax.items()}


def argmax_head(lm_head: Tensor) -> Tensor:
    """The lm_head the target's argmax is taken with (stored and online alike): on a CPU in the
    dtype measured fastest there, else as it is."""
    return lm_head.to(resolve_dtype("auto")) if lm_head.device.type == "cpu" else lm_head
