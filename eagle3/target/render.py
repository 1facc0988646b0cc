"""Render conversations and prompts for the target: the one renderer of the project.

A conversation is rendered with the target's chat template (or, for a base model without one,
as plain paragraphs) and its assistant tokens are marked. The assistant spans are found in
characters by rendering growing prefixes of the conversation (chat templates are
prefix-stable), then mapped to tokens with the fast tokenizer's offsets. A token is in the loss
mask when it starts inside an assistant span, end-of-turn marker included: the drafter must
learn to propose it too.

A prompt (what self-distillation, the SGLang backend and speculative-eval ask the target to
answer) is rendered the same way up to where the assistant's turn starts, so the drafter is
trained and evaluated on the same text.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

Message = dict[str, str]  # {"role": ..., "content": ...}, as a chat template takes it


@dataclass
class Rendered:
    input_ids: np.ndarray  # int32 [T]
    loss_mask: np.ndarray  # uint8 [T]


def _plain(messages: list[Message]) -> str:
    # Base models without a chat template: plain completion, one turn per paragraph.
    return "".join(m["content"].strip() + "\n\n" for m in messages)


def render_text(tokenizer, messages: list[Message], chat: bool, generation_prompt: bool = False) -> str:
    """The text of `messages`: the chat template (with the assistant's header when
    `generation_prompt`), or one paragraph per turn for a base model without a template."""
    if not chat:
        return _plain(messages)
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)


def _tokenize(tokenizer, text: str, chat: bool, offsets: bool = False):
    # A chat template writes its own special tokens; plain text gets the tokenizer's (e.g. BOS).
    return tokenizer(text, add_special_tokens=not chat, return_offsets_mapping=offsets)


def assistant_spans(tokenizer, messages: list[Message], chat: bool) -> tuple[str, list[tuple[int, int]]]:
    """The full text and the [start, end) character spans of the assistant turns."""

    def render(msgs: list[Message], generation_prompt: bool = False) -> str:
        return render_text(tokenizer, msgs, chat, generation_prompt)

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
    enc = _tokenize(tokenizer, text, chat, offsets=True)
    ids = np.asarray(enc["input_ids"][:max_length], dtype=np.int32)
    starts = np.asarray([s for s, _ in enc["offset_mapping"][:max_length]], dtype=np.int64)
    mask = np.zeros(len(ids), dtype=np.uint8)
    for lo, hi in spans:
        mask[(starts >= lo) & (starts < hi)] = 1
    return Rendered(input_ids=ids, loss_mask=mask)


def first_exchange(messages: list[Message]) -> list[Message]:
    """System prompt (if any) and first user turn: what a prompt asks the target to answer."""
    head = []
    for message in messages:
        head.append(message)
        if message["role"] == "user":
            return head
    return head


def user_turn(text: str) -> list[Message]:
    """A prompt given as text (speculative-eval's prompts) as a conversation."""
    return [{"role": "user", "content": text}]


def render_prompt(tokenizer, messages: list[Message], chat: bool) -> np.ndarray:
    """Token ids (int32) of the first exchange of `messages` up to where the assistant's answer
    starts, rendered as render_conversation renders that conversation."""
    text = render_text(tokenizer, first_exchange(messages), chat, generation_prompt=True)
    return np.asarray(_tokenize(tokenizer, text, chat).input_ids, dtype=np.int32)
