"""On-policy data (the target answers, features captured during that generation) against plain
extraction of the same prompts' ShareGPT conversations, measured in one run on this machine.

    python -m bench.onpolicy [--dtype float32] [--samples 64] [--batch 16 64] [--new-tokens 128]

Prints, per configuration, stored tokens/s (prompt + answer, what training reads) and answer
tokens/s, and the ratio to extraction's tokens/s taken in the same process. The goal it is
measured against: on-policy >= 0.5x extraction (docs/results/2026-12-01-0411-on-policy-data.md: ~0.23x).
"""

from __future__ import annotations

import argparse
import time

import torch

from eagle3.core.device import machine
from eagle3.core.packed import pack_linears
from eagle3.core.params import parse_params
from eagle3.data.extract import capture_batch, select_conversations, token_batches
from eagle3.data.onpolicy import generate_with_features
from eagle3.target.load import eos_token_ids, load_target
from eagle3.target.render import render_prompt


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--dtype", default="float32", choices=["bfloat16", "float32"])
    parser.add_argument("--samples", type=int, default=64)
    parser.add_argument("--batch", type=int, nargs="+", default=[16, 64])
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--max-length", type=int, default=384)
    parser.add_argument("--pack", action="store_true", help="also measure with oneDNN-packed weights")
    args = parser.parse_args()

    raw = {
        "target": {"dtype": args.dtype},
        "data": {"num_samples": args.samples, "max_length": args.max_length},
    }
    plain_params = parse_params(raw)
    onpolicy_params = parse_params(raw | {"data": raw["data"] | {"regenerate": True}})
    target = load_target(plain_params.target)
    aux = [1, target.num_layers // 2 - 1, target.num_layers - 4]
    eos = eos_token_ids(target.model, target.tokenizer)
    rendered = [s.rendered for s in select_conversations(plain_params, target.tokenizer, chat=True)]
    selected = select_conversations(onpolicy_params, target.tokenizer, chat=True)
    prompts = sorted((render_prompt(target.tokenizer, s.messages, True) for s in selected), key=len)

    def extraction() -> float:
        start = time.perf_counter()
        for batch in token_batches([len(r.input_ids) for r in rendered], 4096):
            capture_batch(target, [rendered[i] for i in batch], aux)
        return sum(len(r.input_ids) for r in rendered) / (time.perf_counter() - start)

    def onpolicy(batch: int) -> tuple[float, float]:
        start, stored, answer = time.perf_counter(), 0, 0
        for r, _, _ in generate_with_features(
            target, prompts, args.new_tokens, args.max_length, aux, eos, batch_size=batch
        ):
            stored += len(r.input_ids)
            answer += int(r.loss_mask.sum())
        seconds = time.perf_counter() - start
        return stored / seconds, answer / seconds

    print(f"machine: {machine()}")
    print(
        f"target {target.model.dtype}, {args.samples} ShareGPT samples, answers <= {args.new_tokens} tokens"
    )
    extraction()  # warm-up
    weights = ["default", "packed"] if args.pack else ["default"]
    for layout in weights:
        if layout == "packed":
            pack_linears(target.model)
        base = extraction()
        print(f"[{layout}] extraction: {base:,.0f} tok/s")
        for batch in args.batch:
            stored, answer = onpolicy(batch)
            print(
                f"[{layout}] on-policy batch {batch}: {stored:,.0f} stored tok/s "
                f"({stored / base:.2f}x extraction), {answer:,.0f} answer tok/s"
            )


if __name__ == "__main__":
    torch.set_grad_enabled(False)
    main()
