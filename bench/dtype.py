"""The dtype policy's measurement, shown: per job, float32 against bf16 on this machine, part by
part, and the decision the rule takes from it.

    python -m bench.dtype [--target smollm2-135m-instruct] [--jobs decode draft] [--verify 9 17]
        [--reps 9] [--wall]

`auto` decides each job on the bf16/float32 cost ratio of CPU time on one thread, float32 and
bf16 interleaved (eagle3/dtypes/probes.py), weighted as the job spends its parts and read with a
confidence interval (eagle3/dtypes/rule.py). Decode is measured at each --verify token count
(default: the default eval's), draft at the default eval's draft shape over a drafter of the
target's sizes and --draft-vocab. --wall measures again in wall-clock time on every thread (what a
quiet machine would show a user), so the proxy can be checked against the real thing. On a CPU
without native bf16 the pipeline skips the measurement and uses float32; this script measures
anyway.
"""

from __future__ import annotations

import argparse
import dataclasses
import json

from eagle3.core.device import machine, machine_class
from eagle3.core.params import TargetParams
from eagle3.dtypes.probes import JOBS, REPS, DraftShape, Shape, Work, measure
from eagle3.dtypes.rule import decide, explain
from eagle3.target.load import load_target_config


def works(shape: Shape, jobs: list[str], verify: list[int], draft_vocab: int) -> list[Work]:
    out = []
    for job in jobs:
        if job == "decode":
            out += [Work("decode", shape, verify_tokens=n) for n in verify]
        elif job == "draft":
            drafter = dataclasses.replace(shape, vocab_size=min(draft_vocab, shape.vocab_size))
            out.append(Work.of("draft", drafter))
        else:
            out.append(Work.of(job, shape))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--target", default="smollm2-135m-instruct")
    parser.add_argument("--jobs", nargs="+", choices=JOBS, default=list(JOBS))
    parser.add_argument("--verify", nargs="+", type=int, default=[DraftShape().verify_tokens])
    parser.add_argument("--draft-vocab", type=int, default=8192)
    parser.add_argument("--reps", type=int, default=REPS)
    parser.add_argument("--wall", action="store_true", help="also wall-clock on every thread")
    parser.add_argument("--json", help="write every rep's timings here")
    args = parser.parse_args()
    shape = Shape.of(load_target_config(TargetParams(source=args.target)))
    klass = machine_class()
    print(f"machine: {machine()} ({klass})\nshape: {shape}")
    raw = []
    for work in works(shape, args.jobs, args.verify, args.draft_vocab):
        for wall in (False, True) if args.wall else (False,):
            times, others = measure(work, args.reps, wall=wall)
            decision = decide(work.job, times, klass)
            clock = "wall, all threads" if wall else "CPU, 1 thread"
            print(f"\n{work.describe()} [{clock}; others kept {others:.2f} cores busy]")
            for part in times["float32"]:
                f, b = decision["parts_ms"]["float32"][part], decision["parts_ms"]["bfloat16"][part]
                print(f"  {part:16} float32 {f:9.2f} ms  bf16 {b:9.2f} ms  ratio {b / f:.3f}")
            print(f"  -> {decision['choice']}: {explain(decision, klass)}")
            raw.append({"work": work.describe(), "clock": clock, "times": times, "decision": decision})
    if args.json:
        with open(args.json, "w") as out:
            json.dump({"machine": machine(), "runs": raw}, out, indent=1)


if __name__ == "__main__":
    main()
