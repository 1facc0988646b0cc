"""The machine at hand: its CPU (model, bf16 support, class) and the one line every speed
figure names. Which dtype each job runs in is decided in eagle3/dtypes/, from these facts and a
measurement."""

from __future__ import annotations

import os
import platform
from collections.abc import Iterator
from contextlib import contextmanager
from functools import cache
from pathlib import Path
from typing import Literal

import torch

# What a CPU can do in bf16, the classes eagle3/dtypes/rule.py gives a default to: AMX tiles
# multiply bf16 natively at several times float32's rate; AVX512-BF16 alone has only a bf16
# dot-product instruction; without either bf16 matmuls are emulated (~50x slower than float32).
MachineClass = Literal["gpu", "amx", "avx512_bf16", "no_native_bf16"]


@cache
def _cpu_flags() -> str:
    try:
        return Path("/proc/cpuinfo").read_text()
    except OSError:
        return ""


def cpu_model() -> str:
    for line in _cpu_flags().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or "cpu"


def vector_flags() -> str:
    """The CPU's AVX and AMX flags, sorted: what decides how fast each dtype multiplies."""
    return " ".join(sorted({f for f in _cpu_flags().split() if "avx" in f or "amx" in f}))


@cache
def native_bf16() -> bool:
    if torch.cuda.is_available():
        return torch.cuda.is_bf16_supported()
    flags = _cpu_flags()
    return "amx_bf16" in flags or "avx512_bf16" in flags


def machine_class() -> MachineClass:
    if torch.cuda.is_available():
        return "gpu"
    flags = _cpu_flags()
    if "amx_bf16" in flags:
        return "amx"
    return "avx512_bf16" if "avx512_bf16" in flags else "no_native_bf16"


def machine() -> str:
    """One line naming the machine every speed figure was measured on."""
    if torch.cuda.is_available():
        return f"{torch.cuda.get_device_name()}, torch {torch.__version__}"
    bf16 = {"amx": "AMX", "avx512_bf16": "AVX512-BF16"}.get(machine_class(), "no native bf16")
    return (
        f"{cpu_model()}, {os.cpu_count()} cores, {bf16}, torch {torch.__version__} "
        f"({torch.backends.cpu.get_cpu_capability()}), {torch.get_num_threads()} threads"
    )


@contextmanager
def torch_threads(threads: int | None) -> Iterator[None]:
    """torch's intra-op threads set to `threads` for the block (None: left as they are), and the
    calling thread's count put back after it, also when the block changed it. The count is per
    calling thread (OpenMP's and MKL's settings are), so a background thread may hold its own."""
    before = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)
