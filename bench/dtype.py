"""The dtype policy's measurement, shown: per job, float32 vs bf16 on this machine, in one run.

    python -m bench.dtype [--target smollm2-135m-instruct]

`auto` picks the faster of the two per job (eagle3/device.py); on a CPU without native bf16
the pipeline skips this measurement and uses float32, but the script measures anyway, so the
rule itself is checked on every machine.
"""

from __future__ import annotations

import argparse

from eagle3.device import JOBS, Shape, machine, measure_policy
from eagle3.params import TargetParams
from eagle3.target.load import load_target_config


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--target", default="smollm2-135m-instruct")
    args = parser.parse_args()
    shape = Shape.of(load_target_config(TargetParams(source=args.target)))
    policy = measure_policy(shape)
    print(f"machine: {machine()}")
    print(f"shape: {shape} (a 2-layer model of these sizes, medians of 3)")
    print(f"{'job':8} {'float32 s':>10} {'bf16 s':>10} {'bf16/fp32':>10}  choice")
    for job in JOBS:
        f32, b16 = policy[job]["float32"], policy[job]["bfloat16"]
        print(f"{job:8} {f32:10.4f} {b16:10.4f} {b16 / f32:10.2f}  {policy[job]['choice']}")


if __name__ == "__main__":
    main()
