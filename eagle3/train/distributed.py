"""Data parallelism under torchrun: the process group, its collectives, and the relaunch.

Under `torchrun` (WORLD_SIZE > 1) each rank takes every world-th row of the global batch and the
loss is normalised by the global number of trained positions, so N processes compute the same
update as one process on the same global batch.
"""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor


@dataclass
class Dist:
    rank: int = 0
    world: int = 1
    local_rank: int = 0

    @property
    def main(self) -> bool:
        return self.rank == 0


SINGLE_PROCESS = Dist()


def launched_by_torchrun() -> bool:
    return "WORLD_SIZE" in os.environ


def is_main_process() -> bool:
    return int(os.environ.get("RANK", "0")) == 0


def relaunch_under_torchrun(n: int, module: str) -> int:
    """Run `python -m module` again as n torchrun processes; returns their exit code."""
    env = dict(os.environ)
    if not torch.cuda.is_available():  # share the cores instead of oversubscribing them
        env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // n)))
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={n}",
        "-m",
        module,
    ]
    return subprocess.call(cmd, env=env)


# cuBLAS's workspace that makes its products deterministic; read when cuBLAS starts, so the train
# stage sets it before any CUDA work of its process
CUBLAS_DETERMINISTIC = ":4096:8"


def init_distributed() -> Dist:
    """Join the torchrun group when launched by torchrun (gloo on CPU, nccl on GPU)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world == 1:
        return Dist()
    if not dist.is_initialized():
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    return Dist(dist.get_rank(), dist.get_world_size(), int(os.environ.get("LOCAL_RANK", "0")))


def device_of(d: Dist) -> torch.device:
    """This rank's GPU, or the CPU. On a GPU, deterministic kernels only: same params and inputs
    give the same bytes there too, and a resumed run the bytes of an unbroken one (the default
    atomics-based backward kernels do not)."""
    if not torch.cuda.is_available():
        return torch.device("cpu")
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", CUBLAS_DETERMINISTIC)  # too late if cuBLAS started
    torch.use_deterministic_algorithms(True)
    device = torch.device(f"cuda:{d.local_rank}")
    torch.cuda.set_device(device)
    return device


def all_reduce(x: Tensor, d: Dist) -> Tensor:
    if d.world > 1:
        x = x.clone()
        dist.all_reduce(x)
    return x


def barrier(d: Dist) -> None:
    if d.world > 1:
        dist.barrier()


def all_gather_dict(part: dict, d: Dist) -> dict:
    """The union of every rank's `part` (disjoint keys), on every rank."""
    if d.world == 1:
        return part
    parts: list[dict | None] = [None] * d.world
    dist.all_gather_object(parts, part)
    return {k: v for each in parts for k, v in each.items()}
