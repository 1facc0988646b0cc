"""Corrupted stored data is detected before use, with an error naming the file, and a re-run
repairs only what is broken: on a real tiny project (the real SmolLM2 target, real extraction,
the real vocab-map and train stage code run in-process) and on real training checkpoints.

Corruptions tried: a shard truncated, one with a flipped byte, one deleted; the manifest
edited; the token file damaged; a vocab mapping from another run (other vocab.size, other
features, its tensor file alone swapped); a tokenizer that no longer matches the features;
a checkpoint truncated, one with a flipped byte, one from other params.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import zipfile
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
import yaml

from eagle3.core.params import load_params
from eagle3.data.extract import extract_features
from eagle3.data.store import MANIFEST, TOKENS, CorruptStoreError, FeatureStore
from eagle3.target.fingerprint import read_fingerprint
from eagle3.target.load import resolve_target
from eagle3.target.patch_check import fingerprint
from eagle3.train.loop import CHECKPOINT, TrainInputs, train_drafter, trainable_state

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # stages/ is no installed package: import it as `python -m stages.x` does
import stages.train  # noqa: E402
import stages.vocab_map  # noqa: E402

AUX = [1, 14, 26]
SHARDS = ["shard-00000.safetensors", "shard-00001.safetensors", "shard-00002.safetensors"]
CONVERSATIONS = [
    ("Name a colour.", "Blue is a colour, and so is green."),
    ("What is two plus two?", "Two plus two is four."),
    ("Say hello in French.", "Bonjour! That is hello in French."),
]
PARAMS = {
    "target": {"dtype": "float32"},
    "data": {"num_samples": 3, "max_length": 64, "min_assistant_tokens": 2},
    "extract": {"shard_samples": 1, "batch_tokens": 128, "pack_weights": False},
    "vocab": {"size": 64},
    "train": {"dtype": "float32", "batch_size": 1, "seq_len": 64, "epochs": 1},
    "tracking": {"enabled": False},
}


@contextmanager
def inside(folder: Path):
    """Run stage code with `folder` as the working directory, as DVC runs a stage."""
    before = Path.cwd()
    os.chdir(folder)
    try:
        yield
    finally:
        os.chdir(before)


def write_params(folder: Path, **sections: dict) -> None:
    params = {k: dict(v) for k, v in PARAMS.items()}
    params["data"]["source"] = str(folder.parent / "data.jsonl")
    for section, values in sections.items():
        params[section] |= values
    (folder / "params.yaml").write_text(yaml.safe_dump(params))


def extract(smollm2, folder: Path) -> None:
    params = load_params(folder / "params.yaml")
    fp = read_fingerprint(folder / "artifacts/patch-check/report.json")
    extract_features(smollm2, params, AUX, fp, folder / "artifacts/extract")


def stage_failure(main, folder: Path, capsys) -> str:
    """Run a stage's main() in `folder`; it must exit with 2 and one line: return that line."""
    capsys.readouterr()
    with inside(folder), pytest.raises(SystemExit) as stop:
        main()
    err = capsys.readouterr().err
    assert stop.value.code == 2 and err.count("\n") == 1, err
    return err


@pytest.fixture(scope="module")
def built(smollm2, tmp_path_factory) -> Path:
    """patch-check's report, 3 one-sample shards and the vocab mapping of a tiny project."""
    base = tmp_path_factory.mktemp("corruption")
    lines = [
        {"conversations": [{"from": "human", "value": q}, {"from": "gpt", "value": a}]}
        for q, a in CONVERSATIONS
    ]
    (base / "data.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    root = base / "project"
    (root / "artifacts/patch-check").mkdir(parents=True)
    write_params(root)
    report = {"fingerprint": fingerprint(smollm2, AUX).to_json()}
    (root / "artifacts/patch-check/report.json").write_text(json.dumps(report))
    extract(smollm2, root)
    with inside(root):
        stages.vocab_map.main()
    return root


@pytest.fixture
def project(built, tmp_path) -> Path:
    """A fresh copy of the built project for one test to damage (next to the same data file)."""
    root = built.parent / tmp_path.name
    shutil.copytree(built, root, copy_function=shutil.copy2)
    write_params(root)
    yield root
    shutil.rmtree(root)


def stats(store: Path) -> dict[str, tuple[int, int]]:
    return {p.name: (p.stat().st_ino, p.stat().st_mtime_ns) for p in store.glob("shard-*")}


def same_files(a: Path, b: Path) -> bool:
    files = sorted(p.name for p in a.iterdir())
    return files == sorted(p.name for p in b.iterdir()) and all(
        (a / n).read_bytes() == (b / n).read_bytes() for n in files
    )


@pytest.mark.parametrize("damage", ["truncated", "flipped byte", "deleted"])
def test_damaged_shard_is_named_before_training_and_only_it_is_recomputed(
    smollm2, built, project, capsys, damage
):
    store = project / "artifacts/extract"
    shard = store / SHARDS[1]
    data = shard.read_bytes()
    if damage == "truncated":
        shard.write_bytes(data[: len(data) // 2])
    elif damage == "flipped byte":
        shard.write_bytes(data[:-50] + bytes([data[-50] ^ 0x01]) + data[-49:])
    else:
        shard.unlink()
    with pytest.raises(CorruptStoreError, match=rf"{shard} is (missing|corrupt or truncated)"):
        FeatureStore(store).verify()
    failure = stage_failure(stages.train.main, project, capsys)  # before any training
    assert f"train failed: artifacts/extract/{SHARDS[1]} is " in failure
    kept = {name: st for name, st in stats(store).items() if name != SHARDS[1]}
    extract(smollm2, project)  # the re-run
    assert {name: st for name, st in stats(store).items() if name != SHARDS[1]} == kept  # untouched
    assert same_files(store, built / "artifacts/extract")  # repaired, byte for byte


def test_edited_manifest_is_named_and_the_rerun_reuses_every_shard(smollm2, built, project, capsys):
    store = project / "artifacts/extract"
    manifest = json.loads((store / MANIFEST).read_text())
    manifest["shards"][0]["samples"] = 2  # shifts every sample index after it
    (store / MANIFEST).write_text(json.dumps(manifest, indent=2, sort_keys=True))
    err = stage_failure(stages.vocab_map.main, project, capsys)
    assert f"vocab-map failed: artifacts/extract/{MANIFEST} was edited after extraction" in err
    kept = stats(store)
    extract(smollm2, project)
    assert stats(store) == kept and same_files(store, built / "artifacts/extract")


def test_damaged_token_file_is_named_and_the_rerun_reuses_every_shard(smollm2, built, project, capsys):
    store = project / "artifacts/extract"
    data = (store / TOKENS).read_bytes()
    (store / TOKENS).write_bytes(data[:-3] + bytes([data[-3] ^ 0x04]) + data[-2:])  # one byte changed
    assert f"artifacts/extract/{TOKENS} is corrupt or truncated" in stage_failure(
        stages.vocab_map.main, project, capsys
    )
    kept = stats(store)
    extract(smollm2, project)
    assert stats(store) == kept and same_files(store, built / "artifacts/extract")


def test_vocab_mapping_from_another_run_is_refused_until_vocab_map_reruns(smollm2, built, project, capsys):
    mapping = project / "artifacts/vocab-map"
    ours = {p.name: p.read_bytes() for p in mapping.iterdir()}
    # another vocab.size's mapping
    write_params(project, vocab={"size": 32})
    with inside(project):
        stages.vocab_map.main()
    write_params(project)
    assert "built for vocab.size 32, params have 64" in stage_failure(stages.train.main, project, capsys)
    # its tensor file alone, next to our vocab.json
    (mapping / "vocab.json").write_bytes(ours["vocab.json"])
    err = stage_failure(stages.train.main, project, capsys)
    vocab_map = "artifacts/vocab-map"
    assert f"{vocab_map}/mapping.safetensors is not the mapping {vocab_map}/vocab.json describes" in err
    # a mapping counted from another extraction (2 samples instead of 3)
    write_params(project, data={"num_samples": 2})
    extract(smollm2, project)
    with inside(project):
        stages.vocab_map.main()
    shutil.rmtree(project / "artifacts/extract")
    shutil.copytree(built / "artifacts/extract", project / "artifacts/extract")
    write_params(project)
    assert "was counted from other features" in stage_failure(stages.train.main, project, capsys)
    with inside(project):  # the repair: vocab-map again, then train accepts its inputs
        stages.vocab_map.main()
        inputs, online = stages.train.prepare(load_params())
    assert {p.name: p.read_bytes() for p in mapping.iterdir()} == ours
    assert len(inputs.store) == 3 and len(inputs.d2t) == 64 and online is None


def test_tokenizer_that_no_longer_matches_the_features_is_refused(project, capsys):
    real = Path(resolve_target("smollm2-135m-instruct"))
    target = project / "target"
    target.mkdir()
    for path in real.iterdir():
        (target / path.name).symlink_to(path)
    (target / "tokenizer.json").unlink()
    tokenizer = json.loads((real / "tokenizer.json").read_text())
    tokenizer["added_tokens"][0]["content"] = "<|changed|>"
    (target / "tokenizer.json").write_text(json.dumps(tokenizer))
    write_params(project, target={"dtype": "float32", "source": str(target)})
    assert "the target's tokenizer files changed since the features" in stage_failure(
        stages.train.main, project, capsys
    )


# --- checkpoints --------------------------------------------------------------------------------


def _largest_entry_offset(path: Path) -> int:
    """Where the bytes of the checkpoint's largest tensor start (zip local header skipped)."""
    with zipfile.ZipFile(path) as z:
        info = max(z.infolist(), key=lambda i: i.file_size)
    raw = path.read_bytes()
    name_len = int.from_bytes(raw[info.header_offset + 26 : info.header_offset + 28], "little")
    extra_len = int.from_bytes(raw[info.header_offset + 28 : info.header_offset + 30], "little")
    return info.header_offset + 30 + name_len + extra_len


def test_checkpoints_load_weights_only_and_damage_or_other_params_are_not_resumed(tmp_path, capsys):
    from test_train import interrupt_after, tiny_inputs, tiny_params  # the tiny training setup

    inputs, p = tiny_inputs(tmp_path / "f"), tiny_params(epochs=1)
    interrupt_after(p, inputs, tmp_path / "cut", steps=3)
    saved = tmp_path / "cut" / CHECKPOINT
    assert torch.load(saved, weights_only=True)["step"] == 2  # tensors and plain values only

    def resume(case: str, key: str = "tiny") -> tuple[int, str, dict]:
        """(first step trained, what was printed, weights) of a run next to a copy of `saved`."""
        folder = tmp_path / case
        folder.mkdir()
        data = saved.read_bytes()
        if case == "truncated":
            data = data[: len(data) - 100]
        elif case == "flipped byte":
            at = _largest_entry_offset(saved) + 7
            data = data[:at] + bytes([data[at] ^ 0x10]) + data[at + 1 :]
        (folder / CHECKPOINT).write_bytes(data)
        steps: list[int] = []
        capsys.readouterr()
        run = TrainInputs(**{**inputs.__dict__, "run_key": key})
        out = train_drafter(p, run, folder, on_step=lambda row: steps.append(row["step"]))
        return steps[0], " ".join(capsys.readouterr().err.split()), trainable_state(out.drafter)

    # another key trains the same params from scratch: the uninterrupted run's weights
    first, err, whole = resume("other params", key="other")
    assert first == 1 and f"{tmp_path / 'other params' / CHECKPOINT} was written for other params" in err
    first, err, state = resume("intact")
    resumed = f"train: resuming {tmp_path / 'intact' / CHECKPOINT} at step 2 "
    assert first == 3 and err.startswith(resumed)  # really resumed after step 2, and bitwise the same result
    assert all(torch.equal(state[k], whole[k]) for k in whole)
    for case, why in (("truncated", "is damaged ("), ("flipped byte", "its content differs")):
        first, err, state = resume(case)
        assert first == 1 and f"{tmp_path / case / CHECKPOINT} is damaged" in err and why in err
        assert all(torch.equal(state[k], whole[k]) for k in whole)
