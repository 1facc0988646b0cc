"""dvc.yaml, written from the stage declarations (eagle3/core/pipeline.py) and the code.

Each stage's deps are its code deps (the import closure, eagle3/derived/imports.py, less
eagle3/core/pipeline.py NOT_DEPS), then the other files and the earlier stages' outputs it
declares. A package is one dep entry when the stage imports all of it (or the declaration lists
it `whole`), so a new module there re-runs the stage; else each module it imports is one entry.
"""

from __future__ import annotations

import difflib
import textwrap
from pathlib import Path
from typing import Any

import yaml

from eagle3.core.params import Params
from eagle3.core.pipeline import HEADER, NOT_DEPS, SHOWN_METRICS, STAGES, Entry, Output, Stage
from eagle3.derived.imports import ROOT, closure, is_marker
from eagle3.derived.reads import unlisted_reads

WIDTH = 100  # comment lines wrap here
SHOWN_NOTE = (
    "The metrics DVC shows (eagle3/core/pipeline.py SHOWN_METRICS): acceptance and speedup per "
    "domain, then the params that differ; each stage's own metrics file is a plain output."
)
WRITTEN_BY = (
    "Written by `eagle3 pipeline write` from eagle3/core/pipeline.py (the stages) and the code's imports "
    "(each stage's code deps): edit those, not this file."
)


def _modules(root: Path, folder: Path) -> set[str]:
    """Every module under `folder` that can change behaviour (package markers left out)."""
    return {p.relative_to(root).as_posix() for p in (root / folder).rglob("*.py") if not is_marker(p)}


def code_deps(stage: Stage, root: Path = ROOT) -> list[str]:
    """The stage's code deps: stages/ first, then eagle3/, each in path order."""
    imported = closure(stage.module, root) - set(NOT_DEPS)
    # the packages below eagle3/ and stages/ (those two are never one entry)
    folders = {p for m in imported for p in Path(m).parents if len(p.parts) > 1}
    folders |= {Path(w) for w in stage.whole}
    whole = {f for f in folders if f.as_posix() in stage.whole or _modules(root, f) <= imported}
    outermost = {f for f in whole if not any(f != g and f.is_relative_to(g) for g in whole)}
    entries = {m for m in imported if not any(Path(m).is_relative_to(f) for f in outermost)}
    entries |= {f.as_posix() for f in outermost}
    return sorted(entries, key=lambda e: (not e.startswith("stages/"), e))


def _value(item: str | Path | Entry) -> str:
    return item.value if isinstance(item, Entry) else Path(item).as_posix()


def _param_problems(stage: Stage) -> list[str]:
    sections = {name: set(f.annotation.model_fields) for name, f in Params.model_fields.items()}
    known = set(sections) | {f"{s}.{k}" for s, keys in sections.items() for k in keys}
    return [
        f"{stage.name}: params key {key} is not in eagle3/core/params.py"
        + (f" (close: {', '.join(close)})" if (close := difflib.get_close_matches(key, known, 3)) else "")
        for key in stage.param_keys
        if key not in known
    ]


def _output_problems(stage: Stage, written: dict[str, str]) -> list[str]:
    found = []
    for out in stage.outputs:
        if not out.persist:
            found.append(
                f"{stage.name}: output {out.path} is not persisted (DVC would delete it before the stage "
                "runs, and a failed run would lose it): remove persist=False"
            )
        if (other := written.get(out.path.as_posix())) is not None:
            found.append(f"{stage.name}: output {out.path} is written by {other} too")
    for read in map(Path, map(_value, stage.reads)):
        if not any(read == Path(o) or read.is_relative_to(o) for o in written):
            found.append(f"{stage.name}: reads {read.as_posix()}, which no earlier stage writes")
    return found


def _deps_problems(stage: Stage, root: Path) -> list[str]:
    imported = closure(stage.module, root) - set(NOT_DEPS)
    return [
        f"{stage.name}: lists {file}, which does not exist"
        for file in map(_value, stage.files)
        if not (root / file).exists()
    ] + [
        f"{stage.name}: lists {folder} whole, but imports nothing of it: remove it from whole"
        for folder in stage.whole
        if not any(m.startswith(folder + "/") for m in imported)
    ]


def problems(root: Path = ROOT, stages: tuple[Stage, ...] = STAGES) -> list[str]:
    """One line per thing the declarations get wrong; dvc.yaml is written only without any."""
    names = [stage.name for stage in stages]
    found = [f"{n}: declared {names.count(n)} times" for n in sorted(set(names)) if names.count(n) > 1]
    written: dict[str, str] = {}  # output path -> the stage that writes it, of the stages before
    for stage in stages:
        found += _param_problems(stage) + _output_problems(stage, written) + _deps_problems(stage, root)
        found += unlisted_reads(stage, root)
        written |= {path: stage.name for path in stage.output_paths}
    return found


def _comment(text: str, indent: str) -> list[str]:
    return textwrap.wrap(
        text, WIDTH, initial_indent=indent + "# ", subsequent_indent=indent + "# ", break_on_hyphens=False
    )


def _scalar(value: Any) -> str:
    return yaml.safe_dump(value, width=10**6).removesuffix("\n...\n").strip()


def _items(key: str, items: list[str | Path | Entry], note: str = "", above: str = "") -> list[str]:
    lines = [f"    {key}:" + (f"  # {note}" if note else ""), *_comment(above, "      ")]
    for item in items:
        entry = item if isinstance(item, Entry) else Entry(_value(item))
        lines += _comment(entry.above, "      ")
        lines.append(f"      - {_scalar(entry.value)}" + (f"  # {entry.note}" if entry.note else ""))
    return lines


def _flags(out: Output) -> dict[str, Any]:
    """The settings dvc.yaml gives an output: those that differ from DVC's defaults."""
    flags = {"cache": out.cache, "persist": out.persist, "x": out.x, "y": out.y, "title": out.title}
    defaults = {"cache": True, "persist": False, "x": None, "y": None, "title": None}
    return {k: v for k, v in flags.items() if v != defaults[k]}


def _output(out: Output) -> list[str]:
    lines = _comment(out.above, "      ") + [f"      - {_scalar(out.path.as_posix())}:"]
    return lines + [f"          {k}: {_scalar(v)}" for k, v in _flags(out).items()]


def _stage(stage: Stage, root: Path) -> list[str]:
    lines = [f"  {stage.name}:", *_comment(stage.about, "    "), f"    cmd: {stage.cmd}"]
    if stage.always_changed:
        lines.append("    always_changed: true")
    deps = [*code_deps(stage, root), *stage.files, *stage.reads]
    lines += _items("deps", deps, above=stage.deps_above)
    lines += _items("params", list(stage.params), note=stage.params_note)
    for kind, outs in _groups(stage).items():
        if outs:
            lines += [f"    {kind}:", *(line for out in outs for line in _output(out))]
    return lines


def _groups(stage: Stage) -> dict[str, list[Output]]:
    """A stage's outputs as dvc.yaml lists them: metrics files among the outs (the top-level
    metrics list declares them, in SHOWN_METRICS' order), then the plots."""
    return {
        "outs": [out for out in stage.outputs if out.kind != "plots"],
        "plots": [out for out in stage.outputs if out.kind == "plots"],
    }


def _expected(stage: Stage, root: Path) -> dict[str, Any]:
    """The stage as DVC reads it: what the written text must load as."""
    entry: dict[str, Any] = {"cmd": stage.cmd} | ({"always_changed": True} if stage.always_changed else {})
    entry["deps"] = [*code_deps(stage, root), *map(_value, stage.files), *map(_value, stage.reads)]
    entry["params"] = list(stage.param_keys)
    for kind, outs in _groups(stage).items():
        if outs:
            entry[kind] = [{out.path.as_posix(): _flags(out)} for out in outs]
    return entry


def render(root: Path = ROOT, stages: tuple[Stage, ...] = STAGES) -> str:
    """dvc.yaml's text: the header, then each stage, a blank line between them."""
    lines = [*_comment(WRITTEN_BY, ""), *_comment(" ".join(HEADER.split()), ""), "stages:"]
    for i, stage in enumerate(stages):
        lines += ([""] if i else []) + _stage(stage, root)
    shown = [p.as_posix() for p in SHOWN_METRICS]
    lines += ["", *_comment(SHOWN_NOTE, ""), "metrics:", *(f"  - {path}" for path in shown)]
    text = "\n".join(lines) + "\n"
    # the comments are written by hand above; the data must load exactly as declared
    expected = {"stages": {stage.name: _expected(stage, root) for stage in stages}, "metrics": shown}
    if yaml.safe_load(text) != expected:
        raise AssertionError("the written dvc.yaml does not load as the declaration: a bug in the writer")
    return text
