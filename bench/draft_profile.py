"""Where one speculative step's time goes: torch.profiler over the drafter's own tree (no lookup
branch, as SGLang and vLLM serve it), each op's self CPU time split by phase.

    python -m bench.draft_profile [--drafter drafters/smollm2-135m-instruct-4m] [--prompts 2]
        [--tokens 64] [--k 2 --topk 4 --budget 6] [--drafter-dtype auto] [--threads 1]

Phases: "draft" is the drafter's forward over the newly verified tokens plus the tree's draft
passes (what bench/draft_cost.py times as the draft step), "verify" the target's forward over the
tree and its lm_head over the tree's nodes, "rest" everything else in a step (the tree's mask,
the acceptance walk, trimming the KV cache to the accepted path, gathering its aux states). Per
phase it prints the wall milliseconds per step and the ops with the most self CPU time per step;
the gap between the phase's wall time and its ops' sum is Python and dispatch overhead. One
thread by default, so an op's CPU time is its wall time.
"""

from __future__ import annotations

import argparse
from collections import defaultdict

import torch
from torch.profiler import ProfilerActivity, profile, record_function

from bench.decoding import load_pair, mtbench_prompts
from bench.draft_cost import add_tree_alone_args, tree_alone
from eagle3.decoding.engine import SpecEngine, greedy_decode

PHASES = ("prefill", "draft", "verify")


def labelled(fn, phase: str):
    def call(*args, **kwargs):
        with record_function(phase):
            return fn(*args, **kwargs)

    return call


def label_phases(engine: SpecEngine) -> dict[str, int]:
    """Wrap (on this instance only) every call that belongs to a phase in a profiler range. The
    first target forward of a generation is its prefill: reset the returned counter per prompt."""
    drafter, target = engine.drafter, engine.target
    drafter.forward = labelled(drafter.forward, "draft")
    drafter.project = labelled(drafter.project, "draft")
    engine.draft_tree = labelled(engine.draft_tree, "draft")
    target.logits = labelled(target.logits, "verify")  # the lm_head over the tree's nodes
    hidden, calls = target.hidden, {"n": 0}

    def forward(*args, **kwargs):
        calls["n"] += 1
        with record_function("prefill" if calls["n"] == 1 else "verify"):
            return hidden(*args, **kwargs)

    target.hidden = forward
    return calls


def phase_of(event) -> str | None:
    """The outermost phase range this event runs inside, or None."""
    phase, parent = None, event.cpu_parent
    while parent is not None:
        if parent.name in PHASES:
            phase = parent.name
        parent = parent.cpu_parent
    return phase


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_tree_alone_args(ap, prompts=2)
    ap.add_argument("--drafter-dtype", default="auto", choices=["auto", "bfloat16", "float32"])
    ap.add_argument("--top", type=int, default=8, help="ops listed per phase")
    ap.add_argument(
        "--match", type=float, help="a speedup to reach (e.g. prompt lookup's): the acceptance it needs"
    )
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    setup = load_pair(args.target, "float32", args.drafter, args.drafter_dtype, args.threads)
    engine = SpecEngine.for_target(setup.target, setup.drafter, temperature=0.0, seed=0, **tree_alone(args))
    prompts = mtbench_prompts(setup.target, args.prompts)
    engine.generate(prompts[0][1], 8, setup.eos)  # warm-up: first-call allocations out of the profile
    calls = label_phases(engine)
    wall: dict[str, float] = defaultdict(float)  # microseconds per phase, outermost ranges only
    ops: dict[str | None, dict[str, float]] = {p: defaultdict(float) for p in (*PHASES, None)}
    steps = 0
    for _, ids in prompts:
        calls["n"] = 0
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            gen = engine.generate(ids, args.tokens, setup.eos)
        steps += len(gen.accepted)
        for event in prof.events():
            phase = phase_of(event)
            if event.name in PHASES and phase is None:
                wall[event.name] += event.cpu_time_total
            elif event.name not in PHASES:
                ops[phase][event.name] += event.self_cpu_time_total
        wall["total"] += gen.seconds * 1e6
    wall["rest"] = wall["total"] - wall["prefill"] - wall["draft"] - wall["verify"]
    drafter_dtype = str(setup.drafter_dtype).removeprefix("torch.")
    print(
        f"drafter: {args.drafter} ({drafter_dtype}); tree {args.k}/{args.topk}/{args.budget}, "
        f"no lookup; {len(prompts)} prompts x {args.tokens} tokens; {steps} steps; threads {args.threads}"
    )
    step_ms = (wall["total"] - wall["prefill"]) / steps / 1e3
    print(f"one step: {step_ms:.2f} ms wall (profiler on)")
    for phase in ("draft", "verify", "rest"):
        ms = wall[phase] / steps / 1e3
        print(f"\n{phase}: {ms:.2f} ms per step ({ms / step_ms:.0%} of a step)")
        phase_ops = ops[None if phase == "rest" else phase]
        listed = sorted(phase_ops.items(), key=lambda kv: -kv[1])
        for name, us in listed[: args.top]:
            print(f"  {us / steps / 1e3:7.3f} ms  {name}")
        rest_ms = sum(us for _, us in listed[args.top :]) / steps / 1e3
        overhead = ms - sum(phase_ops.values()) / steps / 1e3
        print(f"  {rest_ms:7.3f} ms  ({len(listed) - args.top} other ops)")
        print(f"  {overhead:7.3f} ms  Python and dispatch (wall minus the ops' self time)")
    speed_without_profiler(engine, setup, prompts, args.tokens, args.match)


def speed_without_profiler(
    engine: SpecEngine, setup, prompts: list, tokens: int, match: float | None
) -> None:
    """Plain greedy and the tree, interleaved per prompt, unprofiled, end to end as speculative-eval
    times them; at a fixed step cost the speedup scales with tokens per step, which gives the
    acceptance a wanted speedup needs."""
    plain_s = spec_s = 0.0
    plain_n = spec_n = steps = 0
    for _, ids in prompts:
        plain = greedy_decode(setup.target.model, ids, tokens, setup.eos)
        gen = engine.generate(ids, tokens, setup.eos)
        plain_s, plain_n = plain_s + plain.seconds, plain_n + len(plain.tokens)
        spec_s, spec_n, steps = spec_s + gen.seconds, spec_n + len(gen.tokens), steps + len(gen.accepted)
    accept, speedup = spec_n / steps, (spec_n / spec_s) / (plain_n / plain_s)
    print(f"\nwithout the profiler: {accept:.2f} tokens per step, {speedup:.2f}x over plain greedy")
    if match:
        print(f"{match:.2f}x needs {accept * match / speedup:.2f} tokens per step at this step cost")


if __name__ == "__main__":
    main()
