"""Extraction data path on the real SmolLM2 at tiny sizes: ShareGPT parsing, loss masks,
the shard store, resume after interruption, and corruption detection."""

from __future__ import annotations

import copy
import json
import shutil
from pathlib import Path

import pytest
import torch
from conftest import SHAREGPT_SAMPLE

from eagle3.core.device import torch_threads
from eagle3.core.params import parse_params
from eagle3.core.stageio import code_sha256
from eagle3.data import extract
from eagle3.data.conversations import load_conversations, normalise, read_complete_records
from eagle3.data.extract import extract_features
from eagle3.data.store import JOURNAL, MANIFEST, CorruptStoreError, FeatureStore, work_folder
from eagle3.target.load import eos_token_ids
from eagle3.target.patch_check import fingerprint
from eagle3.target.render import assistant_spans, render_conversation, render_prompt, user_turn

AUX = [1, 14, 26]

REPO = Path(__file__).resolve().parents[1]


def test_truncated_json_array_keeps_complete_records():
    text = json.dumps([{"id": i, "conversations": []} for i in range(3)])
    cut = text[: text.rindex('{"id": 2') + 12]  # the last record is cut off
    assert [r["id"] for r in read_complete_records(cut)] == [0, 1]


def test_packaged_sharegpt_loads_complete_conversations():
    conversations = load_conversations("sharegpt")
    assert len(conversations) > 15_000
    assert all(c[0]["role"] in ("user", "system") for c in conversations[:100])


def test_roles_are_normalised_and_alternate():
    turns = [
        {"from": "gpt", "value": "orphan"},
        {"from": "human", "value": "hi"},
        {"from": "bard", "value": "hello"},
        {"from": "chatgpt", "value": "again"},
    ]
    assert normalise(turns) == [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]


def test_loss_mask_covers_exactly_the_assistant_turns(smollm2):
    tok = smollm2.tokenizer
    messages = [
        {"role": "user", "content": "Name a colour."},
        {"role": "assistant", "content": "Blue."},
        {"role": "user", "content": "Another?"},
        {"role": "assistant", "content": "Green."},
    ]
    rendered = render_conversation(tok, messages, max_length=512)
    masked = tok.decode(rendered.input_ids[rendered.loss_mask == 1])
    assert masked == "Blue.<|im_end|>\nGreen.<|im_end|>\n"
    full = tok.apply_chat_template(messages, tokenize=False)
    assert tok.decode(rendered.input_ids) == full
    short = render_conversation(tok, messages, max_length=10)
    assert len(short.input_ids) == 10


@pytest.mark.parametrize("chat", [True, False], ids=["chat-model", "base-model"])
def test_training_and_eval_prompts_are_one_rendering(smollm2, chat):
    """Self-distillation (extract, regenerate, the SGLang backend) and speculative-eval ask the
    target the same thing: a user text gives the same ids on both paths, and those ids are what
    the training conversation holds before its assistant turn. The base model (no chat template)
    is SmolLM2's tokenizer with its template removed."""
    tok = smollm2.tokenizer
    if not chat:
        tok = copy.deepcopy(tok)
        tok.chat_template = None
    conversations = load_conversations(str(SHAREGPT_SAMPLE))
    for messages in conversations[:8]:
        question = messages[0]["content"]
        training = render_prompt(tok, messages, chat).tolist()
        assert render_prompt(tok, user_turn(question), chat).tolist() == training
        if chat:
            text = tok.apply_chat_template(user_turn(question), tokenize=False, add_generation_prompt=True)
            assert training == tok(text, add_special_tokens=False).input_ids
            # a chat template's special tokens bound the turn: the ids are a prefix too
            full = render_conversation(tok, messages, max_length=1 << 20, chat=chat).input_ids
            assert full[: len(training)].tolist() == training
        else:  # one paragraph per turn, as training conversations of a base model are written
            assert training == tok(question.strip() + "\n\n", add_special_tokens=True).input_ids
        text, spans = assistant_spans(tok, messages, chat)
        assert tok.decode(training) == text[: spans[0][0]]


def tiny_params(**data):
    return parse_params(
        {
            "target": {"dtype": "float32"},
            "data": {"source": str(SHAREGPT_SAMPLE), "num_samples": 6, "max_length": 40, "seed": 3} | data,
            "extract": {"shard_samples": 2, "batch_tokens": 128},
        }
    )


@pytest.fixture(scope="module")
def fp(smollm2):
    return fingerprint(smollm2, AUX)


@pytest.fixture(scope="module")
def uninterrupted(smollm2, fp, tmp_path_factory):
    out = tmp_path_factory.mktemp("full")
    extract_features(smollm2, tiny_params(), AUX, fp, out)
    return out


def test_store_layout_and_contents(uninterrupted, smollm2):
    store = FeatureStore(uninterrupted)
    store.verify()
    assert len(store) == 6 and len(store.shards) == 3
    sample = store.sample(4)
    t = len(sample["input_ids"])
    assert sample["input_ids"].dtype == torch.int32 and sample["loss_mask"].dtype == torch.uint8
    assert sample["aux_hidden"].shape == (t, 3 * 576) and sample["aux_hidden"].dtype == torch.bfloat16
    assert sample["last_hidden"].shape == (t, 576)
    # stored states are the target's own: recompute sample 4 alone and compare (bf16 rounding)
    with torch.no_grad():
        out = smollm2.model(sample["input_ids"].long()[None], output_hidden_states=True)
    assert torch.allclose(sample["last_hidden"].float(), out.hidden_states[-1][0], atol=0.05, rtol=0.02)
    assert torch.allclose(
        sample["aux_hidden"][:, 576:1152].float(), out.hidden_states[15][0], atol=0.05, rtol=0.02
    )
    manifest = json.loads((uninterrupted / MANIFEST).read_text())
    assert manifest["bytes_per_token"] == (3 + 1) * 576 * 2 + 4 + 1
    tokens = store.tokens()
    assert tokens["offsets"].tolist()[-1] == manifest["num_tokens"] == len(tokens["input_ids"])
    assert torch.equal(tokens["input_ids"][tokens["offsets"][4] : tokens["offsets"][5]], sample["input_ids"])


def test_interrupted_extraction_resumes_to_identical_files(smollm2, fp, uninterrupted, tmp_path):
    params = tiny_params()
    out, work = tmp_path / "store", work_folder(tmp_path / "store")
    partial = extract_features(smollm2, params, AUX, fp, out, stop_after_shards=2)
    assert partial == {"interrupted_after": 2}
    # until the run completes, shards and journal are in the work folder, outside the DVC out
    assert (work / JOURNAL).exists() and not out.exists()
    # one shard in the out, as a run killed while it moved shards there (before the store was
    # published whole) left it: vouched for by the journal, it is kept
    out.mkdir()
    (work / "shard-00001.safetensors").rename(out / "shard-00001.safetensors")
    first = [(work / "shard-00000.safetensors").stat(), (out / "shard-00001.safetensors").stat()]
    extract_features(smollm2, params, AUX, fp, out)
    again = [(out / "shard-00000.safetensors").stat(), (out / "shard-00001.safetensors").stat()]
    # moved, not recomputed
    assert [(s.st_ino, s.st_mtime_ns) for s in first] == [(s.st_ino, s.st_mtime_ns) for s in again]
    assert not work.exists()
    names = sorted(p.name for p in uninterrupted.iterdir())
    assert names == sorted(p.name for p in out.iterdir())
    for name in names:
        assert (out / name).read_bytes() == (uninterrupted / name).read_bytes(), name


def test_a_run_that_stops_midway_leaves_the_last_store_as_it_was(smollm2, fp, uninterrupted, tmp_path):
    """The out is replaced only by a complete store: a failure or a kill midway (another config
    here, stopped after one shard) leaves every file of the last one, byte for byte."""
    out = Path(shutil.copytree(uninterrupted, tmp_path / "store"))
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    assert extract_features(smollm2, tiny_params(seed=4), AUX, fp, out, stop_after_shards=1)
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert sorted(p.name for p in work_folder(out).iterdir()) == [JOURNAL, "shard-00000.safetensors"]


def test_resume_recomputes_a_damaged_shard_and_ignores_another_config(smollm2, fp, uninterrupted, tmp_path):
    out = tmp_path / "store"
    extract_features(smollm2, tiny_params(), AUX, fp, out, stop_after_shards=2)
    shard = work_folder(out) / "shard-00001.safetensors"
    shard.write_bytes(shard.read_bytes()[:-10])  # truncated by a crash
    extract_features(smollm2, tiny_params(), AUX, fp, out)
    assert (out / shard.name).read_bytes() == (uninterrupted / shard.name).read_bytes()
    # another seed: nothing of the old run may be reused
    extract_features(smollm2, tiny_params(seed=4), AUX, fp, out)
    assert (out / "shard-00000.safetensors").read_bytes() != (
        uninterrupted / "shard-00000.safetensors"
    ).read_bytes()


def test_shards_of_other_extraction_code_are_not_resumed(smollm2, fp, tmp_path, monkeypatch):
    """`dvc repro` after a change to the code that computes features must extract again, not
    keep the old shards: their journal key carries the extraction code's digest, and only its."""
    package = tmp_path / "eagle3"
    shutil.copytree(REPO / "eagle3", package, ignore=shutil.ignore_patterns("__pycache__"))
    before = code_sha256(package, extract.EXTRACTION_CODE)
    assert before == extract.extraction_code_sha256()  # the copy digests as the package does
    with open(package / "cli" / "report.py", "a") as f:
        f.write("# not extraction code\n")
    assert code_sha256(package, extract.EXTRACTION_CODE) == before
    with open(package / "target" / "capture.py", "a") as f:
        f.write("# extraction code\n")
    assert code_sha256(package, extract.EXTRACTION_CODE) != before

    out = tmp_path / "store"
    extract.extract_features(smollm2, tiny_params(), AUX, fp, out, stop_after_shards=1)
    kept = (work_folder(out) / "shard-00000.safetensors").stat()
    monkeypatch.setattr(extract, "extraction_code_sha256", lambda: "other code")
    extract.extract_features(smollm2, tiny_params(), AUX, fp, out)
    again = (out / "shard-00000.safetensors").stat()
    assert (again.st_ino, again.st_mtime_ns) != (kept.st_ino, kept.st_mtime_ns)  # computed anew


def test_shards_of_another_thread_count_are_not_resumed(smollm2, fp, tmp_path):
    """The manifest records the torch threads the capture ran at (online training runs its forwards
    at that count), and a run at another count computes its shards anew: one store, one count, as
    on some CPUs a forward's last bits depend on it."""
    out = tmp_path / "store"
    with torch_threads(1):
        extract_features(smollm2, tiny_params(), AUX, fp, out, stop_after_shards=1)
    kept = (work_folder(out) / "shard-00000.safetensors").stat()
    with torch_threads(2):
        extract_features(smollm2, tiny_params(), AUX, fp, out)
    again = (out / "shard-00000.safetensors").stat()
    assert (again.st_ino, again.st_mtime_ns) != (kept.st_ino, kept.st_mtime_ns)  # computed anew
    assert FeatureStore(out).capture_threads == 2


def test_corrupted_shard_is_detected(uninterrupted, tmp_path):
    for path in uninterrupted.iterdir():
        (tmp_path / path.name).write_bytes(path.read_bytes())
    shard = tmp_path / "shard-00002.safetensors"
    data = bytearray(shard.read_bytes())
    data[-100] ^= 0xFF  # one flipped byte inside the hidden states
    shard.write_bytes(bytes(data))
    with pytest.raises(CorruptStoreError, match="shard-00002.safetensors is corrupt or truncated"):
        FeatureStore(tmp_path).verify()


def test_self_distillation_features_come_from_the_generation_itself(smollm2, fp, tmp_path):
    """On-policy data: the target's greedy answer, and features equal to a separate full forward
    over the same tokens (bf16 rounding); the loss mask covers exactly the generated answer."""
    # max_length 80 cuts the longer prompts' answers short: rows finish at different steps
    params = tiny_params(
        num_samples=5, regenerate=True, regenerate_max_new_tokens=12, max_length=80, min_assistant_tokens=1
    )
    params = params.model_copy(  # one shard, 2 rows in flight: prompts join as earlier answers finish
        update={
            "data": params.data.model_copy(update={"regenerate_batch_size": 2}),
            "extract": params.extract.model_copy(update={"shard_samples": 5}),
        }
    )
    extract_features(smollm2, params, AUX, fp, tmp_path)
    store = FeatureStore(tmp_path)
    assert len(store) == 5
    prompt_lengths, lengths = set(), set()
    for i in range(len(store)):
        sample = store.sample(i)
        ids, mask = sample["input_ids"].long(), sample["loss_mask"].bool()
        prompt = int((~mask).sum())
        prompt_lengths.add(prompt)
        assert not mask[:prompt].any() and mask[prompt:].all()  # the answer is one final span
        with torch.no_grad():
            greedy = smollm2.model.generate(ids[None, :prompt], max_new_tokens=12, do_sample=False)
            ref = smollm2.model(ids[None], output_hidden_states=True).hidden_states
        answer = greedy[0, prompt:].tolist()
        # fed answer tokens = the greedy answer minus its last token (whose prediction is stored),
        # cut at the end-of-turn token or where the sequence reaches max_length
        ends = [
            j for j, token in enumerate(answer) if token in eos_token_ids(smollm2.model, smollm2.tokenizer)
        ]
        fed = min([min(12, 80 - prompt + 1) - 1] + ends)
        assert ids[prompt:].tolist() == answer[:fed]
        lengths.add(fed)
        for got, want in (
            (sample["last_hidden"], ref[-1][0]),
            (sample["aux_hidden"], torch.cat([ref[i + 1][0] for i in AUX], dim=-1)),
        ):
            torch.testing.assert_close(got.float(), want.to(torch.bfloat16).float(), rtol=2**-6, atol=2e-2)
    assert len(prompt_lengths) > 1 and len(lengths) > 1  # mixed prompt and answer lengths in flight
    again = tmp_path / "again"
    extract_features(smollm2, params, AUX, fp, again)
    shard = "shard-00000.safetensors"
    assert (again / shard).read_bytes() == (tmp_path / shard).read_bytes()
