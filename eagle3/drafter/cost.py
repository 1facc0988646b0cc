"""What a drafter costs: its parameters, the FLOPs of a draft step, the bytes the feature store
keeps per token, and training memory per device. `eagle3 plan`, the train stage's pre-flight
memory refusal and the train loop's FLOP count all read these, so a calibration of one is the
calibration of all.

Training memory (bytes, per device, `rows` = train.batch_size / devices sequences of seq_len):
AdamW keeps two moments per trainable parameter in the master dtype; bf16 autocast keeps float32
master weights (the optimizer's own, no second copy) and the frozen tensors (the target's
embedding and lm_head, the teacher's rows) in bf16; DDP replicates everything on each device
(FSDP shards weights, grads and moments). Activations kept for backward, per TTT step and token:
ACTIVATION_BYTES[autocast] per draft logit, per hidden unit and per MLP unit, and a byte per
attention score (rows x seq_len^2 x TTT steps).

Calibrated on an H200 (docs/results/2026-12-04-1750-gpu-train-loop-kimi-step.md: Kimi-K2.5's
drafter, batch 1 x 2,048, TTT 7, bf16 autocast, peak allocated 27.95 / 31.10 / 37.65 / 57.51 GiB at
draft vocabularies 16K / 32K / 65K / 164K): a straight line over the draft vocabulary gives 5.8
bytes a logit per step and per token 0.76x the hidden-state bytes first assumed (658K against 868K).
The Gemma-3-270M CPU run's peak RSS (docs/results/2026-12-04-1619-gemma-train-cost-online-memory.md,
bf16 autocast) gives 7.4 bytes a logit. The bf16 row below takes 8 (bf16 logits, their float32 copy,
the bf16 gradient) and 64 x H + 12 x I, above both machines. Without autocast nothing has been
measured: the float32 row keeps the first coefficients.
"""

from __future__ import annotations

import math
from types import SimpleNamespace
from typing import Any

import torch

from eagle3.core.params import TrainParams
from eagle3.data.store import feature_bytes_per_token
from eagle3.drafter.config import DrafterConfig

GIB = 2**30
IDS_MASK_BYTES = (4 + 1) * 2  # input_ids int32 + loss_mask uint8, in the shards and the token file
# interpreter, torch, allocator slack and the CUDA context beyond what the tensors hold
RUNTIME_BYTES = GIB // 2
# bytes kept for backward per token and TTT step: per draft logit, per hidden unit, per MLP unit
# (autocast True: bf16 autocast, calibrated as the module doc says; False: float32, not measured)
ACTIVATION_BYTES = {True: (8, 64, 12), False: (12, 80, 16)}


def drafter_params(cfg: DrafterConfig, p: Any) -> dict[str, int]:
    """Parameters of the drafter as `eagle3.drafter.model.Eagle3Drafter` builds it, and the frozen
    target tensors training holds beside it (embedding; the teacher's lm_head rows)."""
    h, ht, k, v = cfg.hidden_size, cfg.target_hidden_size, cfg.draft_vocab_size, cfg.vocab_size
    q, kv = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    parts = {
        "fc": 3 * ht * h + (3 * ht if cfg.fc_norm else 0),
        "attention": 2 * h * (q + 2 * kv) + q * h,  # q, k, v read concat(embedding, hidden): 2H
        "mlp": 3 * h * cfg.intermediate_size,
        "layer_norms": 3 * h,  # input_layernorm, hidden_norm, post_attention_layernorm
        "draft_lm_head": k * h,
        "final_norm": h,
    }
    head_frozen = not getattr(p, "head_trainable", True)
    frozen_parts = {"draft_lm_head", "final_norm"} if head_frozen else set()
    trainable = sum(n for name, n in parts.items() if name not in frozen_parts)
    # the teacher: the target's lm_head rows of the draft vocabulary (all V rows for
    # train.target_topk on a final-state store, which ranks the full vocabulary)
    teacher = (v if getattr(p, "target_topk", None) else k) * ht
    frozen = {"embedding": v * h, "teacher_head_rows": teacher} | {n: parts[n] for n in frozen_parts}
    return parts | {
        "trainable": trainable,
        "frozen_embedding": v * h,
        "frozen_teacher_head_rows": teacher,
        "frozen": sum(frozen.values()),
        "total": trainable + sum(frozen.values()),
    }


def draft_step_flops(cfg: DrafterConfig) -> dict[str, float]:
    """Forward matmul FLOPs of one draft token, 2 per multiply-add (the decoder layer and the
    draft head; attention over the context left out; fc runs once per verified token on the
    target's aux states)."""
    p = drafter_params(cfg, SimpleNamespace())
    step = 2.0 * (p["attention"] + p["mlp"] + p["draft_lm_head"])
    return {"draft_step": step, "fc_per_verified_token": 2.0 * 3 * cfg.target_hidden_size * cfg.hidden_size}


def store_bytes_per_token(hidden: int, top_n: int, dtype: str = "bfloat16") -> dict[str, int]:
    """Bytes the feature store keeps per token (eagle3/data/store.py): aux_hidden [3H] with
    last_hidden [H] (final_state) or N x (id int32 + logprob float32) (top-N logprobs), the
    hidden states in bf16 or (`dtype` float8_e4m3fn) fp8 with a float32 scale per row, plus
    input_ids and loss_mask in the shards and again in the token file."""
    return {
        "final_state": feature_bytes_per_token(hidden, dtype) + IDS_MASK_BYTES,
        "top_logprobs": feature_bytes_per_token(hidden, dtype, top_n) + IDS_MASK_BYTES,
    }


def activation_bytes_per_step(cfg: DrafterConfig, p: TrainParams, rows: int, autocast: bool = True) -> int:
    """Activations kept for backward per TTT step, for `rows` sequences of train.seq_len
    (logits of the draft vocabulary dominate; attention scores grow with seq_len squared)."""
    per_logit, per_hidden, per_mlp = ACTIVATION_BYTES[autocast]
    h, k, i = cfg.hidden_size, cfg.draft_vocab_size, cfg.intermediate_size
    tokens = rows * p.seq_len
    return tokens * (k * per_logit + h * per_hidden + i * per_mlp) + tokens * p.seq_len * p.ttt_length


def training_memory(
    cfg: DrafterConfig,
    p: TrainParams,
    world: int,
    precision: tuple[torch.dtype, bool],
    stored_topk: int | None = None,
) -> dict[str, float]:
    """Per-device training memory in GiB, part by part, with its DDP and FSDP totals (see the
    module doc). `precision`: eagle3/dtypes/precision.py's precision_of(the train dtype);
    `stored_topk`: the store holds the target's top-N logprobs instead of last_hidden."""
    master, autocast = precision
    m = master.itemsize
    frozen_bytes = 2 if autocast else m
    counts = drafter_params(cfg, p)
    trainable = counts["trainable"]
    rows = math.ceil(p.batch_size / world)
    tokens = rows * p.seq_len
    if stored_topk:  # ids int64 + logprobs float32 per position; no teacher logits
        teacher = tokens * stored_topk * 12
    else:  # the K teacher logits, and for train.target_topk the full-vocabulary ones (bf16 + float32)
        teacher = tokens * cfg.draft_vocab_size * 2 + (tokens * cfg.vocab_size * 6 if p.target_topk else 0)
    activations = activation_bytes_per_step(cfg, p, rows, autocast) * p.ttt_length + teacher
    # the target's full lm_head [V, H] stays loaded beside the teacher's rows (prepare_inputs)
    frozen = counts["frozen"] + cfg.vocab_size * cfg.target_hidden_size
    out = {
        "weights_trainable": trainable * m / GIB,
        "weights_frozen": frozen * frozen_bytes / GIB,
        "grads": trainable * m / GIB,
        "optimizer": 2 * trainable * m / GIB,
        "activations": activations / GIB,
        "runtime": RUNTIME_BYTES / GIB,
    }
    out["total_ddp"] = sum(out.values())
    sharded = (out["weights_trainable"] + out["grads"] + out["optimizer"]) / world
    out["total_fsdp"] = sharded + out["weights_frozen"] + out["activations"] + out["runtime"]
    return out
