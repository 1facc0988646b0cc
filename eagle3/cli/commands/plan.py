"""`eagle3 plan`: what a run will cost, from params (+ -S overrides) and a target's config.json
(eagle3/sweep/plan.py computes it, eagle3/cli/plan.py prints it)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from rich.console import Console

from eagle3.cli.subcommand import Subcommand, fail
from eagle3.core.params import Params, ParamsError, parse_params


def _arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--params", default="params.yaml")
    parser.add_argument(
        "-S", "--set-param", action="append", default=[], metavar="K=V", help="override a param, as dvc"
    )
    parser.add_argument("--target", help="packaged name, HF folder or config.json (default: target.source)")
    parser.add_argument("--tokens", type=int, help="tokens stored (default: data.num_samples x max_length)")
    parser.add_argument("--world", type=int, help="training devices (default: train.num_processes)")
    parser.add_argument(
        "--server-tokens-per-s",
        type=float,
        help="tokens/s one target server computes features for, for the server-hours of the "
        "features (default 10,000: an assumption, measure yours)",
    )
    parser.add_argument("--json", action="store_true", help="the plan as JSON, for scripts")


def _params(args: argparse.Namespace) -> Params:
    """params.yaml (if there) with the -S overrides, validated."""
    import yaml

    raw = (yaml.safe_load(Path(args.params).read_text()) if Path(args.params).exists() else None) or {}
    for item in args.set_param:
        key, sep, value = item.partition("=")
        section, dot, name = key.partition(".")
        if not (sep and dot and name):
            raise ParamsError("-S", [f"{item}: expected section.key=value (e.g. vocab.size=32000)"])
        raw.setdefault(section, {})[name] = yaml.safe_load(value)
    return parse_params(raw, f"{args.params} + -S" if args.set_param else args.params)


def _run(args: argparse.Namespace) -> int:
    from eagle3.cli.plan import print_plan
    from eagle3.core.inputs import InputError
    from eagle3.sweep.plan import plan, read_target_config

    try:
        params = _params(args)
        target = read_target_config(args.target or params.target.source)
        throughput = {"server_tokens_per_s": args.server_tokens_per_s} if args.server_tokens_per_s else {}
        result = plan(params, target, args.tokens, args.world, **throughput)
    except (ParamsError, InputError, ValueError) as err:
        return fail(err)
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print_plan(result, Console())
    return 0


SUBCOMMAND = Subcommand(
    "plan",
    "what a run will cost: drafter params, store bytes, training memory and steps, FLOPs",
    _arguments,
    _run,
)
