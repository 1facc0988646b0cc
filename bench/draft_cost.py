"""What the draft step costs, and what a cheaper one would buy: the drafter in bf16 against
oneDNN-packed float32, and the drafter's own tree at zero draft cost, in one run.

    python -m bench.draft_cost [--drafter drafters/smollm2-135m-instruct-4m] [--prompts 6]
        [--tokens 64] [--k 2 --topk 4 --budget 6] [--threads 1]

Each prompt is decoded plain and speculatively with each drafter dtype (drafter's tree only, no
lookup branch, as SGLang and vLLM serve it), in rotating order. Per variant it prints the draft
and verify time per step (their ratio is taken inside one generation, so load stretches both
alike), the CPU seconds per generated token on this thread (the figure a busy machine does not
move: run it with --threads 1), and the speedup over plain greedy by CPU time. "zero draft"
is the speedup the same acceptance would give if drafting cost nothing: the stake of a cheaper
draft step.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from bench.decoding import load_pair, mtbench_prompts
from eagle3.core.device import machine
from eagle3.core.packed import pack_linears
from eagle3.decoding.engine import SpecEngine, greedy_decode
from eagle3.drafter.export import load_drafter


def cpu_timed(fn):
    start = time.thread_time()
    out = fn()
    return out, time.thread_time() - start


def add_tree_alone_args(ap: argparse.ArgumentParser, prompts: int) -> None:
    """The options of the draft-step benches (this one and draft_profile.py): the pair, prompts x
    tokens, the drafter's tree (no lookup branch), threads."""
    ap.add_argument("--drafter", default="drafters/smollm2-135m-instruct-4m")
    ap.add_argument("--target", default="smollm2-135m-instruct")
    ap.add_argument("--prompts", type=int, default=prompts)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--k", type=int, default=2)
    ap.add_argument("--topk", type=int, default=4)
    ap.add_argument("--budget", type=int, default=6)
    ap.add_argument("--threads", type=int, default=1, help="1: all work on this thread, CPU time exact")


def tree_alone(args: argparse.Namespace) -> dict[str, object]:
    """SpecEngine settings for the drafter's tree alone, as SGLang and vLLM serve it."""
    return {"mode": "tree", "k": args.k, "topk": args.topk, "tree_budget": args.budget, "lookup_tokens": 0}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_tree_alone_args(ap, prompts=6)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    setup = load_pair(args.target, "float32", args.drafter, "bfloat16", args.threads)
    target, eos = setup.target, setup.eos
    embed = target.model.get_input_embeddings().weight
    drafter_f32 = load_drafter(args.drafter, embed, dtype=torch.float32, target_config=target.config)
    pack_linears(drafter_f32)
    shape = tree_alone(args)
    engines = {
        name: SpecEngine.for_target(target, drafter, temperature=0.0, seed=0, **shape)
        for name, drafter in (("bf16 drafter", setup.drafter), ("float32 packed drafter", drafter_f32))
    }
    prompts = mtbench_prompts(target, args.prompts)
    keys = ("draft", "verify", "cpu", "acc")
    per: dict[str, dict[str, list[float]]] = {name: {key: [] for key in keys} for name in engines}
    plain_cpu = []
    for i, (_, ids) in enumerate(prompts):
        order = list(engines)[i % 2 :] + list(engines)[: i % 2]
        plain, seconds = cpu_timed(lambda: greedy_decode(target.model, ids, args.tokens, eos))  # noqa: B023
        plain_cpu.append(seconds / len(plain.tokens))
        for name in order:
            gen, seconds = cpu_timed(lambda: engines[name].generate(ids, args.tokens, eos))  # noqa: B023
            steps = len(gen.accepted)
            per[name]["draft"].append(gen.draft_s / steps * 1e3)
            per[name]["verify"].append(gen.verify_s / steps * 1e3)
            per[name]["cpu"].append(seconds / len(gen.tokens))
            per[name]["acc"].append(1 + sum(gen.accepted) / steps)  # tokens per verification
    print(f"machine: {machine()}")
    shape_name = f"tree {args.k}/{args.topk}/{args.budget}, no lookup"
    print(f"drafter: {args.drafter}; {shape_name}; {len(prompts)} prompts x {args.tokens} tokens")
    print(f"plain greedy: {statistics.median(plain_cpu) * 1e3:.1f} CPU ms per token")
    header = f"{'variant':24} {'draft ms':>9} {'verify ms':>9} {'draft share':>11} {'accept':>7}"
    print(header + f" {'CPU ms/token':>13} {'speedup':>8} {'zero draft':>10}")
    for name, m in per.items():
        draft, verify = statistics.median(m["draft"]), statistics.median(m["verify"])
        cpu, plain = statistics.median(m["cpu"]), statistics.median(plain_cpu)
        share = draft / (draft + verify)
        print(
            f"{name:24} {draft:9.2f} {verify:9.2f} {share:11.2f} {statistics.median(m['acc']):7.2f} "
            f"{cpu * 1e3:13.1f} {plain / cpu:8.2f} {plain / (cpu * (1 - share)):10.2f}"
        )


if __name__ == "__main__":
    main()
