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
as the JSON path raises, and the caller flushes and asks again.

The folder is the same path on the servers and the client: a local directory (or /dev/shm) on
one host, shared storage across hosts. Files of a killed client are removed by the next client
once they are STALE_S old, so nothing grows without bound.
"""

from __future__ import annotations

import os
import re
import socket
import time
import uuid
from pathlib import Path

import numpy as np
import torch

from eagle3.sglang.client import ServerPool, SGLangError
from eagle3.sglang.rows import PartialPrefillError, Rows, parse_top, with_cache_retries

RID_PREFIX = "e3-"  # every request id this project sends through a hook starts so
PIECE = re.compile(
    r"^(?P<rid>.+)\.(?P<start>\d+)-(?P<end>\d+)\.(?P<dtype>bfloat16|float16|float32|float8_e4m3fn)$"
)
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
FP8 = "float8_e4m3fn"  # fp8 rows [n, W] then float32 row scales [n] (eagle3/sglang/aux_hook.py)
# How long the rows may take to appear after the reply (the hook writes on a thread of its own).
WAIT_S = float(os.environ.get("EAGLE3_HANDOVER_WAIT_S", "60"))
STALE_S = 600.0  # files of requests nobody has read for this long are a killed client's


class HandoverError(SGLangError):
    """The hand-over folder is unusable, or a request's rows did not arrive whole."""


def _check_folder(folder: Path) -> None:
    """Refuse, before any request, a folder this client cannot create, write and remove in."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
        probe = folder / f".{RID_PREFIX}probe-{os.getpid()}-{uuid.uuid4().hex}"
        probe.write_bytes(b"ok")
        probe.unlink()
    except OSError as err:
        raise HandoverError(
            f"extract.sglang_handover_dir {folder}: not writable here ({err.strerror or err}); the "
            "servers write the rows there and this client reads and removes them"
        ) from None


def remove_stale(folder: Path, older_than_s: float = STALE_S) -> int:
    """Remove this project's pieces nobody read for `older_than_s` seconds (a killed client's)."""
    now, removed = time.time(), 0
    for path in folder.glob(f"{RID_PREFIX}*"):
        try:
            if now - path.stat().st_mtime > older_than_s:
                path.unlink()
                removed += 1
        except FileNotFoundError:  # another client took it
            continue
    return removed


def read_piece(path: Path, n: int, width: int, dtype: str, what: str) -> torch.Tensor:
    """A piece's n rows as float32 [n, width]: the model's dtype widened, or fp8 x row scale."""
    raw = torch.from_numpy(np.fromfile(path, dtype=np.uint8))
    fp8 = dtype == FP8
    want = n * (width + 4) if fp8 else n * width * DTYPES[dtype].itemsize
    if raw.numel() != want:
        got = f"{raw.numel()} bytes for {n} rows of {width} {dtype}{' and their scales' if fp8 else ''}"
        raise HandoverError(f"{path}: {got}, not {want} ({what})")
    if not fp8:
        return raw.view(DTYPES[dtype]).view(n, width).float()
    scales = raw[n * width :].clone().view(torch.float32)  # cloned: the scales' offset may be unaligned
    # the feature store's read of an fp8 row before its bf16 cast (eagle3/data/store.py)
    return raw[: n * width].view(torch.float8_e4m3fn).view(n, width).float() * scales[:, None]


class HookTransport:
    """Rows of one request from the hook's files in `folder` (see the module docstring)."""

    name = "hook"

    def __init__(self, folder: str | Path, wait_s: float = WAIT_S):
        self.folder, self.wait_s = Path(folder), wait_s
        _check_folder(self.folder)
        remove_stale(self.folder)
        self.prefix = f"{RID_PREFIX}{socket.gethostname()}-{os.getpid()}-"

    def new_rid(self) -> str:
        return self.prefix + uuid.uuid4().hex

    def request_rows(self, pool: ServerPool, body: dict, width: int, what: str) -> Rows:
        """Send `body` (a prefill_body) with a fresh request id and no hidden states in the reply;
        the rows come from the folder. A prefix-cache hit is flushed and asked again."""
        return with_cache_retries(pool, lambda url: self._once(pool, url, body, width, what))

    def _once(self, pool: ServerPool, url: str, body: dict, width: int, what: str) -> Rows:
        rid, prompt_len = self.new_rid(), len(body["input_ids"])
        sent = {k: v for k, v in body.items() if k != "return_hidden_states"} | {"rid": rid}
        try:
            response = pool.generate(url, sent)
            prefill = self.collect(rid, prompt_len, width, url, what)
        finally:
            self.discard(rid)
        output_ids = [int(i) for i in response.get("output_ids") or []]
        rows = Rows(prefill, torch.zeros(0, width), output_ids)
        if top := body.get("top_logprobs_num"):
            rows.top_ids, rows.top_logprobs = parse_top(response, prompt_len, top, url)
        return rows

    def _pieces(self, rid: str) -> list[tuple[int, int, str, Path]]:
        pieces = []
        for path in self.folder.glob(f"{rid}.*"):
            if path.name == f"{rid}.err":
                why = path.read_text().strip()
                raise HandoverError(f"the server's hook could not hand over the rows of {rid}: {why}")
            match = PIECE.match(path.name)
            if match and match["rid"] == rid:
                pieces.append((int(match["start"]), int(match["end"]), match["dtype"], path))
        return sorted(pieces)

    def collect(self, rid: str, prompt_len: int, width: int, url: str, what: str) -> torch.Tensor:
        """[prompt_len, width] rows as float32 (the JSON path's type), once pieces cover 0..P-1."""
        deadline = time.monotonic() + self.wait_s
        while True:
            pieces = self._pieces(rid)
            if pieces and pieces[0][0] > 0:
                raise PartialPrefillError(
                    f"{url}: prefix-cache hit: the hook's rows start at position {pieces[0][0]} "
                    f"of {prompt_len}"
                )
            covered = 0
            for start, end, _, _ in pieces:
                if start > covered:
                    break  # a chunk still on its way
                covered = max(covered, end)
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
        for start, end, dtype, path in pieces:
            block = read_piece(path, end - start, width, dtype, what)
            stop = min(end, prompt_len)
            out[start:stop] = block[: stop - start]
        return out

    def discard(self, rid: str) -> None:
        """Remove every file of `rid` (read, refused or abandoned)."""
        for path in self.folder.glob(f"{rid}.*"):
            path.unlink(missing_ok=True)
