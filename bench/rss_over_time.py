"""A train stage's anonymous memory over time: does it grow with the steps taken?

    python -m bench.rss_over_time PROJECT [--seconds 150] [--env NAME=VALUE ...]

PROJECT is a scratch project whose extract and vocab-map outputs exist (bench.online leaves one
in its --workdir). Its artifacts/train is removed, then `python -m stages.train` runs there for
--seconds (or to the end) while its RssAnon (/proc, file-backed pages left out: a store read
through mmap counts as file pages) is sampled every second. Prints the RSS at every 30 s, the
peak, and when each checkpoint was written (every train.checkpoint_every steps, so the gaps
compare speeds). --env runs the stage with extra environment variables, e.g.
ONEDNN_PRIMITIVE_CACHE_CAPACITY=0 or MALLOC_MMAP_THRESHOLD_=131072, to tell causes apart.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from eagle3.core.device import machine


def anon_mib(pid: int) -> int | None:
    try:
        lines = Path(f"/proc/{pid}/status").read_text().splitlines()
    except OSError:
        return None
    return next((int(line.split()[1]) // 1024 for line in lines if line.startswith("RssAnon:")), None)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("project", type=Path)
    ap.add_argument("--seconds", type=float, default=150.0)
    ap.add_argument("--env", action="append", default=[], metavar="NAME=VALUE")
    args = ap.parse_args()
    env = dict(os.environ) | dict(kv.split("=", 1) for kv in args.env)
    shutil.rmtree(args.project / "artifacts" / "train", ignore_errors=True)
    checkpoint = args.project / "artifacts" / "train" / "checkpoints" / "last.pt"
    print(f"machine: {machine()}; env: {' '.join(args.env) or '-'}", flush=True)
    stage = subprocess.Popen(
        [sys.executable, "-m", "stages.train"],
        cwd=args.project,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    began, samples, written = time.perf_counter(), [], []
    try:
        while stage.poll() is None and time.perf_counter() - began < args.seconds:
            rss = anon_mib(stage.pid)
            if rss is not None:
                samples.append((time.perf_counter() - began, rss))
            stamp = checkpoint.stat().st_mtime if checkpoint.exists() else None
            if stamp is not None and (not written or written[-1][1] != stamp):
                written.append((time.perf_counter() - began, stamp))
            time.sleep(1.0)
    finally:
        stage.kill()
        stage.wait()
    marks = range(0, int(samples[-1][0]) + 1, 30) if samples else []
    every30 = [next(f"{t:.0f}s {rss}" for t, rss in samples if t >= mark) for mark in marks]
    print("RssAnon MiB: " + ", ".join(every30))
    print(f"peak RssAnon MiB: {max(rss for _, rss in samples)}")
    print("checkpoints written at: " + ", ".join(f"{t:.0f}s" for t, _ in written))


if __name__ == "__main__":
    main()
