"""The SGLang backend against a real, running SGLang 0.5.23 server (optional, CPU-only).

tests/test_sglang.py replays recorded responses; this file launches the real server on this
machine (SmolLM2-135M-Instruct, bf16, CPU, tools/sglang_cpu/README.md) and runs the server-arg
checks and the patch-check and extract stages, as DVC runs them, against it.

It needs a Python with sglang 0.5.23, which the project never installs: point
EAGLE3_SGLANG_PYTHON at it, else every test here is skipped. Two servers (aux, then plain for
the final_state tests), ~3.7 GB of RAM each; 2 min on a quiet 2-core machine (7.5 min while
another pipeline shared it).
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
import yaml
from conftest import SHAREGPT_SAMPLE
from project_copy import copy_code

from eagle3.core.layer_ids import layer_id_rule
from eagle3.core.params import TargetParams, parse_params
from eagle3.data.extract import extract_features, select_conversations
from eagle3.data.store import MANIFEST, FeatureStore
from eagle3.decoding.divergence import check_divergence
from eagle3.sglang.check import MIN_ROW_COSINE, hf_reference, logprob_agreement
from eagle3.sglang.client import ServerPool
from eagle3.sglang.launch import stop_group
from eagle3.sglang.rows import prefill_body, request_rows
from eagle3.sglang.server_args import check_server_args
from eagle3.target.load import load_target, resolve_target
from eagle3.target.patch_check import fingerprint
from eagle3.target.render import render_prompt

REPO = Path(__file__).resolve().parents[1]
STAND_IN = REPO / "tools" / "sglang_cpu"  # holds the sgl_kernel stand-in
VERSION = "0.5.23"
AUX = [1, 14, 26]
H = 576
TOPK = 20  # extract.sglang_top_logprobs' default
LLAMA = layer_id_rule("LlamaForCausalLM")
STARTUP_TIMEOUT_S = 300
STAGE_TIMEOUT_S = 900
ENV_VAR = "EAGLE3_SGLANG_PYTHON"


def _sglang_python() -> tuple[str | None, str]:
    """(the python to launch SGLang with, or None; why not)."""
    python = os.environ.get(ENV_VAR)
    how = f"see tools/sglang_cpu/README.md to make one, then set {ENV_VAR}=<that venv>/bin/python"
    if not python:
        return None, f"{ENV_VAR} is not set: these tests need a python with sglang {VERSION} ({how})"
    try:
        done = subprocess.run(
            [python, "-c", "import sglang; print(sglang.__version__)"],
            capture_output=True,
            text=True,
            timeout=120,
            env=os.environ | {"PYTHONPATH": str(STAND_IN)},
        )
    except (OSError, subprocess.TimeoutExpired) as err:
        return None, f"{ENV_VAR}={python} cannot be run: {err} ({how})"
    version = done.stdout.strip().splitlines()[-1] if done.stdout.strip() else ""
    if done.returncode != 0 or version != VERSION:
        got = f"sglang {version}" if version else "no importable sglang"
        return None, f"{ENV_VAR}={python} has {got}, these tests need sglang {VERSION} ({how})"
    return python, ""


SGLANG_PYTHON, WHY_SKIPPED = _sglang_python()
# Past the suite's 15-minute default: a test here may wait for a server start (STARTUP_TIMEOUT_S)
# and two stage runs (STAGE_TIMEOUT_S each) before it fails on its own.
pytestmark = [
    pytest.mark.skipif(SGLANG_PYTHON is None, reason=WHY_SKIPPED),
    pytest.mark.timeout(STARTUP_TIMEOUT_S + 2 * STAGE_TIMEOUT_S),
    pytest.mark.slow,
]

# The launch that works on a CPU (tools/sglang_cpu/README.md), plus --sleep-on-idle: without it
# an idle SGLang scheduler spins one core at ~100%, half of a 2-core machine, which the stages'
# HF reference forwards need. The aux server names an EAGLE3 speculative algorithm with no draft
# model, as recorded (tests/fixtures/sglang); server_info then says speculative_algorithm null,
# aux_hidden_state_capture "eagle3".
BASE_ARGS = [
    "--device",
    "cpu",
    "--attention-backend",
    "torch_native",
    "--disable-overlap-schedule",
    "--max-total-tokens",
    "4096",
    "--dtype",
    "bfloat16",
    "--skip-server-warmup",
    "--sleep-on-idle",
    "--enable-return-hidden-states",
]
AUX_ARGS = [
    "--enable-return-aux-hidden-states",
    "--speculative-algorithm",
    "EAGLE3",
    "--return-aux-hidden-state-layer-ids",
    *map(str, AUX),
]


class LiveServer:
    """A real SGLang server in its own process group, logging to `log`."""

    def __init__(self, args: list[str], log: Path):
        self.log = log
        with socket.socket() as s:  # a free port (the tiny race until SGLang binds it is harmless here)
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        model = resolve_target("smollm2-135m-instruct")
        env = {k: v for k, v in os.environ.items() if not k.startswith(("MLFLOW_", "DVC_"))}
        # the repository root too: a --forward-hooks factory of this project imports from it
        env |= {"SGLANG_USE_CPU_ENGINE": "1", "PYTHONPATH": os.pathsep.join([str(STAND_IN), str(REPO)])}
        command = [SGLANG_PYTHON, "-m", "sglang.launch_server", "--model-path", str(model)]
        command += ["--host", "127.0.0.1", "--port", str(self.port), *BASE_ARGS, *args]
        with open(log, "wb") as out:
            self.process = subprocess.Popen(
                command, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True
            )
        self.started = time.monotonic()

    def tail(self, lines: int = 40) -> str:
        text = self.log.read_text(errors="replace") if self.log.exists() else ""
        return "\n".join(text.splitlines()[-lines:])

    def wait_ready(self) -> float:
        """Seconds until GET /get_server_info answers; fails with the log's tail otherwise."""
        while time.monotonic() - self.started < STARTUP_TIMEOUT_S:
            if self.process.poll() is not None:
                pytest.fail(f"SGLang exited with {self.process.returncode} while starting:\n{self.tail()}")
            try:
                with urllib.request.urlopen(f"{self.url}/get_server_info", timeout=5) as response:
                    if response.status == 200:
                        return time.monotonic() - self.started
            except OSError:
                pass
            time.sleep(1)
        self.stop()
        pytest.fail(f"SGLang did not answer /get_server_info within {STARTUP_TIMEOUT_S} s:\n{self.tail()}")

    def info(self) -> dict:
        return ServerPool([self.url]).server_info(self.url)

    def stop(self) -> None:
        stop_group(self.process)


def launched(args: list[str], log: Path) -> Iterator[LiveServer]:
    server = LiveServer(args, log)
    try:
        seconds = server.wait_ready()
        print(f"\nSGLang ({'aux' if AUX_ARGS[0] in args else 'plain'}) up in {seconds:.0f} s at {server.url}")
        yield server
    finally:
        server.stop()
    # no kernel of the stand-in was needed: it raises NotImplementedError when one is called
    assert "NotImplementedError" not in log.read_text(errors="replace"), server.tail()


@pytest.fixture(scope="module")
def aux_server(tmp_path_factory) -> Iterator[LiveServer]:
    yield from launched(AUX_ARGS, tmp_path_factory.mktemp("sglang") / "aux_server.log")


@pytest.fixture(scope="module")
def plain_server(tmp_path_factory) -> Iterator[LiveServer]:
    yield from launched([], tmp_path_factory.mktemp("sglang") / "plain_server.log")


# --- helpers -------------------------------------------------------------------------------


def conversations(folder: Path, n: int = 6) -> Path:
    """The first n real ShareGPT conversations as the data source."""
    path = folder / "conversations.jsonl"
    path.write_text("".join(SHAREGPT_SAMPLE.read_text().splitlines(keepends=True)[:n]))
    return path


def live_params(data_file: Path, aux_url: str, data: dict | None = None, **extract) -> dict:
    return {
        "target": {"dtype": "float32"},
        "data": {"source": str(data_file), "num_samples": 6, "max_length": 256, "seed": 0} | (data or {}),
        "extract": {"backend": "sglang", "sglang_url": aux_url, "shard_samples": 4} | extract,
        "tracking": {"enabled": False},
    }


def make_project(project: Path, raw: dict, report_from: Path | None = None) -> Path:
    """A copy of the code with `raw` as params.yaml, and optionally another project's patch-check
    report (what DVC reuses when only data or transport params change)."""
    copy_code(project, pipeline=False)
    (project / "params.yaml").write_text(yaml.safe_dump(raw))
    if report_from is not None:
        shutil.copytree(report_from / "artifacts/patch-check", project / "artifacts/patch-check")
    return project


def stage(project: Path, name: str) -> subprocess.CompletedProcess:
    """`python -m stages.<name>` as DVC runs it, with the project venv's python."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MLFLOW_", "DVC_"))}
    started = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-m", f"stages.{name}"],
        cwd=project,
        env=env,
        capture_output=True,
        text=True,
        timeout=STAGE_TIMEOUT_S,
    )
    print(f"stages.{name}: {time.monotonic() - started:.0f} s, rc {done.returncode}")
    return done


def run_ok(project: Path, name: str) -> None:
    done = stage(project, name)
    assert done.returncode == 0, f"stages.{name} failed:\n{done.stdout}\n{done.stderr}"


def report_of(project: Path) -> dict:
    return json.loads((project / "artifacts/patch-check/report.json").read_text())


def store_of(project: Path) -> FeatureStore:
    store = FeatureStore(project / "artifacts/extract")
    store.verify()
    assert store.fingerprint.to_json() == report_of(project)["fingerprint"]
    metrics = json.loads((project / "metrics/extract.json").read_text())
    print(f"extract metrics: {metrics}")
    return store


def hf_store(smollm2, raw: dict, out: Path) -> FeatureStore:
    """The same params extracted by the hf backend (the smollm2 fixture, float32)."""
    params = parse_params(raw)
    params = params.model_copy(update={"extract": params.extract.model_copy(update={"backend": "hf"})})
    extract_features(smollm2, params, AUX, fingerprint(smollm2, AUX), out)
    return FeatureStore(out)


def check_top_logprobs(store: FeatureStore, smollm2) -> dict:
    """Every sample's stored top-N: shape, dtype, order; top-1 against the HF float32 argmax
    (patch-check's reference and scores)."""
    reference = hf_reference(smollm2.model, AUX)
    agree = total = 0
    worst_error = 0.0
    for i in range(len(store)):
        sample = store.sample(i)
        ids, logprobs, n = sample["target_topk_ids"], sample["target_topk_logprobs"], len(sample["input_ids"])
        assert ids.dtype == torch.int32 and ids.shape == (n, TOPK), (i, ids.dtype, ids.shape)
        assert logprobs.dtype == torch.float32 and logprobs.shape == (n, TOPK), (i, logprobs.dtype)
        assert (logprobs <= 0).all() and (logprobs[:, :-1] >= logprobs[:, 1:]).all(), i
        scores = logprob_agreement(ids, logprobs, reference(sample["input_ids"].tolist())["log_probs"])
        agree += round(scores["top1_agreement"] * n)
        total += n
        worst_error = max(worst_error, round(scores["max_top1_logprob_error"], 4))
    figures = {
        "top1_agreement": round(agree / total, 4),
        "positions": total,
        "max_top1_lp_error": worst_error,
    }
    print(f"stored top-1 vs HF float32 argmax: {agree}/{total}, {figures}")
    assert agree / total >= 0.9, figures
    return figures


def min_cosine(ours: torch.Tensor, theirs: torch.Tensor) -> float:
    """The worst per-row, per-H-slice cosine of two [T, k*H] feature tensors."""
    a, b = ours.float().view(len(ours), -1, H), theirs.float().view(len(theirs), -1, H)
    return torch.nn.functional.cosine_similarity(a, b, dim=-1).min().item()


@pytest.fixture(scope="module")
def checked_project(aux_server, tmp_path_factory) -> Path:
    """The default mode (sglang_target: top_logprobs) after stages.patch_check ran on the live server."""
    folder = tmp_path_factory.mktemp("top_logprobs")
    project = make_project(folder / "project", live_params(conversations(folder), aux_server.url))
    run_ok(project, "patch_check")
    return project


# --- tests ---------------------------------------------------------------------------------


def test_the_live_server_args_pass_the_checks(aux_server, smollm2):
    info = aux_server.info()
    record = check_server_args(aux_server.url, info, "aux", AUX, LLAMA)
    assert record == {
        "version": VERSION,
        "dtype": "bfloat16",
        "quantization": None,
        "kv_cache_dtype": "auto",
        "tp_size": 1,
        "enable_return_hidden_states": True,
        "enable_return_aux_hidden_states": True,
        "return_aux_hidden_state_layer_ids": AUX,
        "forward_hooks": None,  # recorded: a server relaunched with a hook config is refused
    }
    # an aux server is refused where the final-norm state is wanted, and for other layers
    with pytest.raises(ValueError, match="launch it without --enable-return-aux-hidden-states"):
        check_server_args(aux_server.url, info, "final", AUX, LLAMA)
    with pytest.raises(ValueError, match=r"captures layers \[1, 14, 26\]"):
        check_server_args(aux_server.url, info, "aux", [2, 15, 27], LLAMA)
    # what one extraction request costs here (250 tokens, aux rows + top-20 logprobs)
    ids = [1] + smollm2.tokenizer(SHAREGPT_SAMPLE.read_text()[:4000]).input_ids[:249]
    started = time.monotonic()
    rows = request_rows(ServerPool([aux_server.url]), prefill_body(ids, TOPK), 3 * H, "aux rows")
    print(f"one 250-token aux + top-{TOPK} request: {time.monotonic() - started:.2f} s")
    assert rows.prefill.shape == (250, 3 * H) and rows.top_ids.shape == (250, TOPK)


def test_stages_extract_top_logprobs_from_the_live_server(checked_project, smollm2, tmp_path):
    fp = report_of(checked_project)["fingerprint"]
    assert (fp["engine"], fp["engine_version"], fp["dtype"], fp["target_top_logprobs"]) == (
        "sglang",
        VERSION,
        "bfloat16",
        TOPK,
    )
    assert fp["server_args"]["return_aux_hidden_state_layer_ids"] == AUX and fp["final_server_args"] is None
    print("patch-check scores:", json.dumps([c["agreement"] for c in report_of(checked_project)["checks"]]))
    run_ok(checked_project, "extract")
    store = store_of(checked_project)
    assert len(store) == 6 and store.target_topk == TOPK
    hf = hf_store(smollm2, yaml.safe_load((checked_project / "params.yaml").read_text()), tmp_path / "hf")
    assert json.loads((store.folder / MANIFEST).read_text())["num_tokens"] == len(hf.tokens()["input_ids"])
    for i in range(len(store)):
        ours, theirs = store.sample(i), hf.sample(i)
        assert torch.equal(ours["input_ids"], theirs["input_ids"]), i
        assert torch.equal(ours["loss_mask"], theirs["loss_mask"]), i
        assert "last_hidden" not in ours
        assert min_cosine(ours["aux_hidden"], theirs["aux_hidden"]) >= MIN_ROW_COSINE, i
    check_top_logprobs(store, smollm2)


@torch.no_grad()
def hf_answer(smollm2, sample: dict, prompt_len: int) -> list[int]:
    """The hf backend's on-policy answer: the stored tokens after the prompt, then the token its
    last row predicts (the store keeps every token but the last), from the float32 target."""
    stored = sample["input_ids"].tolist()
    last = smollm2.model(torch.tensor([stored])).logits[0, -1]
    return stored[prompt_len:] + [int(last.argmax())]


def test_self_distillation_through_the_live_server(checked_project, aux_server, smollm2, tmp_path):
    data = {"num_samples": 2, "regenerate": True, "regenerate_max_new_tokens": 16}
    raw = live_params(conversations(tmp_path), aux_server.url, data)
    # data params do not touch patch-check (dvc.yaml): its report is reused, as DVC would
    project = make_project(tmp_path / "project", raw, report_from=checked_project)
    run_ok(project, "extract")
    store = store_of(project)
    assert len(store) == 2 and store.target_topk == TOPK
    tokenizer = smollm2.tokenizer
    selected = select_conversations(parse_params(raw), tokenizer, chat=True)
    prompts = [render_prompt(tokenizer, chosen.messages, chat=True).tolist() for chosen in selected]
    # the server's own greedy answers to the selected prompts, asked for directly (together: one
    # decode batch)
    pool = ServerPool([aux_server.url])
    sampling = {"max_new_tokens": 16, "temperature": 0, "stop_token_ids": [2]}
    with ThreadPoolExecutor(len(prompts)) as threads:
        answers = list(
            threads.map(
                lambda p: pool.generate(aux_server.url, {"input_ids": p, "sampling_params": sampling}),
                prompts,
            )
        )
    hf = hf_store(smollm2, raw, tmp_path / "hf")
    bf16 = load_target(TargetParams(dtype="bfloat16"))  # the server's dtype: its ties are bf16 ties
    for i, (prompt, response) in enumerate(zip(prompts, answers, strict=True)):
        answer, sample = response["output_ids"], store.sample(i)
        print(
            f"sample {i}: prompt {len(prompt)} tokens, answer {len(answer)}, ends in EOS: {answer[-1] == 2}"
        )
        # prompt + the answer up to (not including) its last token, whose prediction the last row holds
        assert sample["input_ids"].tolist() == prompt + answer[:-1], i
        assert sample["loss_mask"].tolist() == [0] * len(prompt) + [1] * (len(answer) - 1), i
        # the hf backend's on-policy extraction (float32 greedy) writes the same tokens up to where
        # the two answers part, if they do: only at a token divergence.py judges a bf16 tie
        theirs = hf.sample(i)
        parted = check_divergence(bf16.model, prompt, answer, hf_answer(smollm2, theirs, len(prompt)), 1)
        same = len(prompt) + (len(answer) - 1 if parted is None else parted.index)
        if parted is not None:
            print(f"sample {i}: the answers part at token {parted.index}: {parted.as_dict()}")
            assert parted.explained, (i, parted.as_dict())
        assert torch.equal(theirs["input_ids"][:same], sample["input_ids"][:same]), i
        assert torch.equal(theirs["loss_mask"][:same], sample["loss_mask"][:same]), i
        assert min_cosine(sample["aux_hidden"][:same], theirs["aux_hidden"][:same]) >= MIN_ROW_COSINE, i
    check_top_logprobs(store, smollm2)


# --- final_state: a second, plain-mode server (two fit: ~3.7 GB each; ~1 min to start) ------


@pytest.fixture(scope="module")
def final_state_project(aux_server, plain_server, tmp_path_factory) -> Path:
    """sglang_target: final_state after stages.patch_check. One request in flight: the aux
    requests ask for no logprobs, so they hit the prefix cache (SmolLM2's chat template puts the
    same system prompt first); with one in flight the client's flush-and-retry works."""
    folder = tmp_path_factory.mktemp("final_state")
    raw = live_params(
        conversations(folder),
        aux_server.url,
        sglang_target="final_state",
        sglang_final_url=plain_server.url,
        sglang_requests_in_flight=1,
    )
    project = make_project(folder / "project", raw)
    run_ok(project, "patch_check")
    return project


def test_final_state_mode_with_a_second_live_server(final_state_project, plain_server, smollm2, tmp_path):
    info = plain_server.info()
    assert not check_server_args(plain_server.url, info, "final", AUX, LLAMA)[
        "enable_return_aux_hidden_states"
    ]
    with pytest.raises(ValueError, match="needs --enable-return-aux-hidden-states"):
        check_server_args(plain_server.url, info, "aux", AUX, LLAMA)
    fp = report_of(final_state_project)["fingerprint"]
    assert (
        fp["target_top_logprobs"] is None and not fp["final_server_args"]["enable_return_aux_hidden_states"]
    )
    run_ok(final_state_project, "extract")
    store = store_of(final_state_project)
    assert store.target_topk is None and len(store) == 6
    raw = yaml.safe_load((final_state_project / "params.yaml").read_text())
    hf = hf_store(smollm2, raw, tmp_path / "hf")
    for i in range(len(store)):
        ours, theirs = store.sample(i), hf.sample(i)
        assert torch.equal(ours["input_ids"], theirs["input_ids"]), i
        assert min_cosine(ours["aux_hidden"], theirs["aux_hidden"]) >= MIN_ROW_COSINE, i
        # the plain server's rows are the final-norm state (the lm_head's input), as HF's last_hidden
        assert min_cosine(ours["last_hidden"], theirs["last_hidden"]) >= MIN_ROW_COSINE, i


def test_final_state_mode_with_requests_in_flight_needs_the_radix_cache_off(final_state_project, tmp_path):
    """The default 16 requests in flight, radix cache on (as the launch command has it). Seen
    here: SGLang 0.5.23 flushes only an idle server (HTTP 400 "Flush cache failed." while other
    requests run), so extraction refuses that setup before sending anything."""
    raw = yaml.safe_load((final_state_project / "params.yaml").read_text())
    raw["extract"].pop("sglang_requests_in_flight")  # a transport key: the same patch-check
    project = make_project(tmp_path / "project", raw, report_from=final_state_project)
    done = stage(project, "extract")
    assert done.returncode == 1 and "--disable-radix-cache" in done.stderr, done.stderr
    assert not list((project / "artifacts" / "extract").glob("shard-*"))
