"""Commands that leave processes behind (`dvc queue start`, `eagle3 ui`, servers), run so that no
test can hang on them and none outlives its test. Every test that starts one uses these.

A daemon forked by a command inherits the command's stdout and stderr. Read through pipes
(`capture_output=True`), that output ends only when its last holder exits, so `subprocess.run`
waits for the daemon, not for the command: for `dvc queue start`, until every queue worker
exits, which a worker that misses the empty queue never does (docs/experiments.md, "Leftover
queue workers"). Here output goes to a file, each command starts its own session (so whatever
it leaves behind can be found and ended by pid), and every wait has a timeout.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from eagle3.cli.queue_workers import command_line, is_alive, listed_pids

QUEUE_START_TIMEOUT_S = 120  # `dvc queue start` returns once its workers are spawned
QUEUE_STOP_TIMEOUT_S = 60
QUEUE_START_LOG = "queue-start.log"


def project_env() -> dict[str, str]:
    """The environment tests run project commands in: none of the caller's MLflow or DVC settings,
    this venv's commands first on PATH (DVC's queue workers run `dvc` from it), and no DVC
    analytics daemon (`dvc init` would fork one before the project turns analytics off)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MLFLOW_", "DVC_"))}
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env['PATH']}"
    return env | {"DVC_NO_ANALYTICS": "1"}


def start_detached(
    cmd: list[str], cwd: Path, log: Path, env: dict[str, str] | None = None
) -> subprocess.Popen:
    """Start `cmd` in its own session, stdout and stderr appended to `log`, stdin closed."""
    with open(log, "ab") as out:
        return subprocess.Popen(
            cmd,
            cwd=cwd,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )


def run_detached(
    cmd: list[str], cwd: Path, log: Path, env: dict[str, str] | None = None, timeout: float = 120
) -> subprocess.Popen:
    """Run a command that returns while the daemons it started run on; wait for the command only.
    Its output is in `log`; its session id (= its pid) finds what it left behind."""
    proc = start_detached(cmd, cwd, log, env)
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        end_processes(session_members(proc.pid))
        raise
    return proc


def session_members(sid: int) -> list[int]:
    """Pids of the live processes in session `sid` (Linux /proc), the session leader included."""
    members = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue  # exited while we looked
        if int(fields[3]) == sid and fields[0] != "Z":
            members.append(int(stat.parent.name))
    return sorted(members)


def end_processes(pids: list[int], grace_s: float = 10) -> list[int]:
    """SIGTERM `pids`, SIGKILL those still alive after `grace_s`; returns any that survive both."""
    for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 10)):
        for pid in pids:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + wait_s
        while (pids := [p for p in pids if is_alive(p)]) and time.monotonic() < deadline:
            time.sleep(0.1)
        if not pids:
            break
    return pids


def leftover_queue_processes(project: Path, sessions: list[int]) -> list[int]:
    """Live processes of `project`'s DVC queue: those its pid files list (workers and running
    experiments; a pid file outlives its process, so a reused pid must still be a dvc process),
    and every process still in the sessions the test started."""
    listed = [
        pid
        for pid in listed_pids(project).values()
        if is_alive(pid) and "dvc" in (command_line(pid) or "dvc")
    ]
    return sorted({*listed, *(pid for sid in sessions for pid in session_members(sid))})


def stop_dvc_queue(project: Path, sessions: list[int], env: dict[str, str] | None = None) -> list[int]:
    """Stop the queue for sure: `dvc queue stop --kill`, then end by pid whatever is left.
    Returns the pids that survived even SIGKILL (none, unless something is badly wrong)."""
    cmd = [sys.executable, "-m", "dvc", "queue", "stop", "--kill"]
    stop = start_detached(cmd, project, project / "queue-stop.log", env)
    try:
        stop.wait(timeout=QUEUE_STOP_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        pass  # ended below with the rest of its session
    return end_processes(leftover_queue_processes(project, [*sessions, stop.pid]))


@contextmanager
def dvc_queue_started(
    project: Path, jobs: int, env: dict[str, str] | None = None
) -> Iterator[subprocess.Popen]:
    """`dvc queue start -j jobs` in `project`, output in QUEUE_START_LOG; yields the finished
    command (its pid is the session of the daemon and workers it left). On exit the queue is
    stopped for sure and nothing of it is left alive."""
    log = project / QUEUE_START_LOG
    cmd = [sys.executable, "-m", "dvc", "queue", "start", "-j", str(jobs)]
    proc = run_detached(cmd, project, log, env, timeout=QUEUE_START_TIMEOUT_S)
    try:
        assert proc.returncode == 0, f"dvc queue start failed:\n{log.read_text(errors='replace')}"
        yield proc
    finally:
        left = stop_dvc_queue(project, [proc.pid], env)
        assert not left, f"queue processes survived SIGKILL: {left}"
