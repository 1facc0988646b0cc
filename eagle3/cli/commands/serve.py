"""`eagle3 serve-command`: the SGLang and vLLM commands that serve the target with the drafter."""

from __future__ import annotations

import argparse

from eagle3.cli.subcommand import Subcommand, fail
from eagle3.core.params import ParamsError, load_params


def _arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--params", default="params.yaml")
    parser.add_argument("--drafter", default=None, help="default: eval.drafter, else artifacts/train/drafter")
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel GPUs (8 for Kimi-K2.5)")
    parser.add_argument("--port", type=int, default=30000)


def _run(args: argparse.Namespace) -> int:
    from eagle3.cli.serve import serve_commands  # loads torch

    try:
        commands = serve_commands(load_params(args.params), args.drafter, args.tp, args.port)
    except (ParamsError, FileNotFoundError, ValueError) as err:
        return fail(err)
    print(f"# SGLang\n{commands['sglang']}\n# vLLM\n{commands['vllm']}")
    for note in filter(None, commands["notes"].split("\n")):
        print(f"# note: {note}")
    return 0


SUBCOMMAND = Subcommand(
    "serve-command",
    "print the SGLang and vLLM commands that serve the target with the drafter",
    _arguments,
    _run,
)
