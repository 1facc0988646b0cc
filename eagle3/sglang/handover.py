"""The hook transport: a request's aux rows handed over as raw bytes through a folder, not as
JSON numbers (extract.sglang_transport: hook).

Stock SGLang loads the project's hook factory (eagle3/sglang/aux_hook.py) through
--forward-hooks; on every prefill forward it writes each request's rows to the hand-over folder
as `<rid>.<start>-<end>.<dtype>` (positions start..end-1, each row the aux layers' states in
the model's dtype, written under a temporary name and renamed, so a file is whole once it is
there; with the hook's config dtype float8_e4m3fn, `<rid>.<start>-<end>.float8_e4m3fn`: fp8
rows then a float32 scale per row, read back as fp8 x scale in float32), or `<rid>.err` with the
reason it could not place them. The client sends /generate with
a request id of its own and without return_hidden_states (the reply carries the top logprobs
only, when the target mode asks for them), assembles the rows once the pieces cover the prompt,
and removes them. A piece that does not start at 0 is a prefix-cache hit: PartialPrefillError,
as the JSON path raises, and the caller flushes and asks again under a fresh request id. A
request given up on before its last piece arrived (a cache hit, the hook's error line, a timeout,
an error in the reply) leaves a cancel marker, so that the server's hook drops its later pieces
and removes the marker with the last one. The names and the bytes are eagle3/data/wire.py's.

The folder is the same path on the servers and the client: a local directory (or /dev/shm) on
one host, shared storage across hosts. Files of a killed client or server (and a marker whose
request never reached its last piece) are removed once they are STALE_S old, by every client
when it starts and every STALE_S / 2 while it runs, so nothing grows without bound.
"""

from __future__ import annotations

import os
import socket
import threading
import time
import uuid
from pathlib import Path

import numpy as np
import torch

from eagle3.data.wire import (
    FP8,
    RID_PREFIX,
    Piece,
    cancel_name,
    cancel_text,
    decode_piece,
    error_name,
    parse_error,
    parse_piece,
    temporary_name,
)
from eagle3.sglang.client import ServerPool, SGLangError
from eagle3.sglang.rows import PartialPrefillError, Rows, parse_top, with_cache_retries

# How long the rows may take to appear after the reply (the hook writes on a thread of its own).
WAIT_S = float(os.environ.get("EAGLE3_HANDOVER_WAIT_S", "60"))
STALE_S = 600.0  # files of requests nobody has read for this long are a killed client's


class HandoverError(SGLangError):
    """The hand-over folder is unusable, or a request's rows did not arrive whole."""


def _check_folder(folder: Path) -> None:
    """Refuse, before any request, a folder this client cannot create, write and remove in."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
        probe = folder / temporary_name(f"{RID_PREFIX}probe", f"{os.getpid()}-{uuid.uuid4().hex}")
        probe.write_bytes(b"ok")
        probe.unlink()
    except OSError as err:
        raise HandoverError(
            f"extract.sglang_handover_dir {folder}: not writable here ({err.strerror or err}); the "
            "servers write the rows there and this client reads and removes them"
        ) from None


def remove_stale(folder: Path, older_than_s: float = STALE_S) -> int:
    """Remove this project's files nobody touched for `older_than_s` seconds: a killed client's
    pieces, a killed server's temporary files, markers whose request never reached its end."""
    now, removed = time.time(), 0
    stale = [*folder.glob(f"{RID_PREFIX}*"), *folder.glob(temporary_name(f"{RID_PREFIX}*", "*"))]
    for path in stale:
        try:
            if now - path.stat().st_mtime > older_than_s:
                path.unlink()
                removed += 1
        except FileNotFoundError:  # another client took it
            continue
    return removed


def read_piece(path: Path, piece: Piece, width: int, what: str) -> torch.Tensor:
    """A piece's rows as float32 [n, width]: the model's dtype widened, or fp8 x row scale."""
    raw = torch.from_numpy(np.fromfile(path, dtype=np.uint8))
    if raw.numel() != piece.size(width):
        scales = " and their scales" if piece.dtype == FP8 else ""
        got = f"{raw.numel()} bytes for {piece.rows} rows of {width} {piece.dtype}{scales}"
        raise HandoverError(f"{path}: {got}, not {piece.size(width)} ({what})")
    return decode_piece(raw, piece, width)


class HookTransport:
    """Rows of one request from the hook's files in `folder` (see the module docstring)."""

    name = "hook"

    def __init__(self, folder: str | Path, wait_s: float = WAIT_S):
        self.folder, self.wait_s = Path(folder), wait_s
        _check_folder(self.folder)
        remove_stale(self.folder)
        self.swept_at, self.sweep_lock = time.monotonic(), threading.Lock()
        self.prefix = f"{RID_PREFIX}{socket.gethostname()}-{os.getpid()}-"

    def new_rid(self) -> str:
        return self.prefix + uuid.uuid4().hex

    def request_rows(self, pool: ServerPool, body: dict, width: int, what: str) -> Rows:
        """Send `body` (a prefill_body) with a fresh request id and no hidden states in the reply;
        the rows come from the folder. A prefix-cache hit is flushed and asked again."""
        self.sweep()
        return with_cache_retries(pool, lambda url: self._once(pool, url, body, width, what))

    def sweep(self) -> None:
        """remove_stale every STALE_S / 2 while a run goes on, not only when a client starts."""
        with self.sweep_lock:
            if time.monotonic() - self.swept_at < STALE_S / 2:
                return
            self.swept_at = time.monotonic()
        remove_stale(self.folder)

    def _once(self, pool: ServerPool, url: str, body: dict, width: int, what: str) -> Rows:
        rid, prompt_len = self.new_rid(), len(body["input_ids"])
        sent = {k: v for k, v in body.items() if k != "return_hidden_states"} | {"rid": rid}
        try:
            response = pool.generate(url, sent)
            prefill = self.collect(rid, prompt_len, width, url, what)
        finally:
            self.discard(rid, prompt_len)
        output_ids = [int(i) for i in response.get("output_ids") or []]
        rows = Rows(prefill, torch.zeros(0, width), output_ids)
        if top := body.get("top_logprobs_num"):
            rows.top_ids, rows.top_logprobs = parse_top(response, prompt_len, top, url)
        return rows

    def _files(self, rid: str) -> tuple[list[Piece], tuple[int | None, str] | None]:
        """The pieces of `rid` in the folder, and the hook's error line for it if there is one:
        (the end of the rows it lost, why)."""
        pieces, error = [], None
        for path in self.folder.glob(f"{rid}.*"):
            if path.name == error_name(rid):
                try:
                    error = parse_error(path.read_text())
                except FileNotFoundError:  # removed by this client's other look
                    continue
            elif (piece := parse_piece(path.name)) and piece.rid == rid:
                pieces.append(piece)
        return sorted(pieces, key=lambda p: (p.start, p.end)), error

    def collect(self, rid: str, prompt_len: int, width: int, url: str, what: str) -> torch.Tensor:
        """[prompt_len, width] rows as float32 (the JSON path's type), once pieces cover 0..P-1."""
        deadline = time.monotonic() + self.wait_s
        while True:
            pieces, error = self._files(rid)
            if error:
                raise HandoverError(f"the server's hook could not hand over the rows of {rid}: {error[1]}")
            if pieces and pieces[0].start > 0:
                raise PartialPrefillError(
                    f"{url}: prefix-cache hit: the hook's rows start at position {pieces[0].start} "
                    f"of {prompt_len}"
                )
            covered = 0
            for piece in pieces:
                if piece.start > covered:
                    break  # a chunk still on its way
                covered = max(covered, piece.end)
            if covered >= prompt_len:
                break
            if time.monotonic() > deadline:
                raise HandoverError(
                    f"{url}: the rows of {rid} cover {covered} of {prompt_len} positions in {self.folder} "
                    f"after {self.wait_s:g} s: is the server's --forward-hooks dir this folder, writable "
                    "and not full? (its log names a failed write)"
                )
            time.sleep(0.002)
        out = torch.empty(prompt_len, width, dtype=torch.float32)
        for piece in pieces:
            block = read_piece(self.folder / piece.name, piece, width, what)
            stop = min(piece.end, prompt_len)
            out[piece.start : stop] = block[: stop - piece.start]
        return out

    def _remove(self, rid: str, prompt_len: int) -> bool:
        """Remove the pieces and error line of `rid`; whether its last file was among them (a
        piece or an error line reaching `prompt_len`)."""
        pieces, error = self._files(rid)
        if error:
            (self.folder / error_name(rid)).unlink(missing_ok=True)
        for piece in pieces:
            (self.folder / piece.name).unlink(missing_ok=True)
        ends = [piece.end for piece in pieces] + ([error[0]] if error and error[0] is not None else [])
        return any(end >= prompt_len for end in ends)

    def discard(self, rid: str, prompt_len: int) -> None:
        """Remove every file of `rid` (read, refused or abandoned), including those the server
        writes after this call. Until the request's last file (the piece or error line reaching
        `prompt_len`) is there, the server may still write some; the hook writes one request's
        files in forward order, so once the last one is there, every other one is too."""
        if not self._remove(rid, prompt_len):
            # Given up before its last piece: a cancel marker, not a wait for the rest. A wait
            # would hold the retry of a cache hit on pieces nobody reads, and would not end for a
            # request the server stopped (a timeout, an error line); the marker costs a request
            # read whole nothing, and the hook removes it with the last piece.
            marker = self.folder / cancel_name(rid)
            temp = self.folder / temporary_name(marker.name, os.getpid())
            temp.write_text(cancel_text(prompt_len))
            temp.replace(marker)  # whole: the hook reads the prompt length from it
            if not self._remove(rid, prompt_len):
                return  # the hook drops the rest and removes the marker with the last piece
            marker.unlink(missing_ok=True)  # the last piece came in the meantime: nothing follows
        # a listing made while pieces were renamed into place may miss one written before the
        # last: every piece is in place now, so one more look removes it
        self._remove(rid, prompt_len)
