"""Tree masks, tree selection, and the target's KV cache after a partial acceptance."""

from __future__ import annotations

import pytest
import torch
from test_decoding_fixtures import prompts, tiny_target
from transformers import DynamicCache

from eagle3.decoding.engine import TargetRunner
from eagle3.decoding.kv import keep_verified
from eagle3.decoding.tree import DraftTree, ancestor_matrix, verify_mask
from eagle3.decoding.verify import greedy_tree

# Tiny models: one thread is faster than two (and kinder to a shared CPU).
pytestmark = pytest.mark.usefixtures("one_thread")

# root 0; 1, 2 under the root; 3, 4 under 1; 5 under 2; 6 under 3
PARENTS = torch.tensor([-1, 0, 0, 1, 1, 2, 3])
DEPTHS = torch.tensor([0, 1, 1, 2, 2, 2, 3])


def path_to_root(node: int) -> list[int]:
    path = [node]
    while PARENTS[path[-1]] >= 0:
        path.append(int(PARENTS[path[-1]]))
    return path[::-1]


def test_ancestor_matrix_and_mask():
    anc = ancestor_matrix(PARENTS, DEPTHS)
    for node in range(len(PARENTS)):
        assert anc[node].nonzero(as_tuple=True)[0].tolist() == path_to_root(node)
    mask = verify_mask(5, PARENTS, DEPTHS, torch.float32)
    assert mask.shape == (1, 1, 7, 12)
    assert (mask[0, 0, :, :5] == 0).all()  # the committed prefix is visible to all
    assert torch.equal(mask[0, 0, :, 5:] == 0, anc)
    assert (mask[0, 0, :, 5:][~anc] == torch.finfo(torch.float32).min).all()


def test_select_keeps_ancestors_and_best_scores():
    # depth-1: a (-0.1), b (-2.0); under a: c (-0.3), d (-5); under b: e (-2.1); under c: f (-0.3, tie)
    tree = DraftTree(
        tokens=torch.tensor([10, 11, 12, 13, 14, 15]),
        parents=torch.tensor([-1, -1, 0, 0, 1, 2]),
        depths=torch.tensor([1, 1, 2, 2, 2, 3]),
        scores=torch.tensor([-0.1, -2.0, -0.3, -5.0, -2.1, -0.3]),
    )
    small = tree.select(3)
    assert small.tokens.tolist() == [10, 12, 15]  # the tie with the parent keeps the parent first
    assert small.parents.tolist() == [-1, 0, 1]
    tokens, parents, depths = small.with_root(99)
    assert tokens.tolist() == [99, 10, 12, 15] and parents.tolist() == [-1, 0, 1, 2]
    assert depths.tolist() == [0, 1, 2, 3]
    assert tree.select(10) is tree


@torch.no_grad()
def test_tree_logits_equal_each_path_run_alone_and_cache_rollback():
    target = tiny_target()
    prefix = prompts(1, length=9)[0]
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(1, 300, (len(PARENTS),), generator=g)
    past = len(prefix)

    runner = TargetRunner(target)
    cache = DynamicCache(config=target.config)
    runner.hidden(torch.tensor(prefix), torch.arange(past), cache)
    mask = verify_mask(past, PARENTS, DEPTHS, torch.float64)
    tree_logits = runner.logits(runner.hidden(tokens, past + DEPTHS, cache, mask))

    # Every node's logits equal those of its own path run as a plain sequence.
    for node in range(len(PARENTS)):
        path = tokens[path_to_root(node)]
        plain = target(torch.tensor([prefix + path.tolist()])).logits[0, -1]
        torch.testing.assert_close(tree_logits[node], plain, rtol=0, atol=1e-12)

    # Partial acceptance along 0 -> 1 -> 3 (node 4, a sibling of 3, and 2's subtree rejected).
    keep = [0, 1, 3]
    keep_verified(cache, len(PARENTS), keep)
    reference = DynamicCache(config=target.config)
    runner.hidden(torch.tensor(prefix + tokens[keep].tolist()), torch.arange(past + 3), reference)
    assert cache.get_seq_length() == past + 3
    for mine, ref in zip(cache.layers, reference.layers, strict=True):
        torch.testing.assert_close(mine.keys, ref.keys, rtol=0, atol=1e-12)
        torch.testing.assert_close(mine.values, ref.values, rtol=0, atol=1e-12)
    # ... and decoding continues exactly as from the plain sequence.
    nxt = torch.tensor([7])
    torch.testing.assert_close(
        runner.hidden(nxt, torch.tensor([past + 3]), cache),
        runner.hidden(nxt, torch.tensor([past + 3]), reference),
        rtol=0,
        atol=1e-12,
    )


def test_greedy_tree_walks_only_matching_paths():
    tokens = torch.tensor([5, 1, 2, 3, 4, 6, 7])
    v = 10
    logits = torch.zeros(len(PARENTS), v)
    # the target wants 2 after the root (node 2), then 6 after node 2 (node 5), then 9
    logits[0, 2] = logits[2, 6] = logits[5, 9] = 1.0
    logits[1, 3] = 1.0  # node 1's subtree would match, but node 1 itself is rejected
    rows = logits.__getitem__
    path, bonus = greedy_tree(tokens.tolist(), PARENTS.tolist(), rows)
    assert path == [0, 2, 5] and bonus == 9
    logits[0] = 0
    logits[0, 8] = 1.0  # no child matches: only the root, bonus from the root
    assert greedy_tree(tokens.tolist(), PARENTS.tolist(), rows) == ([0], 8)
