"""On-policy training data at generation cost: the target answers prompts itself (greedy,
batched) and the capture hooks record the aux and final hidden states of that very
generation, prefill rows for the prompt and one row per decode step for the answer, so no
second forward pass over the text is needed.

A row's stored sequence is every token the target was fed: the prompt, then its answer up to
(not including) the last generated token, whose prediction the final stored row holds. So
position t's `last_hidden` predicts token t+1 exactly as in a full forward, and the answer's
final token (often the end-of-turn marker) is still a training target.

Batching is continuous: up to `batch_size` rows decode together, each left-padded in one KV
cache. Answers end at different steps, and a batch left to drain would spend its last steps
on a few rows at nearly the cost of a full one; so once half the rows have finished, they
leave and the next prompts join (one prefill for the newcomers, caches merged by left
padding). The caller's prompt order decides who joins when: same prompts, same bytes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor
from transformers import DynamicCache

from eagle3.target.capture import Captured, capture_hidden_states
from eagle3.target.load import Target
from eagle3.target.render import Rendered


@dataclass
class _Answer:
    """One prompt's generation: its prompt features, answer tokens and answer features."""

    prompt: np.ndarray
    budget: int  # answer tokens it may generate
    prompt_aux: Tensor
    prompt_last: Tensor
    aux: Tensor  # bf16 [budget, 3H], rows 0..fed-1 filled
    last: Tensor  # bf16 [budget, H]
    tokens: list[int]
    fed: int = 0


@dataclass
class _Batch:
    """The rows decoding together: one KV cache, left-padded; `logits` are each row's next token's."""

    cache: DynamicCache
    mask: Tensor  # long [B, L]
    next_pos: Tensor  # long [B]
    logits: Tensor  # [B, V]
    rows: list[int]  # prompt index of each row
    done: Tensor  # bool [B]

    def keep(self, keep: Tensor) -> None:
        """Keep only rows `keep`, dropping cache columns that are padding for every kept row."""
        mask = self.mask[keep]
        first = int((mask.cumsum(-1) == 0).sum(-1).min()) if len(keep) else mask.shape[1]
        for layer in self.cache.layers:
            layer.keys = layer.keys[keep, :, first:]
            layer.values = layer.values[keep, :, first:]
        self.mask, self.next_pos, self.logits = mask[:, first:], self.next_pos[keep], self.logits[keep]
        self.rows = [self.rows[i] for i in keep.tolist()]
        self.done = self.done[keep]

    def extend(self, other: _Batch) -> None:
        """Append `other`'s rows, left-padding whichever cache is shorter."""
        width = max(self.mask.shape[1], other.mask.shape[1])

        def left_pad(x: Tensor, dim_from_end: int) -> Tensor:
            missing = width - x.shape[-dim_from_end]
            return F.pad(x, (0, 0) * (dim_from_end - 1) + (missing, 0)) if missing else x

        for mine, theirs in zip(self.cache.layers, other.cache.layers, strict=True):
            mine.keys = torch.cat([left_pad(mine.keys, 2), left_pad(theirs.keys, 2)])
            mine.values = torch.cat([left_pad(mine.values, 2), left_pad(theirs.values, 2)])
        self.mask = torch.cat([left_pad(self.mask, 1), left_pad(other.mask, 1)])
        self.next_pos = torch.cat([self.next_pos, other.next_pos])
        self.logits = torch.cat([self.logits, other.logits])
        self.rows += other.rows
        self.done = torch.cat([self.done, other.done])


def _prefill(target: Target, captured: Captured, answers: list[_Answer], rows: list[int]) -> _Batch:
    """Run the newcomers' prompts (left-padded) and keep their features and first logits."""
    prompts = [answers[i].prompt for i in rows]
    longest = max(len(p) for p in prompts)
    pad = target.tokenizer.pad_token_id or 0
    ids = torch.full((len(rows), longest), pad, dtype=torch.long)
    mask = torch.zeros((len(rows), longest), dtype=torch.long)
    for j, p in enumerate(prompts):
        ids[j, longest - len(p) :] = torch.from_numpy(p.astype(np.int64))
        mask[j, longest - len(p) :] = 1
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    cache = DynamicCache(config=target.model.config)
    target.model.model(
        input_ids=ids, attention_mask=mask, position_ids=positions, cache=cache, use_cache=True
    )
    aux, last = captured.aux_hidden(), captured.last
    for j, i in enumerate(rows):
        n = len(prompts[j])
        answers[i].prompt_aux = aux[j, longest - n :].to(torch.bfloat16)
        answers[i].prompt_last = last[j, longest - n :].to(torch.bfloat16)
    logits = target.model.get_output_embeddings()(last[:, -1])
    done = torch.zeros(len(rows), dtype=torch.bool)
    return _Batch(cache, mask, positions[:, -1] + 1, logits, list(rows), done)


def _chunks(lengths: list[int], budget: int) -> list[list[int]]:
    """Consecutive index groups whose rows x longest stays within `budget` (one row at least)."""
    groups: list[list[int]] = [[]]
    for i, n in enumerate(lengths):
        longest = max([lengths[j] for j in groups[-1]] + [n])
        if groups[-1] and (len(groups[-1]) + 1) * longest > budget:
            groups.append([])
        groups[-1].append(i)
    return groups


@torch.no_grad()
def generate_with_features(
    target: Target,
    prompts: Sequence[np.ndarray],
    max_new_tokens: int,
    max_length: int,
    aux_layers: list[int],
    eos_ids: frozenset[int],
    batch_size: int | None = None,
    prefill_tokens: int = 4096,
) -> list[tuple[Rendered, Tensor, Tensor]]:
    """Greedy answers to `prompts` (token ids), with their captured features.

    Returns per prompt (tokens fed with loss_mask = 1 on the answer, aux_hidden bf16 [T, 3H],
    last_hidden bf16 [T, H]). An answer stops at an EOS id, after `max_new_tokens`, or when the
    sequence reaches `max_length` stored tokens. `batch_size` rows at most decode together
    (None: all prompts at once); newcomers prefill in chunks of <= `prefill_tokens` padded tokens.
    """
    lengths = [len(p) for p in prompts]
    if min(lengths) < 1 or max(lengths) > max_length:
        raise ValueError(
            f"prompt lengths must be in 1..max_length ({max_length}), got {min(lengths)}..{max(lengths)}"
        )
    size = batch_size or len(prompts)
    answers = _empty_answers(prompts, max_new_tokens, max_length, target.hidden_size)
    waiting = list(range(len(prompts)))
    with capture_hidden_states(target.decoder_layers, target.final_norm, aux_layers) as captured:
        batch: _Batch | None = None
        while True:
            live = 0 if batch is None else int((~batch.done).sum())
            if waiting and live <= size // 2:
                joining, waiting = waiting[: size - live], waiting[size - live :]
                batch = _refill(target, captured, answers, batch, joining, prefill_tokens)
            tokens = batch.logits.argmax(-1)
            for j, i in enumerate(batch.rows):
                if batch.done[j]:
                    continue
                answer = answers[i]
                answer.tokens.append(int(tokens[j]))
                if answer.tokens[-1] in eos_ids or len(answer.tokens) >= answer.budget:
                    batch.done[j] = True
            live_rows = (~batch.done).nonzero().flatten()
            if len(live_rows) == 0:
                if not waiting:
                    break
                continue
            _feed(target, captured, answers, batch, tokens, live_rows)
    return [_result(answer) for answer in answers]


def _empty_answers(
    prompts: Sequence[np.ndarray], max_new_tokens: int, max_length: int, h: int
) -> list[_Answer]:
    """One answer per prompt with room for its budget of fed tokens' features."""
    answers = []
    for p in prompts:
        budget = min(max_new_tokens, max_length - len(p) + 1)  # the last answer token is not fed
        empty_aux, empty_last = torch.empty(0, 3 * h), torch.empty(0, h)
        aux, last = (
            torch.empty(budget, 3 * h, dtype=torch.bfloat16),
            torch.empty(budget, h, dtype=torch.bfloat16),
        )
        answers.append(_Answer(np.asarray(p, dtype=np.int32), budget, empty_aux, empty_last, aux, last, []))
    return answers


def _refill(
    target: Target,
    captured: Captured,
    answers: list[_Answer],
    batch: _Batch | None,
    joining: list[int],
    prefill_tokens: int,
) -> _Batch:
    """The batch with its finished rows dropped and the `joining` prompts prefilled into it."""
    if batch is not None:
        batch.keep((~batch.done).nonzero().flatten())
    # prefill in chunks of <= prefill_tokens padded tokens: one long prompt must not pad a whole
    # group of short ones
    for chunk in _chunks([len(answers[i].prompt) for i in joining], prefill_tokens):
        newcomers = _prefill(target, captured, answers, [joining[j] for j in chunk])
        if batch is None:
            batch = newcomers
        else:
            batch.extend(newcomers)
    return batch


def _feed(
    target: Target,
    captured: Captured,
    answers: list[_Answer],
    batch: _Batch,
    tokens: Tensor,
    live_rows: Tensor,
) -> None:
    """One decode step: feed each row's new token, keep the live rows' features, next logits."""
    # finished rows ride along (their outputs are ignored) until the next refill
    batch.mask = torch.cat([batch.mask, (~batch.done).long()[:, None]], dim=1)
    target.model.model(
        input_ids=tokens[:, None],
        attention_mask=batch.mask,
        position_ids=batch.next_pos[:, None],
        cache=batch.cache,
        use_cache=True,
    )
    aux, last = captured.aux_hidden()[:, 0].to(torch.bfloat16), captured.last[:, 0]
    for j in live_rows.tolist():
        answer = answers[batch.rows[j]]
        answer.aux[answer.fed] = aux[j]
        answer.last[answer.fed] = last[j].to(torch.bfloat16)
        answer.fed += 1
    batch.logits = target.model.get_output_embeddings()(last)
    batch.next_pos = batch.next_pos + 1


def _result(answer: _Answer) -> tuple[Rendered, Tensor, Tensor]:
    """The prompt and the fed answer tokens (loss on the answer) with their features."""
    n, k = len(answer.prompt), answer.fed
    tokens = np.concatenate([answer.prompt, np.asarray(answer.tokens[:k], dtype=np.int32)])
    loss_mask = np.zeros(n + k, dtype=np.uint8)
    loss_mask[n:] = 1
    aux = torch.cat([answer.prompt_aux, answer.aux[:k]])
    last = torch.cat([answer.prompt_last, answer.last[:k]])
    return Rendered(input_ids=tokens, loss_mask=loss_mask), aux, last
