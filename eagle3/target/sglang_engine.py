"""What this project relies on in SGLang: supported versions, the layer-id rule per architecture,
and the server args that must (or must not) be set for extraction.

Layer ids mean the same everywhere in this project: id L = the output of decoder layer L
(0-indexed) = HF `hidden_states[L + 1]`. How SGLang gets there differs by model family (read
from sgl-project/sglang, python/sglang/srt/models/):
  * Llama, Qwen3, Qwen3-MoE (`set_eagle3_layers_to_capture`): `layers_to_capture = [L + 1]`, and
    the model appends the *input* of layer L + 1, i.e. the output of layer L. Layer N - 1 has no
    successor, so it can never be captured (recorded: the server then fails on the first request).
  * DeepSeek-V2/V3/V3.2 (deepseek_v2.py, `DeepseekV2ForCausalLM.set_eagle3_layers_to_capture`)
    and Kimi-K2/K2.5 (kimi_k25.py hands the call to its DeepseekV3ForCausalLM language model; ids
    count text_config's 61 layers): in SGLang 0.5.23 explicit ids get the + 1 only when the first
    id is 1; otherwise they are taken as given, as hook points (id W = the input of layer W = the
    output of layer W - 1). So SpecForge's Kimi-K2 drafter ([2, 30, 58]) and DeepSeek-V3 drafter
    ([1, 29, 57]) both capture the outputs of layers 1, 29, 57, which are also what no ids at all
    capture ([2, N // 2, N - 3] as hook points). `to_sglang` writes this project's ids L in the
    form that captures L (L + 1 unless the first is 1); the output of layer 0 cannot be asked for.
    Captured as the residual stream (hidden_states + residual) entering the layer, but only in
    the plain layer loop:
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
    # deepseek_v2.py's rule: + 1 only when the first id is 1, else the ids are hook points
    plus_one_if_first_is_one: bool = False

    def to_sglang(self, layer_ids: list[int]) -> list[int]:
        """The ids to give SGLang (drafter config.json, --return-aux-hidden-state-layer-ids) for it
        to capture the outputs of decoder layers `layer_ids` (this project's ids)."""
        ids = sorted(int(i) for i in layer_ids)
        if not self.plus_one_if_first_is_one or ids[0] == 1:
            return ids
        if ids[0] == 0:
            raise ValueError(
                f"aux layer 0 cannot be captured on {self.family} targets by SGLang: id 1 is read as "
                "layer 1's output and id 0 as the embeddings (extract.aux_layers: use ids >= 1)"
            )
        return [i + 1 for i in ids]

    def from_sglang(self, sglang_ids: list[int]) -> list[int]:
        """The decoder layers whose outputs SGLang captures for `sglang_ids` (as a drafter's
        config.json lists them), in this project's ids; inverse of `to_sglang`."""
        ids = [int(i) for i in sglang_ids]
        if not self.plus_one_if_first_is_one or ids[0] == 1:
            return sorted(ids)
        if min(ids) == 0:
            raise ValueError(f"layer id 0 makes SGLang capture the embeddings on {self.family} targets")
        return sorted(i - 1 for i in ids)


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
            "Kimi_K25ForConditionalGeneration",  # transformers' own name for the same model
        ),
        "layers_to_capture = [L + 1] (ids written as L, first id 1) or [W] (ids written as W = L + 1, "
        "first id not 1) on the DeepSeek-V3 language model: the residual stream entering layer L + 1 "
        "= the output of layer L; not captured under two-batch overlap",
        {"enable_two_batch_overlap": "layers from first_k_dense_replace on are then not captured"},
        plus_one_if_first_is_one=True,
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


def serving_rule(config) -> LayerIdRule:
    """The rule SGLang applies to a drafter's eagle_aux_hidden_state_layer_ids for a target with
    this HF config (or config.json dict): the listed families, else SGLang's common + 1 (every
    other model file in 0.5.23 that captures aux states adds 1 unconditionally)."""
    get = config.get if isinstance(config, dict) else lambda k, default=None: getattr(config, k, default)
    for architecture in get("architectures") or []:
        for rule in LAYER_ID_RULES:
            if architecture in rule.architectures:
                return rule
    if get("model_type") in DEEPSEEK_MODEL_TYPES:  # a config built in code names no architecture
        return layer_id_rule("DeepseekV3ForCausalLM")
    return LAYER_ID_RULES[0]


DEEPSEEK_MODEL_TYPES = ("deepseek_v2", "deepseek_v3", "deepseek_v32", "kimi_k2", "kimi_k25")


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
    sglang_ids = rule.to_sglang(aux_layers)
    flags = f"--return-aux-hidden-state-layer-ids {' '.join(map(str, sglang_ids))}"
    if mode == "aux":
        if not aux_on:
            raise ValueError(f"{url} (extract.sglang_url) needs --enable-return-aux-hidden-states {flags}")
        ids = info.get("return_aux_hidden_state_layer_ids")
        if list(ids or []) != sglang_ids:
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
