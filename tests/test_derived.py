"""dvc.yaml and params.yaml are derived: from the stage declarations (eagle3/core/pipeline.py) and
each stage's import closure, and from the params schema (eagle3/core/params.py). One test says
they are current; the others show that the derivation follows the code and refuses what is wrong,
each in one line."""

from __future__ import annotations

import dataclasses
import shutil
from pathlib import Path

import pytest
from pydantic import Field

from eagle3.cli.command import main as cli
from eagle3.core.params import Params, Section, VocabParams
from eagle3.core.pipeline import STAGE_BY_NAME, STAGES, Output
from eagle3.derived import dvc_yaml, params_yaml
from eagle3.derived.files import check, rendered, stale
from eagle3.derived.imports import closure

REPO = Path(__file__).resolve().parents[1]


def test_derived_files_are_current():
    found = check()
    assert not found, "\n".join(found)


@pytest.fixture(scope="module")
def derived() -> dict[str, str]:
    return rendered()


def hand_edited(tmp_path: Path, name: str, old: str, new: str) -> Path:
    """A copy of the derived files with one line of `name` edited by hand."""
    for file in ("dvc.yaml", "params.yaml"):
        shutil.copy(REPO / file, tmp_path / file)
    text = (tmp_path / name).read_text()
    assert old in text
    (tmp_path / name).write_text(text.replace(old, new, 1))
    return tmp_path


def test_a_hand_edit_of_dvc_yaml_fails_in_one_line_naming_the_command(tmp_path, derived):
    root = hand_edited(tmp_path, "dvc.yaml", "      - eagle3/vocab.py\n", "")  # dtypes' first
    [line] = stale(derived, root)
    assert line.startswith("dvc.yaml is not what eagle3/core/pipeline.py") and "\n" not in line
    # the first line that differs: where the removed dep was
    assert (
        "(has '    params:  # what a decision depends on" in line
        and "derived '      - eagle3/vocab.py'" in line
    )
    assert line.endswith(
        "run `eagle3 pipeline write` (a hand edit there is lost: make it in eagle3/core/pipeline.py)"
    )


def test_a_hand_edit_of_a_params_comment_fails_too(tmp_path, derived):
    root = hand_edited(tmp_path, "params.yaml", "# torch threads on CPU", "# threads")
    [line] = stale(derived, root)
    assert line.startswith("params.yaml is not what eagle3/core/params.py") and "from line 9 " in line
    assert "make it in eagle3/core/params.py" in line


@pytest.mark.slow
def test_the_command_writes_and_checks(tmp_path, capsys):
    assert cli(["pipeline", "check"]) == 0
    assert capsys.readouterr().out == "dvc.yaml, params.yaml are current\n"
    assert cli(["pipeline", "write"]) == 0  # nothing to write: byte-identical
    assert capsys.readouterr().out == "dvc.yaml, params.yaml were current\n"


@pytest.mark.slow
def test_a_new_import_becomes_a_dep(tmp_path, derived):
    """The deps follow the code: vocab-map starting to import eagle3/decoding/stats.py lists it
    (a package it imports whole would be one entry), and the committed dvc.yaml is stale."""
    for folder in ("eagle3", "stages"):
        shutil.copytree(REPO / folder, tmp_path / folder, ignore=shutil.ignore_patterns("__pycache__"))
    stage = tmp_path / "stages/vocab_map.py"
    stage.write_text(stage.read_text() + "\nfrom eagle3.decoding import stats  # noqa\n")
    before = dvc_yaml.code_deps(STAGE_BY_NAME["vocab-map"])
    after = dvc_yaml.code_deps(STAGE_BY_NAME["vocab-map"], tmp_path)
    assert sorted(set(after) - set(before)) == ["eagle3/decoding/stats.py"]
    assert "eagle3/data/store.py" in after and "eagle3/data" not in after  # a part of eagle3/data
    assert "eagle3/data" in dvc_yaml.code_deps(STAGE_BY_NAME["extract"])  # all of it: one entry
    assert "eagle3/core/pipeline.py" not in after  # imported, but a declaration (NOT_DEPS)
    assert dvc_yaml.render(tmp_path) != derived["dvc.yaml"]


def test_an_import_for_type_checkers_only_is_no_dep(tmp_path):
    """An import under `if TYPE_CHECKING:` never runs, so it re-runs nothing; its else branch runs."""
    for folder in ("eagle3", "stages"):
        shutil.copytree(REPO / folder, tmp_path / folder, ignore=shutil.ignore_patterns("__pycache__"))
    stage = tmp_path / "stages/vocab_map.py"
    typed = [
        "from typing import TYPE_CHECKING",
        "if TYPE_CHECKING:",
        "    from eagle3.decoding import stats",
        "else:",
        "    from eagle3.decoding import kv",
    ]
    stage.write_text(stage.read_text() + "\n" + "\n".join(typed) + "\n")
    after = dvc_yaml.code_deps(STAGE_BY_NAME["vocab-map"], tmp_path)
    assert "eagle3/decoding/kv.py" in after and "eagle3/decoding/stats.py" not in after


def test_a_backend_role_brings_its_modules_and_no_others():
    """patch-check calls only the patch_check role: the backends' patch-check modules are its
    deps, their extraction, online and evaluation modules are not (nor what the roles'
    Protocols name for type checkers only)."""
    deps = closure("stages.patch_check")
    assert {"eagle3/target/patch_check.py", "eagle3/sglang/patch_check.py"} <= deps
    assert not deps & {"eagle3/sglang/online.py", "eagle3/sglang/evaluate.py", "eagle3/decoding/hf_eval.py"}
    assert not deps & {"eagle3/train/online.py", "eagle3/decoding/evaluate.py", "eagle3/decoding/prompts.py"}
    assert {"eagle3/sglang/online.py", "eagle3/train/online.py"} <= closure("stages.train")


def declared(name: str, **changes) -> tuple:
    """The declared stages with stage `name` changed."""
    return tuple(dataclasses.replace(s, **changes) if s.name == name else s for s in STAGES)


@pytest.mark.parametrize(
    ("name", "changes", "expected"),
    [
        (
            "vocab-map",
            {"params": ("train.init",)},
            "vocab-map: stages/vocab_map.py reads params.vocab.size, which its params in "
            "eagle3/core/pipeline.py do not list",
        ),
        (
            "train",
            {"params": ("train", "target", "vocab.sise")},
            "train: params key vocab.sise is not in eagle3/core/params.py (close: vocab.size",
        ),
        (
            "vocab-map",
            {"outs": (Output(Path("artifacts/vocab-map"), persist=False),)},
            "vocab-map: output artifacts/vocab-map is not persisted",
        ),
        (
            "extract",
            {"reads": (Path("artifacts/vocab-map"),)},
            "extract: reads artifacts/vocab-map, which no earlier stage writes",
        ),
        (
            "patch-check",
            {"whole": ("eagle3/train",)},
            "patch-check: lists eagle3/train whole, but imports nothing of it",
        ),
    ],
)
def test_a_wrong_declaration_is_refused_in_one_line(name, changes, expected):
    found = dvc_yaml.problems(stages=declared(name, **changes))
    assert any(line.startswith(expected) for line in found), found
    assert all("\n" not in line for line in found)


def test_every_param_needs_a_one_line_description_and_no_list_ends_a_section():
    class Grid(Section):
        size: int = Field(default=1, description="a size")
        sizes: list[int] = Field(default_factory=lambda: [1, 2], description="the sizes")

    class Extended(Params):
        grid: Grid = Field(default=Grid())
        more: VocabParams = Field(default=VocabParams(), description="one more section")

    assert params_yaml.problems(Extended) == [
        "grid: no description: add Field(description=...) in eagle3/core/params.py",
        "grid.sizes: a list ends the section, and `dvc exp run -S` drops the blank line after a list it "
        "replaces: move another key below it in eagle3/core/params.py",
    ]


def test_the_dtypes_stage_lists_the_eval_shape_its_decode_decision_is_measured_at():
    """`auto` for decoding is decided at the eval's draft shape (eagle3/dtypes/decisions.py): a
    dtypes stage without eval.tree_budget would keep a decision measured at another verify count."""
    from dataclasses import replace

    from eagle3.core.pipeline import STAGE_BY_NAME
    from eagle3.derived.reads import unlisted_reads

    stage = STAGE_BY_NAME["dtypes"]
    assert unlisted_reads(stage) == []
    without = replace(stage, params=tuple(p for p in stage.params if p != "eval.tree_budget"))
    assert unlisted_reads(without) == [
        "dtypes: eagle3/dtypes/decisions.py reads params.eval.tree_budget, which its params in "
        "eagle3/core/pipeline.py do not list"
    ]
