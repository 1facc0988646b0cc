"""SGLang 0.5.23's DFLASH speculative decoding, live on this CPU (tools/sglang_cpu).

A DFLASH server (tools/sglang_cpu/launch_server.py, whose dflash_cpu.py shims let SGLang's
DFlash worker run on a CPU) and a plain server of the same target, both float32 on the
intel_amx backend, decode the same prompts greedily, three requests at once: the DFLASH text
must be the plain text, token for token. The drafter is written by
tools/sglang_cpu/make_dflash_drafter.py in the layout SGLang loads; by default one that
proposes " the" at every block position, so that on "the the the ..." whole blocks are
accepted and the accept path is exercised, not only the reject path. Set
EAGLE3_DFLASH_DRAFTER=<dir> to serve another drafter instead (an exported one): the same
checks run, except the acceptance expected of the " the" drafter.

Skipped, with the reason, unless EAGLE3_SGLANG_PYTHON names a Python with sglang 0.5.23
(tools/sglang_cpu/make_venv.sh). Two servers, ~3.7 GB of RAM each.
"""

from __future__ import annotations

import json
import os
import subprocess
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from test_sglang_live import SGLANG_PYTHON, STAND_IN, STARTUP_TIMEOUT_S, WHY_SKIPPED

from eagle3.sglang.launch import Launch, start_servers, stop_servers
from eagle3.target.load import resolve_target

pytestmark = [
    pytest.mark.skipif(SGLANG_PYTHON is None, reason=WHY_SKIPPED),
    pytest.mark.timeout(STARTUP_TIMEOUT_S + 1800),
]

DRAFTER_ENV = "EAGLE3_DFLASH_DRAFTER"
TARGET = "smollm2-135m-instruct"
BLOCK_SIZE = 4
THE = 260  # SmolLM2's token " the"
TARGET_LAYER_IDS = [1, 14, 26]
MAX_NEW_TOKENS = 24
PROMPTS = [
    "Repeat after me: the the the the the the",  # the target answers " the" x 24
    "Write one sentence about the history of the Roman Empire.",
    "<|im_start|>user\nWhat is the best way to learn the piano?<|im_end|>\n<|im_start|>assistant\n",
]


def sglang_env() -> dict[str, str]:
    return os.environ | {"SGLANG_USE_CPU_ENGINE": "1", "PYTHONPATH": str(STAND_IN)}


@pytest.fixture(scope="module")
def drafter(tmp_path_factory) -> Path:
    given = os.environ.get(DRAFTER_ENV)
    if given:
        return Path(given).resolve()
    out = tmp_path_factory.mktemp("dflash") / "drafter"
    command = [SGLANG_PYTHON, str(STAND_IN / "make_dflash_drafter.py"), str(resolve_target(TARGET))]
    command += [str(out), "--block-size", str(BLOCK_SIZE), "--constant-token", str(THE)]
    command += ["--target-layer-ids", *map(str, TARGET_LAYER_IDS)]
    subprocess.run(command, check=True, capture_output=True, timeout=300)
    return out


@pytest.fixture(scope="module")
def servers(drafter, tmp_path_factory) -> Iterator[dict]:
    launch = Launch(SGLANG_PYTHON, "cpu", 1, "float32", tmp_path_factory.mktemp("dflash-logs"))
    dflash = ["--speculative-algorithm", "DFLASH", "--speculative-draft-model-path", str(drafter)]
    running = start_servers(launch, str(resolve_target(TARGET)), {"dflash": dflash, "plain": []})
    try:
        yield running
    finally:
        stop_servers(running)
    for server in running.values():  # no kernel of the stand-in was missing
        assert "NotImplementedError" not in server.log.read_text(errors="replace"), server.log


def get_json(url: str, body: dict | None = None) -> dict:
    data = json.dumps(body).encode() if body is not None else None
    request = urllib.request.Request(url, data, {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=1800) as response:
        return json.load(response)


def generate_all(url: str) -> list[dict]:
    """The prompts' greedy continuations, all three requests in flight at once."""
    body = {"sampling_params": {"temperature": 0, "max_new_tokens": MAX_NEW_TOKENS}}
    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        return list(pool.map(lambda p: get_json(f"{url}/generate", body | {"text": p}), PROMPTS))


def test_sglangs_own_parser_reads_the_drafter(drafter):
    code = (
        "import json, sys; from transformers import AutoConfig;"
        "from sglang.srt.speculative.dflash_utils import parse_dflash_draft_config as p;"
        "c = p(draft_hf_config=AutoConfig.from_pretrained(sys.argv[1]));"
        "print(json.dumps([c.num_hidden_layers, c.block_size, c.target_layer_ids, c.mask_token_id]))"
    )
    command = [SGLANG_PYTHON, "-c", code, str(drafter)]
    done = subprocess.run(command, capture_output=True, text=True, env=sglang_env(), timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    layers, block, layer_ids, mask = json.loads(done.stdout.strip().splitlines()[-1])
    assert layers >= 1 and block >= 2 and mask is not None and 0 <= mask < 49152
    assert layer_ids and all(0 <= i <= 28 for i in layer_ids)  # SmolLM2: 30 layers, the last not capturable
    if not os.environ.get(DRAFTER_ENV):
        assert (layers, block, layer_ids, mask) == (1, BLOCK_SIZE, TARGET_LAYER_IDS, THE)


def test_dflash_greedy_output_is_the_plain_servers(servers, drafter):
    info = get_json(f"{servers['dflash'].url}/get_server_info")
    assert info["speculative_algorithm"] == "DFLASH"
    assert info["speculative_draft_attention_backend"] == info["attention_backend"] == "intel_amx"
    spec, plain = generate_all(servers["dflash"].url), generate_all(servers["plain"].url)
    for prompt, ours, theirs in zip(PROMPTS, spec, plain, strict=True):
        assert ours["output_ids"], prompt
        assert ours["output_ids"] == theirs["output_ids"], (prompt, ours["text"], theirs["text"])
        meta = ours["meta_info"]
        assert meta["spec_verify_ct"] > 0 and meta["spec_accept_length"] >= 1.0, meta
    if not os.environ.get(DRAFTER_ENV):
        # the " the" drafter on " the the the ...": whole blocks accepted, the bonus token on top
        repeat = spec[0]["meta_info"]
        assert spec[0]["output_ids"] == [THE] * MAX_NEW_TOKENS
        assert repeat["spec_accept_length"] >= BLOCK_SIZE - 1, repeat
        assert repeat["spec_correct_drafts_histogram"][BLOCK_SIZE - 1] > 0, repeat
    print("\nDFLASH accept lengths:", [round(o["meta_info"]["spec_accept_length"], 2) for o in spec])


def test_the_stage_measures_an_exported_dflash_drafter_on_sglang(tmp_path):
    """speculative-eval with eval.backend sglang and drafter.kind dflash, as DVC runs it: this
    project's own export (random weights, seeded) served by a DFLASH server beside a plain one."""
    import torch
    from test_sglang_eval import run_stage
    from transformers import AutoConfig, AutoTokenizer

    from eagle3.drafter.dflash import DFlashConfig, DFlashDrafter, resolve_mask_token
    from eagle3.drafter.dflash_export import export_dflash

    path = resolve_target(TARGET)
    mask, text = resolve_mask_token(AutoTokenizer.from_pretrained(path), 49152)
    cfg = DFlashConfig.from_target_config(
        AutoConfig.from_pretrained(path), 1, BLOCK_SIZE, TARGET_LAYER_IDS, mask, text
    )
    torch.manual_seed(0)
    drafter = tmp_path / "drafter"
    export_dflash(DFlashDrafter(cfg), drafter, dtype=torch.float32)
    ev = {
        "backend": "sglang",
        "drafter": str(drafter),
        "domains": {"chat": 1, "code": 1},
        "max_new_tokens": 16,
    }
    ev |= {"dtype": "float32", "prompt_lookup": False, "lookup_tokens": 0, "sglang_python": SGLANG_PYTHON}
    raw = {"drafter": {"kind": "dflash"}, "eval": ev, "tracking": {"enabled": False}}
    project, done = run_stage(tmp_path, raw)
    assert done.returncode == 0, done.stderr[-3000:]
    metrics = json.loads((project / "metrics/speculative-eval.json").read_text())
    args = metrics["sglang_args"]["dflash"]
    assert args["speculative_algorithm"] == "DFLASH" and args["speculative_draft_model_path"] == str(drafter)
    assert args["speculative_num_draft_tokens"] == BLOCK_SIZE  # one block verified a step
    assert metrics["greedy_match"] == 1.0 and metrics["lossless"] and metrics["steps"] > 0
    assert metrics["eval_coverage"] == 1.0  # the target's own head: every token can be drafted
    assert set(metrics["per_position_acceptance"]) == {str(i) for i in range(1, BLOCK_SIZE)}
    assert set(metrics["per_domain"]) == {"chat", "code"}
