"""On-policy training data at generation cost: the target answers prompts itself (greedy,
batched) and the capture hooks record the aux and final hidden states of that very
generation, prefill rows for the prompt and one row per decode step for the answer, so no
second forward pass over the text is needed.

A row's stored sequence is every token the target was fed: the prompt, then its answer up to
(not including) the last generated token, whose prediction the final stored row holds. So
position t's `last_hidden` predicts token t+1 exactly as in a full forward, and the answer's
final token (often the end-of-turn marker) is still a training target.

Rows are left-padded within a batch (prompts of similar length batched together) and leave the
batch as soon as they finish, so a long answer never makes the short ones pay for its steps.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
from torch import Tensor
from transformers import DynamicCache

from eagle3.data.render import Rendered
from eagle3.target.capture import capture_hidden_states
from eagle3.target.load import Target


@torch.no_grad()
def generate_with_features(
    target: Target,
    prompts: Sequence[np.ndarray],
    max_new_tokens: int,
    max_length: int,
    aux_layers: list[int],
    eos_ids: frozenset[int],
) -> list[tuple[Rendered, Tensor, Tensor]]:
    """Greedy answers to `prompts` (token ids) in one batch, with their captured features.

    Returns per prompt (tokens fed with loss_mask = 1 on the answer, aux_hidden bf16 [T, 3H],
    last_hidden bf16 [T, H]). An answer stops at an EOS id, after `max_new_tokens`, or when the
    sequence reaches `max_length` stored tokens.
    """
    model, h = target.model, target.hidden_size
    lengths = [len(p) for p in prompts]
    if min(lengths) < 1 or max(lengths) > max_length:
        raise ValueError(
            f"prompt lengths must be in 1..max_length ({max_length}), got {min(lengths)}..{max(lengths)}"
        )
    b, longest = len(prompts), max(lengths)
    pad = target.tokenizer.pad_token_id or 0
    ids = torch.full((b, longest), pad, dtype=torch.long)
    mask = torch.zeros((b, longest), dtype=torch.long)
    for row, p in enumerate(prompts):
        ids[row, longest - len(p) :] = torch.from_numpy(np.asarray(p, dtype=np.int64))
        mask[row, longest - len(p) :] = 1
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    # answers may run to new = max_length - prompt + 1 tokens (the last one is not fed)
    budget = [min(max_new_tokens, max_length - n + 1) for n in lengths]
    steps = max(budget)
    aux_out = torch.zeros((b, steps, 3 * h), dtype=torch.bfloat16)
    last_out = torch.zeros((b, steps, h), dtype=torch.bfloat16)
    answers: list[list[int]] = [[] for _ in range(b)]
    fed = torch.zeros(b, dtype=torch.long)  # answer tokens fed back (rows of aux_out/last_out filled)

    cache = DynamicCache(config=model.config)
    head = model.get_output_embeddings()
    with capture_hidden_states(target.decoder_layers, target.final_norm, aux_layers) as captured:
        model.model(input_ids=ids, attention_mask=mask, position_ids=positions, cache=cache, use_cache=True)
        prompt_aux = captured.aux_hidden().to(torch.bfloat16)
        prompt_last = captured.last.to(torch.bfloat16)
        logits = head(captured.last[:, -1])
        active = torch.arange(b)  # original row of each batch row
        next_pos = positions[:, -1] + 1
        while True:
            tokens = logits.argmax(-1)
            keep = []
            for j, row in enumerate(active.tolist()):
                token = int(tokens[j])
                answers[row].append(token)
                if token not in eos_ids and len(answers[row]) < budget[row]:
                    keep.append(j)
            if not keep:
                break
            if len(keep) < len(active):
                rows = torch.tensor(keep)
                cache.batch_select_indices(rows)  # finished rows leave the batch
                active, tokens, next_pos, mask = active[rows], tokens[rows], next_pos[rows], mask[rows]
            mask = torch.cat([mask, torch.ones((len(active), 1), dtype=torch.long)], dim=1)
            model.model(
                input_ids=tokens[:, None],
                attention_mask=mask,
                position_ids=next_pos[:, None],
                cache=cache,
                use_cache=True,
            )
            aux_out[active, fed[active]] = captured.aux_hidden()[:, 0].to(torch.bfloat16)
            last_out[active, fed[active]] = captured.last[:, 0].to(torch.bfloat16)
            fed[active] += 1
            logits = head(captured.last[:, -1])
            next_pos = next_pos + 1

    results = []
    for row, prompt in enumerate(prompts):
        n, k = lengths[row], int(fed[row])
        tokens = np.concatenate(
            [np.asarray(prompt, dtype=np.int32), np.asarray(answers[row][:k], dtype=np.int32)]
        )
        loss_mask = np.zeros(n + k, dtype=np.uint8)
        loss_mask[n:] = 1
        aux = torch.cat([prompt_aux[row, longest - n :], aux_out[row, :k]])
        last = torch.cat([prompt_last[row, longest - n :], last_out[row, :k]])
        results.append((Rendered(input_ids=tokens, loss_mask=loss_mask), aux, last))
    return results
