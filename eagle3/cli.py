"""The `eagle3` command: params validation and a look at what the pipeline produced."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from rich.console import Console
from rich.syntax import Syntax

from eagle3.params import ParamsError, flatten, load_params, parse_params


def params_check(path: str) -> int:
    import yaml

    console = Console()
    try:
        params = load_params(path)
    except ParamsError as err:
        Console(stderr=True).print(f"[bold red]error:[/] {err}", highlight=False)
        return 2
    console.print(f"[green]{path} is valid[/]; resolved params:")
    console.print(Syntax(yaml.safe_dump(params.model_dump(), sort_keys=False), "yaml"))
    return 0


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


def ship(name: str, drafter: str = "artifacts/train/drafter", folder: str = "drafters") -> Path:
    """Copy a trained drafter with the params and metrics that produced it into drafters/<name>/,
    so it can be committed and evaluated later with `eval.drafter` (no retraining)."""
    import shutil

    src, out = Path(drafter), Path(folder) / name
    for needed in (src / "config.json", src / "model.safetensors", Path("params.yaml")):
        if not needed.exists():
            raise FileNotFoundError(f"{needed} is missing: train a drafter first (dvc repro)")
    out.mkdir(parents=True, exist_ok=True)
    for file in ("config.json", "model.safetensors"):
        shutil.copyfile(src / file, out / file)
    shutil.copyfile("params.yaml", out / "params.yaml")
    metrics = {
        stage: json.loads(path.read_text())
        for stage in ("extract", "vocab-map", "train", "speculative-eval")
        if (path := Path("metrics") / f"{stage}.json").exists()
    }
    (out / "metrics.json").write_text(json.dumps(metrics, indent=2, sort_keys=True) + "\n")
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="eagle3", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    params_cmd = commands.add_parser("params", help="params.yaml tools")
    params_sub = params_cmd.add_subparsers(dest="action", required=True)
    check = params_sub.add_parser("check", help="validate a params file and print the resolved values")
    check.add_argument("file", nargs="?", default="params.yaml")
    preset = commands.add_parser(
        "preset",
        help="print `dvc exp run` arguments for presets/NAME.yaml: dvc exp run $(eagle3 preset full)",
    )
    preset.add_argument("name")
    ship_cmd = commands.add_parser(
        "ship", help="copy the trained drafter, params.yaml and metrics into drafters/NAME/ (to commit)"
    )
    ship_cmd.add_argument("name")
    args = parser.parse_args(argv)
    if args.command == "ship":
        try:
            print(ship(args.name))
        except FileNotFoundError as err:
            Console(stderr=True).print(f"[bold red]error:[/] {err}", highlight=False)
            return 2
        return 0
    if args.command == "params" and args.action == "check":
        return params_check(args.file)
    if args.command == "preset":
        try:
            print(" ".join(preset_args(args.name)))
        except ParamsError as err:
            Console(stderr=True).print(f"[bold red]error:[/] {err}", highlight=False)
            return 2
        return 0
    parser.error("unknown command")
    return 2


if __name__ == "__main__":
    sys.exit(main())
