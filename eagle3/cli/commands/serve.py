"""`eagle3 serve-command`: the exact SGLang and vLLM commands that serve the target with the
trained drafter.

Draft shape comes from the eval params, which the speculative-eval stage measured (the mapping
lives in eagle3/sglang/speculative.py, which eval.backend: sglang launches with):
  chain (eval.k drafts, one per step): SGLang --speculative-num-steps k --speculative-eagle-topk 1
      --speculative-num-draft-tokens k + 1 (the drafts plus the token they extend);
  tree (depth eval.k, eval.topk children, eval.tree_budget drafts): steps k, topk, budget + 1.
vLLM's EAGLE-3 drafts a chain of `num_speculative_tokens`, so it gets k in both modes.
A DFlash block drafter (drafter.kind: dflash) takes no shape flags: SGLang's DFLASH and vLLM's
dflash method verify its block (block_size tokens: block_size - 1 drafts) every step.
"""

from __future__ import annotations

import argparse
import json
import shlex
from pathlib import Path

from eagle3.cli.subcommand import Subcommand, fail
from eagle3.core.params import Params, ParamsError, load_params


def drafter_folder(params: Params, drafter: str | None = None) -> Path:
    """The drafter to serve: the argument, else eval.drafter, else the train stage's, refused as
    speculative-eval refuses it: an export of the family drafter.kind names."""
    # imported here, not above: they load torch, and every `eagle3` subcommand imports this module
    from eagle3.decoding.setup import eval_drafter
    from eagle3.drafter.dflash_export import check_drafter_kind

    folder = eval_drafter(params, drafter)
    check_drafter_kind(
        folder,
        params.drafter.kind,
        "--drafter" if drafter else "eval.drafter" if params.eval.drafter else None,
    )
    return folder.resolve()


def serve_commands(
    params: Params, drafter: str | None = None, tp: int = 1, port: int = 30000
) -> dict[str, str]:
    """{"sglang": command, "vllm": command, "notes": lines} for the current artifacts."""
    from eagle3.decoding.setup import drafter_depth
    from eagle3.sglang.speculative import eagle3_flags, eagle3_shape
    from eagle3.target.load import resolve_target

    if tp < 1:
        raise ValueError(f"--tp must be >= 1 (got {tp})")
    folder = str(drafter_folder(params, drafter))
    target = resolve_target(params.target.source)
    if params.drafter.kind == "dflash":
        return _dflash_commands(folder, target, tp, port)
    ev = params.eval
    shape = eagle3_shape(ev.mode, ev.k, ev.topk, ev.tree_budget)  # as eval.backend sglang serves it
    sglang = ["python", "-m", "sglang.launch_server", "--model-path", target, "--tp", str(tp)]
    sglang += ["--port", str(port), *eagle3_flags(folder, shape)]
    spec = {"method": "eagle3", "model": folder, "num_speculative_tokens": params.eval.k}
    vllm = ["vllm", "serve", target, "--tensor-parallel-size", str(tp), "--port", str(port)]
    vllm += ["--speculative-config", json.dumps(spec, separators=(",", ":"))]
    notes = []
    if warning := drafter_depth(params, Path(folder))[1]:
        notes.append(warning)
    if params.eval.mode == "tree":
        notes.append("vLLM drafts a chain of num_speculative_tokens; the tree shape applies to SGLang only")
    if params.eval.lookup_tokens:
        notes.append(
            f"eval.lookup_tokens ({params.eval.lookup_tokens}): neither server grafts a prompt-lookup "
            "branch onto EAGLE-3 trees, so expect the speed measured with eval.lookup_tokens: 0"
        )
    return {"sglang": shlex.join(sglang), "vllm": shlex.join(vllm), "notes": "\n".join(notes)}


def _dflash_commands(folder: str, target: str, tp: int, port: int) -> dict[str, str]:
    from eagle3.drafter.dflash_export import load_dflash_config
    from eagle3.sglang.speculative import dflash_flags

    block = load_dflash_config(folder).block_size
    sglang = ["python", "-m", "sglang.launch_server", "--model-path", target, "--tp", str(tp)]
    sglang += ["--port", str(port), *dflash_flags(folder)]
    spec = {"method": "dflash", "model": folder, "num_speculative_tokens": block - 1}
    vllm = ["vllm", "serve", target, "--tensor-parallel-size", str(tp), "--port", str(port)]
    vllm += ["--speculative-config", json.dumps(spec, separators=(",", ":"))]
    note = f"a DFlash block of {block}: {block - 1} drafts a step (eval.mode, k, topk: EAGLE-3's)"
    return {"sglang": shlex.join(sglang), "vllm": shlex.join(vllm), "notes": note}


def _arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--params", default="params.yaml")
    parser.add_argument("--drafter", default=None, help="default: eval.drafter, else artifacts/train/drafter")
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel GPUs (8 for Kimi-K2.5)")
    parser.add_argument("--port", type=int, default=30000)


def _run(args: argparse.Namespace) -> int:
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
