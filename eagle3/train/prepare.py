"""Everything training needs, read and cross-checked before any expensive work.

`prepare_inputs` reads the features, the vocab mapping and the patch-check report, builds the
drafter config (sizes from the target, architecture choices from train params), refuses inputs
that do not belong together or would not fit in memory, and loads the target's embedding,
lm_head and final norm. The loop takes what it returns as given.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from torch import Tensor

from eagle3.core.inputs import InputError
from eagle3.core.params import Params, ParamsError, TrainParams
from eagle3.core.stageio import code_sha256, sha256_file, sha256_json
from eagle3.data.store import MANIFEST, FeatureStore
from eagle3.drafter.config import DrafterConfig
from eagle3.drafter.cost import training_memory
from eagle3.drafter.family import family_record
from eagle3.drafter.warm_start import InitDrafter, check_against_target, read_init_drafter
from eagle3.dtypes.policy import resolve_dtype
from eagle3.dtypes.precision import precision_of
from eagle3.dtypes.probes import Shape, Work
from eagle3.target.fingerprint import read_fingerprint
from eagle3.target.load import load_target_config, resolve_target, tokenizer_sha256
from eagle3.train.checks import check_inputs
from eagle3.train.heads import load_target_final_norm, load_target_heads
from eagle3.vocab import MAPPING, draft_size, load_mapping

# Params that do not change the trained weights (a checkpoint stays valid across them).
NOT_IN_KEY = ("checkpoint_every", "max_memory_gib")
# The code that shapes the weights (features, drafter, loop): a checkpoint written by other code
# is not resumed, or `dvc repro` after a change to it would finish the old run's drafter.
TRAINING_CODE = ("data", "drafter", "train")


@dataclass
class TrainInputs:
    store: FeatureStore
    embed: Tensor  # target input embedding [V, H]
    head: Tensor  # target lm_head [V, H]
    d2t: Tensor  # int64 [K]
    t2d: Tensor  # bool [V]
    drafter_cfg: DrafterConfig  # final: train.fc_norm / norm_output / intermediate_size applied
    run_key: str = ""  # identifies params + inputs; a checkpoint with another key is not resumed
    final_norm: Tensor | None = None  # target final norm as a Llama RMSNorm weight [H] (head_init: target)
    init: InitDrafter | None = None  # train.init: the drafter to fine-tune (checked against the target)
    features_sha256: str | None = None  # of the features' manifest: keys the cached target argmax


def precision(p: TrainParams, cfg: DrafterConfig | None = None) -> tuple[torch.dtype, bool]:
    """(master weight dtype, bf16 autocast on?) for train.dtype (auto: measured for the drafter's sizes)."""
    return precision_of(resolve_dtype(p.dtype, Work.of("train", Shape.of(cfg)) if cfg is not None else None))


SHAPE_KEYS = ("intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim")


def drafter_config(base: DrafterConfig, p: TrainParams) -> DrafterConfig:
    """`base` (sizes from the target) with the architecture choices of train params applied
    (a shape key left null keeps the target's)."""
    shape = {key: getattr(p, key) or getattr(base, key) for key in SHAPE_KEYS}
    try:
        return replace(base, **shape, fc_norm=p.fc_norm, norm_output=p.norm_output)
    except ValueError as err:  # e.g. heads not a multiple of the KV heads the target gives
        set_keys = ", ".join(f"train.{k}={getattr(p, k)}" for k in SHAPE_KEYS if getattr(p, k))
        raise ParamsError("params", [f"{set_keys or 'train'}: {err}"]) from None


def dtype_shapes(params: Params) -> dict[str, Shape]:
    """The sizes each `auto` dtype is measured at (eagle3/dtypes/decisions.py): the target's, the
    drafter layer train builds, and that layer over the draft vocabulary (the drafter's step)."""
    config = load_target_config(params.target)
    vocab = config.get_text_config().vocab_size  # Kimi-K2.5 nests it
    aux = [0, 1, 2]  # the drafter layer's sizes do not depend on which layers feed it
    base = DrafterConfig.from_target_config(config, draft_size(params.vocab.size, vocab), aux)
    drafter = drafter_config(base, params.train)
    return {
        "target": Shape.of(config),
        "drafter": Shape.of(drafter),
        "draft": Shape.of(drafter, drafter.draft_vocab_size),
    }


def check_memory(
    cfg: DrafterConfig, p: TrainParams, precision: tuple[torch.dtype, bool], stored_topk: int | None = None
) -> float:
    """The per-device peak `eagle3 plan` plans for these params (eagle3.drafter.cost), refused
    above train.max_memory_gib. `precision`: precision(p, cfg)."""
    gib = training_memory(cfg, p, p.num_processes, precision, stored_topk)["total_ddp"]
    if gib > p.max_memory_gib:
        raise ValueError(
            f"train: estimated peak memory {gib:.1f} GiB per device for a draft vocabulary of "
            f"{cfg.draft_vocab_size:,} (batch_size {p.batch_size} over {p.num_processes} device(s) x seq_len "
            f"{p.seq_len}, ttt_length {p.ttt_length}) exceeds train.max_memory_gib={p.max_memory_gib}; lower "
            "vocab.size, train.batch_size or train.seq_len, or raise train.max_memory_gib"
        )
    return gib


def check_target_topk(p: TrainParams, stored_topk: int | None) -> None:
    """A top-N store cannot give more of the target's distribution than the N it holds."""
    if stored_topk and (p.target_topk or 0) > stored_topk:
        raise ValueError(
            f"train.target_topk is {p.target_topk}, but the feature store holds the target's top "
            f"{stored_topk} only (extract.sglang_top_logprobs): set train.target_topk <= "
            f"{stored_topk}, or null to use all of them"
        )


def run_key(
    p: TrainParams,
    cfg: DrafterConfig,
    features_sha256: str,
    mapping_sha256: str,
    init_sha256: str | None = None,
) -> str:
    """The identity of a training run: the params that shape the weights, the config, the inputs."""
    train = {k: v for k, v in p.model_dump().items() if k not in NOT_IN_KEY}
    material = {
        "train": train,
        "cfg": cfg.as_dict(),
        "features": features_sha256,
        "mapping": mapping_sha256,
        "code": training_code_sha256(),
    }
    if init_sha256 is not None:  # the warm-start drafter's files, not only its path
        material["init"] = init_sha256
    return sha256_json(material)


@functools.cache
def training_code_sha256() -> str:
    """One digest of the training code's .py files (their paths in the package and bytes)."""
    return code_sha256(Path(__file__).resolve().parents[1], TRAINING_CODE)


def warm_start_config(init: InitDrafter, base: DrafterConfig, p: TrainParams) -> DrafterConfig:
    """The drafter config of a warm start: the init drafter's shape on the target's sizes, after
    refusing (one line each, both values named) what makes it another target's drafter and train
    params that ask for another shape than it has."""
    check_against_target(init, base.target_hidden_size, base.vocab_size, base.aux_layer_ids, rope=base)
    have = init.cfg
    asked = {k: getattr(p, k) for k in SHAPE_KEYS if getattr(p, k) is not None}
    asked |= {"fc_norm": p.fc_norm, "norm_output": p.norm_output}
    differ = [
        f"train.{k} is {v} but the drafter has {getattr(have, k)}"
        for k, v in asked.items()
        if v != getattr(have, k)
    ]
    if differ:
        raise ParamsError(
            "params", [f"train.init {init.folder}: " + "; ".join(differ) + " (leave the shape keys null)"]
        )
    shape = {k: getattr(have, k) for k in SHAPE_KEYS}
    return replace(
        base, **shape, rms_norm_eps=have.rms_norm_eps, fc_norm=have.fc_norm, norm_output=have.norm_output
    )


def check_adopted_mapping(init: InitDrafter, d2t: Tensor, t2d: Tensor, meta: dict) -> None:
    """The vocab-map output must be this drafter's own mapping, adopted from these very files."""
    rerun = "re-run the vocab-map stage (dvc repro -f vocab-map)"
    if meta.get("init_sha256") != init.sha256:
        raise InputError(
            f"the vocab mapping (artifacts/vocab-map) was not adopted from the train.init drafter "
            f"{init.folder} as it is now (vocab.json init_sha256 {str(meta.get('init_sha256'))[:12]}, "
            f"the folder {init.sha256[:12]}); {rerun}"
        )
    if not (torch.equal(d2t, init.d2t) and torch.equal(t2d, init.t2d)):
        raise InputError(f"the vocab mapping differs from the train.init drafter's d2t/t2d; {rerun}")


def _require(paths: dict[Path, str]) -> None:
    for path, stage in paths.items():
        if not path.exists():
            raise FileNotFoundError(f"{path} is missing: run the {stage} stage first")


def prepare_inputs(params: Params, features: Path, mapping: Path, report: Path) -> TrainInputs:
    """Read and cross-check every input (the extract, vocab-map and patch-check outputs)."""
    _require({report: "patch-check", features / MANIFEST: "extract", mapping: "vocab-map"})
    report_fp = read_fingerprint(report)
    store = FeatureStore(features)  # refuses an edited manifest
    d2t, t2d, meta = load_mapping(mapping)  # refuses a damaged or mismatched mapping file
    if meta.get("drafter_kind", "eagle3") != "eagle3":
        raise InputError(
            f"the vocab mapping (artifacts/vocab-map) was made for a {meta['drafter_kind']} drafter (the "
            "whole vocabulary): re-run the vocab-map stage with drafter.kind: eagle3 (dvc repro vocab-map)"
        )
    target_config = load_target_config(params.target)
    base = DrafterConfig.from_target_config(target_config, len(d2t), store.aux_layers)
    init = read_init_drafter(params.train.init, target_config) if params.train.init else None
    if init is not None:  # warm start: checked against the target, then its shape
        base = warm_start_config(init, base, params.train)
        check_adopted_mapping(init, d2t, t2d, meta)
    cfg = drafter_config(base, params.train)
    features_sha256 = sha256_file(features / MANIFEST)
    folder = Path(resolve_target(params.target.source))  # a hub id has no local tokenizer to check
    check_inputs(
        report_fp,
        store.fingerprint,
        store.aux_layers,
        meta,
        d2t,
        t2d,
        cfg,
        features_sha256=features_sha256,
        family=family_record(params),
        target_tokenizer_sha256=tokenizer_sha256(folder) if folder.is_dir() else None,
    )
    check_target_topk(params.train, store.target_topk)
    master, autocast = precision(params.train, cfg)
    check_memory(cfg, params.train, (master, autocast), store.target_topk)
    store.verify()  # every shard and the token file against the manifest's sha256
    embed, head = load_target_heads(params.target.source, torch.bfloat16 if autocast else master)
    norm = load_target_final_norm(params.target.source, master)
    key = run_key(params.train, cfg, features_sha256, sha256_file(mapping / MAPPING), init and init.sha256)
    return TrainInputs(store, embed, head, d2t, t2d, cfg, key, norm, init, features_sha256)
