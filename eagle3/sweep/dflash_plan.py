"""The DFlash block drafter's part of `eagle3 plan`: what the dflash section's drafter would be for
this target and what it costs, beside the EAGLE-3 drafter the rest of the plan describes, so one
command answers "EAGLE-3 or a block drafter, for my target" in parameters, memory and FLOPs.

From params and the target's config alone (eagle3/drafter/dflash_cost.py): the drafter's
parameters by part and the frozen target tensors it borrows (embedding, the whole lm_head), the
bytes a store keeps per token for its target layers, per-device training memory (the train
stage's pre-flight figure; train.dtype auto taken as bf16 autocast, as on a GPU), training FLOPs
per token, and one draft step (a block) against the target's FLOPs per token and against the
EAGLE-3 drafter's steps for the same number of drafts.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from eagle3.core.inputs import InputError
from eagle3.core.params import Params, ParamsError, dflash_target_layers
from eagle3.drafter.cost import GIB
from eagle3.drafter.dflash import DFlashConfig
from eagle3.drafter.dflash_cost import (
    dflash_params,
    dflash_step_flops,
    dflash_store_bytes_per_token,
    dflash_train_flops_per_token,
    dflash_training_memory,
)
from eagle3.dtypes.precision import precision_of
from eagle3.dtypes.probes import DTYPES
from eagle3.sglang.servers import store_format
from eagle3.train.prepare import SHAPE_KEYS


def planned_dflash(params: Params, target: dict[str, Any]) -> DFlashConfig:
    """The DFlash drafter the train stage would build for this target (mask token: the configured
    id, else 0; it costs nothing)."""
    d, layers = params.dflash, target["num_hidden_layers"]
    ids = d.target_layers or dflash_target_layers(layers, d.num_layers)
    if bad := [i for i in ids if not 0 <= i <= layers - 2]:
        raise ParamsError(
            "params", [f"dflash.target_layers: layer ids {bad} are outside the {layers}-layer target"]
        )
    shape = {key: getattr(params.train, key) for key in SHAPE_KEYS}
    try:
        return DFlashConfig.from_target_config(
            SimpleNamespace(**target), d.num_layers, d.block_size, ids, d.mask_token_id or 0, None, shape
        )
    except ValueError as err:
        raise InputError(f"plan: the DFlash drafter: {err}") from None


def dflash_plan(
    params: Params, target: dict[str, Any], world: int, target_flops_per_token: float, eagle3_step: float
) -> dict:
    """The `dflash` entry of the plan (plain data, as the --json output carries it);
    `eagle3_step`: the FLOPs of one draft step of the plan's EAGLE-3 drafter."""
    cfg = planned_dflash(params, target)
    p = params.train
    dtype = DTYPES["bfloat16" if p.dtype == "auto" else p.dtype]
    top_n = params.extract.sglang_top_logprobs if store_format(params.extract) == "top_logprobs" else None
    memory = dflash_training_memory(cfg, p, params.dflash.anchors, world, precision_of(dtype), top_n)
    step = dflash_step_flops(cfg)
    drafts = cfg.block_size - 1
    row = min(p.seq_len, params.data.max_length)  # a sample of data.max_length tokens
    anchors_per_token = min(params.dflash.anchors, row) / row
    return {
        "active": params.drafter.kind == "dflash",
        "config": {
            "num_layers": cfg.num_hidden_layers,
            "block_size": cfg.block_size,
            "target_layer_ids": cfg.target_layer_ids,
            "shape": {key: getattr(cfg, key) for key in SHAPE_KEYS},
            "anchors": params.dflash.anchors,
        },
        "params": dflash_params(cfg),
        "store_bytes_per_token": dflash_store_bytes_per_token(cfg),
        "memory_gib_per_device": memory,
        "flops": step
        | {
            "draft_step_over_target": step["draft_step"] / target_flops_per_token,
            # EAGLE-3 drafts one token a step (its layer and its draft head)
            "eagle3_steps_same_drafts": drafts * eagle3_step,
            "train_per_token": dflash_train_flops_per_token(cfg, anchors_per_token),
        },
        "weights_gib_bf16": dflash_params(cfg)["trainable"] * 2 / GIB,
    }
