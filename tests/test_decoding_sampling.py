"""Speculative sampling keeps the target's distribution (chi-square tests, tiny vocabulary)."""

from __future__ import annotations

import pytest
import torch
from scipy.stats import chisquare
from test_decoding_fixtures import engine, prompts, random_drafter, tiny_target

from eagle3.decoding.verify import sample_chain, sample_tree

# Tiny models: one thread is faster than two (and kinder to a shared CPU).
pytestmark = pytest.mark.usefixtures("one_thread")

V = 6
P_MIN = 1e-3  # fixed seeds: the test is deterministic; this is the bar it clears
N_RULE = 8000  # draws per acceptance-rule test (cheap: no model)
N_ENGINE = 600  # full decodings per engine test (each runs the tiny target twice)


def _dist(seed: int, n: int = V) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.softmax(2 * torch.randn(n, generator=g, dtype=torch.float64), dim=0)


def _check(counts: torch.Tensor, probs: torch.Tensor) -> None:
    expected = probs * counts.sum()
    keep = expected >= 5  # merge the rare cells, as chi-square needs
    obs = torch.cat([counts[keep], counts[~keep].sum().view(1)]).tolist()
    exp = torch.cat([expected[keep], expected[~keep].sum().view(1)]).tolist()
    if exp[-1] == 0:
        obs, exp = obs[:-1], exp[:-1]
    assert chisquare(obs, exp).pvalue > P_MIN


@pytest.mark.slow
def test_chain_rule_first_token_is_distributed_as_target():
    p = torch.stack([_dist(1), _dist(2), _dist(3)])  # [k+1, V], k = 2
    q = torch.stack([_dist(4), _dist(5)])
    g = torch.Generator().manual_seed(0)
    counts = torch.zeros(V)
    accepted_any = 0
    for _ in range(N_RULE):
        draft = [int(torch.multinomial(q[i], 1, generator=g)) for i in range(2)]
        q_at = [float(q[i, t]) for i, t in enumerate(draft)]
        accepted, nxt = sample_chain(draft, q_at, q.__getitem__, p.__getitem__, g)
        first = draft[0] if accepted else nxt
        counts[first] += 1
        accepted_any += accepted > 0
    assert 0 < accepted_any < N_RULE  # both branches ran
    _check(counts, p[0])


def test_tree_rule_first_token_is_distributed_as_target():
    # root with children 1, 2 (point-mass proposals), node 1 with child 3
    tokens = [0, 2, 4, 1]
    children = [[1, 2], [3], [], []]
    p = torch.stack([_dist(6), _dist(7), _dist(8), _dist(9)])
    g = torch.Generator().manual_seed(0)
    counts = torch.zeros(V)
    second = torch.zeros(V)  # the token after node 1 when node 1 is kept
    for _ in range(N_RULE):
        path, nxt = sample_tree(tokens, children, p.__getitem__, g)
        first = tokens[path[1]] if len(path) > 1 else nxt
        counts[first] += 1
        if path[1:2] == [1]:
            second[tokens[path[2]] if len(path) > 2 else nxt] += 1
    _check(counts, p[0])
    _check(second, p[1])


@torch.no_grad()
def _exact_two_token_distribution(target, prompt: list[int], temperature: float) -> torch.Tensor:
    """p(t1, t2 | prompt) of the tiny target by enumeration, [V * V]."""
    first = torch.softmax(target(torch.tensor([prompt])).logits[0, -1].double() / temperature, -1)
    batch = torch.tensor([prompt + [t] for t in range(V)])
    second = torch.softmax(target(batch).logits[:, -1].double() / temperature, -1)
    return (first[:, None] * second).reshape(-1)


@pytest.mark.slow
@pytest.mark.parametrize("setting", [dict(mode="chain", k=2), dict(mode="tree", k=2, topk=2, tree_budget=4)])
def test_engine_samples_the_targets_two_token_distribution(setting):
    target = tiny_target(vocab=V, seed=11)
    drafter = random_drafter(target, seed=12)
    # A confident drafter that favours tokens the target finds unlikely: many rejections, so
    # the residual distribution decides much of the outcome (a wrong one would show).
    drafter.lm_head.weight.data *= 10
    spec = engine(target, drafter, temperature=1.0, seed=0, **setting)
    prompt = prompts(1, length=5, vocab=V)[0]
    exact = _exact_two_token_distribution(target, prompt, 1.0)
    counts = torch.zeros(V * V)
    accepted = []
    for _ in range(N_ENGINE):
        out = spec.generate(prompt, 2, frozenset())
        counts[out.tokens[0] * V + out.tokens[1]] += 1
        accepted += out.accepted
    assert 0 < sum(accepted) < len(accepted) * setting["k"]  # drafts were kept and rejected
    _check(counts, exact)
