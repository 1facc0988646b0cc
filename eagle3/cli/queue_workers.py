"""DVC queue workers that outlive their queue.

`dvc queue start -j N` leaves N worker processes (`dvc exp queue-worker ...`), each listed by
pid in `.dvc/tmp/exps/celery/dvc-exp-worker-<n>.pid` (dvc 3.67, dvc-task's ManagedProcess). A
worker should exit once the queue is empty, but DVC's celery worker can miss that and sleep on
for good, holding the daemon that `dvc queue start` forked (and anything reading that daemon's
output). `dvc queue status` then reads "0 active, 0 idle", so the worker goes unseen.
"""

from __future__ import annotations

import os
from pathlib import Path

WORKER_PID_DIR = Path(".dvc/tmp/exps/celery")  # worker pid files; the file outlives the worker
RUN_PID_DIR = Path(".dvc/tmp/exps/run")  # one folder per running experiment, <rev>/<rev>.pid


def dvc_root(start: str | Path = ".") -> Path | None:
    """The DVC project holding `start` (the nearest folder up with a .dvc/), or None."""
    here = Path(start).resolve()
    for folder in (here, *here.parents):
        if (folder / ".dvc").is_dir():
            return folder
    return None


def is_alive(pid: int) -> bool:
    """True while `pid` runs (a zombie, dead but not yet reaped, counts as gone)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's process: alive, not ours
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True  # no /proc (macOS): kill(0) is all there is
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def command_line(pid: int) -> str | None:
    """The process's arguments joined by spaces, or None where /proc cannot tell."""
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return None


def listed_pids(root: Path) -> dict[Path, int]:
    """Every pid file DVC's queue keeps under `root` (workers and running experiments): {file: pid}."""
    files = [*(root / WORKER_PID_DIR).glob("*.pid"), *(root / RUN_PID_DIR).glob("*/*.pid")]
    pids = {}
    for path in files:
        try:
            pids[path] = int(path.read_text().strip())
        except (OSError, ValueError):
            continue  # being rewritten, or not a pid
    return pids


def live_workers(root: Path) -> list[int]:
    """Pids of queue workers listed under `root` that still run. A pid file outlives its worker,
    so where /proc tells, the process must also be a queue worker (the pid may have been reused)."""
    pids = []
    for path, pid in listed_pids(root).items():
        if path.parent != root / WORKER_PID_DIR or not is_alive(pid):
            continue
        args = command_line(pid)
        if args is None or "queue-worker" in args:
            pids.append(pid)
    return sorted(pids)


def queue_is_idle(root: Path) -> bool:
    """No experiment queued or running in `root`'s DVC queue (read from its files, as
    `dvc queue status` does)."""
    from dvc.exceptions import DvcException  # slow import, needed only when a worker is alive
    from dvc.repo import Repo

    try:
        with Repo(str(root)) as repo:
            queue = repo.experiments.celery_queue
            queued = next(iter(queue.iter_queued()), None)
            return queued is None and next(iter(queue.iter_active()), None) is None
    except (DvcException, OSError):
        return False  # no queue to read (e.g. a project without git): nothing to warn about


def leftover_worker_warning(start: str | Path = ".") -> str | None:
    """One line for the user when a queue worker still runs with nothing left to run, else None."""
    root = dvc_root(start)
    if root is None:
        return None
    pids = live_workers(root)
    if not pids or not queue_is_idle(root):
        return None
    listed = " ".join(map(str, pids))
    return (
        f"a DVC queue worker is still alive with nothing queued or running (pid {listed}): "
        f"`dvc queue stop` ends it; if it stays, `kill {listed}`"
    )
