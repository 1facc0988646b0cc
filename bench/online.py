"""Offline against online features, one run after the other on this machine: the real stages in
a scratch project, each stage in its own process.

    python -m bench.online [--preset curve] [-S data.num_samples=2900 ...] [--modes store,online]
                           [--eval] [--workdir DIR]

Modes, run in the order given after dtypes and patch-check: store (extract.features: store, the
bf16 store), fp8 (a store with extract.store_dtype: float8_e4m3fn), online (tokens only; train
computes the features). Each runs extract, vocab-map and train. Prints per mode the bytes the
extraction left on disk, extract and train wall time, training tokens/s, the train stage's peak
RSS, held-out top-1 and the drafter's md5; then each mode against the first: train time against
its extract + train, throughput per trained token against the no-overlap bound
1 / (1/extract rate + 1/train rate), disk and peak RSS. With --eval, speculative-eval (the
params' eval section) runs on each distinct drafter (by md5).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import yaml

from eagle3.core.device import machine

REPO = Path(__file__).resolve().parents[1]
# runs a stage module in this process and prints the process's peak RSS when it exits: VmHWM,
# since getrusage's ru_maxrss is carried across exec (a child would report at least this
# bench's own peak)
PEAK = (
    "import atexit, runpy, sys\n"
    "def peak():\n"
    "    hwm = [l for l in open('/proc/self/status') if l.startswith('VmHWM:')][0].split()[1]\n"
    "    print(f'PEAK_RSS_KB {hwm}', file=sys.stderr)\n"
    "atexit.register(peak)\n"
    "runpy.run_module(sys.argv[1], run_name='__main__', alter_sys=True)\n"
)


def make_project(workdir: Path, overrides: dict[str, object]) -> Path:
    """A scratch project: this repo's stage code and params.yaml with the overrides applied."""
    project = workdir / "project"
    if project.exists():
        shutil.rmtree(project)
    for name in ("eagle3", "stages", "tools"):
        shutil.copytree(REPO / name, project / name, ignore=shutil.ignore_patterns("__pycache__"))
    params = yaml.safe_load((REPO / "params.yaml").read_text())
    for key, value in overrides.items():
        section, name = key.split(".", 1)
        params[section][name] = value
    params["tracking"]["enabled"] = False
    (project / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    return project


def run_stage(project: Path, stage: str) -> tuple[float, int]:
    """(wall seconds, peak RSS in bytes) of one stage; raises with its stderr if it fails."""
    began = time.perf_counter()
    done = subprocess.run(
        [sys.executable, "-c", PEAK, f"stages.{stage}"], cwd=project, capture_output=True, text=True
    )
    seconds = time.perf_counter() - began
    if done.returncode != 0:
        raise RuntimeError(f"{stage} failed:\n{done.stderr[-3000:]}")
    peak = [line for line in done.stderr.splitlines() if line.startswith("PEAK_RSS_KB ")]
    return seconds, int(peak[-1].split()[1]) * 1024


def folder_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


def md5(path: Path) -> str:
    return hashlib.md5(path.read_bytes()).hexdigest()


MODES = {
    "store": {"features": "store", "store_dtype": "bfloat16"},
    "fp8": {"features": "store", "store_dtype": "float8_e4m3fn"},
    "online": {"features": "online", "store_dtype": "bfloat16"},
}


def set_features(project: Path, mode: str) -> None:
    params = yaml.safe_load((project / "params.yaml").read_text())
    params["extract"] |= MODES[mode]
    params["eval"]["drafter"] = None  # the train stage's
    (project / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))


def one_mode(project: Path, mode: str) -> dict:
    set_features(project, mode)
    shutil.rmtree(project / "artifacts" / "train", ignore_errors=True)  # no resume across modes
    extract_s, _ = run_stage(project, "extract")
    stored = folder_bytes(project / "artifacts" / "extract")
    run_stage(project, "vocab_map")
    train_s, rss = run_stage(project, "train")
    metrics = json.loads((project / "metrics" / "train.json").read_text())
    epochs = yaml.safe_load((project / "params.yaml").read_text())["train"]["epochs"]
    drafter = project / "artifacts" / "train" / "drafter"
    kept = project.parent / f"drafter-{mode}"
    shutil.rmtree(kept, ignore_errors=True)
    shutil.copytree(drafter, kept)
    return {
        "mode": mode,
        "extract_s": extract_s,
        "bytes": stored,
        "train_s": train_s,
        "tokens": metrics["train_tokens"],
        "epochs": epochs,
        "tokens_per_s": metrics["train_tokens_per_s"],
        "peak_rss": rss,
        "heldout_acc_0": metrics["heldout_acc_0"],
        "md5": md5(drafter / "model.safetensors"),
        "drafter": kept,
    }


def evaluate(project: Path, drafter: Path) -> dict:
    params = yaml.safe_load((project / "params.yaml").read_text())
    params["eval"]["drafter"] = str(drafter)
    (project / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    run_stage(project, "speculative_eval")
    return json.loads((project / "metrics" / "speculative-eval.json").read_text())


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--preset", help="a presets/NAME.yaml applied first (e.g. curve)")
    parser.add_argument("-S", "--set-param", action="append", default=[], metavar="K=V")
    parser.add_argument("--modes", default="store,online", help=f"comma-separated, of {', '.join(MODES)}")
    parser.add_argument("--eval", action="store_true", help="speculative-eval of the drafter(s) too")
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/eagle3-bench-online"))
    args = parser.parse_args()
    modes = args.modes.split(",")
    if unknown := [m for m in modes if m not in MODES]:
        parser.error(f"--modes: {', '.join(unknown)} unknown (allowed: {', '.join(MODES)})")

    overrides: dict[str, object] = {}
    if args.preset:
        preset = yaml.safe_load((REPO / "presets" / f"{args.preset}.yaml").read_text())
        overrides |= {f"{s}.{k}": v for s, values in preset.items() for k, v in values.items()}
    for item in args.set_param:
        key, _, value = item.partition("=")
        overrides[key] = yaml.safe_load(value)
    print(f"machine: {machine()}; overrides: {overrides}", flush=True)
    project = make_project(args.workdir, overrides)
    for stage in ("dtypes", "patch_check"):
        run_stage(project, stage)
    rows = [one_mode(project, mode) for mode in modes]
    for r in rows:
        print(
            f"{r['mode']:>6}: extract {r['extract_s']:7.1f} s, {r['bytes'] / 2**20:9.1f} MiB on disk; "
            f"train {r['train_s']:7.1f} s ({r['tokens']:,} tokens x {r['epochs']} epochs, "
            f"{r['tokens_per_s']:,.0f} tok/s), peak RSS {r['peak_rss'] / 2**30:.2f} GiB; "
            f"held-out top-1 {r['heldout_acc_0']:.4f}; drafter md5 {r['md5']}",
            flush=True,
        )
    first = rows[0]
    trained = first["tokens"] * first["epochs"]
    extract_rate = first["tokens"] / first["extract_s"]  # per training token: the store's tokens
    bound = 1 / (1 / extract_rate + 1 / (trained / first["train_s"]))
    for r in rows[1:]:
        print(
            f"{r['mode']} against {first['mode']}: train / ({first['mode']} extract + train) "
            f"{r['train_s'] / (first['extract_s'] + first['train_s']):.3f}; "
            f"rate {trained / r['train_s']:,.0f} tok/s / no-overlap bound {bound:,.0f} = "
            f"{trained / r['train_s'] / bound:.3f}; disk {r['bytes'] / first['bytes']:.5f}; "
            f"peak RSS {r['peak_rss'] / first['peak_rss']:.2f}; "
            f"same drafter bytes: {r['md5'] == first['md5']}",
            flush=True,
        )
    if args.eval:
        seen: set[str] = set()
        for r in rows:
            if r["md5"] in seen:
                continue
            seen.add(r["md5"])
            m = evaluate(project, r["drafter"])
            print(
                f"speculative-eval ({r['mode']} drafter): acceptance {m['acceptance_length']:.3f} "
                f"{m.get('acceptance_length_ci')}, speedup {m['speedup']:.3f} {m.get('speedup_ci')}, "
                f"prompt lookup {m.get('prompt_lookup_speedup')}",
                flush=True,
            )


if __name__ == "__main__":
    main()
