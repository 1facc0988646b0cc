"""Imports only run downwards: eagle3/__init__.py lists the package's entries foundations first
(LAYERS), and a module may import from its own entry or one listed before it, never from one
listed after it. Every import counts, function-level and TYPE_CHECKING ones included, since each
is a dependency of the importing layer on the imported one."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import eagle3

REPO = Path(__file__).resolve().parents[1]
PACKAGE = REPO / "eagle3"
LAYERS: tuple[str, ...] = eagle3.LAYERS


def _layer(path: Path) -> str | None:
    """The LAYERS entry a file of eagle3/ belongs to (None for eagle3/__init__.py itself)."""
    parts = path.relative_to(PACKAGE).with_suffix("").parts
    return None if parts == ("__init__",) else parts[0]


def _imported(path: Path, tree: ast.AST) -> list[tuple[int, str]]:
    """(line, dotted module) for every eagle3 module `tree` imports; `from eagle3 import x`
    yields eagle3.x, since x is then an entry of the map."""
    package = ".".join(path.relative_to(REPO).with_suffix("").parts[:-1])
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            parent = package.rsplit(".", node.level - 1)[0] if node.level else ""
            base = ".".join(p for p in (parent, node.module or "") if p)
            names = [f"{base}.{alias.name}" for alias in node.names] if base == "eagle3" else [base]
        else:
            continue
        found += [(node.lineno, name) for name in names if name.split(".")[0] == "eagle3"]
    return found


def upward_imports(path: Path, source: str | None = None) -> list[str]:
    """Each import in `path` (or in `source`, read as if it were that file) of an eagle3 entry
    listed after the file's own, or of one LAYERS does not list."""
    tree = ast.parse(path.read_text() if source is None else source)
    own = _layer(path)
    if own is None:
        return []
    rel = path.relative_to(REPO).as_posix()
    problems = []
    for line, name in _imported(path, tree):
        parts = name.split(".")
        if len(parts) < 2:
            continue  # `import eagle3`: the package marker, below everything
        target = parts[1]
        if target not in LAYERS:
            problems.append(f"{rel}:{line} imports {name}: {target} is not in eagle3.LAYERS")
        elif LAYERS.index(target) > LAYERS.index(own):
            problems.append(
                f"{rel}:{line} imports {name}: layer {own} (LAYERS[{LAYERS.index(own)}]) imports "
                f"the higher layer {target} (LAYERS[{LAYERS.index(target)}] in eagle3/__init__.py)"
            )
    return problems


def _modules() -> list[Path]:
    return sorted(PACKAGE.rglob("*.py"))


def test_every_entry_of_eagle3_has_a_layer():
    entries = {p.name.removesuffix(".py") for p in PACKAGE.iterdir() if p.suffix == ".py" or p.is_dir()}
    entries -= {"__init__", "__pycache__"}
    assert sorted(entries - set(LAYERS)) == [], "add the new entry to eagle3.LAYERS and the map"
    assert sorted(set(LAYERS) - entries) == [], "LAYERS lists an entry eagle3/ does not have"


def test_the_map_in_the_docstring_is_layers_order():
    """The docstring's folder list is the human-readable LAYERS: same entries, same order."""
    listed = re.findall(r"^    (\w+)(?:/|\.py) ", eagle3.__doc__, flags=re.MULTILINE)
    assert tuple(listed) == LAYERS


def test_imports_only_run_downwards():
    problems = [problem for path in _modules() for problem in upward_imports(path)]
    assert problems == []


def test_an_upward_import_is_caught():
    """The check itself: drafter/ importing sglang/ (the import this test was written after) fails,
    naming the file, the module and both layers; importing core/ from drafter/ passes."""
    path = PACKAGE / "drafter" / "config.py"
    up = "from eagle3.sglang.server_args import check_server_args\nimport eagle3.cli.report\n"
    assert upward_imports(path, up) == [
        "eagle3/drafter/config.py:1 imports eagle3.sglang.server_args: layer drafter (LAYERS[5]) imports "
        "the higher layer sglang (LAYERS[8] in eagle3/__init__.py)",
        "eagle3/drafter/config.py:2 imports eagle3.cli.report: layer drafter (LAYERS[5]) imports "
        "the higher layer cli (LAYERS[12] in eagle3/__init__.py)",
    ]
    lazy = "def f():\n    from eagle3 import decoding\n"
    assert upward_imports(path, lazy) == [
        "eagle3/drafter/config.py:2 imports eagle3.decoding: layer drafter (LAYERS[5]) imports "
        "the higher layer decoding (LAYERS[7] in eagle3/__init__.py)",
    ]
    relative = "from ..train import loop\n"
    assert (
        "layer drafter (LAYERS[5]) imports the higher layer train (LAYERS[6]"
        in upward_imports(path, relative)[0]
    )
    assert upward_imports(path, "from eagle3.core.layer_ids import serving_rule\nimport eagle3\n") == []
