"""torch.compile (inductor, freezing) vs eagle3's oneDNN-packed weights for CPU decoding.

    python -m bench.compile [--target smollm2-135m-instruct] [--prompts 4] [--tokens 64]
        [--rows 1 9] [--reps 15] [--mode max-autotune-no-cudagraphs] [--steps-only]

Three copies of the float32 target, the same weights in one process:
- `default`: nn.Linear as transformers builds it;
- `packed`: every Linear swapped for `eagle3.core.packed.PackedLinear` (what speculative-eval runs);
- `compiled`: the decoder stack and the lm_head under `torch.compile` with inductor's
  freezing pass (weights become constants and are pre-packed by inductor itself), dynamic
  shapes so a growing KV cache does not recompile.

Prints the machine, each copy's compile/warm-up time, then (1) one forward of n new tokens over a
KV cache (the cost of a plain step and of a verification) and (2) plain greedy decoding tokens/s
over MT-bench prompts, reps and prompts interleaved across copies, medians, each as a ratio to
`packed`. Outputs are checked to be the same tokens as `default` decodes.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time

import torch
from torch._inductor import config as inductor_config

from bench.decoding import mtbench_prompts
from eagle3.core.device import machine
from eagle3.core.packed import pack_linears
from eagle3.core.params import TargetParams
from eagle3.decoding.engine import greedy_decode
from eagle3.target.load import eos_token_ids, load_target


def compiled_copy(model: torch.nn.Module, mode: str | None, dynamic: bool) -> torch.nn.Module:
    """The decoder and the lm_head compiled in place on a copy (what greedy_decode calls)."""
    inductor_config.freezing = True  # constant weights: inductor packs them for oneDNN itself
    copy_ = copy.deepcopy(model)
    decoder = copy_.get_decoder()
    decoder.forward = torch.compile(decoder.forward, dynamic=dynamic, mode=mode)
    head = copy_.get_output_embeddings()
    head.forward = torch.compile(head.forward, dynamic=dynamic, mode=mode)
    return copy_


def forward_ms(model: torch.nn.Module, prefix_cache, new: torch.Tensor) -> float:
    """One forward of `new` over a copy of the prompt's KV cache (the copy is not timed)."""
    cache = copy.deepcopy(prefix_cache)
    start = time.perf_counter()
    model(new, past_key_values=cache, use_cache=True)
    return (time.perf_counter() - start) * 1000


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default="smollm2-135m-instruct")
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 9], help="new tokens per forward")
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--context", type=int, default=200)
    ap.add_argument("--mode", default=None, help="torch.compile mode (None = default)")
    ap.add_argument(
        "--steps-only",
        action="store_true",
        help="static shapes, the n-token forwards only (no greedy decoding, whose growing cache "
        "needs dynamic shapes)",
    )
    args = ap.parse_args()

    print("machine:", machine())
    target = load_target(TargetParams(source=args.target, dtype="float32"))
    default = target.model
    packed = copy.deepcopy(default)
    pack_linears(packed)
    compiled = compiled_copy(default, args.mode, dynamic=not args.steps_only)
    models = {"default": default, "packed": packed, "compiled": compiled}
    prompts = mtbench_prompts(target, args.prompts)
    eos = eos_token_ids(default, target.tokenizer)
    ids = torch.randint(100, default.config.vocab_size - 100, (1, args.context + max(args.rows)))
    prefix = ids[:, : args.context]

    with torch.no_grad():
        caches = {}  # the prompt's KV cache per model, built once (inside the warm-up: it compiles too)
        for name, model in models.items():  # warm-up: compiles every shape decoding will use
            start = time.perf_counter()
            caches[name] = model(prefix, use_cache=True).past_key_values
            for n in args.rows:
                forward_ms(model, caches[name], ids[:, args.context : args.context + n])
            if not args.steps_only:
                greedy_decode(model, prompts[0][1], 8, eos)
            print(f"{name}: warm-up {time.perf_counter() - start:.1f} s", flush=True)

        step: dict[tuple[str, int], list[float]] = {}
        for _ in range(args.reps):
            for n in args.rows:
                for name, model in models.items():
                    step.setdefault((name, n), []).append(
                        forward_ms(model, caches[name], ids[:, args.context : args.context + n])
                    )
        rates: dict[str, list[float]] = {name: [] for name in models}
        same = True
        for i, (_, prompt) in enumerate([] if args.steps_only else prompts):
            order = list(models)[i % 3 :] + list(models)[: i % 3]  # rotate who goes first
            outs = {}
            for name in order:
                gen = greedy_decode(models[name], prompt, args.tokens, eos)
                rates[name].append(len(gen.tokens) / gen.seconds)
                outs[name] = gen.tokens
            same &= outs["compiled"] == outs["default"] == outs["packed"]

    print(f"\none forward of n new tokens over a {args.context}-token cache, median of {args.reps} (ms)")
    print(f"{'n':>3} " + " ".join(f"{name:>10}" for name in models) + "   compiled/packed")
    for n in args.rows:
        med = {name: statistics.median(step[(name, n)]) for name in models}
        ratio = med["compiled"] / med["packed"]
        print(f"{n:>3} " + " ".join(f"{med[m]:>10.2f}" for m in models) + f"   {ratio:>15.2f}")
    if args.steps_only:
        return
    med = {name: statistics.median(r) for name, r in rates.items()}
    print(f"\nplain greedy, {len(prompts)} MT-bench prompts x {args.tokens} tokens, median tok/s")
    print(" ".join(f"{name}: {med[name]:.1f}" for name in models))
    print(
        f"compiled/packed {med['compiled'] / med['packed']:.2f},"
        f" default/packed {med['default'] / med['packed']:.2f}; same tokens in all three: {same}"
    )


if __name__ == "__main__":
    main()
