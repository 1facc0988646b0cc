"""Write the derived files from their declarations, or say which is not current.

Both are checked as text: a hand edit of dvc.yaml or params.yaml (a dep added, a comment changed)
is found as surely as a declaration changed without the files being written again.
"""

from __future__ import annotations

from pathlib import Path

from eagle3.core.stageio import write_bytes
from eagle3.derived import dvc_yaml, params_yaml
from eagle3.derived.imports import ROOT

WRITE = "eagle3 pipeline write"
# Each derived file and what it is derived from: a change goes there, then `eagle3 pipeline write`.
SOURCES = {
    "dvc.yaml": "eagle3/core/pipeline.py (the stages; their code deps come from the imports)",
    "params.yaml": "eagle3/core/params.py (each param's default and description)",
}


class DeclarationError(ValueError):
    """The declarations cannot be written as they are; `problems` holds one line each."""

    def __init__(self, problems: list[str]):
        self.problems = problems
        super().__init__("; ".join(problems))


def problems(root: Path = ROOT) -> list[str]:
    """One line per thing the declarations get wrong (nothing is written while there is one)."""
    return dvc_yaml.problems(root) + params_yaml.problems()


def rendered(root: Path = ROOT) -> dict[str, str]:
    """Each derived file's text, as the declarations and the code give it."""
    return {"dvc.yaml": dvc_yaml.render(root), "params.yaml": params_yaml.render()}


def stale(texts: dict[str, str], root: Path = ROOT) -> list[str]:
    """One line per file under `root` whose text is not `texts[name]`, naming the first line
    that differs and the command that writes it."""
    found = []
    for name, text in texts.items():
        path = root / name
        have = path.read_text() if path.exists() else None
        if have == text:
            continue
        if have is None:
            found.append(f"{name} is missing: run `{WRITE}`")
            continue
        old, new = have.splitlines() + ["<end of file>"], text.splitlines() + ["<end of file>"]
        n = next(
            (i for i, (a, b) in enumerate(zip(old, new, strict=False)) if a != b), len(new) - 1
        )  # or its ending
        found.append(
            f"{name} is not what {SOURCES[name]} gives, from line {n + 1} (has {old[n]!r}, derived "
            f"{new[n]!r}): run `{WRITE}` (a hand edit there is lost: make it in {SOURCES[name].split()[0]})"
        )
    return found


def check(root: Path = ROOT) -> list[str]:
    """Everything that keeps the derived files from being current: the declarations' problems,
    else each stale file."""
    return problems(root) or stale(rendered(root), root)


def write(root: Path = ROOT) -> list[str]:
    """Write each derived file that is not current; returns their names."""
    if found := problems(root):
        raise DeclarationError(found)
    written = []
    for name, text in rendered(root).items():
        path = root / name
        if not path.exists() or path.read_text() != text:
            write_bytes(path, text.encode())
            written.append(name)
    return written
