"""Which dtype computes fast here: bf16 needs native support (AMX / AVX512-BF16, or a GPU);
CPUs without it emulate bf16 matmuls at a fraction of the float32 rate."""

from __future__ import annotations

from functools import cache
from pathlib import Path

import torch

DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float64": torch.float64}


@cache
def native_bf16() -> bool:
    if torch.cuda.is_available():
        return torch.cuda.is_bf16_supported()
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return "amx_bf16" in flags or "avx512_bf16" in flags


def resolve_dtype(name: str) -> torch.dtype:
    """`auto` = bfloat16 where it is native, else float32; any other name is taken as is."""
    if name == "auto":
        return torch.bfloat16 if native_bf16() else torch.float32
    return DTYPES[name]
