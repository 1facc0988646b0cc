"""Shared fixtures: the real default target, loaded once per test session (float32 for speed
on CPUs without native bf16; tests that need another dtype load their own)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from eagle3.core.params import TargetParams
from eagle3.verifier.load import Target, load_target

# 48 real ShareGPT conversations (provenance: tests/fixtures/README.md): extraction tests read
# these instead of parsing the packaged 125 MB file each time.
SHAREGPT_SAMPLE = Path(__file__).parent / "fixtures" / "sharegpt-48.jsonl"


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
    """bench/faults.py's tiny project through vocab-map (tests/fault_harness.py), built once for
    tests/test_faults.py and tests/test_online.py: read only, each module works on a copy."""
    from fault_harness import build_stages

    return build_stages(tmp_path_factory.mktemp("faults-stages"))


@pytest.fixture(scope="session")
def sglang_top_logprobs(tmp_path_factory):
    """patch-check, extract, vocab-map and train of the replay servers' three conversations
    (tests/test_sglang.py build_top_logprobs_project), run once for tests/test_sglang.py and
    tests/test_sglang_online.py: read only, each test works on a copy."""
    from test_sglang import build_top_logprobs_project

    return build_top_logprobs_project(tmp_path_factory.mktemp("sglang-top-logprobs"))
