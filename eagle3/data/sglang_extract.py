"""Extraction on SGLang servers: the same selection, rendering, shards and resume as the hf
backend (eagle3/data/extract.py), with the hidden states taken from running servers.

Per sample, sent as `input_ids` rendered exactly as the hf backend renders them, one request to
an aux-mode server (extract.sglang_url) for the aux rows [T, 3H]. The aux mode returns no
final-norm state, so what training needs of the target's own prediction comes
  * with sglang_target: top_logprobs (the default), from the same request: the target's top-N
    next tokens and logprobs at every position, stored in place of last_hidden;
  * with sglang_target: final_state, from a second request to a plain-mode server of the same
    target (extract.sglang_final_url): the final-norm rows [T, H], recomputed into logits with
    the lm_head as for the hf backend (a second prefill: twice the server work).
Under self-distillation (data.regenerate) the aux server generates the greedy answer and its
decode steps return that answer's aux rows (and top logprobs) in the same request, as the hf
on-policy path does; final_state then adds one prefill of prompt + answer on the plain server.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch
from transformers import AutoTokenizer, GenerationConfig

from eagle3.core.params import Params, check_against_target
from eagle3.data.extract import GroupFn, Selected, run_extraction, stored_topk
from eagle3.data.render import Rendered, render_conversation, render_prompt, user_turn
from eagle3.data.store import Sample
from eagle3.target.load import has_chat_template, load_target_config, resolve_target
from eagle3.target.sglang_check import CHECK_CONVERSATIONS, check_pools
from eagle3.target.sglang_client import ServerPool
from eagle3.target.sglang_engine import layer_id_rule
from eagle3.target.sglang_rows import Rows, generate_body, prefill_body, request_rows


def server_pools(params: Params) -> tuple[ServerPool, ServerPool | None]:
    """(aux-mode servers, final-state servers or None under top_logprobs) from extract.sglang_url
    / sglang_final_url."""
    aux_urls, final_urls = params.extract.sglang_urls()
    return ServerPool(aux_urls), ServerPool(final_urls) if final_urls else None


def text_config(config):
    """The language model's config (multimodal targets such as Kimi-K2.5 nest it)."""
    return getattr(config, "text_config", None) or config


def eos_ids(path: str, tokenizer) -> frozenset[int]:
    """What ends an answer, as for the hf backend: generation config EOS ids and the tokenizer's."""
    ids: set[int] = set()
    try:
        generation = GenerationConfig.from_pretrained(path).eos_token_id
    except OSError:  # no generation_config.json
        generation = None
    for source in (generation, getattr(tokenizer, "eos_token_id", None)):
        if isinstance(source, int):
            ids.add(source)
        elif source:
            ids.update(int(i) for i in source)
    return frozenset(ids)


def check_inputs(tokenizer, chat: bool) -> tuple[list[list[int]], list[int]]:
    """patch-check's inputs rendered as extraction renders them: the conversations (prefill) and
    the first one's prompt (generation)."""
    inputs = []
    for user, answer in CHECK_CONVERSATIONS:
        messages = [{"role": "user", "content": user}, {"role": "assistant", "content": answer}]
        inputs.append(
            render_conversation(tokenizer, messages, max_length=1 << 20, chat=chat).input_ids.tolist()
        )
    prompt = render_prompt(tokenizer, user_turn(CHECK_CONVERSATIONS[0][0]), chat)
    return inputs, prompt.tolist()


def target_of(final: ServerPool | None, hidden: int, rows: Rows, ids: list[int]) -> dict:
    """The sample's target fields for its first len(ids) positions: the top-N that came with
    `rows`, or (final-state mode) the final-norm rows of one prefill of `ids` on `final`."""
    if final is None:
        n = len(ids)
        return {
            "target_topk_ids": rows.top_ids[:n].clone(),
            "target_topk_logprobs": rows.top_logprobs[:n].clone(),
        }
    last = request_rows(final, prefill_body(ids), hidden, "final-norm rows, hidden_size").prefill
    return {"last_hidden": last.to(torch.bfloat16)}


def text_sample(
    aux: ServerPool, final: ServerPool | None, hidden: int, rendered: Rendered, top: int | None
) -> Sample:
    ids = rendered.input_ids.tolist()
    rows = request_rows(aux, prefill_body(ids, top), 3 * hidden, "aux rows, 3 x hidden_size")
    return Sample(
        input_ids=torch.from_numpy(rendered.input_ids.copy()),
        loss_mask=torch.from_numpy(rendered.loss_mask.copy()),
        aux_hidden=rows.prefill.to(torch.bfloat16),
        **target_of(final, hidden, rows, ids),
    )


def onpolicy_sample(
    aux: ServerPool,
    final: ServerPool | None,
    hidden: int,
    prompt: np.ndarray,
    params: Params,
    stop: frozenset[int],
    top: int | None,
) -> Sample:
    """The target's greedy answer with the aux rows of that generation; stored like the hf
    on-policy path: the prompt, then the answer without its last token (whose prediction the
    final stored row holds)."""
    budget = min(params.data.regenerate_max_new_tokens, params.data.max_length - len(prompt) + 1)
    body = generate_body(prompt.tolist(), budget, sorted(stop), top_logprobs=top)
    rows = request_rows(aux, body, 3 * hidden, "aux rows")
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
        **target_of(final, hidden, rows, tokens.tolist()),
    )


def sglang_group_fn(
    aux: ServerPool,
    final: ServerPool | None,
    hidden: int,
    params: Params,
    tokenizer,
    chat: bool,
    stop: frozenset[int],
) -> GroupFn:
    """One shard's samples, `extract.sglang_requests_in_flight` requests at a time, in order."""

    top = stored_topk(params)

    def compute(group: list[Selected], advance: Callable[[int, int], None]) -> list[Sample]:
        with ThreadPoolExecutor(params.extract.sglang_requests_in_flight) as pool:
            if params.data.regenerate:
                prompts = [render_prompt(tokenizer, s.messages, chat) for s in group]
                futures = [
                    pool.submit(onpolicy_sample, aux, final, hidden, p, params, stop, top) for p in prompts
                ]
            else:
                futures = [pool.submit(text_sample, aux, final, hidden, s.rendered, top) for s in group]
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


def extract_with_sglang(
    params: Params,
    fingerprint: dict,
    out_dir: Path,
    stop_after_shards: int | None = None,
    stats: dict | None = None,
) -> dict:
    """The extract stage's work on SGLang servers; refuses servers that differ from what patch-check saw."""
    if fingerprint.get("engine") != "sglang":
        raise ValueError(
            f"extract.backend is 'sglang' but the patch-check report checked {fingerprint.get('engine')}: "
            "run patch-check again"
        )
    full_config = load_target_config(params.target)
    config = text_config(full_config)
    aux_layers = check_against_target(params, config.num_hidden_layers, config.vocab_size)
    if aux_layers != fingerprint["aux_layers"]:
        raise ValueError(
            f"extract.aux_layers resolve to {aux_layers} but patch-check checked "
            f"{fingerprint['aux_layers']}: run patch-check again"
        )
    top = stored_topk(params)
    if fingerprint.get("target_top_logprobs") != top:
        checked = fingerprint.get("target_top_logprobs")
        raise ValueError(
            f"extract asks for the target's {f'top {top} logprobs' if top else 'final-norm states'}, but "
            f"patch-check checked {f'top {checked} logprobs' if checked else 'final-norm states'}: "
            "run patch-check again"
        )
    aux, final = server_pools(params)
    rule = layer_id_rule(full_config.architectures[0])
    aux_args, final_args = check_pools(aux, final, aux_layers, rule)
    for name, live in (("server_args", aux_args), ("final_server_args", final_args or {})):
        recorded = fingerprint.get(name) or {}
        changed = sorted(k for k in live if recorded.get(k) != live[k])
        if changed:
            detail = ", ".join(f"{k}: {recorded.get(k)!r} -> {live[k]!r}" for k in changed)
            raise ValueError(
                f"the SGLang servers changed since patch-check ({detail}): run patch-check again"
            )
    if final is not None and params.extract.sglang_requests_in_flight > 1:
        refuse_concurrent_cache_hits(aux, final, params.extract.sglang_requests_in_flight)
    path = resolve_target(params.target.source)
    tokenizer = AutoTokenizer.from_pretrained(path)
    chat = has_chat_template(params.target.source)
    compute = sglang_group_fn(
        aux, final, config.hidden_size, params, tokenizer, chat, eos_ids(path, tokenizer)
    )
    return run_extraction(
        tokenizer,
        chat,
        config.hidden_size,
        params,
        aux_layers,
        fingerprint,
        out_dir,
        compute,
        stop_after_shards,
        stats,
    )
