"""The DFlash export loads in SGLang 0.5.23's DFLASH path: its config parser reads what we mean,
its DFlashDraftModel.load_weights fills every parameter with our tensors, and a block forward
through its modules equals our drafter's (tests/sglang_dflash_check.py, run in the SGLang venv).
Skipped, with the reason, unless EAGLE3_SGLANG_PYTHON names a Python with sglang 0.5.23
(tools/sglang_cpu/README.md makes one). ~30 s."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from test_decoding_fixtures import tiny_target
from test_sglang_live import SGLANG_PYTHON, STAND_IN, WHY_SKIPPED

from eagle3.drafter.dflash import DFlashConfig, DFlashDrafter
from eagle3.drafter.dflash_export import export_dflash

pytestmark = pytest.mark.skipif(SGLANG_PYTHON is None, reason=WHY_SKIPPED)
CHECK = Path(__file__).parent / "sglang_dflash_check.py"


def test_sglang_parses_loads_and_computes_our_dflash_export(tmp_path):
    target = tiny_target(dtype=torch.float32)  # 4 layers, GQA 4/2 heads of 16
    cfg = DFlashConfig.from_target_config(
        target.config, num_layers=2, block_size=4, target_layer_ids=[0, 2], mask_token_id=7, mask_token="<m>"
    )
    torch.manual_seed(0)
    drafter = DFlashDrafter(cfg)
    with torch.no_grad():  # norms away from 1, so that a norm SGLang skips shows
        for param in drafter.parameters():
            if param.dim() == 1:
                param.uniform_(0.5, 1.5)
    export_dflash(drafter, tmp_path / "drafter", dtype=torch.float32)
    context, block = 9, cfg.block_size
    io = {
        "aux": torch.randn(context, 2 * cfg.hidden_size),
        "block_embeds": torch.randn(block, cfg.hidden_size),
        "context_positions": torch.arange(context),
        "block_positions": torch.arange(context, context + block),
    }
    with torch.no_grad():
        kv = drafter.context(io["aux"][None], io["context_positions"][None])
        io["out"] = drafter(io["block_embeds"][None], io["block_positions"][None], kv)[0].contiguous()
    save_file(io, tmp_path / "io.safetensors")
    env = os.environ | {"SGLANG_USE_CPU_ENGINE": "1", "PYTHONPATH": str(STAND_IN)}
    done = subprocess.run(
        [
            SGLANG_PYTHON,
            str(CHECK),
            str(tmp_path / "drafter"),
            str(tmp_path / "io.safetensors"),
            str(tmp_path / "out.json"),
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    found = json.loads((tmp_path / "out.json").read_text())
    assert found["config_class"] == "Qwen3Config"
    assert found["num_hidden_layers"] == 2 and found["num_target_layers"] == 4 and found["block_size"] == 4
    assert found["target_layer_ids"] == found["resolved_layer_ids"] == [0, 2]
    assert (found["mask_token_id"], found["mask_token"]) == (7, "<m>")
    assert found["num_context_features"] == 2
    assert found["differing_parameters"] == []
    assert found["max_abs_diff"] < 1e-4
