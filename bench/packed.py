"""oneDNN-packed vs default float32 weights: one target forward of n new tokens over a KV cache.

    python -m bench.packed [--target smollm2-135m-instruct] [--reps 15] [--rows 1 2 5 9]

Prints, per row count, the median forward time of the default and the packed model (the same
weights, the same process, reps interleaved) and their ratio, plus each model's cost of an
n-token forward relative to its own 1-token forward: what a k+1-token verification costs in
plain decoding steps.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time

import torch

from eagle3.core.device import machine
from eagle3.core.packed import pack_linears
from eagle3.core.params import TargetParams
from eagle3.target.load import load_target


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default="smollm2-135m-instruct")
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 2, 5, 9])
    ap.add_argument("--context", type=int, default=200, help="tokens already in the KV cache")
    args = ap.parse_args()

    plain = load_target(TargetParams(source=args.target, dtype="float32")).model
    packed = copy.deepcopy(plain)
    print("machine:", machine())
    print(f"packed {pack_linears(packed)} Linear layers")
    ids = torch.randint(100, plain.config.vocab_size - 100, (1, args.context + max(args.rows)))
    prefix, new = ids[:, : args.context], ids[:, args.context :]
    with torch.no_grad():
        caches = {
            name: m(prefix, use_cache=True).past_key_values
            for name, m in (("plain", plain), ("packed", packed))
        }
        times: dict[tuple[str, int], list[float]] = {}
        for _ in range(args.reps):
            for n in args.rows:
                for name, model in (("plain", plain), ("packed", packed)):
                    cache = copy.deepcopy(caches[name])
                    start = time.perf_counter()
                    model(new[:, :n], past_key_values=cache, use_cache=True)
                    times.setdefault((name, n), []).append(time.perf_counter() - start)
    med = {key: statistics.median(v) * 1000 for key, v in times.items()}
    one = {name: med[(name, args.rows[0])] for name in ("plain", "packed")}
    print(
        f"{'rows':>4} {'default ms':>10} {'packed ms':>10} {'default/packed':>15}"
        f" {'default xrow1':>14} {'packed xrow1':>13}"
    )
    for n in args.rows:
        a, b = med[("plain", n)], med[("packed", n)]
        print(
            f"{n:>4} {a:>10.1f} {b:>10.1f} {a / b:>15.2f}"
            f" {a / one['plain']:>14.2f} {b / one['packed']:>13.2f}"
        )


if __name__ == "__main__":
    main()
