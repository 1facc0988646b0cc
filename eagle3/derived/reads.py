"""The params keys a stage's code reads, held against the keys its declaration lists.

Params are what DVC re-runs a stage on: a stage that reads a key it does not list keeps its old
outputs when that key changes. A read is `params.<section>.<key>` (or `pinned_params.`, the
stage's dtype-pinned copy) in any module of the stage's import closure, or a whole section
(`params.<section>` passed on). eagle3/core/pipeline.py UNLISTED_READS names the reads that are
deliberate, with the reason; the transport keys (eagle3/core/params.py) change no byte.
"""

from __future__ import annotations

import ast
from pathlib import Path

from eagle3.core.params import TRANSPORT_KEYS, Params
from eagle3.core.pipeline import UNLISTED_READS, Stage
from eagle3.derived.imports import ROOT, closure, parsed

PARAMS_NAMES = {"params", "pinned_params"}
SECTIONS = {name: set(field.annotation.model_fields) for name, field in Params.model_fields.items()}
ALLOWED = {("*", key, "*"): reason for key, reason in TRANSPORT_KEYS.items()} | UNLISTED_READS


def reads(path: Path) -> set[str]:
    """Each `section.key` (or whole `section`) of Params the module's code reads."""
    found = set()
    tree = parsed(path)
    keyed = set()
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Attribute)
            and isinstance(node.value.value, ast.Name)
            and node.value.value.id in PARAMS_NAMES
            and node.value.attr in SECTIONS
            and node.attr in SECTIONS[node.value.attr]
        ):
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


def _covered(read: str, listed: set[str]) -> bool:
    return read in listed or read.split(".")[0] in listed


def _allowed(stage: str, read: str, module: str) -> bool:
    return any(
        s in ("*", stage) and m in ("*", module) and (k in ("*", read) or read.startswith(k + "."))
        for s, k, m in ALLOWED
    )


def unlisted_reads(stage: Stage, root: Path = ROOT) -> list[str]:
    """One line per key the stage's code reads and its declaration does not list."""
    listed = set(stage.param_keys)
    return [
        f"{stage.name}: {rel} reads params.{read}, which its params in eagle3/core/pipeline.py do not list"
        for rel in sorted(closure(stage.module, root))
        for read in sorted(reads(root / rel))
        if not _covered(read, listed) and not _allowed(stage.name, read, rel)
    ]
