"""The speculative-eval stage refuses bad input with one clear line, before loading any model."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import yaml

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # stages/ is no installed package: import it as `python -m stages.x` does
import stages.speculative_eval  # noqa: E402


@pytest.mark.parametrize(
    "eval_params,message",
    [
        ({"k": 0}, "eval.k"),
        ({"prompts_file": "empty.jsonl", "domains": {"file": 1}}, "holds no prompts"),
        (
            {"categories": ["math", "poetry"]},
            "eval.categories: unknown ['poetry'] (allowed: any of ['writing',",
        ),
        ({}, "run the train stage first"),
    ],
)
def test_stage_rejects_bad_input_early(tmp_path, monkeypatch, capsys, eval_params, message):
    # In process, as DVC would run it from the project folder: no interpreter start per case.
    monkeypatch.chdir(tmp_path)
    (tmp_path / "empty.jsonl").write_text("\n")
    params = {"eval": eval_params, "tracking": {"enabled": False}}
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(params))
    with pytest.raises(SystemExit) as stop:
        stages.speculative_eval.main()
    assert stop.value.code not in (0, None)
    assert message in " ".join(capsys.readouterr().err.split())
    assert not (tmp_path / "metrics").exists()  # nothing written
