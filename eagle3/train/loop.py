"""The training loop: AdamW + warmup/cosine, clipping, bf16 autocast, checkpoints, DDP.

Resumption is exact: a checkpoint holds the trainable weights, optimizer, scheduler, RNG
states, the data position (epoch, batch) and the history so far; the batches are a pure
function of (seed, epoch), so the resumed run replays exactly what the uninterrupted one did.
Under `torchrun` (WORLD_SIZE > 1) each rank takes every world-th row of the global batch and
the loss is normalised by the global number of trained positions, so N processes compute the
same update as one process on the same global batch.

Checkpoints hold only tensors and plain Python values (the numpy RNG state is stored as a
tensor), so they load with `torch.load(weights_only=True)`: no pickled code runs from disk.
Each carries the sha256 of its content; a damaged checkpoint, or one of other params or
inputs, is reported by name and not resumed (the run starts afresh and overwrites it).
"""

from __future__ import annotations

import hashlib
import math
import os
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn
from torch import Tensor

from eagle3.data.store import FeatureStore
from eagle3.device import Shape, resolve_dtype
from eagle3.drafter.config import DrafterConfig
from eagle3.drafter.model import Eagle3Drafter
from eagle3.params import TrainParams
from eagle3.train.data import Batch, BatchSource, split_samples, target_in_draft
from eagle3.train.ttt import TTTModel, acceptance_length, flops_per_token_step, step_valid

CHECKPOINT = "last.pt"


def precision(p: TrainParams, cfg: DrafterConfig | None = None) -> tuple[torch.dtype, bool]:
    """(master weight dtype, bf16 autocast on?) for train.dtype (auto: measured for the drafter's sizes)."""
    dtype = resolve_dtype(p.dtype, "train", Shape.of(cfg) if cfg is not None else None)
    if dtype == torch.bfloat16:
        return torch.float32, True  # bf16 compute, float32 master weights and optimizer state
    return dtype, False


@dataclass
class TrainInputs:
    store: FeatureStore
    embed: Tensor  # target input embedding [V, H]
    head: Tensor  # target lm_head [V, H]
    d2t: Tensor  # int64 [K]
    t2d: Tensor  # bool [V]
    drafter_cfg: DrafterConfig  # train.fc_norm / norm_output / intermediate_size applied on top
    run_key: str = ""  # identifies params + inputs; a checkpoint with another key is not resumed
    final_norm: Tensor | None = None  # target final norm as a Llama RMSNorm weight [H] (head_init: target)


@dataclass
class TrainOutcome:
    drafter: Eagle3Drafter
    metrics: dict
    curve: list[dict] = field(default_factory=list)  # one row per optimizer step
    epochs: list[dict] = field(default_factory=list)  # held-out results after each epoch


@dataclass
class Dist:
    rank: int = 0
    world: int = 1
    local_rank: int = 0

    @property
    def main(self) -> bool:
        return self.rank == 0


def init_distributed() -> Dist:
    """Join the torchrun group when launched by torchrun (gloo on CPU, nccl on GPU)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world == 1:
        return Dist()
    if not dist.is_initialized():
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    return Dist(dist.get_rank(), dist.get_world_size(), int(os.environ.get("LOCAL_RANK", "0")))


def _all_reduce(x: Tensor, d: Dist) -> Tensor:
    if d.world > 1:
        x = x.clone()
        dist.all_reduce(x)
    return x


def _barrier(d: Dist) -> None:
    if d.world > 1:
        dist.barrier()


def drafter_config(base: DrafterConfig, p: TrainParams) -> DrafterConfig:
    """`base` (sizes from the target) with the architecture choices of train params applied."""
    return replace(
        base,
        intermediate_size=p.intermediate_size or base.intermediate_size,
        fc_norm=p.fc_norm,
        norm_output=p.norm_output,
    )


def init_head(drafter: Eagle3Drafter, head_rows: Tensor, final_norm: Tensor | None, p: TrainParams) -> None:
    """head_init: target copies the target's K lm_head rows and final norm into the drafter;
    head_trainable: false then freezes both (not in the optimizer, as in EAGLE-1/2)."""
    if p.head_init != "target":
        return
    if final_norm is None:
        raise ValueError("train.head_init: target needs the target's final norm (TrainInputs.final_norm)")
    with torch.no_grad():
        drafter.lm_head.weight.copy_(head_rows)
        drafter.norm.weight.copy_(final_norm)
    if not p.head_trainable:
        drafter.lm_head.requires_grad_(False)
        drafter.norm.requires_grad_(False)


def lr_lambda(warmup: int, total: int) -> Callable[[int], float]:
    """Linear warmup to the peak, then cosine decay to 10% of it."""

    def f(step: int) -> float:
        if step < warmup:
            return (step + 1) / (warmup + 1)
        progress = min(1.0, (step - warmup) / max(1, total - warmup))
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress))

    return f


def estimate_peak_gib(cfg: DrafterConfig, p: TrainParams) -> float:
    """A conservative estimate of training memory (activations dominate: logits of every step)."""
    h, k, v, i = cfg.hidden_size, cfg.draft_vocab_size, cfg.vocab_size, cfg.intermediate_size
    tokens = p.batch_size * p.seq_len
    per_step = tokens * (k * 12 + h * 80 + i * 16) + p.batch_size * p.seq_len * p.seq_len * p.ttt_length
    weights = (k * h + 4 * h * h + 3 * h * i + 3 * h * h) * 16 + v * h * 4
    target = tokens * k * 2 + v * h * 2
    runtime = 0.5 * 2**30  # interpreter, torch and allocator slack (bench/train.py measures peak RSS)
    return (per_step * p.ttt_length + weights + target + runtime) / 2**30


def check_memory(cfg: DrafterConfig, p: TrainParams) -> float:
    gib = estimate_peak_gib(cfg, p)
    if gib > p.max_memory_gib:
        raise ValueError(
            f"train: estimated peak memory {gib:.1f} GiB for a draft vocabulary of {cfg.draft_vocab_size:,} "
            f"(batch_size {p.batch_size} x seq_len {p.seq_len}, ttt_length {p.ttt_length}) exceeds "
            f"train.max_memory_gib={p.max_memory_gib}; lower vocab.size, train.batch_size or train.seq_len, "
            "or raise train.max_memory_gib"
        )
    return gib


def _rng_state() -> dict:
    # numpy's state as (name, keys as an int64 tensor, pos, has_gauss, gauss): weights_only
    # loading refuses numpy arrays
    name, keys, pos, has_gauss, gauss = np.random.get_state()
    numpy_state = (name, torch.from_numpy(keys.astype(np.int64)), pos, has_gauss, gauss)
    state = {"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": numpy_state}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    name, keys, pos, has_gauss, gauss = state["numpy"]
    np.random.set_state((name, keys.numpy().astype(np.uint32), pos, has_gauss, gauss))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _digest(state: object) -> str:
    """sha256 of a checkpoint's content: tensors by dtype, shape and bytes, containers in order
    (dicts by key), everything else by repr (exact for ints, floats, strings, None)."""
    h = hashlib.sha256()

    def feed(obj: object) -> None:
        if isinstance(obj, Tensor):
            t = obj.detach().cpu().contiguous()
            h.update(f"T{t.dtype}{tuple(t.shape)}".encode())
            h.update(t.reshape(-1).view(torch.uint8).numpy())  # no copy: the buffer itself
        elif isinstance(obj, dict):
            h.update(b"{")
            for key in sorted(obj, key=repr):
                h.update(repr(key).encode())
                feed(obj[key])
            h.update(b"}")
        elif isinstance(obj, (list, tuple)):
            h.update(b"[" if isinstance(obj, list) else b"(")
            for item in obj:
                feed(item)
            h.update(b"]")
        else:
            h.update(repr(obj).encode())

    feed(state)
    return h.hexdigest()


def read_checkpoint(path: Path, run_key: str) -> tuple[dict | None, str]:
    """(the checkpoint's state, "") when `path` is an intact checkpoint of this run, else
    (None, why not): absent, unreadable or damaged, or written for other params or inputs."""
    if not path.exists():
        return None, ""
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:  # noqa: BLE001 - truncated zip, refused pickle, ...: all mean damaged
        why = f"{type(err).__name__}; or written before checkpoints were weights-only"
        return None, f"{path} is damaged ({why}); starting afresh"
    content = {k: v for k, v in state.items() if k != "sha256"} if isinstance(state, dict) else None
    if content is None or state.get("sha256") != _digest(content):
        return None, f"{path} is damaged (its content differs from its sha256); starting afresh"
    if state["key"] != run_key:
        return None, f"{path} was written for other params or inputs; not resumed, starting afresh"
    return state, ""


def trainable_state(drafter: Eagle3Drafter) -> dict[str, Tensor]:
    return {k: v for k, v in drafter.state_dict().items() if not k.startswith("embed_tokens.")}


def _to_device(batch: Batch, device: torch.device) -> Batch:
    return batch if device.type == "cpu" else batch.to(device)


class _Accumulator:
    """Per-TTT-position sums (loss, correct, count)."""

    def __init__(self, steps: int):
        self.sums = torch.zeros(3, steps, dtype=torch.float64)

    def add(self, stats: Tensor) -> None:
        self.sums += stats

    def summary(self) -> dict:
        loss, correct, count = self.sums
        count = count.clamp(min=1)
        return {
            "loss": (loss / count).tolist(),
            "acc": (correct / count).tolist(),
            "positions": self.sums[2].long().tolist(),
        }


def _progress() -> Progress:
    return Progress(
        TextColumn("[bold]train[/] ep {task.fields[epoch]}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn(
            "loss {task.fields[loss]:.3f}  acc0 {task.fields[acc]:.3f}  {task.fields[tok_s]:,.0f} tok/s"
        ),
        TimeRemainingColumn(),
    )


@torch.no_grad()
def evaluate(model: TTTModel, source: BatchSource, p: TrainParams, device: torch.device) -> dict:
    """Held-out loss/accuracy per TTT position and the simulated acceptance length."""
    acc = _Accumulator(p.ttt_length)
    lengths = []
    master, use_autocast = precision(p, model.drafter.cfg)
    for rows in source.fixed_batches(p.batch_size):
        batch = _to_device(source.batch(rows, None if use_autocast else master), device)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=use_autocast):
            _, stats, hits = model(batch, chains=True)
        acc.add(stats.as_tensor())
        if hits is not None and len(hits):
            lengths.append(acceptance_length(hits))
    out = acc.summary()
    alen = torch.cat(lengths).double() if lengths else torch.ones(1, dtype=torch.float64)
    out["acceptance_length"] = float(alen.mean())
    # share of chains that reach each depth: the per-position acceptance of a greedy chain
    out["chain_survival"] = [float((alen > k + 1).double().mean()) for k in range(p.ttt_length)]
    return out


def train_drafter(
    p: TrainParams,
    inputs: TrainInputs,
    checkpoint_dir: Path | None = None,
    stop_after_steps: int | None = None,
    on_step: Callable[[dict], None] | None = None,
    on_epoch: Callable[[dict], None] | None = None,
    progress: bool = True,
) -> TrainOutcome | None:
    """Train a drafter; returns the outcome on rank 0 (None on other ranks or when stopped early).

    `stop_after_steps` ends the run after that many optimizer steps without finishing (as an
    interruption would; tests use it). `on_step` receives each step's curve row (rank 0).
    """
    d = init_distributed()
    device = torch.device(f"cuda:{d.local_rank}") if torch.cuda.is_available() else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if p.batch_size % d.world:
        raise ValueError(
            f"train.batch_size ({p.batch_size}) must be a multiple of the process count ({d.world})"
        )
    cfg = drafter_config(inputs.drafter_cfg, p)
    check_memory(cfg, p)
    torch.manual_seed(p.seed)
    random.seed(p.seed)
    np.random.seed(p.seed)
    store = inputs.store
    train_ids, held_ids = split_samples(len(store), p.heldout_fraction, p.seed)
    if p.max_samples is not None:  # a data-size curve: same held-out set, fewer training samples
        train_ids = train_ids[: p.max_samples]
    head_rows = inputs.head[torch.arange(cfg.draft_vocab_size) + inputs.d2t]  # the K draft rows
    in_draft = target_in_draft(store, train_ids + held_ids, inputs.head, inputs.t2d)
    train_src = BatchSource(store, train_ids, in_draft, p.seq_len)
    held_src = BatchSource(store, held_ids, in_draft, p.seq_len)

    master, use_autocast = precision(p, cfg)
    compute = torch.bfloat16 if use_autocast else master
    drafter = Eagle3Drafter(cfg, inputs.embed.to(compute)).to(master)
    drafter.embed_tokens.weight.data = inputs.embed.to(compute)
    drafter.set_vocab_mapping(inputs.d2t, inputs.t2d)
    init_head(drafter, head_rows, inputs.final_norm, p)
    model = TTTModel(drafter, head_rows.to(compute), p.ttt_length, p.ttt_decay).to(device)
    ddp_model = model
    if d.world > 1:
        ddp_model = torch.nn.parallel.DistributedDataParallel(
            model, device_ids=[device.index] if device.type == "cuda" else None, broadcast_buffers=False
        )
    params = [q for q in drafter.parameters() if q.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=p.lr, betas=(0.9, 0.95), weight_decay=p.weight_decay)
    n_batches = len(train_src.epoch_batches(0, p.seed, p.batch_size))
    total = p.epochs * n_batches
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(p.warmup_steps, total))

    step, start_epoch, start_batch = 0, 0, 0
    curve: list[dict] = []
    epochs: list[dict] = []
    epoch_acc = _Accumulator(p.ttt_length)
    ckpt_path = checkpoint_dir / CHECKPOINT if checkpoint_dir else None
    state, why = read_checkpoint(ckpt_path, inputs.run_key) if ckpt_path else (None, "")
    if why and d.main:
        Console(stderr=True).print(f"[yellow]train:[/] {escape(why)}", soft_wrap=True)
    if state is not None:
        drafter.load_state_dict(state["model"], strict=False)
        optimizer.load_state_dict(state["optimizer"])
        scheduler.load_state_dict(state["scheduler"])
        _set_rng_state(state["rng"])
        step, start_epoch, start_batch = state["step"], state["epoch"], state["batch"]
        curve, epochs = state["curve"], state["epochs"]
        epoch_acc.sums = state["epoch_sums"]

    def save_checkpoint(epoch: int, batch: int) -> None:
        if not (ckpt_path and d.main):
            return
        ckpt_path.parent.mkdir(parents=True, exist_ok=True)
        state = {
            "key": inputs.run_key,
            "model": trainable_state(drafter),
            "optimizer": optimizer.state_dict(),
            "scheduler": scheduler.state_dict(),
            "rng": _rng_state(),
            "step": step,
            "epoch": epoch,
            "batch": batch,
            "curve": curve,
            "epochs": epochs,
            "epoch_sums": epoch_acc.sums,
        }
        state["sha256"] = _digest(state)
        tmp = ckpt_path.with_suffix(".tmp")
        torch.save(state, tmp)
        os.replace(tmp, ckpt_path)

    flops_token = flops_per_token_step(drafter) * 3 * p.ttt_length  # forward + backward
    tokens_seen, started = 0, time.perf_counter()
    bar = _progress() if progress and d.main else None
    if bar:
        bar.start()
        task = bar.add_task(
            "train", total=total, completed=step, epoch=start_epoch, loss=0.0, acc=0.0, tok_s=0.0
        )
    try:
        for epoch in range(start_epoch, p.epochs):
            batches = train_src.epoch_batches(epoch, p.seed, p.batch_size)
            first = start_batch if epoch == start_epoch else 0
            if first == 0:
                epoch_acc = _Accumulator(p.ttt_length)
            for b in range(first, len(batches)):
                if stop_after_steps is not None and step >= stop_after_steps:
                    return None
                batch = train_src.batch(batches[b][d.rank :: d.world], None if use_autocast else master)
                batch = _to_device(batch, device)
                model.train()
                with torch.autocast(device.type, dtype=torch.bfloat16, enabled=use_autocast):
                    local_counts = torch.stack([_step_count(batch, k) for k in range(p.ttt_length)]).double()
                    norm = _all_reduce(local_counts, d).to(device)
                    loss, stats = ddp_model(batch, norm)
                (loss * d.world).backward()
                grad_norm = torch.nn.utils.clip_grad_norm_(params, p.grad_clip)
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad(set_to_none=True)
                step += 1
                reduced = _all_reduce(
                    torch.cat(
                        [
                            stats.as_tensor(),
                            torch.tensor([[batch.num_tokens] * p.ttt_length], dtype=torch.float64),
                        ]
                    ),
                    d,
                )
                epoch_acc.add(reduced[:3])
                tokens_seen += int(reduced[3, 0])
                seconds = time.perf_counter() - started
                row = _curve_row(step, epoch, scheduler.get_last_lr()[0], reduced[:3], float(grad_norm))
                curve.append(row)
                if d.main and on_step:
                    on_step(
                        row
                        | {
                            "tokens_per_s": tokens_seen / seconds,
                            "matmul_tflops": tokens_seen * flops_token / seconds / 1e12,
                        }
                    )
                if bar:
                    bar.update(
                        task,
                        completed=step,
                        epoch=epoch,
                        loss=row["loss"],
                        acc=row["acc_0"],
                        tok_s=tokens_seen / seconds,
                    )
                if step % p.checkpoint_every == 0:
                    save_checkpoint(epoch, b + 1)
                    _barrier(d)
            if d.main:
                held = evaluate(model, held_src, p, device)
                epochs.append({"epoch": epoch, "train": epoch_acc.summary(), "heldout": held})
                if on_epoch:
                    on_epoch(epochs[-1])
            save_checkpoint(epoch + 1, 0)
            _barrier(d)
    finally:
        if bar:
            bar.stop()
    seconds = time.perf_counter() - started
    if not d.main:
        return None
    last = epochs[-1]
    metrics = {
        "train": last["train"],
        "heldout": last["heldout"],
        "acceptance_length": last["heldout"]["acceptance_length"],
        "heldout_acc_0": last["heldout"]["acc"][0],
        "steps": step,
        "epochs": p.epochs,
        "train_tokens": train_src.num_tokens,
        "heldout_tokens": held_src.num_tokens,
        "processes": d.world,
        "dtype": "bfloat16" if use_autocast else str(master).removeprefix("torch."),
        "tokens_per_s": tokens_seen / seconds if tokens_seen else None,
        "matmul_tflops": tokens_seen * flops_token / seconds / 1e12 if tokens_seen else None,
        "chance_acc": 1.0 / cfg.draft_vocab_size,
    }
    return TrainOutcome(drafter=drafter, metrics=metrics, curve=curve, epochs=epochs)


def _step_count(batch: Batch, k: int) -> Tensor:
    return step_valid(batch, k).sum()


def _curve_row(step: int, epoch: int, lr: float, sums: Tensor, grad_norm: float) -> dict:
    loss, correct, count = sums
    count = count.clamp(min=1)
    row = {"step": step, "epoch": epoch, "lr": lr, "grad_norm": grad_norm}
    row["loss"] = float((loss / count).mean())  # unweighted mean over TTT positions
    for k in range(len(loss)):
        row[f"loss_{k}"] = float(loss[k] / count[k])
        row[f"acc_{k}"] = float(correct[k] / count[k])
    return row
