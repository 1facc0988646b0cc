"""Fault harness: break a tiny real project on purpose and count what survives.

    python tests/fault_harness.py [--points 10] [--seed 0] [--quick]

On a tiny project (the real SmolLM2 target, 16 real ShareGPT conversations, the real stage
code run as DVC runs it: `python -m stages.<name>` in the project folder) it injects:

- SIGKILL of `extract` and `train` at seeded random moments, then a re-run: the resumed
  outputs must equal an uninterrupted run's byte for byte (shards, manifest, drafter weights);
- SIGKILL of `vocab-map` and `speculative-eval` while they replace earlier outputs: every file
  must afterwards be the earlier version or the new complete one, never half-written, and a
  mix of the two must be refused by the stage that reads it;
- an MLflow store that is unreachable (a closed local port) or locked (another process holds
  the sqlite file): the stage's outputs and metrics are still written, the failure is one line;
- a full disk while extracting (a per-file write limit, and where the harness may mount one, a
  small tmpfs): one clear error, no half-written shard, and the re-run resumes to the same bytes;
- the repo's tests that corrupt stored data, queue two experiments at once, and feed bad inputs
  (`pytest` on tests/test_corruption.py, tests/test_report_sweep.py, tests/test_bad_inputs.py).

Prints one row per fault kind: injected, survived, data lost (must be 0). `--quick` is the
subset tests/test_faults.py runs in the default suite (one point each, no pytest rows). The tests
import it as a module (`import fault_harness as faults`): tests/test_faults.py, test_online.py and
test_failed_stages.py start from its tiny project with patch-check, extract and vocab-map run
(build_stages, once per session: conftest.py's faults_stages).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import resource
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from eagle3.core.pipeline import FEATURES
from eagle3.core.stage_commit import STAGE_OUTPUTS
from eagle3.core.stageio import sha256_file
from eagle3.data.store import work_folder

REPO = Path(__file__).resolve().parents[1]
SHAREGPT = REPO / "tests" / "fixtures" / "sharegpt-48.jsonl"
# Small enough that one stage run is seconds, big enough for 8 shards and 8 train checkpoints.
TINY = {
    "target": {"dtype": "float32"},
    "data": {"source": str(SHAREGPT), "num_samples": 16, "max_length": 64},
    "extract": {"shard_samples": 2, "batch_tokens": 128, "pack_weights": False},
    "vocab": {"size": 500},
    "train": {"dtype": "float32", "batch_size": 2, "seq_len": 64, "epochs": 3, "checkpoint_every": 3},
    "eval": {"domains": {"chat": 1}, "max_new_tokens": 16, "dtype": "float32", "drafter_dtype": "float32"},
    "tracking": {"enabled": False},
}
EXTRACT = FEATURES.as_posix()
EXTRACT_WORK = work_folder(FEATURES).as_posix()  # its shards and journal until a run completes
# No wait is unbounded: a stage of the tiny project takes seconds, a pytest file minutes.
STAGE_TIMEOUT_S = 900
PYTEST_TIMEOUT_S = 3600
VOCAB_OUTPUTS = list(STAGE_OUTPUTS["vocab-map"])
EVAL_OUTPUTS = ["artifacts/speculative-eval", "metrics/speculative-eval.json", "plots/acceptance.csv"]


@dataclass
class Tally:
    kind: str
    injected: int = 0
    survived: int = 0
    lost: int = 0
    notes: list[str] = field(default_factory=list)

    def add(self, survived: bool, lost: bool = False, note: str = "") -> None:
        self.injected += 1
        self.survived += survived
        self.lost += lost
        if note:
            self.notes.append(note)


# ---------------------------------------------------------------- the tiny project


def write_params(project: Path, **overrides: dict) -> None:
    params = yaml.safe_load((REPO / "params.yaml").read_text())
    for section, values in TINY.items():
        params[section].update(values)
    for section, values in overrides.items():
        params[section].update(values)
    (project / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))


def make_project(root: Path) -> Path:
    """A project folder holding this repo's stage code and tiny params."""
    project = root / "project"
    for name in ("eagle3", "stages"):
        shutil.copytree(REPO / name, project / name, ignore=shutil.ignore_patterns("__pycache__"))
    write_params(project)
    return project


def env_for(extra: dict[str, str] | None = None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MLFLOW_", "DVC_"))}
    return env | (extra or {})


def start(project: Path, stage: str, env: dict[str, str] | None = None, preexec=None) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", f"stages.{stage}"],
        cwd=project,
        env=env_for(env),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=preexec,
    )


def run(
    project: Path, stage: str, env: dict[str, str] | None = None, preexec=None
) -> subprocess.CompletedProcess:
    proc = start(project, stage, env, preexec)
    try:
        out, err = proc.communicate(timeout=STAGE_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        raise
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def must_run(project: Path, stage: str, env: dict[str, str] | None = None) -> None:
    done = run(project, stage, env)
    if done.returncode != 0:
        raise RuntimeError(f"stage {stage} failed in {project}:\n{done.stderr[-3000:]}")


def build_stages(root: Path) -> Path:
    """The tiny project (TINY) with patch-check, extract and vocab-map run."""
    project = make_project(root)
    for stage in ("patch_check", "extract", "vocab_map"):
        must_run(project, stage)
    return project


def copy_project(built: Path, root: Path) -> Path:
    """A copy of a built project for a test to change (files and mtimes as they were)."""
    return Path(shutil.copytree(built, root / "project", copy_function=shutil.copy2))


TIMINGS = ("per_s", "speedup", "_ms", "seconds")  # metric keys measured in wall time


def _without_timings(value):
    if isinstance(value, dict):
        return {k: _without_timings(v) for k, v in value.items() if not any(t in k for t in TIMINGS)}
    return value


def content_digest(path: Path) -> str:
    """sha256 of a file; of a metrics JSON, sha256 of what is not a timing: two complete runs of
    speculative-eval differ in their measured speeds, and either one is a whole version."""
    if path.parent.name == "metrics" and path.suffix == ".json":
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError):
            return sha256_file(path)  # a torn file: its bytes, which match no complete version
        return hashlib.sha256(json.dumps(_without_timings(data), sort_keys=True).encode()).hexdigest()
    return sha256_file(path)


def digests(project: Path, paths: list[str]) -> dict[str, str]:
    """Content digest of every file under the given paths (relative names); hidden temp files included."""
    out = {}
    for rel in paths:
        base = project / rel
        if base.is_file():
            files = [base]
        else:
            files = sorted(p for p in base.rglob("*") if p.is_file()) if base.exists() else []
        for f in files:
            out[str(f.relative_to(project))] = content_digest(f)
    return out


def remove(project: Path, paths: list[str]) -> None:
    for rel in paths:
        path = project / rel
        if path.is_dir():
            shutil.rmtree(path)
        elif path.exists():
            path.unlink()


def snapshot(project: Path, paths: list[str], into: Path) -> None:
    remove(into, paths)
    for rel in paths:
        src, dst = project / rel, into / rel
        if src.is_dir():
            shutil.copytree(src, dst)
        elif src.exists():
            dst.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dst)


def timed_reference(project: Path, stage: str, watch: str) -> tuple[float, float]:
    """Run `stage` uninterrupted; return (seconds until `watch` first holds a file, total seconds):
    the window in which a kill lands in the stage's real work rather than in its imports."""
    began = time.monotonic()
    proc = start(project, stage)
    first = None
    while proc.poll() is None:
        _within_timeout(proc, began)
        if first is None and (project / watch).exists() and any((project / watch).rglob("*")):
            first = time.monotonic() - began
        time.sleep(0.02)
    total = time.monotonic() - began
    if proc.returncode != 0:
        raise RuntimeError(f"reference {stage} failed:\n{proc.stderr.read()[-3000:]}")
    return (first if first is not None else total * 0.5), total


def kill_at(project: Path, stage: str, delay: float) -> bool:
    """Start `stage`, SIGKILL it after `delay` s; False if it finished first (no fault injected)."""
    proc = start(project, stage)
    try:
        proc.wait(timeout=delay)
        return False
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        return True


def _within_timeout(proc: subprocess.Popen, began: float) -> None:
    if time.monotonic() - began > STAGE_TIMEOUT_S:
        proc.kill()
        proc.wait()
        raise subprocess.TimeoutExpired(proc.args, STAGE_TIMEOUT_S)


def kill_after_files(project: Path, stage: str, watch: str, count: int) -> bool:
    """Start `stage`, SIGKILL it once `watch` holds `count` files (a point in its progress, not
    in wall time, so a faster or slower machine cannot miss it); False if it finished first."""
    proc, began = start(project, stage), time.monotonic()
    while proc.poll() is None:
        _within_timeout(proc, began)
        if (project / watch).exists() and sum(1 for p in (project / watch).iterdir()) >= count:
            proc.send_signal(signal.SIGKILL)
            proc.wait()
            return True
        time.sleep(0.01)
    return False


def inject_kills(rng: random.Random, window: tuple[float, float], n: int, attempt) -> None:
    """Call `attempt(delay) -> bool` (True = the kill landed) at random delays until `n` kills
    have landed. A run that finished first narrows the window to that delay (the machine was
    faster than during the reference run), so the next draw lands in the real work. Gives up
    after 3n draws."""
    first, total = window
    lo = max(first * 0.8, 0.0)  # a little before the first output: its write is in flight
    landed = 0
    for _ in range(3 * n):
        if landed >= n:
            return
        delay = rng.uniform(lo, max(lo, total * 0.98))
        if attempt(delay):
            landed += 1
        else:
            total = delay


# ---------------------------------------------------------------- faults


def killed_and_resumed(
    project: Path,
    stage: str,
    outputs: list[str],
    watch: str,
    compare: list[str],
    points: int,
    rng: random.Random,
) -> Tally:
    """SIGKILL `stage` at random points; each time a re-run must give the uninterrupted bytes."""
    tally = Tally(f"SIGKILL {stage}, then re-run")
    remove(project, outputs)
    window = timed_reference(project, stage, watch)
    reference = digests(project, compare)

    def attempt(delay: float) -> bool:
        remove(project, outputs)
        if not kill_at(project, stage, delay):
            tally.notes.append(f"{delay:.1f}s: finished before the kill")
            return False
        done = run(project, stage)
        same = done.returncode == 0 and digests(project, compare) == reference
        tally.add(
            same,
            lost=not same,
            note="" if same else f"{delay:.1f}s: rc {done.returncode} {done.stderr[-300:]}",
        )
        return True

    inject_kills(rng, window, points, attempt)
    return tally


def killed_while_replacing(
    project: Path,
    stage: str,
    outputs: list[str],
    change: dict[str, dict],
    points: int,
    rng: random.Random,
    mixed_is_refused,
) -> Tally:
    """SIGKILL `stage` while it replaces its earlier outputs (params changed): every file must be
    the earlier version or the new complete one; a mix must be refused by its reader."""
    tally = Tally(f"SIGKILL {stage} mid-run")
    scratch = project.parent / f"{stage}-old"
    must_run(project, stage)
    old = digests(project, outputs)
    snapshot(project, outputs, scratch)
    write_params(project, **change)
    window = timed_reference(project, stage, outputs[0])
    window = (window[1] * 0.3, window[1])  # its outputs exist from the start: kill anywhere after imports
    new = digests(project, outputs)

    def attempt(delay: float) -> bool:
        snapshot(scratch, outputs, project)
        if not kill_at(project, stage, delay):
            tally.notes.append(f"{delay:.1f}s: finished before the kill")
            return False
        now = digests(project, outputs)
        broken = [f for f, h in now.items() if h not in (old.get(f), new.get(f))] + [
            f for f in old if f not in now and not f.startswith(".")
        ]
        if broken:
            tally.add(False, lost=True, note=f"{delay:.1f}s: {broken}")
        elif now in (old, new):
            tally.add(True)
        else:  # whole files of both runs: the reader must notice
            refused = mixed_is_refused(project)
            tally.add(
                refused,
                lost=not refused,
                note=f"{delay:.1f}s: old/new mix, {'refused' if refused else 'ACCEPTED'}",
            )
        return True

    inject_kills(rng, window, points, attempt)
    snapshot(scratch, outputs, project)
    write_params(project)
    return tally


def mapping_mix_refused(project: Path) -> bool:
    """Train's input check on a vocab-map folder holding files of two runs."""
    from eagle3.core.params import load_params
    from eagle3.train.prepare import prepare_inputs

    try:
        prepare_inputs(
            load_params(project / "params.yaml"),
            project / EXTRACT,
            project / "artifacts/vocab-map",
            project / "artifacts/patch-check/report.json",
        )
    except (ValueError, RuntimeError, FileNotFoundError):
        return True
    return False


def eval_mix_refused(project: Path) -> bool:
    """Eval's outputs are final (nothing reads them back): a mix keeps each file whole and the
    metrics of one run; count it as survived when the metrics file is whole JSON."""
    return isinstance(json.loads((project / "metrics/speculative-eval.json").read_text()), dict)


def one_line_warning(stderr: str) -> bool:
    lines = [line for line in stderr.splitlines() if "MLflow tracking" in line]
    return len(lines) == 1 and "Traceback" not in stderr


def _vocab_map_without_store(project: Path, uri: str, expected: dict, tally: Tally, label: str) -> None:
    """vocab-map against a failing store: exit 0, the same outputs, one warning line."""
    remove(project, VOCAB_OUTPUTS)
    began = time.monotonic()
    done = run(project, "vocab_map", {"MLFLOW_TRACKING_URI": uri})
    same = digests(project, VOCAB_OUTPUTS) == expected
    ok = done.returncode == 0 and same and one_line_warning(done.stderr)
    tally.add(ok, lost=not same, note=f"{label}: {time.monotonic() - began:.0f}s")
    if not ok:
        tally.notes.append(done.stderr[-500:])


def tracking_unavailable(project: Path) -> Tally:
    """vocab-map with MLflow unreachable, then with its sqlite store locked by another process."""
    tally = Tally("MLflow store unreachable / locked")
    write_params(project, tracking={"enabled": True})
    must_run(project, "vocab_map")  # creates the store, so the locked case locks a real one
    expected = digests(project, VOCAB_OUTPUTS)

    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    _vocab_map_without_store(project, f"http://127.0.0.1:{port}", expected, tally, "unreachable")

    store = project / "mlflow.db"
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sqlite3,sys,time; c=sqlite3.connect(sys.argv[1]); "
            "c.execute('BEGIN EXCLUSIVE'); print('locked', flush=True); time.sleep(3600)",
            str(store),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        holder.stdout.readline()
        _vocab_map_without_store(project, f"sqlite:///{store}", expected, tally, "locked")
    finally:
        holder.kill()
        holder.wait()
    write_params(project)
    return tally


def _extract_fails_cleanly(project: Path, done: subprocess.CompletedProcess, reference: dict) -> bool:
    """A clear one-line error, and every file left (in the out or the work folder) is a complete
    file of the reference run."""
    left = digests(project, [EXTRACT, EXTRACT_WORK])
    by_name = {Path(f).name: h for f, h in reference.items()}
    whole = all(by_name.get(Path(f).name) == h for f, h in left.items() if not f.endswith("journal.json"))
    lines = [line for line in done.stderr.splitlines() if "extract failed" in line]
    return done.returncode != 0 and len(lines) == 1 and "Traceback" not in done.stderr and whole


def disk_full(project: Path, tmpfs: bool, extracted: bool = False) -> Tally:
    """Extraction against a per-file size limit (and a small tmpfs where mounting is allowed).
    `extracted`: the project's extraction is an uninterrupted run of its params already (the
    tests' prepared project), the reference as it is; else one is run first."""
    tally = Tally("disk full while extracting")
    if not extracted:
        remove(project, [EXTRACT, EXTRACT_WORK])
        must_run(project, "extract")
    reference = digests(project, [EXTRACT])
    shard_sizes = sorted(p.stat().st_size for p in (project / EXTRACT).glob("shard-*"))

    limit = shard_sizes[len(shard_sizes) // 2]  # smaller shards fit, larger ones do not

    def limited() -> None:
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    remove(project, [EXTRACT, EXTRACT_WORK])
    done = run(project, "extract", preexec=limited)
    clean = _extract_fails_cleanly(project, done, reference)
    resumed = (
        run(project, "extract").returncode == 0 and digests(project, [EXTRACT, EXTRACT_WORK]) == reference
    )
    tally.add(
        clean and resumed, lost=not resumed, note="" if clean else f"file-size limit: {done.stderr[-400:]}"
    )

    if tmpfs:
        # over all of artifacts/: the out and its work folder must share a filesystem (shards
        # move by rename), so the mount holds both, and a copy of what extract reads
        mount, needed, kept = project / "artifacts", ["artifacts/patch-check"], project.parent / "kept"
        remove(project, [EXTRACT, EXTRACT_WORK])
        snapshot(project, needed, kept)
        size = sum(shard_sizes[: len(shard_sizes) // 2]) + 64 * 1024  # + the report and journal
        if (
            subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(mount)]).returncode
            != 0
        ):
            tally.notes.append("tmpfs: mount not permitted, skipped")
            return tally
        try:
            snapshot(kept, needed, project)
            done = run(project, "extract")
            clean = _extract_fails_cleanly(project, done, reference)
            subprocess.run(["mount", "-o", f"remount,size={64 * sum(shard_sizes)}", str(mount)], check=True)
            resumed = (
                run(project, "extract").returncode == 0
                and digests(project, [EXTRACT, EXTRACT_WORK]) == reference
            )
        finally:
            subprocess.run(["umount", str(mount)])
        tally.add(clean and resumed, lost=not resumed, note="" if clean else f"tmpfs: {done.stderr[-400:]}")
    return tally


def pytest_rows(files: dict[str, str]) -> list[Tally]:
    """The repo's own fault tests: each test is one fault tried (collected, then run)."""
    rows = []
    for kind, test_file in files.items():
        # output to a file, not pipes, in its own session: tests/test_report_sweep.py starts a DVC
        # queue, whose daemon would hold pipes open after pytest is done (a queue worker can miss
        # the empty queue and never exit: docs/experiments.md, "Leftover queue workers")
        with tempfile.TemporaryFile("w+") as out:
            subprocess.run(
                [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rA", test_file],
                cwd=REPO,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                timeout=PYTEST_TIMEOUT_S,
            )
            out.seek(0)
            report = out.read()
        passed = sum(line.startswith("PASSED ") for line in report.splitlines())
        failed = sum(line.startswith(("FAILED ", "ERROR ")) for line in report.splitlines())
        tally = Tally(kind, injected=passed + failed, survived=passed, lost=failed)
        if failed:
            tally.notes.append(report[-800:])
        rows.append(tally)
    return rows


def harness(points: int, seed: int, quick: bool, workdir: Path) -> list[Tally]:
    rng = random.Random(seed)
    project = build_stages(workdir)
    rows = [
        killed_and_resumed(
            project, "extract", [EXTRACT, EXTRACT_WORK], EXTRACT_WORK, [EXTRACT, EXTRACT_WORK], points, rng
        ),
        killed_and_resumed(
            project,
            "train",
            ["artifacts/train"],
            "artifacts/train/checkpoints",
            ["artifacts/train/drafter"],
            points,
            rng,
        ),
        killed_while_replacing(
            project,
            "vocab_map",
            VOCAB_OUTPUTS,
            {"vocab": {"size": 400}},
            max(1, points // 2),
            rng,
            mapping_mix_refused,
        ),
        killed_while_replacing(
            project,
            "speculative_eval",
            EVAL_OUTPUTS,
            {"eval": {"max_new_tokens": 24}},
            max(1, points // 2),
            rng,
            eval_mix_refused,
        ),
        tracking_unavailable(project),
        disk_full(project, tmpfs=os.geteuid() == 0 and not quick),
    ]
    if not quick:
        rows += pytest_rows(
            {
                "stored data corrupted (tests/test_corruption.py)": "tests/test_corruption.py",
                "2 queued experiments at once (tests/test_report_sweep.py)": "tests/test_report_sweep.py",
                "bad inputs: exit 2, one line (tests/test_bad_inputs.py)": "tests/test_bad_inputs.py",
            }
        )
    return rows


def print_table(rows: list[Tally]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title="faults injected on a tiny real project")
    for col in ("fault", "injected", "survived", "data lost"):
        table.add_column(col, justify="left" if col == "fault" else "right")
    for row in rows:
        table.add_row(row.kind, str(row.injected), str(row.survived), str(row.lost))
    console = Console()
    console.print(table)
    for row in rows:
        for note in row.notes:
            console.print(f"  {row.kind}: {note}", highlight=False, soft_wrap=True)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--points", type=int, default=10, help="kill points per stage")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help="the default suite's subset")
    args = parser.parse_args()
    from eagle3.core.device import machine

    print(f"machine: {machine()}")
    with tempfile.TemporaryDirectory(prefix="eagle3-faults-") as tmp:
        rows = harness(args.points, args.seed, args.quick, Path(tmp))
    print_table(rows)
    sys.exit(0 if all(r.lost == 0 and r.survived == r.injected for r in rows) else 1)


if __name__ == "__main__":
    main()
