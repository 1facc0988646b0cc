"""What this project relies on in SGLang: supported versions, the layer-id rule per architecture,
and the server args that must (or must not) be set for extraction.

Layer ids mean the same everywhere in this project: id L = the output of decoder layer L
(0-indexed) = HF `hidden_states[L + 1]`. How SGLang gets there differs by model family (read
from sgl-project/sglang, python/sglang/srt/models/):
  * Llama, Qwen3, Qwen3-MoE (`set_eagle3_layers_to_capture`): `layers_to_capture = [L + 1]`, and
    the model appends the *input* of layer L + 1, i.e. the output of layer L. Layer N - 1 has no
    successor, so it can never be captured (recorded: the server then fails on the first request).
  * DeepSeek-V2/V3/V3.2 (deepseek_v2.py) and Kimi-K2/K2.5 (kimi_k25.py hands the call to its
    DeepseekV3ForCausalLM language model; ids count text_config's 61 layers): the same + 1,
    captured as hidden_states + residual before layer L + 1, but only in the plain layer loop:
    with two-batch overlap (`--enable-two-batch-overlap`) every layer from
    `first_k_dense_replace` on (1 for Kimi-K2) runs in `model_forward_maybe_tbo` with no
    capture, so the aux rows silently come back short. Extraction refuses that flag.
  * DeepSeek-V4 (deepseek_v4.py): ids are taken as given and captured after layer L returns,
    which is again the output of layer L.
"""

from __future__ import annotations

from dataclasses import dataclass, field

# Versions whose response layout was recorded (tests/fixtures/sglang).
SUPPORTED_VERSIONS = ("0.5.23",)
# Server args that change the numbers or the layout of what comes back; recorded in the
# fingerprint, so a server relaunched with other values invalidates extraction.
ARGS_THAT_MATTER = (
    "dtype",
    "quantization",
    "kv_cache_dtype",
    "tp_size",
    "enable_return_hidden_states",
    "enable_return_aux_hidden_states",
    "return_aux_hidden_state_layer_ids",
)


@dataclass(frozen=True)
class LayerIdRule:
    family: str
    architectures: tuple[str, ...]
    capture: str  # how SGLang turns id L into a captured tensor
    forbidden_args: dict[str, str] = field(default_factory=dict)  # server arg -> why


LAYER_ID_RULES = (
    LayerIdRule(
        "llama-like",
        ("LlamaForCausalLM", "Qwen3ForCausalLM", "Qwen3MoeForCausalLM"),
        "layers_to_capture = [L + 1]: the input of decoder layer L + 1 = the output of layer L",
    ),
    LayerIdRule(
        "deepseek",
        (
            "DeepseekV2ForCausalLM",
            "DeepseekV3ForCausalLM",
            "DeepseekV32ForCausalLM",
            "KimiK25ForConditionalGeneration",
        ),
        "layers_to_capture = [L + 1] on the DeepSeek-V3 language model: hidden_states + residual "
        "before layer L + 1 = the output of layer L; not captured under two-batch overlap",
        {"enable_two_batch_overlap": "layers from first_k_dense_replace on are then not captured"},
    ),
    LayerIdRule(
        "deepseek-v4",
        ("DeepseekV4ForCausalLM",),
        "layers_to_capture = [L]: captured after layer L returns = the output of layer L",
    ),
)


def layer_id_rule(architecture: str) -> LayerIdRule:
    for rule in LAYER_ID_RULES:
        if architecture in rule.architectures:
            return rule
    known = ", ".join(a for rule in LAYER_ID_RULES for a in rule.architectures)
    raise ValueError(
        f"target architecture {architecture} has no SGLang layer-id rule encoded in "
        f"eagle3/target/sglang_engine.py (known: {known})"
    )


def check_server_args(url: str, info: dict, mode: str, aux_layers: list[int], rule: LayerIdRule) -> dict:
    """The args that matter of one server, after checking its version and mode; `mode` is
    "aux" (aux hidden states of `aux_layers`) or "final" (the plain final-norm state)."""
    version = str(info.get("version"))
    if version not in SUPPORTED_VERSIONS:
        raise ValueError(
            f"{url} runs SGLang {version}; supported: {', '.join(SUPPORTED_VERSIONS)} "
            "(the versions whose hidden-state layout is recorded in tests/fixtures/sglang)"
        )
    if not info.get("enable_return_hidden_states"):
        raise ValueError(f"{url} was launched without --enable-return-hidden-states")
    aux_on = bool(info.get("enable_return_aux_hidden_states"))
    flags = f"--return-aux-hidden-state-layer-ids {' '.join(map(str, aux_layers))}"
    if mode == "aux":
        if not aux_on:
            raise ValueError(f"{url} (extract.sglang_url) needs --enable-return-aux-hidden-states {flags}")
        ids = info.get("return_aux_hidden_state_layer_ids")
        if list(ids or []) != list(aux_layers):
            raise ValueError(
                f"{url} captures layers {ids}, but extract.aux_layers resolve to {aux_layers}: {flags}"
            )
    elif aux_on:
        raise ValueError(
            f"{url} (extract.sglang_final_url) returns aux states; it must serve the final-norm "
            "state: launch it without --enable-return-aux-hidden-states"
        )
    for arg, why in rule.forbidden_args.items():
        if info.get(arg):
            raise ValueError(f"{url} runs with {arg} on, which {rule.family} targets cannot use: {why}")
    return {"version": version} | {key: info.get(key) for key in ARGS_THAT_MATTER}


def check_pool_args(infos: dict[str, dict], mode: str, aux_layers: list[int], rule: LayerIdRule) -> dict:
    """One args record for a pool of data-parallel servers, which must all agree."""
    records = {url: check_server_args(url, info, mode, aux_layers, rule) for url, info in infos.items()}
    first_url, first = next(iter(records.items()))
    for url, record in records.items():
        differ = sorted(k for k in first if record[k] != first[k])
        if differ:
            raise ValueError(f"{url} and {first_url} differ in {', '.join(differ)}: serve one configuration")
    return first
