"""The hook transport against a real SGLang 0.5.23 server with the project's --forward-hooks
factory (eagle3/sglang/aux_hook.py). Skipped without EAGLE3_SGLANG_PYTHON
(tests/test_sglang_live.py). The server splits prefills into chunks of 64 tokens.

- Batched and chunked: 16 requests in flight each ask for both transports at once
  (return_hidden_states and a request id), so the hook's rows and the JSON rows come from the same
  forwards and must be the same bits; the server batches them, splits the longer prompts into
  chunked prefills, and the hook must place every piece. (The JSON path keeps only a chunked
  prefill's last chunk: those rows are compared where they are.)
- Extract, patch-check, train: the same params through each transport on the same server give
  the same shards and the same drafter bytes. One request at a time and samples that fit one
  chunk: that is what makes two extractions' forwards, and so their bits, the same; which
  requests share a forward changes the rounding on a CPU, through either transport.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from test_sglang_live import (
    AUX_ARGS,
    TOPK,
    H,
    LiveServer,
    conversations,
    launched,
    live_params,
    make_project,
    pytestmark,  # noqa: F401 - the same skip and time limit
    report_of,
    run_ok,
    store_of,
)

from eagle3.core.params import parse_params
from eagle3.data.extract import select_conversations
from eagle3.sglang.client import ServerPool
from eagle3.sglang.handover import HookTransport
from eagle3.sglang.rows import prefill_body

CHUNK = 64  # --chunked-prefill-size
WIDTH = 3 * H


def hook_spec(folder: Path) -> dict:
    """The --forward-hooks entry of the project's factory writing into `folder`."""
    return {
        "name": "eagle3_aux",
        "target_modules": ["model"],
        "hook_factory": "eagle3.sglang.aux_hook:make_hook",
        "config": {"dir": str(folder)},
    }


def hook_args(folder: Path) -> list[str]:
    return [
        *AUX_ARGS,
        "--chunked-prefill-size",
        str(CHUNK),
        "--forward-hooks",
        json.dumps([hook_spec(folder)]),
    ]


@pytest.fixture(scope="module")
def hook_server(tmp_path_factory) -> Iterator[tuple[LiveServer, Path]]:
    folder = tmp_path_factory.mktemp("handover")
    for server in launched(hook_args(folder), tmp_path_factory.mktemp("sglang") / "hook_server.log"):
        yield server, folder


def test_batched_and_chunked_hook_rows_are_the_json_rows_of_the_same_forwards(hook_server, smollm2, tmp_path):
    server, folder = hook_server
    raw = live_params(conversations(tmp_path, 16), server.url, {"num_samples": 16})
    selected = select_conversations(parse_params(raw), smollm2.tokenizer, True)
    prompts = [s.rendered.input_ids.tolist() for s in selected]
    pool, transport = ServerPool([server.url]), HookTransport(folder)

    def both(ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        rid = transport.new_rid()
        # with logprobs from position 0, as extraction asks: SGLang then keeps off its prefix cache
        response = pool.generate(server.url, prefill_body(ids, TOPK) | {"rid": rid})
        given = torch.tensor(response["meta_info"]["hidden_states"][0], dtype=torch.float32)
        handed = transport.collect(rid, len(ids), WIDTH, server.url, "aux rows")
        transport.discard(rid, len(ids))
        return given, handed

    with ThreadPoolExecutor(16) as threads:
        pairs = list(threads.map(both, prompts))
    chunked = 0
    for ids, (given, handed) in zip(prompts, pairs, strict=True):
        # every position, chunked or not (a forward's 64 tokens are shared: the last request of a
        # batched forward is split too)
        assert handed.shape == (len(ids), WIDTH)
        chunked += given.shape[0] < len(ids)
        assert torch.equal(handed[len(ids) - given.shape[0] :], given)
    print(f"{len(prompts)} requests in flight, {chunked} of them chunked prefills: the same bits")
    assert chunked >= 4 and list(folder.iterdir()) == []


def test_the_hook_store_and_drafter_are_the_json_ones(hook_server, tmp_path):
    server, folder = hook_server
    data = conversations(tmp_path, 12)
    trained = {}
    for transport in ("json", "hook"):
        extra = {"sglang_requests_in_flight": 1}
        if transport == "hook":
            extra |= {"sglang_transport": "hook", "sglang_handover_dir": str(folder)}
        raw = live_params(data, server.url, {"num_samples": 12, "max_length": CHUNK}, **extra)
        raw["train"] = {"epochs": 1, "batch_size": 2}
        project = make_project(tmp_path / transport, raw)
        for name in ("patch_check", "extract", "vocab_map", "train"):
            run_ok(project, name)
        store = store_of(project)
        shards = {entry["file"]: entry["sha256"] for entry in store.shards}
        drafter = {p.name: p.read_bytes() for p in sorted((project / "artifacts/train/drafter").iterdir())}
        trained[transport] = shards, drafter, report_of(project)
    assert trained["hook"][0] == trained["json"][0]  # the same shards
    assert trained["hook"][1] == trained["json"][1]  # the same drafter
    checks = [c for c in trained["hook"][2]["checks"] if c.get("transport") == "hook"]
    assert checks and checks[0]["bitwise_equal"], trained["hook"][2]["checks"]
    assert list(folder.iterdir()) == []  # every piece read and removed
