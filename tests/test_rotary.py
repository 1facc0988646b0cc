"""The drafter's RoPE is transformers' own, for every rope_type a target uses.

A Llama-3.1-style target (rope_type llama3), a Qwen-style YaRN target and a DeepSeek/Kimi-style
YaRN target (mscale) build a drafter config whose rotary equals the target's own rotary class
bitwise, and whose exported config.json makes transformers build that same rotary again.
"""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoConfig, DeepseekV3Config, LlamaConfig, Qwen2Config
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3RotaryEmbedding
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb
from transformers.models.qwen2.modeling_qwen2 import Qwen2RotaryEmbedding

from eagle3.drafter import DrafterConfig, Eagle3Drafter, export_drafter

V, K = 300, 64
SIZES = dict(
    vocab_size=V, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2
)


def llama3_target() -> tuple[LlamaConfig, type]:
    rope = {
        "rope_type": "llama3",
        "rope_theta": 500000.0,
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    return LlamaConfig(**SIZES, max_position_embeddings=131072, rope_parameters=rope), LlamaRotaryEmbedding


def qwen_yarn_target() -> tuple[Qwen2Config, type]:
    # transformers 4's spelling (rope_scaling with "type"), as many hub configs still have it
    rope = {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}
    return Qwen2Config(**SIZES, max_position_embeddings=131072, rope_scaling=rope), Qwen2RotaryEmbedding


def deepseek_yarn_target() -> tuple[DeepseekV3Config, type]:
    rope = {
        "rope_type": "yarn",
        "rope_theta": 10000.0,
        "factor": 40.0,
        "original_max_position_embeddings": 4096,
        "beta_fast": 32,
        "beta_slow": 1,
        "mscale": 1.0,
        "mscale_all_dim": 0.707,  # != mscale: the attention factor is not 1
    }
    sizes = SIZES | {"num_key_value_heads": 4}
    config = DeepseekV3Config(
        **sizes,
        max_position_embeddings=163840,
        qk_rope_head_dim=16,
        qk_nope_head_dim=16,
        v_head_dim=16,
        kv_lora_rank=16,
        q_lora_rank=None,
        rope_parameters=rope,
    )
    return config, DeepseekV3RotaryEmbedding


TARGETS = {"llama3": llama3_target, "qwen-yarn": qwen_yarn_target, "deepseek-yarn": deepseek_yarn_target}


def rotations(rotary_of_target: torch.nn.Module, drafter: Eagle3Drafter) -> tuple:
    """(reference q, k rotated with the target's cos/sin, the drafter's q, k) at long positions."""
    cfg = drafter.cfg
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, cfg.num_attention_heads, 7, cfg.head_dim, generator=g)
    k = torch.randn(2, cfg.num_key_value_heads, 7, cfg.head_dim, generator=g)
    pos = torch.tensor([[0, 1, 5, 4095, 4096, 9000, 100000]])
    cos, sin = rotary_of_target(q, pos)
    return (*apply_rotary_pos_emb(q, k, cos, sin), *drafter.midlayer.self_attn.rotary(q, k, pos))


@pytest.mark.parametrize("name", TARGETS)
def test_drafter_rotary_equals_the_targets(name):
    target, rotary_class = TARGETS[name]()
    cfg = DrafterConfig.from_target_config(target, K, [1, 2, 3])
    assert cfg.rope_scaling["rope_type"] == target.rope_parameters["rope_type"] != "default"
    drafter = Eagle3Drafter(cfg, torch.randn(V, target.hidden_size))
    q_ref, k_ref, q, k = rotations(rotary_class(target), drafter)
    assert torch.equal(q, q_ref) and torch.equal(k, k_ref)


@pytest.mark.parametrize("name", TARGETS)
def test_exported_config_builds_the_same_rotary(tmp_path, name):
    """SGLang/vLLM read rope_scaling (transformers 4) or rope_parameters (5) from config.json."""
    target, rotary_class = TARGETS[name]()
    cfg = DrafterConfig.from_target_config(target, K, [1, 2, 3])
    export_drafter(Eagle3Drafter(cfg, torch.randn(V, target.hidden_size)), tmp_path)
    exported = json.loads((tmp_path / "config.json").read_text())
    assert exported["rope_scaling"] == cfg.rope_scaling and "rope_theta" not in exported["rope_scaling"]
    assert exported["rope_parameters"] == cfg.rope_parameters
    assert DrafterConfig.from_hf_dict(exported) == cfg
    loaded = LlamaRotaryEmbedding(AutoConfig.from_pretrained(tmp_path))
    x, pos = torch.randn(1, 4, 5, cfg.head_dim), torch.tensor([[0, 3, 4096, 50000, 131000]])
    for ours, theirs in zip(loaded(x, pos), rotary_class(target)(x, pos), strict=True):
        assert torch.equal(ours, theirs)


def test_default_rope_is_exported_as_before():
    cfg = DrafterConfig.from_target_config(LlamaConfig(**SIZES, rope_theta=1e5), K, [1, 2, 3])
    exported = cfg.to_hf_dict()
    assert cfg.rope_scaling is None and "rope_scaling" not in exported
    assert exported["rope_parameters"] == {"rope_theta": 1e5, "rope_type": "default"}


def test_unknown_or_partial_rope_is_refused():
    base = DrafterConfig.from_target_config(LlamaConfig(**SIZES), K, [1, 2, 3]).as_dict()
    with pytest.raises(ValueError, match="rope type 'mrope' is not supported"):
        DrafterConfig(**base | {"rope_scaling": {"rope_type": "mrope"}})
    with pytest.raises(ValueError, match="partial_rotary_factor"):
        DrafterConfig(
            **base | {"rope_scaling": {"rope_type": "linear", "factor": 2.0, "partial_rotary_factor": 0.5}}
        )
