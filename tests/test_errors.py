"""How a stage reports a failure (stages/common.py): an input error as one line and no traceback
(exit 2 for params and input files, 1 for the other deliberate refusals), anything else (a bug)
with its traceback and then the same kind of one line (exit 1); EAGLE3_TRACEBACK=1 adds the
traceback to input errors too."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from eagle3.core.inputs import InputError
from eagle3.core.params import ParamsError
from eagle3.decoding.prompts import load_prompts
from eagle3.sglang.client import SGLangError

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # stages/ is no installed package: import it as `python -m stages.x` does
from stages.common import TRACEBACK_ENV, reported_failures  # noqa: E402


def failed(stage: str, raise_it, capsys) -> tuple[int | str | None, str]:
    """(exit code, stderr) of `raise_it()` run inside reported_failures(stage)."""
    capsys.readouterr()
    with pytest.raises(SystemExit) as stop, reported_failures(stage):
        raise_it()
    return stop.value.code, capsys.readouterr().err


def raiser(err: BaseException):
    def raise_it():
        raise err

    return raise_it


@pytest.fixture(autouse=True)
def no_traceback_env(monkeypatch):
    monkeypatch.delenv(TRACEBACK_ENV, raising=False)


# --- input errors: one line, no traceback ------------------------------------------------------


@pytest.mark.parametrize(
    "err,code,message",
    [
        (InputError("data.source x.jsonl, line 2: not UTF-8"), 2, "data.source x.jsonl, line 2: not UTF-8"),
        (ParamsError("params", ["train.lr: must be > 0"]), 2, "invalid params: train.lr: must be > 0"),
        (
            FileNotFoundError("artifacts/train/drafter is missing: run the train stage first"),
            1,
            "run the train",
        ),
        (SGLangError("cannot reach http://x:30000: refused"), 1, "cannot reach http://x:30000"),
    ],
    ids=["InputError", "ParamsError", "FileNotFoundError", "project RuntimeError subclass"],
)
def test_input_errors_are_one_line(capsys, err, code, message):
    exit_code, stderr = failed("train", raiser(err), capsys)
    assert exit_code == code
    assert "Traceback" not in stderr and stderr.count("\n") == 1, stderr
    assert stderr.startswith("train failed: ") and message in stderr


def test_a_value_error_the_project_raises_is_one_line(capsys):
    code, stderr = failed("speculative-eval", lambda: load_prompts(None, 0), capsys)
    assert code == 1 and stderr == "speculative-eval failed: eval.domains.file must be >= 1 (got 0)\n"


# --- bugs: the traceback, then one line ----------------------------------------------------------


@pytest.mark.parametrize(
    "raise_it,name",
    [
        (raiser(RuntimeError("shape [61, 1728], expected [n, 576]")), "RuntimeError"),
        (raiser(AssertionError("tree selection dropped an ancestor")), "AssertionError"),
        (lambda: {}["missing_key"], "KeyError"),
        (lambda: len(3), "TypeError"),
        (lambda: int("not a number"), "ValueError"),  # raised inside Python, not by the project
    ],
    ids=["RuntimeError", "AssertionError", "KeyError", "TypeError", "ValueError outside the project"],
)
def test_bugs_print_their_traceback(capsys, raise_it, name):
    code, stderr = failed("train", raise_it, capsys)
    assert code == 1
    assert stderr.startswith("Traceback (most recent call last):"), stderr
    assert __file__ in stderr  # it points at the code that failed
    last = stderr.strip().splitlines()[-1]
    assert last.startswith(f"train failed: unexpected {name}: ") and last.endswith("(traceback above)")


def test_traceback_env_adds_the_traceback_to_input_errors(capsys, monkeypatch):
    monkeypatch.setenv(TRACEBACK_ENV, "1")
    code, stderr = failed("extract", raiser(InputError("data.source x.jsonl, line 2: not UTF-8")), capsys)
    assert code == 2 and stderr.startswith("Traceback (most recent call last):")
    assert stderr.strip().splitlines()[-1] == "extract failed: data.source x.jsonl, line 2: not UTF-8"
    monkeypatch.setenv(TRACEBACK_ENV, "0")
    code, stderr = failed("extract", raiser(InputError("bad")), capsys)
    assert code == 2 and stderr == "extract failed: bad\n"


# --- as DVC runs them: a real process -------------------------------------------------------------


def run(args: list[str], cwd: Path, **env: str) -> subprocess.CompletedProcess[str]:
    environ = {k: v for k, v in os.environ.items() if k != TRACEBACK_ENV}
    environ |= {"PYTHONPATH": str(REPO), "COLUMNS": "60", **env}  # narrow: one line must not wrap
    return subprocess.run([sys.executable, *args], cwd=cwd, env=environ, capture_output=True, text=True)


@pytest.mark.slow
def test_stage_process_with_a_bad_param_prints_one_line(tmp_path):
    params = {"eval": {"categories": ["math", "poetry"]}, "tracking": {"enabled": False}}
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(params))
    done = run(["-m", "stages.speculative_eval"], tmp_path)
    assert done.returncode != 0 and "Traceback" not in done.stderr, done.stderr
    (line,) = [x for x in done.stderr.splitlines() if x.strip()]
    assert line.startswith("speculative-eval failed: eval.categories: unknown ['poetry']"), line


INTERNAL = """
from stages.common import reported_failures
with reported_failures("train"):
    raise RuntimeError("the loss is {}".format(float("nan")))
"""


def test_process_with_an_internal_error_prints_the_traceback(tmp_path):
    (tmp_path / "internal.py").write_text(INTERNAL)
    done = run(["internal.py"], tmp_path)
    assert done.returncode == 1
    assert done.stderr.startswith("Traceback (most recent call last):"), done.stderr
    assert 'raise RuntimeError("the loss is' in done.stderr
    assert (
        done.stderr.splitlines()[-1]
        == "train failed: unexpected RuntimeError: the loss is nan (traceback above)"
    )


BAD_INPUT = """
from eagle3.core.inputs import InputError
from stages.common import reported_failures
with reported_failures("extract"):
    raise InputError("data.source x.jsonl, line 2: not UTF-8")
"""


def test_process_input_error_with_and_without_the_traceback_env(tmp_path):
    plain = run(["-c", BAD_INPUT], tmp_path)
    assert (
        plain.returncode == 2 and plain.stderr == "extract failed: data.source x.jsonl, line 2: not UTF-8\n"
    )
    full = run(["-c", BAD_INPUT], tmp_path, EAGLE3_TRACEBACK="1")
    assert full.returncode == 2 and full.stderr.startswith("Traceback (most recent call last):")
    assert "InputError: data.source x.jsonl" in full.stderr
    assert full.stderr.splitlines()[-1] == plain.stderr.strip()


def test_a_bare_assert_names_its_type(capsys):
    def bare():
        raise AssertionError

    code, stderr = failed("train", bare, capsys)
    assert (
        code == 1
        and stderr.strip().splitlines()[-1] == "train failed: unexpected AssertionError (traceback above)"
    )
