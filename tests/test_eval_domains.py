"""speculative-eval's domains: the prompt sets, the held-out long contexts, second turns after the
target's own answer, and the per-domain figures (real packages and tokenizer, no model forward)."""

from __future__ import annotations

import json

import pytest
from conftest import SHAREGPT_SAMPLE

from eagle3.core.inputs import InputError
from eagle3.core.params import DataParams, ParamsError, TargetParams, parse_params
from eagle3.data.conversations import load_conversations, split_order
from eagle3.data.extract import select_conversations
from eagle3.decoding.domains import (
    LONG_MAX_TOKENS,
    LONG_MIN_TOKENS,
    chat_prompts,
    code_prompts,
    load_domains,
    long_prompts,
    math_prompts,
    token_counter,
)
from eagle3.decoding.engine import Generation
from eagle3.decoding.evaluate import EvalRun, PromptResult, headline_by_domain, per_domain
from eagle3.decoding.prompts import answered, first_turns, render_messages, render_prompts, with_answers


@pytest.fixture(scope="module")
def count_tokens():
    return token_counter(TargetParams())


def test_chat_is_each_conversation_at_its_first_turn_then_its_second():
    prompts = chat_prompts(3, None)
    assert [(p.id, p.follows) for p in prompts] == [
        ("81", None),
        ("81-2", "81"),
        ("91", None),
        ("91-2", "91"),
        ("101", None),
        ("101-2", "101"),
    ]
    assert [p.category for p in prompts[::2]] == ["writing", "roleplay", "reasoning"]
    assert {p.domain for p in prompts} == {"chat"}
    assert first_turns(prompts) == prompts[::2]
    with pytest.raises(ValueError, match="follow another prompt's answer"):
        render_prompts(None, prompts, True)


def test_a_second_turn_is_rendered_after_the_target_answer_to_the_first(count_tokens):
    from transformers import AutoTokenizer

    from eagle3.target.load import resolve_target

    tokenizer = AutoTokenizer.from_pretrained(resolve_target("smollm2-135m-instruct"))
    prompts = chat_prompts(1, ["math"])
    asked = []

    def answer(ids: list[int]) -> list[int]:  # the backend's plain decoder, here a fixed answer
        asked.append(ids)
        return tokenizer("The answer is 42.").input_ids

    resolved = answered(tokenizer, prompts, True, answer)
    assert len(asked) == 1 and asked[0] == render_prompts(tokenizer, prompts[:1], True)[0][1]
    second = resolved[1]
    assert second.follows is None and [m["role"] for m in second.messages()] == ["user", "assistant", "user"]
    assert second.history[1]["content"] == "The answer is 42."
    ids = render_messages(tokenizer, second.messages(), True)
    first_ids = render_prompts(tokenizer, prompts[:1], True)[0][1]
    assert ids[: len(first_ids)] == first_ids and "The answer is 42." in tokenizer.decode(ids)
    assert with_answers(prompts[:1], {}) == prompts[:1]  # nothing to resolve


def test_code_and_math_come_from_their_packages_first_problems_first():
    code = code_prompts(2)
    assert [p.id for p in code] == ["HumanEval/0", "HumanEval/1"]
    assert "def has_close_elements(" in code[0].text and code[0].domain == "code"
    math = math_prompts(1)
    assert math[0].text.startswith("Janet\u2019s ducks lay 16 eggs per day") and math[0].domain == "math"
    with pytest.raises(InputError, match=r"eval.domains.math: 2000 is more than the 1319 prompts available"):
        math_prompts(2000)


@pytest.mark.slow
def test_long_contexts_are_held_out_and_2k_to_4k_tokens(count_tokens):
    data = DataParams()
    prompts = long_prompts(2, data, count_tokens)
    conversations = load_conversations(data.source)
    training, heldout = split_order(len(conversations), data.seed)
    assert set(training).isdisjoint(heldout) and len(training) + len(heldout) == len(conversations)
    for p in prompts:
        index = int(p.id.removeprefix("conversation-"))
        assert index in heldout and index not in training
        assert LONG_MIN_TOKENS <= count_tokens(p.messages()) <= LONG_MAX_TOKENS
        # the turn answered is one the conversation really asks, after the turns before it
        assert list(p.messages()) == conversations[index][: len(p.history) + 1]


def test_training_never_draws_the_held_out_tail(smollm2):
    params = parse_params({"data": {"source": str(SHAREGPT_SAMPLE), "num_samples": 40}})
    conversations = load_conversations(str(SHAREGPT_SAMPLE))
    _, heldout = split_order(len(conversations), 0)
    chosen = select_conversations(params, smollm2.tokenizer, True)
    assert heldout and all(c.messages not in [conversations[i] for i in heldout] for c in chosen)
    with pytest.raises(ValueError, match=rf"outside the {len(heldout)} held out for evaluation"):
        select_conversations(
            parse_params({"data": {"source": str(SHAREGPT_SAMPLE), "num_samples": 48}}),
            smollm2.tokenizer,
            True,
        )


def test_too_few_long_contexts_is_one_line_naming_the_count(count_tokens):
    with pytest.raises(InputError, match=r"eval.domains.long: 1 asked, but only 0 of the 2 conversations"):
        long_prompts(1, DataParams(source=str(SHAREGPT_SAMPLE)), count_tokens)


def test_domains_param_is_checked_before_any_work():
    for raw, message in (
        ({"num_prompts": 8}, "num_prompts was replaced by eval.domains"),
        ({"domains": {"chat": 0}}, "eval.domains.chat: Input should be greater than or equal to 1"),
        ({"domains": {"poetry": 2}}, "Input should be 'chat', 'code', 'math', 'long' or 'file'"),
        ({"domains": {"file": 2}}, "eval.domains has file but eval.prompts_file is null"),
        ({"prompts_file": "x.jsonl"}, "add file: N to eval.domains"),
    ):
        with pytest.raises(ParamsError, match=message):
            parse_params({"eval": raw})
    params = parse_params({"eval": {"domains": {"code": 1, "chat": 1}}})
    assert [p.domain for p in load_domains(params.eval, params.data)] == ["code", "chat", "chat"]


def _result(pid: str, accepted: list[int], seconds: float) -> PromptResult:
    tokens = list(range(len(accepted) + sum(accepted)))
    spec = Generation(tokens=tokens, seconds=seconds, accepted=accepted, drafter_accepted=accepted)
    base = Generation(tokens=tokens, seconds=2 * seconds)
    return PromptResult(pid, 4, base, spec)


def test_per_domain_figures_and_the_headline_dvc_shows_first():
    run = EvalRun([_result("a", [2, 0], 1.0), _result("b", [1, 1], 1.0), _result("c", [0, 0, 0], 1.0)])
    figures = per_domain(run, ["code", "code", "math"], k=2, seed=0)
    code, math = figures["code"], figures["math"]
    assert code["num_prompts"] == 2 and code["acceptance_length"] == pytest.approx((4 + 4) / 4)
    # steps accepting 2, 0, 1, 1: three of four accept position 1, one of those three position 2
    assert code["per_position_acceptance"] == {"1": 0.75, "2": pytest.approx(1 / 3)}
    assert math["acceptance_length"] == 1.0 and math["per_position_acceptance"]["1"] == 0.0
    assert code["speedup"] == pytest.approx(2.0) and code["speedup_ci"] == {"lo": 2.0, "hi": 2.0}
    head = headline_by_domain({"per_domain": figures})
    assert head == {"code": 2.0, "math": 1.0, "x": {"code": 2.0, "math": 2.0}}
    assert list(head) == ["code", "math", "x"]  # acceptance columns first, then the speedups
    assert json.dumps(head)  # plain numbers: what dvc exp show and MLflow take
    with pytest.raises(ValueError, match="2 domains for 3 prompts"):
        per_domain(run, ["code", "math"], k=2, seed=0)
