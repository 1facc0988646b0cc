"""The SGLang backend against real recorded SGLang 0.5.23 responses (tests/fixtures/sglang):
parsing and position alignment, prefix-cache hits, agreement with the HF reference files,
server checks, shards identical in format to the hf backend's, self-distillation, and the
patch-check and extract stages run against local replay servers."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import threading
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import torch
import yaml
from project_copy import copy_code
from safetensors.torch import load_file

from eagle3.core.layer_ids import layer_id_rule
from eagle3.core.params import ParamsError, parse_params
from eagle3.data.extract import ExtractionPlan, extract_features, run_extraction
from eagle3.data.store import FEATURE_KEYS, MANIFEST, TOPK_KEYS, FeatureStore
from eagle3.sglang.check import (
    CHECK_CONVERSATIONS,
    MAX_TOP1_LOGPROB_ERROR,
    MIN_MEAN_COSINE,
    MIN_ROW_COSINE,
    MIN_TOP1_AGREEMENT,
    agreement,
    check_pools,
    hf_reference,
    logprob_agreement,
    run_sglang_patch_check,
    sglang_fingerprint,
)
from eagle3.sglang.client import ServerPool, SGLangError
from eagle3.sglang.extract import sglang_group_fn
from eagle3.sglang.patch_check import check_inputs
from eagle3.sglang.rows import FLUSH_WAITS_S, PartialPrefillError, parse_rows, prefill_body, request_rows
from eagle3.sglang.server_args import check_server_args
from eagle3.sglang.servers import ExtractionServers, TopLogprobs
from eagle3.target.fingerprint import Fingerprint
from eagle3.target.load import eos_token_ids_of_folder, resolve_target
from eagle3.target.patch_check import PatchCheckError, fingerprint

FIXTURES = Path(__file__).parent / "fixtures" / "sglang"
REPO = Path(__file__).resolve().parents[1]
STAGE_TIMEOUT_S = 900  # a tiny stage against the replay servers takes seconds
AUX = [1, 14, 26]
H = 576
NAMES = [f"layer_{layer}" for layer in AUX]
LLAMA = layer_id_rule("LlamaForCausalLM")


def fixture(name: str) -> dict:
    return json.loads((FIXTURES / name).read_text())


def reference(n: int) -> dict[str, torch.Tensor]:
    return load_file(FIXTURES / f"hf_ref_{n:02d}.safetensors")


def server_info(mode: str) -> dict:
    """/get_server_info of the recorded aux-mode server (lp_server_info.json); the plain mode's
    is that with the aux flags off (constructed: that server was not recorded)."""
    info = fixture("lp_server_info.json")
    if mode == "final":
        info |= {"enable_return_aux_hidden_states": False, "return_aux_hidden_state_layer_ids": None}
    return info


class Replay(ThreadingHTTPServer):
    """A local SGLang stand-in answering with the recorded responses (aux mode) or rows built
    from the HF reference's final_norm (plain mode, constructed)."""

    def __init__(self, mode: str, cache_hit_first: bool = False, always_hit: bool = False):
        super().__init__(("127.0.0.1", 0), ReplayHandler)
        self.mode, self.info, self.flushes, self.requests = mode, server_info(mode), 0, []
        self.recorded = {}  # (ids, max_new_tokens, top_logprobs_num) -> recorded response
        for prefix in ("", "lp_"):
            for n in range(1, 5):
                req = fixture(f"{prefix}req_{n:02d}.json")
                key = (
                    tuple(req["input_ids"]),
                    req["sampling_params"]["max_new_tokens"],
                    req.get("top_logprobs_num"),
                )
                self.recorded[key] = fixture(f"{prefix}resp_{n:02d}.json")
        self.hit = {tuple(fixture("req_05.json")["input_ids"])} if cache_hit_first or always_hit else set()
        self.always_hit = always_hit
        self.busy_flushes = 0  # flushes refused as SGLang refuses them while requests run
        self.references = [reference(n) for n in range(1, 5)]
        self.thread = threading.Thread(target=self.serve_forever, daemon=True)
        self.thread.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"

    def answer(self, body: dict) -> dict | None:
        ids = tuple(body["input_ids"])
        if self.mode == "final":
            for ref in self.references:
                if ids == tuple(ref["input_ids"][: len(ids)].tolist()):
                    rows = ref["final_norm"][: len(ids)].to(torch.bfloat16).float()
                    meta = {"prompt_tokens": len(ids), "cached_tokens": 0, "hidden_states": [rows.tolist()]}
                    return {"text": "", "output_ids": [0], "meta_info": meta}
            return None
        top = body.get("top_logprobs_num")
        if ids in self.hit:  # recorded: logprobs from position 0 on keep SGLang off its prefix cache
            return fixture("lp_resp_05.json" if top else "resp_05.json")
        return self.recorded.get((ids, body["sampling_params"]["max_new_tokens"], top))

    def close(self) -> None:
        self.shutdown()
        self.server_close()


class ReplayHandler(BaseHTTPRequestHandler):
    server: Replay

    def log_message(self, *args) -> None:  # keep test output clean
        pass

    def reply(self, code: int, payload: bytes, kind: str = "application/json") -> None:
        self.send_response(code)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)

    def do_GET(self) -> None:
        if self.path == "/get_server_info":
            self.reply(200, json.dumps(self.server.info).encode())
        else:
            self.reply(404, b'{"error": "not found"}')

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])) or b"{}")
        if self.path == "/flush_cache":
            if self.server.busy_flushes > 0:
                self.server.busy_flushes -= 1
                self.reply(400, b"Flush cache failed.", "text/plain")
                return
            self.server.flushes += 1
            if not self.server.always_hit:
                self.server.hit.clear()
            self.reply(200, b"Cache flushed.", "text/plain")
            return
        self.server.requests.append(body)
        response = self.server.answer(body)
        if response is None:
            self.reply(400, b'{"error": "no recorded response for this request"}')
        else:
            self.reply(200, json.dumps(response).encode())


@pytest.fixture
def servers():
    aux, final = Replay("aux", cache_hit_first=True), Replay("final")
    yield aux, final
    aux.close()
    final.close()


# --- parsing and alignment -------------------------------------------------------------------


@pytest.mark.parametrize("n", [1, 2, 3])
def test_prefill_rows_cover_every_position_and_agree_with_hf(n):
    rows = parse_rows(
        fixture(f"resp_{n:02d}.json"), len(fixture(f"req_{n:02d}.json")["input_ids"]), 3 * H, "aux"
    )
    ref = reference(n)
    assert rows.prefill.shape == (len(ref["input_ids"]), 3 * H) and len(rows.decode) == 0
    assert torch.equal(rows.prefill.to(torch.bfloat16).float(), rows.prefill)  # stored as bf16 losslessly
    for name, score in agreement(rows.prefill, ref, NAMES).items():
        assert score["min_cosine"] >= MIN_ROW_COSINE and score["mean_cosine"] >= MIN_MEAN_COSINE, name


def test_decode_rows_follow_the_prefill_at_the_fed_positions():
    rows = parse_rows(fixture("resp_04.json"), 37, 3 * H, "aux")
    ref = reference(4)  # prompt + the first 15 generated tokens
    assert rows.output_ids[:15] == ref["input_ids"][37:].tolist() and len(rows.decode) == 15
    aligned = agreement(torch.cat([rows.prefill, rows.decode]), ref, NAMES)
    assert min(s["min_cosine"] for s in aligned.values()) >= MIN_ROW_COSINE
    # one position off (the classic decode-step mistake) is far outside the tolerance
    shifted = agreement(
        torch.cat([rows.prefill, rows.decode])[1:], {k: v[:-1] for k, v in ref.items()}, NAMES
    )
    assert min(s["min_cosine"] for s in shifted.values()) < 0.9


def test_a_prefix_cache_hit_is_detected_not_stored_short():
    with pytest.raises(PartialPrefillError, match="rows for 18 of 61 prompt positions"):
        parse_rows(fixture("resp_05.json"), 61, 3 * H, "aux")
    # the 18 rows are right, just not all: they match HF positions 43..60
    rows = torch.tensor(fixture("resp_05.json")["meta_info"]["hidden_states"][0])
    part = agreement(rows, {k: v[43:] for k, v in reference(1).items()}, NAMES)
    assert min(s["min_cosine"] for s in part.values()) >= MIN_ROW_COSINE


def test_wrong_width_names_the_layer_flag():
    with pytest.raises(RuntimeError, match=r"shape \[61, 1728\], expected \[n, 576\]"):
        parse_rows(fixture("resp_01.json"), 61, H, "final-norm rows")


def test_cache_hit_is_flushed_and_re_requested(servers):
    aux, _ = servers
    rows = request_rows(
        ServerPool([aux.url]), prefill_body(fixture("req_01.json")["input_ids"]), 3 * H, "aux"
    )
    assert rows.prefill.shape == (61, 3 * H) and aux.flushes == 1


@pytest.mark.slow
def test_a_flush_refused_a_moment_after_the_reply_is_tried_again(servers):
    """SGLang 0.5.23 may refuse a flush right after its reply, its scheduler not yet idle: a few
    refusals are waited out (rows.FLUSH_WAITS_S); one that lasts names --disable-radix-cache."""
    aux, _ = servers
    body = prefill_body(fixture("req_01.json")["input_ids"])
    aux.busy_flushes = len(FLUSH_WAITS_S)
    rows = request_rows(ServerPool([aux.url]), body, 3 * H, "aux")
    assert rows.prefill.shape == (61, 3 * H) and aux.flushes == 1 and aux.busy_flushes == 0
    aux.hit.add(tuple(fixture("req_05.json")["input_ids"]))  # a cache hit again
    aux.busy_flushes = len(FLUSH_WAITS_S) + 1
    with pytest.raises(PartialPrefillError, match="refused to flush its cache .*--disable-radix-cache"):
        request_rows(ServerPool([aux.url]), body, 3 * H, "aux")


def test_a_cache_that_keeps_hitting_is_an_error():
    aux = Replay("aux", always_hit=True)
    try:
        with pytest.raises(PartialPrefillError, match="--disable-radix-cache"):
            request_rows(
                ServerPool([aux.url]), prefill_body(fixture("req_01.json")["input_ids"]), 3 * H, "aux"
            )
    finally:
        aux.close()


# --- top-N logprobs (sglang_target: top_logprobs) ----------------------------------------------


def hf_log_probs(smollm2, ids: list[int]) -> torch.Tensor:
    """patch-check's HF float32 reference log-probabilities [T, V]; row t predicts token t + 1."""
    return hf_reference(smollm2.model, AUX)(ids)["log_probs"]


@pytest.mark.parametrize("n", [1, 2, 3])
def test_top_logprobs_are_the_prediction_of_the_next_token_and_agree_with_hf(n, smollm2):
    ids = fixture(f"lp_req_{n:02d}.json")["input_ids"]
    rows = parse_rows(fixture(f"lp_resp_{n:02d}.json"), len(ids), 3 * H, "aux", top_logprobs=20)
    assert rows.top_ids.shape == rows.top_logprobs.shape == (len(ids), 20)
    assert rows.top_ids.dtype == torch.int32 and rows.top_logprobs.dtype == torch.float32
    assert bool((rows.top_logprobs.diff(dim=-1) <= 0).all())  # best first
    # the hidden states are the same bytes as without logprobs
    assert torch.equal(
        rows.prefill, parse_rows(fixture(f"resp_{n:02d}.json"), len(ids), 3 * H, "aux").prefill
    )
    want = hf_log_probs(smollm2, ids)
    scores = logprob_agreement(rows.top_ids, rows.top_logprobs, want)
    assert scores["top1_agreement"] >= MIN_TOP1_AGREEMENT  # recorded: 0.968-0.984
    assert scores["max_top1_logprob_error"] <= MAX_TOP1_LOGPROB_ERROR  # recorded: 0.158
    # read one position off (SGLang's entry i predicts token i, not i + 1) and nothing agrees
    shifted = logprob_agreement(rows.top_ids[1:], rows.top_logprobs[1:], want[:-1])
    assert shifted["top1_agreement"] < 0.2 and shifted["max_top1_logprob_error"] > 1.0


def test_generation_top_logprobs_cover_the_prompt_and_the_fed_answer(smollm2):
    response = fixture("lp_resp_04.json")
    rows = parse_rows(response, 37, 3 * H, "aux", top_logprobs=20)
    answer = response["output_ids"]
    assert rows.top_ids.shape == (37 + 16 - 1, 20) and len(rows.decode) == 15
    # greedy: from the last prompt position on, the top-1 is the next answer token
    assert rows.top_ids[36:, 0].tolist() == answer
    fed = reference(4)["input_ids"].tolist()  # prompt + answer[:15]
    scores = logprob_agreement(rows.top_ids, rows.top_logprobs, hf_log_probs(smollm2, fed))
    assert scores["top1_agreement"] >= MIN_TOP1_AGREEMENT


def test_logprob_requests_are_never_cache_hits_and_short_lists_are_refused():
    # recorded: lp_req_05 = lp_req_01 sent after lp_req_04 without a flush comes back whole
    # (resp_05, the same request without logprobs, had 43 cached tokens and 18 rows)
    hit = fixture("lp_resp_05.json")
    assert hit["meta_info"]["cached_tokens"] == 0
    rows = parse_rows(hit, 61, 3 * H, "aux", top_logprobs=20)
    assert torch.equal(
        rows.top_ids, parse_rows(fixture("lp_resp_01.json"), 61, 3 * H, "aux", top_logprobs=20).top_ids
    )
    short = json.loads(json.dumps(fixture("lp_resp_01.json")))
    short["meta_info"]["input_top_logprobs"] = short["meta_info"]["input_top_logprobs"][43:]
    with pytest.raises(PartialPrefillError, match="top logprobs for 18 of 61 prompt positions"):
        parse_rows(short, 61, 3 * H, "aux", top_logprobs=20)
    with pytest.raises(SGLangError, match="holds 20 top logprobs, expected 32"):
        parse_rows(fixture("lp_resp_01.json"), 61, 3 * H, "aux", top_logprobs=32)
    with pytest.raises(SGLangError, match="send return_logprob: true, logprob_start_len: 0"):
        parse_rows(fixture("resp_01.json"), 61, 3 * H, "aux", top_logprobs=20)


# --- server checks and the layer-id rule -----------------------------------------------------


@pytest.mark.parametrize(
    ("change", "mode", "message"),
    [
        ({"version": "0.4.9"}, "aux", "runs SGLang 0.4.9; supported: 0.5.23"),
        ({"return_aux_hidden_state_layer_ids": [2, 15, 27]}, "aux", "captures layers [2, 15, 27]"),
        ({"enable_return_aux_hidden_states": False}, "aux", "needs --enable-return-aux-hidden-states"),
        ({"enable_return_aux_hidden_states": True}, "final", "launch it without --enable-return-aux"),
        ({"enable_return_hidden_states": False}, "final", "without --enable-return-hidden-states"),
    ],
)
def test_server_args_are_checked(change, mode, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        check_server_args("http://s", server_info(mode) | change, mode, AUX, LLAMA)


def test_deepseek_and_kimi_refuse_two_batch_overlap():
    for architecture in ("DeepseekV3ForCausalLM", "KimiK25ForConditionalGeneration"):
        rule = layer_id_rule(architecture)
        info = server_info("aux") | {"enable_two_batch_overlap": True}
        with pytest.raises(ValueError, match="first_k_dense_replace"):
            check_server_args("http://s", info, "aux", AUX, rule)
    with pytest.raises(ValueError, match="no SGLang layer-id rule"):
        layer_id_rule("MysteryForCausalLM")


@pytest.mark.slow
def test_pools_must_agree(servers):
    aux, final = servers
    aux_args, final_args = check_pools(ServerPool([aux.url]), ServerPool([final.url]), AUX, LLAMA)
    assert aux_args["version"] == "0.5.23" and aux_args["return_aux_hidden_state_layer_ids"] == AUX
    other = Replay("aux")
    other.info["tp_size"] = 2
    try:
        with pytest.raises(ValueError, match="differ in tp_size"):
            check_pools(ServerPool([aux.url, other.url]), ServerPool([final.url]), AUX, LLAMA)
    finally:
        other.close()


def test_params_list_servers_and_refuse_what_cannot_run():
    params = parse_params(
        {
            "extract": {
                "backend": "sglang",
                "sglang_target": "final_state",
                "sglang_url": ["http://a:1", "http://b:1"],
                "sglang_final_url": "http://c:1",
            }
        }
    )
    servers = ExtractionServers.from_params(params.extract)
    assert servers.aux.urls == ["http://a:1", "http://b:1"] and servers.final.urls == ["http://c:1"]
    assert servers.top_logprobs is None
    # the default takes the target's prediction from the aux request: one kind of server
    default = parse_params({"extract": {"backend": "sglang", "sglang_url": "http://a:1"}}).extract
    assert (default.sglang_target, default.sglang_top_logprobs) == ("top_logprobs", 20)
    assert ExtractionServers.from_params(default).mode == TopLogprobs(20)
    with pytest.raises(ParamsError, match="final_state' needs sglang_final_url"):
        parse_params(
            {"extract": {"backend": "sglang", "sglang_target": "final_state", "sglang_url": "http://a:1"}}
        )
    with pytest.raises(ParamsError, match="sglang_final_url is used only with sglang_target: final_state"):
        parse_params(
            {"extract": {"backend": "sglang", "sglang_url": "http://a:1", "sglang_final_url": "http://c:1"}}
        )
    with pytest.raises(ParamsError, match="needs sglang_url"):
        parse_params({"extract": {"backend": "sglang"}})
    with pytest.raises(ParamsError, match="must start with http"):
        parse_params({"extract": {"sglang_url": "a:1"}})
    with pytest.raises(ParamsError, match="serves the drafter's tree alone.*set lookup_tokens: 0"):
        parse_params({"eval": {"backend": "sglang"}})


# --- patch-check ---------------------------------------------------------------------------


def recorded_reference(ids: list[int]) -> dict[str, torch.Tensor]:
    """The HF reference files, looked up by input ids."""
    for n in range(1, 5):
        ref = reference(n)
        if ref["input_ids"].tolist() == ids:
            return ref
    raise KeyError("no HF reference file for these ids")


def test_patch_check_agrees_with_the_hf_reference_files(servers, smollm2):
    aux, final = servers
    inputs, prompt = check_inputs(smollm2.tokenizer, chat=True)
    assert inputs == [fixture(f"req_{n:02d}.json")["input_ids"] for n in (1, 2, 3)]  # rendered as recorded
    assert prompt == fixture("req_04.json")["input_ids"]
    checks = run_sglang_patch_check(
        ServerPool([aux.url]), ServerPool([final.url]), inputs, prompt, H, AUX, recorded_reference
    )
    assert [c["kind"] for c in checks] == ["prefill"] * 6 + ["generate"]
    assert checks[-1]["tokens"] == 52


def test_patch_check_fails_on_the_wrong_layers(servers, smollm2):
    aux, final = servers
    inputs, prompt = check_inputs(smollm2.tokenizer, chat=True)

    def hf_index_as_layer_id(ids):  # the classic mistake: layer L read as HF hidden_states[L]
        ref = dict(recorded_reference(ids))
        ref["layer_14"], ref["layer_26"] = ref["layer_1"], ref["layer_14"]
        return ref

    with pytest.raises(PatchCheckError, match="layer_14: min cosine"):
        run_sglang_patch_check(
            ServerPool([aux.url]), ServerPool([final.url]), inputs, prompt, H, AUX, hf_index_as_layer_id
        )


# --- extraction ----------------------------------------------------------------------------


def conversations_file(folder: Path) -> Path:
    """The three recorded conversations as a JSONL data source."""
    lines = [
        json.dumps(
            {"messages": [{"role": "user", "content": user}, {"role": "assistant", "content": answer}]}
        )
        for user, answer in CHECK_CONVERSATIONS
    ]
    path = folder / "conversations.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path


def tiny(data_file: Path, aux_url: str, final_url: str | None, **data) -> dict:
    """Params for the three recorded conversations: final_state mode with a final-state server,
    else the default top_logprobs mode."""
    target = {"sglang_target": "final_state", "sglang_final_url": final_url} if final_url else {}
    return {
        "target": {"dtype": "float32"},
        "data": {"source": str(data_file), "num_samples": 3, "max_length": 128, "seed": 0} | data,
        "extract": {
            "backend": "sglang",
            "sglang_url": aux_url,
            "shard_samples": 2,
            "sglang_requests_in_flight": 4,
        }
        | target,
        "tracking": {"enabled": False},
    }


def run_sglang(params, smollm2, out: Path) -> dict:
    path = resolve_target(params.target.source)
    servers = ExtractionServers.from_params(params.extract)  # the servers `tiny` names
    stop = eos_token_ids_of_folder(path, smollm2.tokenizer)
    compute = sglang_group_fn(servers, H, params, smollm2.tokenizer, True, stop)
    plan = ExtractionPlan(smollm2.tokenizer, True, H, compute, servers.top_logprobs)
    return run_extraction(plan, params, AUX, fingerprint(smollm2, AUX), out)


def test_sglang_shards_match_the_hf_backend_format(servers, smollm2, tmp_path):
    aux, final = servers
    params = parse_params(tiny(conversations_file(tmp_path), aux.url, final.url))
    manifest = run_sglang(params, smollm2, tmp_path / "sglang")
    hf_params = params.model_copy(update={"extract": params.extract.model_copy(update={"backend": "hf"})})
    hf_manifest = extract_features(smollm2, hf_params, AUX, fingerprint(smollm2, AUX), tmp_path / "hf")
    assert sorted(p.name for p in (tmp_path / "sglang").iterdir()) == sorted(
        p.name for p in (tmp_path / "hf").iterdir()
    )
    # the hf store records the torch threads its in-process forwards ran at (online ranks repeat
    # them); an SGLang store's forwards ran in the server, which sets its own
    assert set(manifest) == set(hf_manifest) - {"capture_threads"}
    assert manifest["num_tokens"] == hf_manifest["num_tokens"] == 183
    assert manifest["bytes_per_token"] == hf_manifest["bytes_per_token"]
    ours, theirs = FeatureStore(tmp_path / "sglang"), FeatureStore(tmp_path / "hf")
    ours.verify()
    for i in range(3):
        a, b = ours.sample(i), theirs.sample(i)
        for key in FEATURE_KEYS:
            assert a[key].dtype == b[key].dtype and a[key].shape == b[key].shape, key
        assert torch.equal(a["input_ids"], b["input_ids"]) and torch.equal(a["loss_mask"], b["loss_mask"])
        for key in ("aux_hidden", "last_hidden"):  # SGLang bf16 vs HF float32 -> bf16
            cos = torch.nn.functional.cosine_similarity(
                a[key].float().view(len(a[key]), -1, H), b[key].float().view(len(b[key]), -1, H), dim=-1
            )
            assert cos.min() >= MIN_ROW_COSINE, key
    assert torch.equal(ours.tokens()["input_ids"], theirs.tokens()["input_ids"])
    assert aux.flushes == 1  # the recorded cache hit was caught and re-requested


def test_self_distillation_through_sglang_takes_the_generations_own_rows(servers, smollm2, tmp_path):
    aux, final = servers
    data = conversations_file(tmp_path)
    data.write_text(data.read_text().splitlines()[0] + "\n")  # the recorded generation's prompt
    raw = tiny(data, aux.url, final.url, num_samples=1, regenerate=True, regenerate_max_new_tokens=16)
    params = parse_params(raw)
    run_sglang(params, smollm2, tmp_path / "sglang")
    sample = FeatureStore(tmp_path / "sglang").sample(0)
    prompt = fixture("req_04.json")["input_ids"]
    generated = fixture("resp_04.json")["output_ids"]  # EOS (2) at index 7; ignore_eos went on
    assert aux.requests[0]["sampling_params"]["stop_token_ids"] == [2]
    assert sample["input_ids"].tolist() == prompt + generated[:7]  # stops at EOS, last token not fed
    assert sample["loss_mask"].tolist() == [0] * 37 + [1] * 7
    ref = {k: v[:44] for k, v in reference(4).items()}
    assert (
        min(s["min_cosine"] for s in agreement(sample["aux_hidden"].float(), ref, NAMES).values())
        >= MIN_ROW_COSINE
    )
    # the hf backend's own on-policy path makes the same tokens and mask
    hf_params = params.model_copy(update={"extract": params.extract.model_copy(update={"backend": "hf"})})
    extract_features(smollm2, hf_params, AUX, fingerprint(smollm2, AUX), tmp_path / "hf")
    hf = FeatureStore(tmp_path / "hf").sample(0)
    assert torch.equal(hf["input_ids"], sample["input_ids"]) and torch.equal(
        hf["loss_mask"], sample["loss_mask"]
    )


def test_top_n_shards_hold_the_targets_top_logprobs_in_place_of_last_hidden(servers, smollm2, tmp_path):
    aux, final = servers
    params = parse_params(tiny(conversations_file(tmp_path), aux.url, None))
    manifest = run_sglang(params, smollm2, tmp_path / "sglang")
    assert manifest["target_topk"] == 20 and manifest["bytes_per_token"] == 3 * H * 2 + 20 * 8 + 5
    assert len(aux.requests) == 3 and not final.requests  # one request per sample, one kind of server
    assert aux.flushes == 0  # logprobs from position 0 keep the server off its prefix cache
    hf_params = params.model_copy(update={"extract": params.extract.model_copy(update={"backend": "hf"})})
    extract_features(smollm2, hf_params, AUX, fingerprint(smollm2, AUX), tmp_path / "hf")
    ours, theirs = FeatureStore(tmp_path / "sglang"), FeatureStore(tmp_path / "hf")
    ours.verify()
    assert ours.target_topk == 20 and theirs.target_topk is None
    agree = []
    for i in range(3):
        a, b = ours.sample(i), theirs.sample(i)
        assert set(a) == set(TOPK_KEYS) and a["target_topk_ids"].shape == (len(a["input_ids"]), 20)
        assert torch.equal(a["input_ids"], b["input_ids"]) and torch.equal(a["loss_mask"], b["loss_mask"])
        cos = torch.nn.functional.cosine_similarity(
            a["aux_hidden"].float().view(-1, H), b["aux_hidden"].float().view(-1, H), dim=-1
        )
        assert cos.min() >= MIN_ROW_COSINE  # SGLang bf16 vs HF float32 -> bf16
        best = hf_log_probs(smollm2, a["input_ids"].tolist()).argmax(-1)
        agree.append((a["target_topk_ids"][:, 0].long() == best).float().mean().item())
    assert min(agree) >= MIN_TOP1_AGREEMENT
    assert torch.equal(ours.tokens()["input_ids"], theirs.tokens()["input_ids"])


def test_self_distillation_through_sglang_stores_the_generations_top_logprobs(servers, smollm2, tmp_path):
    aux, _ = servers
    data = conversations_file(tmp_path)
    data.write_text(data.read_text().splitlines()[0] + "\n")  # the recorded generation's prompt
    raw = tiny(data, aux.url, None, num_samples=1, regenerate=True, regenerate_max_new_tokens=16)
    run_sglang(parse_params(raw), smollm2, tmp_path / "sglang")
    sample = FeatureStore(tmp_path / "sglang").sample(0)
    generated = fixture("lp_resp_04.json")["output_ids"]
    assert aux.requests[0]["top_logprobs_num"] == 20 and aux.requests[0]["logprob_start_len"] == 0
    assert sample["input_ids"].tolist() == fixture("req_04.json")["input_ids"] + generated[:7]
    # row t predicts token t + 1: over the answer, greedy decoding's own choices
    assert sample["target_topk_ids"][36:, 0].tolist() == generated[:8]


def stage_runner(tmp_path: Path, raw: dict):
    """A project folder with `raw` as params.yaml; runs its stages as DVC does (python -m stages.X)."""
    project = tmp_path / "project"
    copy_code(project, pipeline=False)
    (project / "params.yaml").write_text(yaml.safe_dump(raw))
    return project, stages_in(project)


def stages_in(project: Path):
    """Runs `project`'s stages as DVC does (python -m stages.X), on one torch thread: online
    training compares its drafter's bytes with the store's at equal thread counts (docs/features.md)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MLFLOW_", "DVC_"))}
    env["OMP_NUM_THREADS"] = "1"

    def stage(name: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, "-m", f"stages.{name}"],
            cwd=project,
            env=env,
            capture_output=True,
            text=True,
            timeout=STAGE_TIMEOUT_S,
        )

    return stage


TOP_LOGPROBS_TRAIN = {
    "epochs": 2,
    "seq_len": 64,
    "batch_size": 1,
    "heldout_fraction": 0.34,
    "dtype": "float32",
}


@dataclass(frozen=True)
class TopLogprobsProject:
    """A project trained through patch-check, extract, vocab-map and train against replay servers
    of its own (closed since), with the target's prediction from the top-20 logprobs."""

    project: Path
    raw: dict
    final_requests: int  # requests its final-state server got: none is expected


def build_top_logprobs_project(folder: Path) -> TopLogprobsProject:
    """Built once per session (conftest.py's sglang_top_logprobs) for this file's pipeline test
    and tests/test_sglang_online.py, which both copy it: the same four stage runs, done once."""
    aux, final = Replay("aux", cache_hit_first=True), Replay("final")
    try:
        raw = tiny(conversations_file(folder), aux.url, None)
        raw |= {"vocab": {"size": 512}, "train": dict(TOP_LOGPROBS_TRAIN)}
        project, stage = stage_runner(folder, raw)
        for name in ("patch_check", "extract", "vocab_map", "train"):
            done = stage(name)
            assert done.returncode == 0, f"{name}: {done.stderr}"
        return TopLogprobsProject(project, raw, len(final.requests))
    finally:
        aux.close()
        final.close()


def copy_top_logprobs_project(built: TopLogprobsProject, tmp_path: Path, aux_url: str | list[str]):
    """A copy of the built project whose params name the server(s) at `aux_url`; its stage runner."""
    raw = json.loads(json.dumps(built.raw))
    raw["extract"]["sglang_url"] = aux_url
    project = tmp_path / "project"
    shutil.copytree(built.project, project, copy_function=shutil.copy2)
    (project / "params.yaml").write_text(yaml.safe_dump(raw))
    return project, raw, stages_in(project)


def test_the_pipeline_trains_on_top_logprobs_from_replay_servers(servers, sglang_top_logprobs, tmp_path):
    """patch-check, extract, vocab-map and train as DVC runs them, with the target's prediction
    taken from the aux requests' top-20 logprobs: one kind of server, no last_hidden stored (the
    four runs are the session's sglang_top_logprobs; this test checks them and refuses on a copy)."""
    aux, _ = servers
    built = sglang_top_logprobs
    project, raw, stage = copy_top_logprobs_project(built, tmp_path, aux.url)
    report = json.loads((project / "artifacts/patch-check/report.json").read_text())
    assert (
        report["fingerprint"]["target_top_logprobs"] == 20
        and report["fingerprint"]["final_server_args"] is None
    )
    scores = [c["agreement"]["top_logprobs"] for c in report["checks"]]
    assert len(scores) == 4 and min(s["top1_agreement"] for s in scores) >= MIN_TOP1_AGREEMENT
    assert built.final_requests == 0
    assert FeatureStore(project / "artifacts/extract").target_topk == 20
    metrics = json.loads((project / "metrics/train.json").read_text())
    assert metrics["train_tokens"] > 0 and 0 <= metrics["heldout_acc_0"] <= 1
    assert (project / "artifacts/train/drafter/model.safetensors").is_file()
    # asking for more of the target's distribution than the store holds is refused before training
    raw["train"]["target_topk"] = 32
    (project / "params.yaml").write_text(yaml.safe_dump(raw))
    done = stage("train")
    assert done.returncode == 1 and "holds the target's top 20 only" in done.stderr
    # extract with another top-N than patch-check checked is refused
    raw["extract"]["sglang_top_logprobs"] = 8
    (project / "params.yaml").write_text(yaml.safe_dump(raw))
    done = stage("extract")
    assert done.returncode == 1 and "patch-check checked top 20 logprobs" in done.stderr


@pytest.mark.slow
def test_patch_check_and_extract_stages_against_replay_servers(servers, tmp_path):
    """The real stages as DVC runs them (python -m stages.<name>), pointed at the replay servers."""
    aux, final = servers
    project, stage = stage_runner(tmp_path, tiny(conversations_file(tmp_path), aux.url, final.url))
    done = stage("patch_check")
    assert done.returncode == 0, done.stderr
    report = json.loads((project / "artifacts/patch-check/report.json").read_text())
    fp = report["fingerprint"]
    assert (fp["engine"], fp["engine_version"], fp["dtype"], fp["layer_id_family"]) == (
        "sglang",
        "0.5.23",
        "bfloat16",
        "llama-like",
    )
    assert fp["server_args"]["return_aux_hidden_state_layer_ids"] == AUX
    # final_state requests can hit the radix cache, which SGLang flushes only when idle: with
    # requests in flight the servers must run without it (refused before any request)
    sent = len(aux.requests)  # patch-check's
    done = stage("extract")
    assert done.returncode == 1 and "--disable-radix-cache" in done.stderr and len(aux.requests) == sent
    aux.info["disable_radix_cache"] = final.info["disable_radix_cache"] = True
    done = stage("extract")
    assert done.returncode == 0, done.stderr
    store = FeatureStore(project / "artifacts/extract")
    store.verify()
    assert len(store) == 3 and store.fingerprint.to_json() == fp
    assert json.loads((project / "artifacts/extract" / MANIFEST).read_text())["num_tokens"] == 183
    # a relaunched server with other args is refused before any request
    aux.info["tp_size"] = 2
    done = stage("extract")
    assert (
        done.returncode == 1 and "tp_size: 1 -> 2" in done.stderr and "run patch-check again" in done.stderr
    )


@pytest.mark.slow
def test_serve_command_matches_the_eval_params(tmp_path):
    drafter = tmp_path / "drafter"
    drafter.mkdir()
    (drafter / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLMEagle3"]}))
    params_file = tmp_path / "params.yaml"
    params_file.write_text(
        yaml.safe_dump(
            {"train": {"ttt_length": 3}, "eval": {"mode": "tree", "k": 3, "topk": 4, "tree_budget": 15}}
        )
    )
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "eagle3.cli",
            "serve-command",
            "--params",
            str(params_file),
            "--drafter",
            str(drafter),
            "--tp",
            "8",
        ],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    sglang = next(
        line for line in done.stdout.splitlines() if line.startswith("python -m sglang.launch_server")
    )
    for flag in (
        "--tp 8",
        "--speculative-algorithm EAGLE3",
        f"--speculative-draft-model-path {drafter}",
        "--speculative-num-steps 3",
        "--speculative-eagle-topk 4",
        "--speculative-num-draft-tokens 16",
    ):
        assert flag in sglang, flag
    vllm = next(line for line in done.stdout.splitlines() if line.startswith("vllm serve"))
    assert (
        '"method":"eagle3"' in vllm
        and '"num_speculative_tokens":3' in vllm
        and "--tensor-parallel-size 8" in vllm
    )
    missing = subprocess.run(
        [
            sys.executable,
            "-m",
            "eagle3.cli",
            "serve-command",
            "--params",
            str(params_file),
            "--drafter",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=120,
    )
    assert missing.returncode == 2 and "config.json is missing" in missing.stderr


def test_serve_reads_the_drafters_trained_ttt_length_and_notes_the_lookup_branch(tmp_path):
    from eagle3.cli.commands.serve import serve_commands

    shipped = tmp_path / "shipped"
    shipped.mkdir()
    config = {"architectures": ["LlamaForCausalLMEagle3"]}
    (shipped / "config.json").write_text(json.dumps(config))
    (shipped / "params.yaml").write_text(yaml.safe_dump({"train": {"ttt_length": 2}}))
    tree = {"mode": "tree", "k": 2, "topk": 4, "tree_budget": 6}
    # the workspace trains TTT 1, but the shipped drafter was trained TTT 2: k=2 is served
    params = parse_params({"train": {"ttt_length": 1}, "eval": tree | {"lookup_tokens": 4}})
    notes = serve_commands(params, str(shipped))["notes"]
    assert "prompt-lookup branch" in notes
    # k past the trained TTT length is served, as SGLang serves it, with the warning in the notes
    (shipped / "params.yaml").write_text(yaml.safe_dump({"train": {"ttt_length": 1}}))
    alone = parse_params({"eval": tree | {"lookup_tokens": 0}})
    deeper = serve_commands(alone, str(shipped))
    assert "--speculative-num-steps 2" in deeper["sglang"]
    assert "draft step 2 was never trained" in deeper["notes"] and "untrained_steps: 1" in deeper["notes"]
    # the exported config's own record wins over a params.yaml beside it
    (shipped / "config.json").write_text(json.dumps(config | {"eagle_config": {"ttt_length": 2}}))
    assert "prompt-lookup" not in serve_commands(alone, str(shipped))["notes"]


def test_sglang_fingerprint_replaces_the_engine(smollm2):
    base = fingerprint(smollm2, AUX)
    fp = sglang_fingerprint(base, server_info("aux") | {"version": "0.5.23"}, server_info("final"), LLAMA)
    on_disk = fp.to_json()
    assert on_disk["engine"] == "sglang" and "torch_version" not in on_disk
    assert on_disk["layer_id_family"] == "llama-like" and on_disk["final_server_args"] == server_info("final")
    assert Fingerprint.from_json(on_disk, "report.json") == fp  # the file reads back as written
    kept = ("target_sha256", "tokenizer_sha256", "num_layers", "hidden_size", "vocab_size", "aux_layers")
    assert {k: on_disk[k] for k in kept} == {k: base.to_json()[k] for k in kept}
