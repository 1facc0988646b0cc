"""What training-time test costs: the drafter's train step at TTT 1, 2, 4 and 7 (or --ttt-grid),
tokens/s, time per token against TTT 1, and peak memory (a fresh process each), in one run.

    python -m bench.ttt                               # SmolLM2-sized drafter, K=8192, B=2, T=512
    python -m bench.ttt --seq 2048 --ttt-grid 1 7     # longer samples
    python -m bench.ttt --device cuda --target tests/fixtures/kimi-k2.5 --batch 1 --seq 8192

The step is bench/train.py's (random features, the real TTTModel forward, backward and AdamW
step); steps alternate between the TTT lengths so machine noise hits all alike, and the
figures are medians. Nothing here is a timed test.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.train import train_rate  # noqa: E402
from eagle3.core.device import machine  # noqa: E402
from eagle3.core.params import TargetParams  # noqa: E402

TRAIN_BENCH = Path(__file__).with_name("train.py")


def peak_gib(ttt: int, args: argparse.Namespace, device: str) -> float:
    """Peak memory of a few steps at this TTT length, in a fresh process (bench/train.py's child)."""
    cmd = [sys.executable, str(TRAIN_BENCH), "--memory-child", str(args.draft_vocab)]
    cmd += ["--batch", str(args.batch), "--seq", str(args.seq), "--ttt", str(ttt)]
    cmd += ["--dtype", args.dtype, "--target", args.target]
    child = subprocess.run([*cmd, "--device", device], capture_output=True, text=True)
    if child.returncode:
        sys.exit(f"the peak-memory run at TTT {ttt} failed:\n{child.stderr[-3000:]}")
    return json.loads(child.stdout.strip().splitlines()[-1])["peak_bytes"] / 2**30


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default=TargetParams().source)
    ap.add_argument("--draft-vocab", type=int, default=8192)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--ttt-grid", type=int, nargs="+", default=[1, 2, 4, 7])
    ap.add_argument("--rounds", type=int, default=3, help="alternating rounds of 2 timed steps a length")
    ap.add_argument("--device", default="auto", help="cpu, cuda or auto (cuda where there is one)")
    ap.add_argument("--json", help="also write the figures here")
    args = ap.parse_args()
    device = "cuda" if args.device == "auto" and torch.cuda.is_available() else args.device
    device = "cpu" if device == "auto" else device
    print(f"{machine()}; target {args.target}; device {device}; threads {torch.get_num_threads()}")
    print(f"B={args.batch}, T={args.seq}, K={args.draft_vocab}, dtype {args.dtype}")
    steps: dict[int, list[float]] = {n: [] for n in args.ttt_grid}
    for _ in range(args.rounds):  # alternating: noise spreads over every length
        for n in args.ttt_grid:
            run = train_rate(
                args.draft_vocab, args.batch, args.seq, n, args.dtype, 2, args.target, torch.device(device)
            )
            steps[n].append(run["step_s"])
    base = statistics.median(steps[args.ttt_grid[0]])
    rows = []
    print(f"{'TTT':>4} {'step s':>8} {'tokens/s':>9} {'x TTT ' + str(args.ttt_grid[0]):>9} {'peak GiB':>9}")
    for n in args.ttt_grid:
        step = statistics.median(steps[n])
        row = {"ttt": n, "step_s": step, "tokens_per_s": args.batch * args.seq / step, "x_first": step / base}
        row["peak_gib"] = peak_gib(n, args, device)
        rows.append(row)
        print(f"{n:>4} {step:8.3f} {row['tokens_per_s']:9,.0f} {row['x_first']:9.2f} {row['peak_gib']:9.2f}")
    if args.json:
        figures = {"machine": machine(), "args": vars(args), "rows": rows}
        Path(args.json).write_text(json.dumps(figures, indent=1))


if __name__ == "__main__":
    main()
