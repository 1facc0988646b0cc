"""Simulated acceptance per draft shape (eagle3/train/simulate.py) against a reference that
drafts each position on its own, builds the engine's DraftTree and keeps its `budget` best
nodes with DraftTree.select: the batched simulation must agree position by position."""

from __future__ import annotations

import pytest
import torch
from test_train import H, K, V, tiny_cfg, tiny_inputs, tiny_params

from eagle3.decoding.tree import DraftTree
from eagle3.drafter import Eagle3Drafter
from eagle3.drafter.ttt_attention import TTTCache
from eagle3.train.data import Batch
from eagle3.train.loop import train_drafter
from eagle3.train.report import stage_metrics
from eagle3.train.simulate import SHAPES, DraftShape, accepted_lengths
from eagle3.train.ttt import LossConfig, TTTModel, shift_left

pytestmark = pytest.mark.slow

T = 24


def setup(seed: int) -> tuple[TTTModel, Batch]:
    g = torch.Generator().manual_seed(seed)
    embed, head = torch.randn(V, H, generator=g), torch.randn(V, H, generator=g)
    ids = torch.arange(K) * 3
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[ids] = True
    torch.manual_seed(seed)
    drafter = Eagle3Drafter(tiny_cfg(), embed_weight=embed).double().eval()
    drafter.set_vocab_mapping(ids - torch.arange(K), t2d)
    # a drafter with sharp, varied distributions: scaled-up random weights
    with torch.no_grad():
        drafter.lm_head.weight.mul_(8)
    real = torch.ones(1, T, dtype=torch.bool)
    batch = Batch(
        input_ids=ids[torch.randint(0, K, (1, T), generator=g)],
        loss_mask=real.clone(),
        in_draft=real.clone(),
        real=real,
        position_ids=torch.arange(T)[None],
        aux_hidden=torch.randn(1, T, 3 * H, generator=g).double(),
        last_hidden=torch.randn(1, T, H, generator=g).double(),
    )
    return TTTModel(drafter, head[ids].double(), LossConfig(ttt_length=2, decay=0.8)), batch


def reference(model: TTTModel, batch: Batch, shape: DraftShape) -> list[int]:
    m, k = model.drafter, shape.topk
    target = (batch.last_hidden @ model.head_rows.T).argmax(-1)[0]  # draft slot of the target's argmax
    first = m(
        shift_left(batch.input_ids, 1), m.project(batch.aux_hidden), batch.position_ids, cache := TTTCache()
    )
    out = []
    for t in range(T - 2):  # positions with a target one and two tokens ahead
        s1, d1 = torch.log_softmax(m.logits(first[0, t]).float(), -1).topk(k)
        tokens, parents, depths, scores = (
            [d1],
            [torch.full((k,), -1)],
            [torch.ones(k, dtype=torch.long)],
            [s1],
        )
        for j in range(k if shape.depth > 1 else 0):
            step = shift_left(batch.input_ids, 2).clone()
            step[0, t] = m.to_target_ids(d1[j])  # this position alone: the batched version swaps all
            alt = TTTCache()
            alt.k, alt.v = cache.k, cache.v
            second = m(step, first, batch.position_ids + 1, alt)
            s2, d2 = torch.log_softmax(m.logits(second[0, t]).float(), -1).topk(k)
            tokens.append(d2)
            parents.append(torch.full((k,), j))
            depths.append(torch.full((k,), 2))
            scores.append(s1[j] + s2)
        tree = DraftTree(torch.cat(tokens), torch.cat(parents), torch.cat(depths), torch.cat(scores))
        kept = tree.select(shape.budget)
        accepted, node = 1, -1
        for depth, wanted in ((1, target[t + 1]), (2, target[t + 2])):
            hit = [i for i in range(len(kept.tokens)) if kept.parents[i] == node and kept.tokens[i] == wanted]
            if depth > shape.depth or not hit:
                break
            accepted, node = accepted + 1, hit[0]
        out.append(accepted)
    return out


@pytest.mark.parametrize("seed", [0, 1])
def test_batched_simulation_equals_the_engines_tree_per_position(seed):
    model, batch = setup(seed)
    simulated = accepted_lengths(model, batch)
    for shape in SHAPES:
        expected = reference(model, batch, shape)
        assert simulated[shape.name][: T - 2].tolist() == expected, shape.name
    # and the figures are not trivially equal: the shapes differ somewhere
    assert len({tuple(v.tolist()) for v in simulated.values()}) > 1


def test_training_reports_each_trained_depths_shapes_per_epoch(tmp_path):
    """Shapes as deep as the unroll, after every epoch; a chain of 1 is the old chain figure."""
    p = tiny_params(ttt_length=1, epochs=2)
    outcome = train_drafter(p, tiny_inputs(tmp_path / "features", p), tmp_path / "checkpoints")
    for epoch in outcome.epochs:
        assert set(epoch["heldout"]["sim_acceptance"]) == {"chain 1", "tree 1/8/8"}
    held = outcome.metrics["heldout"]
    assert held["sim_acceptance"]["chain 1"] == pytest.approx(held["acceptance_length"])
    assert held["sim_acceptance"]["tree 1/8/8"] >= held["sim_acceptance"]["chain 1"]


def test_training_reports_simulated_acceptance_by_draft_position(tmp_path):
    """Each shape's accepted drafts by position, as speculative-eval counts them (share of steps
    accepting position k among those that accepted k-1), in metrics/train.json; past the trees'
    depth 2, the unroll's own chains."""
    p = tiny_params(ttt_length=3, epochs=1)
    outcome = train_drafter(p, tiny_inputs(tmp_path / "features", p), tmp_path / "checkpoints")
    held = outcome.metrics["heldout"]
    shares = held["sim_per_position"]
    assert set(shares) == set(held["sim_acceptance"]) | {"chain 3"}
    assert all(
        list(s) == [str(k) for k in range(1, int(name[-1]) + 1)]
        for name, s in shares.items()
        if "chain" in name
    )
    assert list(shares["tree 2/4/6"]) == ["1", "2"]
    # a chain's shares multiply to the share of chains that reach each depth
    reached = 1.0
    for k, survival in enumerate(held["chain_survival"]):
        reached *= shares["chain 3"][str(k + 1)]
        assert reached == pytest.approx(survival)
    # a shape's shares give back its simulated acceptance length: 1 + sum of the reach products
    tree = shares["tree 2/4/6"]
    assert held["sim_acceptance"]["tree 2/4/6"] == pytest.approx(1 + tree["1"] + tree["1"] * tree["2"])
    assert 0 < shares["chain 1"]["1"] < 1
    metrics = stage_metrics(outcome)
    assert metrics["sim_per_position"]["chain 3"] == {k: round(v, 6) for k, v in shares["chain 3"].items()}
