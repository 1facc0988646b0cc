"""Extraction on SGLang servers: the same selection, rendering, shards and resume as the hf
backend (eagle3/data/extract.py), with the hidden states taken from running servers.

Per sample two requests, sent as `input_ids` rendered exactly as the hf backend renders them:
  * to an aux-mode server (extract.sglang_url): the aux rows [T, 3H];
  * to a plain-mode server of the same target (extract.sglang_final_url): the final-norm rows
    [T, H], which the aux mode does not return and training needs (the target's own
    prediction is recomputed from them with its lm_head, as for the hf backend).
Under self-distillation (data.regenerate) the aux server generates the greedy answer and its
decode steps return that answer's aux rows in the same request, as the hf on-policy path does;
the final rows then come from one prefill of prompt + answer on the plain-mode server.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch
from transformers import AutoTokenizer, GenerationConfig

from eagle3.data.extract import GroupFn, Selected, run_extraction
from eagle3.data.render import Rendered, render_conversation, render_prompt, user_turn
from eagle3.data.store import Sample
from eagle3.params import Params, check_against_target
from eagle3.target.load import has_chat_template, load_target_config, resolve_target
from eagle3.target.sglang_check import CHECK_CONVERSATIONS, check_pools
from eagle3.target.sglang_client import ServerPool
from eagle3.target.sglang_engine import layer_id_rule
from eagle3.target.sglang_rows import generate_body, prefill_body, request_rows


def server_pools(params: Params) -> tuple[ServerPool, ServerPool]:
    """(aux-mode servers, final-state servers) from extract.sglang_url / sglang_final_url."""
    aux_urls, final_urls = params.extract.sglang_urls()
    return ServerPool(aux_urls), ServerPool(final_urls)


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


def text_sample(aux: ServerPool, final: ServerPool, hidden: int, rendered: Rendered) -> Sample:
    ids = rendered.input_ids.tolist()
    aux_rows = request_rows(aux, prefill_body(ids), 3 * hidden, "aux rows, 3 x hidden_size").prefill
    last_rows = request_rows(final, prefill_body(ids), hidden, "final-norm rows, hidden_size").prefill
    return Sample(
        input_ids=torch.from_numpy(rendered.input_ids.copy()),
        loss_mask=torch.from_numpy(rendered.loss_mask.copy()),
        aux_hidden=aux_rows.to(torch.bfloat16),
        last_hidden=last_rows.to(torch.bfloat16),
    )


def onpolicy_sample(
    aux: ServerPool, final: ServerPool, hidden: int, prompt: np.ndarray, params: Params, stop: frozenset[int]
) -> Sample:
    """The target's greedy answer with the aux rows of that generation; stored like the hf
    on-policy path: the prompt, then the answer without its last token (whose prediction the
    final stored row holds)."""
    budget = min(params.data.regenerate_max_new_tokens, params.data.max_length - len(prompt) + 1)
    rows = request_rows(aux, generate_body(prompt.tolist(), budget, sorted(stop)), 3 * hidden, "aux rows")
    answer = rows.output_ids[:budget]
    ends = [i for i, token in enumerate(answer) if token in stop]
    if ends:  # a server that generated past an EOS id (ignore_eos) is cut where the hf path stops
        answer = answer[: ends[0] + 1]
    fed = max(len(answer) - 1, 0)
    tokens = np.concatenate([prompt, np.asarray(answer[:fed], dtype=np.int32)])
    last_rows = request_rows(final, prefill_body(tokens.tolist()), hidden, "final-norm rows").prefill
    mask = np.zeros(len(tokens), dtype=np.uint8)
    mask[len(prompt) :] = 1
    return Sample(
        input_ids=torch.from_numpy(tokens),
        loss_mask=torch.from_numpy(mask),
        aux_hidden=torch.cat([rows.prefill, rows.decode[:fed]]).to(torch.bfloat16),
        last_hidden=last_rows.to(torch.bfloat16),
    )


def sglang_group_fn(
    aux: ServerPool,
    final: ServerPool,
    hidden: int,
    params: Params,
    tokenizer,
    chat: bool,
    stop: frozenset[int],
) -> GroupFn:
    """One shard's samples, `extract.sglang_requests_in_flight` requests at a time, in order."""

    def compute(group: list[Selected], advance: Callable[[int, int], None]) -> list[Sample]:
        with ThreadPoolExecutor(params.extract.sglang_requests_in_flight) as pool:
            if params.data.regenerate:
                prompts = [render_prompt(tokenizer, s.messages, chat) for s in group]
                futures = [pool.submit(onpolicy_sample, aux, final, hidden, p, params, stop) for p in prompts]
            else:
                futures = [pool.submit(text_sample, aux, final, hidden, s.rendered) for s in group]
            samples = []
            for future in futures:
                samples.append(future.result())
                advance(1, len(samples[-1].input_ids))
        return samples

    return compute


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
    config = text_config(load_target_config(params.target))
    aux_layers = check_against_target(params, config.num_hidden_layers, config.vocab_size)
    if aux_layers != fingerprint["aux_layers"]:
        raise ValueError(
            f"extract.aux_layers resolve to {aux_layers} but patch-check checked "
            f"{fingerprint['aux_layers']}: run patch-check again"
        )
    aux, final = server_pools(params)
    rule = layer_id_rule(load_target_config(params.target).architectures[0])
    aux_args, final_args = check_pools(aux, final, aux_layers, rule)
    for name, live in (("server_args", aux_args), ("final_server_args", final_args)):
        recorded = fingerprint.get(name, {})
        changed = sorted(k for k in live if recorded.get(k) != live[k])
        if changed:
            detail = ", ".join(f"{k}: {recorded.get(k)!r} -> {live[k]!r}" for k in changed)
            raise ValueError(
                f"the SGLang servers changed since patch-check ({detail}): run patch-check again"
            )
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
