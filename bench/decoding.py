"""Speculative vs plain greedy decoding, measured as ratios in one run (median over prompts).

    python -m bench.decoding [--drafter artifacts/train/drafter] [--dtype float32] [--prompts 6]
        [--tokens 64] [--mode tree --k 4 --topk 4 --budget 16] [--threads N] [--lookup 4] [--no-pack]

Each prompt is decoded plain, speculatively (and with prompt lookup) back to back, in
rotating order, so machine noise hits all alike. Prints the machine first: numbers from
another CPU (AMX or not, cores, threads) are not comparable. Without an exported drafter a
random one is used: acceptance ~0, which measures the engine's pure overhead.
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path
from typing import NamedTuple

from eagle3.core.device import machine
from eagle3.core.params import ParamsError, TargetParams, parse_params
from eagle3.decoding.dflash import setup_class
from eagle3.decoding.domains import load_domains, token_counter
from eagle3.decoding.engine import greedy_decode
from eagle3.decoding.evaluate import run_comparison, summarize
from eagle3.decoding.prompts import answered, load_prompts, render_prompts
from eagle3.decoding.setup import DecodingSetup
from eagle3.dtypes.probes import DTYPES
from eagle3.target.load import Target, has_chat_template


def load_pair(
    source: str,
    dtype: str,
    drafter_dir: str,
    drafter_dtype: str,
    threads: int | None = None,
    pack: bool = True,
) -> DecodingSetup:
    """The target and the drafter as speculative-eval runs them (eagle3/decoding/setup.py;
    oneDNN-packed unless `pack` is off); a random drafter when `drafter_dir` holds none
    (acceptance ~0: the engine's overhead)."""
    exported = (Path(drafter_dir) / "config.json").exists()
    target = TargetParams(source=source, dtype=dtype, threads=threads)
    setup = DecodingSetup.load(target, Path(drafter_dir) if exported else None, drafter_dtype, pack)
    print("machine:", machine())
    if exported:
        print(f"drafter: {drafter_dir} in {str(setup.drafter_dtype).removeprefix('torch.')}")
    else:
        print("drafter: random (no exported drafter found): measures overhead, not speedup")
    return setup


def with_drafter_of_its_family(base: DecodingSetup, drafter_dir: Path) -> DecodingSetup:
    """`drafter_dir`'s drafter, of either family, on `base`'s loaded target, in its dtype and
    packing: an EAGLE-3 and a DFlash drafter compared in one run share one target. Each family's
    with_drafter reads only the target, dtype and packing, which every setup has."""
    return setup_class(drafter_dir).with_drafter(base, drafter_dir)


def load_drafters(
    source: str, dtype: str, paths: dict[str, Path], drafter_dtype: str
) -> dict[str, DecodingSetup]:
    """Several drafters, EAGLE-3 or DFlash, on one loaded target, each in the first's dtype and
    packing ({name: setup}, in the order given); the first may be a folder without an export (a
    random EAGLE-3 drafter: the engine's overhead)."""
    first, *others = paths
    folder = paths[first] if (paths[first] / "config.json").exists() else None
    cls = setup_class(folder) if folder else DecodingSetup
    setups = {first: cls.load(TargetParams(source=source, dtype=dtype), folder, drafter_dtype)}
    return setups | {name: with_drafter_of_its_family(setups[first], paths[name]) for name in others}


def mtbench_prompts(target: Target, n: int) -> list[tuple[str, list[int]]]:
    """(id, token ids) of the first n MT-bench prompts (one per category in turn), rendered as
    speculative-eval renders them."""
    return render_prompts(target.tokenizer, load_prompts(None, n), has_chat_template(target.source))


def parse_domains(text: str) -> dict[str, int]:
    """`chat=12,code=24,...` -> eval.domains, validated as the param is."""
    try:
        domains = {name: int(n) for name, _, n in (part.partition("=") for part in text.split(","))}
    except ValueError:
        raise SystemExit(
            f"--domains {text!r}: expected NAME=N,... (e.g. chat=12,code=24,math=24,long=4)"
        ) from None
    try:
        return parse_params({"eval": {"domains": domains}}).eval.domains
    except ParamsError as err:
        raise SystemExit(f"--domains {text!r}: {'; '.join(err.problems)}") from None


def domain_prompts(
    setup: DecodingSetup, domains: dict[str, int], tokens: int
) -> list[tuple[str, str, list[int]]]:
    """(domain, id, token ids) of speculative-eval's domains (eagle3/decoding/domains.py; the long
    domain held out from data seed 0's order, which every shipped drafter trained on), second
    turns after the target's own greedy answer of `tokens` tokens."""
    params = parse_params({"eval": {"domains": domains}})
    counter = token_counter(params.target.model_copy(update={"source": setup.target.source}))
    prompts = load_domains(params.eval, params.data, counter if "long" in domains else None)
    model, eos = setup.target.model, setup.eos
    prompts = answered(
        setup.target.tokenizer, prompts, setup.chat, lambda ids: greedy_decode(model, ids, tokens, eos).tokens
    )
    return [(p.domain, pid, ids) for p, (pid, ids) in zip(prompts, setup.render(prompts), strict=True)]


class DraftShape(NamedTuple):
    """Defaults of --mode, --k, --topk and --budget (eval.mode, k, topk, tree_budget)."""

    mode: str
    k: int
    topk: int
    budget: int


def add_decoding_args(
    ap: argparse.ArgumentParser,
    *,
    prompts: int,
    tokens: int,
    lookup: int,
    shape: DraftShape | None = None,
    lookup_help: str = "prompt_lookup_num_tokens (0 = skip)",
) -> None:
    """The arguments the decoding benches share, with each bench's defaults: the target and the
    dtypes, how many MT-bench prompts and tokens, the draft shape (where the bench takes one) and
    transformers' prompt lookup beside."""
    ap.add_argument("--target", default="smollm2-135m-instruct")
    ap.add_argument("--dtype", default="float32", choices=sorted(DTYPES))
    ap.add_argument("--drafter-dtype", default="auto", choices=["auto", *sorted(DTYPES)])
    ap.add_argument("--prompts", type=int, default=prompts)
    ap.add_argument("--tokens", type=int, default=tokens)
    if shape is not None:
        ap.add_argument("--mode", default=shape.mode, choices=["chain", "tree"])
        ap.add_argument("--k", type=int, default=shape.k)
        ap.add_argument("--topk", type=int, default=shape.topk)
        ap.add_argument("--budget", type=int, default=shape.budget)
    ap.add_argument("--lookup", type=int, default=lookup, help=lookup_help)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--drafter", default="artifacts/train/drafter")
    add_decoding_args(
        ap, prompts=6, tokens=64, lookup=0, shape=DraftShape(mode="chain", k=4, topk=4, budget=16)
    )
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--no-pack", action="store_true", help="keep the default (unpacked) float32 weights")
    args = ap.parse_args()

    setup = load_pair(
        args.target, args.dtype, args.drafter, args.drafter_dtype, args.threads, pack=not args.no_pack
    )
    engine = setup.engine(mode=args.mode, k=args.k, topk=args.topk, tree_budget=args.budget)
    batch = mtbench_prompts(setup.target, args.prompts)
    run = run_comparison(
        engine,
        batch,
        args.tokens,
        setup.eos,
        prompt_lookup_tokens=args.lookup or None,
        check=False,
    )
    m = summarize(run, engine.max_depth, greedy=False)

    def rate(g) -> float:
        return len(g.tokens) / g.seconds

    ratios = [rate(r.spec) / rate(r.baseline) for r in run.results]
    tree = f" topk={args.topk} budget={args.budget}" if args.mode == "tree" else ""
    print(
        f"{args.dtype} {args.mode} k={args.k}{tree}: acceptance length {m['acceptance_length']:.2f}, "
        f"draft {m['draft_ms_per_step']:.1f} ms + verify {m['verify_ms_per_step']:.1f} ms per step, "
        f"plain {1000 / m['baseline_tokens_per_s']:.1f} ms/token"
    )
    median = statistics.median(ratios)
    print(f"speedup (median of {len(ratios)} prompts): {median:.2f}x; pooled {m['speedup']:.2f}x")
    if args.lookup:
        look = [rate(r.lookup) / rate(r.baseline) for r in run.results]
        print(f"prompt lookup ({args.lookup} tokens) speedup (median): {statistics.median(look):.2f}x")


if __name__ == "__main__":
    main()
