"""speculative-eval with eval.backend: sglang for real: the stage, as DVC runs it, starts a plain,
an EAGLE-3 (the shipped drafter, tree 2/4/6) and an NGRAM SGLang 0.5.23 server on this CPU
(tools/sglang_cpu), decodes two MT-bench prompts on each, and stops them.

Skipped, with the reason, unless EAGLE3_SGLANG_PYTHON names a Python with sglang 0.5.23
(tools/sglang_cpu/make_venv.sh). Three servers at once, ~3.7 GB of RAM each; 1 passed in 370 s
on the shared 2-core machine (2026-12-02, load average ~13).
"""

from __future__ import annotations

import json
import os

import pytest
from test_sglang_eval import DRAFTER, HF_KEYS, params_for, run_stage
from test_sglang_live import SGLANG_PYTHON, WHY_SKIPPED

pytestmark = [pytest.mark.skipif(SGLANG_PYTHON is None, reason=WHY_SKIPPED), pytest.mark.slow]


def test_the_stage_starts_sglang_servers_and_measures_the_drafter(tmp_path):
    raw = params_for(
        domains={"chat": 1, "file": 1}, max_new_tokens=16, sglang_python=SGLANG_PYTHON
    ).model_dump()
    raw["tracking"] = {"enabled": False}
    project, done = run_stage(tmp_path, raw)
    assert done.returncode == 0, done.stderr[-3000:]
    metrics = json.loads((project / "metrics/speculative-eval.json").read_text())
    assert HF_KEYS <= set(metrics) and metrics["engine"] == "sglang 0.5.23"
    args = metrics["sglang_args"]
    assert args["eagle3"]["speculative_algorithm"] == "EAGLE3"
    assert args["ngram"]["speculative_algorithm"] == "NGRAM"
    assert args["eagle3"]["speculative_draft_model_path"] == str(DRAFTER.resolve())
    assert args["plain"]["attention_backend"] == args["eagle3"]["attention_backend"] == "intel_amx"
    # float32: SGLang's speculative outputs are the plain server's, token for token
    assert metrics["greedy_match"] == 1.0 and metrics["prompt_lookup_greedy_match"] == 1.0
    assert metrics["lossless"] and 1.0 <= metrics["acceptance_length"] <= 3.0
    assert metrics["steps"] > 0 and metrics["tokens_per_s"] > 0
    # every server was stopped: none of their processes is left
    left = os.popen("ps -eo args").read()
    assert str(DRAFTER.resolve()) not in left
