"""The per-work dtype policy (eagle3/dtypes/policy.py, probes.py): measured on this machine with
real (tiny) Llamas on each job's work, kept per machine and work, never kept under load; and the
probes' draft shape is the engine's."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest
import torch
from test_decoding_fixtures import EOS, engine, prompts, random_drafter, tiny_target

from eagle3.dtypes import policy
from eagle3.dtypes.policy import cpu_decision, measure_decision, resolve_dtype, resolve_dtype_name
from eagle3.dtypes.probes import JOBS, DraftShape, Shape, Work, measure
from eagle3.dtypes.rule import WEIGHTS, decide

TINY = Shape(
    hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, vocab_size=512
)


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("EAGLE3_CACHE", str(tmp_path))
    cpu_decision.cache_clear()
    yield tmp_path
    cpu_decision.cache_clear()


@pytest.mark.slow
def test_each_job_is_timed_on_its_parts_and_decided_by_the_rule():
    for job in JOBS:
        work = Work.of(job, TINY, DraftShape(k=2, topk=4, tree_budget=6))
        decision = measure_decision(work)
        assert set(decision["parts_ms"]["float32"]) == set(WEIGHTS[job])
        assert all(t > 0 for by in decision["parts_ms"].values() for t in by.values())
        assert decision["others_cores"] >= 0 and decision["work"] == work.describe()
        low, high = decision["interval"]
        assert low <= decision["ratio"] <= high


def test_a_longer_verify_step_costs_more():
    """The verify part really carries the eval's tokens: 64 tokens cost more than 2, float32."""
    short = measure(Work("decode", TINY, verify_tokens=2), reps=3)[0]["float32"]["verify step"]
    long = measure(Work("decode", TINY, verify_tokens=64), reps=3)[0]["float32"]["verify step"]
    assert sorted(long)[1] > sorted(short)[1]


def _burn(seconds: float) -> subprocess.Popen:
    """A busy loop in another process (a real load, not a simulated one)."""
    code = f"import time\nend = time.time() + {seconds}\nwhile time.time() < end: pass"
    return subprocess.Popen([sys.executable, "-c", code])


# Large enough that compute, not Python overhead, decides the ratio, so it is clear on every CPU:
# ~0.6 with native bf16 (Zen 4), far above 1 where bf16 is emulated (Zen 3).
MID = Shape(
    hidden_size=512, intermediate_size=1536, num_attention_heads=8, num_key_value_heads=4, vocab_size=4096
)


@pytest.mark.slow
def test_the_ratio_is_measured_in_cpu_time_so_load_does_not_decide_it():
    """Wall time under a busy loop on every core stretches unevenly; the CPU time a job needs does
    not. The prefill decision, measured quiet and then with every core busy, is the same."""
    work = Work.of("prefill", MID)
    quiet = decide("prefill", measure(work, reps=5)[0], "avx512_bf16")
    burners = [_burn(120) for _ in range(2)]
    try:
        time.sleep(0.5)
        loaded = decide("prefill", measure(work, reps=5)[0], "avx512_bf16")
    finally:
        for burner in burners:
            burner.kill()
            burner.wait(timeout=10)
    assert quiet["choice"] == loaded["choice"], (quiet, loaded)


def test_explicit_dtypes_are_taken_as_is():
    assert resolve_dtype("bfloat16", Work.of("decode", TINY)) == torch.bfloat16
    assert resolve_dtype("float64") == torch.float64
    assert resolve_dtype_name("float32", Work.of("train", TINY)) == ("float32", "set in params")


def test_auto_without_native_bf16_is_float32_for_every_job(monkeypatch):
    monkeypatch.setattr(policy, "native_bf16", lambda: False)
    assert {resolve_dtype("auto", Work.of(job, TINY)) for job in JOBS} == {torch.float32}


def _kept(choice: str, verdict: str, ratio: float) -> dict:
    return {
        "choice": choice,
        "verdict": verdict,
        "ratio": ratio,
        "interval": [ratio - 0.05, ratio + 0.05],
        "machine_class": "avx512_bf16",
        "others_cores": 0.0,
    }


def test_a_native_bf16_cpu_follows_its_kept_decision_per_work(cache_dir, monkeypatch):
    """A kept decision is read back, so a machine resolves the same way every run; it is kept per
    work: decoding at another verify count is another decision, measured on its own."""
    monkeypatch.setattr(policy, "native_bf16", lambda: True)
    at_13, at_9 = Work.of("decode", TINY), Work.of("decode", TINY, DraftShape(lookup_tokens=0))
    assert (at_13.verify_tokens, at_9.verify_tokens) == (13, 9)
    assert policy.policy_path(at_13) != policy.policy_path(at_9)
    policy.policy_path(at_13).parent.mkdir(parents=True)
    policy.policy_path(at_13).write_text(json.dumps(_kept("bfloat16", "bf16 wins", 0.7)))
    policy.policy_path(Work.of("prefill", TINY)).write_text(json.dumps(_kept("float32", "tie", 0.97)))
    assert resolve_dtype("auto", at_13) == torch.bfloat16
    dtype, why = resolve_dtype_name("auto", Work.of("prefill", TINY))
    assert dtype == "float32"
    assert why.startswith("bf16/float32 cost 0.97 [0.92, 1.02]: a tie -> float32, the avx512_bf16 default")
    assert why.endswith(f"kept in {policy.policy_path(Work.of('prefill', TINY))}")
    assert resolve_dtype_name("auto", at_9, measure=False)[0] == "auto"  # not measured yet


def test_a_quiet_measurement_is_kept_tie_or_not(cache_dir, monkeypatch):
    monkeypatch.setattr(policy, "native_bf16", lambda: True)
    monkeypatch.setattr(policy, "LOADED_CORES", 99.0)  # this test is about keeping, not load
    work = Work.of("train", TINY)
    decision = cpu_decision(work)
    assert decision["source"] == f"measured now, kept in {policy.policy_path(work)}"
    kept = json.loads(policy.policy_path(work).read_text())
    assert kept["choice"] == decision["choice"] and kept["verdict"] in ("bf16 wins", "float32 wins", "tie")
    policy.forget([work])
    assert not policy.policy_path(work).exists()


def test_a_measurement_under_load_is_used_but_never_kept(cache_dir, monkeypatch):
    monkeypatch.setattr(policy, "native_bf16", lambda: True)
    burners = [_burn(120) for _ in range(2)]
    try:
        time.sleep(0.5)
        decision = cpu_decision(Work.of("train", TINY))
    finally:
        for burner in burners:
            burner.kill()
            burner.wait(timeout=10)
    assert decision["others_cores"] > policy.LOADED_CORES
    assert "not kept" in decision["source"] and "cores busy" in decision["source"]
    assert not list(cache_dir.rglob("*.json"))


SHAPES = {
    "default": DraftShape(),
    "tree 3/2/64, no lookup": DraftShape(k=3, topk=2, tree_budget=64, lookup_tokens=0),
    "tree 4/3/10": DraftShape(k=4, topk=3, tree_budget=10, lookup_tokens=2),
    "chain 4": DraftShape(mode="chain", k=4, lookup_tokens=0),
}


@pytest.mark.usefixtures("one_thread")
@pytest.mark.parametrize("name", list(SHAPES))
def test_the_probes_draft_shape_is_the_engines(name):
    """What the probes time is what the engine runs: its verify steps never carry more tokens than
    DraftShape.verify_tokens and reach it with the lookup branch off; its drafter forwards after
    the first have DraftShape.draft_rows' rows (the first carries the pending pairs)."""
    shape = SHAPES[name]
    target = tiny_target()
    spec = engine(target, random_drafter(target), **vars(shape))
    verified, drafted = [], []
    # pre-hooks see what each model is given: the decoder its tokens, the drafter its rows
    target.model.register_forward_pre_hook(
        lambda _, a, kw: verified.append(kw["input_ids"].shape[1]), with_kwargs=True
    )
    spec.drafter.register_forward_pre_hook(lambda _, args: drafted.append(args[0].shape[1]))
    steps = []
    for p in prompts(8)[:3]:
        verified.clear()
        drafted.clear()
        spec.generate(p, 24, EOS)
        steps += verified[1:]  # the first is the prompt pass
    assert max(steps) <= shape.verify_tokens
    if not shape.lookup_tokens:
        assert max(steps) == shape.verify_tokens
    levels = len(shape.draft_rows) - 1
    assert drafted[1 : 1 + levels] == list(shape.draft_rows[1:])
