"""vocab-map: the d2t/t2d convention, tie-breaking, the identity at full size, coverage."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from eagle3.drafter.config import DrafterConfig
from eagle3.vocab import (
    build_vocab_map,
    count_tokens,
    coverage_curve,
    coverage_of,
    draft_size,
    load_mapping,
    save_vocab_map,
)


def test_target_id_is_draft_id_plus_d2t():
    ids = np.array([5, 5, 5, 2, 2, 9, 7, 7, 7, 7, 1], dtype=np.int32)
    mask = np.array([1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 0], dtype=np.uint8)  # token 1 is not an assistant token
    counts = count_tokens(ids, mask, vocab_size=12)
    vocab = build_vocab_map(counts, size=3)
    # most frequent: 7 (4), 5 (3), 2 (2); draft ids are those target ids in ascending order
    assert vocab.draft_to_target.tolist() == [2, 5, 7]
    assert vocab.d2t.tolist() == [2, 4, 5]
    assert torch.equal(torch.arange(3) + vocab.d2t, torch.tensor([2, 5, 7]))
    assert vocab.t2d.nonzero().flatten().tolist() == [2, 5, 7]
    assert vocab.coverage() == pytest.approx(9 / 10)


def test_ties_are_broken_by_token_id():
    counts = np.array([0, 3, 3, 3, 1])
    assert build_vocab_map(counts, size=2).draft_to_target.tolist() == [1, 2]


def test_full_size_is_identity():
    counts = np.array([4, 0, 2, 9, 0, 1])
    for size in (6, 100):
        vocab = build_vocab_map(counts, size)
        assert vocab.draft_size == 6
        assert (vocab.d2t == 0).all() and vocab.t2d.all()
        assert vocab.coverage() == 1.0


def test_one_draft_size_clamp_for_the_mapping_the_drafter_and_the_plan():
    """vocab.size above the target's vocabulary is the whole vocabulary, wherever it is read: the
    mapping vocab-map builds, the drafter config, a warm start's check and the plan's grid."""
    assert draft_size(8192, 49152) == 8192 and draft_size(300_000, 49152) == 49152
    assert build_vocab_map(np.arange(6), 100).draft_size == draft_size(100, 6) == 6
    sizes = {"hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4, "vocab_size": 500}
    target = SimpleNamespace(**sizes, max_position_embeddings=64)
    assert DrafterConfig.from_target_config(target, 10_000, [0, 1, 2]).draft_vocab_size == 500


def test_fewer_distinct_tokens_than_k_fills_deterministically():
    counts = np.array([0, 5, 0, 2, 0, 0])
    vocab = build_vocab_map(counts, size=4)
    assert vocab.draft_to_target.tolist() == [0, 1, 2, 3]  # 1 and 3, then unseen 0 and 2 (lowest ids)
    assert vocab.unseen_filled == 2


def test_coverage_curve_is_monotone_and_ends_at_one():
    counts = np.random.default_rng(0).zipf(1.5, 1000) % 500
    curve = coverage_curve(np.bincount(counts, minlength=500), [10, 100, 1000])
    values = [c for _, c in curve]
    assert [k for k, _ in curve] == [10, 100, 500]
    assert values == sorted(values) and values[-1] == pytest.approx(1.0)


def test_ids_outside_vocab_are_rejected():
    with pytest.raises(ValueError, match="outside the target vocabulary"):
        count_tokens(np.array([3, 70]), np.array([1, 1]), vocab_size=50)


def test_mapping_round_trip(tmp_path):
    vocab = build_vocab_map(np.array([1, 0, 5, 2]), size=2)
    save_vocab_map(vocab, tmp_path, {"draft_vocab_size": 2})
    d2t, t2d, meta = load_mapping(tmp_path)
    assert torch.equal(d2t, vocab.d2t) and torch.equal(t2d, vocab.t2d) and meta["draft_vocab_size"] == 2


def test_coverage_of_counts_tokens_inside_the_draft_vocab():
    t2d = torch.zeros(10, dtype=torch.bool)
    t2d[[1, 3]] = True
    assert coverage_of([1, 2, 3, 4], t2d) == 0.5
    assert coverage_of([1, 1, 1, 9], t2d) == 0.75  # repeats count each time, as in decoding
    assert coverage_of([], t2d) == 0.0
