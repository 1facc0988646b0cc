"""The CPU kernels of tools/sglang_cpu/sgl_kernel against SGLang's own Triton kernels (run on the
CPU by the Triton interpreter) and against per-request attention: tools/sglang_cpu/check_kernels.py
in the SGLang venv. Skipped, with the reason, unless EAGLE3_SGLANG_PYTHON names a Python with
sglang 0.5.23 (tools/sglang_cpu/README.md makes one). ~30 s."""

from __future__ import annotations

import os
import subprocess

import pytest
from test_sglang_live import SGLANG_PYTHON, STAND_IN, WHY_SKIPPED

pytestmark = [pytest.mark.skipif(SGLANG_PYTHON is None, reason=WHY_SKIPPED), pytest.mark.slow]


def test_kernels_match_sglang_triton_kernels():
    env = os.environ | {"SGLANG_USE_CPU_ENGINE": "1", "TRITON_INTERPRET": "1", "PYTHONPATH": str(STAND_IN)}
    done = subprocess.run(
        [SGLANG_PYTHON, str(STAND_IN / "check_kernels.py")],
        capture_output=True,
        text=True,
        env=env,
        timeout=900,
    )
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    lines = done.stdout.splitlines()
    assert any(line.startswith("build_tree + verify_tree_greedy: 42/42") for line in lines), done.stdout
    assert any(line.startswith("reconstruct_indices_from_tree_mask: 16/16") for line in lines), done.stdout
    assert any(line.startswith("attention: 4 cases") for line in lines), done.stdout
