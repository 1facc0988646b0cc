"""The speculative-eval stage refuses bad input with one clear line, before loading any model."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]


def run_stage(tmp_path: Path, eval_params: dict) -> subprocess.CompletedProcess:
    params = {"eval": eval_params, "tracking": {"enabled": False}}
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(params))
    env = dict(os.environ, PYTHONPATH=str(REPO))
    return subprocess.run(
        [sys.executable, "-m", "stages.speculative_eval"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


# Each case starts a Python process (seconds of imports): the library tests cover the rest.
@pytest.mark.parametrize(
    "eval_params,message",
    [
        ({"k": 0}, "eval.k"),
        ({"prompts_file": "empty.jsonl"}, "holds no prompts"),
        (
            {"categories": ["math", "poetry"]},
            "eval.categories: unknown ['poetry'] (allowed: any of ['writing',",
        ),
        ({}, "run the train stage first"),
    ],
)
def test_stage_rejects_bad_input_early(tmp_path, eval_params, message):
    (tmp_path / "empty.jsonl").write_text("\n")
    result = run_stage(tmp_path, eval_params)
    assert result.returncode != 0
    assert message in " ".join(result.stderr.split())
    assert not (tmp_path / "metrics").exists()  # nothing written
