"""patch-check on SGLang servers: the report the stage writes (the comparisons themselves are in
eagle3/sglang/check.py). Every server is checked cheaply first (version, mode, args), then its
rows on a few conversations against the HF float32 reference of the same target."""

from __future__ import annotations

from eagle3.core.layer_ids import layer_id_rule
from eagle3.core.params import Params, check_against_target
from eagle3.sglang.check import (
    CHECK_CONVERSATIONS,
    check_pools,
    check_transport,
    hf_reference,
    run_sglang_patch_check,
    sglang_fingerprint,
)
from eagle3.sglang.servers import ExtractionServers
from eagle3.target.load import has_chat_template, load_target, load_target_config
from eagle3.target.patch_check import PatchCheckError, fingerprint
from eagle3.target.render import render_conversation, render_prompt, user_turn


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


def sglang_patch_check(params: Params) -> dict:
    """The patch-check report of the servers extract.sglang_url (and sglang_final_url) name;
    raises on any server that is not what extraction needs or disagrees with the reference."""
    full_config = load_target_config(params.target)
    config = full_config.get_text_config()  # Kimi-K2.5 nests it
    aux_layers = check_against_target(params, config.num_hidden_layers, config.vocab_size)
    rule = layer_id_rule(full_config.architectures[0])
    servers = ExtractionServers.from_params(params.extract)
    aux_args, final_args = check_pools(servers.aux, servers.final, aux_layers, rule)  # before the HF load
    # float32: the tolerances were measured against a float32 reference (a bf16 one adds its own
    # rounding: top-1 logprob error 0.39 against 0.16, measured on SmolLM2)
    target = load_target(params.target.model_copy(update={"dtype": "float32"}))
    inputs, prompt = check_inputs(target.tokenizer, has_chat_template(params.target.source))
    reference = hf_reference(target.model, aux_layers)
    top = servers.top_logprobs
    checks = run_sglang_patch_check(
        servers.aux, servers.final, inputs, prompt, config.hidden_size, aux_layers, reference, top
    )
    if servers.transport.name != "json":  # the same rows another way: bit for bit, batched
        handover = check_transport(servers.aux, servers.transport, inputs, 3 * config.hidden_size)
        if handover["hook_dtype"] != "bfloat16" and params.extract.store_dtype != handover["hook_dtype"]:
            raise PatchCheckError(
                f"the servers' hooks write {handover['hook_dtype']} rows, and extract.store_dtype is "
                f"{params.extract.store_dtype}: the store would hold their rounded values, not the "
                "target's; set store_dtype: float8_e4m3fn (a store), or hook config dtype bfloat16"
            )
        checks.append(handover)
    base = fingerprint(target, aux_layers)
    return {
        "fingerprint": sglang_fingerprint(base, aux_args, final_args, rule, top).to_json(),
        "convention": f"aux layer id L = output of decoder layer L = HF hidden_states[L + 1]; SGLang "
        f"({rule.family}): {rule.capture}",
        "checks": checks,
        "passed": True,
    }
