"""eagle3/data/wire.py: the fp8 row format the feature store and the SGLang hook share, and the
names of the hook transport's files. The quantizer's bytes are pinned to those the store wrote
before the two copies became one (main f63998b, eagle3/data/store.py quantize_rows)."""

from __future__ import annotations

import hashlib

import pytest
import torch

from eagle3.data import wire
from eagle3.data.wire import (
    FP8,
    Piece,
    cancel_name,
    error_name,
    error_text,
    parse_error,
    parse_piece,
    quantize_rows,
    temporary_name,
)

# sha256 of quantize_rows(fixed_rows()): the fp8 bytes, then the float32 scales (little-endian),
# as the store's own quantizer wrote them at f63998b
FIXED_ROWS_SHA256 = "b92a5294fd67def421e313f50166639ead5f47003ff2d1dff368f53a238441ba"


def fixed_rows() -> torch.Tensor:
    """Every finite bf16 value once, 64 to a row in bit order (each row about one binade:
    subnormal to huge scales, negative rows), then an all-zero row: no generator involved."""
    bits = torch.arange(0, 1 << 16, dtype=torch.int32)
    finite = bits[((bits >> 7) & 0xFF) != 0xFF]
    rows = finite.to(torch.int16).view(torch.bfloat16)
    rows = rows[: len(rows) // 64 * 64].reshape(-1, 64)
    return torch.cat([rows, torch.zeros(1, 64, dtype=torch.bfloat16)])


def digest(fp8: torch.Tensor, scales: torch.Tensor) -> str:
    return hashlib.sha256(fp8.view(torch.uint8).numpy().tobytes() + scales.numpy().tobytes()).hexdigest()


@pytest.mark.parametrize("rows_at_a_time", [None, 1, 7])
def test_the_quantizers_bytes_are_those_the_store_wrote_before(monkeypatch, rows_at_a_time):
    """Whatever the CPU chunking (the hook's and the store's shards see different row counts)."""
    if rows_at_a_time:
        monkeypatch.setattr(wire, "QUANTIZE_BYTES", rows_at_a_time * 4 * 64)
    assert digest(*quantize_rows(fixed_rows())) == FIXED_ROWS_SHA256


def test_a_row_is_scaled_to_its_amax_at_448_and_a_zero_row_keeps_scale_one():
    rows = torch.tensor([[1.0, -2.0, 0.5, 0.0], [0.0, 0.0, 0.0, 0.0]], dtype=torch.bfloat16)
    fp8, scales = quantize_rows(rows)
    assert fp8.float().tolist() == [[224.0, -448.0, 112.0, 0.0], [0.0, 0.0, 0.0, 0.0]]
    assert scales.tolist() == [torch.tensor(2 / 448, dtype=torch.float32).item(), 1.0]
    assert torch.equal(wire.dequantize_rows(fp8, scales), rows.float())  # these values are exact in e4m3


@pytest.mark.parametrize("rid", ["e3-host-1-ab", "e3-my.host.name-7-cd"])
@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32", FP8])
def test_a_piece_name_parses_back_to_its_piece(rid, dtype):
    piece = Piece(rid, 64, 128, dtype)
    assert parse_piece(piece.name) == piece


@pytest.mark.parametrize(
    "name",
    [
        error_name("e3-x"),
        cancel_name("e3-x"),
        temporary_name("e3-x.0-4.bfloat16", 77),
        "e3-x.0-4.int8",  # no dtype a piece has
        "e3-x.04-8.bfloat16",  # not how the hook writes 4
        "e3-x.-4.bfloat16",
        "e3-x.0-4",
        "bfloat16",
    ],
)
def test_no_other_file_parses_as_a_piece(name):
    assert parse_piece(name) is None


def test_an_fp8_piece_holds_a_scale_per_row_beside_its_rows():
    assert Piece("e3-x", 0, 3, FP8).size(96) == 3 * (96 + 4)
    assert Piece("e3-x", 0, 3, "bfloat16").size(96) == 3 * 96 * 2


def test_an_error_line_tells_up_to_where_the_rows_are_lost():
    assert parse_error(error_text("cannot write /x: No space left on device", 64)) == (
        64,
        "cannot write /x: No space left on device",
    )
    assert parse_error(error_text("12 rows for extend lengths [4, 4]", None)) == (
        None,
        "12 rows for extend lengths [4, 4]",
    )
