"""The official EAGLE-3 trainer's two conventions as train params: which drafted tokens
count at a turn boundary (train.loss_positions) and what a step's loss is averaged over
(train.loss_average); the defaults keep today's training bit for bit."""

from __future__ import annotations

import pytest
import torch
from test_train import H, K, V, tiny_cfg, tiny_inputs, tiny_params

from eagle3.core.params import ParamsError, parse_params
from eagle3.drafter import Eagle3Drafter
from eagle3.train.data import Batch
from eagle3.train.loop import train_drafter
from eagle3.train.ttt import LossConfig, TTTModel, loss_norm, shift_left, step_valid

# header, header, answer a0 a1 a2, end of turn, header of the next turn, its answer b0 b1, end
MASK = [0, 0, 1, 1, 1, 1, 0, 0, 1, 1, 1]


def batch_of(masks: list[list[int]], pad: int = 0) -> Batch:
    """Right-padded rows with these loss masks (a row's length is its mask's), `pad` columns
    past the longest (the loader pads widths to a multiple of 32)."""
    g = torch.Generator().manual_seed(0)
    width = max(len(m) for m in masks) + pad
    real = torch.tensor([[i < len(m) for i in range(width)] for m in masks])
    loss_mask = torch.tensor([m + [0] * (width - len(m)) for m in masks], dtype=torch.bool)
    ids = torch.randint(0, K, (len(masks), width), generator=g) * 3  # draft-vocab tokens
    return Batch(
        input_ids=ids * real,
        loss_mask=loss_mask,
        in_draft=real.clone(),
        real=real,
        position_ids=torch.arange(width).expand(len(masks), width).contiguous(),
        aux_hidden=torch.randn(len(masks), width, 3 * H, generator=g).double(),
        last_hidden=torch.randn(len(masks), width, H, generator=g).double(),
    )


def drafted_tokens(batch: Batch, k: int, positions: str) -> list[int]:
    """The indices of the tokens whose drafts step k trains (row 0): t + 2 + k."""
    return [t + 2 + k for t in step_valid(batch, k, positions)[0].nonzero().flatten().tolist()]


@pytest.mark.parametrize("k", [0, 1])
def test_each_convention_counts_its_own_drafted_tokens(k):
    batch = batch_of([MASK])
    # after_assistant: tokens following an assistant token, the one after each end of turn
    # included (6, the next header; 11, past the end: the target's prediction there)
    assert drafted_tokens(batch, k, "after_assistant") == [t for t in [3, 4, 5, 6, 9, 10, 11] if t > k + 1]
    # assistant (the official trainer): the assistant tokens, each answer's first (2, 8) included
    assert drafted_tokens(batch, k, "assistant") == [t for t in [2, 3, 4, 5, 8, 9, 10] if t > k + 1]
    # drafted: what decoding drafts, both
    assert drafted_tokens(batch, k, "drafted") == [t for t in [3, 4, 5, 9, 10] if t > k + 1]


def test_the_default_positions_are_the_former_rule():
    batch = batch_of([MASK, MASK[:7]])
    batch.in_draft[0, 4] = False
    for k in range(3):
        n = 1 + k
        former = (
            shift_left(batch.real, n, False)
            & shift_left(batch.loss_mask, n, False)
            & shift_left(batch.in_draft, n, False)
        )
        assert torch.equal(step_valid(batch, k), former)
    counts = torch.tensor([5.0, 4.0], dtype=torch.float64)
    assert loss_norm(batch, counts) is counts  # token: the counts themselves, no new rounding


def test_an_unknown_convention_is_refused():
    batch = batch_of([MASK])
    with pytest.raises(ValueError, match="after_assistant, assistant or drafted"):
        step_valid(batch, 0, "header")
    with pytest.raises(ValueError, match="token or row"):
        loss_norm(batch, torch.ones(1), "sample")
    with pytest.raises(ParamsError, match="loss_average"):
        parse_params({"train": {"loss_average": "sample"}})
    # the TTT model's loss config refuses them too, before any batch
    with pytest.raises(
        ValueError, match=r"^loss positions 'header': use one of after_assistant, assistant, drafted$"
    ):
        LossConfig(2, 0.8, positions="header")
    with pytest.raises(ValueError, match=r"^loss average 'sample': use one of token, row$"):
        LossConfig(2, 0.8, average="sample")


def tiny_model(**kw) -> TTTModel:
    g = torch.Generator().manual_seed(3)
    embed, head = torch.randn(V, H, generator=g), torch.randn(V, H, generator=g)
    ids = torch.arange(K) * 3
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[ids] = True
    torch.manual_seed(3)
    drafter = Eagle3Drafter(tiny_cfg(), embed_weight=embed).double()
    drafter.set_vocab_mapping(ids - torch.arange(K), t2d)
    return TTTModel(drafter, head[ids].double(), LossConfig(ttt_length=2, decay=0.8, **kw))


def test_row_average_divides_every_step_by_the_padded_batch():
    """The official `.mean()` over [B, T] (T = the longest row): the same summed losses, divided
    by B x T instead of each step's counted positions."""
    batch, width = batch_of([MASK, MASK[:7]], pad=5), len(MASK)  # padding past the longest: not counted
    with torch.no_grad():
        token_loss, stats = tiny_model()(batch)
        row_loss, row_stats = tiny_model(average="row")(batch)
    assert torch.equal(stats.loss_sum, row_stats.loss_sum)
    expected = sum(0.8**k * stats.loss_sum[k] / (2 * width) for k in range(2))
    assert float(row_loss) == pytest.approx(float(expected), rel=1e-6)  # summed in float32
    by_token = sum(0.8**k * stats.loss_sum[k] / stats.count[k] for k in range(2))
    assert float(token_loss) == pytest.approx(float(by_token), rel=1e-6)  # summed in float32
    assert float(row_loss) < float(token_loss)  # fewer counted positions than B x T


@pytest.mark.slow
def test_the_official_conventions_train_differently(tmp_path):
    """Each param reaches the training steps; the defaults train what naming them trains."""

    def weights(**kw) -> dict[str, torch.Tensor]:
        p = tiny_params(epochs=1, **kw)
        folder = tmp_path / "_".join(["run", *kw.values()])
        return train_drafter(p, tiny_inputs(folder, p)).drafter.state_dict()

    default = weights()
    named = weights(loss_positions="after_assistant", loss_average="token")
    assert all(torch.equal(default[n], named[n]) for n in default)
    for changed in (weights(loss_positions="assistant"), weights(loss_average="row")):
        assert any(not torch.equal(default[n], changed[n]) for n in default)
