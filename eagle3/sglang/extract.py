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
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from transformers import AutoTokenizer

from eagle3.core.layer_ids import LayerIdRule, layer_id_rule
from eagle3.core.params import Params, check_against_target
from eagle3.data.extract import Backend, GroupFn, Selected, run_extraction
from eagle3.data.store import Sample
from eagle3.sglang.check import check_pools
from eagle3.sglang.client import ServerPool
from eagle3.sglang.rows import Rows, generate_body, prefill_body, request_rows
from eagle3.sglang.server_args import check_pool_args
from eagle3.sglang.servers import ExtractionServers, FinalState
from eagle3.verifier.load import (
    eos_token_ids_of_folder,
    has_chat_template,
    load_target_config,
    resolve_target,
)
from eagle3.verifier.render import Rendered, render_prompt


def target_of(servers: ExtractionServers, hidden: int, rows: Rows, ids: list[int]) -> dict:
    """The sample's target fields for its first len(ids) positions: the top-N that came with
    `rows`, or (final-state mode) the final-norm rows of one prefill of `ids` on its servers."""
    if not isinstance(servers.mode, FinalState):
        n = len(ids)
        return {
            "target_topk_ids": rows.top_ids[:n].clone(),
            "target_topk_logprobs": rows.top_logprobs[:n].clone(),
        }
    last = request_rows(servers.mode.pool, prefill_body(ids), hidden, "final-norm rows, hidden_size").prefill
    return {"last_hidden": last.to(torch.bfloat16)}


def text_sample(servers: ExtractionServers, hidden: int, rendered: Rendered) -> Sample:
    ids = rendered.input_ids.tolist()
    body = prefill_body(ids, servers.top_logprobs)
    rows = request_rows(servers.aux, body, 3 * hidden, "aux rows, 3 x hidden_size")
    return Sample(
        input_ids=torch.from_numpy(rendered.input_ids.copy()),
        loss_mask=torch.from_numpy(rendered.loss_mask.copy()),
        aux_hidden=rows.prefill.to(torch.bfloat16),
        **target_of(servers, hidden, rows, ids),
    )


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


def refuse_concurrent_cache_hits(aux: ServerPool, final: ServerPool, in_flight: int) -> None:
    """final_state requests ask for no logprobs, so a prompt prefix the server saw before (a
    chat template's system prompt) hits its radix cache and comes back short. The client then
    flushes and asks again, but SGLang 0.5.23 flushes only an idle server (HTTP 400 while other
    requests run; recorded by tests/test_sglang_live.py): refuse that before any request."""
    cached = [
        url
        for pool in (aux, final)
        for url in pool.urls
        if not pool.server_info(url).get("disable_radix_cache")
    ]
    if cached:
        raise ValueError(
            f"sglang_target final_state with sglang_requests_in_flight {in_flight}: {', '.join(cached)} "
            "run with the radix cache on, and SGLang cannot flush a cache hit while other requests "
            "run: launch them with --disable-radix-cache, or set sglang_requests_in_flight: 1 "
            "(or use sglang_target: top_logprobs, whose requests never hit the cache)"
        )


@dataclass(frozen=True)
class CheckedServers:
    """The servers of the extract params, checked against what patch-check recorded."""

    servers: ExtractionServers
    aux_layers: list[int]
    hidden_size: int
    rule: LayerIdRule
    recorded: dict  # name ("server_args", "final_server_args") -> the args patch-check saw

    def refuse_changed(self, url: str) -> None:
        """ValueError when the server at `url` (relaunched, say) runs other args than recorded."""
        kind = "final" if self.servers.final is not None and url in self.servers.final.urls else "aux"
        pool = self.servers.final if kind == "final" else self.servers.aux
        live = check_pool_args({url: pool.server_info(url)}, kind, self.aux_layers, self.rule)
        _refuse_changed(self.recorded["final_server_args" if kind == "final" else "server_args"], live)


def _refuse_changed(recorded: dict | None, live: dict) -> None:
    recorded = recorded or {}
    changed = sorted(k for k in live if recorded.get(k) != live[k])
    if changed:
        detail = ", ".join(f"{k}: {recorded.get(k)!r} -> {live[k]!r}" for k in changed)
        raise ValueError(f"the SGLang servers changed since patch-check ({detail}): run patch-check again")


def checked_servers(params: Params, fingerprint: dict) -> CheckedServers:
    """The extract params' servers after refusing, before any request, what differs from the
    patch-check report: the engine, the aux layers, the target mode and every server's args."""
    if fingerprint.get("engine") != "sglang":
        raise ValueError(
            f"extract.backend is 'sglang' but the patch-check report checked {fingerprint.get('engine')}: "
            "run patch-check again"
        )
    full_config = load_target_config(params.target)
    config = full_config.get_text_config()  # Kimi-K2.5 nests it
    aux_layers = check_against_target(params, config.num_hidden_layers, config.vocab_size)
    if aux_layers != fingerprint["aux_layers"]:
        raise ValueError(
            f"extract.aux_layers resolve to {aux_layers} but patch-check checked "
            f"{fingerprint['aux_layers']}: run patch-check again"
        )
    servers = ExtractionServers.from_params(params.extract)
    if fingerprint.get("target_top_logprobs") != servers.top_logprobs:
        checked = fingerprint.get("target_top_logprobs")
        raise ValueError(
            f"extract asks for the target's {servers.mode.describe()}, but "
            f"patch-check checked {f'top {checked} logprobs' if checked else 'final-norm states'}: "
            "run patch-check again"
        )
    rule = layer_id_rule(full_config.architectures[0])
    aux_args, final_args = check_pools(servers.aux, servers.final, aux_layers, rule)
    recorded = {name: fingerprint.get(name) for name in ("server_args", "final_server_args")}
    _refuse_changed(recorded["server_args"], aux_args)
    _refuse_changed(recorded["final_server_args"], final_args or {})
    if servers.final is not None and params.extract.sglang_requests_in_flight > 1:
        refuse_concurrent_cache_hits(servers.aux, servers.final, params.extract.sglang_requests_in_flight)
    return CheckedServers(servers, aux_layers, config.hidden_size, rule, recorded)


def extract_with_sglang(
    params: Params,
    fingerprint: dict,
    out_dir: Path,
    **options: int | dict | None,
) -> dict:
    """The extract stage's work on SGLang servers; refuses servers that differ from what patch-check
    saw. `options`: run_extraction's `stop_after_shards`, `stats` and `publish`."""
    checked = checked_servers(params, fingerprint)
    path = resolve_target(params.target.source)
    tokenizer = AutoTokenizer.from_pretrained(path)
    chat = has_chat_template(params.target.source)
    stop = eos_token_ids_of_folder(path, tokenizer)
    servers, hidden = checked.servers, checked.hidden_size
    compute = sglang_group_fn(servers, hidden, params, tokenizer, chat, stop)
    backend = Backend(tokenizer, chat, hidden, compute, servers.top_logprobs)
    return run_extraction(backend, params, checked.aux_layers, fingerprint, out_dir, **options)
