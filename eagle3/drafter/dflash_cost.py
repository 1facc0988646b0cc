"""What a DFlash drafter costs: parameters, the FLOPs of one draft step (one forward over a block),
the store bytes per token, and training memory per device. `eagle3 plan`, the train stage's
memory refusal and the train loop's FLOP count read these, as eagle3/drafter/cost.py serves
EAGLE-3.

Training (eagle3/train/dflash.py) runs per sample up to dflash.anchors blocks of block_size
queries over seq_len context keys in every layer, and the target's full lm_head on every counted
block position: the drafter's logits (kept for backward) and the target's distribution, both
[positions, V]. Per query and layer the activations are costed with cost.py's per-hidden and
per-MLP bytes; attention scores take a byte each (queries x (seq_len + queries)); each counted
position keeps per_logit bytes of the drafter's logits and 4 of the target's probabilities.
Not calibrated on a GPU yet: the EAGLE-3 coefficients (ACTIVATION_BYTES) are taken as they are.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from eagle3.drafter.cost import ACTIVATION_BYTES, GIB, IDS_MASK_BYTES, RUNTIME_BYTES
from eagle3.drafter.dflash import DFlashConfig


def dflash_params(cfg: DFlashConfig) -> dict[str, int]:
    """Parameters of `DFlashDrafter`, and the frozen target tensors it borrows (embedding, lm_head)."""
    h, v, n = cfg.hidden_size, cfg.vocab_size, len(cfg.target_layer_ids)
    q, kv = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    layers = cfg.num_hidden_layers
    parts = {
        "fc": n * h * h + h,  # + hidden_norm
        "attention": layers * (h * (q + 2 * kv) + q * h + 2 * cfg.head_dim),  # + q_norm, k_norm
        "mlp": layers * 3 * h * cfg.intermediate_size,
        "layer_norms": layers * 2 * h + h,  # input / post-attention norms, the final norm
    }
    trainable = sum(parts.values())
    frozen = {"embedding": v * h, "lm_head": v * h}
    return parts | {
        "trainable": trainable,
        "frozen_embedding": frozen["embedding"],
        "frozen_lm_head": frozen["lm_head"],
        "frozen": sum(frozen.values()),
        "total": trainable + sum(frozen.values()),
    }


def dflash_step_flops(cfg: DFlashConfig) -> dict[str, float]:
    """Forward matmul FLOPs (2 per multiply-add) of one draft step: the layers over block_size
    queries and the target's head over the block_size - 1 drafts (attention scores left out), and
    per verified token the context it adds: fc and each layer's key and value projections."""
    h, q, kv = cfg.hidden_size, cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    layer = h * (q + 2 * kv) + q * h + 3 * h * cfg.intermediate_size
    block = cfg.block_size
    step = 2.0 * (block * cfg.num_hidden_layers * layer + (block - 1) * cfg.vocab_size * h)
    context = 2.0 * (len(cfg.target_layer_ids) * h * h + cfg.num_hidden_layers * 2 * kv * h)
    return {"draft_step": step, "context_per_verified_token": context, "drafts_per_step": block - 1}


def dflash_train_flops_per_token(cfg: DFlashConfig, anchors_per_token: float) -> float:
    """Matmul FLOPs of one trained token, forward and backward (3x the forward): its context
    (fc, keys and values in every layer) and its share of the blocks (`anchors_per_token` blocks
    of block_size queries through every layer, the drafter's logits and the target's)."""
    f = dflash_step_flops(cfg)
    head = 2.0 * cfg.vocab_size * cfg.hidden_size * (cfg.block_size - 1)
    # the drafter's pass is trained (x3); the target's distribution is a forward only (x1)
    return (
        3 * (f["context_per_verified_token"] + anchors_per_token * f["draft_step"]) + anchors_per_token * head
    )


def dflash_store_bytes_per_token(cfg: DFlashConfig) -> int:
    """Bytes a bf16 store keeps per token: the target layers' outputs [n x H], last_hidden [H],
    ids and mask (eagle3/data/store.py)."""
    return (len(cfg.target_layer_ids) + 1) * cfg.hidden_size * 2 + IDS_MASK_BYTES


def dflash_training_memory(
    cfg: DFlashConfig,
    p: Any,
    anchors: int,
    world: int,
    precision: tuple[torch.dtype, bool],
    stored_topk: int | None = None,
) -> dict[str, float]:
    """Per-device training memory in GiB, part by part, with its DDP and FSDP totals (module
    doc); `p`: train params (batch_size, seq_len), `anchors`: dflash.anchors."""
    master, autocast = precision
    m = master.itemsize
    frozen_bytes = 2 if autocast else m
    counts = dflash_params(cfg)
    trainable = counts["trainable"]
    per_logit, per_hidden, per_mlp = ACTIVATION_BYTES[autocast]
    rows = math.ceil(p.batch_size / world)
    queries = rows * min(anchors, p.seq_len) * cfg.block_size
    labels = rows * min(anchors, p.seq_len) * (cfg.block_size - 1)
    h = cfg.hidden_size
    per_layer = queries * (h * per_hidden + cfg.intermediate_size * per_mlp) + queries * (p.seq_len + queries)
    context = rows * p.seq_len * (len(cfg.target_layer_ids) + 1) * h * 4  # features and their projection
    teacher = 0 if not stored_topk else rows * p.seq_len * stored_topk * 12
    activations = (
        cfg.num_hidden_layers * per_layer + labels * cfg.vocab_size * (per_logit + 4) + context + teacher
    )
    out = {
        "weights_trainable": trainable * m / GIB,
        "weights_frozen": counts["frozen"] * frozen_bytes / GIB,
        "grads": trainable * m / GIB,
        "optimizer": 2 * trainable * m / GIB,
        "activations": activations / GIB,
        "runtime": RUNTIME_BYTES / GIB,
    }
    out["total_ddp"] = sum(out.values())
    sharded = (out["weights_trainable"] + out["grads"] + out["optimizer"]) / world
    out["total_fsdp"] = sharded + out["weights_frozen"] + out["activations"] + out["runtime"]
    return out
