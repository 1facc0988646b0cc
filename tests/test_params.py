"""Params validation: every problem named with its key path, value and what is allowed."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from eagle3.cli import main as cli
from eagle3.params import (
    Params,
    ParamsError,
    default_aux_layers,
    flatten,
    load_params,
    parse_params,
    resolve_aux_layers,
)

REPO = Path(__file__).resolve().parents[1]


def test_schema_defaults_are_params_yaml():
    """params.yaml is what the pipeline runs; a section built in code (tests, bench) or a partial
    file must mean the same. Every key listed, every default equal: they cannot drift apart."""
    written = flatten(yaml.safe_load((REPO / "params.yaml").read_text()))
    defaults = Params().flat()
    assert sorted(written) == sorted(defaults), "params.yaml must list every key of eagle3/params.py"
    differ = {k: (defaults[k], written[k]) for k in defaults if defaults[k] != written[k]}
    assert not differ, f"eagle3/params.py default != params.yaml value (change both): {differ}"
    assert load_params(REPO / "params.yaml") == Params()


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        ({"vocab": {"size": 0}}, "vocab.size: Input should be greater than or equal to 1 (got 0)"),
        ({"vocab": {"sise": 10}}, "vocab.sise: unknown key (allowed: size, coverage_grid)"),
        ({"train": {"epochs": "many"}}, "train.epochs: Input should be a valid integer"),
        (
            {"extract": {"aux_layers": [1, 2]}},
            "extract.aux_layers: must list exactly 3 layer ids (or be null for EAGLE-3's default)",
        ),
        ({"bogus": {}}, "bogus: unknown key (allowed: target, data, extract"),
        ({"eval": {"k": 0}}, "eval.k: Input should be greater than or equal to 1 (got 0)"),
    ],
)
def test_invalid_params_name_key_value_and_allowed(raw, expected):
    with pytest.raises(ParamsError) as err:
        parse_params(raw)
    assert expected in str(err.value)


def test_every_problem_is_reported_at_once():
    with pytest.raises(ParamsError) as err:
        parse_params({"vocab": {"size": 0}, "data": {"num_samples": -1, "extra": 1}})
    assert len(err.value.problems) == 3


def test_aux_layers_must_lie_inside_the_model():
    params = parse_params({"extract": {"aux_layers": [1, 14, 40]}})
    with pytest.raises(ParamsError, match=r"extract.aux_layers: layer ids \[40\] are outside the target"):
        resolve_aux_layers(params, num_layers=30)


def test_default_aux_layers_are_eagle3s():
    assert default_aux_layers(30) == [1, 14, 26]
    assert resolve_aux_layers(Params(), 30) == [1, 14, 26]


def test_cli_params_check(tmp_path, capsys):
    good = tmp_path / "good.yaml"
    good.write_text(yaml.safe_dump({"vocab": {"size": 100}}))
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump({"vocab": {"size": 0}, "train": {"lr": "fast"}}))
    assert cli(["params", "check", str(good)]) == 0
    assert "size: 100" in capsys.readouterr().out
    assert cli(["params", "check", str(bad)]) == 2
    err = capsys.readouterr().err
    assert "vocab.size" in err and "train.lr" in err
