"""Draft shapes (chains and trees) against plain greedy and prompt lookup, in one run.

    python -m bench.trees [--drafter drafters/smollm2-135m-instruct-4m] [--prompts 24]
        [--tokens 128] [--shapes chain:2 tree:2:8:10 tree:3:6:10 ...] [--dtype float32]

A shape is `chain:K` or `tree:K:TOPK:BUDGET[:LOOKUP]` (eval.k, eval.topk, eval.tree_budget,
eval.lookup_tokens: a prompt-lookup branch grafted onto the tree). Each prompt
is decoded by every decoder back to back, in rotating order, so machine noise hits all alike;
every speculative output must equal plain greedy's (the run stops otherwise). Prints, per
shape, the acceptance length, draft and verify ms per step and the pooled speedup, with the
machine first: figures from another CPU do not compare.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path

from bench.decoding import add_decoding_args, load_pair, mtbench_prompts
from eagle3.core.inputs import InputError
from eagle3.decoding.engine import Generation, greedy_decode
from eagle3.decoding.evaluate import Diverged, decode_prompts, prompt_lookup_decode
from eagle3.decoding.setup import check_draft_depth
from eagle3.drafter.export import trained_ttt_length


def parse_shape(text: str) -> dict:
    """`chain:K` or `tree:K:TOPK:BUDGET[:LOOKUP]` -> SpecEngine settings."""
    mode, *numbers = text.split(":")
    if mode == "chain" and len(numbers) == 1:
        return {"mode": "chain", "k": int(numbers[0])}
    if mode == "tree" and len(numbers) in (3, 4):
        k, topk, budget, lookup = map(int, numbers + ["0"] * (4 - len(numbers)))
        return {"mode": "tree", "k": k, "topk": topk, "tree_budget": budget, "lookup_tokens": lookup}
    raise SystemExit(f"bad shape {text!r}: expected chain:K or tree:K:TOPK:BUDGET[:LOOKUP]")


def rate(generations: list[Generation]) -> float:
    return sum(len(g.tokens) for g in generations) / sum(g.seconds for g in generations)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--drafter", default="drafters/smollm2-135m-instruct-4m")
    add_decoding_args(ap, prompts=24, tokens=128, lookup=4)
    ap.add_argument("--shapes", nargs="+", default=["chain:2", "tree:2:4:6", "tree:2:6:8", "tree:2:8:10"])
    args = ap.parse_args()
    shapes = {shape: parse_shape(shape) for shape in args.shapes}
    if (Path(args.drafter) / "config.json").exists():  # a random drafter (no config) has no depth
        trained = trained_ttt_length(args.drafter, default=1)
        for shape, settings in shapes.items():
            try:
                check_draft_depth(settings["k"], trained)
            except InputError as err:
                raise SystemExit(f"{shape}: {err}") from None

    setup = load_pair(args.target, args.dtype, args.drafter, args.drafter_dtype)
    target, eos = setup.target, setup.eos
    engines = {shape: setup.engine(**settings) for shape, settings in shapes.items()}
    prompts = mtbench_prompts(target, args.prompts)
    n = args.tokens

    decoders: list[tuple[str, Callable[[list[int]], Generation]]] = [
        ("plain", lambda ids: greedy_decode(target.model, ids, n, eos))
    ]
    if args.lookup:
        decoders.append(("lookup", lambda ids: prompt_lookup_decode(target.model, ids, n, eos, args.lookup)))
    decoders += [(shape, lambda ids, e=e: e.generate(ids, n, eos)) for shape, e in engines.items()]

    try:
        rows = decode_prompts(decoders, prompts, must_match=list(engines))
    except Diverged as err:
        raise SystemExit(f"{err.name} diverged from plain greedy on prompt {err.index}") from None
    runs = {name: [row[name] for row in rows] for name, _ in decoders}

    base = rate(runs["plain"])
    print(f"plain greedy: {base:.2f} tok/s ({1000 / base:.1f} ms/token), {len(prompts)} prompts x {n} tokens")
    if args.lookup:
        print(f"prompt lookup ({args.lookup} tokens): {rate(runs['lookup']) / base:.3f}x")
    # "drafter" = the drafter's own share of the acceptance length (the lookup branch's excluded)
    print(f"{'shape':<14} {'accept len':>10} {'drafter':>8} {'draft ms':>9} {'verify ms':>10} {'speedup':>8}")
    for shape in engines:
        gens = runs[shape]
        steps = sum(len(g.accepted) for g in gens)
        accept = 1 + sum(sum(g.accepted) for g in gens) / steps
        own = 1 + sum(sum(g.drafter_accepted) for g in gens) / steps
        draft_ms = 1000 * sum(g.draft_s for g in gens) / steps
        verify_ms = 1000 * sum(g.verify_s for g in gens) / steps
        speedup = rate(gens) / base
        print(f"{shape:<14} {accept:>10.3f} {own:>8.3f} {draft_ms:>9.1f} {verify_ms:>10.1f} {speedup:>7.3f}x")


if __name__ == "__main__":
    main()
