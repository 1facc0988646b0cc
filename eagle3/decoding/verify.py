"""The acceptance rules: which drafted tokens the target keeps, and the token it adds.

Every rule walks the draft from the root and asks for the target's logits of one verified
position at a time (`logits(i)` -> [V]); the caller decides how they are computed (the engine
computes all verified rows in one lm_head call up front).

Greedy (temperature 0): a draft token is kept while it equals the target's argmax at its
parent; the target's argmax after the last kept token is the next (bonus) token. The output
is then exactly the target's greedy output (in exact arithmetic).

Sampling (temperature > 0) keeps the target's distribution exactly:
- chain: speculative sampling (Leviathan et al. / Chen et al.): draft y ~ q is kept with
  probability min(1, p(y)/q(y)); on rejection the token is drawn from norm(max(0, p - q)).
- tree: the children of a node are deterministic proposals (the drafter's top-k), i.e. point
  masses. Trying them in turn, child c is kept with probability r(c) where r starts as p and,
  after each rejection, loses c and is renormalised; if none is kept the token is drawn from
  the final r. Each try is speculative sampling with q = delta_c, so the token is
  distributed as p.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

Rows = Callable[[int], Tensor]  # verified position -> its logits or probabilities [V]


def greedy_chain(draft: list[int], logits: Rows) -> tuple[int, int]:
    """draft: k target ids; position i of the verification holds the root (i = 0) or y_i.
    Returns (accepted count a, the target's token after y_a)."""
    for i, token in enumerate(draft):
        best = int(logits(i).argmax())
        if best != token:
            return i, best
    return len(draft), int(logits(len(draft)).argmax())


def children_by_token(tokens: list[int], parents: list[int]) -> list[dict[int, int]]:
    """For each node, {token: child}. Siblings carry distinct tokens (top-k proposals)."""
    table: list[dict[int, int]] = [{} for _ in tokens]
    for node, parent in enumerate(parents):
        if parent >= 0:
            table[parent][tokens[node]] = node
    return table


def greedy_tree(tokens: list[int], parents: list[int], logits: Rows) -> tuple[list[int], int]:
    """Verification tree (root = node 0): (accepted path incl. the root, the next token)."""
    children = children_by_token(tokens, parents)
    path = [0]
    while True:
        best = int(logits(path[-1]).argmax())
        child = children[path[-1]].get(best)
        if child is None:
            return path, best
        path.append(child)


def _draw(probs: Tensor, generator: torch.Generator) -> int:
    return int(torch.multinomial(probs, 1, generator=generator))


def _uniform(generator: torch.Generator) -> float:
    return float(torch.rand((), generator=generator, dtype=torch.float64))


def sample_chain(
    draft: list[int], q_at: list[float], q_full: Rows, p: Rows, generator: torch.Generator
) -> tuple[int, int]:
    """Speculative sampling of a chain.

    draft: k target ids drawn from the drafter; q_at[i]: the draft probability of draft[i];
    q_full(i): the drafter's distribution of step i over the target vocabulary; p(i): the
    target's distribution at verified position i. Returns (accepted count a, the next token).
    """
    for i, token in enumerate(draft):
        p_i = p(i)
        if _uniform(generator) * q_at[i] < float(p_i[token]):  # u < p/q, without dividing by q
            continue
        residual = (p_i - q_full(i)).clamp(min=0)
        total = residual.sum()
        # q == p exactly leaves no residual; rejection then has probability 0, p is the fallback.
        return i, _draw(residual / total if total > 0 else p_i, generator)
    return len(draft), _draw(p(len(draft)), generator)


def sample_tree(
    tokens: list[int], children: list[list[int]], p: Rows, generator: torch.Generator
) -> tuple[list[int], int]:
    """Multi-candidate rejection over a tree with point-mass proposals (see module doc).

    children[i]: node i's children in proposal order; p(i): the target's distribution at i.
    Returns (path incl. the root, the next token).
    """
    path = [0]
    while True:
        node = path[-1]
        residual = p(node)
        moved = False
        for child in children[node]:
            token = tokens[child]
            if _uniform(generator) < float(residual[token]):
                path.append(child)
                moved = True
                break
            residual = residual.clone()
            residual[token] = 0
            total = residual.sum()
            if total <= 0:  # all mass was on rejected tokens: impossible up to rounding
                residual = p(node)
                break
            residual = residual / total
        if not moved:
            return path, _draw(residual, generator)
