"""Which dtype computes fastest here, per job: measured on the machine at hand, not guessed.

CPUs differ in ways a feature flag does not settle: without AVX512-BF16/AMX, bf16 matmuls are
emulated (~50x slower than float32); with AVX512-BF16 but no AMX, bf16 prefill ran 1.7x
faster than float32 on one machine (Zen 4) while single-token bf16 decoding ran 5x slower than
float32 with oneDNN-packed weights. So `auto` resolves per job:

- prefill  many rows at once (extraction, the prompt pass, batched self-distillation)
- decode   one row per forward (plain greedy; the baseline every speedup divides by)
- train    forward + backward of the drafter (bf16 autocast vs float32)

On a GPU bf16 wins every job; on a CPU without native bf16 float32 does (no measurement
needed). On a CPU with native bf16 a short matmul measurement (~2 s) decides, once per machine:
the answer is cached under ~/.cache/eagle3/dtype-policy/ keyed by CPU model, flags, torch
version and thread count, so repeated runs resolve identically.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Literal

import torch

from eagle3.packed import pack_linears, packing_available
from eagle3.stageio import write_json

DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float64": torch.float64}
Job = Literal["prefill", "decode", "train"]
JOBS: tuple[Job, ...] = ("prefill", "decode", "train")
# Shapes of a small target's MLP (SmolLM2: 576 -> 1536); the ranking, not the figure, is used.


@cache
def _cpu_flags() -> str:
    try:
        return Path("/proc/cpuinfo").read_text()
    except OSError:
        return ""


def _cpu_model() -> str:
    for line in _cpu_flags().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or "cpu"


@cache
def native_bf16() -> bool:
    if torch.cuda.is_available():
        return torch.cuda.is_bf16_supported()
    flags = _cpu_flags()
    return "amx_bf16" in flags or "avx512_bf16" in flags


def machine() -> str:
    """One line naming the machine every speed figure was measured on."""
    if torch.cuda.is_available():
        return f"{torch.cuda.get_device_name()}, torch {torch.__version__}"
    bf16 = "AMX" if "amx_bf16" in _cpu_flags() else "AVX512-BF16" if native_bf16() else "no native bf16"
    return (
        f"{_cpu_model()}, {os.cpu_count()} cores, {bf16}, torch {torch.__version__} "
        f"({torch.backends.cpu.get_cpu_capability()}), {torch.get_num_threads()} threads"
    )


def _median_seconds(fn: Callable[[], object], reps: int = 3) -> float:
    fn()  # warm-up (oneDNN primitive creation)
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


@dataclass(frozen=True)
class Shape:
    """The sizes that decide the measurement: a target's (or drafter's) layer and vocabulary."""

    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    vocab_size: int
    # The decode probe runs the whole depth: with two layers the lm_head dominates it, and on a
    # Zen 4 (AVX512-BF16) that chose bf16 although the real 30-layer model decoded 13% slower in
    # bf16 (34.8 tok/s) than in packed float32 (40.2 tok/s).
    num_hidden_layers: int = 2

    @classmethod
    def of(cls, config) -> Shape:
        c = getattr(config, "text_config", None) or config
        heads = c.num_attention_heads
        kv = getattr(c, "num_key_value_heads", None) or heads
        layers = getattr(c, "num_hidden_layers", 2)  # a drafter config has one layer and no such key
        return cls(c.hidden_size, c.intermediate_size, heads, kv, c.vocab_size, layers)


def _probe_model(shape: Shape, dtype: torch.dtype, pack: bool = False, layers: int = 2):
    """A Llama of the target's sizes (random weights, `layers` deep): the real op mix of a job."""
    from transformers import LlamaConfig, LlamaForCausalLM  # noqa: PLC0415 - heavy import

    torch.manual_seed(0)
    config = LlamaConfig(
        hidden_size=shape.hidden_size,
        intermediate_size=shape.intermediate_size,
        num_attention_heads=shape.num_attention_heads,
        num_key_value_heads=shape.num_key_value_heads,
        vocab_size=shape.vocab_size,
        num_hidden_layers=layers,
        tie_word_embeddings=False,
    )
    model = LlamaForCausalLM(config).to(dtype).eval().requires_grad_(False)
    if pack:
        pack_linears(model)
    return model


def measure_job(job: Job, dtype: torch.dtype, shape: Shape) -> float:
    """Median seconds of the job's work on a model of `shape` in `dtype`:
    prefill = one 256-token forward of 2 layers;
    decode = DECODE_STEPS one-token steps of the full depth with a KV cache and the lm_head
    (float32 weights packed, as decoding runs them);
    train = forward + backward of one decoder layer over 256 tokens (bf16 autocast over float32
    weights, as training runs it)."""
    from transformers import DynamicCache  # noqa: PLC0415 - heavy import

    ids = torch.randint(0, shape.vocab_size, (1, 256))
    if job == "train":
        model = _probe_model(shape, torch.float32)
        layer = model.model.layers[0].requires_grad_(True)
        x = torch.randn(1, 256, shape.hidden_size)
        positions = torch.arange(256)[None]
        rotary = model.model.rotary_emb(x, positions)

        def step() -> None:
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == torch.bfloat16):
                out = layer(x, position_embeddings=rotary, attention_mask=None)
            (out[0] if isinstance(out, tuple) else out).float().square().mean().backward()

        return _median_seconds(step)
    decoding = job == "decode"
    layers = shape.num_hidden_layers if decoding else 2
    model = _probe_model(shape, dtype, pack=decoding and packing_available(dtype), layers=layers)
    with torch.no_grad():
        if job == "prefill":
            return _median_seconds(lambda: model.model(input_ids=ids, use_cache=False))

        # only the one-token steps are timed (a prompt pass favours bf16: that is the prefill job),
        # at a context of an eval prompt's length, with explicit positions as the engine passes them
        cache = DynamicCache(config=model.config)
        model(input_ids=ids[:, :DECODE_CONTEXT], cache=cache, use_cache=True)

        def decode() -> None:
            for i in range(DECODE_STEPS):
                at = DECODE_CONTEXT + i
                model(
                    input_ids=ids[:, at : at + 1],
                    position_ids=torch.tensor([[at]]),
                    cache=cache,
                    use_cache=True,
                )
            cache.crop(-DECODE_STEPS)  # back to the prompt (transformers 5 crops by a negative count)

        return _median_seconds(decode, reps=5)


# The decode probe: one-token steps timed after an untimed prompt of DECODE_CONTEXT tokens.
DECODE_CONTEXT, DECODE_STEPS = 192, 8
# bf16 decodes only where it beats float32 by this factor: near a tie the probe's noise (~10%
# between runs on a 2-core VM) decides, and float32 is also the dtype in which speculative
# output equals plain greedy token for token (bf16 rounding flips near-tied argmaxes).
BF16_DECODE_MARGIN = 0.9


def choose(job: Job, times: dict[str, float]) -> str:
    """The dtype a job runs in, from its measured seconds per dtype."""
    if job == "decode":
        return "bfloat16" if times["bfloat16"] < BF16_DECODE_MARGIN * times["float32"] else "float32"
    return min(times, key=times.get)


def measure_policy(shape: Shape) -> dict:
    """{job: {"float32": s, "bfloat16": s, "choice": see `choose`} for every job."""
    policy = {}
    for job in JOBS:
        times = {name: measure_job(job, DTYPES[name], shape) for name in ("float32", "bfloat16")}
        policy[job] = times | {"choice": choose(job, times)}
    return policy


def _policy_path(shape: Shape) -> Path:
    from eagle3.target.load import cache_root  # noqa: PLC0415 - avoids an import cycle

    flags = " ".join(sorted(f for f in _cpu_flags().split() if "avx" in f or "amx" in f))
    key = f"{_cpu_model()}|{flags}|{torch.__version__}|{torch.get_num_threads()}|{shape}"
    return cache_root() / "dtype-policy" / f"{hashlib.sha256(key.encode()).hexdigest()[:16]}.json"


@cache
def cpu_policy(shape: Shape) -> dict:
    """The measured policy of this machine for `shape`, measured once and cached on disk."""
    path = _policy_path(shape)
    if path.exists():
        return json.loads(path.read_text())
    policy = {"machine": machine(), "shape": str(shape)} | measure_policy(shape)
    write_json(path, policy)
    return policy


def resolve_dtype(name: str, job: Job = "prefill", shape: Shape | None = None) -> torch.dtype:
    """`auto` = the fastest dtype for `job` on this machine; any other name is taken as is.

    `shape` (the target's sizes) is needed only where a measurement decides: a CPU with native
    bf16; without one such a CPU keeps the old rule (bf16 where native)."""
    if name != "auto":
        return DTYPES[name]
    if torch.cuda.is_available():
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float32
    if not native_bf16():
        return torch.float32  # emulated bf16: measured ~50x slower for matmuls (README)
    if shape is None:
        return torch.bfloat16
    return DTYPES[cpu_policy(shape)[job]["choice"]]
