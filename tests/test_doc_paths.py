"""Every repository path the docs and the code cite exists.

Cited paths are read from the markdown pages (README, CONTRIBUTING, docs/, tools/, tests/), from
the comments and string literals (docstrings included) of the Python files and from the comments
of the shell scripts and presets. A citation is a path under one of `ROOTS` that names a file (its
last part has an extension) or a folder (a trailing slash), backticked or plain; a project module
run as `python -m bench.trees` and a markdown link's target (resolved from its page) count too.
Left out: what the pipeline writes (artifacts/,
metrics/, plots/: not under `ROOTS`), placeholders (`stages/<name>.py`, `drafters/NAME/`, globs)
and, in the dated entries of docs/results/, the plain mentions: an entry is the record of the
commit it names, so the paths it mentions are that commit's (its links must still resolve).
"""

from __future__ import annotations

import io
import re
import subprocess
import tokenize
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
ROOTS = ("bench", "docs", "drafters", "eagle3", "presets", "stages", "tests", "tools")
CITED = re.compile(rf"(?<![\w./@:-])((?:{'|'.join(ROOTS)})/[\w./+-]*)")
# a character right after the path that makes it a pattern, not a path
PLACEHOLDER_NEXT = set("<{*$[")
# [text](target): the target up to a space or ")"; images alike
MD_LINK = re.compile(r"\]\(([^)\s]+)\)")
# code blocks and spans, whose `[text](target)` is an example, not a link
MD_CODE = re.compile(r"^```.*?^```|`[^`]*`", re.MULTILINE | re.DOTALL)
# paths cited as what a change would add, not as what exists
EXAMPLES = {"eagle3/dflash/"}  # CONTRIBUTING.md's worked example: a new drafter family's package
# `python -m bench.trees`: a module of the project, run by name
MODULE = re.compile(rf"\bpython3? -m ((?:{'|'.join(ROOTS)})(?:\.\w+)+)")
DATED_ENTRY = re.compile(r"^docs/results/\d{4}-\d{2}-\d{2}-\d{4}-[\w-]+\.md$")


def cited_paths(text: str) -> list[str]:
    """The repository paths `text` cites: files (an extension) or folders (a trailing slash)."""
    found = []
    for m in CITED.finditer(text):
        path = m.group(1).rstrip(".,;:-")
        after = text[m.end() : m.end() + 1]
        if after in PLACEHOLDER_NEXT or "..." in m.group(1):
            continue
        if path in EXAMPLES:
            continue
        last = path.rstrip("/").rsplit("/", 1)[-1]
        if any(len(stem := part.split(".")[0]) > 1 and stem.isupper() for part in path.split("/")):
            continue  # drafters/NAME/, DIR/...: a placeholder
        if path.endswith("/") or re.search(r"\.[A-Za-z0-9]+$", last):
            found.append(path)
    return found


def module_paths(text: str) -> list[str]:
    """The files of the project modules `text` runs as `python -m <module>`."""
    found = []
    for name in MODULE.findall(text):
        last = name.rsplit(".", 1)[1]
        if len(last) == 1 or last.isupper():
            continue  # `python -m stages.x`, `stages.NAME`: a placeholder
        base = name.replace(".", "/")
        found.append(f"{base}.py" if not (REPO / base).is_dir() else f"{base}/")
    return found


def python_citations(source: str) -> str:
    """The comments and string literals of a Python file, one per line."""
    parts = []
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type in (tokenize.COMMENT, tokenize.STRING):
            parts.append(tok.string)
        elif tok.type == getattr(tokenize, "FSTRING_MIDDLE", -1):
            parts.append(tok.string)
    return "\n".join(parts)


def comments(source: str) -> str:
    """The `#` comments of a shell script or YAML file (whole-line or trailing)."""
    return "\n".join(line.split("#", 1)[1] for line in source.splitlines() if "#" in line)


def tracked_files() -> list[str]:
    """The repository's files, new ones not yet added included (git-ignored ones left out)."""
    command = ["git", "ls-files", "--cached", "--others", "--exclude-standard"]
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, check=True)
    return [f for f in done.stdout.splitlines() if (REPO / f).is_file()]


def missing_citations(files: list[str], root: Path) -> list[str]:
    """'file: path' for every cited repository path or markdown link target that does not exist."""
    missing = []
    for name in files:
        path = root / name
        text = path.read_text(encoding="utf-8", errors="replace")
        cited: list[str] = []
        if name.endswith(".md"):
            for target in MD_LINK.findall(MD_CODE.sub("", text)):
                target = target.split("#", 1)[0]
                if target and not re.match(r"^[a-z]+:", target):
                    resolved = (path.parent / target).resolve()
                    if not resolved.exists():
                        missing.append(f"{name}: link {target}")
            if not DATED_ENTRY.match(name):
                cited = cited_paths(text) + module_paths(text)
        elif name.endswith(".py"):
            cited = cited_paths(python_citations(text)) + module_paths(python_citations(text))
        elif name.endswith((".sh", ".yaml", ".yml")):
            cited = cited_paths(comments(text)) + module_paths(comments(text))
        missing += [f"{name}: {c}" for c in dict.fromkeys(cited) if not (root / c).exists()]
    return missing


def scanned(files: list[str]) -> list[str]:
    """The files whose citations are checked: the markdown pages at the top and under ROOTS, the
    Python, shell and YAML files under ROOTS. Left out: the shipped drafters' params.yaml (a copy
    of the params that made them, as they were), params.yaml (written from eagle3/core/params.py)
    and dvc.yaml (its paths are checked by `eagle3 pipeline check`)."""
    keep = []
    for f in files:
        if f == "tests/test_doc_paths.py":
            continue  # its own examples
        top = f.split("/", 1)[0]
        if f.endswith(".md") and (top in ROOTS or "/" not in f):
            keep.append(f)
        elif top in ROOTS and top != "drafters" and f.endswith((".py", ".sh", ".yaml", ".yml")):
            keep.append(f)
    return keep


def test_a_cited_path_is_found_and_a_placeholder_is_not():
    text = (
        "see `eagle3/train/ttt.py` and docs/findings.md, docs/results/ too; "
        "`stages/<name>.py`, drafters/NAME/, presets/NAME.yaml, tests/test_*.py, presets/..., "
        "eagle3/core (a package), eagle3/dflash/ (an example), "
        "https://github.com/o/r/blob/main/eagle3/x.py, eagle3.core.params, `python -m bench.trees --x`, "
        "python -m stages.train, python -m pytest, python -m eagle3.derived, python -m stages.x"
    )
    assert cited_paths(text) == ["eagle3/train/ttt.py", "docs/findings.md", "docs/results/"]
    assert module_paths(text) == ["bench/trees.py", "stages/train.py", "eagle3/derived/"]


def test_a_missing_path_or_link_is_named(tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "here.md").write_text(
        "[ok](here.md) [gone](gone.md#a) [web](https://x.org/y.md) `[example](not-a-link.md)`\n"
        "```\n[example](nor-this.md)\n```\nsee `docs/here.md`, docs/none.md\n",
        encoding="utf-8",
    )
    (tmp_path / "eagle3").mkdir()
    (tmp_path / "eagle3" / "m.py").write_text(
        '"""Measured in docs/here.md."""\n\n'
        '# see docs/away.md, python -m bench.gone\nx = "docs/also-away.md"\n',
        encoding="utf-8",
    )
    (tmp_path / "presets").mkdir()
    (tmp_path / "presets" / "p.yaml").write_text("a: 1  # docs/old.md\nb: docs/value.md\n", encoding="utf-8")
    files = ["docs/here.md", "eagle3/m.py", "presets/p.yaml"]
    assert missing_citations(files, tmp_path) == [
        "docs/here.md: link gone.md",
        "docs/here.md: docs/none.md",
        "eagle3/m.py: docs/away.md",
        "eagle3/m.py: docs/also-away.md",
        "eagle3/m.py: bench/gone.py",
        "presets/p.yaml: docs/old.md",
    ]


def test_a_dated_entry_is_checked_for_its_links_only(tmp_path):
    (tmp_path / "docs" / "results").mkdir(parents=True)
    entry = "docs/results/2026-01-02-0304-a-topic.md"
    (tmp_path / entry).write_text("code then in `eagle3/device.py`; [index](README.md)\n", encoding="utf-8")
    assert missing_citations([entry], tmp_path) == [f"{entry}: link README.md"]


def test_every_cited_path_exists():
    files = scanned(tracked_files())
    assert any(f.startswith("docs/results/") for f in files), "the results folder is not scanned"
    missing = missing_citations(files, REPO)
    assert not missing, "cited paths that do not exist (fix the citation or the path):\n" + "\n".join(missing)
