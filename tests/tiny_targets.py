"""Tiny Kimi-architecture targets for tests: DeepSeek-V3 (MLA, MoE, YaRN RoPE) with random weights
and Kimi-K2's 163,840-entry vocabulary, saved as HF folders that load like the real thing.

Two forms of the same weights:
  * `build_deepseek_target`: a DeepseekV3ForCausalLM folder (Kimi-K2's own layout);
  * `build_kimi_k25_target`: Kimi-K2.5's layout, Kimi_K25ForConditionalGeneration with the
    language model nested under `text_config` (and a tiny vision tower the text path never runs).

The tokenizer is SmolLM2's (the packaged default target's, 49,152 ids): no packaged tokenizer
matches Kimi's (Gemma's has 262,144 ids, more than this vocabulary holds, so it could index past
the embedding). A smaller tokenizer is safe under a larger vocabulary as long as the model never
predicts an id the tokenizer does not have: every id it produces indexes a real embedding row, and
the lm_head rows past the tokenizer are zero, so with random weights (real rows' logits of both
signs) greedy decoding never picks them. Like Kimi's own padded rows, they exist and cost FLOPs.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from transformers import AutoTokenizer, DeepseekV3Config, DeepseekV3ForCausalLM

from eagle3.target.load import resolve_target

KIMI_VOCAB = 163840
# Kimi-K2.5's RoPE (its text_config, as in tests/fixtures/kimi-k2.5/config.json): YaRN x64 over
# 4,096 positions, theta 50,000, up to 262,144 positions.
KIMI_ROPE = {
    "rope_type": "yarn",
    "rope_theta": 50000.0,
    "factor": 64.0,
    "original_max_position_embeddings": 4096,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "mscale": 1.0,
    "mscale_all_dim": 1.0,
}
# Every part of the architecture at a size that runs the whole pipeline in seconds: one dense
# layer then MoE layers (first_k_dense_replace), 4 routed experts in 2 groups + 1 shared, MLA with
# both LoRA ranks. 8 layers make EAGLE-3's default aux layers [1, 3, 4] distinct and all MoE.
TINY = dict(
    vocab_size=KIMI_VOCAB,
    hidden_size=64,
    intermediate_size=128,
    moe_intermediate_size=32,
    num_hidden_layers=8,
    num_attention_heads=4,
    num_key_value_heads=4,
    n_shared_experts=1,
    n_routed_experts=4,
    num_experts_per_tok=2,
    n_group=2,
    topk_group=1,
    first_k_dense_replace=1,
    routed_scaling_factor=2.5,
    q_lora_rank=32,
    kv_lora_rank=32,
    qk_nope_head_dim=16,
    qk_rope_head_dim=8,
    v_head_dim=16,
    max_position_embeddings=262144,
    rms_norm_eps=1e-6,
    rope_parameters=KIMI_ROPE,
    tie_word_embeddings=False,
)


def tiny_deepseek_model(seed: int = 0) -> tuple[DeepseekV3ForCausalLM, object]:
    """(model, SmolLM2 tokenizer): random weights from `seed`, routers random (zero routers would
    send every token to the same experts), lm_head rows past the tokenizer zero (module doc)."""
    tokenizer = AutoTokenizer.from_pretrained(resolve_target("smollm2-135m-instruct"))
    config = DeepseekV3Config(
        **TINY,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    config.architectures = ["DeepseekV3ForCausalLM"]
    torch.manual_seed(seed)
    model = DeepseekV3ForCausalLM(config).eval()
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for layer in model.model.layers[config.first_k_dense_replace :]:
            gate = layer.mlp.gate
            gate.weight.copy_(torch.randn(gate.weight.shape, generator=g) * 0.5)
            bias = gate.e_score_correction_bias
            bias.copy_(torch.randn(bias.shape, generator=g) * 0.01)
        model.lm_head.weight[len(tokenizer) :] = 0
    return model, tokenizer


def build_deepseek_target(folder: Path, seed: int = 0) -> Path:
    """A DeepseekV3ForCausalLM folder (bf16 safetensors, as real checkpoints ship) at `folder`."""
    model, tokenizer = tiny_deepseek_model(seed)
    model.to(torch.bfloat16).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def build_kimi_k25_target(folder: Path, seed: int = 0) -> Path:
    """The same language model in Kimi-K2.5's layout: `text_config` nesting, vision tower beside it."""
    from transformers.models.kimi_k25 import Kimi_K25Config, Kimi_K25ForConditionalGeneration

    text, tokenizer = tiny_deepseek_model(seed)
    vision = dict(num_hidden_layers=1, hidden_size=32, intermediate_size=64, num_attention_heads=2)
    config = Kimi_K25Config(
        text_config=text.config.to_dict(),
        vision_config=vision,
        projection_hidden_size=32,
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    model = Kimi_K25ForConditionalGeneration(config).eval()
    with torch.no_grad():
        model.model.language_model.load_state_dict(text.model.state_dict())
        model.lm_head.weight.copy_(text.lm_head.weight)
    model.to(torch.bfloat16).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    _as_published(folder / "config.json")
    return folder


def _as_published(path: Path) -> None:
    """Rewrite transformers' config.json the way moonshotai/Kimi-K2.5's reads: its own
    architecture name, text model_type kimi_k2, RoPE in transformers 4's rope_theta +
    rope_scaling {"type": ...} spelling (transformers maps all three back on load)."""
    config = json.loads(path.read_text())
    config["architectures"] = ["KimiK25ForConditionalGeneration"]
    text = config["text_config"]
    text |= {"model_type": "kimi_k2", "architectures": ["DeepseekV3ForCausalLM"]}
    rope = dict(text.pop("rope_parameters"))
    text["rope_theta"] = rope.pop("rope_theta")
    text["rope_scaling"] = {"type": rope.pop("rope_type")} | rope
    path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
