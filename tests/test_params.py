"""Params validation: every problem named with its key path, value and what is allowed."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import yaml

from eagle3.cli.command import main as cli
from eagle3.core.params import (
    Params,
    ParamsError,
    check_against_target,
    default_aux_layers,
    parse_params,
    resolve_aux_layers,
    tracking_schemes,
)

REPO = Path(__file__).resolve().parents[1]
CORES = os.cpu_count()
# Two params that once slipped through: threads torch died on (a bare MemoryError after the
# stage had started), and a URI scheme MLflow has no store for (every stage ran, none recorded).
MACHINE_AND_SCHEME = {
    "threads above the cores": (
        {"target": {"threads": 100000}},
        f"target.threads: more than the {CORES} cores of this machine (allowed: 1..{CORES}, or null) "
        "(got 100000)",
    ),
    "a scheme MLflow cannot track to": (
        {"tracking": {"uri": "ftp://x"}},
        "tracking.uri: MLflow has no tracking store for scheme 'ftp' (allowed: a path, file:, sqlite:, "
        "postgresql:, mysql:, mssql:, http:, https:, databricks:) (got 'ftp://x')",
    ),
}


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        ({"vocab": {"size": 0}}, "vocab.size: Input should be greater than or equal to 1 (got 0)"),
        ({"vocab": {"sise": 10}}, "vocab.sise: unknown key (allowed: coverage_grid, size)"),
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


@pytest.mark.parametrize("case", MACHINE_AND_SCHEME)
def test_machine_and_scheme_errors_stop_a_stage_in_one_line_before_any_work(
    case, tmp_path, monkeypatch, capsys
):
    raw, expected = MACHINE_AND_SCHEME[case]
    monkeypatch.syspath_prepend(str(REPO))  # stages/ is no installed package, as `python -m stages.x`
    import stages.patch_check

    monkeypatch.chdir(tmp_path)
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(raw))
    with pytest.raises(SystemExit) as stop:
        stages.patch_check.main()  # the first stage; threads: 100000 once died in it
    err = capsys.readouterr().err
    assert stop.value.code == 2 and err == f"error: invalid params in params.yaml: {expected}\n"
    assert [p.name for p in tmp_path.iterdir()] == ["params.yaml"]  # nothing written
    assert cli(["params", "check", str(tmp_path / "params.yaml")]) == 2
    assert expected in capsys.readouterr().err


def test_threads_up_to_the_cores_and_every_mlflow_scheme_pass():
    assert parse_params({"target": {"threads": CORES}}).target.threads == CORES
    for uri in (
        "mlruns",
        "/abs/mlruns",
        "file:///abs/mlruns",
        "sqlite:///mlflow.db",
        "postgresql+psycopg2://u@db/mlflow",
        "mysql://u@db/mlflow",
        "mssql+pyodbc://u@db/mlflow",
        "http://127.0.0.1:5000",
        "https://mlflow.example.com",
        "databricks",
        "databricks://profile",
    ):
        assert parse_params({"tracking": {"uri": uri}}).tracking.uri == uri


@pytest.mark.slow
def test_tracking_schemes_are_the_installed_mlflows():
    """The schemes params accept are those MLflow's tracking-store registry holds (less Unity
    Catalog's, registered only to refuse tracking), so an MLflow upgrade cannot silently differ."""
    from mlflow.tracking._tracking_service.utils import _tracking_store_registry

    registered = set(_tracking_store_registry._registry) - {"", "databricks-uc", "uc"}
    assert registered == set(tracking_schemes())


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


def test_a_top_n_larger_than_the_targets_vocabulary_is_refused_before_any_work():
    """check_against_target reads the target's vocabulary size (the dtypes stage calls it before it
    measures): a train.target_topk above it could never be taken; vocab.size above it is the whole
    vocabulary, no error."""
    params = parse_params({"train": {"target_topk": 50000}, "vocab": {"size": 60000}})
    with pytest.raises(ParamsError) as err:
        check_against_target(params, num_layers=30, vocab_size=49152)
    assert err.value.problems == [
        "train.target_topk: more than the target's vocabulary of 49152 tokens (allowed: 1..49152, or null) "
        "(got 50000)"
    ]
    assert check_against_target(params, num_layers=30, vocab_size=50000) == [1, 14, 26]


def test_params_explain_prints_a_keys_meaning(capsys):
    assert cli(["params", "explain", "train.ttt_length"]) == 0
    assert capsys.readouterr().out.splitlines() == [
        "train.ttt_length: = eval.k: drafts beyond the unroll length are never trained",
        "  allowed: int (>= 1, <= 32); default: 1",
        "  re-runs: train, speculative-eval",
    ]
    # a family key is listed by vocab-map alone, which records it for train (eagle3/drafter/family.py)
    assert cli(["params", "explain", "dflash.loss_decay"]) == 0
    assert capsys.readouterr().out.splitlines()[-1] == (
        "  re-runs: vocab-map; then, where their outputs change, train, speculative-eval"
    )
    assert cli(["params", "explain", "online.recheck_every"]) == 0
    assert capsys.readouterr().out.splitlines()[-1] == (
        "  re-runs nothing (no stage lists it); changes no byte: how often a sample is computed again to "
        "check the source"
    )
    assert cli(["params", "explain", "eval"]) == 0  # a section: its meaning and its keys'
    out = capsys.readouterr().out.splitlines()
    assert (
        out[0].startswith("eval: ")
        and "  k: draft tokens per step (tree: depth); past train.ttt_length: a warning, untrained_steps"
        in out
    )


def test_params_explain_of_an_unknown_key_is_one_line_with_close_matches(capsys):
    assert cli(["params", "explain", "train.ttt_lenght"]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err == (
        "error: params has no key 'train.ttt_lenght' "
        "(close: train.ttt_length, train.ttt_decay, train.seq_len)\n"
    )
