"""The server side of the hook transport: a forward-hook factory that stock SGLang (0.5.23) loads
through --forward-hooks, writing each request's EAGLE-3 aux rows as raw bytes into a hand-over
folder instead of JSON numbers. The client side is eagle3/sglang/handover.py.

It runs inside the SGLang server's Python, so it imports torch and the standard library only
(SGLang lazily, for checks that make sense inside a server); the server needs the repository
root on its PYTHONPATH. Launch the aux-mode server as extraction needs it, plus:

    --forward-hooks '[{"name": "eagle3_aux", "target_modules": ["model", "language_model.model"],
                       "hook_factory": "eagle3.sglang.aux_hook:make_hook",
                       "config": {"dir": "<extract.sglang_handover_dir>"}}]'

The hooked module is the inner decoder stack ("model"; "language_model.model" for Kimi-K2.5),
whose forward returns (hidden_states, aux_hidden_states) in aux mode: the aux part is the very
list SGLang's return_hidden_states path concatenates, so the bytes equal the JSON rows bit for bit.

Per prefill (EXTEND) forward the batch's rows are split by request with extend_seq_lens and
each piece is written as `<dir>/<rid>.<start>-<end>.<dtype>`: positions start..end-1 (start =
extend_prefix_lens: a cached prefix, or the earlier chunks of a chunked prefill), each row the
aux layers' states side by side in the model's dtype, row-major. A piece appears under its name
only once complete (a temporary name, then a rename). A request whose rows cannot be placed
gets `<dir>/<rid>.err` (one line: why). Decode forwards are skipped. Only attention-TP rank 0
writes: every TP rank holds the same rows.

config: dir (else $EAGLE3_HANDOVER_DIR), rid_prefix (default "e3-": only requests whose rid starts
with it are written, so other traffic leaves nothing behind), sync (default false: a writer
thread; true: written before the forward returns), dtype (default: the model's; "float8_e4m3fn"
writes each piece as `<rid>.<start>-<end>.float8_e4m3fn`: its n rows as float8_e4m3fn [n, W]
row-major, then one float32 scale per row [n], native byte order, n * (W + 4) bytes; quantized
as the feature store's fp8 shards are (eagle3/data/store.py quantize_rows: scale = row amax /
448, 1 for a zero row; row / scale clamped to +-448, rounded to e4m3), so a piece's bytes equal
the store's quantization of the same bf16 rows; about half the bytes of bf16 rows, quantized in
the forward's thread on its device, so a GPU copies half the bytes to the host).
"""

from __future__ import annotations

import logging
import os
import queue
import re
import threading

import torch

logger = logging.getLogger(__name__)

DIR_ENV = "EAGLE3_HANDOVER_DIR"
SAFE_RID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,199}$")
PENDING_FORWARDS = 8  # forwards' rows held on the host while the writer catches up
FP8 = "float8_e4m3fn"
FP8_MAX = 448.0  # the largest float8_e4m3fn value: a row's amax is written as it
QUANTIZE_BYTES = 1 << 20  # float32 rows quantized at a time on a CPU
DTYPES = ("model", FP8)  # config "dtype": the model's own (the default), or fp8 rows and row scales


def quantize_rows(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """float8_e4m3fn rows and their float32 scales: the formula of the feature store's fp8 shards
    (eagle3/data/store.py quantize_rows, which a server's Python cannot import without the
    project's dependencies; a test holds the two to the same bytes) in fewer passes: a row's
    |x| max as max(max, -min) in its own dtype and the division promoted to float32 are exact,
    the same bits. On a CPU a few rows at a time, their float32 copies kept in cache (2.4x
    faster at Kimi-K2.5's width); element-wise, so the same bytes whatever the chunking."""
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

    def submit(self, job: tuple) -> None:
        if self.sync:
            self.write(*job)
        else:
            self.jobs.put(job)

    def _loop(self) -> None:
        while True:
            job = self.jobs.get()
            try:
                self.write(*job)
            except Exception:  # one forward's failure must not stop the writer
                logger.exception("eagle3 aux hook: writing a forward's rows failed")

    def place(self, name: str, payload: bytes | memoryview) -> None:
        final = os.path.join(self.folder, name)
        temp = os.path.join(self.folder, f".{name}.{os.getpid()}.tmp")
        try:
            with open(temp, "wb") as out:
                out.write(payload)
            os.replace(temp, final)  # atomic within one filesystem: a reader sees all or nothing
        except OSError:
            if os.path.exists(temp):
                os.remove(temp)  # a full disk leaves no half piece behind
            raise

    def error(self, rid: str, why: str) -> None:
        try:
            self.place(f"{rid}.err", (why + "\n").encode())
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
        tag = FP8 if self.fp8 else str(rows.dtype).removeprefix("torch.")
        as_bytes = rows.view(torch.uint8)  # [T, W * itemsize], no copy
        for rid, offset, start, n in pieces:
            if positions is not None:
                got = positions[offset : offset + n]
                if not torch.equal(got, torch.arange(start, start + n, dtype=got.dtype)):
                    why = f"positions {got[:4].tolist()}... do not start at the extend prefix {start}"
                    self.error(rid, why)
                    continue
            try:
                if self.fp8:  # the fp8 rows, then their float32 scales
                    fp8 = as_bytes[offset : offset + n].numpy().tobytes()
                    payload = fp8 + scales[offset : offset + n].numpy().tobytes()
                else:
                    payload = as_bytes[offset : offset + n].numpy().data
                self.place(f"{rid}.{start}-{start + n}.{tag}", payload)
            except OSError as err:  # full or not writable: the client stops with this line
                self.error(rid, f"cannot write {self.folder}: {err.strerror or err}")


def forward_batch(args: tuple):
    for arg in args:
        if type(arg).__name__ == "ForwardBatch":
            return arg
    return None


def make_hook(config: dict):
    """SGLang calls this once per matched spec with the spec's "config"; the returned callable
    is registered with register_forward_hook on every matched module."""
    folder = config.get("dir") or os.environ.get(DIR_ENV)
    if not folder:
        raise ValueError(f"eagle3 aux hook: give config.dir or ${DIR_ENV} (the hand-over folder)")
    os.makedirs(folder, exist_ok=True)
    if refusals := server_refusals():
        raise RuntimeError("eagle3 aux hook: " + "; ".join(refusals))
    writer = Writer(folder, sync=bool(config.get("sync", False)), dtype=str(config.get("dtype", "model")))
    prefix = str(config.get("rid_prefix", "e3-"))
    rank: list[int] = []  # resolved on the first call: the process groups exist by then
    warned: set[str] = set()

    def warn_once(key: str, message: str) -> None:
        if key not in warned:
            warned.add(key)
            logger.error(message)

    def hook(module, args, output):
        if not rank:
            rank.append(writer_rank())
        batch = forward_batch(args)
        if rank[0] != 0 or batch is None or batch.forward_mode.name != "EXTEND":
            return None
        if not (isinstance(output, tuple) and len(output) == 2):
            warn_once(
                "aux",
                "eagle3 aux hook: the hooked module returned no aux states: launch with "
                "--enable-return-aux-hidden-states and hook the inner model",
            )
            return None
        aux = output[1]
        rids = list(batch.rids or [])
        ours = [i for i, rid in enumerate(rids) if rid.startswith(prefix)]
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
                    writer.error(rids[i], why)
            warn_once("shape", f"eagle3 aux hook: {why}")
            return None
        offsets = [sum(lens[:i]) for i in range(len(lens))]
        pieces = [(rids[i], offsets[i], starts[i], lens[i]) for i in ours if SAFE_RID.match(rids[i])]
        if len(pieces) != len(ours):
            warn_once("rid", "eagle3 aux hook: a request id is not a safe file name; its rows are skipped")
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
        writer.submit((host, pos, event, pieces, scales))
        return None  # the output as it was

    return hook
