"""speculative-eval's sglang backend against real recorded SGLang 0.5.23 speculative responses
(tests/fixtures/sglang/spec_*, SPEC.md): the shape-to-flags mapping shared with `eagle3
serve-command`, parsing meta_info, the metrics in the hf backend's schema, the stage as DVC runs
it on replay servers, and every refusal (one line, before any decoding, no metrics written)."""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import yaml
from project_copy import copy_code

from eagle3.cli.commands.serve import serve_commands
from eagle3.core.params import ParamsError, parse_params
from eagle3.decoding.prompts import load_prompts, mtbench_path
from eagle3.sglang.client import SGLangError
from eagle3.sglang.evaluate import (
    NOT_MEASURED,
    check_inputs,
    drafter_refusal,
    evaluate_on_sglang,
)
from eagle3.sglang.launch import LaunchError
from eagle3.sglang.speculative import SpecResponse, SpecServerError, SpecShape, eagle3_shape, ngram_flags

FIXTURES = Path(__file__).parent / "fixtures" / "sglang"
REPO = Path(__file__).resolve().parents[1]
DRAFTER = REPO / "drafters" / "smollm2-135m-instruct-full"
NUM, MAX_NEW = 3, 24  # what record_spec.py recorded
KINDS = ("plain", "tree", "chain", "ngram")
# the hf backend's metric keys (eagle3/decoding/evaluate.py summarize + summarize_spread, greedy,
# with the prompt-lookup peer), which the sglang backend must write too
HF_KEYS = set(
    "num_prompts new_tokens steps acceptance_length acceptance_rate drafter_acceptance_length "
    "per_position_acceptance tokens_per_s baseline_tokens_per_s speedup prompt_lookup_tokens_per_s "
    "prompt_lookup_speedup prompt_lookup_greedy_match greedy_match divergences unexplained_divergences "
    "lossless per_category acceptance_length_ci speedup_ci prompt_lookup_speedup_ci "
    "speedup_minus_prompt_lookup_ci dtype drafter_dtype machine eval_coverage".split()
)


def fixture(name: str):
    return json.loads((FIXTURES / name).read_text())


def recorded(kind: str) -> list[tuple[dict, dict]]:
    return [
        (fixture(f"spec_{kind}_req_{i:02d}.json"), fixture(f"spec_{kind}_resp_{i:02d}.json"))
        for i in range(1, NUM + 1)
    ]


class Replay(ThreadingHTTPServer):
    """A local server answering as the recorded SGLang server of `kind` did. The warm-up request
    (the first prompt, fewer tokens) gets that prompt's recorded response; `answers` > 0 makes it
    drop the connection after that many /generate answers (a server gone mid-run)."""

    def __init__(self, kind: str, info: dict | None = None, answers: int = 0):
        super().__init__(("127.0.0.1", 0), Handler)
        self.info = info or fixture(f"spec_{kind}_server_info.json")
        self.by_ids = {tuple(req["input_ids"]): resp for req, resp in recorded(kind)}
        self.answers, self.served = answers, 0
        threading.Thread(target=self.serve_forever, daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"

    def close(self) -> None:
        self.shutdown()
        self.server_close()


class Handler(BaseHTTPRequestHandler):
    server: Replay

    def log_message(self, *args) -> None:
        pass

    def reply(self, code: int, payload: dict) -> None:
        body = json.dumps(payload).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self) -> None:
        self.reply(200, self.server.info) if self.path == "/get_server_info" else self.reply(404, {})

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])) or b"{}")
        if self.path == "/flush_cache":
            return self.reply(200, {})
        self.server.served += 1
        if self.server.answers and self.server.served > self.server.answers:
            self.connection.close()  # gone: no response at all
            return
        resp = self.server.by_ids.get(tuple(body.get("input_ids", ())))
        if resp is None or body["sampling_params"]["temperature"] != 0:
            return self.reply(400, {"error": "not recorded"})
        self.reply(200, resp)


@pytest.fixture
def replays():
    servers = {kind: Replay(kind) for kind in KINDS}
    yield servers
    for server in servers.values():
        server.close()


def params_for(urls: dict[str, str] | None = None, **eval_params):
    ev = {
        "backend": "sglang",
        "drafter": str(DRAFTER),
        # the recorded prompts: MT-bench's first turns, as a file domain (no second turns to replay)
        "domains": {"file": NUM},
        "prompts_file": str(mtbench_path()),
        "max_new_tokens": MAX_NEW,
        "mode": "tree",
        "k": 2,
        "topk": 4,
        "tree_budget": 6,
        "lookup_tokens": 0,
        "dtype": "float32",
        "prompt_lookup_tokens": 4,
    }
    if urls:
        ev |= {
            "sglang_url": urls["plain"],
            "sglang_eagle3_url": urls["spec"],
            "sglang_ngram_url": urls["ngram"],
        }
    return parse_params(
        {"eval": ev | eval_params, "train": {"ttt_length": 2}, "tracking": {"enabled": False}}
    )


def urls_of(replays, spec: str = "tree") -> dict[str, str]:
    return {"plain": replays["plain"].url, "spec": replays[spec].url, "ngram": replays["ngram"].url}


# --- the flag mapping ------------------------------------------------------------------------


def test_one_mapping_serves_the_eval_the_recorded_servers_and_serve_command():
    assert eagle3_shape("tree", 2, 4, 6) == SpecShape(2, 4, 7)  # SGLang counts the root
    assert eagle3_shape("chain", 2, 8, 8) == SpecShape(2, 1, 3)  # a chain ignores topk and budget
    for kind, shape in (("tree", SpecShape(2, 4, 7)), ("chain", SpecShape(2, 1, 3))):
        info = fixture(f"spec_{kind}_server_info.json")
        served = (
            info["speculative_num_steps"],
            info["speculative_eagle_topk"],
            info["speculative_num_draft_tokens"],
        )
        assert served == (shape.num_steps, shape.topk, shape.num_draft_tokens)
        assert info["speculative_algorithm"] == "EAGLE3" and info["version"] == "0.5.23"
    ngram = fixture("spec_ngram_server_info.json")
    assert ngram["speculative_algorithm"] == "NGRAM"
    assert ngram_flags(4)[-1] == str(ngram["speculative_num_draft_tokens"]) == "5"
    command = serve_commands(params_for(), str(DRAFTER))["sglang"]
    assert "--speculative-num-steps 2 --speculative-eagle-topk 4 --speculative-num-draft-tokens 7" in command
    chain = serve_commands(params_for(mode="chain"), str(DRAFTER))["sglang"]
    assert "--speculative-num-steps 2 --speculative-eagle-topk 1 --speculative-num-draft-tokens 3" in chain


# --- parsing -----------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["tree", "chain", "ngram"])
def test_recorded_speculative_responses_parse(kind):
    for req, resp in recorded(kind):
        r = SpecResponse.parse("replay", resp, speculative=True)
        meta = resp["meta_info"]
        assert len(r.output_ids) == meta["completion_tokens"] == req["sampling_params"]["max_new_tokens"]
        assert sum(r.histogram) == r.verify_steps == meta["spec_verify_ct"] > 0
        assert sum(r.accepted()) == r.correct_drafts == meta["spec_num_correct_drafts"]
        # SGLang's spec_accept_length counts the prefill's token; ours is per verification step
        assert meta["spec_accept_length"] == pytest.approx(meta["completion_tokens"] / r.verify_steps)
        assert 1 + r.correct_drafts / r.verify_steps < meta["spec_accept_length"] + 1e-9


def test_a_histogram_that_does_not_add_up_is_refused():
    _, resp = recorded("tree")[0]
    meta = resp["meta_info"] | {"spec_num_correct_drafts": resp["meta_info"]["spec_num_correct_drafts"] + 1}
    with pytest.raises(SpecServerError, match="does not add up"):
        SpecResponse.parse("replay", resp | {"meta_info": meta}, speculative=True)
    with pytest.raises(SpecServerError, match="without spec_verify_ct"):
        SpecResponse.parse("replay", recorded("plain")[0][1], speculative=True)


# --- metrics -------------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("spec", ["tree", "chain"])
def test_metrics_in_the_hf_schema_from_recorded_responses(replays, spec):
    extra = {} if spec == "tree" else {"mode": "chain"}
    result = evaluate_on_sglang(params_for(urls_of(replays, spec), **extra), load_prompts(None, NUM), DRAFTER)
    m = result.metrics
    assert HF_KEYS <= set(m) and not set(NOT_MEASURED) & set(m)
    responses = [resp["meta_info"] for _, resp in recorded(spec)]
    steps = sum(r["spec_verify_ct"] for r in responses)
    correct = sum(r["spec_num_correct_drafts"] for r in responses)
    assert m["steps"] == steps and m["acceptance_length"] == pytest.approx(1 + correct / steps)
    assert m["drafter_acceptance_length"] == m["acceptance_length"]
    assert m["acceptance_rate"] == pytest.approx(correct / (steps * 2))
    # SGLang trims a histogram's trailing zeros
    padded = [
        r["spec_correct_drafts_histogram"] + [0] * (3 - len(r["spec_correct_drafts_histogram"]))
        for r in responses
    ]
    hist = [sum(h) for h in zip(*padded, strict=True)]
    assert m["per_position_acceptance"]["1"] == pytest.approx(sum(hist[1:]) / sum(hist))
    assert m["per_position_acceptance"]["2"] == pytest.approx(hist[2] / sum(hist[1:]))
    plain = [resp for _, resp in recorded("plain")]
    spec_s = sum(r["e2e_latency"] for r in responses)
    plain_s = sum(r["meta_info"]["e2e_latency"] for r in plain)
    assert m["speedup"] == pytest.approx((NUM * MAX_NEW / spec_s) / (NUM * MAX_NEW / plain_s))
    ngram = [resp["meta_info"] for _, resp in recorded("ngram")]
    ngram_steps = sum(r["spec_verify_ct"] for r in ngram)
    assert m["ngram_acceptance_length"] == pytest.approx(
        1 + sum(r["spec_num_correct_drafts"] for r in ngram) / ngram_steps
    )
    assert m["prompt_lookup_speedup"] == pytest.approx(
        (NUM * MAX_NEW / sum(r["e2e_latency"] for r in ngram)) / (NUM * MAX_NEW / plain_s)
    )
    # float32: SGLang's EAGLE-3 and NGRAM outputs equal the plain server's, token for token
    assert m["greedy_match"] == 1.0 and m["lossless"] and m["divergences"] == 0
    assert m["prompt_lookup_greedy_match"] == 1.0
    assert m["backend"] == "sglang" and m["engine"] == "sglang 0.5.23" and m["peer"] == "sglang NGRAM"
    assert m["sglang_args"]["eagle3"]["speculative_num_draft_tokens"] == (7 if spec == "tree" else 3)
    assert set(m["per_category"]) == {p.category for p in load_prompts(None, NUM)}
    assert m["acceptance_length_ci"]["lo"] <= m["acceptance_length"] <= m["acceptance_length_ci"]["hi"]
    rows = result.rows
    assert [r["spec_tokens"] for r in rows] == [resp["output_ids"] for resp in plain]
    assert all(r["greedy_match"] and r["ngram_match"] for r in rows)
    assert result.tags["eval.backend"] == "sglang"


@pytest.mark.slow
def test_a_divergence_is_judged_as_the_hf_backend_judges_it(replays):
    """A plain server whose answer differs from the recorded EAGLE-3 one (one token swapped):
    the HF target finds a large logit gap there, so the run is not lossless."""
    req, resp = recorded("plain")[1]
    swapped = list(resp["output_ids"])
    swapped[5] = (swapped[5] + 1) % 49152
    replays["plain"].by_ids[tuple(req["input_ids"])] = resp | {"output_ids": swapped}
    m = evaluate_on_sglang(params_for(urls_of(replays)), load_prompts(None, NUM), DRAFTER)
    assert (
        m.metrics["divergences"] == 1
        and m.metrics["unexplained_divergences"] == 1
        and not m.metrics["lossless"]
    )
    row = m.rows[1]
    assert row["divergence"]["index"] == 5 and row["baseline_tokens"] == swapped


# --- refusals, before any decoding ------------------------------------------------------------------


@pytest.mark.slow
def test_given_servers_of_the_wrong_kind_version_or_shape_are_refused(replays):
    prompts = load_prompts(None, NUM)
    urls = urls_of(replays)
    with pytest.raises(SpecServerError, match="is not speculative"):
        evaluate_on_sglang(params_for(urls | {"spec": urls["plain"]}), prompts, DRAFTER)
    with pytest.raises(SpecServerError, match="the baseline must be a plain server"):
        evaluate_on_sglang(params_for(urls | {"plain": urls["spec"]}), prompts, DRAFTER)
    with pytest.raises(
        SpecServerError,
        match="serves steps 2, topk 1, 3 draft tokens; the eval params ask for steps 2, topk 4, 7",
    ):
        evaluate_on_sglang(params_for(urls | {"spec": replays["chain"].url}), prompts, DRAFTER)
    with pytest.raises(
        SpecServerError, match="runs EAGLE3; this server must run --speculative-algorithm NGRAM"
    ):
        evaluate_on_sglang(params_for(urls | {"ngram": urls["spec"]}), prompts, DRAFTER)
    old = Replay("tree", fixture("spec_tree_server_info.json") | {"version": "0.5.20"})
    try:
        with pytest.raises(SpecServerError, match=r"runs SGLang 0\.5\.20; supported: 0\.5\.23"):
            evaluate_on_sglang(params_for(urls | {"spec": old.url}), prompts, DRAFTER)
    finally:
        old.close()
    with pytest.raises(Exception, match="the three must run one dtype"):
        evaluate_on_sglang(params_for(urls, dtype="bfloat16"), prompts, DRAFTER)
    for server in replays.values():  # refused before the first request
        assert server.served == 0


@pytest.mark.slow
def test_a_server_gone_mid_run_fails_in_one_line(replays):
    gone = Replay("tree", answers=2)  # warm-up and the first prompt, then nothing
    try:
        with pytest.raises(SGLangError, match="SGLang server gone or failing mid-run: .*"):
            evaluate_on_sglang(
                params_for(urls_of(replays) | {"spec": gone.url}), load_prompts(None, NUM), DRAFTER
            )
    finally:
        gone.close()


def shipped_copy(tmp_path: Path, **config) -> Path:
    folder = tmp_path / "drafter"
    shutil.copytree(DRAFTER, folder)
    raw = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(
        json.dumps({k: v for k, v in (raw | config).items() if v is not None})
    )
    return folder


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"tie_word_embeddings": True}, "would use the embedding as the drafter's lm_head"),
        ({"draft_vocab_size": None}, "would load the target's lm_head"),
        ({"hidden_size": 288}, "hidden_size 288 != the target's 576"),
        (
            {"eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 14, 29]}},
            "the target's last layer \\(29\\)",
        ),
    ],
)
def test_a_drafter_sglang_cannot_load_as_trained_is_refused(tmp_path, change, message):
    from transformers import AutoConfig

    from eagle3.target.load import resolve_target

    folder = shipped_copy(tmp_path, **change)
    assert (
        drafter_refusal(DRAFTER, AutoConfig.from_pretrained(resolve_target("smollm2-135m-instruct"))) is None
    )
    with pytest.raises(ValueError, match=message):
        check_inputs(params_for(drafter=str(folder)), folder)


def test_k_past_the_trained_ttt_length_is_served_and_unservable_trees_are_refused():
    # deeper than trained is a shape SGLang serves: checked like any other, not refused
    shape, _ = check_inputs(params_for(k=3, tree_budget=6), DRAFTER)
    assert shape.num_steps == 3
    with pytest.raises(
        ValueError, match="SGLang cannot serve this tree: 30 draft tokens.* among the 20 candidates"
    ):
        check_inputs(params_for(tree_budget=30), DRAFTER)
    with pytest.raises(ValueError, match="measures greedy decoding"):
        check_inputs(params_for(temperature=0.7), DRAFTER)


def test_params_refuse_half_given_servers_and_a_lookup_branch():
    with pytest.raises(ParamsError, match="sglang_eagle3_url, sglang_ngram_url missing"):
        params_for(sglang_url="http://a:1")
    with pytest.raises(ParamsError, match="must start with http"):
        params_for(sglang_url="a:1")
    with pytest.raises(ParamsError, match="set lookup_tokens: 0"):
        params_for(lookup_tokens=4)
    with pytest.raises(ParamsError, match="used only with backend: sglang"):
        parse_params(
            {
                "eval": {
                    "sglang_url": "http://a:1",
                    "sglang_eagle3_url": "http://b:1",
                    "sglang_ngram_url": "http://c:1",
                }
            }
        )


def fake_sglang_python(tmp_path: Path, version: str, log: Path | None) -> str:
    """A stand-in for the SGLang venv's python that replays a recorded launch: it answers the
    version query; the EAGLE-3 server's launch prints the recorded log and exits 1, as SGLang
    did; the other servers keep starting (until stopped)."""
    script = tmp_path / "python"
    refuse = f"cat {log}; exit 1" if log else "exit 1"
    script.write_text(
        f'#!/bin/sh\nif [ "$1" = "-c" ]; then echo {version}; exit 0; fi\n'
        f'case "$*" in *--speculative-draft-model-path*) {refuse};; esac\nexec sleep 600\n'
    )
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    return str(script)


@pytest.mark.slow
def test_started_servers_refuse_an_unsupported_sglang_and_a_drafter_the_loader_rejects(tmp_path):
    prompts = load_prompts(None, NUM)
    old = fake_sglang_python(tmp_path, "0.5.20", None)
    with pytest.raises(LaunchError, match=r"has SGLang 0\.5\.20; supported: 0\.5\.23"):
        evaluate_on_sglang(params_for(sglang_python=old), prompts, DRAFTER, log_dir=tmp_path / "logs")
    assert not (tmp_path / "logs").exists()  # refused before any server started
    refusing = fake_sglang_python(tmp_path, "0.5.23", FIXTURES / "spec_refused_server.log")
    recorded_reason = (FIXTURES / "spec_refused_error.txt").read_text().strip().split(": ", 1)[1]
    with pytest.raises(LaunchError, match="SGLang refused the drafter") as err:
        evaluate_on_sglang(params_for(sglang_python=refusing), prompts, DRAFTER, log_dir=tmp_path / "logs")
    assert "\n" not in str(err.value) and recorded_reason.split(" (log:")[0][-60:] in str(err.value)


# --- the stage as DVC runs it ----------------------------------------------------------------------


def run_stage(tmp_path: Path, raw: dict) -> tuple[Path, subprocess.CompletedProcess]:
    project = tmp_path / "project"
    if not project.exists():
        copy_code(project, pipeline=False)
    (project / "params.yaml").write_text(yaml.safe_dump(raw))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MLFLOW_", "DVC_", "EAGLE3_SGLANG"))}
    done = subprocess.run(
        [sys.executable, "-m", "stages.speculative_eval"],
        cwd=project,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    return project, done


@pytest.mark.slow
def test_the_stage_writes_the_hf_outputs_from_replay_servers_and_writes_nothing_on_refusal(replays, tmp_path):
    raw = params_for(urls_of(replays)).model_dump()
    raw["tracking"] = {"enabled": False}
    project, done = run_stage(tmp_path, raw)
    assert done.returncode == 0, done.stderr
    metrics = json.loads((project / "metrics/speculative-eval.json").read_text())
    assert metrics["backend"] == "sglang" and metrics["lossless"] and HF_KEYS <= set(metrics)
    results = json.loads((project / "artifacts/speculative-eval/results.json").read_text())
    assert len(results["prompts"]) == NUM and (project / "plots/acceptance.csv").exists()
    first = (project / "artifacts/speculative-eval/results.json").read_bytes()
    # refusals: one line, exit non-zero, no metrics written
    for change, message in (({"sglang_eagle3_url": replays["plain"].url}, "is not speculative"),):
        (project / "metrics/speculative-eval.json").unlink(missing_ok=True)
        _, done = run_stage(tmp_path, raw | {"eval": raw["eval"] | change})
        assert done.returncode != 0 and message in done.stderr
        assert len([ln for ln in done.stderr.splitlines() if "failed" in ln]) == 1
        assert not (project / "metrics/speculative-eval.json").exists()
    # same params and inputs: byte-identical results
    _, done = run_stage(tmp_path, raw)
    assert (
        done.returncode == 0 and (project / "artifacts/speculative-eval/results.json").read_bytes() == first
    )


def test_compare_and_report_show_the_eval_backend_per_row():
    from eagle3.cli.commands.compare import comparison
    from eagle3.sweep.experiments import Experiment
    from eagle3.sweep.render import TABLE

    metrics = {"acceptance_length": 1.8, "speedup": 1.1, "tokens_per_s": 2.0}
    rows = [
        Experiment(
            "tree-hf", {"eval.backend": "hf", "vocab.size": 8192}, metrics, "cpu", {"eval": "float32"}
        ),
        Experiment(
            "tree-sgl", {"eval.backend": "sglang", "vocab.size": 8192}, metrics, "cpu", {"eval": "float32"}
        ),
        Experiment("old", {"vocab.size": 8192}, metrics, "cpu", {"eval": "float32"}),  # before eval.backend
    ]
    quality, _, speed, _ = comparison(rows).renderables
    for table in (quality, speed):
        assert list(table.columns[0].cells) == ["tree-hf", "tree-sgl [sglang]", "old"]
    assert [TABLE[0][1](e) for e in rows] == ["tree-hf", "tree-sgl [sglang]", "old"]
