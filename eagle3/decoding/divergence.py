"""Is a difference between speculative and plain greedy output explained by rounding?

A forward over several tokens rounds differently from one-token forwards, so where the
target's top two logits nearly tie, both outputs are "the target's greedy output". At the
first differing token we recompute the target's logits for that prefix three ways (one full
forward, a one-token step after the rest, a (k+1)-token block after the rest, as plain
decoding and verification do) and take the largest logit difference between them, D, as the
rounding spread at this very position. The divergence is explained when the logit gap between
the two tokens is within 2 D (each logit moves by at most D) plus a few units of rounding.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch
from transformers import DynamicCache, PreTrainedModel

from eagle3.decoding.engine import TargetRunner

ROUNDING_UNITS = 4.0  # floor of the tolerance, in eps(dtype) * max|logit|


@dataclass
class Divergence:
    index: int  # first differing position among the new tokens
    baseline_token: int | None  # None: that output ended here
    spec_token: int | None
    gap: float  # |logit(baseline) - logit(spec)| in the reference forward
    spread: float  # D: largest logit difference between the recomputations
    tolerance: float
    explained: bool

    def as_dict(self) -> dict:
        return asdict(self)


def first_difference(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


@torch.no_grad()
def _last_logits(model: PreTrainedModel, ids: torch.Tensor, split: int | None) -> torch.Tensor:
    """Logits of the last position of `ids`: one forward (split None) or a cached prefix of
    `split` tokens then one forward over the rest."""
    target = TargetRunner(model)
    cache = DynamicCache(config=model.config)
    n = ids.shape[0]
    if split is not None:
        target.hidden(ids[:split], torch.arange(split), cache)
    start = split or 0
    hidden = target.hidden(ids[start:], torch.arange(start, n), cache)
    return target.logits(hidden[-1]).double()


def check_divergence(
    model: PreTrainedModel, prompt_ids: list[int], baseline: list[int], spec: list[int], block: int
) -> Divergence | None:
    """None when the outputs are identical; else the first divergence, judged (see module doc).

    `block` is the verification width (k + 1 for a chain) used for one of the recomputations.
    """
    index = first_difference(baseline, spec)
    if index is None:
        return None
    b_tok = baseline[index] if index < len(baseline) else None
    s_tok = spec[index] if index < len(spec) else None
    if b_tok is None or s_tok is None:
        # One output stopped (EOS or length) where the other went on: with EOS kept in both
        # outputs, this cannot be a near-tie between two tokens.
        return Divergence(index, b_tok, s_tok, float("inf"), 0.0, 0.0, False)
    ids = torch.tensor(prompt_ids + baseline[:index])
    n = ids.shape[0]
    ref = _last_logits(model, ids, None)
    others = [_last_logits(model, ids, n - 1)]
    if 1 < block < n:
        others.append(_last_logits(model, ids, n - block))
    spread = max(float((o - ref).abs().max()) for o in others)
    dtype = next(model.parameters()).dtype
    floor = ROUNDING_UNITS * torch.finfo(dtype).eps * float(ref.abs().max())
    tolerance = 2 * spread + floor
    gap = abs(float(ref[b_tok] - ref[s_tok]))
    return Divergence(index, b_tok, s_tok, gap, spread, tolerance, gap <= tolerance)
