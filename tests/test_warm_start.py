"""Warm start (train.init): each refusal, the adopted draft vocabulary and its coverage, the quick
held-out fit check, and fine-tuning that really starts from the drafter's weights.

Real tiny drafters: trained on the tiny feature store of test_train.py and exported as the train
stage exports them (SGLang layout), or built at another target's shape."""

from __future__ import annotations

import json
import re
import subprocess
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from test_train import REPO, H, K, V, tiny_cfg, tiny_inputs, tiny_params, tiny_store

from eagle3.core.inputs import InputError
from eagle3.core.params import ParamsError
from eagle3.data.store import write_tokens
from eagle3.drafter import Eagle3Drafter, export_drafter
from eagle3.drafter.warm_start import adopt_vocab_map, read_init_drafter
from eagle3.train.loop import train_drafter
from eagle3.train.prepare import TrainInputs, check_adopted_mapping, drafter_config, warm_start_config
from eagle3.train.report import stage_metrics
from eagle3.vocab import build_vocab_map

AUX = [1, 2, 3]


def export_random(folder: Path, **cfg) -> Path:
    """A drafter of tiny_cfg's shape (changed by `cfg`) with random weights, exported."""
    torch.manual_seed(0)
    config = replace(tiny_cfg(), **cfg)
    export_drafter(Eagle3Drafter(config), folder, dtype=torch.float32)
    return folder


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> tuple[Path, dict, TrainInputs]:
    """A drafter trained on the tiny store (float32 export: its weights exactly), with the
    held-out metrics of its last epoch and the inputs it was trained on."""
    root = tmp_path_factory.mktemp("trained")
    inputs = tiny_inputs(root / "features")
    out = train_drafter(tiny_params(epochs=4), inputs)
    export_drafter(out.drafter, root / "drafter", dtype=torch.float32)
    return root / "drafter", out.metrics, inputs


def warm_inputs(inputs: TrainInputs, folder: Path) -> TrainInputs:
    """The tiny inputs with the init drafter's own mapping, as vocab-map adopts it."""
    init = read_init_drafter(str(folder))
    return replace(inputs, d2t=init.d2t, t2d=init.t2d, init=init)


# --- refusals, each one line naming both values ----------------------------------------------------


def test_missing_folder_is_refused(tmp_path):
    with pytest.raises(InputError, match=r"train.init: .*nowhere does not exist"):
        read_init_drafter(str(tmp_path / "nowhere"))


def test_a_file_is_refused_as_a_file_not_a_folder(tmp_path):
    """train.init: README.md (a file that exists) says what it found and what is expected."""
    readme = tmp_path / "README.md"
    readme.write_text("# not a drafter\n")
    with pytest.raises(InputError) as err:
        read_init_drafter(str(readme))
    assert str(err.value) == (
        f"train.init: {readme} is a file, not a folder (expected an exported drafter folder with "
        "config.json and model.safetensors, e.g. drafters/<name>, or null to train from scratch)"
    )


def test_a_folder_without_the_drafter_files_is_refused_naming_what_it_holds(tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(InputError) as err:
        read_init_drafter(str(empty))
    assert str(err.value) == (
        f"train.init: {empty} is a folder without config.json and model.safetensors, not an exported "
        "drafter (expected an exported drafter folder with config.json and model.safetensors, e.g. "
        "drafters/<name>, or null to train from scratch); it is empty"
    )
    (empty / "config.json").write_text("{}")  # half a drafter: the missing file is named
    (empty / "notes").mkdir()
    with pytest.raises(InputError, match=r"without model.safetensors, not .*; it holds config.json, notes/$"):
        read_init_drafter(str(empty))
    parent = tmp_path / "drafters"  # the folder of drafters instead of one drafter in it
    export_random(parent / "a")
    with pytest.raises(InputError, match=f"; the drafters in it: {re.escape(str(parent))}/a$"):
        read_init_drafter(str(parent))


def test_not_a_drafter_is_refused(tmp_path):
    target = export_random(tmp_path / "target")  # a target model's config in its place
    config = json.loads((target / "config.json").read_text()) | {"architectures": ["LlamaForCausalLM"]}
    (target / "config.json").write_text(json.dumps(config))
    with pytest.raises(
        InputError, match=r"config.json is not an EAGLE-3 drafter's config .*LlamaForCausalLM"
    ):
        read_init_drafter(str(target))


@pytest.mark.slow
def test_vocab_size_that_differs_is_refused_with_both_numbers(trained):
    folder, _, inputs = trained
    counts = np.ones(V, dtype=np.int64)
    with pytest.raises(
        InputError, match=rf"vocab.size is 100 but .* draft vocabulary of {K} tokens.*vocab.size: {K}"
    ):
        adopt_vocab_map(read_init_drafter(str(folder)), counts, H, AUX, 100)


@pytest.mark.parametrize(
    ("changed", "line"),
    [
        ({"hidden_size": 48, "target_hidden_size": 48, "head_dim": 12}, "hidden size: drafter 48, target 32"),
        ({"aux_layer_ids": [1, 3, 5]}, "aux layer ids: drafter [1, 3, 5], target features [1, 2, 3]"),
        ({"vocab_size": 512}, "target vocabulary: drafter 512, target 256"),
    ],
)
def test_another_targets_drafter_is_refused_before_the_mapping_is_adopted(tmp_path, changed, line):
    init = read_init_drafter(str(export_random(tmp_path / "other", **changed)))
    with pytest.raises(InputError, match="was made for another target") as err:
        adopt_vocab_map(init, np.ones(V, dtype=np.int64), H, AUX, K)
    assert f"\n  - {line}" in str(err.value)
    with pytest.raises(InputError, match="was made for another target") as err:  # and again by train
        warm_start_config(init, tiny_cfg(), tiny_params())
    assert f"\n  - {line}" in str(err.value)


def test_rope_that_differs_is_refused_by_train(tmp_path):
    init = read_init_drafter(str(export_random(tmp_path / "other")))  # rope_theta 1e4, default
    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128}
    target = replace(tiny_cfg(), rope_theta=5e5, rope_scaling=yarn)
    with pytest.raises(InputError) as err:
        warm_start_config(init, target, tiny_params())
    assert "\n  - RoPE: drafter theta 10000, default, target theta 500000, factor 4.0" in str(err.value)


def test_another_targets_shape_lists_every_mismatch(tmp_path):
    """A drafter of another target's shape (as the Gemma-3-270M preset's would be on SmolLM2):
    every mismatch at once, one line each."""
    other = dict(hidden_size=40, target_hidden_size=40, head_dim=10, vocab_size=320, aux_layer_ids=[1, 8, 14])
    init = read_init_drafter(str(export_random(tmp_path / "gemma-like", rope_theta=1e6, **other)))
    with pytest.raises(InputError) as err:
        warm_start_config(init, tiny_cfg(), tiny_params())
    lines = str(err.value).split("\n  - ")[1:]
    assert [line.split(":")[0] for line in lines] == [
        "hidden size",
        "aux layer ids",
        "target vocabulary",
        "RoPE",
    ]


@pytest.mark.slow
def test_shape_params_that_differ_from_the_drafter_are_refused(trained):
    init = read_init_drafter(str(trained[0]))
    with pytest.raises(ParamsError, match=r"train.intermediate_size is 24 but the drafter has 64"):
        warm_start_config(init, tiny_cfg(), tiny_params(intermediate_size=24))
    with pytest.raises(ParamsError, match=r"train.fc_norm is True but the drafter has False"):
        warm_start_config(init, tiny_cfg(), tiny_params(fc_norm=True))
    cfg = warm_start_config(init, replace(tiny_cfg(), intermediate_size=80), tiny_params())
    assert cfg.intermediate_size == 64 and drafter_config(cfg, tiny_params()) == cfg  # the drafter's shape


@pytest.mark.slow
def test_a_mapping_not_adopted_from_these_files_is_refused(trained):
    init = read_init_drafter(str(trained[0]))
    with pytest.raises(InputError, match=r"not adopted from the train.init drafter"):
        check_adopted_mapping(init, init.d2t, init.t2d, {"init_sha256": "0" * 64})
    counted = build_vocab_map(np.arange(V), K)  # a mapping counted from data instead
    with pytest.raises(InputError, match=r"differs from the train.init drafter's d2t/t2d"):
        check_adopted_mapping(init, counted.d2t, counted.t2d, {"init_sha256": init.sha256})
    check_adopted_mapping(init, init.d2t, init.t2d, {"init_sha256": init.sha256})


# --- the adopted vocabulary, the fit check, fine-tuning ---------------------------------------------


@pytest.mark.slow
def test_adopted_mapping_and_its_coverage_on_this_runs_tokens(trained):
    init = read_init_drafter(str(trained[0]))
    counts = np.zeros(V, dtype=np.int64)
    counts[1::3] = 10  # this run's tokens: none of the drafter's (every third token from 0)
    counts[0:30:3] = 1
    vocab = adopt_vocab_map(init, counts, H, AUX, K)
    assert torch.equal(vocab.d2t, init.d2t) and torch.equal(vocab.t2d, init.t2d)
    total = 10 + 10 * len(range(1, V, 3))
    assert vocab.coverage() == pytest.approx(10 / total)  # only the 10 tokens it shares with this run
    assert build_vocab_map(counts, K).coverage() == pytest.approx(10 * K / total)  # counted here: 74%


@pytest.mark.slow
def test_warm_start_measures_the_drafter_first_then_fine_tunes_it(trained):
    folder, source, inputs = trained
    p = tiny_params(epochs=1, init_min_acc=0.0)
    warm = warm_inputs(inputs, folder)
    out = train_drafter(
        p, replace(warm, drafter_cfg=drafter_config(warm_start_config(warm.init, tiny_cfg(), p), p))
    )
    # the check ran on the init weights: the source run's last held-out figures, exactly
    assert out.metrics["init"]["heldout_acc_0"] == source["heldout_acc_0"]
    assert out.metrics["init"]["acceptance_length"] == source["acceptance_length"]
    metrics = stage_metrics(out)
    assert metrics["init_heldout_acc_0"] == round(source["heldout_acc_0"], 6)
    assert "init_sim_acceptance_length" in metrics
    scratch = train_drafter(p, inputs)
    assert out.curve[0]["loss"] < scratch.curve[0]["loss"]  # training went on from the trained weights
    assert "init_heldout_acc_0" not in stage_metrics(scratch)


@pytest.mark.slow
def test_a_drafter_that_does_not_fit_is_refused_before_training(trained, tmp_path):
    _, _, inputs = trained
    folder = export_random(tmp_path / "random")  # right shape, never trained on this target
    warm = warm_inputs(inputs, folder)
    with pytest.raises(InputError, match=r"held-out top-1 0\.\d+, .*below train.init_min_acc 0.5") as err:
        train_drafter(tiny_params(init_min_acc=0.5), warm, tmp_path / "ck")
    assert "train.init: null trains from scratch" in str(err.value)
    assert not (tmp_path / "ck").exists()  # nothing trained, nothing written


@pytest.mark.slow
def test_vocab_map_stage_adopts_the_drafter_and_refuses_another_size(trained, tmp_path, monkeypatch, capsys):
    folder, _, _ = trained
    store = tiny_store(tmp_path / "artifacts" / "extract")
    samples = [store.sample(i) for i in range(len(store))]
    lengths = torch.tensor([0] + [len(s["input_ids"]) for s in samples])
    write_tokens(  # the token file vocab-map counts from (tiny_store writes the shards only)
        store.folder,
        torch.cat([s["input_ids"] for s in samples]),
        torch.cat([s["loss_mask"] for s in samples]),
        lengths.cumsum(0),
    )
    params = yaml.safe_load((REPO / "params.yaml").read_text())
    params["tracking"]["enabled"] = False
    params["train"]["init"] = str(folder)
    # the stage's main() in this process, in the folder, as DVC runs it there (tests/test_corruption.py
    # does the same): a fresh interpreter per run cost seconds of imports for the same code
    monkeypatch.syspath_prepend(str(REPO))  # stages/ is no installed package
    monkeypatch.chdir(tmp_path)
    from stages.vocab_map import main

    def vocab_map(size: int) -> subprocess.CompletedProcess:
        params["vocab"]["size"] = size
        (tmp_path / "params.yaml").write_text(yaml.safe_dump(params))
        capsys.readouterr()
        try:
            main()
            code = 0
        except SystemExit as stop:
            code = stop.code
        out, err = capsys.readouterr()
        return subprocess.CompletedProcess(["stages.vocab_map"], code, out, err)

    refused = vocab_map(8192)
    assert refused.returncode == 2 and "vocab.size is 8,192 but the train.init drafter" in refused.stderr
    assert not (tmp_path / "artifacts" / "vocab-map").exists()
    done = vocab_map(K)
    assert done.returncode == 0, done.stderr
    metrics = json.loads((tmp_path / "metrics" / "vocab-map.json").read_text())
    assert metrics["draft_vocab_size"] == K and 0 < metrics["init_mapping_coverage"] <= 1
    assert metrics["counted_mapping_coverage"] >= metrics["init_mapping_coverage"]
    meta = json.loads((tmp_path / "artifacts" / "vocab-map" / "vocab.json").read_text())
    assert meta["init_sha256"] == read_init_drafter(str(folder)).sha256
    assert "adopted from train.init" in done.stderr
