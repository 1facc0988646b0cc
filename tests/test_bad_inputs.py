"""Bad inputs: each is refused with one line that names the file (and line), exit code 2, and
nothing of the last run is lost. Real files and the real SmolLM2 target; stages run in-process
(their main(), as `python -m stages.x` runs it: no interpreter start per case); tests/test_pipeline.py
runs them as processes under DVC.

Bad inputs tried (BAD_INPUTS counts them): conversation files x 7, prompt files x 5, target
folders that are not a model x 5, a truncated GGUF, a tokenizer that does not match the
features (in test_corruption.py, which has the real project it needs), aux layer ids out of
range, NaN and Inf in captured features.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import yaml
from conftest import made_up_fingerprint

from eagle3.core.inputs import MAX_LINE_BYTES, InputError
from eagle3.core.params import TargetParams, parse_params
from eagle3.data.conversations import load_conversations
from eagle3.data.extract import extract_features
from eagle3.data.store import JOURNAL, Sample, work_folder, write_shard
from eagle3.decoding.prompts import read_prompts
from eagle3.target.load import _packaged_gguf, load_target, load_target_config, resolve_target

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # stages/ is no installed package: import it as `python -m stages.x` does
from stages.common import reported_failures  # noqa: E402

GOOD = {
    "conversations": [
        {"from": "human", "value": "Hi there."},
        {"from": "gpt", "value": "Hello! How can I help?"},
    ]
}
HUGE = b'{"conversations": "' + b"x" * (MAX_LINE_BYTES + 1) + b'"}\n'


def line(obj: object) -> bytes:
    return json.dumps(obj).encode() + b"\n"


CONVERSATION_FILES = {
    "bad JSON line": (line(GOOD) + b'{"conversations": [\n', "line 2: not valid JSON"),
    "not UTF-8": (line(GOOD) + line(GOOD).replace(b"Hello", b"H\xe9llo"), "line 2: not UTF-8"),
    "empty turn": (
        line({"conversations": [{"from": "human", "value": " "}, GOOD["conversations"][1]]}),
        "turn 1 (human) is empty",
    ),
    "no assistant turn": (
        line({"messages": [{"role": "user", "content": "Hi"}]}),
        "line 1: no assistant turn",
    ),
    "huge line": (line(GOOD) + HUGE, "line 2: longer than 16 MiB"),
    "not a conversation": (line(["Hi", "Hello"]), "expected an object with a 'conversations' or 'messages'"),
    "unknown role": (line({"messages": [{"role": "robot", "content": "Hi"}]}), "turn 1 has role 'robot'"),
}
PROMPT_FILES = {
    "bad JSON line": (b'{"prompt": "Hi"}\n{"prompt": \n', "line 2: not valid JSON"),
    "not UTF-8": (b'{"prompt": "caf\xe9"}\n', "line 1: not UTF-8"),
    "empty turn": (b'{"turns": [""]}\n', "line 1: needs a non-empty 'prompt'"),
    "huge line": (b'{"prompt": "Hi"}\n' + HUGE, "line 2: longer than 16 MiB"),
    "not an object": (b'"Hi"\n', "line 1: expected a JSON object"),
}
NOT_A_MODEL = (
    "empty folder",
    "config not JSON",
    "config without model_type",
    "no weights",
    "truncated weights",
)
OTHER_CASES = (
    "truncated GGUF",
    "tokenizer not matching the features",
    "aux layers out of range",
    "NaN",
    "Inf",
)
BAD_INPUTS = len(CONVERSATION_FILES) + len(PROMPT_FILES) + len(NOT_A_MODEL) + len(OTHER_CASES)


def test_bad_input_count():
    assert BAD_INPUTS == 22  # the count docs/robustness.md quotes


def test_input_errors_exit_2_with_one_line(capsys):
    long = "target.source: /x/y is not a model " + "word " * 40 + "[bold] stays literal"
    with pytest.raises(SystemExit) as stop, reported_failures("extract"):
        raise InputError(long)
    err = capsys.readouterr().err
    assert stop.value.code == 2 and err.count("\n") == 1 and err.strip().endswith("[bold] stays literal")
    with pytest.raises(SystemExit) as stop, reported_failures("train"):
        raise ValueError("not an input problem")
    assert stop.value.code == 1  # other known failures keep exit code 1


@pytest.mark.parametrize("case", CONVERSATION_FILES)
def test_bad_conversation_file_names_file_and_line(tmp_path, case):
    content, message = CONVERSATION_FILES[case]
    path = tmp_path / "data.jsonl"
    path.write_bytes(content)
    with pytest.raises(InputError, match=rf"data.source {path}, line \d+: ") as err:
        load_conversations(str(path))
    assert message in str(err.value) and "\n" not in str(err.value)


def test_good_conversation_file_still_loads(tmp_path):
    path = tmp_path / "data.jsonl"
    system = {"from": "system", "value": ""}  # an empty system prompt is dropped, not refused
    path.write_bytes(line(GOOD) + b"\n" + line({"conversations": [system] + GOOD["conversations"]}))
    assert (
        load_conversations(str(path))
        == [
            [
                {"role": "user", "content": "Hi there."},
                {"role": "assistant", "content": "Hello! How can I help?"},
            ]
        ]
        * 2
    )


@pytest.mark.parametrize("case", PROMPT_FILES)
def test_bad_prompt_file_names_file_and_line(tmp_path, case):
    content, message = PROMPT_FILES[case]
    path = tmp_path / "prompts.jsonl"
    path.write_bytes(content)
    with pytest.raises(InputError, match=rf"eval.prompts_file {path}, line \d+: ") as err:
        read_prompts(path)
    assert message in str(err.value) and "\n" not in str(err.value)


def _model_folder(tmp_path: Path, case: str) -> Path:
    real = Path(resolve_target("smollm2-135m-instruct"))
    folder = tmp_path / case.replace(" ", "-")
    folder.mkdir()
    if case == "config not JSON":
        (folder / "config.json").write_text("{model_type: llama")
    elif case == "config without model_type":
        (folder / "config.json").write_text('{"hidden_size": 576}')
    elif case != "empty folder":
        for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
            shutil.copy(real / name, folder / name)
    if case == "truncated weights":
        with open(real / "model.safetensors", "rb") as f:
            (folder / "model.safetensors").write_bytes(f.read(1 << 20))
    return folder


@pytest.mark.parametrize("case", NOT_A_MODEL)
def test_target_folder_that_is_not_a_model(tmp_path, case):
    folder = _model_folder(tmp_path, case)
    with pytest.raises(InputError, match=rf"target.source: {folder}") as err:
        load_target(TargetParams(source=str(folder), dtype="float32"))
    assert "\n" not in str(err.value)


def test_hub_model_code_never_runs_unless_params_allow_it(tmp_path):
    folder = tmp_path / "custom"
    folder.mkdir()
    (folder / "config.json").write_text(
        json.dumps({"model_type": "mine", "auto_map": {"AutoConfig": "code.Cfg"}})
    )
    (folder / "code.py").write_text("raise SystemExit('remote code ran')\n")
    with pytest.raises(InputError, match="set target.trust_remote_code: true only if you trust it"):
        load_target_config(TargetParams(source=str(folder)))


@pytest.fixture
def truncated_gguf(tmp_path) -> Path:
    real = _packaged_gguf("smollm2-135m-instruct")
    path = tmp_path / "SmolLM2.gguf"
    with open(real, "rb") as f:
        path.write_bytes(f.read(real.stat().st_size - 4096))  # the last tensor's data is cut off
    return path


def test_truncated_gguf_is_refused_before_conversion(truncated_gguf, tmp_path, monkeypatch):
    monkeypatch.setenv("EAGLE3_CACHE", str(tmp_path / "cache"))
    with pytest.raises(InputError, match=rf"{truncated_gguf} is not a complete GGUF file .*truncated"):
        load_target_config(TargetParams(source=str(truncated_gguf)))
    assert not (tmp_path / "cache" / "targets").exists() or not any(
        (tmp_path / "cache" / "targets").iterdir()
    )


def failure_lines(stderr: str, stage: str) -> list[str]:
    """The stage's own failure report (transformers' progress bars also write to stderr)."""
    assert "Traceback" not in stderr, stderr
    return [line for line in stderr.splitlines() if line.startswith(f"{stage} failed:")]


@dataclass
class Finished:
    returncode: int | str | None
    stderr: str


def run_stage(stage: str, cwd: Path, params: dict, capsys: pytest.CaptureFixture[str]) -> Finished:
    """stages/<stage>.py's main() run in `cwd`, as DVC runs the stage; it must exit."""
    (cwd / "params.yaml").write_text(yaml.safe_dump(params | {"tracking": {"enabled": False}}))
    main = importlib.import_module(f"stages.{stage}").main
    capsys.readouterr()
    with contextlib.chdir(cwd), pytest.raises(SystemExit) as stop:
        main()
    return Finished(stop.value.code, capsys.readouterr().err)


def test_patch_check_stage_refuses_a_truncated_gguf_with_exit_2(truncated_gguf, tmp_path, capsys):
    report = tmp_path / "artifacts/patch-check/report.json"
    report.parent.mkdir(parents=True)
    report.write_text('{"earlier": "report"}')
    done = run_stage("patch_check", tmp_path, {"target": {"source": str(truncated_gguf)}}, capsys)
    assert done.returncode == 2, done.stderr
    (failure,) = failure_lines(done.stderr, "patch-check")
    assert "is not a complete GGUF file" in failure and done.stderr.strip().endswith(failure)
    assert report.read_text() == '{"earlier": "report"}' and not (tmp_path / "metrics").exists()


def test_aux_layers_out_of_range_exit_2_in_one_line(tmp_path, monkeypatch, capsys):
    import stages.patch_check

    monkeypatch.chdir(tmp_path)
    (tmp_path / "params.yaml").write_text(yaml.safe_dump({"extract": {"aux_layers": [1, 14, 29]}}))
    with pytest.raises(SystemExit) as stop:
        stages.patch_check.main()
    err = capsys.readouterr().err
    assert stop.value.code == 2 and err.count("\n") == 1
    assert "extract.aux_layers: layer ids [29] are outside the target (allowed: 0..28" in err
    assert not (tmp_path / "artifacts").exists()


# --- extraction: bad data and non-finite states lose nothing -------------------------------------

CONVERSATIONS = [
    ("Name a colour.", "Blue is a colour, and so is green."),
    ("What is two plus two?", "Two plus two is four."),
    ("Say hello in French.", "Bonjour! That is hello in French."),
    ("Give me a fruit.", "An apple is a fruit that grows on trees."),
]


def data_file(path: Path) -> Path:
    lines = [
        line({"conversations": [{"from": "human", "value": q}, {"from": "gpt", "value": a}]})
        for q, a in CONVERSATIONS
    ]
    path.write_bytes(b"".join(lines))
    return path


def tiny_params(source: Path):
    return parse_params(
        {
            "target": {"dtype": "float32"},
            "data": {"source": str(source), "num_samples": 2, "max_length": 64, "min_assistant_tokens": 2},
            "extract": {"shard_samples": 1, "batch_tokens": 128, "pack_weights": False},
        }
    )


AUX = [1, 14, 26]
FP = made_up_fingerprint(aux_layers=tuple(AUX))


def test_non_finite_states_are_refused_and_the_finished_shards_kept(smollm2, tmp_path):
    params = tiny_params(data_file(tmp_path / "data.jsonl"))
    out, work = tmp_path / "store", work_folder(tmp_path / "store")
    extract_features(smollm2, params, AUX, FP, out, stop_after_shards=1)
    first = (work / "shard-00000.safetensors").stat()
    weight = smollm2.model.model.layers[3].mlp.down_proj.weight
    kept = weight[0].clone()
    try:
        with torch.no_grad():
            weight[0, :4] = torch.tensor([float("inf"), 1.0, float("nan"), 1.0])  # an overflowing layer
        with pytest.raises(
            InputError, match=r"NaN or Inf aux_hidden for sample 0 of shard 1 .*target.dtype"
        ) as err:
            extract_features(smollm2, params, AUX, FP, out)
        assert "\n" not in str(err.value)
    finally:
        with torch.no_grad():
            weight[0] = kept
    assert not (work / "shard-00001.safetensors").exists()
    assert [s["file"] for s in json.loads((work / JOURNAL).read_text())["shards"]] == [
        "shard-00000.safetensors"
    ]
    extract_features(smollm2, params, AUX, FP, out)  # the target fixed: the run resumes and ends
    again = (out / "shard-00000.safetensors").stat()
    assert (first.st_ino, first.st_mtime_ns) == (again.st_ino, again.st_mtime_ns)
    assert (out / "manifest.json").exists() and not work.exists()


def test_infinite_states_are_refused(tmp_path):
    def sample(bad: bool) -> Sample:
        last = torch.zeros(5, 4, dtype=torch.bfloat16)
        if bad:
            last[3, 1] = float("-inf")
        ids, mask = torch.zeros(5, dtype=torch.int32), torch.ones(5, dtype=torch.uint8)
        return Sample(ids, mask, torch.zeros(5, 12, dtype=torch.bfloat16), last)

    with pytest.raises(InputError, match=r"NaN or Inf last_hidden for sample 1 of shard 7 \(token 3 of 5\)"):
        write_shard(tmp_path, 7, [sample(False), sample(True)])
    assert not list(tmp_path.iterdir())  # nothing stored


def test_extract_stage_refuses_a_bad_data_file_and_keeps_the_last_store(tmp_path, capsys):
    store = tmp_path / "artifacts/extract"
    store.mkdir(parents=True)
    kept = {
        "manifest.json": b'{"schema_version": 1}',
        "shard-00000.safetensors": b"last run",
        "tokens.safetensors": b"ids",
    }
    for name, data in kept.items():
        (store / name).write_bytes(data)
    report = tmp_path / "artifacts/patch-check/report.json"
    report.parent.mkdir(parents=True)
    report.write_text(json.dumps({"fingerprint": FP.to_json()}))
    bad = tmp_path / "data.jsonl"
    bad.write_bytes(line(GOOD) + b'{"conversations": [{"from": "human", "value": "\xff"}]}\n')
    done = run_stage(
        "extract",
        tmp_path,
        {
            "target": {"dtype": "float32"},
            "data": {"source": str(bad), "num_samples": 1},
            "extract": {"pack_weights": False},
        },
        capsys,
    )
    assert done.returncode == 2, done.stderr
    (failure,) = failure_lines(done.stderr, "extract")
    assert f"data.source {bad}, line 2: not UTF-8" in failure and done.stderr.strip().endswith(failure)
    assert {p.name: p.read_bytes() for p in store.iterdir()} == kept
    assert not (tmp_path / "metrics").exists()
