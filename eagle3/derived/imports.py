"""The project modules a stage's command can import: its import closure, lazy imports included.

A stage re-runs when one of its deps changes, so its code deps are exactly the project files
`python -m stages.<name>` may import: every `import` in their bodies (function-level ones too),
the `__init__.py` of each package on the way, and the modules of the backend roles it calls
(eagle3/backends.py imports a role's module by name when it is called, which no import statement
shows). A package marker (an `__init__.py` with only a docstring) changes nothing and is left out,
and so is an import under `if TYPE_CHECKING:`, which never runs (tests/test_layers.py still holds
those to the layers).
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from functools import lru_cache
from pathlib import Path

import eagle3
from eagle3.backends import BACKENDS, ROLES

ROOT = Path(eagle3.__file__).resolve().parents[1]  # the repository: eagle3/ and stages/
PACKAGES = ("eagle3", "stages")


def module_file(name: str, root: Path = ROOT) -> Path | None:
    """The project file of a dotted module name, or None for a name outside the project."""
    if name.split(".")[0] not in PACKAGES:
        return None
    base = root.joinpath(*name.split("."))
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.exists():
            return candidate
    return None


def parsed(path: Path) -> ast.Module:
    """The module's syntax tree, parsed once per version of the file."""
    return _parsed(path, path.stat().st_mtime_ns)


@lru_cache(maxsize=4096)
def _parsed(path: Path, _version: int) -> ast.Module:
    return ast.parse(path.read_text())


def _type_checking_only(node: ast.AST) -> bool:
    """`if TYPE_CHECKING:` (or `typing.TYPE_CHECKING`): a block only type checkers read."""
    if not isinstance(node, ast.If):
        return False
    test = node.test
    return getattr(test, "id", None) == "TYPE_CHECKING" or getattr(test, "attr", None) == "TYPE_CHECKING"


def _run_time_nodes(tree: ast.AST) -> Iterator[ast.AST]:
    """Every node of `tree` but those of `if TYPE_CHECKING:` bodies (their else branches run)."""
    todo = [tree]
    while todo:
        node = todo.pop()
        yield node
        for child in ast.iter_child_nodes(node):
            todo.extend(child.orelse if _type_checking_only(child) else [child])


def imports(path: Path, root: Path = ROOT) -> set[Path]:
    """Project files `path` imports anywhere in its body (function-level imports included, those
    under `if TYPE_CHECKING:` not)."""
    package = ".".join(path.relative_to(root).with_suffix("").parts[:-1])
    found: set[Path] = set()
    for node in _run_time_nodes(parsed(path)):
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
                if file := module_file(".".join(parts[:i]), root):
                    found.add(file)
    return found


def backend_roles(path: Path) -> set[str]:
    """The roles `path` calls on a backend: `backend_for(...).<role>`, `backend_of(...).<role>`,
    or `<name>.<role>` where `<name> = backend_for(...)` (or backend_of)."""
    tree = parsed(path)

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


def role_modules(roles: set[str], root: Path = ROOT) -> set[Path]:
    """Each backend's module for each of `roles`."""
    names = {b.roles[r].split(":")[0] for b in BACKENDS.values() for r in roles if r in b.roles}
    return {file for name in names if (file := module_file(name, root))}


def is_marker(path: Path) -> bool:
    """A package marker: an __init__.py with nothing but a docstring and imports of __future__."""
    if path.name != "__init__.py":
        return False
    body = parsed(path).body
    return all(
        (isinstance(n, ast.Expr) and isinstance(n.value, ast.Constant))
        or (isinstance(n, ast.ImportFrom) and n.module == "__future__")
        for n in body
    )


@lru_cache(maxsize=4096)
def _direct(path: Path, _version: int, root: Path) -> frozenset[Path]:
    """What `path` imports itself, and the modules of the roles it calls (once per version)."""
    return frozenset(imports(path, root) | role_modules(backend_roles(path), root))


def closure(module: str, root: Path = ROOT) -> set[str]:
    """Every project file `python -m <module>` may import, as root-relative paths: its imports,
    and the modules of the backend roles it calls; package markers left out."""
    start = module_file(module, root)
    if start is None:
        raise ValueError(f"{module} is no module of the project (under {', '.join(PACKAGES)})")
    todo, seen = [start], set()
    while todo:
        path = todo.pop()
        if path in seen:
            continue
        seen.add(path)
        todo.extend(_direct(path, path.stat().st_mtime_ns, root) - seen)
    return {p.relative_to(root).as_posix() for p in seen if not is_marker(p)}
