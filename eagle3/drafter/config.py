"""The drafter's hyper-parameters, mirrored 1:1 by the exported config.json (which also records
the TTT length it was trained for, eagle_config.ttt_length: see export.py).

Sizes come from the target (hidden, heads, RoPE; the MLP width too unless train.intermediate_size
says otherwise), so the drafter's embedding can be the target's own and the serving engine can
share it. The exported dict is a Llama config with the EAGLE-3 extras SGLang's
`LlamaForCausalLMEagle3` reads: `draft_vocab_size`, `eagle_config.eagle_aux_hidden_state_layer_ids`,
`target_hidden_size` (only when it differs from hidden_size, see `to_hf_dict`) and the EAGLE-3.1
switches `fc_norm` / `norm_output`.

RoPE is the target's, of any type transformers implements (default, llama3, yarn, ...), as EAGLE-3
drafters take it. `rope_scaling` holds the type and its parameters (None = default) and is exported
as both `rope_scaling` (transformers 4, SGLang, vLLM) and `rope_parameters` (transformers 5), so the
serving engine rotates exactly as training did.

MLA targets (DeepSeek-V3, Kimi-K2/K2.5): the drafter is a Llama layer, so its head_dim is
hidden_size / num_attention_heads (Kimi: 7168 / 64 = 112), not MLA's qk_rope_head_dim (64) that
transformers' DeepseekV3Config reports as head_dim; RoPE (YaRN) then rotates the drafter's whole
head with the target's rope parameters, as SGLang's LlamaForCausalLMEagle3 does with them.

Aux layer ids: `aux_layer_ids` are this project's (id L = the output of decoder layer L); the
export writes them in the form SGLang reads for the target's family (`layer_id_family`, see
eagle3/core/layer_ids.py: DeepSeek/Kimi targets differ) and records that family in
eagle_config, so reading the file back restores the same ids.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from eagle3.core.layer_ids import LAYER_ID_RULES, serving_rule
from eagle3.vocab import draft_size

ARCHITECTURE = "LlamaForCausalLMEagle3"


@dataclass
class DrafterConfig:
    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    hidden_act: str
    vocab_size: int  # the target's vocabulary V
    draft_vocab_size: int  # K
    target_hidden_size: int
    # 0-indexed decoder layer ids whose outputs feed fc (SGLang eagle_aux_hidden_state_layer_ids).
    aux_layer_ids: list[int] = field(default_factory=list)
    # EAGLE-3.1: an RMSNorm per aux layer before fc, and the normed output fed to the next step.
    fc_norm: bool = False
    norm_output: bool = False
    # the target's RoPE type and its parameters without rope_theta, e.g. {"rope_type": "llama3",
    # "factor": 8.0, ...}; None = default (unscaled) RoPE
    rope_scaling: dict[str, Any] | None = None
    # how SGLang reads eagle_aux_hidden_state_layer_ids for the target (sglang_engine.LayerIdRule)
    layer_id_family: str = "llama-like"

    def __post_init__(self) -> None:
        if not 1 <= self.draft_vocab_size <= self.vocab_size:
            raise ValueError(
                f"draft_vocab_size must be in 1..vocab_size ({self.vocab_size}), got {self.draft_vocab_size}"
            )
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )
        if self.hidden_act != "silu":
            raise ValueError(f"hidden_act: only 'silu' is supported (Llama), got {self.hidden_act!r}")
        if len(self.aux_layer_ids) != 3:
            raise ValueError(f"aux_layer_ids must list 3 layer ids, got {self.aux_layer_ids}")
        self.aux_layer_ids = [int(i) for i in self.aux_layer_ids]
        self.rope_scaling = _checked_rope_scaling(self.rope_scaling)

    @property
    def rope_parameters(self) -> dict[str, Any]:
        """transformers 5's rope_parameters: rope_theta, rope_type and the type's own keys."""
        return {"rope_theta": self.rope_theta, "rope_type": "default"} | (self.rope_scaling or {})

    @classmethod
    def from_target_config(
        cls,
        target_hf_config: Any,
        draft_vocab_size: int,
        aux_layer_ids: list[int],
        intermediate_size: int | None = None,
        fc_norm: bool = False,
        norm_output: bool = False,
    ) -> DrafterConfig:
        """Sizes taken from the target's HF config (LlamaConfig-like, transformers 4 or 5);
        `intermediate_size` None = the target's MLP width."""
        c = target_hf_config
        family = serving_rule(c).family  # the wrapper's architecture decides (Kimi-K2.5)
        c = getattr(c, "text_config", None) or c  # multimodal wrappers keep the LM under text_config
        heads = c.num_attention_heads
        return cls(
            hidden_size=c.hidden_size,
            intermediate_size=intermediate_size or c.intermediate_size,
            num_attention_heads=heads,
            num_key_value_heads=getattr(c, "num_key_value_heads", None) or heads,
            head_dim=_llama_head_dim(c),
            rms_norm_eps=float(getattr(c, "rms_norm_eps", 1e-6)),
            rope_theta=_rope_theta(c),
            rope_scaling=_rope_scaling(c),
            max_position_embeddings=c.max_position_embeddings,
            hidden_act=getattr(c, "hidden_act", "silu"),
            vocab_size=c.vocab_size,
            draft_vocab_size=draft_size(draft_vocab_size, c.vocab_size),
            target_hidden_size=c.hidden_size,
            aux_layer_ids=list(aux_layer_ids),
            fc_norm=fc_norm,
            norm_output=norm_output,
            layer_id_family=family,
        )

    @property
    def owns_embedding(self) -> bool:
        """True when the drafter is narrower/wider than the target: it cannot share the target's
        embedding, so its own is exported (every loader then reads it from the file)."""
        return self.target_hidden_size != self.hidden_size

    def to_hf_dict(self) -> dict[str, Any]:
        """The config.json SGLang, vLLM and the EAGLE reference load (LlamaConfig + EAGLE-3 fields)."""
        d = {
            "architectures": [ARCHITECTURE],
            "model_type": "llama",
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": 1,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "hidden_act": self.hidden_act,
            "rms_norm_eps": self.rms_norm_eps,
            # transformers 4 reads rope_theta (+ rope_scaling), transformers 5 rope_parameters: write both.
            "rope_theta": self.rope_theta,
            "rope_parameters": self.rope_parameters,
            "max_position_embeddings": self.max_position_embeddings,
            "vocab_size": self.vocab_size,
            "draft_vocab_size": self.draft_vocab_size,
            "attention_bias": False,
            "mlp_bias": False,
            # SGLang reuses the embedding as lm_head when true; ours is a separate K-row head.
            "tie_word_embeddings": False,
            # the ids as SGLang reads them for the target's family (module doc); the family is
            # recorded (SGLang ignores the key) only where that form differs from ours
            "eagle_config": {"eagle_aux_hidden_state_layer_ids": self.sglang_aux_layer_ids},
            # EAGLE-3.1: top-level keys, read with getattr(config, "fc_norm" / "norm_output", False)
            # by SGLang python/sglang/srt/models/llama_eagle3.py and vLLM
            # vllm/model_executor/models/llama_eagle3.py (vllm-project/vllm#42764), and by SpecForge
            # specforge/modeling/draft/llama3_eagle.py and speculators
            # src/speculators/models/eagle3/config.py. Always written: SpecForge's norm_output
            # defaults to true when absent.
            "fc_norm": self.fc_norm,
            "norm_output": self.norm_output,
            "torch_dtype": "bfloat16",
        }
        # The EAGLE reference (SafeAILab/EAGLE eagle/model/cnets.py, Model.__init__) copies the
        # target's embedding only when config.json has no target_hidden_size; SGLang and vLLM
        # default it to hidden_size. So it is written only when it differs (and then the
        # drafter's own embedding ships in model.safetensors, see export.py).
        if self.owns_embedding:
            d["target_hidden_size"] = self.target_hidden_size
        if self.rope_scaling is not None:  # left out for the default, as in Llama-2 style configs
            d["rope_scaling"] = dict(self.rope_scaling)
        if self.layer_id_family != LAYER_ID_RULES[0].family:
            d["eagle_config"][FAMILY_KEY] = self.layer_id_family
        return d

    @property
    def sglang_aux_layer_ids(self) -> list[int]:
        """aux_layer_ids as SGLang's eagle_aux_hidden_state_layer_ids for the target's family."""
        return _family_rule(self.layer_id_family).to_sglang(self.aux_layer_ids)

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any], target_config: Any = None) -> DrafterConfig:
        """The config of an exported drafter; its aux layer ids are read as SGLang reads them for
        `target_config`'s family when given (a drafter exported elsewhere records none), else
        for the family the file records (ours), else SGLang's common + 1 rule."""
        arch = d.get("architectures") or []
        if ARCHITECTURE not in arch:
            raise ValueError(f"config.json: architectures must contain {ARCHITECTURE!r}, got {arch}")
        if d.get("num_hidden_layers", 1) != 1:
            raise ValueError(f"config.json: num_hidden_layers must be 1, got {d['num_hidden_layers']}")
        eagle = d.get("eagle_config") or {}
        aux = eagle.get("eagle_aux_hidden_state_layer_ids")
        if aux is None:
            raise ValueError("config.json: eagle_config.eagle_aux_hidden_state_layer_ids is missing")
        heads = d["num_attention_heads"]
        family = serving_rule(target_config).family if target_config is not None else None
        family = family or eagle.get(FAMILY_KEY, LAYER_ID_RULES[0].family)
        return cls(
            hidden_size=d["hidden_size"],
            intermediate_size=d["intermediate_size"],
            num_attention_heads=heads,
            num_key_value_heads=d.get("num_key_value_heads") or heads,
            head_dim=d.get("head_dim") or d["hidden_size"] // heads,
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            rope_theta=_rope_theta(d),
            rope_scaling=_rope_scaling(d),
            max_position_embeddings=d["max_position_embeddings"],
            hidden_act=d.get("hidden_act", "silu"),
            vocab_size=d["vocab_size"],
            draft_vocab_size=d.get("draft_vocab_size") or d["vocab_size"],
            # missing in our exports when equal to hidden_size (and in old EAGLE-3 exports)
            target_hidden_size=d.get("target_hidden_size") or d["hidden_size"],
            aux_layer_ids=_family_rule(family).from_sglang(aux),
            fc_norm=bool(d.get("fc_norm", False)),
            norm_output=bool(d.get("norm_output", False)),
            layer_id_family=family,
        )

    def mismatch(self, vocab_size: int, num_layers: int) -> str | None:
        """Why this drafter cannot run on a target of these sizes (it was trained for another
        one), or None when it fits."""
        if self.vocab_size != vocab_size or max(self.aux_layer_ids) >= num_layers:
            return (
                f"trained for another target (vocab {self.vocab_size}, aux layers {self.aux_layer_ids}; "
                f"target vocab {vocab_size}, {num_layers} layers)"
            )
        return None

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


FAMILY_KEY = "layer_id_family"  # in eagle_config: how SGLang reads the ids (not an SGLang key)


def _family_rule(family: str):
    rules = {rule.family: rule for rule in LAYER_ID_RULES}
    if family not in rules:
        raise ValueError(f"layer_id_family must be one of {', '.join(rules)}, got {family!r}")
    return rules[family]


def _llama_head_dim(c: Any) -> int:
    """The Llama drafter's head width for a target config: its head_dim, except for MLA targets
    (kv_lora_rank set), whose head_dim is the RoPE part of a query/key head, not a head's width."""
    if getattr(c, "kv_lora_rank", None):
        return c.hidden_size // c.num_attention_heads
    return getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads


def _rope_dict(c: Any) -> dict[str, Any]:
    """The rope parameters of an HF config object or config.json dict: transformers 5's
    rope_parameters (theta included), else transformers 4's rope_scaling."""
    get = c.get if isinstance(c, dict) else lambda k, default=None: getattr(c, k, default)
    rope = get("rope_parameters") or get("rope_scaling") or {}
    return dict(rope) if isinstance(rope, dict) else {}


def _rope_theta(c: Any) -> float:
    get = c.get if isinstance(c, dict) else lambda k, default=None: getattr(c, k, default)
    theta = get("rope_theta") or _rope_dict(c).get("rope_theta")
    return float(theta or 10000.0)


def _rope_scaling(c: Any) -> dict[str, Any] | None:
    rope = _rope_dict(c)
    rope.pop("rope_theta", None)
    rope.setdefault("rope_type", rope.pop("type", "default"))  # "type": transformers 4's old key
    return None if rope["rope_type"] == "default" else rope


def _checked_rope_scaling(rope: dict[str, Any] | None) -> dict[str, Any] | None:
    """None for the default RoPE; refuses what the one-layer drafter cannot rotate like the target."""
    if rope is None or rope.get("rope_type", "default") == "default":
        return None
    kind = rope.get("rope_type")
    if kind not in ROPE_INIT_FUNCTIONS:
        known = ", ".join(["default", *sorted(ROPE_INIT_FUNCTIONS)])
        raise ValueError(f"rope type {kind!r} is not supported (transformers knows {known})")
    if rope.get("partial_rotary_factor", 1.0) != 1.0:
        raise ValueError("partial rotary embeddings (partial_rotary_factor < 1) are not supported")
    return dict(rope)
