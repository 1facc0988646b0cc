"""Write a randomly initialised DFlash drafter in the layout SGLang 0.5.23 loads for
`--speculative-algorithm DFLASH`, for a Llama-style target (SmolLM2-135M by default).

    python tools/sglang_cpu/make_dflash_drafter.py TARGET_DIR OUT_DIR [--layers 1] [--block-size 4]
        [--target-layer-ids 1 14 26] [--mask-token-id 16] [--seed 0] [--dtype float32] [--constant-token X]

It reads only TARGET_DIR/config.json (hidden size, heads, rope, vocabulary) and needs torch and
safetensors, nothing of eagle3: it defines what SGLang's DFLASH path loads, so a live test can
serve a drafter before any is trained. A random drafter proposes wrong tokens almost always;
speculative decoding stays lossless, so the server's output must still equal plain greedy.

`--constant-token X` writes a drafter that proposes X at every block position instead, so that
the accept path is exercised too: X becomes the mask token and every layer's o_proj and
down_proj are zero, so each layer passes its input through and the drafter's last hidden state
at a masked position is RMSNorm(embedding of X); through a tied target head (SmolLM2's) that
scores X highest for ordinary tokens (checked: " the", " a", ",", "\n"). On text where the
target repeats X ("the the the ...") a whole block is accepted.

The layout, read from sglang/srt/models/dflash.py (DFlashDraftModel) and
sglang/srt/speculative/dflash_utils.py (parse_dflash_draft_config):
- config.json: `architectures: ["DFlashDraftModel"]`, a `model_type` transformers knows (`qwen3`:
  the drafter's layers are Qwen3 decoder layers, q/k RMSNorm included), the target's hidden
  size, heads, head_dim, rope and vocabulary (the drafter borrows the target's embedding and LM
  head and has neither), `num_hidden_layers` (draft layers), top-level `block_size` and
  `num_target_layers`, and `dflash_config: {target_layer_ids, mask_token_id, block_size}`.
  target_layer_ids[i] = the output of target layer i (SGLang's Llama captures it as the input of
  layer i + 1, so the last target layer cannot be used).
- model.safetensors: `fc.weight` [H, len(target_layer_ids) * H] and `hidden_norm.weight` [H]
  (project the concatenated target features), `norm.weight` [H], and per draft layer i
  `layers.i.input_layernorm.weight`, `layers.i.post_attention_layernorm.weight` [H],
  `layers.i.self_attn.{q,k,v,o}_proj.weight`, `layers.i.self_attn.{q,k}_norm.weight` [head_dim],
  `layers.i.mlp.{gate,up,down}_proj.weight`. No embed_tokens, no lm_head.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from safetensors.torch import save_file

INIT_STD = 0.02  # the Hugging Face initializer_range of Llama/Qwen3 configs


def drafter_config(
    target: dict, layers: int, block_size: int, target_layer_ids: list[int], mask_token_id: int, dtype: str
) -> dict:
    """config.json of a DFlash drafter for the target whose config.json is `target`."""
    hidden = int(target["hidden_size"])
    heads = int(target["num_attention_heads"])
    num_target_layers = int(target["num_hidden_layers"])
    vocab = int(target["vocab_size"])
    bad = [i for i in target_layer_ids if not 0 <= i < num_target_layers - 1]
    if bad or not target_layer_ids:
        raise ValueError(
            f"target_layer_ids={target_layer_ids}: each must be in 0..{num_target_layers - 2} "
            f"(the target has {num_target_layers} layers; SGLang cannot capture the last one's output)"
        )
    if block_size < 2:
        raise ValueError(f"block_size={block_size}: at least 2 (the verified token plus one draft)")
    if not 0 <= mask_token_id < vocab:
        raise ValueError(f"mask_token_id={mask_token_id}: must be in 0..{vocab - 1} (the target vocabulary)")
    default_rope = {"rope_theta": target.get("rope_theta", 1e4), "rope_type": "default"}
    rope = target.get("rope_parameters") or default_rope
    return {
        "architectures": ["DFlashDraftModel"],
        "model_type": "qwen3",
        "hidden_size": hidden,
        "intermediate_size": int(target["intermediate_size"]),
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": int(target.get("num_key_value_heads", heads)),
        "head_dim": int(target.get("head_dim", hidden // heads)),
        "hidden_act": "silu",
        "rms_norm_eps": float(target.get("rms_norm_eps", 1e-6)),
        "rope_parameters": rope,
        "max_position_embeddings": int(target.get("max_position_embeddings", 8192)),
        "attention_bias": False,
        "vocab_size": vocab,
        "tie_word_embeddings": False,
        "dtype": dtype,
        "block_size": block_size,
        "num_target_layers": num_target_layers,
        "dflash_config": {
            "target_layer_ids": list(target_layer_ids),
            "mask_token_id": mask_token_id,
            "block_size": block_size,
        },
    }


def drafter_weights(
    config: dict, seed: int, dtype: torch.dtype, pass_through: bool = False
) -> dict[str, torch.Tensor]:
    """Random weights with the names and shapes DFlashDraftModel.load_weights maps; with
    pass_through, the layers' output projections are zero (each layer adds nothing)."""
    gen = torch.Generator().manual_seed(seed)
    h, inter, d = config["hidden_size"], config["intermediate_size"], config["head_dim"]
    q, kv = config["num_attention_heads"] * d, config["num_key_value_heads"] * d
    k = len(config["dflash_config"]["target_layer_ids"])

    def linear(out_features: int, in_features: int) -> torch.Tensor:
        return (torch.randn(out_features, in_features, generator=gen) * INIT_STD).to(dtype)

    def output(out_features: int, in_features: int) -> torch.Tensor:
        weight = linear(out_features, in_features)
        return torch.zeros_like(weight) if pass_through else weight

    def ones(n: int) -> torch.Tensor:
        return torch.ones(n, dtype=dtype)

    weights = {"fc.weight": linear(h, k * h), "hidden_norm.weight": ones(h), "norm.weight": ones(h)}
    for i in range(config["num_hidden_layers"]):
        p = f"layers.{i}."
        weights |= {
            p + "input_layernorm.weight": ones(h),
            p + "post_attention_layernorm.weight": ones(h),
            p + "self_attn.q_proj.weight": linear(q, h),
            p + "self_attn.k_proj.weight": linear(kv, h),
            p + "self_attn.v_proj.weight": linear(kv, h),
            p + "self_attn.o_proj.weight": output(h, q),
            p + "self_attn.q_norm.weight": ones(d),
            p + "self_attn.k_norm.weight": ones(d),
            p + "mlp.gate_proj.weight": linear(inter, h),
            p + "mlp.up_proj.weight": linear(inter, h),
            p + "mlp.down_proj.weight": output(h, inter),
        }
    return weights


def write_drafter(
    target_dir: Path,
    out_dir: Path,
    layers: int = 1,
    block_size: int = 4,
    target_layer_ids: tuple[int, ...] = (1, 14, 26),
    mask_token_id: int = 16,
    seed: int = 0,
    dtype: str = "float32",
    constant_token: int | None = None,
) -> Path:
    """Write config.json and model.safetensors of a random DFlash drafter to out_dir (one that
    proposes `constant_token` everywhere, when given; it is then the mask token too)."""
    target = json.loads((Path(target_dir) / "config.json").read_text())
    if constant_token is not None:
        mask_token_id = constant_token
    config = drafter_config(target, layers, block_size, list(target_layer_ids), mask_token_id, dtype)
    weights = drafter_weights(config, seed, getattr(torch, dtype), pass_through=constant_token is not None)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    save_file(weights, str(out_dir / "model.safetensors"))
    (out_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return out_dir


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("target_dir", type=Path)
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--layers", type=int, default=1)
    parser.add_argument("--block-size", type=int, default=4)
    parser.add_argument("--target-layer-ids", type=int, nargs="+", default=[1, 14, 26])
    parser.add_argument("--mask-token-id", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    parser.add_argument("--constant-token", type=int, default=None)
    a = parser.parse_args()
    out = write_drafter(
        a.target_dir, a.out_dir, a.layers, a.block_size, tuple(a.target_layer_ids), a.mask_token_id, a.seed,
        a.dtype, a.constant_token,
    )  # fmt: skip
    print(out)


if __name__ == "__main__":
    main()
