"""The bytes of hidden-state rows between processes, declared once: the fp8 row format that the
feature store's shards (eagle3/data/store.py) and the SGLang hook's pieces share, and the names
of the hook transport's files in its hand-over folder (written by eagle3/sglang/aux_hook.py
inside SGLang's server, read by eagle3/sglang/handover.py in the client).

torch and the standard library only: SGLang server processes import this module through
--forward-hooks (eagle3.sglang.aux_hook), where the project's other dependencies may be absent.

Files in the hand-over folder, each named after the request id (rid, which starts with RID_PREFIX):
  <rid>.<start>-<end>.<dtype>  a piece: positions start..end-1, each row the aux layers' states
                               side by side, row-major; dtype the model's (bfloat16, float16,
                               float32) or FP8: the n rows as float8_e4m3fn [n, W], then one
                               float32 scale per row [n], native byte order, n * (W + 4) bytes
  <rid>.err                    one line: the end of the rows the hook could not place ("-" if
                               it cannot tell), a space, why
  <rid>.cancel                 the client gave up on the request: its prompt length, one line;
                               the hook drops the request's later pieces and removes the marker
                               with the last one (the piece that reaches the prompt length)
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

RID_PREFIX = "e3-"  # every request id this project hands over through a hook starts so
SAFE_RID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,199}$")  # a rid usable as a file name
FP8 = "float8_e4m3fn"
FP8_MAX = 448.0  # the largest float8_e4m3fn value: a row's amax is stored as it
QUANTIZE_BYTES = 1 << 20  # float32 rows quantized at a time on a CPU: they stay in cache
PIECE_DTYPES = {
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float32": torch.float32,
    FP8: torch.float8_e4m3fn,
}
ERROR, CANCEL = "err", "cancel"  # the suffixes of a request's error line and its cancel marker


def quantize_rows(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """float8_e4m3fn rows and their float32 scales of rows [N, D] (bf16 in the store and the
    hook): scale = row amax / 448, 1 for a zero row (so it stays zero); row / scale clamped to
    +-448, rounded to e4m3. A row's |x| max as max(max, -min) in its own dtype and the division
    promoted to float32 are exact, so the bytes are those of the same formula in float32. On a
    CPU a few rows at a time, their float32 copies kept in cache (2.4x faster at Kimi-K2.5's
    width); element-wise, so the same bytes whatever the chunking, on every run."""
    fp8 = torch.empty(rows.shape, dtype=torch.float8_e4m3fn, device=rows.device)
    scales = torch.empty(rows.shape[0], dtype=torch.float32, device=rows.device)
    step = rows.shape[0] if rows.is_cuda else max(1, QUANTIZE_BYTES // (4 * max(1, rows.shape[-1])))
    for lo in range(0, rows.shape[0], step):
        part = rows[lo : lo + step]
        scale = torch.maximum(part.amax(-1), -part.amin(-1)).float() / FP8_MAX
        scale = torch.where(scale > 0, scale, torch.ones_like(scale))
        fp8[lo : lo + step] = (part / scale[:, None]).clamp_(-FP8_MAX, FP8_MAX)  # float32, then e4m3
        scales[lo : lo + step] = scale
    return fp8, scales


def dequantize_rows(fp8: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """float32 rows of fp8 rows and their scales: fp8 -> float32 x the row's scale."""
    return fp8.float() * scales[:, None]


def dtype_tag(dtype: torch.dtype) -> str:
    """The name a piece's dtype has in its file name (torch.bfloat16 -> "bfloat16")."""
    return str(dtype).removeprefix("torch.")


@dataclass(frozen=True)
class Piece:
    """One piece file of a request: rows of positions start..end-1 in `dtype`."""

    rid: str
    start: int
    end: int
    dtype: str

    @property
    def name(self) -> str:
        return f"{self.rid}.{self.start}-{self.end}.{self.dtype}"

    @property
    def rows(self) -> int:
        return self.end - self.start

    def size(self, width: int) -> int:
        """The piece's bytes for rows of `width` values."""
        if self.dtype == FP8:
            return self.rows * (width + 4)  # fp8 rows, then a float32 scale per row
        return self.rows * width * PIECE_DTYPES[self.dtype].itemsize


def parse_piece(name: str) -> Piece | None:
    """The piece a file name names, or None for any other file (an error line, a cancel
    marker, a temporary file, another program's): the inverse of Piece.name."""
    parts = name.rsplit(".", 2)  # a rid may hold dots: the last two fields are the span and dtype
    if len(parts) != 3:
        return None
    rid, span, dtype = parts
    start, _, end = span.partition("-")
    if dtype not in PIECE_DTYPES or not (start.isdecimal() and end.isdecimal()):
        return None
    piece = Piece(rid, int(start), int(end), dtype)
    return piece if piece.name == name else None  # "007" or "+7" is no name the hook writes


def error_name(rid: str) -> str:
    return f"{rid}.{ERROR}"


def error_text(why: str, end: int | None) -> str:
    """An error line's content: up to which position the rows are lost (the client then knows
    whether more of the request may follow), and why."""
    return f"{'-' if end is None else end} {why}\n"


def parse_error(text: str) -> tuple[int | None, str]:
    """(end, why) of an error line's content."""
    end, _, why = text.strip().partition(" ")
    return (int(end) if end.isdecimal() else None), why


def cancel_name(rid: str) -> str:
    return f"{rid}.{CANCEL}"


def cancel_text(prompt_len: int) -> str:
    """A cancel marker's content: the prompt length, whose piece is the request's last."""
    return f"{prompt_len}\n"


def cancelled_length(text: str) -> int | None:
    """The prompt length a cancel marker holds (None if it holds none)."""
    return int(text) if text.strip().isdecimal() else None


def temporary_name(name: str, writer: int | str) -> str:
    """Where `writer` (a process id) writes a file before its rename to `name`: hidden, and for
    a rid of this project under "." + RID_PREFIX, so that stale ones are found."""
    return f".{name}.{writer}.tmp"


def decode_piece(raw: torch.Tensor, piece: Piece, width: int) -> torch.Tensor:
    """A piece's bytes (uint8, piece.size(width) of them) as float32 rows [n, width]: the
    model's dtype widened, or fp8 x row scale (the feature store's read of an fp8 row before
    its bf16 cast)."""
    n = piece.rows
    if piece.dtype != FP8:
        return raw.view(PIECE_DTYPES[piece.dtype]).view(n, width).float()
    scales = raw[n * width :].clone().view(torch.float32)  # cloned: the scales' offset may be unaligned
    return dequantize_rows(raw[: n * width].view(torch.float8_e4m3fn).view(n, width), scales)
