"""Evaluation prompts: MT-bench by default, any JSONL, round-robin over categories, clear errors."""

from __future__ import annotations

import json

import pytest
from pydantic import ValidationError

from eagle3.core.params import EvalParams
from eagle3.decoding.prompts import Prompt, load_prompts, mtbench_path, round_robin

MTBENCH_CATEGORIES = [
    "writing",
    "roleplay",
    "reasoning",
    "math",
    "coding",
    "extraction",
    "stem",
    "humanities",
]


def _write(path, lines):
    path.write_text("".join((json.dumps(x) if not isinstance(x, str) else x) + "\n" for x in lines))
    return str(path)


def mtbench_rows() -> list[dict]:
    return [json.loads(line) for line in mtbench_path().read_text().splitlines() if line.strip()]


def test_mtbench_first_turns_round_robin_over_categories():
    rows = {str(r["question_id"]): r for r in mtbench_rows()}
    prompts = load_prompts(None, 24)
    assert [p.category for p in prompts] == MTBENCH_CATEGORIES * 3  # 3 per category, in file order
    assert all(p.text == rows[p.id]["turns"][0] and p.category == rows[p.id]["category"] for p in prompts)
    # Within a category the file's order: the first writing question, then the second, ...
    assert [p.id for p in prompts if p.category == "writing"] == ["81", "82", "83"]
    assert [p.category for p in load_prompts(None, 8)] == MTBENCH_CATEGORIES
    everything = load_prompts(None, 80)
    assert sorted(p.id for p in everything) == sorted(rows) and everything[:24] == prompts


def test_more_prompts_than_available_fails_clearly():
    with pytest.raises(ValueError, match=r"eval.domains.file: 81 is more than the 80 prompts available"):
        load_prompts(None, 81)
    with pytest.raises(
        ValueError, match=r"11 is more than the 10 prompts available in categories \['math'\]"
    ):
        load_prompts(None, 11, ["math"])


def test_categories_restrict_and_unknown_ones_name_the_allowed():
    picked = load_prompts(None, 5, ["coding", "math"])
    assert [p.category for p in picked] == ["math", "coding", "math", "coding", "math"]  # file order
    with pytest.raises(
        ValueError, match=r"eval.categories: unknown \['poetry'\] \(allowed: any of \['writing'"
    ):
        load_prompts(None, 4, ["math", "poetry"])
    with pytest.raises(ValidationError, match="categories"):
        EvalParams(categories=[])
    assert EvalParams().categories is None


def test_round_robin_skips_exhausted_categories():
    prompts = [Prompt(str(i), "x", c) for i, c in enumerate("aabaca")]
    assert [p.id for p in round_robin(prompts, 6)] == ["0", "2", "4", "1", "3", "5"]
    assert [p.id for p in round_robin(prompts, 4)] == ["0", "2", "4", "1"]


def test_jsonl_prompt_and_turns_and_ids(tmp_path):
    path = _write(
        tmp_path / "p.jsonl",
        [
            {"prompt": "hello", "id": "a"},
            "",
            {"turns": ["first", "second"]},
            {"prompt": "third", "id": 7},
        ],
    )
    prompts = load_prompts(path, 3)
    assert [(p.id, p.text, p.category) for p in prompts] == [
        ("a", "hello", "all"),
        ("1", "first", "all"),
        ("7", "third", "all"),
    ]
    assert len(load_prompts(path, 2)) == 2
    with pytest.raises(ValueError, match="4 is more than the 3 prompts available"):
        load_prompts(path, 4)


def test_jsonl_categories_missing_ones_are_all(tmp_path):
    path = _write(
        tmp_path / "p.jsonl",
        [
            {"prompt": "q1", "category": "code"},
            {"prompt": "q2", "category": "code"},
            {"prompt": "q3"},
        ],
    )
    assert [(p.id, p.category) for p in load_prompts(path, 3)] == [("0", "code"), ("2", "all"), ("1", "code")]
    assert [p.id for p in load_prompts(path, 1, ["all"])] == ["2"]


@pytest.mark.parametrize(
    "lines,match",
    [
        ([], "holds no prompts"),
        (["{not json"], "line 1: not valid JSON"),
        ([{"text": "x"}], "line 1: needs a non-empty 'prompt'"),
        ([{"prompt": "ok"}, {"prompt": ""}], "line 2: needs a non-empty 'prompt'"),
        ([[1, 2]], "expected a JSON object"),
        ([{"prompt": "ok", "category": 3}], "line 1: 'category' must be a non-empty string"),
        ([{"prompt": "ok", "category": "a.b"}], "line 1: 'category' must be a non-empty string of letters"),
    ],
)
def test_bad_files_fail_clearly(tmp_path, lines, match):
    path = _write(tmp_path / "bad.jsonl", lines)
    with pytest.raises(ValueError, match=match):
        load_prompts(path, 4)


def test_missing_file_names_the_key(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"eval.prompts_file: .*nope.jsonl.* does not exist"):
        load_prompts(str(tmp_path / "nope.jsonl"), 4)
