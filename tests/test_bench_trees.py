"""`python -m bench.trees` with drafters of both families on the real SmolLM2: an EAGLE-3 drafter
at a tree and a DFlash drafter at its block decode the same prompts on one loaded target, each
checked against plain greedy, and a shape of the other family is refused before any loading."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoConfig

from eagle3.drafter.dflash import DFlashConfig, DFlashDrafter
from eagle3.drafter.dflash_export import export_dflash
from eagle3.target.load import resolve_target

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[1]
SHIPPED = REPO / "drafters" / "smollm2-135m-instruct-4m"
BLOCK = 4


def bench(*args: str) -> subprocess.CompletedProcess:
    env = os.environ | {"OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "bench.trees", *args]
    return subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)


@pytest.fixture(scope="module")
def dflash_drafter(tmp_path_factory) -> Path:
    """An untrained DFlash drafter of SmolLM2's shape (1 layer, blocks of 4)."""
    try:
        config = AutoConfig.from_pretrained(resolve_target("smollm2-135m-instruct"))
    except (FileNotFoundError, ImportError, OSError) as err:
        pytest.skip(f"default target not available: {err}")
    cfg = DFlashConfig.from_target_config(
        config, num_layers=1, block_size=BLOCK, target_layer_ids=[1, 8], mask_token_id=16
    )
    torch.manual_seed(0)
    folder = tmp_path_factory.mktemp("dflash") / "drafter"
    export_dflash(DFlashDrafter(cfg), folder, dtype=torch.float32)
    return folder


def test_an_eagle3_tree_and_a_dflash_block_are_decoded_in_one_paired_run(dflash_drafter, tmp_path):
    out = tmp_path / "trees.json"
    done = bench(
        *("--drafter", f"e3={SHIPPED}", "--drafter", f"df={dflash_drafter}"),
        *("--shapes", "e3:tree:2:4:6", "df:block"),
        *("--prompts", "2", "--tokens", "12", "--lookup", "0", "--drafter-dtype", "float32"),
        *("--json", str(out)),
    )
    assert done.returncode == 0, done.stdout + done.stderr  # a divergence from plain greedy exits 1
    data = json.loads(out.read_text())
    assert data["kinds"] == {"e3": "eagle3", "df": "dflash"}
    assert data["settings"]["df:block"] == {"drafter": "df", "mode": "block", "block_size": BLOCK}
    assert data["settings"]["e3:tree:2:4:6"]["mode"] == "tree"
    assert set(data["ttt_lengths"]) == {"e3"}  # a DFlash drafter has no TTT length
    figures = data["domains"]["mtbench"]
    block = figures["df:block"]
    assert len(block["reach"]) == BLOCK - 1  # reach is counted over the block's drafted positions
    # paired against the first shape, over the same prompts
    assert "acceptance_length_minus_reference_ci" in block
    # the shipped drafter accepts; the untrained block drafter hardly does
    assert figures["e3:tree:2:4:6"]["acceptance_length"] > block["acceptance_length"] >= 1.0
    assert "df:block - e3:tree:2:4:6: acceptance" in done.stdout


@pytest.mark.parametrize(
    ("shape", "expected"),
    [
        ("df:chain:2", "shape 'df:chain:2': drafter 'df' is dflash, whose shapes are [NAME:]block"),
        ("e3:block", "shape 'e3:block': drafter 'e3' is eagle3, whose shapes are [NAME:]chain:K or"),
    ],
)
def test_a_shape_of_the_other_family_is_refused_in_one_line(dflash_drafter, shape, expected):
    done = bench("--drafter", f"e3={SHIPPED}", "--drafter", f"df={dflash_drafter}", "--shapes", shape)
    assert done.returncode != 0 and expected in done.stderr
    assert "Traceback" not in done.stderr
