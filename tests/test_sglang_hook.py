"""The hook transport (eagle3/sglang/handover.py) against a replay server that hands the recorded
rows over through the project's hook writer (eagle3/sglang/aux_hook.py Writer): raw bf16 pieces
`<rid>.<start>-<end>.bfloat16`, or fp8 pieces with row scales, in a folder, written on a thread
after the reply (as the hook's writer thread does), the reply without hidden states. Live SGLang
with the real hook: tests/test_sglang_hook_live.py."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
import torch
from test_sglang import H, Replay, fixture

from eagle3.data.wire import cancel_name, dequantize_rows, quantize_rows, temporary_name
from eagle3.sglang import aux_hook
from eagle3.sglang.aux_hook import Writer
from eagle3.sglang.client import ServerPool
from eagle3.sglang.features import text_sample
from eagle3.sglang.handover import STALE_S, HandoverError, HookTransport, remove_stale
from eagle3.sglang.rows import PartialPrefillError, prefill_body, request_rows
from eagle3.sglang.servers import ExtractionServers, TopLogprobs
from eagle3.target.render import Rendered

WIDTH = 3 * H


class HookReplay(Replay):
    """The recorded aux server, handing rows over through `folder` for requests with a rid; a
    prompt longer than `chunk` comes in pieces, as a chunked prefill's forwards write it."""

    def __init__(self, folder: Path, chunk: int = 16, dtype: str = "model", **kw):
        super().__init__("aux", **kw)
        self.folder, self.chunk, self.refuse, self.dtype = folder, chunk, None, dtype
        self.writers: list[threading.Thread] = []

    def answer(self, body: dict) -> dict | None:
        response = super().answer(body)
        if response is None or "rid" not in body:
            return response
        meta = dict(response["meta_info"])
        rows = torch.tensor(meta.pop("hidden_states")[0], dtype=torch.float32).to(torch.bfloat16)
        start = len(body["input_ids"]) - len(rows)  # a cache hit leaves the cached prefix out
        writer = threading.Thread(target=self.write, args=(body["rid"], rows, start))
        self.writers.append(writer)
        writer.start()
        return response | {"meta_info": meta}

    def settle(self) -> None:
        """Wait until this stand-in has written every piece it answered for, as a real server
        has once its writer thread is idle: what the folder holds then is what stays."""
        for writer in self.writers:
            writer.join()

    def write(self, rid: str, rows: torch.Tensor, start: int) -> None:
        time.sleep(0.01)  # after the reply, as the hook's writer thread may
        writer = Writer(str(self.folder), sync=True, dtype=self.dtype)
        if self.refuse:  # the hook's error line for the whole prompt
            writer.error(rid, self.refuse, start + len(rows))
            return
        for lo in range(0, len(rows), self.chunk):  # one chunk a forward
            piece = rows[lo : lo + self.chunk]
            writer.write(piece, None, None, [(rid, 0, start + lo, len(piece))])


@pytest.fixture
def hook(tmp_path):
    server = HookReplay(tmp_path / "handover", cache_hit_first=True)
    (tmp_path / "handover").mkdir()
    yield server
    server.close()


def recorded(n: int, top: bool = True) -> dict:
    req = fixture(f"{'lp_' if top else ''}req_{n:02d}.json")
    return prefill_body(req["input_ids"], req.get("top_logprobs_num"))


@pytest.mark.slow
def test_hook_rows_equal_the_json_rows_bit_for_bit_with_requests_in_flight(hook):
    pool, transport = ServerPool([hook.url]), HookTransport(hook.folder)
    bodies = [recorded(n, top) for n in range(1, 4) for top in (True, False)] * 2  # 12 in flight
    with ThreadPoolExecutor(len(bodies)) as pool_of_threads:
        got = list(pool_of_threads.map(lambda b: transport.request_rows(pool, b, WIDTH, "aux"), bodies))
    for body, rows in zip(bodies, got, strict=True):
        want = request_rows(pool, body, WIDTH, "aux")
        assert rows.prefill.shape == (len(body["input_ids"]), WIDTH)
        assert torch.equal(rows.prefill, want.prefill)
        if body.get("top_logprobs_num"):
            assert torch.equal(rows.top_ids, want.top_ids)
            assert torch.equal(rows.top_logprobs, want.top_logprobs)
    # no numbers asked for in the reply
    assert all("return_hidden_states" not in r for r in hook.requests if "rid" in r)
    hook.settle()  # the request answered from the prefix cache (req_01's prompt) included
    assert list(hook.folder.iterdir()) == []  # every piece removed once read, or dropped once cancelled


def test_a_prefix_cache_hit_is_flushed_and_asked_again(hook):
    body = prefill_body(fixture("req_05.json")["input_ids"])  # recorded as a cache hit first
    rows = HookTransport(hook.folder).request_rows(ServerPool([hook.url]), body, WIDTH, "aux")
    assert hook.flushes == 1 and rows.prefill.shape == (len(body["input_ids"]), WIDTH)
    hook.settle()
    assert list(hook.folder.iterdir()) == []  # the abandoned request's later pieces too


def test_a_server_that_keeps_hitting_its_cache_is_refused(tmp_path):
    server = HookReplay(tmp_path, always_hit=True)
    try:
        body = prefill_body(fixture("req_05.json")["input_ids"])
        with pytest.raises(PartialPrefillError, match="rows start at position .* --disable-radix-cache"):
            HookTransport(tmp_path).request_rows(ServerPool([server.url]), body, WIDTH, "aux")
    finally:
        server.close()


def test_rows_the_hook_could_not_place_stop_with_its_reason(hook):
    hook.refuse = "positions do not start at the extend prefix"
    with pytest.raises(HandoverError, match="could not hand over .*: positions do not start"):
        HookTransport(hook.folder).request_rows(ServerPool([hook.url]), recorded(1), WIDTH, "aux")
    assert list(hook.folder.iterdir()) == []


def test_rows_that_never_arrive_name_the_folder(tmp_path):
    server = Replay("aux")  # no hook: nothing is written
    try:
        transport = HookTransport(tmp_path, wait_s=0.2)
        with pytest.raises(HandoverError, match=f"cover 0 of .* in {tmp_path} after 0.2 s: is the server's"):
            transport.request_rows(ServerPool([server.url]), recorded(1), WIDTH, "aux")
    finally:
        server.close()


def test_a_folder_this_client_cannot_write_is_refused_before_any_request(tmp_path):
    (tmp_path / "file").write_text("")
    with pytest.raises(HandoverError, match="sglang_handover_dir .*file/handover: not writable here"):
        HookTransport(tmp_path / "file" / "handover")


def test_a_killed_clients_pieces_are_removed_once_stale(tmp_path):
    """A killed client's pieces, a killed server's half-written piece and a cancel marker whose
    request never reached its last piece: removed once stale, and nothing fresh or foreign."""
    old = [
        tmp_path / "e3-host-1-ab.0-4.bfloat16",
        tmp_path / temporary_name("e3-host-1-ab.4-8.bfloat16", 77),
        tmp_path / cancel_name("e3-host-1-ef"),
    ]
    fresh, other = tmp_path / "e3-host-1-cd.0-4.bfloat16", tmp_path / "x"
    for path in (*old, fresh, other):
        path.write_bytes(b"\0" * 8)
    for path in old:
        os.utime(path, (time.time() - STALE_S - 1, time.time() - STALE_S - 1))
    assert remove_stale(tmp_path) == 3
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([fresh.name, other.name])


def test_a_client_removes_stale_files_while_it_runs_not_only_when_it_starts(hook):
    transport = HookTransport(hook.folder)
    stale = hook.folder / "e3-host-1-ab.0-4.bfloat16"
    stale.write_bytes(b"\0" * 8)
    os.utime(stale, (time.time() - STALE_S - 1, time.time() - STALE_S - 1))
    transport.request_rows(ServerPool([hook.url]), recorded(2), WIDTH, "aux")
    assert stale.exists()  # swept at the start, and not again within STALE_S / 2
    transport.swept_at -= STALE_S / 2  # half of STALE_S later
    transport.request_rows(ServerPool([hook.url]), recorded(2), WIDTH, "aux")
    assert not stale.exists()


def recorded_rows(n: int) -> torch.Tensor:
    """The recorded aux rows of request n, as the server's bf16."""
    response = fixture(f"resp_{n:02d}.json")
    return torch.tensor(response["meta_info"]["hidden_states"][0], dtype=torch.float32).to(torch.bfloat16)


def test_an_fp8_piece_holds_the_stores_quantization_of_the_rows_then_their_scales(tmp_path):
    rows = torch.cat([recorded_rows(1), torch.zeros(1, WIDTH, dtype=torch.bfloat16)])  # a zero row too
    writer = Writer(str(tmp_path), sync=True, dtype="float8_e4m3fn")
    writer.write(rows, None, None, [("e3-x", 0, 0, len(rows))])
    (piece,) = tmp_path.iterdir()
    assert piece.name == f"e3-x.0-{len(rows)}.float8_e4m3fn"
    fp8, scales = quantize_rows(rows)
    assert piece.read_bytes() == fp8.view(torch.uint8).numpy().tobytes() + scales.numpy().tobytes()
    assert len(piece.read_bytes()) == len(rows) * (WIDTH + 4)  # about half of bf16's 2 * WIDTH


@pytest.mark.slow
def test_fp8_rows_read_back_as_the_store_reads_its_fp8_rows_within_the_fp8_bound(tmp_path):
    hook = HookReplay(tmp_path, dtype="float8_e4m3fn")
    try:
        pool, transport = ServerPool([hook.url]), HookTransport(tmp_path)
        for n in (1, 2, 3):  # 3 spans several pieces
            body = recorded(n)
            got = transport.request_rows(pool, body, WIDTH, "aux").prefill
            rows = request_rows(pool, body, WIDTH, "aux").prefill.to(torch.bfloat16)  # the JSON rows
            fp8, scales = quantize_rows(rows)
            assert torch.equal(got, dequantize_rows(fp8, scales))  # float32, before the store's bf16 cast
            # an fp8 store of these rows (bf16, as extraction keeps them) holds the same bytes
            again, again_scales = quantize_rows(got.to(torch.bfloat16))
            assert torch.equal(again.view(torch.uint8), fp8.view(torch.uint8))
            assert torch.equal(again_scales, scales)
            # e4m3 keeps 3 mantissa bits: half a step is 1/16 of a value; below 2^-6 (x scale) the
            # subnormal step is 2^-9, half of it 2^-10
            error = (got - rows.float()).abs()
            bound = rows.float().abs() / 16 + scales[:, None] / 1024
            assert bool((error <= bound).all()), float((error - bound).max())
            assert float(error.max()) > 0  # fp8, not the bf16 rows passed through
        assert list(tmp_path.iterdir()) == []
    finally:
        hook.close()


class ForwardBatch:
    """What the hook reads of SGLang's ForwardBatch (it finds the argument by its type's name)."""

    def __init__(self, rids: list[str], lens: list[int], starts: list[int]):
        self.forward_mode = type("Mode", (), {"name": "EXTEND"})()
        self.rids, self.extend_seq_lens_cpu, self.extend_prefix_lens_cpu = rids, lens, starts


@pytest.mark.parametrize("dtype", ["model", "float8_e4m3fn"])
def test_the_hook_writes_its_requests_pieces_of_a_batched_forward_and_nothing_else(tmp_path, dtype):
    hook = aux_hook.make_hook({"dir": str(tmp_path), "sync": True, "dtype": dtype})
    layers = [torch.randn(10, H).to(torch.bfloat16) for _ in range(3)]
    rows = torch.cat(layers, dim=-1)
    positions = torch.tensor([0, 1, 2, 3, 4, 5, 0, 1, 2, 3])  # e3-a's second chunk at 4: positions 4, 5
    batch = ForwardBatch(["other", "e3-a", "e3-b"], [4, 2, 4], [0, 4, 0])
    assert hook(None, (None, positions, batch), (rows[:, :H], layers)) is None
    names = sorted(p.name for p in tmp_path.iterdir())
    tag = "float8_e4m3fn" if dtype != "model" else "bfloat16"
    assert names == [f"e3-a.4-6.{tag}", f"e3-b.0-4.{tag}"]
    if dtype == "model":
        assert (tmp_path / names[0]).read_bytes() == rows[4:6].view(torch.uint8).numpy().tobytes()
    else:
        fp8, scales = quantize_rows(rows[6:10])  # the store's quantization of e3-b's rows
        assert (tmp_path / names[1]).read_bytes() == fp8.view(
            torch.uint8
        ).numpy().tobytes() + scales.numpy().tobytes()
    # a forward of other traffic only writes nothing
    hook(
        None,
        (None, positions[:4], ForwardBatch(["other"], [4], [0])),
        (rows[:4, :H], [x[:4] for x in layers]),
    )
    assert len(list(tmp_path.iterdir())) == 2


def forward(hook: aux_hook.Hook, rid: str, start: int, n: int, positions: torch.Tensor | None = None) -> None:
    """One prefill forward of `rid` alone through the hook: positions start..start+n-1."""
    layers = [torch.randn(n, H).to(torch.bfloat16) for _ in range(3)]
    positions = torch.arange(start, start + n) if positions is None else positions
    hook(None, (None, positions, ForwardBatch([rid], [n], [start])), (layers[0], layers))


def test_pieces_of_a_request_given_up_on_are_dropped_even_when_written_after_the_discard(tmp_path):
    """A prefix-cache hit: the client reads the first piece (positions 8-11 of 20), gives up and
    discards the request while the server still has its chunks 12-15 and 16-19 to write; the hook
    writes them after the discard, on purpose, one with positions it cannot place (an error
    line). The hook drops both, and its last piece removes the client's cancel marker."""
    hook = aux_hook.make_hook({"dir": str(tmp_path), "sync": True})
    transport = HookTransport(tmp_path)
    rid = transport.new_rid()
    forward(hook, rid, 8, 4)  # the cached prefix 0-7 is not computed
    with pytest.raises(PartialPrefillError, match="rows start at position 8 of 20"):
        transport.collect(rid, 20, WIDTH, "server", "aux")
    transport.discard(rid, 20)
    assert [p.name for p in tmp_path.iterdir()] == [cancel_name(rid)]
    forward(hook, rid, 12, 4, positions=torch.arange(4))  # late, and not placeable: no error line
    assert [p.name for p in tmp_path.iterdir()] == [cancel_name(rid)]
    forward(hook, rid, 16, 4)  # late, the last piece: dropped, and the marker with it
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("prompt_len", [8, 12])
def test_a_piece_named_just_after_the_clients_look_is_removed_by_the_hooks_second_look(tmp_path, prompt_len):
    """The other order: the hook finds no marker, then the client gives up and removes what it
    sees, and only then is the hook's piece renamed into place. The hook looks again after the
    rename, finds the marker and removes the piece (and, with the last piece, the marker)."""
    hook = aux_hook.make_hook({"dir": str(tmp_path), "sync": True})
    transport = HookTransport(tmp_path)
    rid = transport.new_rid()
    forward(hook, rid, 0, 4)
    place = hook.writer.place

    def the_client_gives_up_first(name: str, payload: bytes) -> str:
        transport.discard(rid, prompt_len)
        assert [p.name for p in tmp_path.iterdir()] == [cancel_name(rid)]
        return place(name, payload)

    hook.writer.place = the_client_gives_up_first  # between the hook's first look and its rename
    forward(hook, rid, 4, 4)
    hook.writer.place = place
    if prompt_len == 12:  # not the last piece: the marker stays for the last one
        assert [p.name for p in tmp_path.iterdir()] == [cancel_name(rid)]
        forward(hook, rid, 8, 4)
    assert list(tmp_path.iterdir()) == []


def test_a_request_given_up_on_after_its_last_piece_leaves_no_marker(tmp_path):
    """Nothing more comes once the last piece is there, so no marker is left for nobody to remove."""
    hook = aux_hook.make_hook({"dir": str(tmp_path), "sync": True})
    transport = HookTransport(tmp_path)
    rid = transport.new_rid()
    forward(hook, rid, 8, 4)
    forward(hook, rid, 12, 4)
    with pytest.raises(PartialPrefillError, match="rows start at position 8 of 16"):
        transport.collect(rid, 16, WIDTH, "server", "aux")
    transport.discard(rid, 16)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.slow
def test_the_hook_imports_only_torch_the_standard_library_and_the_wire_module():
    """SGLang imports the factory by its dotted name in each scheduler process (importlib, from
    --forward-hooks), where the project's other dependencies may be missing."""
    code = (
        "import sys, torch; before = set(sys.modules); import eagle3.sglang.aux_hook; "
        "print(' '.join(sorted(set(sys.modules) - before)))"
    )
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    added = run.stdout.split()
    assert {name.split(".")[0] for name in added} - set(sys.stdlib_module_names) == {"eagle3"}
    assert sorted(name for name in added if name.startswith("eagle3")) == [
        "eagle3",
        "eagle3.data",
        "eagle3.data.wire",
        "eagle3.sglang",
        "eagle3.sglang.aux_hook",
    ]


def test_a_hook_dtype_it_cannot_write_is_refused_by_name(tmp_path):
    with pytest.raises(ValueError, match="config dtype 'int8' is none of model, float8_e4m3fn"):
        Writer(str(tmp_path), sync=True, dtype="int8")


def test_extraction_and_online_training_get_the_same_sample_through_the_hook(hook):
    """text_sample is what extraction stores and online training trains on (sglang/features.py):
    through the hook it is the JSON path's sample, tensor for tensor."""
    ids = np.asarray(fixture("lp_req_01.json")["input_ids"], dtype=np.int32)
    rendered = Rendered(ids, np.ones(len(ids), dtype=np.uint8))
    top = fixture("lp_req_01.json")["top_logprobs_num"]
    json_servers = ExtractionServers(ServerPool([hook.url]), TopLogprobs(top))
    hook_servers = ExtractionServers(ServerPool([hook.url]), TopLogprobs(top), HookTransport(hook.folder))
    a, b = text_sample(json_servers, H, rendered), text_sample(hook_servers, H, rendered)
    for key in ("input_ids", "loss_mask", "aux_hidden", "target_topk_ids", "target_topk_logprobs"):
        assert torch.equal(getattr(a, key), getattr(b, key)), key
    assert list(hook.folder.iterdir()) == []


def test_a_piece_the_hook_cannot_write_leaves_the_reason_not_half_a_file(tmp_path):
    """A write that fails (here a folder stands where the piece goes; a full disk fails alike)
    leaves `<rid>.err` with the OS error and no temporary file; the client stops with that line."""
    writer = Writer(str(tmp_path), sync=True)
    rows = recorded_rows(1)[:4]
    (tmp_path / "e3-x.0-4.bfloat16").mkdir()
    writer.write(rows, None, None, [("e3-x", 0, 0, 4)])
    assert "cannot write" in (tmp_path / "e3-x.err").read_text()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["e3-x.0-4.bfloat16", "e3-x.err"]
