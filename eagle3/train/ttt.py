"""Training-time test (TTT): the drafter unrolled `ttt_length` steps on its own hidden states.

Alignment (EAGLE): at step k the query at position t embeds token t+1+k, reads the hidden
state of step k-1 (step 0: fc(aux_hidden[t])), sits at position pos[t] + k, and is trained to
match the target's next-token distribution at position t+1+k (softmax of the frozen target
lm_head applied to last_hidden, restricted to the K draft rows). With `target_topk` = N it
matches only the target's top-N over the full vocabulary (renormalised over those inside the
draft vocab). A top-N store (SGLang's top logprobs, stored in place of last_hidden) carries
exactly that top-N, which is then the target as it is.

Attention of step k (what the drafter sees when drafting the (k+1)-th token at inference):
the step-0 keys up to t (the prefix, built from target features) plus its own keys of steps
1..k at the same position t (its earlier drafts). A TTTCache carries the keys of earlier
steps, so inference and training run the very same `Eagle3Drafter.forward`.

Loss of step k: soft cross-entropy over positions whose target position is an assistant token
of the same sample and whose target argmax lies inside the draft vocabulary, normalised by
the number of such positions in the global (all ranks) batch, weighted by decay^k.
Two conventions of the official EAGLE-3 trainer (SafeAILab/EAGLE eagle/traineagle3) differ at
the turn boundary and in that normalisation; train.loss_positions and train.loss_average
choose (eagle3/core/params.py; measured in
docs/results/2026-12-05-1249-turn-boundary-loss-average-two-seeds.md: no difference, defaults kept).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, get_args

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from eagle3.core.params import LossAverage, LossPositions, TrainParams
from eagle3.drafter.model import Eagle3Drafter
from eagle3.drafter.ttt_attention import TTTCache
from eagle3.train.data import Batch

# The head runs on the positions that count, padded to a multiple of this many rows: their
# number differs every batch, and each new row count made oneDNN build and cache new kernels
# whose churn fragmented the heap (peak RSS grew with the steps taken;
# docs/results/2026-12-04-0920-train-memory-growth.md).
ROW_MULTIPLE = 64
# The positions step_valid counts: those training can count at (train.loss_positions), and drafted,
# the tokens decoding drafts, which bench/heldout.py measures every drafter on.
CountedPositions = Literal[LossPositions, "drafted"]


def shift_left(x: Tensor, n: int, fill: int | bool = 0) -> Tensor:
    """x[:, t + n] at index t (along dim 1), `fill` past the end."""
    if n == 0:
        return x
    pad = torch.full_like(x[:, :n], fill)
    return torch.cat([x[:, n:], pad], dim=1)


def step_valid(batch: Batch, k: int, positions: CountedPositions = "after_assistant") -> Tensor:
    """[B, T] bool: position t has a trainable target at step k. Step k at t drafts token
    t+2+k from the target's prediction at t+1+k; `positions` (train.loss_positions) says which
    of those count: after_assistant = token t+1+k is an assistant token, assistant = the
    drafted token t+2+k is one, drafted = both (what decoding drafts: neither the answer's
    first token, which the target's prefill gives, nor the one after its end of turn)."""
    # rows are right-padded, so "the target position is real" also means "same sample"
    n = 1 + k
    valid = shift_left(batch.real, n, False) & shift_left(batch.in_draft, n, False)
    if positions in ("after_assistant", "drafted"):
        valid = valid & shift_left(batch.loss_mask, n, False)
    if positions in ("assistant", "drafted"):
        valid = valid & shift_left(batch.loss_mask, n + 1, False)
    if positions not in (allowed := get_args(CountedPositions)):
        raise ValueError(f"positions {positions!r}: use {', '.join(allowed[:-1])} or {allowed[-1]}")
    return valid


def loss_norm(batch: Batch, counts: Tensor, average: LossAverage = "token") -> Tensor:
    """[L]: what each TTT step's summed loss is divided by, from this batch's counted positions
    per step `counts` [L] (train.loss_average): token = those counts; row = the official
    trainer's mean over its padded [B, T] batch (T = the longest row, as its collator pads),
    the same for every step."""
    if average == "token":
        return counts
    if average not in get_args(LossAverage):
        raise ValueError(f"average {average!r}: use {' or '.join(get_args(LossAverage))}")
    padded = batch.real.shape[0] * batch.real.sum(dim=1).max()
    return torch.full_like(counts, float(padded))


@dataclass(frozen=True)
class LossConfig:
    """What the TTT loss is over: `ttt_length` steps, step k weighted decay**k; the positions
    that count (step_valid: train.loss_positions, or drafted to measure what decoding drafts);
    what a step's summed loss is divided by (loss_norm: train.loss_average); and, with
    `target_topk` n > 0, the target's top-n only (0: all the batch carries)."""

    ttt_length: int
    decay: float
    positions: CountedPositions = "after_assistant"
    average: LossAverage = "token"
    target_topk: int = 0

    def __post_init__(self) -> None:
        for name, kind in (("positions", CountedPositions), ("average", LossAverage)):
            if getattr(self, name) not in (allowed := get_args(kind)):
                raise ValueError(f"loss {name} {getattr(self, name)!r}: use one of {', '.join(allowed)}")

    @classmethod
    def of(cls, p: TrainParams) -> LossConfig:
        """The loss the train params ask for."""
        return cls(p.ttt_length, p.ttt_decay, p.loss_positions, p.loss_average, p.target_topk or 0)


@dataclass
class StepStats:
    """Per TTT position, summed over a batch: loss, correct top-1, counted positions. As one
    tensor (as_tensor, from_tensor) the three are its rows, in that order: what is all-reduced
    and what a checkpoint keeps."""

    loss_sum: Tensor  # float64 [L]
    correct: Tensor  # float64 [L]
    count: Tensor  # float64 [L]

    ROWS = 3  # as_tensor's rows

    def as_tensor(self) -> Tensor:
        return torch.stack([self.loss_sum, self.correct, self.count])

    @classmethod
    def from_tensor(cls, rows: Tensor) -> StepStats:
        loss_sum, correct, count = rows
        return cls(loss_sum, correct, count)


def draft_distribution(top: Tensor, ids: Tensor, draft_slot: Tensor, draft_size: int) -> Tensor:
    """[..., K] probabilities from the target's top-n (logits or logprobs `top` [..., n] of target
    ids `ids`): those inside the draft vocab kept and renormalised (draft_slot [V]: draft id of
    a target id, -1 if none)."""
    slots = draft_slot[ids]
    p = top.float().softmax(-1) * (slots >= 0)
    p = p / p.sum(-1, keepdim=True).clamp_min(1e-30)
    out = p.new_zeros(*p.shape[:-1], draft_size)
    return out.scatter_add_(-1, slots.clamp_min(0), p)  # p is 0 wherever the slot was -1


def topk_target(
    last_hidden: Tensor, full_head: Tensor, draft_slot: Tensor, n: int, draft_size: int | None = None
) -> Tensor:
    """[B, T, K]: the target's top-n tokens over its whole vocabulary (from last_hidden),
    renormalised over the draft vocab (draft_size K, else read from draft_slot, which costs a
    pass over it and a device sync)."""
    top, ids = (last_hidden.to(full_head.dtype) @ full_head.T).float().topk(n, dim=-1)
    return draft_distribution(top, ids, draft_slot, draft_size or int(draft_slot.max()) + 1)


class TTTModel(nn.Module):
    """The drafter plus the frozen K target lm_head rows; forward = the whole TTT unroll.

    Wrapping the unroll in one module keeps DDP correct: DDP hooks see one forward per step.
    """

    def __init__(
        self,
        drafter: Eagle3Drafter,
        target_head_rows: Tensor,
        loss: LossConfig,
        draft_slot: Tensor | None = None,  # [V]: draft id of a target id, -1 if none (top-N targets)
        full_head: Tensor | None = None,  # the target lm_head [V, H]: top-n from last_hidden
    ):
        super().__init__()
        self.drafter = drafter
        self.register_buffer("head_rows", target_head_rows, persistent=False)  # [K, H]
        self.loss = loss
        if draft_slot is not None:
            self.register_buffer("draft_slot", draft_slot, persistent=False)
        if full_head is not None:
            self.register_buffer("full_head", full_head, persistent=False)

    def _targets(self, batch: Batch, b: Tensor, t: Tensor, soft: Tensor | None, logits: Tensor | None):
        """(wanted [n, K] distribution, the target's top-1 draft slot [n]) at positions (b, t)."""
        if batch.topk_ids is not None:  # a top-N store: the target's prediction as stored
            n = self.loss.target_topk or batch.topk_ids.shape[-1]
            ids, top = batch.topk_ids[b, t, :n], batch.topk_logprobs[b, t, :n]
            wanted = draft_distribution(top, ids, self.draft_slot, len(self.head_rows))
            return wanted, self.draft_slot[ids[:, 0]]
        target = logits[b, t].float()
        return (target.softmax(-1) if soft is None else soft[b, t]), target.argmax(-1)

    def forward(self, batch: Batch, norm: Tensor | None = None, chains: bool = False):
        """Returns (weighted loss, StepStats[, correct chains [N0, L] for acceptance]).

        `norm` [L]: what each step's summed loss is divided by over the global batch (defaults
        to this batch's, loss_norm).
        """
        L, m, topk_n = self.loss.ttt_length, self.drafter, self.loss.target_topk
        valid = [step_valid(batch, k, self.loss.positions) for k in range(L)]
        counts = torch.stack([v.sum() for v in valid]).double()
        norm = loss_norm(batch, counts, self.loss.average) if norm is None else norm
        target_logits = soft = None
        if batch.last_hidden is not None:
            with torch.no_grad():
                target_logits = batch.last_hidden.to(self.head_rows.dtype) @ self.head_rows.T  # [B, T, K]
                if topk_n:
                    soft = topk_target(
                        batch.last_hidden, self.full_head, self.draft_slot, topk_n, len(self.head_rows)
                    )
        hidden = m.project(batch.aux_hidden)
        cache = TTTCache()
        loss = hidden.new_zeros((), dtype=torch.float32)
        loss_sum, correct = (torch.zeros(L, dtype=torch.float64, device=counts.device) for _ in range(2))
        start = valid[0].nonzero(as_tuple=True) if chains else None
        chain_hits = []
        for k in range(L):
            ids = shift_left(batch.input_ids, 1 + k)
            hidden = m(ids, hidden, batch.position_ids + k, cache)
            b, t = valid[k].nonzero(as_tuple=True)
            if len(b):
                logits = head_logits(m, hidden, b, t).float()
                with torch.no_grad():
                    wanted, target_top1 = self._targets(batch, b, t + 1 + k, soft, target_logits)
                step_loss = F.cross_entropy(logits, wanted, reduction="sum")
                loss = loss + (self.loss.decay**k) * step_loss / norm[k].clamp(min=1).to(loss.dtype)
                hit = logits.argmax(-1) == target_top1
                loss_sum[k] = step_loss.detach().double()
                correct[k] = hit.sum().double()
            if chains:
                hits = torch.zeros_like(valid[k])
                if len(b):
                    hits[b, t] = hit
                chain_hits.append(hits[start])
        stats = StepStats(loss_sum, correct, counts)
        if chains:
            return loss, stats, torch.stack(chain_hits, dim=-1) if chain_hits else None
        return loss, stats


def head_logits(m: Eagle3Drafter, hidden: Tensor, b: Tensor, t: Tensor) -> Tensor:
    """The drafter's logits at positions (b, t) of `hidden` [B, T, H]: computed on ROW_MULTIPLE
    rows at a time (the last position repeated), the repeats dropped."""
    short = -len(b) % ROW_MULTIPLE
    if short:
        b, t = torch.cat([b, b[-1:].expand(short)]), torch.cat([t, t[-1:].expand(short)])
    return m.logits(hidden[b, t])[: len(b) - short]


def acceptance_length(chain_hits: Tensor) -> Tensor:
    """Simulated tokens per verification for each start position: 1 (the target's own token)
    plus the leading run of steps whose draft top-1 equals the target's top-1."""
    return 1 + chain_hits.long().cumprod(dim=-1).sum(dim=-1)
