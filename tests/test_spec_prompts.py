"""Evaluation prompts: MT-bench by default, any JSONL, clear errors for bad files."""

from __future__ import annotations

import json

import pytest
from transformers import AutoTokenizer

from eagle3.spec.prompts import load_prompts, mtbench_path, render_prompt


def _write(path, lines):
    path.write_text("".join((json.dumps(x) if not isinstance(x, str) else x) + "\n" for x in lines))
    return str(path)


def test_mtbench_first_turns_by_default():
    prompts = load_prompts(None, 3)
    rows = [json.loads(line) for line in mtbench_path().read_text().splitlines()[:3]]
    assert [p.text for p in prompts] == [r["turns"][0] for r in rows]
    assert [p.id for p in prompts] == [str(r["question_id"]) for r in rows]
    assert len(load_prompts(None, 1000)) == 80  # all of MT-bench when asking for more


def test_jsonl_prompt_and_turns_and_ids(tmp_path):
    path = _write(tmp_path / "p.jsonl", [
        {"prompt": "hello", "id": "a"}, "", {"turns": ["first", "second"]}, {"prompt": "third", "id": 7},
    ])
    prompts = load_prompts(path, 10)
    assert [(p.id, p.text) for p in prompts] == [("a", "hello"), ("1", "first"), ("7", "third")]
    assert len(load_prompts(path, 2)) == 2


@pytest.mark.parametrize("lines,match", [
    ([], "holds no prompts"),
    (["{not json"], "line 1: not valid JSON"),
    ([{"text": "x"}], "line 1: needs a non-empty 'prompt'"),
    ([{"prompt": "ok"}, {"prompt": ""}], "line 2: needs a non-empty 'prompt'"),
    ([[1, 2]], "expected a JSON object"),
])
def test_bad_files_fail_clearly(tmp_path, lines, match):
    path = _write(tmp_path / "bad.jsonl", lines)
    with pytest.raises(ValueError, match=match):
        load_prompts(path, 4)


def test_missing_file_names_the_key(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"eval.prompts_file: .*nope.jsonl.* does not exist"):
        load_prompts(str(tmp_path / "nope.jsonl"), 4)


def test_render_chat_and_plain():
    from eagle3.target.load import PACKAGES, resolve_target

    try:
        path = resolve_target("smollm2-135m-instruct")
    except (FileNotFoundError, ImportError) as err:  # the packaged target is not installed here
        pytest.skip(str(err))
    assert PACKAGES["smollm2-135m-instruct"].has_chat_template
    tok = AutoTokenizer.from_pretrained(path)
    chat = tok.decode(render_prompt(tok, "Hi there", chat=True))
    assert chat.endswith("<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n")
    plain = tok.decode(render_prompt(tok, "Hi there", chat=False))
    assert "im_start" not in plain and plain.rstrip().endswith("Hi there")
