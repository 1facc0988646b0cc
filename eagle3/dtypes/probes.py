"""The work each dtype decision is measured on, at the real sizes (random weights), and its
timing: float32 and bf16 interleaved, in CPU seconds of one thread.

- prefill  one 256-token forward of 2 layers of the target
- train    forward + backward of one drafter layer over 256 tokens (bf16 autocast over float32
           weights, as training runs it)
- decode   the target's two decoding steps at its full depth, with a KV cache and the lm_head,
           float32 weights oneDNN-packed as decoding runs them: a one-token step (plain greedy)
           and a verify step of the eval's draft count, tree-masked as the engine verifies
- draft    the drafter's step at the eval's draft shape: its forward over the pending pairs
           (fc over 3 aux states, then its layer), then one forward per further draft level

The decode probe runs the whole depth: with two layers the lm_head dominates it, and on a Zen 4
that chose bf16 although the real 30-layer model decoded 13% slower in bf16. A one-token probe
alone cannot see a verify step: on an AMX Xeon bf16 took 0.8 of float32's time per one-token
step but 0.73 per verify step of the default eval (42.7 against 58.7 ms, the README's default row).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Literal

import torch

from eagle3.core.device import torch_threads
from eagle3.core.packed import pack_linears, packing_available
from eagle3.dtypes.rule import TYPICAL_ACCEPTANCE, Timings

Job = Literal["prefill", "decode", "draft", "train"]
JOBS: tuple[Job, ...] = ("prefill", "decode", "draft", "train")
DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float64": torch.float64}
# Decoding is timed after an untimed prompt of CONTEXT tokens (an eval prompt's length), STEPS
# steps a part per rep.
CONTEXT, STEPS = 192, 8
# Paired reps: 9 gives a 96% interval for the median between the 2nd and 8th ratios.
REPS = 9


@dataclass(frozen=True)
class Shape:
    """The sizes that decide the measurement: a target's (or drafter's) layer and vocabulary."""

    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    vocab_size: int
    num_hidden_layers: int = 2

    @classmethod
    def of(cls, config, vocab_size: int | None = None) -> Shape:
        """The sizes of a model config (a drafter's: `vocab_size` = its draft vocabulary)."""
        c = getattr(config, "text_config", None) or config
        heads = c.num_attention_heads
        kv = getattr(c, "num_key_value_heads", None) or heads
        layers = getattr(c, "num_hidden_layers", 2)  # a drafter config has one layer and no such key
        return cls(c.hidden_size, c.intermediate_size, heads, kv, vocab_size or c.vocab_size, layers)


@dataclass(frozen=True)
class DraftShape:
    """The eval's draft shape (eval.mode, k, topk, tree_budget, lookup_tokens): what one
    speculative step makes the target verify and the drafter run (eagle3/decoding/engine.py)."""

    mode: str = "tree"
    k: int = 1
    topk: int = 8
    tree_budget: int = 8
    lookup_tokens: int = 4

    @classmethod
    def of(cls, ev) -> DraftShape:
        """From EvalParams (or anything with its five keys)."""
        return cls(ev.mode, ev.k, ev.topk, ev.tree_budget, ev.lookup_tokens)

    @property
    def verify_tokens(self) -> int:
        """The most tokens one verify step carries: the root, the drafted nodes (chain: k; tree:
        topk per level of the top-k frontier, capped at tree_budget) and the lookup branch."""
        if self.mode == "chain":
            return 1 + self.k
        drafted = self.topk + (self.k - 1) * self.topk * self.topk
        return 1 + min(self.tree_budget, drafted) + self.lookup_tokens

    @property
    def draft_rows(self) -> tuple[int, ...]:
        """Rows of each drafter forward in one step: the pending pairs (one per token the last
        step accepted, so TYPICAL_ACCEPTANCE), then k-1 further levels (tree: the top-k frontier)."""
        level = self.topk if self.mode == "tree" else 1
        return (round(TYPICAL_ACCEPTANCE),) + (level,) * (self.k - 1)


@dataclass(frozen=True)
class Work:
    """What one decision is measured on: a job at a model's sizes and, for decoding, the draft
    shape's projection the job sees (the verify step's tokens; the drafter's rows)."""

    job: Job
    shape: Shape
    verify_tokens: int = 0
    draft_rows: tuple[int, ...] = field(default=())

    @classmethod
    def of(cls, job: Job, shape: Shape, draft: DraftShape | None = None) -> Work:
        """`job` at `shape`; decode and draft at `draft` (None: the default eval's)."""
        draft = draft or DraftShape()
        if job == "decode":
            return cls(job, shape, verify_tokens=draft.verify_tokens)
        if job == "draft":
            return cls(job, shape, draft_rows=draft.draft_rows)
        return cls(job, shape)

    def describe(self) -> str:
        if self.job == "decode":
            return f"decode (one-token and {self.verify_tokens}-token verify steps)"
        if self.job == "draft":
            return f"draft (drafter forwards of {'/'.join(map(str, self.draft_rows))} rows)"
        return self.job


def _cpu_seconds(fn: Callable[[], object]) -> float:
    """CPU seconds `fn` spends on this thread: the time a job needs, not the wall time a busy
    machine stretches it to (timing runs one intra-op thread, so all work is on this one)."""
    start = time.thread_time()
    fn()
    return time.thread_time() - start


def _wall_seconds(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def _busy_seconds() -> float:
    """CPU seconds spent by everything on the machine so far (/proc/stat; 0 where unreadable)."""
    try:
        fields = Path("/proc/stat").read_text().splitlines()[0].split()[1:]
    except OSError:
        return 0.0
    user, nice, system, _idle, _iowait, irq, softirq, steal = (int(f) for f in fields[:8])
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


@contextmanager
def others_load(into: dict) -> Iterator[None]:
    """Records into["others_cores"]: how many cores other processes kept busy meanwhile."""
    wall, ours, busy = time.perf_counter(), time.process_time(), _busy_seconds()
    yield
    others = (_busy_seconds() - busy) - (time.process_time() - ours)
    into["others_cores"] = round(max(others, 0.0) / max(time.perf_counter() - wall, 1e-9), 2)


def _llama(shape: Shape, dtype: torch.dtype, layers: int, pack: bool = False):
    """A Llama of `shape`'s sizes (random weights, `layers` deep): the real op mix of a job."""
    from transformers import LlamaConfig, LlamaForCausalLM  # heavy import

    torch.manual_seed(0)
    sizes = asdict(shape) | {"num_hidden_layers": layers}  # Shape's fields are LlamaConfig's names
    config = LlamaConfig(**sizes, tie_word_embeddings=False)
    model = LlamaForCausalLM(config).to(dtype).eval().requires_grad_(False)
    if pack and packing_available(dtype):
        pack_linears(model)
    return model


def _ids(shape: Shape, n: int = 256) -> torch.Tensor:
    return torch.randint(0, shape.vocab_size, (1, n), generator=torch.Generator().manual_seed(0))


def _prefill(shape: Shape, dtype: torch.dtype) -> dict[str, Callable[[], object]]:
    model, ids = _llama(shape, dtype, 2), _ids(shape)
    return {"prefill": torch.no_grad()(lambda: model.model(input_ids=ids, use_cache=False))}


def _train(shape: Shape, dtype: torch.dtype) -> dict[str, Callable[[], object]]:
    model = _llama(shape, torch.float32, 1)
    layer = model.model.layers[0].requires_grad_(True)
    x = torch.randn(1, 256, shape.hidden_size)
    rotary = model.model.rotary_emb(x, torch.arange(256)[None])

    def step() -> None:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == torch.bfloat16):
            out = layer(x, position_embeddings=rotary, attention_mask=None)
        (out[0] if isinstance(out, tuple) else out).float().square().mean().backward()

    return {"step": step}


def _verify_tree(tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(parents, depths) of a verification of `tokens` nodes: the root, up to 8 children, then
    grandchildren under the first child (the mask's shape, not its content, sets the cost)."""
    wide = min(tokens - 1, 8)
    parents = [-1] + [0] * wide + [1] * (tokens - 1 - wide)
    depths = [0] + [1] * wide + [2] * (tokens - 1 - wide)
    return torch.tensor(parents), torch.tensor(depths)


def _tree_mask(past: int, parents: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The additive [1, 1, N, past + N] mask a tree verification runs with: the whole prefix,
    and among the nodes each one's ancestors and itself (eagle3/decoding/tree.py verify_mask)."""
    n = parents.shape[0]
    visible = torch.eye(n, dtype=torch.bool)
    for node, parent in enumerate(parents.tolist()):
        if parent >= 0:
            visible[node] |= visible[parent]
    visible = torch.cat([torch.ones(n, past, dtype=torch.bool), visible], dim=1)
    return torch.zeros(visible.shape, dtype=dtype).masked_fill_(~visible, torch.finfo(dtype).min)[None, None]


def _decode(work: Work, dtype: torch.dtype) -> dict[str, Callable[[], object]]:
    from transformers import DynamicCache  # heavy import

    shape = work.shape
    model, ids = _llama(shape, dtype, shape.num_hidden_layers, pack=True), _ids(shape)
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model.model(input_ids=ids[:, :CONTEXT], cache=cache, use_cache=True)

    def steps(tokens: int) -> Callable[[], None]:
        parents, depths = _verify_tree(tokens)
        mask = _tree_mask(CONTEXT, parents, dtype) if tokens > 1 else None
        positions, step_ids = (CONTEXT + depths)[None], ids[:, CONTEXT : CONTEXT + tokens]

        @torch.no_grad()
        def run() -> None:
            for _ in range(STEPS):
                hidden = model.model(
                    input_ids=step_ids,
                    position_ids=positions,
                    attention_mask=mask,
                    cache=cache,
                    use_cache=True,
                ).last_hidden_state
                model.lm_head(hidden[0])  # the engine's logits over every verified row
                cache.crop(-tokens)  # back to the prompt (transformers 5 crops by a negative count)

        return run

    return {"one-token step": steps(1), "verify step": steps(work.verify_tokens)}


def _draft(work: Work, dtype: torch.dtype) -> dict[str, Callable[[], object]]:
    """The drafter's step. Its layer is a Llama layer of the drafter's sizes over the draft
    vocabulary, fed fc's projection of 3 aux states; the real layer reads embedding and hidden
    state concatenated (2H wide into q/k/v): ~6% more weights than this probe multiplies."""
    from transformers import DynamicCache  # heavy import

    shape = work.shape
    model = _llama(shape, dtype, 1, pack=True)
    hidden = shape.hidden_size
    fc = torch.nn.Linear(3 * hidden, hidden, bias=False).to(dtype).requires_grad_(False)
    if packing_available(dtype):
        pack_linears(fc)
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model.model(inputs_embeds=torch.randn(1, CONTEXT, hidden, dtype=dtype), cache=cache, use_cache=True)
    aux = torch.randn(1, work.draft_rows[0], 3 * hidden, dtype=dtype)
    levels = [torch.randn(1, rows, hidden, dtype=dtype) for rows in work.draft_rows[1:]]

    @torch.no_grad()
    def run() -> None:
        for _ in range(STEPS):
            past = CONTEXT
            for level, x in enumerate([fc(aux), *levels]):
                rows = x.shape[1]
                positions = torch.arange(past, past + rows)[None]
                out = model.model(inputs_embeds=x, position_ids=positions, cache=cache, use_cache=True)
                # the first forward drafts from its last row; each further level from every row
                model.lm_head(out.last_hidden_state[0, -1:] if level == 0 else out.last_hidden_state[0])
                past += rows
            cache.crop(CONTEXT - past)

    return {"draft step": run}


def _parts(work: Work, dtype: torch.dtype) -> dict[str, Callable[[], object]]:
    if work.job == "prefill":
        return _prefill(work.shape, dtype)
    if work.job == "train":
        return _train(work.shape, dtype)
    return _decode(work, dtype) if work.job == "decode" else _draft(work, dtype)


def measure(work: Work, reps: int = REPS, wall: bool = False) -> tuple[Timings, float]:
    """({dtype: {part: [seconds per rep]}}, the cores other processes kept busy meanwhile) for
    `work` in float32 and bf16, in CPU seconds on one thread (wall: wall-clock seconds on every
    thread, what a quiet machine shows a user; bench/dtype.py compares the two). The dtypes
    alternate rep by rep, each rep in the other order, so both see the same load; decode and
    draft times are per step."""
    load: dict = {}
    per_call = STEPS if work.job in ("decode", "draft") else 1
    timed = _wall_seconds if wall else _cpu_seconds
    with torch_threads(None if wall else 1):
        parts = {name: _parts(work, DTYPES[name]) for name in ("float32", "bfloat16")}
        times = {name: {part: [] for part in by_part} for name, by_part in parts.items()}
        for by_part in parts.values():
            for run in by_part.values():
                run()  # warm-up (oneDNN primitive creation)
        with others_load(load):
            for rep in range(reps):
                for name in sorted(parts, reverse=rep % 2 == 1):
                    for part, run in parts[name].items():
                        times[name][part].append(timed(run) / per_call)
    return times, load["others_cores"]
