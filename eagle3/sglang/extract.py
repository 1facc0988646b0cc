"""Extraction on SGLang servers: the same selection, rendering, shards and resume as the hf
backend (eagle3/data/extract.py), with the hidden states taken from running servers.

Per sample, sent as `input_ids` rendered exactly as the hf backend renders them, one request to
an aux-mode server for the aux rows [T, 3H], and the target's own prediction as the target mode
says (eagle3/sglang/servers.py: the same request's top-N logprobs, or a second request to a
final-state server). Under self-distillation (data.regenerate) the aux server generates the
greedy answer and its decode steps return that answer's aux rows (and top logprobs) in the same
request, as the hf on-policy path does; final_state then adds one prefill of prompt + answer on
the plain server.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch
from transformers import AutoTokenizer

from eagle3.core.params import Params
from eagle3.data.extract import ExtractionPlan, GroupFn, Selected, run_extraction
from eagle3.data.store import Sample
from eagle3.sglang.features import checked_servers, target_of, text_sample
from eagle3.sglang.rows import generate_body, request_rows
from eagle3.sglang.servers import ExtractionServers
from eagle3.target.fingerprint import Fingerprint
from eagle3.target.load import eos_token_ids_of_folder, has_chat_template, resolve_target
from eagle3.target.render import render_prompt


def onpolicy_sample(
    servers: ExtractionServers, hidden: int, prompt: np.ndarray, params: Params, stop: frozenset[int]
) -> Sample:
    """The target's greedy answer with the aux rows of that generation; stored like the hf
    on-policy path: the prompt, then the answer without its last token (whose prediction the
    final stored row holds)."""
    budget = min(params.data.regenerate_max_new_tokens, params.data.max_length - len(prompt) + 1)
    body = generate_body(prompt.tolist(), budget, sorted(stop), top_logprobs=servers.top_logprobs)
    rows = request_rows(servers.aux, body, 3 * hidden, "aux rows")
    answer = rows.output_ids[:budget]
    ends = [i for i, token in enumerate(answer) if token in stop]
    if ends:  # a server that generated past an EOS id (ignore_eos) is cut where the hf path stops
        answer = answer[: ends[0] + 1]
    fed = max(len(answer) - 1, 0)
    tokens = np.concatenate([prompt, np.asarray(answer[:fed], dtype=np.int32)])
    mask = np.zeros(len(tokens), dtype=np.uint8)
    mask[len(prompt) :] = 1
    return Sample(
        input_ids=torch.from_numpy(tokens),
        loss_mask=torch.from_numpy(mask),
        aux_hidden=torch.cat([rows.prefill, rows.decode[:fed]]).to(torch.bfloat16),
        **target_of(servers, hidden, rows, tokens.tolist()),
    )


def sglang_group_fn(
    servers: ExtractionServers, hidden: int, params: Params, tokenizer, chat: bool, stop: frozenset[int]
) -> GroupFn:
    """One shard's samples, `extract.sglang_requests_in_flight` requests at a time, in order."""

    def compute(group: list[Selected], advance: Callable[[int, int], None]) -> list[Sample]:
        with ThreadPoolExecutor(params.extract.sglang_requests_in_flight) as pool:
            if params.data.regenerate:
                prompts = [render_prompt(tokenizer, s.messages, chat) for s in group]
                futures = [pool.submit(onpolicy_sample, servers, hidden, p, params, stop) for p in prompts]
            else:
                futures = [pool.submit(text_sample, servers, hidden, s.rendered) for s in group]
            samples = []
            for future in futures:
                samples.append(future.result())
                advance(1, len(samples[-1].input_ids))
        return samples

    return compute


def extract_with_sglang(
    params: Params,
    fingerprint: Fingerprint,
    out_dir: Path,
    **options: int | dict | None,
) -> tuple[dict, str]:
    """The extract stage's work on SGLang servers; refuses servers that differ from what patch-check
    saw. `options`: run_extraction's `stop_after_shards`, `stats` and `publish`. Returns the manifest
    and the dtype the servers computed in."""
    checked = checked_servers(params, fingerprint)
    path = resolve_target(params.target.source)
    tokenizer = AutoTokenizer.from_pretrained(path)
    chat = has_chat_template(params.target.source)
    stop = eos_token_ids_of_folder(path, tokenizer)
    servers, hidden = checked.servers, checked.hidden_size
    compute = sglang_group_fn(servers, hidden, params, tokenizer, chat, stop)
    plan = ExtractionPlan(tokenizer, chat, hidden, compute, servers.top_logprobs)
    manifest = run_extraction(plan, params, checked.aux_layers, fingerprint, out_dir, **options)
    return manifest, fingerprint.dtype
