"""The `eagle3` command: params validation and a look at what the pipeline produced."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from rich.console import Console
from rich.markup import escape
from rich.syntax import Syntax

from eagle3.core.params import ParamsError, flatten, load_params, parse_params
from eagle3.core.stageio import write_json


def params_check(path: str) -> int:
    import yaml

    console = Console()
    try:
        params = load_params(path)
    except ParamsError as err:
        Console(stderr=True).print(
            f"[bold red]error:[/] {escape(err.one_line())}", highlight=False, soft_wrap=True
        )
        return 2
    console.print(f"[green]{path} is valid[/]; resolved params:")
    console.print(Syntax(yaml.safe_dump(params.model_dump(), sort_keys=False), "yaml"))
    from eagle3.dtype_decisions import resolve, table  # loads torch

    console.print(table(resolve(params, measure=False)))  # never measures: `eagle3 dtypes` does
    return 0


def dtypes_command(args: argparse.Namespace) -> int:
    """Resolve (measuring where needed) and print the dtypes the pipeline would use here."""
    from eagle3.core.device import machine  # loads torch
    from eagle3.dtype_decisions import forget, resolve, table

    try:
        params = load_params(args.params)
    except ParamsError as err:
        Console(stderr=True).print(f"[bold red]error:[/] {err}", highlight=False)
        return 2
    if args.remeasure:
        forget(params)
    Console().print(table(resolve(params)))
    Console().print(f"on {machine()}; `dvc repro` records these in artifacts/dtypes/")
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
    write_json(out / "metrics.json", metrics)
    return out


def serve_command(args: argparse.Namespace) -> int:
    from eagle3.cli.serve import serve_commands

    try:
        commands = serve_commands(load_params(args.params), args.drafter, args.tp, args.port)
    except (ParamsError, FileNotFoundError, ValueError) as err:
        Console(stderr=True).print(f"[bold red]error:[/] {err}", highlight=False, soft_wrap=True)
        return 2
    print(f"# SGLang\n{commands['sglang']}\n# vLLM\n{commands['vllm']}")
    for note in filter(None, commands["notes"].split("\n")):
        print(f"# note: {note}")
    return 0


def experiments_command(args: argparse.Namespace) -> int:
    """`eagle3 compare` and `eagle3 report`: read the experiments, print the table (and write the report)."""
    from eagle3.cli.compare import print_comparison
    from eagle3.cli.experiments import ExperimentsError, load_experiments, select
    from eagle3.cli.queue_workers import leftover_worker_warning
    from eagle3.core.inputs import InputError

    if warning := leftover_worker_warning():
        Console(stderr=True).print(f"[yellow]warning:[/] {warning}", highlight=False, soft_wrap=True)
    plan_target = paired = None
    try:
        if args.command == "report":  # read first: a bad file fails before `dvc exp show` runs
            from eagle3.cli.report import Paired, PlanTarget

            plan_target = PlanTarget.read(args.plan_target) if args.plan_target else None
            paired = Paired.read(args.paired) if args.paired else None
        rows, where = load_experiments(args.source, args.json, args.all_commits, args.params)
        rows = select(rows, args.names, where)
    except (ExperimentsError, ParamsError, InputError) as err:
        Console(stderr=True).print(f"[bold red]error:[/] {err}", highlight=False, soft_wrap=True)
        return 2
    console = Console()
    print_comparison(rows, console)
    if args.command == "report":
        from eagle3.cli.report import write_report

        verdict, files = write_report(rows, args.out, plan_target, paired)
        console.print(f"\n{verdict.paragraph}\n", highlight=False)
        console.print(f"report: {files[0]} and {files[1]} (plots: {len(files) - 2} PNGs in {args.out})")
    return 0


def ui(args: argparse.Namespace) -> int:
    """Run the MLflow UI in the foreground on the repo's tracking store."""
    import os
    import subprocess

    from eagle3.cli.ui import UI_ENV, ui_command

    try:
        cmd = ui_command(load_params(args.params), args.port, args.host)
    except ParamsError as err:
        Console(stderr=True).print(f"[bold red]error:[/] {err}", highlight=False)
        return 2
    Console(stderr=True).print(f"MLflow UI on http://{args.host}:{args.port} ({cmd[5]})", highlight=False)
    try:
        return subprocess.run(cmd, env=os.environ | UI_ENV).returncode
    except KeyboardInterrupt:
        return 0


def plan_command(args: argparse.Namespace) -> int:
    """`eagle3 plan`: the cost of a run from params (+ -S overrides) and a target config.json."""
    import yaml

    from eagle3.cli.plan import plan, print_plan, read_target_config
    from eagle3.core.inputs import InputError

    try:
        raw = (yaml.safe_load(Path(args.params).read_text()) if Path(args.params).exists() else None) or {}
        for item in args.set_param:
            key, sep, value = item.partition("=")
            section, dot, name = key.partition(".")
            if not (sep and dot and name):
                raise ParamsError("-S", [f"{item}: expected section.key=value (e.g. vocab.size=32000)"])
            raw.setdefault(section, {})[name] = yaml.safe_load(value)
        params = parse_params(raw, f"{args.params} + -S" if args.set_param else args.params)
        target = read_target_config(args.target or params.target.source)
        throughput = {"server_tokens_per_s": args.server_tokens_per_s} if args.server_tokens_per_s else {}
        result = plan(params, target, args.tokens, args.world, **throughput)
    except (ParamsError, InputError, ValueError) as err:
        Console(stderr=True).print(f"[bold red]error:[/] {err}", highlight=False, soft_wrap=True)
        return 2
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print_plan(result, Console())
    return 0


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
    serve_cmd = commands.add_parser(
        "serve-command", help="print the SGLang and vLLM commands that serve the target with the drafter"
    )
    serve_cmd.add_argument("--params", default="params.yaml")
    serve_cmd.add_argument(
        "--drafter", default=None, help="default: eval.drafter, else artifacts/train/drafter"
    )
    serve_cmd.add_argument("--tp", type=int, default=1, help="tensor-parallel GPUs (8 for Kimi-K2.5)")
    serve_cmd.add_argument("--port", type=int, default=30000)
    for name, help_text in (
        ("compare", "compare experiments: vocab size, coverage, acceptance, draft cost, speed, machine"),
        ("report", "the comparison table plus a report (markdown, HTML, PNG plots) that picks the best size"),
    ):
        exp_cmd = commands.add_parser(name, help=help_text)
        exp_cmd.add_argument("names", nargs="*", help="experiments to show (default: all with metrics)")
        exp_cmd.add_argument("--source", choices=("dvc", "mlflow"), default="dvc", help="where to read")
        exp_cmd.add_argument("--json", help="a saved `dvc exp show --json` output instead of running it")
        exp_cmd.add_argument("--all-commits", action="store_true", help="experiments of every commit (dvc)")
        exp_cmd.add_argument("--params", default="params.yaml", help="names the MLflow store and experiment")
        if name == "report":
            exp_cmd.add_argument("--out", default="report", help="folder for report.md, report.html, PNGs")
            exp_cmd.add_argument(
                "--plan-target",
                metavar="TARGET",
                help="also each size's planned cost on this target (as `eagle3 plan --target`: config.json, "
                "HF folder or packaged name), and its ratio to the 32,768 row's",
            )
            exp_cmd.add_argument(
                "--paired",
                metavar="FILE",
                help="`python -m bench.drafters ... --json FILE`: a paired-speedup column, and ties by the "
                "paired intervals",
            )
    plan_cmd = commands.add_parser(
        "plan", help="what a run will cost: drafter params, store bytes, training memory and steps, FLOPs"
    )
    plan_cmd.add_argument("--params", default="params.yaml")
    plan_cmd.add_argument(
        "-S", "--set-param", action="append", default=[], metavar="K=V", help="override a param, as dvc"
    )
    plan_cmd.add_argument("--target", help="packaged name, HF folder or config.json (default: target.source)")
    plan_cmd.add_argument("--tokens", type=int, help="tokens stored (default: data.num_samples x max_length)")
    plan_cmd.add_argument("--world", type=int, help="training devices (default: train.num_processes)")
    plan_cmd.add_argument(
        "--server-tokens-per-s",
        type=float,
        help="tokens/s one target server computes features for, for the server-hours of the "
        "features (default 10,000: an assumption, measure yours)",
    )
    plan_cmd.add_argument("--json", action="store_true", help="the plan as JSON, for scripts")
    dtypes_cmd = commands.add_parser(
        "dtypes", help="the dtype each job runs in here (auto: measured, kept per machine) and why"
    )
    dtypes_cmd.add_argument("--params", default="params.yaml")
    dtypes_cmd.add_argument("--remeasure", action="store_true", help="forget this machine's kept measurement")
    ui_cmd = commands.add_parser("ui", help="the MLflow UI on this repo's tracking store (localhost)")
    ui_cmd.add_argument("--port", type=int, default=5000)
    ui_cmd.add_argument("--host", default="127.0.0.1")
    ui_cmd.add_argument("--params", default="params.yaml")
    args = parser.parse_args(argv)
    if args.command == "serve-command":
        return serve_command(args)
    if args.command in ("compare", "report"):
        return experiments_command(args)
    if args.command == "ui":
        return ui(args)
    if args.command == "dtypes":
        return dtypes_command(args)
    if args.command == "plan":
        return plan_command(args)
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
