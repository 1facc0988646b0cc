"""`eagle3 preset NAME`: the `dvc exp run` arguments that apply presets/NAME.yaml."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from eagle3.cli.subcommand import Subcommand, fail
from eagle3.core.params import ParamsError, flatten, parse_params


def preset_args(name: str, base: str = "params.yaml", folder: str = "presets") -> list[str]:
    """`-S key=value` arguments for `dvc exp run` that apply presets/<name>.yaml on top of params.yaml;
    the merged params are validated first, so a bad preset fails before DVC starts anything."""
    import yaml

    path = Path(folder) / f"{name}.yaml"
    if not path.exists():
        known = sorted(p.stem for p in Path(folder).glob("*.yaml"))
        raise ParamsError(str(path), [f"preset '{name}' not found (allowed: {', '.join(known) or 'none'})"])
    overrides = yaml.safe_load(path.read_text()) or {}
    merged = yaml.safe_load(Path(base).read_text()) or {}
    for section, values in overrides.items():
        merged.setdefault(section, {}).update(values)
    parse_params(merged, f"{base} + {path}")
    # compact JSON (valid YAML, which DVC parses -S values as): no spaces to split in $(...)
    return [
        f"--set-param={key}={json.dumps(value, separators=(',', ':'))}"
        for key, value in flatten(overrides).items()
    ]


def _run(args: argparse.Namespace) -> int:
    try:
        print(" ".join(preset_args(args.name)))
    except ParamsError as err:
        return fail(err, soft_wrap=False)
    return 0


SUBCOMMAND = Subcommand(
    "preset",
    "print `dvc exp run` arguments for presets/NAME.yaml: dvc exp run $(eagle3 preset full)",
    lambda parser: parser.add_argument("name"),
    _run,
)
