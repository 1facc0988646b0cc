"""Online features from two real SGLang 0.5.23 servers under torchrun (optional, CPU-only).

Two aux-mode servers (tests/test_sglang_live.py's launch, ~3.7 GB each) behind a recording
proxy each, so the test sees every request. The same project trains its drafter twice with two
processes (torchrun, gloo): from a store extracted from the servers, then online, each rank
asking the servers for its own rows' features while it trains. Online training must ask for
every sample once per epoch (each training row by the rank that owns it, each held-out row by
rank 0) and nothing twice, spread over both servers, and write the store's drafter. The servers
also load the project's --forward-hooks factory, and the online training runs a second time with
the rows handed over as bytes (extract.sglang_transport: hook): again each row once, the same
drafter.

Skipped unless EAGLE3_SGLANG_PYTHON names a python with sglang 0.5.23 (tools/sglang_cpu).
"""

from __future__ import annotations

import json
import threading
import urllib.error
import urllib.request
from collections import Counter
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from test_online import CHECKPOINTS, DRAFTER, drafter_bytes
from test_sglang_hook_live import hook_spec
from test_sglang_live import (
    AUX_ARGS,
    LiveServer,
    conversations,
    live_params,
    make_project,
    pytestmark,  # noqa: F401 (skipped without the SGLang python; the live timeout)
    run_ok,
)

from eagle3.data.store import FeatureStore

SAMPLES = 8


class RecordingProxy(ThreadingHTTPServer):
    """Forwards every request to `upstream` unchanged and keeps the /generate bodies."""

    daemon_threads = True

    def __init__(self, upstream: str):
        super().__init__(("127.0.0.1", 0), _Forward)
        self.upstream, self.generated, self.lock = upstream, [], threading.Lock()
        self.url = f"http://127.0.0.1:{self.server_address[1]}"
        threading.Thread(target=self.serve_forever, daemon=True).start()

    def taken(self) -> list[dict]:
        """The /generate bodies so far, and a fresh record from here on."""
        with self.lock:
            bodies, self.generated = self.generated, []
        return bodies


class _Forward(BaseHTTPRequestHandler):
    server: RecordingProxy

    def log_message(self, *args) -> None:  # quiet
        pass

    def _forward(self, body: bytes | None) -> None:
        request = urllib.request.Request(self.server.upstream + self.path, data=body, method=self.command)
        request.add_header("Content-Type", self.headers.get("Content-Type", "application/json"))
        try:
            with urllib.request.urlopen(request, timeout=600) as response:
                status, payload = response.status, response.read()
        except urllib.error.HTTPError as err:
            status, payload = err.code, err.read()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)

    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        self._forward(None)

    def do_POST(self) -> None:  # noqa: N802
        body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
        if self.path == "/generate":
            with self.server.lock:
                self.server.generated.append(json.loads(body))
        self._forward(body)


HANDOVER: list[Path] = []  # the folder both servers' hooks write into


@pytest.fixture(scope="module")
def two_servers(tmp_path_factory) -> Iterator[list[RecordingProxy]]:
    folder = tmp_path_factory.mktemp("sglang")
    HANDOVER.append(tmp_path_factory.mktemp("handover"))
    args = [*AUX_ARGS, "--forward-hooks", json.dumps([hook_spec(HANDOVER[0])])]
    servers = [LiveServer(args, folder / f"aux-{i}.log") for i in range(2)]  # start together
    proxies: list[RecordingProxy] = []
    try:
        for server in servers:
            print(f"\nSGLang (aux) up in {server.wait_ready():.0f} s at {server.url}")
        proxies = [RecordingProxy(server.url) for server in servers]
        yield proxies
    finally:
        for proxy in proxies:
            proxy.shutdown()
        for server in servers:
            server.stop()


def train_two_ranks(project: Path) -> dict[str, bytes]:
    for path in (DRAFTER, CHECKPOINTS):
        assert not (project / path).exists()
    run_ok(project, "train")
    assert json.loads((project / "metrics/train.json").read_text())["processes"] == 2
    return drafter_bytes(project)


def test_online_torchrun_on_two_live_servers_asks_each_row_once_and_trains_the_store_drafter(
    two_servers, tmp_path
):
    urls = [proxy.url for proxy in two_servers]
    # one request in flight per rank: each answer is a prefill of one sample
    raw = live_params(
        conversations(tmp_path, SAMPLES),
        urls,
        {"num_samples": SAMPLES},
        sglang_requests_in_flight=1,
    )
    # every request below is a training or held-out row (the re-check: replay tests)
    raw["online"] = {"recheck_every": 0}
    raw["train"] = {"num_processes": 2, "batch_size": 2, "epochs": 1, "heldout_fraction": 0.25}
    store_project = make_project(tmp_path / "store", raw)
    for name in ("patch_check", "extract", "vocab_map"):
        run_ok(store_project, name)
    stored = train_two_ranks(store_project)

    # the same project online: patch-check's report reused (features is a transport key), the
    # token store written again, without a request
    raw["extract"]["features"] = "online"
    project = make_project(tmp_path / "online", raw, report_from=store_project)
    for proxy in two_servers:
        proxy.taken()
    run_ok(project, "extract")
    run_ok(project, "vocab_map")
    assert not any(proxy.taken() for proxy in two_servers)
    store = FeatureStore(project / "artifacts/extract")
    assert store.online and len(store) == SAMPLES

    online = train_two_ranks(project)
    asked = [proxy.taken() for proxy in two_servers]
    assert all(asked), f"requests per server: {[len(a) for a in asked]} (both should share the work)"
    # every sample asked for exactly once (one epoch): no rank asked for another rank's rows
    # (as multisets: ShareGPT repeats conversations, and two of these samples have the same tokens)
    samples = Counter(tuple(store.sample(i)["input_ids"].tolist()) for i in range(len(store)))
    requested = Counter(tuple(body["input_ids"]) for bodies in asked for body in bodies)
    assert requested == samples, f"{requested.total()} requests for {samples.total()} samples"
    print(f"requests per server: {[len(a) for a in asked]}")

    assert online == stored

    # online again, the rows handed over as bytes through the servers' hooks
    raw["extract"] |= {"sglang_transport": "hook", "sglang_handover_dir": str(HANDOVER[0])}
    project = make_project(tmp_path / "online-hook", raw, report_from=store_project)
    run_ok(project, "extract")
    run_ok(project, "vocab_map")
    for proxy in two_servers:
        proxy.taken()
    hooked = train_two_ranks(project)
    asked = [proxy.taken() for proxy in two_servers]
    assert all(asked) and not any("return_hidden_states" in b for a in asked for b in a)
    requested = Counter(tuple(body["input_ids"]) for bodies in asked for body in bodies)
    assert requested == samples, f"{requested.total()} requests for {samples.total()} samples"
    assert hooked == stored
    assert list(HANDOVER[0].iterdir()) == []  # every piece read and removed
