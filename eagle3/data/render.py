"""Render a conversation with the target's chat template and mark the assistant tokens.

The assistant spans are found in characters by rendering growing prefixes of the
conversation (chat templates are prefix-stable), then mapped to tokens with the fast
tokenizer's offsets. A token is in the loss mask when it starts inside an assistant span,
end-of-turn marker included: the drafter must learn to propose it too.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from eagle3.data.conversations import Message


@dataclass
class Rendered:
    input_ids: np.ndarray  # int32 [T]
    loss_mask: np.ndarray  # uint8 [T]


def _plain(messages: list[Message]) -> str:
    # Base models without a chat template: plain completion, one turn per paragraph.
    return "".join(m["content"].strip() + "\n\n" for m in messages)


def assistant_spans(tokenizer, messages: list[Message], chat: bool) -> tuple[str, list[tuple[int, int]]]:
    """The full text and the [start, end) character spans of the assistant turns."""

    def render(msgs: list[Message], generation_prompt: bool = False) -> str:
        if not chat:
            return _plain(msgs)
        return tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=generation_prompt)

    text = render(messages)
    spans = []
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        start = len(render(messages[:i], generation_prompt=True)) if i else 0
        end = len(render(messages[: i + 1]))
        if not text.startswith(render(messages[: i + 1])):
            raise ValueError("the chat template is not prefix-stable; cannot locate assistant turns")
        spans.append((start, end))
    return text, spans


def render_conversation(tokenizer, messages: list[Message], max_length: int, chat: bool = True) -> Rendered:
    text, spans = assistant_spans(tokenizer, messages, chat)
    enc = tokenizer(text, add_special_tokens=not chat, return_offsets_mapping=True)
    ids = np.asarray(enc["input_ids"][:max_length], dtype=np.int32)
    starts = np.asarray([s for s, _ in enc["offset_mapping"][:max_length]], dtype=np.int64)
    mask = np.zeros(len(ids), dtype=np.uint8)
    for lo, hi in spans:
        mask[(starts >= lo) & (starts < hi)] = 1
    return Rendered(input_ids=ids, loss_mask=mask)
