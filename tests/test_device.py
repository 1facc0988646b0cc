"""The per-job dtype policy: measured on this machine with a real (tiny) Llama, cached per machine."""

from __future__ import annotations

import json

import pytest
import torch

from eagle3 import device
from eagle3.device import BF16_DECODE_MARGIN, JOBS, Shape, choose, cpu_policy, measure_policy, resolve_dtype

TINY = Shape(
    hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, vocab_size=512
)


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("EAGLE3_CACHE", str(tmp_path))
    cpu_policy.cache_clear()
    yield tmp_path
    cpu_policy.cache_clear()


def test_measured_policy_picks_the_faster_dtype_of_each_job():
    policy = measure_policy(TINY)
    assert set(policy) == set(JOBS)
    for job in JOBS:
        times = {name: policy[job][name] for name in ("float32", "bfloat16")}
        assert policy[job]["choice"] == choose(job, times)


def test_decode_takes_bf16_only_on_a_clear_win():
    # near a tie float32 decodes (the exact dtype); prefill and train take whichever is faster
    tie = {"float32": 1.0, "bfloat16": 0.95}
    assert choose("decode", tie) == "float32"
    assert choose("prefill", tie) == choose("train", tie) == "bfloat16"
    clear = {"float32": 1.0, "bfloat16": BF16_DECODE_MARGIN * 0.99}
    assert choose("decode", clear) == "bfloat16"
    assert choose("decode", {"float32": 1.0, "bfloat16": 1.2}) == "float32"


def test_explicit_dtypes_are_taken_as_is():
    assert resolve_dtype("bfloat16", "decode", TINY) == torch.bfloat16
    assert resolve_dtype("float64", "train") == torch.float64


def test_auto_without_native_bf16_is_float32_for_every_job(monkeypatch):
    monkeypatch.setattr(device, "native_bf16", lambda: False)
    assert {resolve_dtype("auto", job, TINY) for job in JOBS} == {torch.float32}


def test_a_native_bf16_cpu_follows_its_cached_measurement(cache_dir, monkeypatch):
    """Measured once, written under EAGLE3_CACHE, then read back: a machine resolves the same way
    every run, and each job may resolve differently (e.g. bf16 prefill, float32 decoding)."""
    monkeypatch.setattr(device, "native_bf16", lambda: True)
    policy = cpu_policy(TINY)
    (path,) = (cache_dir / "dtype-policy").glob("*.json")
    assert json.loads(path.read_text())["decode"]["choice"] == policy["decode"]["choice"]
    edited = policy | {"prefill": {"choice": "bfloat16"}, "decode": {"choice": "float32"}}
    path.write_text(json.dumps(edited))
    cpu_policy.cache_clear()
    assert resolve_dtype("auto", "prefill", TINY) == torch.bfloat16
    assert resolve_dtype("auto", "decode", TINY) == torch.float32
