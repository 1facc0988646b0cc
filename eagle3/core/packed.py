"""Inference-only Linear layers with oneDNN pre-packed weights (CPU, float32).

Decoding multiplies a few rows (1 token, or the k+1 tokens of a verification) by every weight
matrix. PyTorch's default CPU path re-packs the weight inside each small GEMM, so on an AVX2
CPU a 5-row forward of SmolLM2 costs ~1.35x a 1-row one, and the 1-row GEMV itself runs well
below memory bandwidth. Packing each weight once into oneDNN's blocked layout (what
torch.compile's freezing pass does for CPU inference) makes both faster and nearly flat in
the row count: measured on a 2-core AVX2 EPYC, 576x1536: 583 -> 358 us at 1 row, 741 -> 440
us at 5 rows; the 49,152-row lm_head: 15.6 -> 9.7 ms at 1 row, 35.8 -> 11.2 ms at 5 rows.

Used for the target and the drafter of speculative-eval, and so for all three decoders
(plain greedy, speculative, prompt lookup) alike. Results equal nn.Linear's to float32
rounding (the sum order differs).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

# The row count oneDNN tunes the packed layout for: a chain verification is k+1 rows.
ROWS_HINT = 8


def packing_available(dtype: torch.dtype, device: torch.device | str = "cpu") -> bool:
    return (
        torch.device(device).type == "cpu"
        and dtype == torch.float32
        and torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
    )


class PackedLinear(nn.Module):
    """y = x W^T + b with W held in oneDNN's packed layout; inference only (no autograd)."""

    def __init__(self, linear: nn.Linear, rows_hint: int = ROWS_HINT):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        # The original stays reachable (dtype, tied embeddings, export) without a copy.
        self.weight = linear.weight
        self.bias = linear.bias
        with torch.no_grad():
            self.register_buffer(
                "packed",
                torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), rows_hint),
                persistent=False,
            )

    def forward(self, x: Tensor) -> Tensor:
        bias = None if self.bias is None else self.bias.detach()
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, bias, "none", [], "")


def pack_linears(model: nn.Module, rows_hint: int = ROWS_HINT) -> int:
    """Replace every float32 CPU nn.Linear of `model` in place; returns how many were packed."""
    swaps = [
        (parent, name, child)
        for parent in model.modules()
        for name, child in parent.named_children()
        if type(child) is nn.Linear and packing_available(child.weight.dtype, child.weight.device)
    ]
    for parent, name, child in swaps:
        setattr(parent, name, PackedLinear(child, rows_hint))
    return len(swaps)
