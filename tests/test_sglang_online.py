"""Online features from SGLang servers (extract.features: online, backend sglang), against the
local replay servers of tests/test_sglang.py (recorded SGLang 0.5.23 responses): the online
drafter equals the one trained from the same servers' store, a server that goes away is waited
for with one line naming it, and one that comes back with other args is refused."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest
import yaml
from test_online import CHECKPOINTS, DRAFTER, drafter_bytes
from test_sglang import Replay, ReplayHandler, copy_top_logprobs_project, servers  # noqa: F401

from eagle3.data.store import FeatureStore

pytestmark = pytest.mark.slow


def set_params(project: Path, raw: dict, recheck_every: int | None = None, **extract) -> None:
    raw["extract"] |= extract
    if recheck_every is not None:
        raw["online"] = raw.get("online", {}) | {"recheck_every": recheck_every}
    (project / "params.yaml").write_text(yaml.safe_dump(raw))


class Down:
    """Makes a replay server stop answering (connections closed unanswered) after `after`
    /generate requests, until `up()`; then it answers with `info` changes applied."""

    def __init__(self, server, after: int):
        self.server, self.after, self.down = server, after, False
        handle_post, handle_get = ReplayHandler.do_POST, ReplayHandler.do_GET
        gone = self

        def post(handler) -> None:
            if handler.path == "/generate" and len(handler.server.requests) >= gone.after:
                gone.down = True
            if gone.down:
                handler.close_connection = True  # no answer: the client sees the server gone
                return
            handle_post(handler)

        def get(handler) -> None:
            if gone.down:
                handler.close_connection = True
                return
            handle_get(handler)

        self.saved = (handle_post, handle_get)
        ReplayHandler.do_POST, ReplayHandler.do_GET = post, get

    def up(self, **info) -> None:
        self.server.info |= info
        self.after, self.down = 10**9, False

    def restore(self) -> None:
        ReplayHandler.do_POST, ReplayHandler.do_GET = self.saved


def start_train(project: Path, log: Path) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MLFLOW_", "DVC_"))}
    env["EAGLE3_SGLANG_POLL_S"] = "0.2"
    env["OMP_NUM_THREADS"] = "1"  # as the store's train ran (stages_in): bytes compared at equal threads
    return subprocess.Popen(
        [sys.executable, "-m", "stages.train"], cwd=project, env=env, stderr=log.open("w"), text=True
    )


def wait_for_line(proc: subprocess.Popen, log: Path, text: str, timeout: float = 600) -> None:
    began = time.monotonic()
    while text not in log.read_text():
        assert proc.poll() is None, f"train ended ({proc.returncode}) before '{text}':\n{log.read_text()}"
        assert time.monotonic() - began < timeout, f"no '{text}' after {timeout} s"
        time.sleep(0.05)


@pytest.mark.timeout(1800)
def test_online_features_from_sglang_servers_train_the_stored_drafter(
    servers,  # noqa: F811
    sglang_top_logprobs,
    tmp_path,
):
    aux, _ = servers
    # the session's project, trained from a store of these servers' rows (patch-check, extract,
    # vocab-map and train: tests/test_sglang.py build_top_logprobs_project), pointed at `aux`
    project, raw, stage = copy_top_logprobs_project(sglang_top_logprobs, tmp_path, aux.url)
    stored = drafter_bytes(project)

    set_params(project, raw, features="online", recheck_every=2)
    sent = len(aux.requests)
    assert stage("extract").returncode == 0
    assert len(aux.requests) == sent  # an online extraction stores tokens: no server work
    assert FeatureStore(project / "artifacts/extract").online
    assert stage("vocab_map").returncode == 0

    # online training, with the server going away mid-training: one line names it, training waits,
    # then finishes with the stored drafter's bytes (an uninterrupted online run was trained here
    # too before; every batch but the one retried takes its path, so this run proves it as well)
    for path in (project / DRAFTER, project / CHECKPOINTS):
        subprocess.run(["rm", "-rf", str(path)], check=True)
    down = Down(aux, after=len(aux.requests) + 2)
    try:
        log = tmp_path / "train.log"
        proc = start_train(project, log)
        wait_for_line(proc, log, f"waiting for {aux.url}")
        down.up()
        assert proc.wait(timeout=600) == 0, log.read_text()
        text = log.read_text()
        assert text.count(f"waiting for {aux.url}") == 1 and f"{aux.url} answers again" in text
        assert len(aux.requests) > sent + 2  # the features came from the server while training
        assert drafter_bytes(project) == stored

        # ...and comes back relaunched with other args: refused as extract refuses it
        for path in (project / DRAFTER, project / CHECKPOINTS):
            subprocess.run(["rm", "-rf", str(path)], check=True)
        down.after, down.down = len(aux.requests) + 2, False
        proc = start_train(project, log)
        wait_for_line(proc, log, f"waiting for {aux.url}")
        down.up(tp_size=2)
        assert proc.wait(timeout=600) == 1
        text = log.read_text()
        assert "tp_size: 1 -> 2" in text and "run patch-check again" in text
        assert not (project / DRAFTER / "model.safetensors").exists()
    finally:
        down.restore()


@pytest.mark.timeout(1800)
def test_online_under_torchrun_asks_each_row_once_and_trains_the_two_rank_store_drafter(
    sglang_top_logprobs, tmp_path
):
    """train.num_processes 2 against two replay servers (data-parallel extract.sglang_url): the
    online drafter equals the one two ranks train from the store, every sample is asked for once
    an epoch (each training row by its rank, the held-out row by rank 0) and both servers work.
    tests/test_sglang_online_live.py runs the same against two live SGLang servers."""
    first, second = Replay("aux"), Replay("aux")
    try:
        urls = [first.url, second.url]
        project, raw, stage = copy_top_logprobs_project(sglang_top_logprobs, tmp_path, urls)
        raw["train"] |= {"num_processes": 2, "batch_size": 2}
        set_params(project, raw, recheck_every=0)  # every request below is a row (the re-check: above)
        trained = {}
        for mode in ("store", "online"):
            if mode == "online":
                set_params(project, raw, features="online")
                assert stage("extract").returncode == 0 and stage("vocab_map").returncode == 0
                first.requests.clear()
                second.requests.clear()
            for path in (project / DRAFTER, project / CHECKPOINTS):
                subprocess.run(["rm", "-rf", str(path)], check=True)
            done = stage("train")
            assert done.returncode == 0, done.stderr[-3000:]
            trained[mode] = drafter_bytes(project)
        store = FeatureStore(project / "artifacts/extract")
        epochs = raw["train"]["epochs"]
        samples = Counter(tuple(store.sample(i)["input_ids"].tolist()) for i in range(len(store)))
        requested = Counter(tuple(body["input_ids"]) for body in first.requests + second.requests)
        assert requested == Counter({ids: n * epochs for ids, n in samples.items()})
        assert first.requests and second.requests
        assert trained["online"] == trained["store"]
    finally:
        first.close()
        second.close()
