"""Draft trees: node bookkeeping, the EAGLE-2 style selection, and attention masks.

A tree is a flat list of nodes in creation order (a parent always precedes its children);
node 0 of a *verification* tree is the root, the last committed token, whose KV entry the
target has not computed yet. `parents[i]` is the index of node i's parent (-1 for the root).
Masks are computed level by level with tensor ops (the depth is small), never per node.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


def ancestor_matrix(parents: Tensor, depths: Tensor) -> Tensor:
    """Bool [N, N]: entry (i, j) is True when j is i itself or one of i's ancestors.

    Nodes must be ordered so that a parent precedes its children; roots have parent -1.
    """
    n = parents.shape[0]
    anc = torch.eye(n, dtype=torch.bool)
    for depth in range(1, int(depths.max()) + 1 if n else 1):
        rows = (depths == depth).nonzero(as_tuple=True)[0]
        if len(rows) == 0:
            continue
        par = parents[rows]
        has = par >= 0
        if has.any():
            anc[rows[has]] |= anc[par[has]]
    return anc


def additive_mask(visible: Tensor, dtype: torch.dtype) -> Tensor:
    """Bool visibility -> the additive float mask transformers takes (0 = attend, min = blocked)."""
    mask = torch.zeros(visible.shape, dtype=dtype)
    return mask.masked_fill_(~visible, torch.finfo(dtype).min)


def verify_mask(past: int, parents: Tensor, depths: Tensor, dtype: torch.dtype) -> Tensor:
    """Additive [1, 1, N, past + N]: every node sees the whole committed prefix (past entries)
    and, among the N tree nodes, itself and its ancestors."""
    anc = ancestor_matrix(parents, depths)
    prefix = torch.ones(anc.shape[0], past, dtype=torch.bool)
    return additive_mask(torch.cat([prefix, anc], dim=1), dtype)[None, None]


def graft_chain(
    tokens: Tensor, parents: Tensor, depths: Tensor, chain: list[int]
) -> tuple[Tensor, Tensor, Tensor]:
    """A verification tree (root first) with `chain` hung under its root: the chain follows
    existing nodes while their tokens agree and grows new ones (appended, so parents still
    precede children) from the first disagreement on. Siblings stay distinct."""
    toks, pars, deps = tokens.tolist(), parents.tolist(), depths.tolist()
    children: dict[tuple[int, int], int] = {
        (p, t): i for i, (p, t) in enumerate(zip(pars, toks, strict=True)) if p >= 0
    }
    node = 0
    for token in chain:
        child = children.get((node, token))
        if child is None:
            child = len(toks)
            toks.append(token)
            pars.append(node)
            deps.append(deps[node] + 1)
            children[(node, token)] = child
        node = child
    return torch.tensor(toks), torch.tensor(pars), torch.tensor(deps)


@dataclass
class DraftTree:
    """The nodes a tree draft produced, before selection (no root: depth-1 nodes have parent -1).

    tokens: target-vocabulary ids [N]; parents [N]; depths [N] (1-based); scores [N]
    (cumulative draft log-probabilities along the path, the EAGLE-2 ranking).
    """

    tokens: Tensor
    parents: Tensor
    depths: Tensor
    scores: Tensor

    def select(self, budget: int) -> DraftTree:
        """The `budget` highest-scoring nodes, as a tree of their own (indices renumbered).

        A child's score never exceeds its parent's (log-probabilities are <= 0) and the stable
        sort keeps a parent ahead of an equally scored child, so the chosen set contains the
        ancestors of every chosen node.
        """
        n = self.tokens.shape[0]
        if budget >= n:
            return self
        order = torch.sort(-self.scores, stable=True).indices[:budget]
        keep = torch.sort(order).values  # back to creation order: parents first
        new_index = torch.full((n,), -1, dtype=torch.long)
        new_index[keep] = torch.arange(budget)
        old_parents = self.parents[keep]
        parents = torch.where(old_parents >= 0, new_index[old_parents.clamp(min=0)], -1)
        if bool(((old_parents >= 0) & (parents < 0)).any()):
            raise AssertionError("tree selection dropped an ancestor of a kept node")
        return DraftTree(self.tokens[keep], parents, self.depths[keep], self.scores[keep])

    def with_root(self, root_token: int) -> tuple[Tensor, Tensor, Tensor]:
        """(tokens, parents, depths) of the verification tree: root first, nodes shifted by one."""
        tokens = torch.cat([torch.tensor([root_token], dtype=torch.long), self.tokens])
        parents = torch.cat([torch.tensor([-1]), torch.where(self.parents >= 0, self.parents + 1, 0)])
        depths = torch.cat([torch.tensor([0]), self.depths])
        return tokens, parents, depths
