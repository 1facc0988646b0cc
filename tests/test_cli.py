"""The `eagle3` command: presets expand to validated `dvc exp run` arguments."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import yaml

from eagle3.cli.command import main
from eagle3.cli.commands.preset import preset_args
from eagle3.core.params import ParamsError, parse_params

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[1]


def test_every_shipped_preset_is_valid_on_the_default_params():
    presets = sorted((REPO / "presets").glob("*.yaml"))
    assert presets, "no presets shipped"
    for preset in presets:
        args = preset_args(preset.stem, str(REPO / "params.yaml"), str(REPO / "presets"))
        assert args and all(a.startswith("--set-param=") and "=" in a[12:] for a in args)
        assert not any(" " in a for a in args)  # safe inside $(...) word splitting


def test_preset_args_apply_exactly_the_preset(tmp_path):
    shutil.copy(REPO / "params.yaml", tmp_path / "params.yaml")
    (tmp_path / "presets").mkdir()
    (tmp_path / "presets" / "mine.yaml").write_text(
        "vocab: {size: 4096}\neval: {categories: [math, coding]}\n"
    )
    args = preset_args("mine", str(tmp_path / "params.yaml"), str(tmp_path / "presets"))
    assert args == ["--set-param=vocab.size=4096", '--set-param=eval.categories=["math","coding"]']
    # what DVC does with them: each value parsed as YAML into the params
    merged = yaml.safe_load((tmp_path / "params.yaml").read_text())
    for arg in args:
        key, value = arg.removeprefix("--set-param=").split("=", 1)
        section, name = key.split(".")
        merged[section][name] = yaml.safe_load(value)
    assert parse_params(merged).eval.categories == ["math", "coding"]


def test_a_bad_or_unknown_preset_fails_before_dvc_runs(tmp_path, monkeypatch, capsys):
    shutil.copy(REPO / "params.yaml", tmp_path / "params.yaml")
    (tmp_path / "presets").mkdir()
    (tmp_path / "presets" / "bad.yaml").write_text("train: {epochs: 0}\n")
    with pytest.raises(ParamsError, match="train.epochs"):
        preset_args("bad", str(tmp_path / "params.yaml"), str(tmp_path / "presets"))
    monkeypatch.chdir(tmp_path)
    assert main(["preset", "nope"]) == 2
    assert "preset 'nope' not found (allowed: bad)" in capsys.readouterr().err


def test_ship_copies_the_drafter_with_its_params_and_metrics(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert main(["ship", "mine"]) == 2  # nothing trained yet: a clear error, nothing written
    assert "artifacts/train/drafter/config.json is missing" in capsys.readouterr().err
    assert not (tmp_path / "drafters").exists()
    drafter = tmp_path / "artifacts" / "train" / "drafter"
    drafter.mkdir(parents=True)
    (drafter / "config.json").write_text("{}")
    (drafter / "model.safetensors").write_bytes(b"weights")
    (tmp_path / "params.yaml").write_text("train: {epochs: 3}\n")
    (tmp_path / "metrics").mkdir()
    (tmp_path / "metrics" / "speculative-eval.json").write_text('{"speedup": 1.5}')
    assert main(["ship", "mine"]) == 0
    out = tmp_path / "drafters" / "mine"
    assert (out / "model.safetensors").read_bytes() == b"weights"
    assert (out / "params.yaml").read_text() == "train: {epochs: 3}\n"
    assert json.loads((out / "metrics.json").read_text()) == {"speculative-eval": {"speedup": 1.5}}
