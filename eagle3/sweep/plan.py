"""What a run will build and cost (`eagle3 plan`; each size of `eagle3 report`), from params and
a target's config.json alone.

No weights are read and nothing is run: the drafter's parameters (trainable and frozen, part by
part), its draft lm_head at every size of `vocab.coverage_grid`, the bytes the feature store
keeps per token, optimizer state and per-device training memory, training steps, and the FLOPs
of one draft step against the target's per token. The target may be a packaged name, an HF
folder or a bare config.json; a multimodal wrapper's text model (`text_config`, as Kimi-K2.5
nests its DeepSeek-V3 language model) is what is planned for.

Assumptions (also in the output): AdamW keeps two moments per trainable parameter in the master
dtype; bf16 autocast (train.dtype auto on a GPU) keeps float32 master weights, which are the
optimizer's own (no second copy), and frozen tensors (embedding, the target's lm_head and the
teacher's rows) in bf16; DDP replicates everything on each device (the FSDP line shards weights,
grads and moments); activations use eagle3.drafter.cost's coefficients, calibrated on an H200,
and the figure is the train stage's pre-flight one. FLOPs count
matmuls only (2 per multiply-add), forward, attention over the context left out (it grows with
the context for the target and the drafter alike).

Features, store against online (`extract.features`; a store in bf16 or fp8,
`extract.store_dtype`): all are planned whatever is configured. What each keeps on disk, how
often the target runs over every token (store: once, at extraction; online: once per epoch),
those forwards in FLOPs and in server-hours at an assumed throughput (`SERVER_TOKENS_PER_S`, an
input: nothing here measured a GPU server) or, for SGLang servers, at the lower of that and what
the configured transport of the aux rows can carry (measured: eagle3/sglang/transport_cost.py),
and what each adds to a training process's memory (online: the prefetch queue, and the target
itself for the in-process hf backend).
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from eagle3.core.inputs import InputError
from eagle3.core.params import DrafterParams, Params, resolve_aux_layers
from eagle3.data.store import FP8
from eagle3.drafter.config import DrafterConfig
from eagle3.drafter.cost import (
    GIB,
    IDS_MASK_BYTES,
    draft_step_flops,
    drafter_params,
    store_bytes_per_token,
    training_memory,
)
from eagle3.drafter.export import load_drafter_config
from eagle3.dtypes.precision import precision_of
from eagle3.dtypes.probes import DTYPES
from eagle3.sglang.servers import store_format
from eagle3.sglang.transport_cost import SERVER_CPU_S_PER_NUMBER, transport_ceiling
from eagle3.sweep.dflash_plan import dflash_plan
from eagle3.train.prepare import SHAPE_KEYS, drafter_config
from eagle3.vocab import draft_size

# The drafter a real Kimi-K2.5 run reported ("2594.7M total params, 1190.9M trainable" at a
# 32,000-token draft vocabulary): the shape the plan compares a Kimi-shaped
# target's drafter with.
REPORTED_KIMI_DRAFTER = {
    "num_attention_heads": 64,
    "num_key_value_heads": 64,
    "head_dim": 128,
    "intermediate_size": 18432,
}
REPORTED = "64 heads, 64 KV heads, head_dim 128, MLP 18,432"
KIMI_TARGET = {"hidden_size": 7168, "vocab_size": 163840}
# Tokens per second one target server (Kimi-K2.5 on 8 x H200 under SGLang, say) runs forwards
# over, for the server-hours of extraction and of online training. An assumption, not a
# measurement (no GPU server has been run for this project: docs/sglang.md): 63.4 GFLOP a token
# at 10,000 tokens/s is 8% of eight H200s' dense bf16 peak, and about a fifth of the best
# published prefill rate for DeepSeek-V3 (LMSYS, 2025-05-05: 52.3K input tokens/s per 8 x H100
# node, prefill-decode disaggregated, expert parallel over 4 nodes, no hidden states returned).
# Measure your own servers and pass that (plan()'s server_tokens_per_s; docs/features.md).
SERVER_TOKENS_PER_S = 10_000.0


@dataclass(frozen=True)
class FeatureMode:
    """One way the drafter gets the target's features (a value of extract.features, and for a
    store the extract.store_dtype its hidden states are kept in): what it keeps on disk per token
    (ids and mask, and the features in `store_dtype`) and how many forwards of the target over
    every token a run of `epochs` epochs pays."""

    name: str
    features: str
    store_dtype: str | None  # None: no features on disk
    target_passes: Callable[[int], int]
    # features computed while training: a bounded queue of batches in flight per process, and a
    # target that runs beside the trainer (in-process for hf)
    computed_while_training: bool


# The storage column of the plan: one entry per way of keeping features.
FEATURE_MODES = (
    FeatureMode("store", "store", "bfloat16", lambda epochs: 1, False),
    FeatureMode("fp8 store", "store", FP8, lambda epochs: 1, False),  # fp8 rows + a float32 scale each
    FeatureMode("online", "online", None, lambda epochs: epochs, True),
)


def read_target_config(source: str) -> dict[str, Any]:
    """The text model's config.json as a dict: `source` is a config.json file, an HF folder or a
    packaged target name (a hub id is not fetched: download its config.json first)."""
    path = Path(source).expanduser()
    if path.is_dir():
        path = path / "config.json"
    elif not path.exists():
        from eagle3.target.load import PACKAGES, resolve_target  # converts a GGUF

        if source not in PACKAGES:
            raise InputError(
                f"plan target: '{source}' is neither a config.json, an HF folder with one, nor a packaged "
                f"target ({', '.join(PACKAGES)}); for a hub model download its config.json"
            )
        path = Path(resolve_target(source)) / "config.json"
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise InputError(f"plan target: cannot read {path} ({err})") from None
    text = config.get("text_config") or config  # multimodal wrappers keep the LM under text_config
    missing = [
        k for k in ("hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size") if k not in text
    ]
    if missing:
        raise InputError(f"plan target: {path} has no {', '.join(missing)} (not a language model's config)")
    return dict(text)


def target_flops_per_token(c: dict[str, Any]) -> dict[str, float]:
    """Forward matmul FLOPs per token of the target: attention projections (MLA's low-rank ones
    for DeepSeek-V3-like configs), MLPs (a MoE layer counts its active and shared experts and the
    router), the lm_head."""
    out = {part: 2.0 * n for part, n in _matmul_weights(c, all_experts=False).items()}
    return out | {"total": sum(out.values())}


def target_weight_count(c: dict[str, Any]) -> int:
    """Weights of the whole target: every matmul with all routed experts, and the embedding
    (once when tied to the lm_head); norms and biases left out (under 0.01% at Kimi's shape)."""
    matmul = sum(_matmul_weights(c, all_experts=True).values())
    return matmul + (0 if c.get("tie_word_embeddings") else c["hidden_size"] * c["vocab_size"])


def _matmul_weights(c: dict[str, Any], all_experts: bool) -> dict[str, int]:
    """Matmul weights of the target by part: those one token multiplies (all_experts False: the
    active and shared experts of a MoE layer) or all of them (the weights to hold)."""
    h, layers, heads, v = c["hidden_size"], c["num_hidden_layers"], c["num_attention_heads"], c["vocab_size"]
    if c.get("kv_lora_rank"):  # MLA (DeepSeek-V2/V3, Kimi-K2)
        qk = c["qk_nope_head_dim"] + c["qk_rope_head_dim"]
        q_rank = c.get("q_lora_rank")
        q = h * q_rank + q_rank * heads * qk if q_rank else h * heads * qk
        kv = h * (c["kv_lora_rank"] + c["qk_rope_head_dim"]) + c["kv_lora_rank"] * heads * (
            c["qk_nope_head_dim"] + c["v_head_dim"]
        )
        attention = q + kv + heads * c["v_head_dim"] * h
    else:
        hd = c.get("head_dim") or h // heads
        kv_heads = c.get("num_key_value_heads") or heads
        attention = 2 * h * heads * hd + 2 * h * kv_heads * hd
    experts = c.get("n_routed_experts") or c.get("num_local_experts") or c.get("num_experts")
    dense_mlp = 3 * h * c.get("intermediate_size", 0)
    mlp = 0
    for layer in range(layers):
        moe = (
            experts and layer >= c.get("first_k_dense_replace", 0) and layer % c.get("moe_layer_freq", 1) == 0
        )
        if moe:
            width = c.get("moe_intermediate_size") or c["intermediate_size"]
            routed = experts if all_experts else c["num_experts_per_tok"]
            mlp += (routed + (c.get("n_shared_experts") or 0)) * 3 * h * width + h * experts
        else:
            mlp += dense_mlp
    return {"attention": attention * layers, "mlp": mlp, "lm_head": h * v}


def training_steps(params: Params) -> dict[str, int]:
    """Optimizer steps as eagle3/train runs them: the held-out split of train/data.split_samples,
    full batches of train.batch_size per epoch (a last partial one dropped)."""
    p, n = params.train, params.data.num_samples
    held = min(n - 1, max(1, round(n * p.heldout_fraction)))
    train = n - held if p.max_samples is None else min(n - held, p.max_samples)
    per_epoch = max(1, train // p.batch_size)
    return {
        "train_samples": train,
        "heldout_samples": held,
        "batches_per_epoch": per_epoch,
        "epochs": p.epochs,
        "steps": per_epoch * p.epochs,
    }


def planned_memory(cfg: DrafterConfig, params: Params, world: int) -> dict[str, float]:
    """Per-device training memory (GiB) of these params: the train stage's pre-flight figure
    (eagle3.drafter.cost.training_memory) with train.dtype auto taken as on a GPU (bf16 autocast)
    and the store the extract params select."""
    dtype = DTYPES["bfloat16" if params.train.dtype == "auto" else params.train.dtype]
    top_n = params.extract.sglang_top_logprobs if store_format(params.extract) == "top_logprobs" else None
    return training_memory(cfg, params.train, world, precision_of(dtype), top_n)


def feature_modes(
    params: Params,
    target: dict[str, Any],
    feature_bytes: dict[str, int],
    tokens: int,
    world: int,
    server_tokens_per_s: float = SERVER_TOKENS_PER_S,
) -> dict[str, Any]:
    """Every FEATURE_MODES entry side by side for a run over `tokens` tokens: disk, the target's
    forwards (count, FLOPs, server-hours at `server_tokens_per_s`) and the memory each adds to a
    training process. `feature_bytes` is what one token's features take in the selected store
    format (aux rows and last_hidden or top-N, no ids or mask), by store dtype."""
    if server_tokens_per_s <= 0:
        raise InputError(f"plan: server tokens/s must be above 0 (got {server_tokens_per_s})")
    ex, tr = params.extract, params.train
    flops_per_token = target_flops_per_token(target)["total"]
    # sglang: the servers hand the aux rows over through a transport whose CPU bounds their rate
    aux_numbers = 3 * target["hidden_size"]
    ceilings = {name: transport_ceiling(name, aux_numbers) for name in SERVER_CPU_S_PER_NUMBER}
    ceiling = ceilings[ex.sglang_transport] if ex.backend == "sglang" else math.inf
    rate = min(server_tokens_per_s, ceiling)
    # each process prefetches its own rows of the global batch (train.batch_size / devices), as
    # stored (bf16; a float32 train.dtype holds them in float32), beyond the batch being trained
    rows = math.ceil(tr.batch_size / world)
    queue = params.online.prefetch_batches * rows * tr.seq_len * feature_bytes["bfloat16"]
    dtype_bytes = {"float32": 4, "float64": 8}.get(params.target.dtype, 2)  # auto: bf16 on a GPU
    in_process = ex.backend == "hf"  # sglang: the servers hold the target, not the trainer
    modes = {}
    for mode in FEATURE_MODES:
        per_token = IDS_MASK_BYTES + (feature_bytes[mode.store_dtype] if mode.store_dtype else 0)
        passes = mode.target_passes(tr.epochs)
        live = mode.computed_while_training
        modes[mode.name] = {
            "configured": mode.features == ex.features and mode.store_dtype in (None, ex.store_dtype),
            "store_dtype": mode.store_dtype,
            "computed_while_training": live,
            "disk_bytes_per_token": per_token,
            "disk_bytes": per_token * tokens,
            "target_passes": passes,
            "target_flops": passes * tokens * flops_per_token,
            "server_hours": passes * tokens / rate / 3600,
            # store: shards are memory-mapped, so the page cache holds what fits and nothing
            # waits in a queue beyond the batch being trained (its activations are counted)
            "in_flight_bytes_per_process": queue if live else 0,
            "target_weights_bytes_in_trainer": (
                target_weight_count(target) * dtype_bytes if live and in_process else 0
            ),
        }
    return {
        "configured": ex.features,
        "backend": ex.backend,
        "tokens": tokens,
        "epochs": tr.epochs,
        "feature_bytes_per_token": feature_bytes["bfloat16"],
        "feature_bytes_per_token_fp8": feature_bytes[FP8],
        "server_tokens_per_s": server_tokens_per_s,
        "transport": ex.sglang_transport if ex.backend == "sglang" else None,
        "transport_ceilings_tokens_per_s": ceilings,
        "effective_tokens_per_s": rate,
        "binds": "transport" if ceiling < server_tokens_per_s else "servers",
        "target_flops_per_token": flops_per_token,
        "prefetch": {
            "batches": params.online.prefetch_batches,
            "rows_per_process": rows,
            "seq_len": tr.seq_len,
            "world_size": world,
        },
        "modes": modes,
    }


def planned_drafter(params: Params, target: dict[str, Any]) -> DrafterConfig:
    """The drafter the train stage would build: sizes from the target, the shape from train
    params, or a warm start's own shape and draft vocabulary (its config.json only)."""
    # the EAGLE-3 drafter's layers, whichever family drafter.kind trains (dflash_plan: the other's)
    eagle3 = params.model_copy(update={"drafter": DrafterParams(kind="eagle3")})
    aux = resolve_aux_layers(eagle3, target["num_hidden_layers"])
    base = DrafterConfig.from_target_config(SimpleNamespace(**target), params.vocab.size, aux)
    if params.train.init:
        try:
            init = load_drafter_config(params.train.init)
        except (FileNotFoundError, ValueError, KeyError) as err:
            raise InputError(f"train.init: {params.train.init}: {err}") from None
        keep = (*SHAPE_KEYS, "draft_vocab_size", "fc_norm", "norm_output")
        base = replace(base, **{k: getattr(init, k) for k in keep})
    return drafter_config(base, params.train)


def by_draft_vocab_size(cfg: DrafterConfig, params: Params) -> list[dict[str, int]]:
    """The drafter's parameters at each size of vocab.coverage_grid (capped at the target's
    vocabulary), the configured size and the full vocabulary."""
    v = cfg.vocab_size
    sizes = sorted({draft_size(k, v) for k in params.vocab.coverage_grid} | {cfg.draft_vocab_size, v})
    out = []
    for k in sizes:
        sized = drafter_params(DrafterConfig(**(cfg.as_dict() | {"draft_vocab_size": k})), params.train)
        out.append(
            {
                "draft_vocab_size": k,
                "draft_lm_head": k * cfg.hidden_size,
                "trainable": sized["trainable"],
                "total": sized["total"],
            }
        )
    return out


def _notes(params: Params, cfg: DrafterConfig, target: dict[str, Any], world: int) -> list[str]:
    """Where the drafter's shape came from, a batch the devices do not divide, and how the shape
    compares with the reported Kimi-K2.5 drafter's on a Kimi-shaped target."""
    shape = {key: getattr(cfg, key) for key in SHAPE_KEYS}
    source = "derived from the target (train shape keys null)"
    if params.train.init:
        source = f"the train.init drafter's ({params.train.init}, draft vocabulary {cfg.draft_vocab_size:,})"
    elif any(getattr(params.train, k) for k in SHAPE_KEYS):
        source = "from train params"
    notes = [f"drafter shape {source}: " + ", ".join(f"{k} {shape[k]}" for k in SHAPE_KEYS)]
    if params.train.batch_size % world:
        notes.append(
            f"train.batch_size ({params.train.batch_size}) is the global batch: training refuses it unless "
            f"it is a multiple of the {world} devices"
        )
    if all(target.get(k) == val for k, val in KIMI_TARGET.items()):
        differ = [
            f"{k} {shape[k]} (reported {val})" for k, val in REPORTED_KIMI_DRAFTER.items() if shape[k] != val
        ]
        notes.append(
            f"differs from the reported Kimi-K2.5 drafter ({REPORTED}) in "
            + ", ".join(differ)
            + "; set train.num_attention_heads / num_key_value_heads / head_dim / intermediate_size to match"
            if differ
            else f"the drafter shape is the reported Kimi-K2.5 drafter's ({REPORTED})"
        )
    return notes


def _assumptions(params: Params, tokens: int | None, server_tokens_per_s: float) -> list[str]:
    return [
        "AdamW: two moments per trainable parameter in the master dtype (float32)",
        "bf16 autocast (train.dtype auto on a GPU): float32 master weights are the optimizer's, "
        "frozen embedding, the target's lm_head and teacher rows in bf16"
        if params.train.dtype not in ("float32", "float64")
        else f"train.dtype {params.train.dtype}: everything in it, no autocast",
        "DDP replicates weights, grads and optimizer on every device; FSDP shards those three",
        "activations as measured on an H200 (docs/results/2026-12-04-1750-gpu-train-loop-kimi-step.md), "
        "rounded up; "
        "0.5 GiB for the runtime",
        "tokens: " + ("--tokens" if tokens else "data.num_samples x data.max_length (an upper bound)"),
        "FLOPs: forward matmuls, 2 per multiply-add; attention over the context left out",
        f"target server throughput {server_tokens_per_s:,.0f} tokens/s (an assumption: measure yours)",
    ]


def _store(params: Params, hidden: int, tokens: int, estimated: bool) -> tuple[dict, dict[str, int]]:
    """The store section (both formats' bytes per token and in all) and one token's features in
    the selected format by store dtype (no ids or mask), for the features section."""
    top_n, selected = params.extract.sglang_top_logprobs, store_format(params.extract)
    per_token = store_bytes_per_token(hidden, top_n)
    fp8_per_token = store_bytes_per_token(hidden, top_n, FP8)
    store = {
        "tokens": tokens,
        "tokens_estimated": estimated,
        "bytes_per_token": per_token,
        "total_gib": {kind: tokens * n / GIB for kind, n in per_token.items()},
        "selected": selected,
    }
    features = {
        "bfloat16": per_token[selected] - IDS_MASK_BYTES,
        FP8: fp8_per_token[selected] - IDS_MASK_BYTES,
    }
    return store, features


def plan(
    params: Params,
    target: dict[str, Any],
    tokens: int | None = None,
    world: int | None = None,
    server_tokens_per_s: float = SERVER_TOKENS_PER_S,
) -> dict:
    """Everything `eagle3 plan` prints, as plain data (the --json output). `server_tokens_per_s`
    is the assumed throughput of one target server for the features' server-hours."""
    world = world or params.train.num_processes
    cfg = planned_drafter(params, target)
    token_count = tokens or params.data.num_samples * params.data.max_length
    store, feature_bytes = _store(params, cfg.target_hidden_size, token_count, tokens is None)
    flops_target = target_flops_per_token(target)
    flops_draft = draft_step_flops(cfg)
    return {
        "target": {
            "hidden_size": cfg.target_hidden_size,
            "num_hidden_layers": target["num_hidden_layers"],
            "vocab_size": cfg.vocab_size,
            "model_type": target.get("model_type"),
            "aux_layers": cfg.aux_layer_ids,
            "flops_per_token": flops_target,
        },
        "drafter": {
            "shape": {key: getattr(cfg, key) for key in SHAPE_KEYS},
            "draft_vocab_size": cfg.draft_vocab_size,
            "params": drafter_params(cfg, params.train),
        },
        "by_draft_vocab_size": by_draft_vocab_size(cfg, params),
        "store": store,
        "features": feature_modes(params, target, feature_bytes, token_count, world, server_tokens_per_s),
        "training": training_steps(params)
        | {"world_size": world, "memory_gib_per_device": planned_memory(cfg, params, world)},
        "flops": flops_draft
        | {
            "target_per_token": flops_target["total"],
            "draft_step_over_target": flops_draft["draft_step"] / flops_target["total"],
        },
        # the DFlash block drafter of the dflash section, beside it (eagle3/sweep/dflash_plan.py)
        "dflash": dflash_plan(params, target, world, flops_target["total"], flops_draft["draft_step"]),
        "notes": _notes(params, cfg, target, world),
        "assumptions": _assumptions(params, tokens, server_tokens_per_s),
    }
