"""How SGLang reads aux layer ids, per architecture: the rule every export, patch-check and
server check of this project writes and reads ids by. It lives in core/ because the HF path
(target/patch_check.py), the drafter's export (drafter/config.py) and the SGLang adapter (sglang/)
all read it, and core/ is below all three.

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
        f"eagle3/core/layer_ids.py (known: {known})"
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
