"""Shared fixtures: the real default target, loaded once per test session (float32 for speed
on CPUs without native bf16; tests that need another dtype load their own)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from eagle3.core.params import TargetParams
from eagle3.target.fingerprint import Fingerprint
from eagle3.target.load import Target, load_target

# 48 real ShareGPT conversations (provenance: tests/fixtures/README.md): extraction tests read
# these instead of parsing the packaged 125 MB file each time.
SHAREGPT_SAMPLE = Path(__file__).parent / "fixtures" / "sharegpt-48.jsonl"


def made_up_fingerprint(**fields: object) -> Fingerprint:
    """A fingerprint of made-up files (SmolLM2's sizes, aux layers 1, 14, 26), for tests whose
    target is never loaded or whose hashes nothing compares; `fields` replace its values."""
    values = {
        "engine": "transformers",
        "engine_version": "0",
        "target_source": "smollm2-135m-instruct",
        "target_sha256": "t",
        "tokenizer_sha256": "tok",
        "num_layers": 30,
        "hidden_size": 576,
        "vocab_size": 49152,
        "aux_layers": (1, 14, 26),
        "dtype": "float32",
    }
    return Fingerprint(**(values | fields))


# The suite runs on two pytest-xdist workers (README: `pytest -n 2 --dist loadgroup`). A module's
# tests stay on one worker, so a module-scoped built project is built once; modules that share a
# session-built project (below) form one group, so it is built once too. The live SGLang modules
# (run only with EAGLE3_SGLANG_PYTHON) form one group as well: their servers (~3.7 GB each) then
# run one module at a time, not two modules' at once.
SHARED_PROJECT_GROUPS = {
    "test_faults": "faults_stages",
    "test_online": "faults_stages",
    "test_failed_stages": "faults_stages",
    "test_sglang": "sglang_top_logprobs",
    "test_sglang_online": "sglang_top_logprobs",
    "test_sglang_live": "live_sglang_servers",
    "test_sglang_online_live": "live_sglang_servers",
    "test_sglang_eval_live": "live_sglang_servers",
    "test_sglang_kernels_live": "live_sglang_servers",
    "test_sglang_dflash_live": "live_sglang_servers",
}


# Two workers on two cores: each worker's torch, and the stages it starts, on one thread. Two
# threads per worker oversubscribe the cores (measured: 25 min of CPU for 16 min of work).
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)


# Fixtures no unit test uses: the real target's load, and the projects built by running stages.
# A test that asks for one is in the full suite only (the `slow` marker, pyproject.toml).
SLOW_FIXTURES = {"smollm2", "faults_stages", "sglang_top_logprobs"}


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        module = item.module.__name__ if item.module else item.nodeid
        item.add_marker(pytest.mark.xdist_group(SHARED_PROJECT_GROUPS.get(module, module)))
        if SLOW_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.slow)


@pytest.fixture(scope="session")
def smollm2() -> Target:
    return load_target(TargetParams(dtype="float32"))


@pytest.fixture
def one_thread() -> Iterator[None]:
    """torch on one thread for the test, restored after: the tiny models of the test_decoding_*
    files run faster on one thread than on two, the real model does not."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def faults_stages(tmp_path_factory) -> Path:
    """The fault harness's tiny project through vocab-map (tests/fault_harness.py), built once for
    tests/test_faults.py, test_online.py and test_failed_stages.py: read only, each module works
    on a copy."""
    from fault_harness import build_stages

    return build_stages(tmp_path_factory.mktemp("faults-stages"))


@pytest.fixture(scope="session")
def sglang_top_logprobs(tmp_path_factory):
    """patch-check, extract, vocab-map and train of the replay servers' three conversations
    (tests/test_sglang.py build_top_logprobs_project), run once for tests/test_sglang.py and
    tests/test_sglang_online.py: read only, each test works on a copy."""
    from test_sglang import build_top_logprobs_project

    return build_top_logprobs_project(tmp_path_factory.mktemp("sglang-top-logprobs"))
