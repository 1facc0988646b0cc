"""How full the hook transport's hand-over folder gets during a live extraction with prefix-cache
hits, and what it holds once the run is over (it must end empty).

    python bench/handover_peak.py [--samples 24] [--system-tokens 512] [--in-flight 1]
                                  [--code DIR] [--json out.json]

Launches one SGLang aux server (the SGLang python of $EAGLE3_SGLANG_PYTHON; tools/sglang_cpu) with
the project's hook (bf16, its writer thread), the radix cache on (SGLang's default) and prefills
chunked at --chunk tokens, and sends ShareGPT conversations that share one long system prompt
through HookTransport.request_rows, as extraction's aux requests without top logprobs
(extract.sglang_target: final_state) do: every request after the first hits the cache on the
system prompt, is given up on at its first piece, flushed and asked again. A thread samples
the folder (files, bytes) every --every-ms while requests run; the figures are a lower bound of
the true peak (a file may come and go between two samples). The final size is read after the
server's writer has had --settle-s to write an abandoned request's last pieces.

--code DIR runs both the client and the server's hook from another checkout (e.g. a commit before
the cancel markers), for a before/after pair on the same machine. With one request in flight on
a 2-core CPU the hook's writer has written a request's pieces before the client, which reads
after the reply, sees the first: late pieces are rare live (the folder ended empty before the
cancel markers too), so tests/test_sglang_hook.py writes them on purpose.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1]


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--samples", type=int, default=24)
    ap.add_argument("--system-tokens", type=int, default=512, help="the shared system prompt's length")
    ap.add_argument("--chunk", type=int, default=64, help="--chunked-prefill-size")
    ap.add_argument("--in-flight", type=int, default=1, help="1: what a radix-cache server allows")
    ap.add_argument("--every-ms", type=float, default=2.0)
    ap.add_argument("--settle-s", type=float, default=5.0)
    ap.add_argument("--code", type=Path, default=BENCH, help="the checkout whose eagle3 runs")
    ap.add_argument("--folder", type=Path, default=Path(f"/dev/shm/eagle3-handover-peak-{os.getpid()}"))
    ap.add_argument("--log", type=Path, default=Path(f"/tmp/eagle3-handover-peak-{os.getpid()}.log"))
    ap.add_argument("--json", type=Path)
    return ap.parse_args()


ARGS = parse_args()
sys.path.insert(0, str(ARGS.code.resolve()))

from eagle3.sglang.client import ServerPool, SGLangError  # noqa: E402
from eagle3.sglang.handover import HookTransport  # noqa: E402
from eagle3.sglang.launch import stop_group  # noqa: E402
from eagle3.sglang.rows import prefill_body  # noqa: E402
from eagle3.target.load import resolve_target  # noqa: E402

SGLANG_PYTHON = os.environ.get("EAGLE3_SGLANG_PYTHON", "/work/sglang-venv/bin/python")
SHAREGPT = BENCH / "tests" / "fixtures" / "sharegpt-48.jsonl"
AUX = [1, 14, 26]
WIDTH = 3 * 576  # SmolLM2-135M's aux rows


class CountingPool(ServerPool):
    """A ServerPool that counts cache flushes: one per request given up on for a cache hit."""

    flushes = 0

    def flush_cache(self, url: str) -> None:
        super().flush_cache(url)
        self.flushes += 1


class FolderSampler(threading.Thread):
    """Files and bytes in the folder, sampled until stopped; the peaks and every sample kept."""

    def __init__(self, folder: Path, every_s: float):
        super().__init__(daemon=True)
        self.folder, self.every_s, self.done = folder, every_s, threading.Event()
        self.peak_bytes = self.peak_files = self.peak_markers = self.samples = 0

    def size(self) -> tuple[int, int, int]:
        files = size = markers = 0
        for entry in os.scandir(self.folder):
            try:
                size += entry.stat().st_size
            except FileNotFoundError:  # read and removed between the listing and the stat
                continue
            files += 1
            markers += entry.name.endswith(".cancel")
        return files, size, markers

    def run(self) -> None:
        while not self.done.is_set():
            files, size, markers = self.size()
            self.samples += 1
            self.peak_files, self.peak_bytes = max(self.peak_files, files), max(self.peak_bytes, size)
            self.peak_markers = max(self.peak_markers, markers)
            time.sleep(self.every_s)


def prompts(n: int, system_tokens: int) -> list[list[int]]:
    """n ShareGPT conversations after one shared system prompt of `system_tokens` tokens,
    through SmolLM2's chat template."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(resolve_target("smollm2-135m-instruct"))
    rows = [json.loads(line)["conversations"] for line in SHAREGPT.read_text().splitlines()]
    text = " ".join(turn["value"] for conversation in rows for turn in conversation)
    system = tokenizer.decode(tokenizer(text)["input_ids"][:system_tokens])
    out = []
    for conversation in rows[:n]:
        messages = [{"role": "system", "content": system}]
        for turn in conversation[:2]:
            role = "user" if turn["from"] == "human" else "assistant"
            messages.append({"role": role, "content": turn["value"][:2000]})
        out.append(list(tokenizer.apply_chat_template(messages, tokenize=True, return_dict=False)))
    return out


def launch(folder: Path, log: Path, chunk: int) -> tuple[subprocess.Popen, str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    spec = {
        "name": "eagle3_aux",
        "target_modules": ["model"],
        "hook_factory": "eagle3.sglang.aux_hook:make_hook",
        "config": {"dir": str(folder)},
    }
    command = [
        SGLANG_PYTHON,
        "-m",
        "sglang.launch_server",
        "--model-path",
        resolve_target("smollm2-135m-instruct"),
    ]
    command += ["--host", "127.0.0.1", "--port", str(port), "--device", "cpu", "--attention-backend"]
    command += [
        "torch_native",
        "--disable-overlap-schedule",
        "--dtype",
        "bfloat16",
        "--max-total-tokens",
        "8192",
    ]
    command += ["--chunked-prefill-size", str(chunk), "--skip-server-warmup", "--sleep-on-idle"]
    command += ["--enable-return-aux-hidden-states", "--speculative-algorithm", "EAGLE3"]
    command += ["--return-aux-hidden-state-layer-ids", *map(str, AUX), "--forward-hooks", json.dumps([spec])]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MLFLOW_", "DVC_"))}
    stand_in = BENCH / "tools" / "sglang_cpu"
    env |= {
        "SGLANG_USE_CPU_ENGINE": "1",
        "PYTHONPATH": os.pathsep.join([str(stand_in), str(ARGS.code.resolve())]),
    }
    with open(log, "wb") as out:
        process = subprocess.Popen(
            command, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
    url, started = f"http://127.0.0.1:{port}", time.monotonic()
    try:
        while time.monotonic() - started < 900:
            if process.poll() is not None:
                raise RuntimeError(f"SGLang exited with {process.returncode}; see {log}")
            try:
                with urllib.request.urlopen(f"{url}/get_server_info", timeout=5):
                    print(f"# server up in {time.monotonic() - started:.0f} s at {url}", flush=True)
                    return process, url
            except OSError:
                time.sleep(2)
        raise RuntimeError(f"SGLang did not answer within 900 s; see {log}")
    except BaseException:
        stop_group(process)
        raise


def main() -> None:
    ids = prompts(ARGS.samples, ARGS.system_tokens)
    ARGS.folder.mkdir(parents=True, exist_ok=True)
    process, url = launch(ARGS.folder, ARGS.log, ARGS.chunk)
    try:
        pool, transport = CountingPool([url]), HookTransport(ARGS.folder)
        sampler = FolderSampler(ARGS.folder, ARGS.every_ms / 1000)
        sampler.start()
        started = time.monotonic()

        failed: list[str] = []

        def one(prompt: list[int]) -> None:
            try:
                rows = transport.request_rows(pool, prefill_body(prompt), WIDTH, "aux rows")
            except SGLangError as err:  # e.g. a flush refused for good: counted, the run goes on
                failed.append(str(err).splitlines()[0][:200])
                return
            assert rows.prefill.shape == (len(prompt), WIDTH)

        with ThreadPoolExecutor(ARGS.in_flight) as threads:
            list(threads.map(one, ids))
        elapsed = time.monotonic() - started
        time.sleep(ARGS.settle_s)  # the writer's last pieces of an abandoned request
        sampler.done.set()
        sampler.join()
        files, size, markers = sampler.size()
        leftover = sorted(p.name for p in ARGS.folder.iterdir())
    finally:
        stop_group(process)
    tokens = sum(len(p) for p in ids)
    result = {
        "code": str(ARGS.code.resolve()),
        "samples": len(ids),
        "tokens": tokens,
        "prompt_tokens_max": max(len(p) for p in ids),
        "system_tokens": ARGS.system_tokens,
        "chunk": ARGS.chunk,
        "in_flight": ARGS.in_flight,
        "cache_hits_flushed": pool.flushes,
        "requests_failed": len(failed),
        "first_failure": failed[:1],
        "seconds": round(elapsed, 1),
        "folder_samples": sampler.samples,
        "peak_bytes": sampler.peak_bytes,
        "peak_files": sampler.peak_files,
        "peak_markers": sampler.peak_markers,
        "bytes_of_the_longest_prompt": max(len(p) for p in ids) * WIDTH * 2,
        "final_bytes": size,
        "final_files": files,
        "final_markers": markers,
        "final_names": leftover[:5],
        "server_log": str(ARGS.log),
    }
    print(json.dumps(result, indent=1))
    if ARGS.json:
        ARGS.json.write_text(json.dumps(result, indent=1) + "\n")
    for path in ARGS.folder.iterdir():  # this bench's folder only
        path.unlink()
    ARGS.folder.rmdir()


if __name__ == "__main__":
    main()
