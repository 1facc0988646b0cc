"""dvc.yaml's code deps follow the code: each stage lists exactly the project modules its
command can import (the transitive closure of stages/<name>.py, lazy imports included), so
"what re-runs when I touch this file" is answered by the deps list and nothing else.

A dep entry is a file or a folder (covering every module under it). A module the stage imports
that no entry covers fails, naming the stage and the module; an entry that covers no module the
stage imports fails too. ALLOWED lists the few modules that cannot change any output."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import yaml

from eagle3.backends import BACKENDS, ROLES

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("eagle3", "stages")
# Imported by stages, but nothing they write depends on them.
ALLOWED = {
    "eagle3/core/tracking.py": "MLflow logging (metrics files are written before it runs)",
    "eagle3/__init__.py": "the package map and its LAYERS order, read only by tests/test_layers.py",
}


def _module_file(name: str) -> Path | None:
    """The project file of a dotted module name, or None for a name outside the project."""
    if name.split(".")[0] not in PACKAGES:
        return None
    base = REPO.joinpath(*name.split("."))
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.exists():
            return candidate
    return None


def _imports(path: Path) -> set[Path]:
    """Project files `path` imports anywhere in its body (function-level imports included)."""
    package = ".".join(path.relative_to(REPO).with_suffix("").parts[:-1])
    found: set[Path] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            parent = package.rsplit(".", node.level - 1)[0] if node.level else ""
            base = ".".join(p for p in (parent, node.module or "") if p)
            # `from pkg import name`: name is a submodule or an attribute of pkg
            names = [base] + [f"{base}.{alias.name}" for alias in node.names]
        else:
            continue
        for name in names:
            parts = name.split(".")
            for i in range(1, len(parts) + 1):  # importing a.b.c runs a/__init__ and a/b/__init__
                if file := _module_file(".".join(parts[:i])):
                    found.add(file)
    return found


def _backend_roles(path: Path) -> set[str]:
    """The roles `path` calls on a backend: `backend_for(...).<role>`, `backend_of(...).<role>`,
    or `<name>.<role>` where `<name> = backend_for(...)` (or backend_of)."""
    tree = ast.parse(path.read_text())

    def picks(node: ast.AST) -> bool:
        return isinstance(node, ast.Call) and getattr(node.func, "id", None) in {"backend_for", "backend_of"}

    names = {
        target.id
        for node in ast.walk(tree)
        if isinstance(node, ast.Assign) and picks(node.value)
        for target in node.targets
        if isinstance(target, ast.Name)
    }
    return {
        node.attr
        for node in ast.walk(tree)
        if isinstance(node, ast.Attribute)
        and node.attr in ROLES
        and (picks(node.value) or (isinstance(node.value, ast.Name) and node.value.id in names))
    }


def _role_modules(roles: set[str]) -> set[Path]:
    """Each backend's module for each of `roles` (eagle3/backends.py imports them by name when
    called, which no import statement shows)."""
    names = {b.roles[r].split(":")[0] for b in BACKENDS.values() for r in roles if r in b.roles}
    return {file for name in names if (file := _module_file(name))}


def closure(stage_module: str) -> set[str]:
    """Every project file the stage's command may import, as repo-relative paths: its imports,
    and the modules of the backend roles it calls."""
    todo, seen = [_module_file(stage_module)], set()
    while todo:
        path = todo.pop()
        if path in seen:
            continue
        seen.add(path)
        todo.extend((_imports(path) | _role_modules(_backend_roles(path))) - seen)
    return {p.relative_to(REPO).as_posix() for p in seen if not _trivial(p)}


def _trivial(path: Path) -> bool:
    """A package marker: an __init__.py with nothing but a docstring and imports of __future__."""
    if path.name != "__init__.py":
        return False
    body = ast.parse(path.read_text()).body
    return all(
        (isinstance(n, ast.Expr) and isinstance(n.value, ast.Constant))
        or (isinstance(n, ast.ImportFrom) and n.module == "__future__")
        for n in body
    )


def _stages() -> dict[str, dict]:
    return yaml.safe_load((REPO / "dvc.yaml").read_text())["stages"]


def _code_deps(stage: dict) -> list[str]:
    deps = [d if isinstance(d, str) else next(iter(d)) for d in stage.get("deps", [])]
    return [d for d in deps if d.split("/")[0] in PACKAGES]


def _covers(dep: str, module: str) -> bool:
    return module == dep or module.startswith(dep.rstrip("/") + "/")


def mismatches(name: str, stage: dict) -> list[str]:
    module = stage["cmd"].split("-m", 1)[1].split()[0]
    imported = closure(module) - set(ALLOWED)
    deps = _code_deps(stage)
    missing = [m for m in sorted(imported) if not any(_covers(d, m) for d in deps)]
    unused = [d for d in deps if not any(_covers(d, m) for m in imported)]
    return [f"{name}: imports {m}, which dvc.yaml does not list" for m in missing] + [
        f"{name}: lists {d}, which it never imports" for d in unused
    ]


@pytest.mark.parametrize("name", list(_stages()))
def test_stage_deps_are_its_import_closure(name):
    assert mismatches(name, _stages()[name]) == []


def test_a_backend_role_brings_its_modules_and_no_others():
    """patch-check calls only the patch_check role: the backends' patch-check modules are its
    deps, their extraction, online and evaluation modules are not."""
    deps = closure("stages.patch_check")
    assert {"eagle3/verifier/patch_check.py", "eagle3/sglang/patch_check.py"} <= deps
    assert not deps & {"eagle3/sglang/online.py", "eagle3/sglang/evaluate.py", "eagle3/decoding/hf_eval.py"}
    assert {"eagle3/sglang/online.py", "eagle3/train/online.py"} <= closure("stages.train")


def test_a_wrong_deps_list_is_caught():
    """The check itself fails both ways: a dep removed, a dep that is not imported added."""
    stage = dict(_stages()["vocab-map"])
    deps = [d for d in stage["deps"] if d != "eagle3/vocab.py"] + ["eagle3/decoding"]
    problems = mismatches("vocab-map", stage | {"deps": deps})
    assert "vocab-map: imports eagle3/vocab.py, which dvc.yaml does not list" in problems
    assert "vocab-map: lists eagle3/decoding, which it never imports" in problems
