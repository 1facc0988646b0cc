"""The dtype policy's measurement, shown: per job, float32 vs bf16 on this machine, in one run.

    python -m bench.dtype [--target smollm2-135m-instruct] [--reps 5]

`auto` decides each job from the bf16/float32 ratio of CPU time on one thread, float32 and bf16
interleaved (eagle3/core/device.py). This script prints that ratio beside the wall-clock ratio with
all threads (what a quiet machine would show a user), so the proxy is checked against the real
thing, and the load other processes put on the machine meanwhile. On a CPU without native bf16
the pipeline skips the measurement and uses float32, but the script measures anyway.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from eagle3.core.device import DTYPES, JOBS, Shape, _job_work, choose, machine, measure_decision
from eagle3.core.params import TargetParams
from eagle3.verifier.load import load_target_config


def wall_ratio(job: str, shape: Shape, reps: int) -> float:
    """Median bf16/float32 wall-clock ratio with all threads, the two interleaved."""
    work = {name: _job_work(job, DTYPES[name], shape) for name in ("float32", "bfloat16")}
    for run in work.values():
        run()
    ratios = []
    for rep in range(reps):
        times = {}
        for name in sorted(work, reverse=rep % 2 == 1):
            start = time.perf_counter()
            work[name]()
            times[name] = time.perf_counter() - start
        ratios.append(times["bfloat16"] / times["float32"])
    return statistics.median(ratios)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--target", default="smollm2-135m-instruct")
    parser.add_argument("--reps", type=int, default=5)
    args = parser.parse_args()
    shape = Shape.of(load_target_config(TargetParams(source=args.target)))
    print(f"machine: {machine()}")
    print(f"shape: {shape}")
    print(f"{'job':8} {'cpu ratio':>10} {'wall ratio':>10} {'others':>7}  choice (cpu) / (wall)")
    for job in JOBS:
        decision = measure_decision(job, shape)
        wall = wall_ratio(job, shape, args.reps)
        print(
            f"{job:8} {decision['ratio']:10.2f} {wall:10.2f} {decision['others_cores']:7.2f}  "
            f"{decision['choice']} / {choose(wall)[0]}  ({torch.get_num_threads()} threads for wall)"
        )


if __name__ == "__main__":
    main()
