"""The DFlash block-wise loss: anchors drawn in each sample, a block of masked positions after
each anchor, every block drafted in parallel in one drafter forward.

As SpecForge's OnlineDFlashModel (specforge/core/dflash.py) trains it:
- anchors: up to `anchors` distinct positions a of a sample whose token is an assistant token
  (an answer token is what decoding anchors a block on) with a + 1 inside the sample, drawn
  uniformly without replacement from a generator seeded by (train.seed, epoch, sample): the same
  anchors on a resumed run and at any process count;
- a block: [token a, mask x (block_size - 1)] at positions a .. a + block_size - 1. Its queries see
  the context (the target layers' features) of positions < a only, and the whole block both ways;
  blocks never see each other;
- the loss: block position k >= 1 drafts the token at a + k; it counts where that token is an
  assistant token inside the sample, weighted exp(-(k - 1) / loss_decay), and the step's loss is
  the weighted mean over the global batch.

One departure, the one this project's EAGLE-3 trainer makes too (eagle3/train/ttt.py): the label of
position k is the target's own distribution over the token at a + k (softmax of the frozen lm_head
on the target's final state at a + k - 1, or the top-N a top-logprobs store carries), not the data's
token. The drafter's logits come from the same frozen lm_head, so acceptance, which compares the
drafter's argmax with the target's, is what both learn.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from eagle3.drafter.dflash import DFlashDrafter
from eagle3.train.data import Batch
from eagle3.train.ttt import ROW_MULTIPLE, StepStats, draft_distribution


def anchor_seed(seed: int, epoch: int, sample: int) -> int:
    """The generator seed of one sample's anchors in one epoch (epoch -1: held-out evaluation)."""
    return ((seed * 1_000_003 + epoch + 1) * 1_000_033 + sample) % (2**63)


def sample_anchors(loss_mask: Tensor, length: int, count: int, generator: torch.Generator) -> Tensor:
    """Sorted anchor positions [n <= count] of one sample: assistant tokens a with a + 1 < length."""
    candidates = loss_mask[: max(length - 1, 0)].nonzero().flatten()
    if len(candidates) > count:
        pick = torch.randperm(len(candidates), generator=generator)[:count]
        candidates = candidates[pick.sort().values]
    return candidates


def batch_anchors(
    batch: Batch, samples: list[int], count: int, seed: int, epoch: int
) -> tuple[Tensor, Tensor]:
    """(anchors [B, N] int64, keep [B, N] bool) for the batch's rows, sample ids `samples`; rows
    with fewer anchors are padded with 0 and keep False."""
    lengths = batch.real.sum(dim=1).tolist()
    rows = [
        sample_anchors(
            batch.loss_mask[r].cpu(), n, count, torch.Generator().manual_seed(anchor_seed(seed, epoch, s))
        )
        for r, (s, n) in enumerate(zip(samples, lengths, strict=True))
    ]
    width = max(1, max(len(a) for a in rows))
    anchors = torch.zeros(len(rows), width, dtype=torch.int64)
    keep = torch.zeros(len(rows), width, dtype=torch.bool)
    for r, a in enumerate(rows):
        anchors[r, : len(a)], keep[r, : len(a)] = a, True
    device = batch.input_ids.device
    return anchors.to(device), keep.to(device)


def block_mask(anchors: Tensor, keep: Tensor, real: Tensor, block: int) -> Tensor:
    """[B, 1, N * block, T + N * block] bool: block n's queries see context keys j < anchor_n
    (real tokens) and the keys of their own block; a padded anchor (keep False) sees its block only."""
    b, n = anchors.shape
    t = real.shape[1]
    q_anchor = anchors.repeat_interleave(block, dim=1)  # [B, Q]
    q_keep = keep.repeat_interleave(block, dim=1)
    j = torch.arange(t, device=anchors.device)
    context = (j[None, None, :] < q_anchor[:, :, None]) & real[:, None, :] & q_keep[:, :, None]
    q_block = torch.arange(n * block, device=anchors.device) // block
    own = q_block[:, None] == q_block[None, :]  # [Q, Q]
    return torch.cat([context, own[None].expand(b, -1, -1)], dim=2)[:, None]


def position_weights(block: int, gamma: float | None, device: torch.device | None = None) -> Tensor:
    """[block - 1] loss weight of positions 1..block-1: exp(-(k - 1) / gamma), or 1 (gamma None)."""
    k = torch.arange(block - 1, dtype=torch.float32, device=device)
    return torch.ones_like(k) if gamma is None else torch.exp(-k / gamma)


class BlockModel(nn.Module):
    """The drafter with the target's frozen embedding and lm_head; forward = every block of a batch."""

    def __init__(
        self,
        drafter: DFlashDrafter,
        embed: Tensor,
        head: Tensor,
        loss_decay: float | None,
    ):
        super().__init__()
        self.drafter = drafter
        self.block, self.mask_id = drafter.cfg.block_size, drafter.cfg.mask_token_id
        self.register_buffer("embed", embed, persistent=False)  # [V, H]
        self.register_buffer("head", head, persistent=False)  # [V, H]
        self.register_buffer("weights", position_weights(self.block, loss_decay), persistent=False)

    @property
    def positions(self) -> int:
        return self.block - 1

    def label_rows(self, batch: Batch, anchors: Tensor, keep: Tensor) -> tuple[Tensor, ...]:
        """(b, n, k, p) of every counted label: row b, anchor n, block position k - 1 (0-based),
        token position p = anchor + k inside the sample and an assistant token."""
        b, t = batch.input_ids.shape
        k = torch.arange(1, self.block, device=anchors.device)
        p = anchors[:, :, None] + k  # [B, N, L-1]
        inside = p < t
        pc = p.clamp(max=t - 1)
        rows = torch.arange(b, device=anchors.device)[:, None, None]
        valid = keep[:, :, None] & inside & batch.real[rows, pc] & batch.loss_mask[rows, pc]
        bi, ni, ki = valid.nonzero(as_tuple=True)
        return bi, ni, ki, p[bi, ni, ki], valid

    def target(self, batch: Batch, b: Tensor, p: Tensor) -> tuple[Tensor, Tensor]:
        """(the target's distribution [M, V] over the token at p, its argmax [M]), from its
        prediction at p - 1."""
        if batch.topk_ids is not None:  # a top-N store: the target's prediction as stored
            ids, top = batch.topk_ids[b, p - 1], batch.topk_logprobs[b, p - 1]
            vocab = self.head.shape[0]
            identity = torch.arange(vocab, device=ids.device)
            return draft_distribution(top, ids, identity, vocab), ids[:, 0]
        logits = (batch.last_hidden[b, p - 1].to(self.head.dtype) @ self.head.T).float()
        return logits.softmax(-1), logits.argmax(-1)

    def forward(
        self, batch: Batch, anchors: Tensor, keep: Tensor, norm: Tensor | None = None, chains: bool = False
    ) -> tuple:
        """(loss, StepStats over the block positions 1..block-1[, hits [kept anchors, block-1]]);
        `norm`: the summed position weights of the global batch (default: this batch's)."""
        drafter, block = self.drafter, self.block
        b, n = anchors.shape
        context = drafter.context(batch.aux_hidden, batch.position_ids)
        ids = torch.full((b, n, block), self.mask_id, dtype=torch.int64, device=anchors.device)
        ids[:, :, 0] = batch.input_ids.gather(1, anchors)
        embeds = self.embed[ids.view(b, n * block)]
        positions = (anchors[:, :, None] + torch.arange(block, device=anchors.device)).view(b, n * block)
        mask = block_mask(anchors, keep, batch.real, block)
        hidden = drafter(embeds, positions, context, mask).view(b, n, block, -1)
        bi, ni, ki, p, valid = self.label_rows(batch, anchors, keep)
        w = self.weights[ki]
        norm = w.sum() if norm is None else norm
        L = self.positions
        zeros = torch.zeros(L, dtype=torch.float64, device=anchors.device)
        loss_sum, correct = zeros.clone(), zeros.clone()
        counts = torch.bincount(ki, minlength=L).double()
        loss = hidden.new_zeros((), dtype=torch.float32)
        hit = torch.zeros(0, dtype=torch.bool, device=anchors.device)
        if len(bi):
            logits = head_logits(hidden[bi, ni, ki + 1], self.head).float()
            with torch.no_grad():
                wanted, target_top1 = self.target(batch, bi, p)
            ce = F.cross_entropy(logits, wanted, reduction="none")
            loss = (ce * w).sum() / norm.clamp(min=1e-6).to(ce.dtype)
            hit = logits.argmax(-1) == target_top1
            loss_sum.index_add_(0, ki, ce.detach().double())
            correct.index_add_(0, ki, hit.double())
        stats = StepStats(loss_sum, correct, counts)
        if not chains:
            return loss, stats
        hits = torch.zeros_like(valid)
        hits[bi, ni, ki] = hit
        return loss, stats, hits[keep]


def head_logits(rows: Tensor, head: Tensor) -> Tensor:
    """Logits [M, V] of hidden rows [M, H] through the target's head, computed on a multiple of
    ROW_MULTIPLE rows (the last repeated) so that oneDNN sees few distinct shapes (ttt.py)."""
    short = -len(rows) % ROW_MULTIPLE
    if short:
        rows = torch.cat([rows, rows[-1:].expand(short, -1)])
    return (rows.to(head.dtype) @ head.T)[: len(rows) - short]
