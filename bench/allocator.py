"""Does glibc's malloc cost the CPU training step time? The step with glibc's defaults against the
step with `GLIBC_TUNABLES=glibc.malloc.mmap_max=0` (no block handed back to the kernel with
munmap, so no fresh pages to fault in and zero on the next step), per draft vocabulary size.

    python -m bench.allocator --target gemma3-270m --batch 2 --seq 384 --ttt 2 \
        --vocab-grid 32768 262144

glibc serves every block above its mmap threshold (32 MiB at most) with its own mmap and
returns it on free, so a step that makes [tokens, K] logits and their gradients faults in
every page of them again each step; with a 262K head that is gigabytes a step. Each variant
runs in a fresh process (the tunable is read at process start), alternating over --rounds;
the figures are medians over rounds, the ratio is taken between the medians of this one run.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.train import own_peak_rss_bytes, train_rate  # noqa: E402
from eagle3.core.device import machine  # noqa: E402
from eagle3.core.params import TargetParams  # noqa: E402

VARIANTS = {"glibc default": None, "mmap_max=0": "glibc.malloc.mmap_max=0"}


def child(args: argparse.Namespace) -> None:
    """One variant in this process: the step's tokens/s (median of --steps), peak RSS, page faults."""
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    run = train_rate(args.child, args.batch, args.seq, args.ttt, args.dtype, args.steps, args.target)
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults
    print(
        json.dumps(
            {"tokens_per_s": run["tokens_per_s"], "peak_bytes": own_peak_rss_bytes(), "faults": faults}
        )
    )


def run_variant(args: argparse.Namespace, k: int, tunables: str | None) -> dict:
    env = {key: value for key, value in os.environ.items() if key != "GLIBC_TUNABLES"}
    if tunables:
        env["GLIBC_TUNABLES"] = tunables
    cmd = [sys.executable, "-m", "bench.allocator", "--child", str(k), "--target", args.target]
    cmd += ["--batch", str(args.batch), "--seq", str(args.seq), "--ttt", str(args.ttt)]
    cmd += ["--dtype", args.dtype, "--steps", str(args.steps)]
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=Path(__file__).parents[1])
    if done.returncode:
        sys.exit(f"K={k:,} with {tunables or 'glibc defaults'} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default=TargetParams().source)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--ttt", type=int, default=2)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--steps", type=int, default=3, help="timed steps per process (after one warm-up)")
    ap.add_argument("--rounds", type=int, default=3, help="fresh processes per variant, alternating")
    ap.add_argument("--vocab-grid", type=int, nargs="+", default=[8192, 32768])
    ap.add_argument("--child", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(args)
        return
    print(f"{machine()}; target {args.target}; torch threads {torch.get_num_threads()}")
    print(f"B={args.batch} T={args.seq} TTT={args.ttt} dtype {args.dtype}; medians of {args.rounds} rounds")
    for k in args.vocab_grid:
        runs: dict[str, list[dict]] = {name: [] for name in VARIANTS}
        for _ in range(args.rounds):
            for name, tunables in VARIANTS.items():
                runs[name].append(run_variant(args, k, tunables))
        med = {
            name: {
                key: statistics.median(r[key] for r in rs) for key in ("tokens_per_s", "peak_bytes", "faults")
            }
            for name, rs in runs.items()
        }
        base, tuned = med["glibc default"], med["mmap_max=0"]
        print(
            f"K={k:>7,}: {base['tokens_per_s']:7,.0f} -> {tuned['tokens_per_s']:7,.0f} tok/s "
            f"({tuned['tokens_per_s'] / base['tokens_per_s']:.2f}x with mmap_max=0), "
            f"peak {base['peak_bytes'] / 2**30:.2f} -> {tuned['peak_bytes'] / 2**30:.2f} GiB, "
            f"minor page faults {base['faults']:,.0f} -> {tuned['faults']:,.0f} "
            f"(build + {args.steps + 1} steps)"
        )


if __name__ == "__main__":
    main()
