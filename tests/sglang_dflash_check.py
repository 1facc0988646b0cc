"""Load an exported DFlash drafter with SGLang 0.5.23's own code, in the SGLang venv
(tests/test_dflash_sglang.py runs it; not a test module itself):

  PYTHONPATH=tools/sglang_cpu <sglang venv>/bin/python tests/sglang_dflash_check.py EXPORT IO OUT

* config.json through AutoConfig and parse_dflash_draft_config, as SGLang's DFLASH worker reads it;
* SGLang's DFlashDraftModel built from it, its weights loaded by its own load_weights, and every
  parameter compared with the export's tensors (q/k/v and gate/up stacked as SGLang stacks them):
  a weight the loader skipped or mis-mapped shows;
* one block forward through SGLang's modules (project_target_hidden, kv_proj_only + k_norm + RoPE
  for the context, qkv + q/k norm + RoPE for the block, attention over context then block with no
  mask, as the worker runs it), against the outputs our drafter gave for the same inputs (IO).

Writes OUT: a JSON of what it found; exits non-zero only when SGLang itself fails.
"""

from __future__ import annotations

import json
import sys

import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from transformers import AutoConfig


def main(folder: str, io_path: str, out_path: str) -> None:
    from sglang.srt.runtime_context import reset_context
    from sglang.srt.server_args import ServerArgs
    from sglang.test.parallel_groups import publish

    reset_context()
    publish(ServerArgs(model_path="dummy", device="cpu"), role="test")
    from sglang.srt.models.dflash import DFlashDraftModel
    from sglang.srt.models.utils import apply_qk_norm
    from sglang.srt.speculative.dflash_utils import parse_dflash_draft_config

    config = AutoConfig.from_pretrained(folder)
    parsed = parse_dflash_draft_config(draft_hf_config=config)
    found = {
        "config_class": type(config).__name__,
        "num_hidden_layers": parsed.num_hidden_layers,
        "num_target_layers": parsed.num_target_layers,
        "block_size": parsed.block_size,
        "target_layer_ids": parsed.target_layer_ids,
        "resolved_layer_ids": parsed.resolve_target_layer_ids(target_num_layers=parsed.num_target_layers),
        "mask_token": parsed.mask_token,
        "mask_token_id": parsed.mask_token_id,
    }
    model = DFlashDraftModel(config).float()
    found["num_context_features"] = model.num_context_features
    tensors = load_file(f"{folder}/model.safetensors")
    model.load_weights(iter(tensors.items()))
    found["differing_parameters"] = sorted(
        name for name, param in model.named_parameters() if not torch.equal(param, expected(name, tensors))
    )
    io = load_file(io_path)
    found["max_abs_diff"] = float((block_forward(model, io, apply_qk_norm) - io["out"]).abs().max())
    with open(out_path, "w") as f:
        json.dump(found, f)


def expected(name: str, tensors: dict[str, torch.Tensor]) -> torch.Tensor:
    """What SGLang's parameter `name` must hold, from the export's unstacked tensors."""
    if name.endswith("qkv_proj.weight"):
        base = name.removesuffix("qkv_proj.weight")
        return torch.cat([tensors[f"{base}{p}_proj.weight"] for p in "qkv"])
    if name.endswith("gate_up_proj.weight"):
        base = name.removesuffix("gate_up_proj.weight")
        return torch.cat([tensors[f"{base}gate_proj.weight"], tensors[f"{base}up_proj.weight"]])
    return tensors[name]


def block_forward(model, io: dict[str, torch.Tensor], apply_qk_norm) -> torch.Tensor:
    """The final-normed block hidden states, computed with SGLang's modules (module doc)."""
    aux, h = io["aux"], io["block_embeds"]
    ctx_pos, pos = io["context_positions"], io["block_positions"]
    block = h.shape[0]
    ctx = model.project_target_hidden(aux)
    for layer in model.layers:
        a = layer.self_attn
        k_ctx, v_ctx = a.kv_proj_only(ctx)
        k_ctx = a.apply_k_rope(ctx_pos, a.apply_k_norm(k_ctx))
        residual = h
        qkv, _ = a.qkv_proj(layer.input_layernorm.forward_native(h))
        q, k, v = qkv.split([a.q_size, a.kv_size, a.kv_size], dim=-1)
        q, k = apply_qk_norm(q, k, a.q_norm, a.k_norm, a.head_dim, allow_inplace=False)
        q, k = a.rotary_emb.forward_native(pos, q, k)
        q = q.view(block, a.num_heads, a.head_dim).transpose(0, 1)
        keys = torch.cat([k_ctx, k]).view(-1, a.num_kv_heads, a.head_dim).transpose(0, 1)
        values = torch.cat([v_ctx, v]).view(-1, a.num_kv_heads, a.head_dim).transpose(0, 1)
        out = F.scaled_dot_product_attention(
            q[None], keys[None], values[None], enable_gqa=True, scale=a.scaling
        )
        out, _ = a.o_proj(out[0].transpose(0, 1).reshape(block, -1))
        h = residual + out
        gate_up, _ = layer.mlp.gate_up_proj(layer.post_attention_layernorm.forward_native(h))
        down, _ = layer.mlp.down_proj(layer.mlp.act_fn.forward_native(gate_up))
        h = h + down
    return model.norm.forward_native(h)


if __name__ == "__main__":
    main(*sys.argv[1:4])
