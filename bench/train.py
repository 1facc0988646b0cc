"""Benchmark the drafter's training step: tokens/s, the share of the machine's matmul rate it
reaches (measured in the same run), and tokens/s and peak memory against the draft vocabulary size.

    python bench/train.py                      # SmolLM2-sized drafter, K=8192, train.dtype auto
    python bench/train.py --vocab-grid 8192 16384 32768 49152
    python bench/train.py --target gemma3-270m --batch 2 --seq 384 --ttt 2 \
        --vocab-grid 32768 16384 65536 262144
    python bench/train.py --device cuda --target tests/fixtures/kimi-k2.5 --batch 1 --seq 2048 \
        --ttt 7 --dtype bfloat16 --draft-vocab 32768 --vocab-grid 16384 32768 65536 163840

Numbers are ratios measured in one process on this machine; nothing here is a timed test.
The matmul rate is measured on the shapes the step itself multiplies ([B*T, H] x [H, K] etc.).
Peak memory of each draft vocab size is the max RSS (CPU) or max allocated (GPU) of a fresh
subprocess running a few steps. A target given as a bare config.json (tests/fixtures/kimi-k2.5)
needs no weights: every tensor here is random.
"""

from __future__ import annotations

import argparse
import functools
import gc
import json
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from eagle3.core.device import machine, native_bf16  # noqa: E402
from eagle3.core.params import TargetParams, TrainParams, default_aux_layers  # noqa: E402
from eagle3.drafter import DrafterConfig, Eagle3Drafter  # noqa: E402
from eagle3.drafter.cost import draft_step_flops, training_memory  # noqa: E402
from eagle3.dtypes.policy import resolve_dtype  # noqa: E402
from eagle3.dtypes.precision import precision_of  # noqa: E402
from eagle3.target.load import load_target_config  # noqa: E402
from eagle3.train.data import Batch  # noqa: E402
from eagle3.train.ttt import LossConfig, TTTModel  # noqa: E402

CPU = torch.device("cpu")


@functools.cache
def _target_config(source: str):  # read once: a GGUF target's config takes seconds to load
    return load_target_config(TargetParams(source=source))


def drafter_config(k: int, target_source: str = TargetParams().source) -> DrafterConfig:
    """The drafter train builds for `target_source` (default: SmolLM2-135M-Instruct) with draft
    vocabulary k (its head trainable, as train.head_trainable: true)."""
    target = _target_config(target_source)
    layers = target.get_text_config().num_hidden_layers  # Kimi-K2.5 nests its LM under text_config
    return DrafterConfig.from_target_config(target, k, default_aux_layers(layers))


def _sync(device: torch.device) -> None:
    if device.type == "cuda":  # kernels run asynchronously: time them done
        torch.cuda.synchronize(device)


def matmul_rate(
    dtype: torch.dtype, m: int, k: int, n: int, seconds: float = 1.5, device: torch.device = CPU
) -> float:
    """FLOP/s of [m, k] x [k, n] (forward) and its two backward products, like nn.Linear does."""
    a, w, g = (torch.randn(*shape, dtype=dtype, device=device) for shape in ((m, k), (n, k), (m, n)))
    a @ w.T  # warm up
    _sync(device)
    flops, started = 0.0, time.perf_counter()
    while time.perf_counter() - started < seconds:
        a @ w.T
        g @ w
        g.T @ a
        flops += 3 * 2 * m * k * n
        _sync(device)
    return flops / (time.perf_counter() - started)


def synthetic_batch(b: int, t: int, h: int, v: int, dtype: torch.dtype) -> Batch:
    g = torch.Generator().manual_seed(0)
    ones = torch.ones(b, t, dtype=torch.bool)
    return Batch(
        torch.randint(0, v, (b, t), generator=g),
        torch.rand(b, t, generator=g) < 0.7,
        ones,
        ones,
        torch.arange(t).expand(b, t).contiguous(),
        torch.randn(b, t, 3 * h, generator=g).to(dtype),
        torch.randn(b, t, h, generator=g).to(dtype),
    )


def train_rate(
    k: int, b: int, t: int, ttt: int, dtype_name: str, steps: int, target: str, device: torch.device = CPU
) -> dict:
    dtype = resolve_dtype(dtype_name)
    autocast = dtype == torch.bfloat16
    master = torch.float32 if autocast else dtype
    cfg = drafter_config(k, target)
    torch.manual_seed(0)
    with device:  # built where it trains: a Kimi-sized drafter is GiBs to copy
        drafter = Eagle3Drafter(cfg, torch.randn(cfg.vocab_size, cfg.hidden_size).to(dtype)).to(master)
        model = TTTModel(drafter, torch.randn(k, cfg.hidden_size).to(dtype), LossConfig(ttt, 0.8))
    params = [p for p in drafter.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-4)
    batch = synthetic_batch(b, t, cfg.hidden_size, cfg.vocab_size, torch.bfloat16 if autocast else master)
    batch = batch if device.type == "cpu" else batch.to(device)
    times, positions = [], 0.0
    for i in range(steps + 1):
        _sync(device)
        started = time.perf_counter()
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast):
            loss, stats = model(batch)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 0.5)
        opt.step()
        opt.zero_grad(set_to_none=True)
        _sync(device)
        if i:  # the first step warms up kernels and allocations
            times.append(time.perf_counter() - started)
            positions = float(stats.count.sum())
    seconds = statistics.median(times)
    c = cfg
    hq, hkv = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
    layer = 2.0 * (
        2 * c.hidden_size * (hq + 2 * hkv) + hq * c.hidden_size + 3 * c.hidden_size * c.intermediate_size
    )
    # matmul FLOPs actually needed: fc + per step the layer on every token and lm_head on trained positions,
    # forward + backward (x3); plus the target's K rows once (forward only)
    flops = (
        b * t * (3 * 2.0 * 3 * c.hidden_size**2 + ttt * 3 * layer)
        + positions * 3 * 2.0 * c.hidden_size * k
        + b * t * 2.0 * c.hidden_size * k
    )
    return {
        "tokens_per_s": b * t / seconds,
        "step_s": seconds,
        "matmul_flops_per_s": flops / seconds,
        "flops_per_token_step_upper": draft_step_flops(drafter.cfg)["draft_step"],
    }


def own_peak_rss_bytes() -> int:
    """This process's peak RSS: VmHWM, not getrusage's ru_maxrss, which Linux carries across
    exec, so a child spawned by this bench reported the bench's own peak (7.4 GiB for every K)."""
    status = Path("/proc/self/status")
    if status.exists():
        for line in status.read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # no procfs: an upper bound


def peak_memory_child(
    k: int, b: int, t: int, ttt: int, dtype_name: str, target: str, device: torch.device
) -> None:
    train_rate(k, b, t, ttt, dtype_name, steps=1, target=target, device=device)
    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else own_peak_rss_bytes()
    print(json.dumps({"peak_bytes": peak}))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default=TargetParams().source, help="target.source (default: %(default)s)")
    ap.add_argument("--draft-vocab", type=int, default=8192)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--ttt", type=int, default=7)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--vocab-grid", type=int, nargs="*", default=[8192, 16384, 32768, 49152])
    ap.add_argument("--device", default="auto", help="cpu, cuda or auto (cuda where there is one)")
    ap.add_argument("--memory-child", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args()
    auto = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(auto if args.device == "auto" else args.device)
    if args.memory_child:
        peak_memory_child(args.memory_child, args.batch, args.seq, args.ttt, args.dtype, args.target, device)
        return
    compute = resolve_dtype(args.dtype)
    print(f"{machine()}; target {args.target}; device {device}")
    print(f"threads {torch.get_num_threads()}, native bf16: {native_bf16()}, compute dtype {compute}")
    m, h = args.batch * args.seq, drafter_config(args.draft_vocab, args.target).hidden_size
    bf16 = matmul_rate(torch.bfloat16, m, h, args.draft_vocab, seconds=1.0, device=device)
    fp32 = matmul_rate(torch.float32, m, h, args.draft_vocab, device=device)
    rate_of = functools.partial(
        train_rate,
        b=args.batch,
        t=args.seq,
        ttt=args.ttt,
        dtype_name=args.dtype,
        steps=args.steps,
        target=args.target,
    )
    run = rate_of(args.draft_vocab, device=device)
    rate = run["matmul_flops_per_s"]
    own = bf16 if compute == torch.bfloat16 else fp32
    print(
        f"matmul rate here: bf16 {bf16 / 1e9:,.1f} GFLOP/s, fp32 {fp32 / 1e9:,.1f} GFLOP/s "
        f"(shape [{m}, {h}] x [{h}, {args.draft_vocab}], fwd + bwd products)"
    )
    print(
        f"train step: {run['tokens_per_s']:,.0f} tokens/s (B={args.batch}, T={args.seq}, TTT={args.ttt}, "
        f"K={args.draft_vocab}), {rate / 1e9:,.1f} GFLOP/s of needed matmul work"
    )
    print(f"  = {rate / bf16:.0%} of the bf16 matmul rate, {rate / own:.0%} of the {compute} matmul rate")
    print(f"by draft vocabulary: step tokens/s (median of {args.steps}), peak memory (fresh process each)")
    rates = {args.draft_vocab: run}  # the step measured above is not measured again
    for k in args.vocab_grid:
        if k not in rates:
            rates[k] = rate_of(k, device=device)
    if device.type == "cuda":  # the children below need the GPU memory this process cached
        gc.collect()
        torch.cuda.empty_cache()
    for k in args.vocab_grid:
        cmd = [
            sys.executable,
            __file__,
            "--memory-child",
            str(k),
            "--batch",
            str(args.batch),
            "--seq",
            str(args.seq),
            "--ttt",
            str(args.ttt),
            "--dtype",
            args.dtype,
            "--target",
            args.target,
            "--device",
            str(device),
        ]
        child = subprocess.run(cmd, capture_output=True, text=True)
        if child.returncode:
            sys.exit(f"the peak-memory run of K={k:,} failed:\n{child.stderr[-3000:]}")
        peak = json.loads(child.stdout.strip().splitlines()[-1])["peak_bytes"] / 2**30
        est = training_memory(  # the train stage's figure: it also holds the target's lm_head
            drafter_config(k, args.target),
            TrainParams(batch_size=args.batch, seq_len=args.seq, ttt_length=args.ttt),
            1,
            precision_of(compute),
        )["total_ddp"]
        ratio = rates[k]["tokens_per_s"] / rates[args.vocab_grid[0]]["tokens_per_s"]
        print(
            f"  K={k:>7,}: {rates[k]['tokens_per_s']:8,.0f} tok/s ({ratio:.2f}x K={args.vocab_grid[0]:,}), "
            f"peak {peak:5.2f} GiB (estimate used by the pre-flight check: {est:5.2f} GiB)"
        )


if __name__ == "__main__":
    main()
