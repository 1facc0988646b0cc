"""Non-invasive capture of the target's hidden states with forward hooks.

The hooks only keep references to tensors the model computes anyway; they never modify
them, so the model's logits are bitwise unchanged (patch-check proves it on every target).
Layer ids follow SGLang's `eagle_aux_hidden_state_layer_ids`: id i is the output of decoder
layer i (0-indexed), which is HF's `hidden_states[i + 1]`.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from torch import nn


def _first(output) -> torch.Tensor:
    return output[0] if isinstance(output, tuple) else output


@dataclass
class Captured:
    aux: list[torch.Tensor] = field(default_factory=list)  # one [B, T, H] per aux layer
    last: torch.Tensor | None = None  # [B, T, H], after the final norm

    def aux_hidden(self) -> torch.Tensor:
        """[B, T, 3H]: the aux layers' outputs concatenated in ascending layer order."""
        return torch.cat(self.aux, dim=-1)


@contextmanager
def capture_hidden_states(
    decoder_layers: nn.ModuleList, final_norm: nn.Module, layer_ids: list[int]
) -> Iterator[Captured]:
    """Within the block, every forward of the model fills the yielded `Captured` (last call wins)."""
    captured = Captured()
    slots: dict[int, torch.Tensor] = {}
    ordered = sorted(layer_ids)

    def keep_aux(layer_id: int):
        def hook(_module, _inputs, output):
            slots[layer_id] = _first(output)

        return hook

    # The final norm runs once per forward, after every decoder layer: publish the set there.
    def keep_last(_module, _inputs, output):
        captured.last = _first(output)
        captured.aux = [slots[i] for i in ordered]

    handles = [decoder_layers[i].register_forward_hook(keep_aux(i)) for i in ordered]
    handles.append(final_norm.register_forward_hook(keep_last))
    try:
        yield captured
    finally:
        for handle in handles:
            handle.remove()
