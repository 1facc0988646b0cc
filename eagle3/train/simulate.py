"""Simulated acceptance of the draft shapes speculative-eval runs, on held-out features, without
decoding: what the drafter's own tree would accept, per shape, in seconds.

For each held-out start position t (the target has just emitted token t+1), the drafter drafts as
eagle3/decoding/engine.py does: depth 1 = its top-`topk` tokens; depth 2 = the top-`topk` children
of every depth-1 node (each child drafted from that node's own token, one TTT step per
alternative); then the `budget` best nodes by cumulative log-probability are kept
(DraftTree.select). The target accepts along its own greedy path: the depth-1 node holding its
argmax if kept, then that node's child holding its next argmax if kept. A chain of k is the tree
of k levels with topk 1 and budget k. Depth is capped at 2 (deeper trees choose a frontier
among off-path nodes, which needs one more drafter pass per frontier node).

Approximations, stated where the figure is reported: positions are held-out training text, not
the target's own answers to MT-bench prompts; the target's argmax two tokens ahead is conditioned
on the data's token, which is the drafted one only where the data followed the target; every
position counts, where decoding visits only the positions after each accepted run; a position
whose target token lies outside the draft vocabulary is left out, where decoding counts a miss.
speculative-eval runs the same code on each eval prompt's own text (eagle3/decoding/parity.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from eagle3.drafter.ttt_attention import TTTCache
from eagle3.train.data import Batch
from eagle3.train.ttt import TTTModel, head_logits, shift_left, step_valid


@dataclass(frozen=True)
class DraftShape:
    """A draft shape as speculative-eval names it: `depth` levels, `topk` children per node,
    `budget` draft tokens verified per step."""

    depth: int
    topk: int
    budget: int

    @property
    def name(self) -> str:
        return f"chain {self.depth}" if self.topk == 1 else f"tree {self.depth}/{self.topk}/{self.budget}"


# The default eval shape, the full preset's, and bench/trees.py's candidates.
SHAPES = (
    DraftShape(1, 1, 1),
    DraftShape(2, 1, 2),
    DraftShape(1, 8, 8),
    DraftShape(2, 4, 6),
    DraftShape(2, 6, 8),
    DraftShape(2, 8, 10),
)


def position_shares(accepted: Tensor, depth: int) -> dict[str, float]:
    """{position: the share of steps accepting at least that many draft tokens among those that
    accepted one fewer}, positions 1..`depth`, from `accepted` [N] (draft tokens accepted per
    step): speculative-eval's per_position_acceptance, for measured and simulated steps alike."""
    accepted = accepted.to(torch.float64)
    out = {}
    for pos in range(1, depth + 1):
        reached = int((accepted >= pos - 1).sum())
        out[str(pos)] = float((accepted >= pos).sum()) / reached if reached else 0.0
    return out


def _rank(scores: Tensor, index: Tensor) -> Tensor:
    """[...]: rank of candidate `index` in `scores` [..., n] as DraftTree.select orders them
    (higher score first, creation order among equal scores)."""
    own = scores.gather(-1, index[..., None])
    earlier = torch.arange(scores.shape[-1], device=scores.device) < index[..., None]
    return ((scores > own) | ((scores == own) & earlier)).sum(-1)


def _position_of(candidates: Tensor, wanted: Tensor) -> tuple[Tensor, Tensor]:
    """(found [...], index [...]) of `wanted` [...] among `candidates` [..., n]."""
    match = candidates == wanted[..., None]
    return match.any(-1), match.long().argmax(-1)


@torch.no_grad()
def accepted_lengths(
    model: TTTModel, batch: Batch, shapes: tuple[DraftShape, ...] = SHAPES
) -> dict[str, Tensor]:
    """{shape name: simulated tokens per verification [N]} over the batch's valid start positions."""
    m = model.drafter
    widest = max(s.topk for s in shapes)
    deep = any(s.depth > 1 for s in shapes)
    valid = [step_valid(batch, k) for k in range(2 if deep else 1)]
    b, t = valid[0].nonzero(as_tuple=True)
    target_logits = None
    if batch.last_hidden is not None:
        target_logits = batch.last_hidden.to(model.head_rows.dtype) @ model.head_rows.T
    last = batch.input_ids.shape[1] - 1
    # the target's argmax (draft slot) one and two tokens ahead; -1 where that step has no target
    wanted = [
        torch.where(
            v[b, t], model._targets(batch, b, (t + 1 + k).clamp(max=last), None, target_logits)[1], -1
        )
        for k, v in enumerate(valid)
    ]

    cache = TTTCache()
    first = m(shift_left(batch.input_ids, 1), m.project(batch.aux_hidden), batch.position_ids, cache)
    score1, draft1 = torch.log_softmax(head_logits(m, first, b, t).float(), -1).topk(widest, -1)  # [N, W]
    found1, at1 = _position_of(draft1, wanted[0])
    scores2 = drafts2 = None
    if deep:  # one TTT step per depth-1 alternative: its children, drafted from its own token
        scores2, drafts2 = [], []
        step_ids = shift_left(batch.input_ids, 2)  # step 1 at t embeds token t+2: the drafted one
        for j in range(widest):
            tokens = step_ids.clone()
            tokens[b, t] = m.to_target_ids(draft1[:, j])
            alt = TTTCache()
            alt.k, alt.v = cache.k, cache.v  # the prefix keys of step 0, no earlier diagonal steps
            second = m(tokens, first, batch.position_ids + 1, alt)
            s, d = torch.log_softmax(head_logits(m, second, b, t).float(), -1).topk(widest, -1)
            scores2.append(s)
            drafts2.append(d)
        scores2, drafts2 = torch.stack(scores2, 1), torch.stack(drafts2, 1)  # [N, W, W]

    out = {}
    for shape in shapes:
        k = shape.topk
        in_tree1 = found1 & (at1 < k)
        if shape.depth == 1:
            kept1 = in_tree1 & (_rank(score1[:, :k], at1.clamp(max=k - 1)) < shape.budget)
            out[shape.name] = 1 + kept1.long()
            continue
        # candidates in creation order: the k depth-1 nodes, then each one's k children
        cand2 = score1[:, :k, None] + scores2[:, :k, :k]  # [N, k, k]
        cand = torch.cat([score1[:, :k], cand2.flatten(1)], -1)
        j = at1.clamp(max=k - 1)
        kept1 = in_tree1 & (_rank(cand, j) < shape.budget)
        children = drafts2[torch.arange(len(j)), j, :k]  # [N, k] the true node's children
        found2, at2 = _position_of(children, wanted[1])
        kept2 = kept1 & found2 & (_rank(cand, k + j * k + at2) < shape.budget)
        out[shape.name] = 1 + kept1.long() + kept2.long()
    return out
