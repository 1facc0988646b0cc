"""oneDNN pre-packed Linear layers: same results as nn.Linear (to float32 rounding), only where packable."""

from __future__ import annotations

import copy

import pytest
import torch
from test_decoding_fixtures import EOS, engine, fitted_pair, prompts, tiny_target
from torch import nn

from eagle3.core.packed import PackedLinear, pack_linears, packing_available
from eagle3.decoding.engine import greedy_decode

pytestmark = [
    pytest.mark.skipif(
        not packing_available(torch.float32), reason="oneDNN packing is not available in this torch build"
    ),
    pytest.mark.usefixtures("one_thread"),  # tiny models: one thread is faster than two
]


@pytest.mark.parametrize("rows", [1, 5, 9])
@pytest.mark.parametrize("bias", [False, True])
def test_packed_linear_matches_linear(rows, bias):
    torch.manual_seed(0)
    linear = nn.Linear(96, 200, bias=bias)
    x = torch.randn(2, rows, 96)
    with torch.no_grad():
        assert torch.allclose(PackedLinear(linear)(x), linear(x), rtol=1e-5, atol=1e-5)


def test_pack_linears_swaps_float32_layers_only():
    target32 = tiny_target(torch.float32)
    n_linear = sum(type(m) is nn.Linear for m in target32.modules())
    ids = torch.tensor([prompts(1)[0]])
    before = target32(ids).logits
    assert pack_linears(target32) == n_linear > 0
    assert not any(type(m) is nn.Linear for m in target32.modules())
    assert torch.allclose(target32(ids).logits, before, atol=1e-4)
    # the tied/original weights stay reachable for callers that read dtype and shape
    assert target32.get_output_embeddings().weight.dtype == torch.float32
    assert pack_linears(tiny_target(torch.float64)) == 0  # float64 keeps nn.Linear (exact tests)


@pytest.mark.slow
def test_packed_target_and_drafter_decode_like_plain_greedy():
    target64, drafter64 = fitted_pair()
    # copies: the fitted pair is cached and shared with the float64 tests
    target, drafter = copy.deepcopy(target64).float(), copy.deepcopy(drafter64).float()
    pack_linears(target)
    pack_linears(drafter)
    spec = engine(target, drafter, mode="chain", k=4)
    for p in prompts(8)[:3]:
        out = spec.generate(p, 30, EOS)
        assert out.tokens == greedy_decode(target, p, 30, EOS).tokens
        assert sum(out.accepted) > 0  # the packed drafter still drafts what it was fitted to
