"""dvc.yaml's params follow the code: each stage lists every params key its code reads, since
params are what DVC re-runs a stage on. A stage that reads a key it does not list keeps its old
outputs when that key changes; the check fails by stage and key.

A read is `params.<section>.<key>` (or `pinned_params.`, the stage's dtype-pinned copy) in any
module of the stage's import closure (tests/test_stage_deps.py), or a whole section
(`params.<section>` passed on). ALLOWED lists the reads that are deliberate, with the reason."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import yaml
from test_stage_deps import REPO, _stages, closure

from eagle3.core.params import TRANSPORT_KEYS, Params

PARAMS_NAMES = {"params", "pinned_params"}
SECTIONS = {name: set(field.annotation.model_fields) for name, field in Params.model_fields.items()}

# (stage or "*", key, section or "*", module or "*") -> why the stage may read it unlisted. The
# transport keys (eagle3/core/params.py TRANSPORT_KEYS) are allowed everywhere: they change no byte.
ALLOWED: dict[tuple[str, str, str], str] = {
    ("*", key, "*"): reason for key, reason in TRANSPORT_KEYS.items()
} | {
    ("*", "tracking", "eagle3/core/tracking.py"): "where MLflow logs; every output is written before it",
    ("dtypes", "train", "eagle3/train/prepare.py"): (
        "dtype_shapes hands the train section to drafter_config, which reads its shape keys (listed) "
        "and fc_norm/norm_output, which no measured size depends on; the module's other reads are "
        "the train stage's"
    ),
    ("*", "extract.aux_layers", "eagle3/core/params.py"): (
        "check_against_target, in the module every stage imports for the schema; the stages that "
        "resolve aux layers with it list the key (an online sglang train refuses servers whose layers "
        "differ from the store's)"
    ),
    ("*", "extract", "eagle3/sglang/features.py"): (
        "the servers: their addresses (transport keys), and a target mode checked against the store's "
        "fingerprint before any request"
    ),
    ("patch-check", "extract", "eagle3/sglang/patch_check.py"): (
        "the servers to check: their addresses (transport keys) and the target-mode keys it lists"
    ),
    ("train", "data", "eagle3/data/extract.py"): (
        "the extraction loop's selection: train imports the module for capture_rows and never runs "
        "the loop (an online store holds the samples extract selected)"
    ),
    ("train", "extract", "eagle3/data/extract.py"): "the same module's loop: shards, store dtype, resume key",
}


def reads(path: Path) -> set[str]:
    """Each `section.key` (or whole `section`) of Params the module's code reads."""
    found = set()
    tree = ast.parse(path.read_text())
    keyed = set()
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Attribute)
            and isinstance(node.value.value, ast.Name)
            and node.value.value.id in PARAMS_NAMES
            and node.value.attr in SECTIONS
        ):
            if node.attr in SECTIONS[node.value.attr]:
                found.add(f"{node.value.attr}.{node.attr}")
                keyed.add(id(node.value))
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Name)
            and node.value.id in PARAMS_NAMES
            and node.attr in SECTIONS
            and id(node) not in keyed
        ):
            found.add(node.attr)  # the whole section, passed on or dumped
    return found


def _declared(stage: dict) -> set[str]:
    return {p if isinstance(p, str) else next(iter(p)) for p in stage.get("params", [])}


def _covered(read: str, declared: set[str]) -> bool:
    return read in declared or read.split(".")[0] in declared


def _allowed(stage: str, read: str, module: str) -> bool:
    return any(
        s in ("*", stage) and m in ("*", module) and (k in ("*", read) or read.startswith(k + "."))
        for s, k, m in ALLOWED
    )


def undeclared_reads(name: str, stage: dict) -> list[str]:
    module = stage["cmd"].split("-m", 1)[1].split()[0]
    declared = _declared(stage)
    problems = []
    for rel in sorted(closure(module)):
        for read in sorted(reads(REPO / rel)):
            if not _covered(read, declared) and not _allowed(name, read, rel):
                problems.append(f"{name}: {rel} reads params.{read}, which dvc.yaml does not list")
    return problems


@pytest.mark.parametrize("name", list(_stages()))
def test_a_stage_lists_every_param_it_reads(name):
    assert undeclared_reads(name, _stages()[name]) == []


def test_an_undeclared_read_is_caught():
    """The check itself: vocab-map without `vocab` fails naming the stage, module and key."""
    stage = yaml.safe_load((REPO / "dvc.yaml").read_text())["stages"]["vocab-map"]
    problems = undeclared_reads("vocab-map", stage | {"params": ["train.init"]})
    assert "vocab-map: stages/vocab_map.py reads params.vocab.size, which dvc.yaml does not list" in problems


def test_the_dtypes_stage_lists_the_eval_shape_its_decode_decision_is_measured_at():
    """`auto` for decoding is decided at the eval's draft shape (eagle3/dtypes/decisions.py): a
    dtypes stage without eval.tree_budget would keep a decision measured at another verify count."""
    stage = yaml.safe_load((REPO / "dvc.yaml").read_text())["stages"]["dtypes"]
    without = [p for p in stage["params"] if p != "eval.tree_budget"]
    problems = undeclared_reads("dtypes", stage | {"params": without})
    assert problems == [
        "dtypes: eagle3/dtypes/decisions.py reads params.eval.tree_budget, which dvc.yaml does not list"
    ]
