"""Start and stop SGLang servers for speculative-eval (eval.backend: sglang without URLs).

SGLang lives in a Python of its own (it pins its own torch), named by eval.sglang_python or
$EAGLE3_SGLANG_PYTHON. Two launches:
  cpu: tools/sglang_cpu/launch_server.py (keeps --attention-backend intel_amx on a CPU without
       AMX) with the pure-torch sgl_kernel of tools/sglang_cpu first on PYTHONPATH;
  gpu: `python -m sglang.launch_server` with SGLang's own kernels and --tp eval.sglang_tp.
Each server runs in its own process group with its output in a log file (never a pipe, which
a chatty server would fill), and is stopped with its whole group.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from eagle3.sglang.server_args import SUPPORTED_VERSIONS

PYTHON_ENV = "EAGLE3_SGLANG_PYTHON"
CPU_TOOLS = Path(__file__).resolve().parents[2] / "tools" / "sglang_cpu"
STARTUP_TIMEOUT_S = 600
# --sleep-on-idle: an idle scheduler otherwise spins a core at 100%, which the other servers
# of the same evaluation need; the prefix cache is off so that every prompt is decoded from a
# full prefill by all three servers, as the hf backend decodes it.
COMMON_ARGS = ["--skip-server-warmup", "--sleep-on-idle", "--disable-radix-cache"]
CPU_ARGS = [
    "--device",
    "cpu",
    "--attention-backend",
    "intel_amx",
    "--disable-overlap-schedule",
    "--disable-cuda-graph",
    "--max-total-tokens",
    "8192",
]
# the last line of a failed start that says why (a loader's exception, an argument error)
_ERROR_LINE = re.compile(r"(Error|Exception|error:)")


class LaunchError(RuntimeError):
    """A server could not be started: one line with the reason and the log's path."""


@dataclass(frozen=True)
class Launch:
    python: str
    kind: str  # "cpu" | "gpu"
    tp: int
    dtype: str
    log_dir: Path

    def command(self, model: str, port: int, extra: list[str]) -> list[str]:
        if self.kind == "cpu":
            head = [self.python, str(CPU_TOOLS / "launch_server.py"), *CPU_ARGS]
        else:
            head = [self.python, "-m", "sglang.launch_server", "--tp", str(self.tp)]
        args = ["--model-path", model, "--host", "127.0.0.1", "--port", str(port), "--dtype", self.dtype]
        return head + args + COMMON_ARGS + extra

    def env(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("MLFLOW_", "DVC_"))}
        if self.kind == "cpu":
            env |= {"SGLANG_USE_CPU_ENGINE": "1", "PYTHONPATH": str(CPU_TOOLS)}
        return env


def sglang_python(configured: str | None) -> str:
    """The Python to run SGLang with: eval.sglang_python, else $EAGLE3_SGLANG_PYTHON."""
    python = configured or os.environ.get(PYTHON_ENV)
    if not python:
        raise LaunchError(
            f"eval.backend sglang starts its servers with a Python that has SGLang: set eval.sglang_python "
            f"or ${PYTHON_ENV} (tools/sglang_cpu/README.md makes one), or give eval.sglang_url and friends"
        )
    if not Path(python).exists():
        raise LaunchError(f"eval.sglang_python: {python} does not exist")
    return python


def installed_version(python: str) -> str:
    """SGLang's version in `python`, read from its package metadata (no import: seconds, not a minute);
    refused unless supported."""
    code = "import importlib.metadata as m; print(m.version('sglang'))"
    done = subprocess.run([python, "-c", code], capture_output=True, text=True, timeout=120)
    version = done.stdout.strip()
    if done.returncode != 0 or not version:
        raise LaunchError(f"{python} has no installed sglang package")
    if version not in SUPPORTED_VERSIONS:
        raise LaunchError(
            f"{python} has SGLang {version}; supported: {', '.join(SUPPORTED_VERSIONS)} (the versions "
            "whose speculative responses are recorded in tests/fixtures/sglang)"
        )
    return version


def free_port() -> int:
    with socket.socket() as s:  # the short race until SGLang binds it is harmless here
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Server:
    """One SGLang server process group and its log."""

    name: str
    command: list[str]
    log: Path
    port: int
    process: subprocess.Popen | None = field(default=None, repr=False)
    started: float = 0.0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, env: dict[str, str]) -> None:
        self.log.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log, "wb") as out:
            self.process = subprocess.Popen(
                self.command, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                env=env, start_new_session=True,
            )  # fmt: skip
        self.started = time.monotonic()

    def reason(self) -> str:
        """The log's last line that names an error (else its last line)."""
        lines = [ln.strip() for ln in self.log.read_text(errors="replace").splitlines() if ln.strip()]
        errors = [ln for ln in lines if _ERROR_LINE.search(ln) and "Warning" not in ln]
        return (errors or lines or ["(empty log)"])[-1][:400]

    def ready(self) -> bool:
        """True once /get_server_info answers; LaunchError when the process has exited."""
        assert self.process is not None
        if self.process.poll() is not None:
            raise LaunchError(
                f"SGLang {self.name} server exited ({self.process.returncode}) while starting: "
                f"{self.reason()} (log: {self.log})"
            )
        try:
            with urllib.request.urlopen(f"{self.url}/get_server_info", timeout=5) as response:
                return response.status == 200
        except OSError:
            return False

    def stop(self) -> None:
        if self.process is not None:
            stop_group(self.process)


def stop_group(process: subprocess.Popen) -> None:
    """SIGTERM to a server's whole process group (launcher, scheduler, detokenizer), SIGKILL
    what is left."""
    for sig, wait in ((signal.SIGTERM, 30), (signal.SIGKILL, 10)):
        try:
            os.killpg(process.pid, sig)
        except ProcessLookupError:
            return
        try:
            process.wait(timeout=wait)
        except subprocess.TimeoutExpired:
            continue
        try:  # the launcher is gone; its children may not be yet
            os.killpg(process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        return


def start_servers(
    launch: Launch, model: str, kinds: dict[str, list[str]], timeout_s: float = STARTUP_TIMEOUT_S
) -> dict[str, Server]:
    """Start one server per kind ({name: extra args}) at once and wait until all answer; on any
    failure stop them all and raise LaunchError."""
    servers: dict[str, Server] = {}
    try:
        for name, extra in kinds.items():
            port = free_port()
            server = Server(
                name, launch.command(model, port, extra), launch.log_dir / f"sglang-{name}.log", port
            )
            server.start(launch.env())
            servers[name] = server
        pending = dict(servers)
        deadline = time.monotonic() + timeout_s
        while pending:
            for name in [n for n, s in pending.items() if s.ready()]:
                del pending[name]
            if pending and time.monotonic() > deadline:
                slow = ", ".join(f"{n} ({s.log})" for n, s in pending.items())
                raise LaunchError(f"SGLang servers did not answer within {timeout_s:.0f} s: {slow}")
            if pending:
                time.sleep(1)
        return servers
    except BaseException:
        stop_servers(servers)
        raise


def stop_servers(servers: dict[str, Server]) -> None:
    for server in servers.values():
        server.stop()


@contextmanager
def terminated_as_exit() -> Iterator[None]:
    """SIGTERM (`dvc queue kill`, a killed job) raises SystemExit inside, so that the servers
    started there are stopped by their `finally`: they run in sessions of their own and would
    outlive this process otherwise."""

    def _exit(signum, frame):
        raise SystemExit(128 + signum)

    try:
        previous = signal.signal(signal.SIGTERM, _exit)
    except ValueError:  # not the main thread: leave signals alone
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
