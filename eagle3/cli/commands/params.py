"""`eagle3 params check [FILE]`: validate a params file and print the resolved values.
`eagle3 params explain KEY`: what a key (or a section) means, what it allows, its default and
which stages re-run when it changes, all read from the schema (eagle3/core/params.py) and the
stage declarations (eagle3/core/pipeline.py)."""

from __future__ import annotations

import argparse
import difflib
import types
import typing
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.syntax import Syntax

from eagle3.cli.subcommand import Subcommand, fail
from eagle3.core.params import TRANSPORT_KEYS, Params, ParamsError, load_params


def params_check(path: str) -> int:
    import yaml

    console = Console()
    try:
        params = load_params(path)
    except ParamsError as err:
        return fail(err.one_line(), markup=False)
    console.print(f"[green]{path} is valid[/]; resolved params:")
    console.print(Syntax(yaml.safe_dump(params.model_dump(), sort_keys=False), "yaml"))
    from eagle3.dtypes.decisions import resolve, table  # loads torch
    from eagle3.train.prepare import dtype_shapes

    # never measures: `eagle3 dtypes` does
    console.print(table(resolve(params, dtype_shapes(params), measure=False)))
    return 0


def _type(annotation: Any) -> str:
    """A field's type as params.yaml spells its values: `int or null`, `hf | sglang`."""
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is typing.Literal:
        return " | ".join(str(a) for a in args)
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_type(a) for a in args)
    if origin is list:
        return f"a list of {_type(args[0])}"
    return "null" if annotation is type(None) else annotation.__name__


def _bounds(field: Any) -> str:
    marks = {"ge": ">=", "gt": ">", "le": "<=", "lt": "<", "min_length": "at least"}
    found = [
        f"{mark} {getattr(m, name)}"
        for m in field.metadata
        for name, mark in marks.items()
        if hasattr(m, name)
    ]
    return f" ({', '.join(found)})" if found else ""


def _reruns(key: str) -> str:
    """The stages that list the key (or its section, or a key inside it): DVC re-runs them."""
    from eagle3.core.pipeline import STAGES

    listed = [
        s.name
        for s in STAGES
        if any(k in (key, key.split(".")[0]) or k.startswith(key + ".") for k in s.param_keys)
    ]
    text = f"re-runs: {', '.join(listed)}" if listed else "re-runs nothing (no stage lists it)"
    if after := [name for name in _downstream(listed) if name not in listed]:
        text += f"; then, where their outputs change, {', '.join(after)}"
    return text + (f"; changes no byte: {TRANSPORT_KEYS[key]}" if key in TRANSPORT_KEYS else "")


def _downstream(names: list[str]) -> list[str]:
    """`names` and every stage that reads, directly or not, what they write, in pipeline order.
    Not through an always-changed stage (dtypes): it runs every time, and its decisions follow
    the machine, rarely a key."""
    from eagle3.core.pipeline import STAGES

    reached, written = [], set()
    for stage in STAGES:  # declared in pipeline order: a stage reads only earlier stages' outputs
        read = {Path(getattr(r, "value", r)).as_posix() for r in stage.reads}
        if (stage.name in names and not stage.always_changed) or read & written:
            written |= set(stage.output_paths)
        if stage.name in names or read & written:
            reached.append(stage.name)
    return reached


def _yaml(value: Any) -> str:
    import yaml

    return yaml.safe_dump(value, default_flow_style=True, width=10**6).removesuffix("\n...\n").strip()


def explain(key: str) -> int:
    """Print what `key` means; an unknown key is one error line naming the close ones."""
    console = Console(highlight=False, soft_wrap=True)
    sections = Params.model_fields
    keys = [*sections, *(f"{s}.{k}" for s, f in sections.items() for k in f.annotation.model_fields)]
    if key not in keys:
        close = difflib.get_close_matches(key, keys, n=3, cutoff=0.6)
        hint = f"close: {', '.join(close)}" if close else f"sections: {', '.join(sections)}"
        return fail(f"params has no key {key!r} ({hint})", markup=False)
    section, _, name = key.partition(".")
    model = sections[section].annotation
    if not name:
        console.print(f"{section}: {sections[section].description}", markup=False)
        for child, field in model.model_fields.items():
            console.print(f"  {child}: {field.description}", markup=False)
        console.print(f"  {_reruns(key)}", markup=False)
        return 0
    field, default = model.model_fields[name], getattr(getattr(Params(), section), name)
    console.print(f"{key}: {field.description}", markup=False)
    console.print(
        f"  allowed: {_type(field.annotation)}{_bounds(field)}; default: {_yaml(default)}", markup=False
    )
    console.print(f"  {_reruns(key)}", markup=False)
    return 0


def _arguments(parser: argparse.ArgumentParser) -> None:
    actions = parser.add_subparsers(dest="action", required=True)
    check = actions.add_parser("check", help="validate a params file and print the resolved values")
    check.add_argument("file", nargs="?", default="params.yaml")
    about = actions.add_parser("explain", help="what a key (e.g. train.ttt_length) or a section means")
    about.add_argument("key")


def _run(args: argparse.Namespace) -> int:
    return params_check(args.file) if args.action == "check" else explain(args.key)


SUBCOMMAND = Subcommand("params", "params.yaml tools", _arguments, _run)
