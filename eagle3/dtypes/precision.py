"""How training computes in a dtype: bf16 is autocast over float32 master weights and optimizer
state (the weights AdamW updates stay float32); any other dtype is the weights' own. The train
loop, its memory estimate (eagle3/drafter/cost.py) and `eagle3 plan` all read it here."""

from __future__ import annotations

import torch


def precision_of(dtype: torch.dtype) -> tuple[torch.dtype, bool]:
    """(master weight dtype, bf16 autocast on?) training runs in for a compute dtype."""
    return (torch.float32, True) if dtype == torch.bfloat16 else (dtype, False)
