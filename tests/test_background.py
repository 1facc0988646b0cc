"""Commands that leave processes behind (tests/background.py): why reading their output through
pipes hangs, that the suite's helpers do not, and that a real DVC queue stopped mid-experiment
leaves nothing alive."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest
from background import (
    QUEUE_START_LOG,
    dvc_queue_started,
    end_processes,
    leftover_queue_processes,
    project_env,
    run_detached,
    session_members,
)

from eagle3.cli.queue_workers import RUN_PID_DIR, is_alive, leftover_worker_warning, listed_pids

pytestmark = pytest.mark.slow

# What `dvc queue start` does, reduced: start a daemon that inherits stdout and stderr, then exit.
DAEMONIZING = """
import pathlib, subprocess, sys
daemon = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
pathlib.Path(sys.argv[1]).write_text(str(daemon.pid))
print("started", daemon.pid, flush=True)
"""


@pytest.fixture
def daemonizing(tmp_path) -> tuple[list[str], Path]:
    script = tmp_path / "daemonizing.py"
    script.write_text(DAEMONIZING)
    pid_file = tmp_path / "daemon.pid"
    yield [sys.executable, str(script), str(pid_file)], pid_file
    if pid_file.exists():  # whatever a failed assertion left running
        end_processes([int(pid_file.read_text())])


def test_captured_output_of_a_daemonizing_command_never_ends(daemonizing):
    cmd, pid_file = daemonizing
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert proc.wait(timeout=60) == 0  # the command itself is done...
    with pytest.raises(subprocess.TimeoutExpired):
        proc.communicate(timeout=3)  # ...but the daemon holds its pipes open: no EOF, ever
    daemon = int(pid_file.read_text())
    assert is_alive(daemon)
    assert end_processes([daemon]) == []
    proc.communicate(timeout=10)  # the daemon gone, the pipes close
    # what the suite did for `dvc queue start`: subprocess.run waits on the pipes, so it blocks
    with pytest.raises(subprocess.TimeoutExpired):
        subprocess.run(cmd, capture_output=True, timeout=3)
    assert end_processes([int(pid_file.read_text())]) == []


def test_the_helper_returns_when_the_command_does_and_ends_what_it_left(daemonizing, tmp_path):
    cmd, pid_file = daemonizing
    log = tmp_path / "out.log"
    proc = run_detached(cmd, tmp_path, log, timeout=60)  # would raise TimeoutExpired if it blocked
    daemon = int(pid_file.read_text())
    assert proc.returncode == 0 and log.read_text() == f"started {daemon}\n"
    assert session_members(proc.pid) == [daemon]  # left behind, in the command's own session
    assert end_processes(session_members(proc.pid)) == []
    assert not is_alive(daemon) and session_members(proc.pid) == []


HANGING = """
import subprocess, sys
import pytest


@pytest.mark.timeout(3)
def test_reads_a_daemons_pipes():
    subprocess.run({cmd!r}, capture_output=True)


def test_next():
    pass
"""


def test_a_hung_test_fails_by_name_and_the_run_goes_on(daemonizing, tmp_path):
    """The suite's timeout settings (pyproject.toml) on a test that hangs as the sweep did."""
    cmd, pid_file = daemonizing
    (tmp_path / "test_hanging.py").write_text(HANGING.format(cmd=cmd))
    config = Path(__file__).resolve().parents[1] / "pyproject.toml"
    pytest_cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-c", str(config)]
    pytest_cmd += ["--rootdir", str(tmp_path), "test_hanging.py"]
    log = tmp_path / "pytest.log"
    proc = run_detached(pytest_cmd, tmp_path, log, project_env(), timeout=300)
    out = log.read_text()
    assert proc.returncode == 1, out
    assert "FAILED test_hanging.py::test_reads_a_daemons_pipes" in out
    assert "Failed: Timeout (>3.0s) from pytest-timeout" in out
    assert "1 failed, 1 passed" in out  # the run went on past it
    assert end_processes(session_members(proc.pid)) == []  # the daemon, in pytest's session


NAP = """stages:
  nap:
    cmd: python -c "import time; time.sleep(600)" && echo done > out.txt
    params: [n]
    outs: [out.txt]
"""


def dvc(project: Path, *args: str) -> str:
    done = subprocess.run(
        [sys.executable, "-m", "dvc", *args],
        cwd=project,
        env=project_env(),
        capture_output=True,  # these commands leave no process behind (not `queue start`)
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, f"dvc {args} failed:\n{done.stdout}\n{done.stderr}"
    return done.stdout


def test_a_queue_stopped_mid_experiment_leaves_nothing_alive(tmp_path):
    """Real DVC: one queued experiment that sleeps; the worker runs it; the helper's teardown
    (`dvc queue stop --kill`, then the pid files and the session, by pid) ends every process."""
    project = tmp_path / "project"
    project.mkdir()
    (project / "dvc.yaml").write_text(NAP)
    (project / "params.yaml").write_text("n: 1\n")
    env = project_env()
    for cmd in (
        ["init", "-q"],
        ["config", "user.email", "ci@example.com"],
        ["config", "user.name", "ci"],
    ):
        subprocess.run(["git", *cmd], cwd=project, check=True, timeout=60)
    dvc(project, "init", "-q")
    dvc(project, "config", "core.analytics", "false")
    subprocess.run(["git", "add", "-A"], cwd=project, check=True, timeout=60)
    subprocess.run(["git", "commit", "-qm", "nap"], cwd=project, check=True, timeout=60)
    assert "Queued experiment" in dvc(project, "exp", "run", "--queue", "-S", "n=2")

    with dvc_queue_started(project, 1, env) as started:
        deadline = time.monotonic() + 300
        running: list[int] = []
        while not running and time.monotonic() < deadline:
            running = [
                pid
                for path, pid in listed_pids(project).items()
                if path.is_relative_to(project / RUN_PID_DIR) and is_alive(pid)
            ]
            time.sleep(0.5)
        log = (project / QUEUE_START_LOG).read_text(errors="replace")
        assert running, f"the experiment did not start within 300 s:\n{log}"
        assert session_members(started.pid), "dvc queue start left no daemon in its session"
        # a worker busy with an experiment is no leftover: `eagle3 compare` stays quiet
        assert leftover_worker_warning(project) is None
    assert leftover_queue_processes(project, [started.pid]) == []
    assert not any(is_alive(pid) for pid in listed_pids(project).values())
