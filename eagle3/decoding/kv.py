"""Keeping the target's KV cache consistent after a partial acceptance.

A verification appends the entries of every verified token; afterwards only the root and the
accepted path may stay, in path order, at the positions the next forward expects. For a chain
that is a crop; for a tree the accepted nodes are scattered, so their entries are moved down
first. transformers 5 `DynamicLayer` keeps plain [B, heads, S, d] tensors that `update`
concatenates to, so rewriting `keys`/`values` is all it takes.
"""

from __future__ import annotations

import torch
from transformers import DynamicCache


def keep_verified(cache: DynamicCache, n_verified: int, keep: list[int]) -> None:
    """Of the last `n_verified` entries of every layer keep those at offsets `keep` (increasing)."""
    n_keep = len(keep)
    contiguous = keep == list(range(n_keep))
    for layer in cache.layers:
        if not layer.is_initialized:
            continue
        total = layer.keys.shape[-2]
        start = total - n_verified
        if getattr(layer, "is_sliding", False) and layer.cumulative_length != total:
            raise RuntimeError(
                "speculative decoding past a sliding attention window is not supported "
                f"(window {layer.sliding_window}, sequence {layer.cumulative_length})"
            )
        if not contiguous:
            index = torch.tensor(keep, device=layer.keys.device) + start
            # the right-hand side is gathered into a new tensor before the in-place write
            layer.keys[:, :, start : start + n_keep] = layer.keys.index_select(2, index)
            layer.values[:, :, start : start + n_keep] = layer.values.index_select(2, index)
        layer.keys = layer.keys[:, :, : start + n_keep]
        layer.values = layer.values[:, :, : start + n_keep]
        if getattr(layer, "is_sliding", False):
            layer.cumulative_length = start + n_keep
