"""The training recipe: setup, train, evaluate, save and load checkpoints (torchtune's split).

AdamW with linear warmup and cosine decay to 10% of the peak, gradient clipping, bf16 autocast,
DDP under torchrun (distributed.py) and exact resumption (checkpoint.py): the batches are a pure
function of (seed, epoch), so a run resumed at (epoch, batch) replays what the uninterrupted one
did. The drafter config is taken as given (prepare.py applied the train params to it).
"""

from __future__ import annotations

import random
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import closing
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn
from torch import Tensor
from transformers import get_cosine_with_min_lr_schedule_with_warmup

from eagle3.core.inputs import InputError
from eagle3.core.params import TrainParams
from eagle3.drafter.cost import draft_step_flops
from eagle3.drafter.model import Eagle3Drafter
from eagle3.train.checkpoint import (
    CHECKPOINT,
    read_checkpoint,
    rng_state,
    set_rng_state,
    trainable_state,
    write_checkpoint,
)
from eagle3.train.data import (
    Batch,
    BatchSource,
    StoredFeatures,
    sample_lengths,
    split_samples,
    target_in_draft,
)
from eagle3.train.distributed import Dist, all_reduce, barrier, device_of, init_distributed
from eagle3.train.online import OnlineSource, prefetched
from eagle3.train.prepare import TrainInputs, drafter_config, precision
from eagle3.train.simulate import SHAPES, DraftShape, accepted_lengths, position_shares
from eagle3.train.ttt import LossConfig, StepStats, TTTModel, acceptance_length, loss_norm, step_valid
from eagle3.vocab import draft_to_target_ids, target_to_draft_slots

__all__ = ["CHECKPOINT", "TrainInputs", "TrainOutcome", "TrainRecipe", "train_drafter", "trainable_state"]

MIN_LR_RATE = 0.1  # the cosine decays to 10% of the peak


@dataclass
class TrainOutcome:
    drafter: Eagle3Drafter
    metrics: dict
    curve: list[dict] = field(default_factory=list)  # one row per optimizer step
    epochs: list[dict] = field(default_factory=list)  # held-out results after each epoch


def warmup_cosine(
    optimizer: torch.optim.Optimizer, warmup: int, total: int
) -> torch.optim.lr_scheduler.LambdaLR:
    """transformers' warmup + cosine to 10%, one step ahead: step s trains at (s+1)/(warmup+1) of the
    peak during warmup, so the first step is not spent at lr 0 (LRs bitwise equal to our former
    schedule, tests/test_train.py)."""
    for group in optimizer.param_groups:  # what a scheduler started at step 0 records
        group.setdefault("initial_lr", group["lr"])
    return get_cosine_with_min_lr_schedule_with_warmup(
        optimizer, warmup + 1, total + 1, min_lr_rate=MIN_LR_RATE, last_epoch=0
    )


class TrainRecipe:
    """One training run of a drafter. `setup()` builds everything and resumes from a checkpoint of
    this run; `train()` runs the epochs, evaluating after each, and returns the outcome on rank 0.
    Hooks `on_step(curve row)` and `on_epoch(epoch result)` run on rank 0 (tracking); an exception
    raised in one interrupts the run as a kill would, after the last checkpoint."""

    def __init__(
        self,
        p: TrainParams,
        inputs: TrainInputs,
        checkpoint_dir: Path | None = None,
        online: OnlineSource | None = None,
    ):
        self.p, self.inputs, self.online = p, inputs, online
        if inputs.store.online and online is None:
            raise ValueError(
                "the feature store holds tokens only (extract.features: online): give its source"
            )
        self.ckpt_path = checkpoint_dir / CHECKPOINT if checkpoint_dir else None
        self.cfg = inputs.drafter_cfg
        self._check_config()
        self.master, self.autocast = precision(p, self.cfg)
        # the training state, as checkpoints hold it
        self.step, self.epoch, self.batch_index = 0, 0, 0
        self.curve: list[dict] = []
        self.epochs: list[dict] = []
        self.epoch_sums = _Accumulator(self.positions)

    @property
    def positions(self) -> int:
        """The draft positions each loss and accuracy is reported per: the TTT steps."""
        return self.p.ttt_length

    def _check_config(self) -> None:
        if drafter_config(self.cfg, self.p) != self.cfg:
            raise ValueError(
                "the drafter config does not carry the train params (build it with drafter_config)"
            )

    def _flops_per_token(self) -> float:
        """Matmul FLOPs of one trained token, forward and backward (for the matmul_tflops figure)."""
        return draft_step_flops(self.drafter.cfg)["draft_step"] * 3 * self.p.ttt_length

    # --- setup -----------------------------------------------------------------------------------

    def setup(self) -> None:
        self.dist = init_distributed()
        self.device = device_of(self.dist)
        if self.p.batch_size % self.dist.world:
            raise ValueError(
                f"train.batch_size ({self.p.batch_size}) must be a multiple of the process count "
                f"({self.dist.world})"
            )
        _seed_everything(self.p.seed)
        self.init_check = None
        if self.inputs.init is not None:  # the fit check first: it needs the held-out split only
            self._setup_data(heldout_only=True)
            self._setup_model()
            # on the init weights, before a checkpoint is loaded: the same figure on a resume
            self.init_check = self.check_init() if self.dist.main else None
            self._setup_data()  # the target's argmax over all training data: the expensive part
        else:
            self._setup_data()
            self._setup_model()
        self._setup_optimizer()
        self.load_checkpoint()

    def _setup_data(self, heldout_only: bool = False) -> None:
        p, store = self.p, self.inputs.store
        train_ids, held_ids = split_samples(len(store), p.heldout_fraction, p.seed)
        if p.max_samples is not None:  # a data-size curve: same held-out set, fewer training samples
            train_ids = train_ids[: p.max_samples]
        if heldout_only:
            train_ids = []
        if store.online:  # features and the target's argmax come with each batch
            reader = self.online.features
        else:
            samples, fp = train_ids + held_ids, self.inputs.features_sha256
            in_draft = target_in_draft(store, samples, self.inputs.head, self.inputs.t2d, fp, self.dist)
            reader = StoredFeatures(store, in_draft)
        lengths = sample_lengths(store)
        self.train_src = BatchSource(reader, train_ids, lengths, p.seq_len)
        self.held_src = BatchSource(reader, held_ids, lengths, p.seq_len)

    def _setup_model(self) -> None:
        p, inputs = self.p, self.inputs
        compute = torch.bfloat16 if self.autocast else self.master
        head_rows = inputs.head[draft_to_target_ids(inputs.d2t)]  # the K draft rows
        drafter = Eagle3Drafter(self.cfg, inputs.embed.to(compute)).to(self.master)
        drafter.embed_tokens.weight.data = inputs.embed.to(compute)
        drafter.set_vocab_mapping(inputs.d2t, inputs.t2d)
        _init_head(drafter, head_rows, inputs.final_norm, p)
        if inputs.init is not None:  # warm start: every trained tensor is the init drafter's
            _load_init_weights(drafter, inputs.init.weights(), inputs.init.folder)
        self.drafter = drafter
        stored_topk = inputs.store.target_topk is not None  # the store holds the target's top-N
        topk_wanted = bool(p.target_topk) or stored_topk
        draft_slot = target_to_draft_slots(inputs.d2t, len(inputs.t2d)) if topk_wanted else None
        # top-N from last_hidden needs every lm_head row; a top-N store carries its top-N already
        full_head = inputs.head.to(compute) if p.target_topk and not stored_topk else None
        head_rows = head_rows.to(compute)
        self.model = TTTModel(drafter, head_rows, LossConfig.of(p), draft_slot, full_head).to(self.device)
        self.ddp_model = self.model
        if self.dist.world > 1:
            self.ddp_model = torch.nn.parallel.DistributedDataParallel(
                self.model,
                device_ids=[self.device.index] if self.device.type == "cuda" else None,
                broadcast_buffers=False,
            )

    def _setup_optimizer(self) -> None:
        p = self.p
        self.params = [q for q in self.drafter.parameters() if q.requires_grad]
        self.optimizer = torch.optim.AdamW(
            self.params, lr=p.lr, betas=(0.9, 0.95), weight_decay=p.weight_decay
        )
        self.total_steps = p.epochs * len(self.train_src.epoch_batches(0, p.seed, p.batch_size))
        self.scheduler = warmup_cosine(self.optimizer, p.warmup_steps, self.total_steps)

    # --- checkpoints -----------------------------------------------------------------------------

    def load_checkpoint(self) -> None:
        """Resume from this run's checkpoint, if there is an intact one (else say why not)."""
        if self.ckpt_path is None:
            return
        state, why = read_checkpoint(self.ckpt_path, self.inputs.run_key)
        if why and self.dist.main:
            Console(stderr=True).print(f"[yellow]train:[/] {escape(why)}", soft_wrap=True)
        if state is None:
            return
        self.drafter.load_state_dict(state["model"], strict=False)
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        set_rng_state(state["rng"])
        self.step, self.epoch, self.batch_index = state["step"], state["epoch"], state["batch"]
        self.curve, self.epochs = state["curve"], state["epochs"]
        self.epoch_sums.sums = state["epoch_sums"]
        if self.dist.main:
            Console(stderr=True).print(
                f"[bold]train:[/] resuming {escape(str(self.ckpt_path))} at step {self.step} "
                f"(epoch {self.epoch}, batch {self.batch_index})",
                soft_wrap=True,
            )

    def save_checkpoint(self) -> None:
        """The state after the current batch (rank 0 writes; every rank waits for it)."""
        if self.ckpt_path is not None and self.dist.main:
            state = {
                "key": self.inputs.run_key,
                "model": trainable_state(self.drafter),
                "optimizer": self.optimizer.state_dict(),
                "scheduler": self.scheduler.state_dict(),
                "rng": rng_state(),
                "step": self.step,
                "epoch": self.epoch,
                "batch": self.batch_index,
                "curve": self.curve,
                "epochs": self.epochs,
                "epoch_sums": self.epoch_sums.sums,
            }
            write_checkpoint(self.ckpt_path, state)
        barrier(self.dist)

    # --- train -----------------------------------------------------------------------------------

    def train(
        self,
        on_step: Callable[[dict], None] | None = None,
        on_epoch: Callable[[dict], None] | None = None,
    ) -> TrainOutcome | None:
        """Run the remaining epochs; the outcome on rank 0, None on the others."""
        self._tokens_seen, self._started = 0, time.perf_counter()
        self._flops_token = self._flops_per_token()
        self._bar = _progress(self.total_steps, self.step, self.epoch) if self._show_progress() else None
        try:
            while self.epoch < self.p.epochs:
                if self.batch_index == 0:  # a new epoch (not one resumed mid-way)
                    self.epoch_sums = _Accumulator(self.positions)
                self._train_epoch(on_step)
                if self.dist.main:
                    held = self.evaluate()
                    self.epochs.append(
                        {"epoch": self.epoch, "train": self.epoch_sums.summary(), "heldout": held}
                    )
                    if on_epoch:
                        on_epoch(self.epochs[-1])
                self.epoch, self.batch_index = self.epoch + 1, 0
                self.save_checkpoint()
        finally:
            if self._bar:
                self._bar[0].stop()
        return self._outcome() if self.dist.main else None

    def _show_progress(self) -> bool:
        return self.dist.main and sys.stderr.isatty()

    def _train_epoch(self, on_step: Callable[[dict], None] | None) -> None:
        batches = self.train_src.epoch_batches(self.epoch, self.p.seed, self.p.batch_size)
        rows = [b[self.dist.rank :: self.dist.world] for b in batches[self.batch_index :]]
        with closing(self._batches(self.train_src, rows)) as ahead:
            for batch in ahead:
                row = self._train_step(batch)
                self.batch_index += 1
                self.curve.append(row)
                self._report(row, on_step)
                if self.step % self.p.checkpoint_every == 0:
                    self.save_checkpoint()

    def _batches(self, source: BatchSource, rows: Sequence[list[int]]) -> Iterator[Batch]:
        """The batches of these rows, in order: read as they are needed from a store; from an
        online store computed on a background thread, online.prefetch_batches ahead."""
        dtype = None if self.autocast else self.master

        def make(samples: list[int]) -> Batch:
            return source.batch(samples, dtype)

        if self.online is not None:
            return prefetched(make, rows, self.online.prefetch_batches)
        return (make(r) for r in rows)

    def _train_step(self, batch: Batch) -> dict:
        """One optimizer step on this rank's rows; returns the step's curve row (global sums)."""
        p, d = self.p, self.dist
        batch = _to_device(batch, self.device)
        self.model.train()
        with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.autocast):
            local_counts = torch.stack(
                [step_valid(batch, k, p.loss_positions).sum() for k in range(p.ttt_length)]
            ).double()
            norm = all_reduce(loss_norm(batch, local_counts, p.loss_average), d).to(self.device)
            loss, stats = self.ddp_model(batch, norm)
        (loss * d.world).backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(self.params, p.grad_clip)
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.step += 1
        summed, tokens = _all_reduced(stats, batch.num_tokens, d, self.device)
        self.epoch_sums.add(summed)
        self._tokens_seen += tokens
        return _curve_row(self.step, self.epoch, self.scheduler.get_last_lr()[0], summed, float(grad_norm))

    def _report(self, row: dict, on_step: Callable[[dict], None] | None) -> None:
        seconds = time.perf_counter() - self._started
        tokens = self._tokens_seen
        tok_s = tokens / seconds
        if self.dist.main and on_step:
            on_step(
                row | {"tokens_per_s": tok_s, "matmul_tflops": tokens * self._flops_token / seconds / 1e12}
            )
        if self._bar:
            bar, task = self._bar
            bar.update(
                task, completed=self.step, epoch=self.epoch, loss=row["loss"], acc=row["acc_0"], tok_s=tok_s
            )

    # --- evaluate --------------------------------------------------------------------------------

    @torch.no_grad()
    def evaluate(self) -> dict:
        """Held-out loss/accuracy per TTT position and the simulated acceptance length."""
        p, source = self.p, self.held_src
        acc = _Accumulator(p.ttt_length)
        lengths = []
        # the eval's draft shapes, as deep as the drafter was trained (train/simulate.py)
        shapes = tuple(s for s in SHAPES if s.depth <= p.ttt_length)
        simulated: dict[str, list[torch.Tensor]] = {s.name: [] for s in shapes}
        with closing(self._batches(source, source.fixed_batches(p.batch_size))) as ahead:
            for batch in ahead:
                batch = _to_device(batch, self.device)
                with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.autocast):
                    _, stats, hits = self.model(batch, chains=True)
                    for name, lengths_of_shape in accepted_lengths(self.model, batch, shapes).items():
                        simulated[name].append(lengths_of_shape.cpu())
                acc.add(stats)
                if hits is not None and len(hits):
                    lengths.append(acceptance_length(hits).cpu())
        out = acc.summary()
        alen = torch.cat(lengths).double() if lengths else torch.ones(1, dtype=torch.float64)
        out["acceptance_length"] = float(alen.mean())
        out["sim_acceptance"] = {
            name: float(torch.cat(v).double().mean()) for name, v in simulated.items() if v
        }
        # each shape's accepted drafts by position, as speculative-eval's per_position_acceptance
        depth = {s.name: s.depth for s in shapes}
        out["sim_per_position"] = {
            name: position_shares(torch.cat(v) - 1, depth[name]) for name, v in simulated.items() if v
        }
        if p.ttt_length > max(depth.values(), default=0):  # past simulate.py's depth: the unroll's chains
            chain = DraftShape(p.ttt_length, 1, p.ttt_length).name
            out["sim_per_position"][chain] = position_shares(alen - 1, p.ttt_length)
        # share of chains that reach each depth: the per-position acceptance of a greedy chain
        out["chain_survival"] = [float((alen > k + 1).double().mean()) for k in range(p.ttt_length)]
        return out

    def check_init(self) -> dict:
        """Does the warm-start drafter fit this target at all? Its held-out top-1 and simulated
        acceptance as it is (seconds, no decoding); refused below train.init_min_acc."""
        init, p = self.inputs.init, self.p
        held = self.evaluate()
        acc, length = held["acc"][0], held["acceptance_length"]
        recorded = (init.recorded.get("train") or {}).get("heldout_acc_0")
        line = (
            f"train.init {init.folder} before training: held-out top-1 {acc:.3f}, simulated acceptance "
            f"length {length:.2f}"
            + (f" (it recorded {recorded:.3f} on the data it was trained on)" if recorded is not None else "")
        )
        if acc < p.init_min_acc:
            raise InputError(
                f"{line}: below train.init_min_acc {p.init_min_acc}, so it was made for another model or "
                "data; train.init: null trains from scratch, train.init_min_acc: 0 fine-tunes it anyway"
            )
        Console(stderr=True).print(f"[bold]train:[/] {escape(line)}", soft_wrap=True)
        return {
            "heldout_acc_0": acc,
            "acceptance_length": length,
            "recorded_heldout_acc_0": recorded,
            "sim_acceptance": held["sim_acceptance"],
        }

    def _outcome(self) -> TrainOutcome:
        seconds = time.perf_counter() - self._started
        tokens = self._tokens_seen
        last = self.epochs[-1]
        metrics = {
            "train": last["train"],
            "heldout": last["heldout"],
            "acceptance_length": last["heldout"]["acceptance_length"],
            "heldout_acc_0": last["heldout"]["acc"][0],
            "steps": self.step,
            "epochs": self.p.epochs,
            "train_tokens": self.train_src.num_tokens,
            "heldout_tokens": self.held_src.num_tokens,
            "processes": self.dist.world,
            "dtype": "bfloat16" if self.autocast else str(self.master).removeprefix("torch."),
            "tokens_per_s": tokens / seconds if tokens else None,
            "matmul_tflops": tokens * self._flops_token / seconds / 1e12 if tokens else None,
            "chance_acc": 1.0 / self.cfg.draft_vocab_size,
            "init": self.init_check,
        }
        # handed back on the CPU, where export and the callers read it (a no-op on a CPU run)
        drafter = self.drafter.cpu()
        return TrainOutcome(drafter=drafter, metrics=metrics, curve=self.curve, epochs=self.epochs)


def train_drafter(
    p: TrainParams,
    inputs: TrainInputs,
    checkpoint_dir: Path | None = None,
    on_step: Callable[[dict], None] | None = None,
    on_epoch: Callable[[dict], None] | None = None,
    online: OnlineSource | None = None,
) -> TrainOutcome | None:
    """Set up and run a training recipe: the outcome on rank 0, None on other ranks; `online`:
    where an online store's features come from."""
    recipe = TrainRecipe(p, inputs, checkpoint_dir, online)
    recipe.setup()
    return recipe.train(on_step, on_epoch)


def _seed_everything(seed: int) -> None:
    torch.manual_seed(seed)
    random.seed(seed)
    np.random.seed(seed)


def _init_head(drafter: Eagle3Drafter, head_rows: Tensor, final_norm: Tensor | None, p: TrainParams) -> None:
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


def _load_init_weights(drafter: Eagle3Drafter, weights: dict[str, Tensor], folder: str) -> None:
    """The init drafter's tensors into the freshly built one, refusing a layout that differs."""
    own = {k for k in drafter.state_dict() if k not in ("d2t", "t2d", "embed_tokens.weight")}
    missing, unexpected = own - set(weights), set(weights) - own
    if missing or unexpected:
        raise InputError(
            f"train.init: {folder}/model.safetensors does not match the drafter's layout "
            f"(missing {sorted(missing)}, unexpected {sorted(unexpected)})"
        )
    state = drafter.state_dict()
    with torch.no_grad():
        for name, tensor in weights.items():
            if tuple(tensor.shape) != tuple(state[name].shape):
                raise InputError(
                    f"train.init: {folder}: {name} has shape {tuple(tensor.shape)}, "
                    f"the drafter's config says {tuple(state[name].shape)}"
                )
            state[name].copy_(tensor)


def _to_device(batch: Batch, device: torch.device) -> Batch:
    return batch if device.type == "cpu" else batch.to(device)


def _all_reduced(stats: StepStats, tokens: int, d: Dist, device: torch.device) -> tuple[StepStats, int]:
    """A step's statistics and its token count summed over the ranks, in one all-reduce: on the
    step's device (NCCL reduces GPU tensors only), read on the CPU."""
    steps = len(stats.count)
    tokens_row = torch.tensor([[tokens] * steps], dtype=torch.float64, device=device)
    reduced = all_reduce(torch.cat([stats.as_tensor(), tokens_row]), d).cpu()
    summed, tokens_summed = reduced[: StepStats.ROWS], reduced[StepStats.ROWS]
    return StepStats.from_tensor(summed), int(tokens_summed[0])


class _Accumulator:
    """Per-TTT-position sums of StepStats, kept as its tensor (what a checkpoint holds)."""

    def __init__(self, steps: int):
        self.sums = torch.zeros(StepStats.ROWS, steps, dtype=torch.float64)

    def add(self, stats: StepStats) -> None:
        self.sums += stats.as_tensor().cpu()

    def summary(self) -> dict:
        sums = StepStats.from_tensor(self.sums)
        count = sums.count.clamp(min=1)
        return {
            "loss": (sums.loss_sum / count).tolist(),
            "acc": (sums.correct / count).tolist(),
            "positions": sums.count.long().tolist(),
        }


def _progress(total: int, done: int, epoch: int) -> tuple[Progress, int]:
    bar = Progress(
        TextColumn("[bold]train[/] ep {task.fields[epoch]}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn(
            "loss {task.fields[loss]:.3f}  acc0 {task.fields[acc]:.3f}  {task.fields[tok_s]:,.0f} tok/s"
        ),
        TimeRemainingColumn(),
    )
    bar.start()
    return bar, bar.add_task("train", total=total, completed=done, epoch=epoch, loss=0.0, acc=0.0, tok_s=0.0)


def _curve_row(step: int, epoch: int, lr: float, sums: StepStats, grad_norm: float) -> dict:
    loss, correct, count = sums.loss_sum, sums.correct, sums.count.clamp(min=1)
    row = {"step": step, "epoch": epoch, "lr": lr, "grad_norm": grad_norm}
    row["loss"] = float((loss / count).mean())  # unweighted mean over TTT positions
    for k in range(len(loss)):
        row[f"loss_{k}"] = float(loss[k] / count[k])
        row[f"acc_{k}"] = float(correct[k] / count[k])
    return row
