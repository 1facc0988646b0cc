"""The tiny drafter config unit tests build on: one factory, each test overriding only the sizes
its own checks depend on."""

from __future__ import annotations

from eagle3.drafter import DrafterConfig


def tiny_drafter_config(
    hidden_size: int = 32, vocab_size: int = 256, draft_vocab_size: int = 64, **overrides
) -> DrafterConfig:
    """A Llama-shaped drafter of `hidden_size` (4 heads, 2 KV heads, MLP 2x wide) for a target of
    `vocab_size` tokens reading aux layers 1, 2, 3; `overrides` replace any other field."""
    fields = {
        "hidden_size": hidden_size,
        "intermediate_size": 2 * hidden_size,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": hidden_size // 4,
        "rms_norm_eps": 1e-5,
        "rope_theta": 1e4,
        "max_position_embeddings": 256,
        "hidden_act": "silu",
        "vocab_size": vocab_size,
        "draft_vocab_size": draft_vocab_size,
        "target_hidden_size": hidden_size,
        "aux_layer_ids": [1, 2, 3],
    }
    return DrafterConfig(**(fields | overrides))
