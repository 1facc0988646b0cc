"""What moving the aux rows out of SGLang costs, JSON vs the hook (bf16 and fp8), in one run.

    python bench/transport.py [--widths smollm2 kimi] [--reps 5] [--json out.json]
                              [--e2e-samples 24] [--url URL --server-pid PID]

For each width it launches one SGLang server (the SGLang python of $EAGLE3_SGLANG_PYTHON, else
/work/sglang-cpu/bin/python; tools/sglang_cpu) with two hook specs on it, bf16 for request ids
"e3-bf16-*" and fp8 for "e3-fp8-*", and sends the same prompt in four modes, interleaved in a
fresh random order every repeat:
  - base: no return_hidden_states, a request id no hook writes for: the forward alone
  - json: return_hidden_states (eagle3/sglang/rows.py, the reply parsed as extraction does)
  - hook-bf16, hook-fp8: eagle3/sglang/handover.py HookTransport, the rows from the files
Per mode and token: bytes moved (the reply; plus the files for the hook), server CPU (utime +
stime of each process of the server's tree from /proc, before and after: robust to other load
on the machine) minus the same repeat's base request (the transport alone: the forward is
subtracted; a trimmed mean over repeats, as /proc counts 10 ms ticks), client CPU (this process,
around the request and the parse; median). The server runs its forward on one OpenMP thread
(--server-threads): on a loaded machine two threads spin on each other and the forward's CPU
time varies by seconds. The transport's ceiling = 1 / its server CPU per token: the most
tokens/s one server's transport can carry if one core did nothing else. The hook's server-side
cost is below what the subtraction resolves, so its code is also timed alone, on one thread:
the hook callable of eagle3/sglang/aux_hook.py (cat, copy, fp8 quantization, the file write)
on a forward's rows of the same size, without a forward around it ("hook code alone"). Before
the repeats, one request per hook asks for both transports and checks its rows against the
same forward's JSON rows: bf16 the same bits, fp8 the feature store's quantization of them.

Widths: smollm2 (SmolLM2-135M-Instruct, the packaged target, hidden 576) and kimi (hidden 7168,
Kimi-K2.5's: a random-weight Llama-architecture folder built at --kimi-folder if missing, 4
layers so that aux layer ids 0 1 2 capture three distinct layers; small MLP and attention; the
transport's cost scales with the width, not the depth or the rest).

End to end (--e2e-samples > 0): SmolLM2 extraction tokens/s through the extract stage's code
(eagle3/sglang/extract.py sglang_group_fn, top-20 logprobs as extract's default) with each
transport on the same server, the same ShareGPT conversations, interleaved.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from eagle3.core.device import machine  # noqa: E402
from eagle3.sglang import client as sglang_client  # noqa: E402
from eagle3.sglang.client import ServerPool  # noqa: E402
from eagle3.sglang.handover import HookTransport  # noqa: E402
from eagle3.sglang.launch import stop_group  # noqa: E402
from eagle3.sglang.rows import JSON, prefill_body  # noqa: E402
from eagle3.target.load import resolve_target  # noqa: E402

SGLANG_PYTHON = os.environ.get("EAGLE3_SGLANG_PYTHON", "/work/sglang-cpu/bin/python")
STAND_IN = REPO / "tools" / "sglang_cpu"
SHAREGPT = REPO / "tests" / "fixtures" / "sharegpt-48.jsonl"
KIMI_HIDDEN = 7168
MODES = ("base", "json", "hook-bf16", "hook-fp8")
HOOK_PREFIX = {"hook-bf16": "e3-bf16-", "hook-fp8": "e3-fp8-"}
HOOK_DTYPE = {"hook-bf16": "model", "hook-fp8": "float8_e4m3fn"}
TICK = os.sysconf("SC_CLK_TCK")


# --- the Kimi-width model -------------------------------------------------------------------


def build_kimi_width(folder: Path, layers: int = 4) -> Path:
    """A random-weight LlamaForCausalLM with hidden_size 7168 (bf16 safetensors, ~1.9 GB) and
    SmolLM2's tokenizer; nothing of it is trained."""
    if (folder / "model.safetensors").exists():
        return folder
    from safetensors.torch import save_file
    from transformers import LlamaConfig

    smollm2 = Path(resolve_target("smollm2-135m-instruct"))
    config = LlamaConfig(
        hidden_size=KIMI_HIDDEN,
        num_hidden_layers=layers,
        num_attention_heads=8,
        num_key_value_heads=8,
        head_dim=128,  # attention narrower than the width: the forward stays cheap
        intermediate_size=1024,
        vocab_size=49152,
        max_position_embeddings=4096,
        architectures=["LlamaForCausalLM"],  # SGLang picks its model class by it
        rope_theta=10000.0,
        tie_word_embeddings=True,
        torch_dtype="bfloat16",
        bos_token_id=1,
        eos_token_id=2,
    )
    partial = folder.with_name(folder.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    config.save_pretrained(partial)
    gen = torch.Generator().manual_seed(0)

    def rand(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen) * 0.02).to(torch.bfloat16)

    h, q, f = KIMI_HIDDEN, 8 * 128, 1024
    weights = {
        "model.embed_tokens.weight": rand(49152, h),
        "model.norm.weight": torch.ones(h, dtype=torch.bfloat16),
    }
    for i in range(layers):
        p = f"model.layers.{i}."
        weights |= {
            p + "self_attn.q_proj.weight": rand(q, h),
            p + "self_attn.k_proj.weight": rand(q, h),
            p + "self_attn.v_proj.weight": rand(q, h),
            p + "self_attn.o_proj.weight": rand(h, q),
            p + "mlp.gate_proj.weight": rand(f, h),
            p + "mlp.up_proj.weight": rand(f, h),
            p + "mlp.down_proj.weight": rand(h, f),
            p + "input_layernorm.weight": torch.ones(h, dtype=torch.bfloat16),
            p + "post_attention_layernorm.weight": torch.ones(h, dtype=torch.bfloat16),
        }
    save_file(weights, str(partial / "model.safetensors"), metadata={"format": "pt"})
    for name in (
        "tokenizer.json",
        "tokenizer_config.json",
        "special_tokens_map.json",
        "vocab.json",
        "merges.txt",
    ):
        if (smollm2 / name).exists():
            shutil.copy(smollm2 / name, partial / name)
    partial.rename(folder)
    return folder


# --- the server ----------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def hook_specs(handover: Path) -> str:
    return json.dumps(
        [
            {
                "name": f"eagle3_aux_{mode}",
                "target_modules": ["model"],
                "hook_factory": "eagle3.sglang.aux_hook:make_hook",
                "config": {"dir": str(handover), "rid_prefix": HOOK_PREFIX[mode], "dtype": HOOK_DTYPE[mode]},
            }
            for mode in HOOK_PREFIX
        ]
    )


def launch(
    model: str, aux_ids: list[int], handover: Path, log: Path, tokens: int, threads: int
) -> tuple[subprocess.Popen, str]:
    """The aux-mode CPU server (tests/test_sglang_live.py's launch) with both hooks; the radix
    cache off (the same prompt again must be computed again) and one chunk a prompt."""
    port = free_port()
    command = [SGLANG_PYTHON, "-m", "sglang.launch_server", "--model-path", model]
    command += ["--host", "127.0.0.1", "--port", str(port), "--device", "cpu"]
    command += ["--attention-backend", "torch_native", "--disable-overlap-schedule", "--dtype", "bfloat16"]
    command += [
        "--max-total-tokens",
        str(max(4096, 2 * tokens)),
        "--chunked-prefill-size",
        str(max(2048, tokens)),
    ]
    command += [
        "--skip-server-warmup",
        "--sleep-on-idle",
        "--disable-radix-cache",
        "--enable-return-hidden-states",
    ]
    command += ["--enable-return-aux-hidden-states", "--speculative-algorithm", "EAGLE3"]
    command += [
        "--return-aux-hidden-state-layer-ids",
        *map(str, aux_ids),
        "--forward-hooks",
        hook_specs(handover),
    ]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MLFLOW_", "DVC_"))}
    env |= {"SGLANG_USE_CPU_ENGINE": "1", "PYTHONPATH": os.pathsep.join([str(STAND_IN), str(REPO)])}
    # the forward on `threads` threads: on a loaded machine a second OpenMP thread spins while
    # the first waits for a core, and the forward's CPU time varies by seconds, burying the
    # transport's (the transport's own steps run on one thread either way)
    env |= {"OMP_NUM_THREADS": str(threads)}
    with open(log, "wb") as out:
        process = subprocess.Popen(
            command, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
    url = f"http://127.0.0.1:{port}"
    started = time.monotonic()
    try:
        while time.monotonic() - started < 900:
            if process.poll() is not None:
                raise RuntimeError(f"SGLang exited with {process.returncode}; see {log}")
            try:
                with urllib.request.urlopen(f"{url}/get_server_info", timeout=5) as response:
                    if response.status == 200:
                        up = time.monotonic() - started
                        print(f"# server up in {up:.0f} s at {url} (pid {process.pid})", flush=True)
                        return process, url
            except OSError:
                time.sleep(2)
        raise RuntimeError(f"SGLang did not answer within 900 s; see {log}")
    except BaseException:
        stop_group(process)
        raise


# --- CPU time from /proc -------------------------------------------------------------------


def tree(pid: int) -> list[int]:
    """pid and all its descendants."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry.name))
    found, todo = [], [pid]
    while todo:
        p = todo.pop()
        found.append(p)
        todo += children.get(p, [])
    return found


def cpu_s(stat_path: Path) -> float:
    """utime + stime of a process or thread, seconds."""
    try:
        fields = stat_path.read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / TICK


def comm(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return "?"


class ServerCPU:
    """CPU seconds of each process of a server's tree (the hook's writer thread is the
    scheduler's: Python 3.11 gives a thread no name /proc shows)."""

    def __init__(self, pid: int):
        self.pids = tree(pid)
        self.names = {p: f"{comm(p)}[{p}]" for p in self.pids}

    def sample(self) -> dict[str, float]:
        return {self.names[p]: cpu_s(Path(f"/proc/{p}/stat")) for p in self.pids}


# --- one request in each mode ---------------------------------------------------------------


class CountingPool(ServerPool):
    """A ServerPool that counts the reply bytes of /generate (and parses them as ServerPool does)."""

    reply_bytes = 0

    def generate(self, url: str, body: dict) -> dict:
        raw = sglang_client._call(f"{url}/generate", body, self.timeout_s, expect_json=False)
        self.reply_bytes = len(raw)
        return json.loads(raw)


class CountingHook(HookTransport):
    """HookTransport with a request id its mode's hook writes for, counting the file bytes read."""

    def __init__(self, folder: Path, mode: str):
        super().__init__(folder)
        self.prefix = self.prefix.replace("e3-", HOOK_PREFIX[mode], 1)
        self.file_bytes = 0

    def discard(self, rid: str, prompt_len: int) -> None:
        self.file_bytes = sum(p.stat().st_size for p in self.folder.glob(f"{rid}.*"))
        super().discard(rid, prompt_len)


def one_request(mode: str, pool: CountingPool, url: str, ids: list[int], width: int, hooks: dict) -> dict:
    body = prefill_body(ids)
    start_wall, start_cpu = time.monotonic(), time.process_time()
    file_bytes = 0
    if mode == "base":
        body = {k: v for k, v in body.items() if k != "return_hidden_states"}
        pool.generate(url, body)
    elif mode == "json":
        rows = JSON.request_rows(pool, body, width, "aux")
        assert rows.prefill.shape == (len(ids), width)
    else:
        rows = hooks[mode].request_rows(pool, body, width, "aux")
        assert rows.prefill.shape == (len(ids), width)
        file_bytes = hooks[mode].file_bytes
    return {
        "client_cpu_s": time.process_time() - start_cpu,
        "wall_s": time.monotonic() - start_wall,
        "bytes": pool.reply_bytes + file_bytes,
        "file_bytes": file_bytes,
    }


def prompt_ids(tokens: int) -> list[int]:
    """`tokens` ids of real text: the ShareGPT sample through SmolLM2's tokenizer."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(resolve_target("smollm2-135m-instruct"))
    text = " ".join(
        turn["value"]
        for line in SHAREGPT.read_text().splitlines()
        for turn in json.loads(line)["conversations"]
    )
    ids = tokenizer(text)["input_ids"]
    assert len(ids) >= tokens, f"the sample has {len(ids)} tokens, fewer than {tokens}"
    return ids[:tokens]


def check_rows(pool: CountingPool, url: str, ids: list[int], width: int, hooks: dict) -> dict:
    """Each hook's rows against the JSON rows of the same forward (one request asking for both):
    bf16 the same bits, fp8 the store's quantization of them (eagle3/data/store.py)."""
    from eagle3.data.wire import dequantize_rows, quantize_rows
    from eagle3.sglang.rows import parse_rows

    checks = {}
    for mode, hook in hooks.items():
        rid = hook.new_rid()
        try:
            response = pool.generate(url, prefill_body(ids) | {"rid": rid})
            got = hook.collect(rid, len(ids), width, url, "aux")
        finally:
            hook.discard(rid, len(ids))
        want = parse_rows(response, len(ids), width, "aux", url).prefill
        if mode == "hook-bf16":
            same = torch.equal(got, want)
        else:
            fp8, scales = quantize_rows(want.to(torch.bfloat16))
            same = torch.equal(got, dequantize_rows(fp8, scales))
        checks[mode] = "equal" if same else "DIFFERENT"
    print(f"#   the hooks' rows against the same forward's JSON rows: {checks}", flush=True)
    return checks


def measure(url: str, server_pid: int, width: int, ids: list[int], reps: int, handover: Path) -> dict:
    pool, cpu = CountingPool([url]), ServerCPU(server_pid)
    hooks = {mode: CountingHook(handover, mode) for mode in HOOK_PREFIX}
    for mode in MODES:  # warm-up: first-call costs out of the figures
        one_request(mode, pool, url, ids[:64], width, hooks)
    checks = check_rows(pool, url, ids, width, hooks)
    runs: dict[str, list[dict]] = {m: [] for m in MODES}
    order = random.Random(0)
    for rep in range(reps):
        modes = list(MODES)
        order.shuffle(modes)
        for mode in modes:
            before = cpu.sample()
            run = one_request(mode, pool, url, ids, width, hooks)
            time.sleep(0.05)  # the writer thread's accounting settles
            after = cpu.sample()
            run["server_cpu_by_process_s"] = {k: after[k] - before[k] for k in after}
            run["server_cpu_s"] = sum(run["server_cpu_by_process_s"].values())
            runs[mode].append(run)
        line = "  ".join(
            f"{m} {runs[m][-1]['server_cpu_s']:.2f}/{runs[m][-1]['client_cpu_s']:.2f}" for m in MODES
        )
        print(f"#   rep {rep + 1}/{reps} server/client CPU s: {line}", flush=True)
    return summarize(runs, len(ids), width) | {"rows_check": checks}


def trimmed_mean(values: list[float]) -> float:
    """The mean without the highest and the lowest value (from 5 values on): the /proc clock
    ticks (10 ms) average out over repeats, a request that shared its core with a burst of
    other work does not count."""
    values = sorted(values)
    return statistics.fmean(values[1:-1] if len(values) >= 5 else values)


def summarize(runs: dict[str, list[dict]], tokens: int, width: int) -> dict:
    base = runs["base"]
    out = {"tokens_per_request": tokens, "width": width, "raw_bf16_bytes_per_token": 2 * width, "modes": {}}
    for mode in MODES:
        mine = runs[mode]
        extra = [m["server_cpu_s"] - b["server_cpu_s"] for m, b in zip(mine, base, strict=True)]
        processes = mine[0]["server_cpu_by_process_s"].keys()
        by_process = {
            name: trimmed_mean(
                [
                    m["server_cpu_by_process_s"][name] - b["server_cpu_by_process_s"][name]
                    for m, b in zip(mine, base, strict=True)
                ]
            )
            / tokens
            for name in processes
        }
        server = trimmed_mean(extra) / tokens
        busiest = max(by_process.values())
        out["modes"][mode] = {
            "bytes_per_token": statistics.median(m["bytes"] for m in mine) / tokens,
            "server_cpu_us_per_token": 1e6 * statistics.median(m["server_cpu_s"] for m in mine) / tokens,
            "transport_server_cpu_us_per_token": 1e6 * server,
            "transport_server_cpu_us_per_token_median": 1e6 * statistics.median(extra) / tokens,
            "transport_server_cpu_us_per_token_range": [1e6 * min(extra) / tokens, 1e6 * max(extra) / tokens],
            "transport_server_cpu_us_per_token_by_process": {k: 1e6 * v for k, v in by_process.items()},
            "client_cpu_us_per_token": 1e6 * statistics.median(m["client_cpu_s"] for m in mine) / tokens,
            "wall_s_per_request": statistics.median(m["wall_s"] for m in mine),
            "ceiling_tokens_per_s": (1 / server) if server > 0 else None,
            "ceiling_busiest_process_tokens_per_s": (1 / busiest) if busiest > 0 else None,
            "reps": len(mine),
            "server_cpu_s": [m["server_cpu_s"] for m in mine],
        }
    return out


# --- the hook's own code, alone ------------------------------------------------------------


class ForwardBatch:
    """What the hook reads of SGLang's ForwardBatch (it finds the argument by its type's name)."""

    def __init__(self, rids: list[str], lens: list[int]):
        self.forward_mode = type("Mode", (), {"name": "EXTEND"})()
        self.rids, self.extend_seq_lens_cpu, self.extend_prefix_lens_cpu = rids, lens, [0] * len(rids)


def hook_alone(width: int, tokens: int, dtype: str, folder: Path, reps: int) -> float:
    """CPU us/token of the hook's callable (eagle3/sglang/aux_hook.py, sync: the write included)
    on one thread, on a forward of `tokens` rows of `width`: what the server spends on the hook,
    measured without a forward around it."""
    from eagle3.sglang.aux_hook import make_hook

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        hook = make_hook({"dir": str(folder), "sync": True, "dtype": dtype, "rid_prefix": "e3-alone-"})
        layers = [torch.randn(tokens, width // 3).to(torch.bfloat16) for _ in range(3)]
        positions = torch.arange(tokens)
        times = []
        for rep in range(reps + 1):
            batch = ForwardBatch([f"e3-alone-{rep}"], [tokens])
            start = time.process_time()
            hook(None, (None, positions, batch), (layers[0], layers))
            times.append(time.process_time() - start)
            for path in folder.glob(f"e3-alone-{rep}.*"):
                path.unlink()
        return 1e6 * statistics.median(times[1:]) / tokens
    finally:
        torch.set_num_threads(threads)


# --- end to end ------------------------------------------------------------------------------


def end_to_end(url: str, handover: Path, samples: int, reps: int, in_flight: int) -> dict:
    """SmolLM2 extraction tokens/s through the extract stage's group function, per transport."""
    from transformers import AutoTokenizer

    from eagle3.core.params import parse_params
    from eagle3.data.extract import select_conversations
    from eagle3.sglang.extract import sglang_group_fn
    from eagle3.sglang.servers import ExtractionServers, TopLogprobs
    from eagle3.target.load import eos_token_ids_of_folder, has_chat_template

    raw = {
        "data": {"source": str(SHAREGPT), "num_samples": samples, "max_length": 512, "seed": 0},
        "extract": {"backend": "sglang", "sglang_url": url, "sglang_requests_in_flight": in_flight},
        "tracking": {"enabled": False},
    }
    params = parse_params(raw)
    path = resolve_target(params.target.source)
    tokenizer = AutoTokenizer.from_pretrained(path)
    chat = has_chat_template(params.target.source)
    stop = eos_token_ids_of_folder(path, tokenizer)
    selected = select_conversations(params, tokenizer, chat)
    transports = {"json": JSON} | {mode: CountingHook(handover, mode) for mode in HOOK_PREFIX}
    runs: dict[str, list[tuple[float, float, int]]] = {m: [] for m in transports}
    order = random.Random(1)
    for _ in range(reps):
        names = list(transports)
        order.shuffle(names)
        for name in names:
            servers = ExtractionServers(
                ServerPool([url]), TopLogprobs(params.extract.sglang_top_logprobs), transports[name]
            )
            compute = sglang_group_fn(servers, 576, params, tokenizer, chat, stop)
            start_wall, start_cpu = time.monotonic(), time.process_time()
            done = compute(selected, lambda _s, _t: None)
            tokens = sum(len(s.input_ids) for s in done)
            runs[name].append((time.monotonic() - start_wall, time.process_time() - start_cpu, tokens))
    return {
        name: {
            "tokens": got[0][2],
            "samples": len(selected),
            "tokens_per_s": statistics.median(t / w for w, _, t in got),
            "client_cpu_us_per_token": 1e6 * statistics.median(c / t for _, c, t in got),
            "requests_in_flight": in_flight,
            "reps": len(got),
        }
        for name, got in runs.items()
    }


# --- the table -------------------------------------------------------------------------------


def by_role(by_process: dict[str, float], launcher: str) -> str:
    """tokenizer manager (the launcher: HTTP, msgpack in, orjson out) / scheduler / detokenizer."""
    roles = [launcher, "sglang::schedul", "sglang::detoken"]
    return " / ".join(f"{sum(v for k, v in by_process.items() if k.startswith(role)):,.0f}" for role in roles)


def table(results: dict) -> str:
    lines = [
        "| width | mode | bytes/token | x raw bf16 | transport server CPU us/token: trimmed mean (min to "
        "max) | of it: tokenizer mgr / scheduler / detokenizer | hook code alone us/token | client CPU "
        "us/token | ceiling tokens/s: 1 / transport | 1 / hook code alone |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for width_name, res in results["widths"].items():
        raw = res["raw_bf16_bytes_per_token"]
        # the tree's first process is the launcher (ServerCPU)
        launcher = next(iter(res["modes"]["base"]["transport_server_cpu_us_per_token_by_process"]))
        for mode, m in res["modes"].items():
            if mode == "base":
                lines.append(
                    f"| {width_name} (W={res['width']}) | base (no rows: the forward alone, "
                    f"{m['server_cpu_us_per_token']:,.0f} us/token) | {m['bytes_per_token']:,.0f} | "
                    f"{m['bytes_per_token'] / raw:.3f} | 0 | | | {m['client_cpu_us_per_token']:,.1f} | | |"
                )
                continue
            lo, hi = m["transport_server_cpu_us_per_token_range"]
            ceiling = m["ceiling_tokens_per_s"]
            ceiling = f"{ceiling:,.0f}" if ceiling else "below resolution"
            alone = m.get("hook_alone_cpu_us_per_token")
            lines.append(
                f"| {width_name} (W={res['width']}) | {mode} | {m['bytes_per_token']:,.0f} | "
                f"{m['bytes_per_token'] / raw:.3f} | "
                f"{m['transport_server_cpu_us_per_token']:,.1f} ({lo:,.0f} to {hi:,.0f}) | "
                f"{by_role(m['transport_server_cpu_us_per_token_by_process'], launcher)} | "
                f"{f'{alone:,.1f}' if alone else '-'} | {m['client_cpu_us_per_token']:,.1f} | {ceiling} | "
                f"{f'{1e6 / alone:,.0f}' if alone else '-'} |"
            )
    if e2e := results.get("end_to_end"):
        lines += [
            "",
            "| SmolLM2 extraction | samples | tokens | tokens/s (wall) | client CPU us/token |",
            "| --- | ---: | ---: | ---: | ---: |",
        ]
        for name, r in e2e.items():
            lines.append(
                f"| {name} | {r['samples']} | {r['tokens']} | {r['tokens_per_s']:,.1f} | "
                f"{r['client_cpu_us_per_token']:,.1f} |"
            )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--widths", nargs="+", default=["smollm2", "kimi"], choices=["smollm2", "kimi"])
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--smollm2-tokens", type=int, default=1024)
    parser.add_argument("--kimi-tokens", type=int, default=256)
    parser.add_argument("--kimi-folder", type=Path, default=Path("/work/kimi-width"))
    parser.add_argument("--e2e-samples", type=int, default=24)
    parser.add_argument("--e2e-reps", type=int, default=3)
    parser.add_argument("--e2e-in-flight", type=int, default=4)
    parser.add_argument("--server-threads", type=int, default=1, help="the server's OMP_NUM_THREADS")
    parser.add_argument("--url", help="a running server of the width given (one) instead of launching one")
    parser.add_argument("--server-pid", type=int, help="with --url: the server's launcher pid (its CPU time)")
    parser.add_argument(
        "--handover", type=Path, default=Path(f"/dev/shm/eagle3-transport-bench-{os.getpid()}")
    )
    parser.add_argument("--json", type=Path, help="write the results here")
    args = parser.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # servers stopped on the way out
    if args.url and (len(args.widths) != 1 or not args.server_pid):
        parser.error("--url needs one --widths and --server-pid")
    results: dict = {
        "machine": machine(),
        "load_average_at_start": os.getloadavg(),
        "command": " ".join(sys.argv),
        "server_threads": args.server_threads,
        "commit": subprocess.run(
            ["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], capture_output=True, text=True
        ).stdout.strip(),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "widths": {},
    }
    print(f"# {results['machine']}; load average {results['load_average_at_start']}", flush=True)
    args.handover.mkdir(parents=True, exist_ok=True)
    for width_name in args.widths:
        tokens = args.smollm2_tokens if width_name == "smollm2" else args.kimi_tokens
        if width_name == "smollm2":
            model, aux_ids, hidden = resolve_target("smollm2-135m-instruct"), [1, 14, 26], 576
        else:
            model, aux_ids, hidden = str(build_kimi_width(args.kimi_folder)), [0, 1, 2], KIMI_HIDDEN
        ids = prompt_ids(tokens)
        process = None
        if args.url:
            url, pid = args.url, args.server_pid
        else:
            process, url = launch(
                model,
                aux_ids,
                args.handover,
                Path(f"/tmp/transport-bench-{os.getpid()}-{width_name}.log"),
                tokens,
                args.server_threads,
            )
            pid = process.pid
        try:
            print(
                f"# {width_name}: W = {3 * hidden}, {tokens} tokens a request, {args.reps} reps", flush=True
            )
            results["widths"][width_name] = measure(url, pid, 3 * hidden, ids, args.reps, args.handover)
            for mode, dtype in HOOK_DTYPE.items():
                alone = hook_alone(3 * hidden, tokens, dtype, args.handover, args.reps)
                results["widths"][width_name]["modes"][mode]["hook_alone_cpu_us_per_token"] = alone
            if width_name == "smollm2" and args.e2e_samples > 0:
                results["end_to_end"] = end_to_end(
                    url, args.handover, args.e2e_samples, args.e2e_reps, args.e2e_in_flight
                )
        finally:
            if process is not None:
                stop_group(process)
        if args.json:
            args.json.write_text(json.dumps(results, indent=1))
    results["load_average_at_end"] = os.getloadavg()
    shutil.rmtree(args.handover, ignore_errors=True)
    print(
        f"# {results['machine']}; load average at start {results['load_average_at_start']}, "
        f"at end {results['load_average_at_end']}"
    )
    print(table(results))
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
