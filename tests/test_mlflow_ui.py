"""`eagle3 ui` serves the repo's tracking store: a real MLflow server on a free port, runs logged
by the stages' own tracking code, read back over the REST API and seen in headless Chromium."""

from __future__ import annotations

import json
import shutil
import socket
import sys
import time
import urllib.request
from pathlib import Path

import pytest
import yaml
from background import end_processes, project_env, run_detached, session_members, start_detached

from eagle3.core.params import load_params
from eagle3.core.tracking import pipeline_run

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[1]
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
RUNS = {"sweep-4096": (4096, 0.21, 10.5), "sweep-32768": (32768, 0.27, 9.75)}


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def get_json(url: str, body: dict | None = None) -> dict:
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=30) as response:
        return json.loads(response.read())


def log_runs(project: Path, monkeypatch) -> None:
    """Two runs as two DVC experiments would make them: the tracking code the stages use."""
    monkeypatch.chdir(project)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.setenv("DVC_ROOT", str(project))
    for name, (size, rate, tok_s) in RUNS.items():
        params = yaml.safe_load((REPO / "params.yaml").read_text())
        params["vocab"]["size"] = size
        (project / "params.yaml").write_text(yaml.safe_dump(params))
        monkeypatch.setenv("DVC_EXP_NAME", name)
        with pipeline_run(load_params("params.yaml"), "speculative-eval") as run:
            run.log_metrics({"acceptance_rate": rate, "tokens_per_s": tok_s, "speedup": 1.0 + rate})


@pytest.fixture
def server(tmp_path, monkeypatch):
    log_runs(tmp_path, monkeypatch)
    port = free_port()
    # the documented command; output to a file (the server's workers inherit it) and its own
    # session, so that the server and every worker of it are ended by pid afterwards
    log = tmp_path / "ui.log"
    proc = start_detached(
        [sys.executable, "-m", "eagle3.cli", "ui", "--port", str(port)], tmp_path, log, project_env()
    )
    url = f"http://127.0.0.1:{port}"
    try:
        for _ in range(180):
            try:
                with urllib.request.urlopen(f"{url}/health", timeout=2):
                    break
            except OSError:
                if proc.poll() is not None:
                    raise AssertionError(f"eagle3 ui exited: {log.read_text(errors='replace')}") from None
                time.sleep(0.5)
        else:
            raise AssertionError("eagle3 ui did not answer on /health within 90 s")
        yield url
    finally:
        assert end_processes(session_members(proc.pid)) == []
        proc.wait(timeout=30)


@pytest.mark.skipif(CHROMIUM is None, reason="chromium is not installed (apt-get install -y chromium)")
def test_ui_serves_the_runs_over_rest_and_in_a_browser(server, tmp_path):
    experiment = get_json(f"{server}/api/2.0/mlflow/experiments/get-by-name?experiment_name=eagle3")
    experiment_id = experiment["experiment"]["experiment_id"]
    found = get_json(f"{server}/api/2.0/mlflow/runs/search", {"experiment_ids": [experiment_id]})
    runs = {r["info"]["run_name"]: r["data"] for r in found["runs"]}
    assert set(runs) == set(RUNS)
    for name, (size, rate, tok_s) in RUNS.items():
        params = {p["key"]: p["value"] for p in runs[name]["params"]}
        metrics = {m["key"]: m["value"] for m in runs[name]["metrics"]}
        assert params["vocab.size"] == str(size)
        assert metrics["acceptance_rate"] == pytest.approx(rate)
        assert metrics["tokens_per_s"] == pytest.approx(tok_s)

    # the experiment page is a single-page app: the runs arrive by XHR after load, so let
    # Chromium's virtual clock run until they have rendered
    page = f"{server}/#/experiments/{experiment_id}/runs"
    dom = ""
    for budget_ms in (10_000, 30_000):
        # the DOM to a file, in its own session: Chromium's helpers (crashpad handler, zygote)
        # may outlive the browser holding its output, and are ended by pid
        out = tmp_path / f"dom-{budget_ms}.html"
        browser = run_detached(
            [
                CHROMIUM,
                "--headless",
                "--no-sandbox",  # tests may run as root in a container
                "--disable-gpu",
                "--disable-dev-shm-usage",
                f"--user-data-dir={tmp_path / 'chromium'}",
                f"--virtual-time-budget={budget_ms}",
                "--dump-dom",
                page,
            ],
            tmp_path,
            out,
            timeout=180,
        )
        assert end_processes(session_members(browser.pid)) == []
        dom = out.read_text(errors="replace")
        if all(name in dom for name in RUNS):
            break
    missing = [name for name in RUNS if name not in dom]
    assert not missing, f"run names {missing} not on {page} ({len(dom)} bytes of DOM)"
