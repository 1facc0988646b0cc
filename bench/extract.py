"""Capture overhead and extraction throughput, measured in one run on this machine.

    python bench/extract.py [--dtype auto|bfloat16|float32] [--samples 16] [--reps 5]

Prints the machine, then medians over interleaved repetitions of the same batches:
  - capture overhead = forward with the capture hooks / the same forward without them
  - extraction tokens/s = real ShareGPT tokens through `capture_batch` (hooks + bf16 copies)
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from eagle3.core.device import machine
from eagle3.core.params import parse_params
from eagle3.data.extract import capture_batch, select_conversations, token_batches
from eagle3.target.capture import capture_hidden_states
from eagle3.target.load import load_target


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float32"])
    parser.add_argument("--samples", type=int, default=16)
    parser.add_argument("--max-length", type=int, default=512)
    parser.add_argument("--batch-tokens", type=int, default=4096)
    parser.add_argument("--reps", type=int, default=5)
    args = parser.parse_args()

    params = parse_params(
        {
            "target": {"dtype": args.dtype},
            "data": {"num_samples": args.samples, "max_length": args.max_length},
        }
    )
    target = load_target(params.target)
    aux = [1, target.num_layers // 2 - 1, target.num_layers - 4]
    rendered = [s.rendered for s in select_conversations(params, target.tokenizer, chat=True)]
    batches = [
        [rendered[i] for i in b]
        for b in token_batches([len(r.input_ids) for r in rendered], args.batch_tokens)
    ]
    tokens = sum(len(r.input_ids) for r in rendered)

    def padded(batch):
        longest = max(len(r.input_ids) for r in batch)
        ids = torch.zeros((len(batch), longest), dtype=torch.long)
        mask = torch.zeros_like(ids)
        for row, r in enumerate(batch):
            ids[row, : len(r.input_ids)] = torch.from_numpy(r.input_ids)
            mask[row, : len(r.input_ids)] = 1
        return ids, mask

    inputs = [padded(b) for b in batches]

    @torch.no_grad()
    def forward(hooked: bool) -> float:
        start = time.perf_counter()
        for ids, mask in inputs:
            if hooked:
                with capture_hidden_states(target.decoder_layers, target.final_norm, aux):
                    target.model.model(input_ids=ids, attention_mask=mask, use_cache=False)
            else:
                target.model.model(input_ids=ids, attention_mask=mask, use_cache=False)
        return time.perf_counter() - start

    def extraction() -> float:
        start = time.perf_counter()
        for batch in batches:
            capture_batch(target, batch, aux)
        return time.perf_counter() - start

    forward(False)  # warm-up
    ratios, plain_times, extract_times = [], [], []
    for _ in range(args.reps):  # interleaved, so drift hits both sides alike
        plain = forward(False)
        hooked = forward(True)
        ratios.append(hooked / plain)
        plain_times.append(plain)
        extract_times.append(extraction())

    print(f"machine: {machine()}")
    print(
        f"target: {params.target.source} ({target.model.dtype}), {args.samples} ShareGPT samples, "
        f"{tokens} tokens, {len(batches)} batches, {args.reps} reps (medians)"
    )
    print(f"capture overhead (with hooks / without): {statistics.median(ratios):.3f}")
    print(f"forward without capture: {tokens / statistics.median(plain_times):,.0f} tokens/s")
    print(f"extraction (capture + bf16 copies): {tokens / statistics.median(extract_times):,.0f} tokens/s")


if __name__ == "__main__":
    main()
