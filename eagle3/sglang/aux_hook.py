"""The server side of the hook transport: a forward-hook factory that stock SGLang (0.5.23) loads
through --forward-hooks, writing each request's EAGLE-3 aux rows as raw bytes into a hand-over
folder instead of JSON numbers. The client side is eagle3/sglang/handover.py.

It runs inside the SGLang server's Python, so it imports torch, the standard library and
eagle3/data/wire.py (itself torch-only) and nothing else of the project (SGLang lazily, for checks
that make sense inside a server); SGLang imports it by its dotted name in each scheduler process,
so the server needs the repository root on its PYTHONPATH. Launch the aux-mode server as
extraction needs it, plus:

    --forward-hooks '[{"name": "eagle3_aux", "target_modules": ["model", "language_model.model"],
                       "hook_factory": "eagle3.sglang.aux_hook:make_hook",
                       "config": {"dir": "<extract.sglang_handover_dir>"}}]'

The hooked module is the inner decoder stack ("model"; "language_model.model" for Kimi-K2.5),
whose forward returns (hidden_states, aux_hidden_states) in aux mode: the aux part is the very
list SGLang's return_hidden_states path concatenates, so the bytes equal the JSON rows bit for bit.

Per prefill (EXTEND) forward the batch's rows are split by request with extend_seq_lens and
each piece is written as `<dir>/<rid>.<start>-<end>.<dtype>`: positions start..end-1 (start =
extend_prefix_lens: a cached prefix, or the earlier chunks of a chunked prefill), each row the
aux layers' states in the model's dtype, row-major. A piece appears under its name only once
complete (a temporary name, then a rename). A request whose rows cannot be placed gets
`<dir>/<rid>.err` (one line: why). A request the client gave up on (`<dir>/<rid>.cancel`) gets
nothing more, and its last piece removes the marker. Decode forwards are skipped. Only
attention-TP rank 0 writes: every TP rank holds the same rows. The names and the bytes are
eagle3/data/wire.py's.

config: dir (else $EAGLE3_HANDOVER_DIR), rid_prefix (default "e3-": only requests whose rid starts
with it are written, so other traffic leaves nothing behind), sync (default false: a writer
thread; true: written before the forward returns), dtype (default: the model's; "float8_e4m3fn"
writes each piece as fp8 rows then one float32 scale per row, quantized as the feature store's
fp8 shards are (wire.quantize_rows), so a piece's bytes equal the store's quantization of the
same bf16 rows; about half the bytes of bf16 rows, quantized in the forward's thread on its
device, so a GPU copies half the bytes to the host).
"""

from __future__ import annotations

import logging
import os
import queue
import threading
from collections.abc import Callable
from functools import partial

import torch

from eagle3.data.wire import (
    FP8,
    SAFE_RID,
    Piece,
    cancel_name,
    cancelled_length,
    dtype_tag,
    error_name,
    error_text,
    quantize_rows,
    temporary_name,
)

logger = logging.getLogger(__name__)

DIR_ENV = "EAGLE3_HANDOVER_DIR"
PENDING_FORWARDS = 8  # forwards' rows held on the host while the writer catches up
DTYPES = ("model", FP8)  # config "dtype": the model's own (the default), or fp8 rows and row scales


def server_refusals() -> list[str]:
    """Server settings under which rows would silently not appear or not be placeable (none
    outside a server)."""
    try:
        from sglang.srt.model_executor.cuda_graph_config import Backend, Phase, check_cuda_graph_backend
        from sglang.srt.runtime_context import get_server_args

        args = get_server_args()
    except Exception:  # not inside an SGLang server
        return []
    refusals = []
    # hooks never run on a replayed CUDA graph, and SGLang 0.5.23 replays prefill through its
    # breakable graph by default on CUDA
    if not check_cuda_graph_backend(Phase.PREFILL, Backend.DISABLED):
        refusals.append("the prefill CUDA graph is on: launch with --cuda-graph-backend-prefill disabled")
    if not getattr(args, "enable_return_aux_hidden_states", False):
        refusals.append("aux capture is off: launch with --enable-return-aux-hidden-states and its layer ids")
    if getattr(args, "enable_mixed_chunk", False):
        refusals.append("--enable-mixed-chunk puts decode rows into prefill forwards: launch without it")
    if getattr(args, "enable_two_batch_overlap", False):
        refusals.append("--enable-two-batch-overlap skips the aux capture on MoE layers: launch without it")
    return refusals


def writer_rank() -> int:
    """The attention-TP rank (the TP rank without DP attention); 0 outside a distributed server."""
    try:
        from sglang.srt.distributed.parallel_state import get_attn_tensor_model_parallel_rank

        return int(get_attn_tensor_model_parallel_rank())
    except Exception:  # no group initialised, or an SGLang without attention DP
        try:
            from sglang.srt.distributed.parallel_state import get_tensor_model_parallel_rank

            return int(get_tensor_model_parallel_rank())
        except Exception:
            return 0


class Writer:
    """Writes each forward's pieces (on a thread of its own unless `sync`)."""

    def __init__(self, folder: str, sync: bool, dtype: str = "model"):
        if dtype not in DTYPES:
            raise ValueError(f"eagle3 aux hook: config dtype {dtype!r} is none of {', '.join(DTYPES)}")
        self.folder, self.sync, self.fp8 = folder, sync, dtype == FP8
        self.jobs: queue.Queue = queue.Queue(maxsize=PENDING_FORWARDS)
        if not sync:
            threading.Thread(target=self._loop, name="eagle3-aux-writer", daemon=True).start()

    def submit(self, job: Callable[[], None]) -> None:
        """Run `job` (a write or an error line) after the jobs before it: a request's files
        appear in forward order, so the client knows that once its last one is there, every
        other one is too."""
        if self.sync:
            job()
        else:
            self.jobs.put(job)

    def _loop(self) -> None:
        while True:
            job = self.jobs.get()
            try:
                job()
            except Exception:  # one forward's failure must not stop the writer
                logger.exception("eagle3 aux hook: writing a forward's rows failed")

    def place(self, name: str, payload: bytes | memoryview) -> str:
        """Write `name` whole: a temporary name, then a rename. Returns its path."""
        final = os.path.join(self.folder, name)
        temp = os.path.join(self.folder, temporary_name(name, os.getpid()))
        try:
            with open(temp, "wb") as out:
                out.write(payload)
            os.replace(temp, final)  # atomic within one filesystem: a reader sees all or nothing
        except OSError:
            if os.path.exists(temp):
                os.remove(temp)  # a full disk leaves no half piece behind
            raise
        return final

    def cancelled(self, rid: str, end: int | None) -> bool:
        """Whether the client gave up on `rid` (its cancel marker is there). The request's last
        piece (`end` reaching the marker's prompt length) removes the marker: no forward of the
        request comes after it."""
        marker = os.path.join(self.folder, cancel_name(rid))
        try:
            with open(marker) as text:
                length = cancelled_length(text.read())
        except FileNotFoundError:
            return False
        if end is not None and length is not None and end >= length:
            try:
                os.remove(marker)
            except FileNotFoundError:  # the client saw the last piece and removed it too
                pass
        return True

    def hand_over(self, rid: str, name: str, payload: bytes | memoryview, end: int | None) -> None:
        """Place a file of `rid` (rows up to position `end`, or an error line) unless the client
        cancelled the request. The client writes its marker and then removes the request's
        files; the hook renames a file into place and then looks for the marker again: whichever
        of the two comes second sees the other's file, so no file outlives a cancel."""
        if self.cancelled(rid, end):
            return
        path = self.place(name, payload)
        if self.cancelled(rid, end):
            try:
                os.remove(path)
            except FileNotFoundError:  # the client's removal came first
                pass

    def error(self, rid: str, why: str, end: int | None) -> None:
        """`<rid>.err`: why the rows up to position `end` (None: unknown) cannot be placed."""
        try:
            self.hand_over(rid, error_name(rid), error_text(why, end).encode(), end)
        except OSError:
            logger.exception(f"eagle3 aux hook: cannot even report {rid}'s failure")

    def write(
        self, rows: torch.Tensor, positions: torch.Tensor | None, event, pieces: list, scales=None
    ) -> None:
        """Write each piece (rid, offset, start, n) of `rows`: the model's rows, or with fp8 the
        rows quantized already (`scales` given: the hook quantizes on the forward's device and
        threads) or not yet (quantized here)."""
        if event is not None:
            event.synchronize()
        if self.fp8 and scales is None:
            rows, scales = quantize_rows(rows)
        tag = FP8 if self.fp8 else dtype_tag(rows.dtype)
        as_bytes = rows.view(torch.uint8)  # [T, W * itemsize], no copy
        for rid, offset, start, n in pieces:
            if positions is not None:
                got = positions[offset : offset + n]
                if not torch.equal(got, torch.arange(start, start + n, dtype=got.dtype)):
                    why = f"positions {got[:4].tolist()}... do not start at the extend prefix {start}"
                    self.error(rid, why, start + n)
                    continue
            try:
                if self.fp8:  # the fp8 rows, then their float32 scales (wire.decode_piece)
                    fp8 = as_bytes[offset : offset + n].numpy().tobytes()
                    payload = fp8 + scales[offset : offset + n].numpy().tobytes()
                else:
                    payload = as_bytes[offset : offset + n].numpy().data
                self.hand_over(rid, Piece(rid, start, start + n, tag).name, payload, start + n)
            except OSError as err:  # full or not writable: the client stops with this line
                self.error(rid, f"cannot write {self.folder}: {err.strerror or err}", start + n)


def forward_batch(args: tuple):
    for arg in args:
        if type(arg).__name__ == "ForwardBatch":
            return arg
    return None


class Hook:
    """The callable SGLang registers (register_forward_hook) on every matched module: splits a
    prefill forward's aux rows by request and hands this project's requests to the writer."""

    def __init__(self, writer: Writer, prefix: str):
        self.writer, self.prefix = writer, prefix
        self.rank: int | None = None  # resolved on the first call: the process groups exist by then
        self.warned: set[str] = set()

    def warn_once(self, key: str, message: str) -> None:
        if key not in self.warned:
            self.warned.add(key)
            logger.error(message)

    def __call__(self, module, args: tuple, output) -> None:
        if self.rank is None:
            self.rank = writer_rank()
        batch = forward_batch(args)
        if self.rank != 0 or batch is None or batch.forward_mode.name != "EXTEND":
            return None
        if not (isinstance(output, tuple) and len(output) == 2):
            self.warn_once(
                "aux",
                "eagle3 aux hook: the hooked module returned no aux states: launch with "
                "--enable-return-aux-hidden-states and hook the inner model",
            )
            return None
        aux, writer = output[1], self.writer
        rids = list(batch.rids or [])
        ours = [i for i, rid in enumerate(rids) if rid.startswith(self.prefix)]
        fresh = isinstance(aux, (list, tuple))
        if not ours or (fresh and not aux):  # other traffic costs no copy
            return None
        lens = [int(n) for n in batch.extend_seq_lens_cpu]
        starts = [int(n) for n in batch.extend_prefix_lens_cpu]
        total = int((aux[0] if fresh else aux).shape[0])
        if len(rids) != len(lens) or sum(lens) != total:
            why = f"{total} rows for extend lengths {lens} of {len(rids)} requests"
            for i in ours:
                if SAFE_RID.match(rids[i]):
                    end = starts[i] + lens[i] if len(rids) == len(lens) == len(starts) else None
                    writer.submit(partial(writer.error, rids[i], why, end))
            self.warn_once("shape", f"eagle3 aux hook: {why}")
            return None
        offsets = [sum(lens[:i]) for i in range(len(lens))]
        pieces = [(rids[i], offsets[i], starts[i], lens[i]) for i in ours if SAFE_RID.match(rids[i])]
        if len(pieces) != len(ours):
            self.warn_once(
                "rid", "eagle3 aux hook: a request id is not a safe file name; its rows are skipped"
            )
        if not pieces:
            return None
        # a list (Llama, Qwen3) is concatenated into fresh storage; a packed tensor (DeepSeek,
        # Kimi) may be a buffer the next forward reuses, so it is copied
        rows = torch.cat(list(aux), dim=-1) if fresh else aux
        positions = args[1] if len(args) > 1 and isinstance(args[1], torch.Tensor) else None
        scales = None
        if writer.fp8:
            # here, not on the writer thread: on the GPU, and on a CPU with the forward's own
            # threads (a second thread's torch ops start a second thread team: oversubscribed)
            rows, scales = quantize_rows(rows)
            fresh = True
        if rows.is_cuda:  # copied while the GPU goes on; the writer waits for the copy
            host = torch.empty(rows.shape, dtype=rows.dtype, pin_memory=True)
            host.copy_(rows, non_blocking=True)
            if scales is not None:
                scales = scales.to("cpu", non_blocking=True)
            pos = positions.to("cpu", non_blocking=True) if positions is not None else None
            event = torch.cuda.Event()
            event.record()
        else:
            host = rows.contiguous() if fresh else rows.clone()
            pos, event = (positions.clone() if positions is not None else None), None
        writer.submit(partial(writer.write, host, pos, event, pieces, scales))
        return None  # the output as it was


def make_hook(config: dict) -> Hook:
    """SGLang calls this once per matched spec with the spec's "config"; the returned callable
    is registered with register_forward_hook on every matched module."""
    folder = config.get("dir") or os.environ.get(DIR_ENV)
    if not folder:
        raise ValueError(f"eagle3 aux hook: give config.dir or ${DIR_ENV} (the hand-over folder)")
    os.makedirs(folder, exist_ok=True)
    if refusals := server_refusals():
        raise RuntimeError("eagle3 aux hook: " + "; ".join(refusals))
    writer = Writer(folder, sync=bool(config.get("sync", False)), dtype=str(config.get("dtype", "model")))
    return Hook(writer, str(config.get("rid_prefix", "e3-")))
