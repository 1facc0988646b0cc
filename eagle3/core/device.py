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
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from functools import cache
from pathlib import Path
from typing import Literal

import torch

from eagle3.core.cache import cache_root
from eagle3.core.packed import pack_linears, packing_available
from eagle3.core.stageio import write_json

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


def _cpu_seconds(fn: Callable[[], object]) -> float:
    """CPU seconds `fn` spends on this thread: the time a job needs, not the wall time a busy
    machine stretches it to (the probe runs one intra-op thread, so all work is on this one)."""
    start = time.thread_time()
    fn()
    return time.thread_time() - start


@contextmanager
def torch_threads(threads: int | None) -> Iterator[None]:
    """torch's intra-op threads set to `threads` for the block (None: left as they are), and the
    calling thread's count put back after it, also when the block changed it. The count is per
    calling thread (OpenMP's and MKL's settings are), so a background thread may hold its own."""
    before = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _busy_seconds() -> float:
    """CPU seconds spent by everything on the machine so far (/proc/stat; 0 where unreadable)."""
    try:
        fields = Path("/proc/stat").read_text().splitlines()[0].split()[1:]
    except OSError:
        return 0.0
    user, nice, system, _idle, _iowait, irq, softirq, steal = (int(f) for f in fields[:8])
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


@contextmanager
def _others_load(into: dict) -> Iterator[None]:
    """Records into["others_cores"]: how many cores other processes kept busy meanwhile."""
    wall, ours, busy = time.perf_counter(), time.process_time(), _busy_seconds()
    yield
    others = (_busy_seconds() - busy) - (time.process_time() - ours)
    into["others_cores"] = round(max(others, 0.0) / max(time.perf_counter() - wall, 1e-9), 2)


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
    from transformers import LlamaConfig, LlamaForCausalLM  # heavy import

    torch.manual_seed(0)
    sizes = asdict(shape) | {"num_hidden_layers": layers}  # Shape's fields are LlamaConfig's names
    config = LlamaConfig(**sizes, tie_word_embeddings=False)
    model = LlamaForCausalLM(config).to(dtype).eval().requires_grad_(False)
    if pack:
        pack_linears(model)
    return model


def _job_work(job: Job, dtype: torch.dtype, shape: Shape) -> Callable[[], object]:
    """The job's work on a model of `shape` in `dtype`, ready to time:
    prefill = one 256-token forward of 2 layers;
    decode = DECODE_STEPS one-token steps of the full depth with a KV cache and the lm_head
    (float32 weights packed, as decoding runs them);
    train = forward + backward of one decoder layer over 256 tokens (bf16 autocast over float32
    weights, as training runs it)."""
    from transformers import DynamicCache  # heavy import

    ids = torch.randint(0, shape.vocab_size, (1, 256), generator=torch.Generator().manual_seed(0))
    if job == "train":
        model = _probe_model(shape, torch.float32)
        layer = model.model.layers[0].requires_grad_(True)
        x = torch.randn(1, 256, shape.hidden_size)
        rotary = model.model.rotary_emb(x, torch.arange(256)[None])

        def step() -> None:
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == torch.bfloat16):
                out = layer(x, position_embeddings=rotary, attention_mask=None)
            (out[0] if isinstance(out, tuple) else out).float().square().mean().backward()

        return step
    decoding = job == "decode"
    layers = shape.num_hidden_layers if decoding else 2
    model = _probe_model(shape, dtype, pack=decoding and packing_available(dtype), layers=layers)
    if job == "prefill":
        return torch.no_grad()(lambda: model.model(input_ids=ids, use_cache=False))

    # only the one-token steps are timed (a prompt pass favours bf16: that is the prefill job),
    # at a context of an eval prompt's length, with explicit positions as the engine passes them
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(input_ids=ids[:, :DECODE_CONTEXT], cache=cache, use_cache=True)

    @torch.no_grad()
    def decode() -> None:
        for i in range(DECODE_STEPS):
            at = DECODE_CONTEXT + i
            model(
                input_ids=ids[:, at : at + 1], position_ids=torch.tensor([[at]]), cache=cache, use_cache=True
            )
        cache.crop(-DECODE_STEPS)  # back to the prompt (transformers 5 crops by a negative count)

    return decode


# The decode probe: one-token steps timed after an untimed prompt of DECODE_CONTEXT tokens.
DECODE_CONTEXT, DECODE_STEPS = 192, 8
# bf16 is chosen only where it needs less than BF16_MARGIN of float32's time: near a tie the
# probe's noise decides, and float32 is also the dtype in which speculative output equals plain
# greedy token for token (bf16 rounding flips near-tied argmaxes).
BF16_MARGIN = 0.9
# A ratio within NARROW of the margin is too close to call: float32, and not cached, so the next
# run measures again instead of keeping a coin toss for good.
NARROW = 0.1
# Other processes keeping more than this many cores busy during the probe: the decision is used
# (CPU time is robust to load) but not cached, so a quiet run decides for good.
LOADED_CORES = 0.25
REPS = 5  # paired reps per job (float32 and bf16 alternate, so both see the same load)


def measure_job(job: Job, shape: Shape, reps: int = REPS) -> dict:
    """{"float32": s, "bfloat16": s, "ratio": median bf16/float32 of the paired reps}, in CPU
    seconds of one thread. The two dtypes run interleaved, each rep in the other order."""
    work = {name: _job_work(job, DTYPES[name], shape) for name in ("float32", "bfloat16")}
    times: dict[str, list[float]] = {name: [] for name in work}
    with torch_threads(1):
        for run in work.values():
            run()  # warm-up (oneDNN primitive creation)
        for rep in range(reps):
            for name in sorted(work, reverse=rep % 2 == 1):
                times[name].append(_cpu_seconds(work[name]))
    ratios = [b / f for f, b in zip(times["float32"], times["bfloat16"], strict=True)]
    return {name: round(statistics.median(t), 6) for name, t in times.items()} | {
        "ratio": round(statistics.median(ratios), 4)
    }


def choose(ratio: float) -> tuple[str, bool]:
    """(dtype, clear) for a measured bf16/float32 time ratio: bf16 only on a clear win; a ratio
    within NARROW of the margin is not clear and resolves to float32."""
    if ratio < BF16_MARGIN * (1 - NARROW):
        return "bfloat16", True
    return "float32", ratio > BF16_MARGIN * (1 + NARROW)


def measure_decision(job: Job, shape: Shape) -> dict:
    """{"float32": s, "bfloat16": s, "ratio": r, "choice": dtype, "clear": bool, "others_cores": n}."""
    decision: dict = {}
    with _others_load(decision):
        measured = measure_job(job, shape)
    choice, clear = choose(measured["ratio"])
    return measured | {"choice": choice, "clear": clear} | decision


def keep_for_good(decision: dict) -> str | None:
    """Why a measured decision must not be kept (None: keep it)."""
    if decision["others_cores"] > LOADED_CORES:
        return f"other processes kept {decision['others_cores']} cores busy while it was measured"
    if not decision["clear"]:
        return "too close to call (float32 used)"
    return None


def policy_path(job: Job, shape: Shape) -> Path:
    flags = " ".join(sorted(f for f in _cpu_flags().split() if "avx" in f or "amx" in f))
    key = f"{POLICY_VERSION}|{_cpu_model()}|{flags}|{torch.__version__}|{torch.get_num_threads()}|{shape}"
    name = f"{job}-{hashlib.sha256(key.encode()).hexdigest()[:16]}.json"
    return cache_root() / "dtype-policy" / name


# Bumped when the measurement changes: a decision measured the old way is not reused.
POLICY_VERSION = 2


def kept_decision(job: Job, shape: Shape) -> dict | None:
    """The decision kept for `job` at `shape` on this machine, without measuring; None if none."""
    path = policy_path(job, shape)
    return json.loads(path.read_text()) | {"source": f"cached in {path}"} if path.exists() else None


@cache
def cpu_decision(job: Job, shape: Shape) -> dict:
    """This machine's dtype for `job` at `shape`: the kept decision where a clear, quiet
    measurement was kept, else measured now (and kept only if clear and quiet). Its "source"
    says which."""
    if kept := kept_decision(job, shape):
        return kept
    path = policy_path(job, shape)
    decision = {"machine": machine(), "shape": str(shape)} | measure_decision(job, shape)
    if why := keep_for_good(decision):
        return decision | {"source": f"measured now, not cached: {why}"}
    write_json(path, decision)
    return decision | {"source": f"measured now, cached in {path}"}


def resolve_dtype(name: str, job: Job = "prefill", shape: Shape | None = None) -> torch.dtype:
    """`auto` = the fastest dtype for `job` on this machine; any other name is taken as is.

    `shape` (the target's sizes) is needed only where a measurement decides: a CPU with native
    bf16; without one such a CPU keeps the old rule (bf16 where native)."""
    return DTYPES[resolve_dtype_name(name, job, shape)[0]]


def resolve_dtype_name(
    name: str, job: Job = "prefill", shape: Shape | None = None, measure: bool = True
) -> tuple[str, str]:
    """(dtype name, where the decision came from) for a dtype param value. With measure=False
    a decision that needs a measurement not yet kept here stays "auto"."""
    if name != "auto":
        return name, "set in params"
    if torch.cuda.is_available():
        return ("bfloat16" if torch.cuda.is_bf16_supported() else "float32"), "GPU rule"
    if not native_bf16():
        return "float32", "no native bf16 on this CPU (emulated bf16 is ~50x slower)"
    if shape is None:
        return "bfloat16", "native bf16 on this CPU"
    decision = cpu_decision(job, shape) if measure else kept_decision(job, shape)
    if decision is None:
        return "auto", "not measured on this machine yet (`eagle3 dtypes` measures it, ~1 min)"
    return decision["choice"], f"bf16/float32 CPU time {decision['ratio']:.2f}; {decision['source']}"
