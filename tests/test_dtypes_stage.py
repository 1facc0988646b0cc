"""The dtypes stage: `auto` resolved once per run and recorded where DVC hashes it, so a changed
machine decision re-runs exactly the stages it affects and an unchanged one re-runs nothing.
Real DVC on a tiny real project; the decision is changed the way a remeasurement would change
it: by the kept measurement in the machine's cache (EAGLE3_CACHE)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from conftest import SHAREGPT_SAMPLE
from project_copy import copy_code

from eagle3.core.device import native_bf16
from eagle3.core.params import parse_params
from eagle3.dtypes import policy
from eagle3.dtypes.decisions import resolve
from eagle3.dtypes.policy import policy_path
from eagle3.dtypes.probes import DraftShape, Work
from eagle3.dtypes.resolved import pinned, record
from eagle3.train.prepare import dtype_shapes

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[1]
TINY = {
    "target": {"dtype": "float32"},
    "data": {"source": str(SHAREGPT_SAMPLE), "num_samples": 4, "max_length": 40},
    "extract": {"shard_samples": 2, "batch_tokens": 128},
    "vocab": {"size": 300},
    "train": {"dtype": "auto", "epochs": 1},
    # explicit: the decode probe (the whole target's depth) would cost this test most of its time
    "eval": {"dtype": "float32", "drafter_dtype": "float32"},
    "tracking": {"enabled": False},
}


def tiny_params() -> dict:
    params = yaml.safe_load((REPO / "params.yaml").read_text())
    for section, values in TINY.items():
        params[section].update(values)
    return params


def test_pinned_replaces_auto_with_the_record_and_keeps_explicit_dtypes(tmp_path):
    raw = tiny_params()
    raw["eval"].update({"dtype": "auto", "drafter_dtype": None})
    params = parse_params(raw, "test")
    record(
        {
            "train": {"train.dtype": {"dtype": "bfloat16", "why": "measured"}},
            "decode": {
                "eval.dtype": {"dtype": "float32", "why": "measured"},
                "eval.drafter_dtype": {"dtype": "float32", "why": "null = eval.dtype"},
            },
        },
        tmp_path,
    )
    assert pinned(params, "train", tmp_path).train.dtype == "bfloat16"
    decode = pinned(params, "decode", tmp_path).eval
    assert (decode.dtype, decode.drafter_dtype) == ("float32", "float32")
    explicit = params.model_copy(update={"train": params.train.model_copy(update={"dtype": "float64"})})
    assert pinned(explicit, "train", tmp_path).train.dtype == "float64"
    assert pinned(params, "prefill", tmp_path) is params  # no record: resolved live
    before = (tmp_path / "train.json").read_bytes()
    same = {"train": {"train.dtype": {"dtype": "bfloat16", "why": "another source, same decision"}}}
    record(same, tmp_path)
    assert (tmp_path / "train.json").read_bytes() == before  # only the decision is in the bytes


def _run(cmd: list[str], cwd: Path, env: dict[str, str]) -> str:
    done = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, f"{cmd} failed:\n{done.stdout}\n{done.stderr}"
    return done.stdout + done.stderr


def _keep(decision: str, work: Work) -> None:
    """A kept decision for `work`, as a clear, quiet measurement on this machine would have written it."""
    ratio = 0.5 if decision == "bfloat16" else 1.3
    verdict = "bf16 wins" if decision == "bfloat16" else "float32 wins"
    path = policy_path(work)
    path.parent.mkdir(parents=True, exist_ok=True)
    kept = {"choice": decision, "verdict": verdict, "ratio": ratio, "interval": [ratio - 0.1, ratio + 0.1]}
    path.write_text(json.dumps(kept | {"machine_class": "avx512_bf16", "others_cores": 0.0}))


@pytest.mark.skipif(not native_bf16(), reason="without native bf16, auto is float32 and nothing is measured")
def test_a_changed_decision_reruns_exactly_the_stages_it_affects(tmp_path, monkeypatch):
    project, cache = tmp_path / "project", tmp_path / "cache"
    copy_code(project)
    (project / "params.yaml").write_text(yaml.safe_dump(tiny_params(), sort_keys=False))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MLFLOW_", "DVC_"))}
    env |= {"EAGLE3_CACHE": str(cache), "DVC_NO_ANALYTICS": "1"}
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env['PATH']}"
    monkeypatch.setenv("EAGLE3_CACHE", str(cache))  # policy_path below: the same cache as the stages
    # the converted target lives in the real cache: link it so the stages do not convert again
    real_cache = Path(os.environ.get("EAGLE3_CACHE", Path.home() / ".cache" / "eagle3"))
    cache.mkdir()
    for entry in real_cache.iterdir() if real_cache.exists() else ():
        if entry.name != "dtype-policy":
            (cache / entry.name).symlink_to(entry)
    train_work = Work.of("train", dtype_shapes(parse_params(tiny_params(), "test"))["drafter"])
    _keep("bfloat16", train_work)
    for cmd in (["git", "init", "-q"], [sys.executable, "-m", "dvc", "init", "-q"]):
        _run(cmd, project, env)
    _run([sys.executable, "-m", "dvc", "repro", "train"], project, env)
    assert json.loads((project / "artifacts/dtypes/train.json").read_text())["train.dtype"] == "bfloat16"

    # the same decision again: the dtypes stage runs (always) and nothing else does
    again = _run([sys.executable, "-m", "dvc", "repro", "train"], project, env)
    assert "Running stage 'dtypes'" in again
    for stage in ("patch-check", "extract", "vocab-map", "train"):
        assert f"Stage '{stage}' didn't change, skipping" in again

    # a remeasurement that decides otherwise: train, and only train, runs again
    _keep("float32", train_work)
    changed = _run([sys.executable, "-m", "dvc", "repro", "train"], project, env)
    assert json.loads((project / "artifacts/dtypes/train.json").read_text())["train.dtype"] == "float32"
    assert "Running stage 'train'" in changed
    for stage in ("patch-check", "extract", "vocab-map"):
        assert f"Stage '{stage}' didn't change, skipping" in changed
    assert json.loads((project / "metrics/train.json").read_text())["dtype"] == "float32"


def test_auto_for_decoding_is_decided_at_the_evals_draft_shape(tmp_path, monkeypatch):
    """eval.dtype follows the decision kept for the target's decode work at the eval's verify count
    (13 tokens by default), eval.drafter_dtype the one kept for the drafter's step: another tree
    shape is other work, not measured yet, and resolves to nothing kept (measure=False)."""
    monkeypatch.setenv("EAGLE3_CACHE", str(tmp_path))
    monkeypatch.setattr(policy, "native_bf16", lambda: True)
    policy.cpu_decision.cache_clear()
    raw = tiny_params()
    raw["eval"].update({"dtype": "auto", "drafter_dtype": "auto"})
    params = parse_params(raw, "test")
    shapes = dtype_shapes(params)
    _keep("bfloat16", Work.of("decode", shapes["target"], DraftShape()))
    _keep("float32", Work.of("draft", shapes["draft"], DraftShape()))
    decode = resolve(params, shapes, measure=False)["decode"]
    assert decode["eval.dtype"]["dtype"] == "bfloat16"
    assert decode["eval.dtype"]["work"] == "decode (one-token and 13-token verify steps)"
    assert decode["eval.drafter_dtype"]["dtype"] == "float32"
    assert shapes["draft"].vocab_size == raw["vocab"]["size"]  # the drafter's step: its own vocabulary
    raw["eval"]["tree_budget"] = 16  # with k 1 the tree holds 8 nodes: still 13 tokens, same work
    assert (
        resolve(parse_params(raw, "test"), shapes, measure=False)["decode"]["eval.dtype"]["dtype"]
        == "bfloat16"
    )
    raw["eval"].update({"k": 2, "tree_budget": 16})
    other = resolve(parse_params(raw, "test"), shapes, measure=False)["decode"]
    assert other["eval.dtype"]["dtype"] == "auto"
    assert other["eval.dtype"]["work"] == "decode (one-token and 21-token verify steps)"
