"""The prompt-lookup branch: the continuation it finds, its graft onto a draft tree, and the
engine with it (lossless, and every step accepts at least what the branch got right)."""

from __future__ import annotations

import pytest
import torch
from test_decoding_fixtures import EOS, engine, prompts, random_drafter, tiny_target

from eagle3.core.params import ParamsError, parse_params
from eagle3.decoding.engine import greedy_decode
from eagle3.decoding.lookup import lookup_continuation
from eagle3.decoding.tree import ancestor_matrix, graft_chain

pytestmark = pytest.mark.usefixtures("one_thread")


def test_continuation_follows_the_latest_longest_match():
    # "1 2" occurred twice before: the latest occurrence (followed by 7 8) wins
    assert lookup_continuation([1, 2, 5, 6, 1, 2, 7, 8, 9, 1, 2], 3) == [7, 8, 9]
    # a 3-gram match beats a more recent 1-gram match
    assert lookup_continuation([4, 5, 6, 10, 11, 6, 12, 4, 5, 6], 2, max_ngram=3) == [10, 11]
    # the continuation stops at the end of the context and at max_tokens
    assert lookup_continuation([3, 9, 3], 5) == [9, 3]
    assert lookup_continuation([3, 9, 8, 7, 3], 2) == [9, 8]
    assert lookup_continuation([1, 2, 3], 4) == []  # nothing repeats
    assert lookup_continuation([7], 4) == []


def test_graft_follows_agreeing_nodes_and_grows_the_rest():
    # root 0 (token 50); children 1 (token 60), 2 (token 61); 3 (token 70) under 1
    tokens, parents, depths = (
        torch.tensor([50, 60, 61, 70]),
        torch.tensor([-1, 0, 0, 1]),
        torch.tensor([0, 1, 1, 2]),
    )
    t, p, d = graft_chain(tokens, parents, depths, [60, 71, 80])
    # 60 is node 1 already; 71 is new under it, 80 under 71
    assert t.tolist() == [50, 60, 61, 70, 71, 80]
    assert p.tolist() == [-1, 0, 0, 1, 1, 4]
    assert d.tolist() == [0, 1, 1, 2, 2, 3]
    anc = ancestor_matrix(p, d)
    assert anc[5].nonzero(as_tuple=True)[0].tolist() == [0, 1, 4, 5]
    # a chain the tree already holds adds nothing; an empty chain neither
    for chain in ([60, 70], []):
        same = graft_chain(tokens, parents, depths, chain)
        assert all(torch.equal(a, b) for a, b in zip(same, (tokens, parents, depths), strict=True))


def _step_contexts(prompt: list[int], out: list[int], accepted: list[int]) -> list[list[int]]:
    """The context each verification step started from (prompt + committed tokens)."""
    contexts, committed = [], 1  # prefill commits one token
    for a in accepted:
        contexts.append(prompt + out[:committed])
        committed += a + 1
    return contexts


@pytest.mark.slow
@pytest.mark.parametrize("lookup_tokens", [2, 5])
def test_engine_with_lookup_is_lossless_and_takes_every_right_lookup(lookup_tokens):
    target = tiny_target(seed=7)
    # a random drafter is almost never right: what is accepted comes from the lookup branch
    drafter = random_drafter(target, draft_vocab=64)
    spec = engine(target, drafter, mode="tree", k=2, topk=2, tree_budget=4, lookup_tokens=lookup_tokens)
    right_total = 0
    for p in prompts(4, seed=8):
        base = greedy_decode(target, p, 48, EOS).tokens
        run = spec.generate(p, 48, EOS)
        assert run.tokens == base
        # the drafter's own share: its tree's part of each accepted path
        assert all(0 <= d <= a for d, a in zip(run.drafter_accepted, run.accepted, strict=True))
        for context, accepted in zip(_step_contexts(p, base, run.accepted), run.accepted, strict=True):
            truth = base[len(context) - len(p) :]
            chain = lookup_continuation(context, lookup_tokens)
            right = next(
                (i for i, (c, t) in enumerate(zip(chain, truth, strict=False)) if c != t),
                min(len(chain), len(truth)),
            )
            assert accepted >= right  # a correct lookup prefix is always kept
            right_total += right
    assert right_total > 0  # the tiny target repeats itself: the branch was exercised
    alone = engine(target, drafter, mode="tree", k=2, topk=2, tree_budget=4).generate(
        prompts(1, seed=8)[0], 48, EOS
    )
    assert alone.drafter_accepted == alone.accepted


def test_lookup_needs_tree_mode():
    target = tiny_target()
    with pytest.raises(ValueError, match=r"lookup_tokens needs eval.mode 'tree'"):
        engine(target, random_drafter(target), mode="chain", k=2, lookup_tokens=3)
    with pytest.raises(ParamsError, match=r"lookup_tokens .* needs mode: tree"):
        parse_params({"eval": {"mode": "chain", "lookup_tokens": 3}})
