"""Training a DFlash drafter: its inputs read and checked, and the recipe of train/loop.py with the
block-wise loss (train/dflash.py) in place of the TTT unroll.

The recipe keeps everything of `TrainRecipe` that is no EAGLE-3 matter: the held-out split, the
length-bucketed batches (stored or online features), AdamW with warm-up and cosine decay, DDP,
exact resumption from checkpoints. What differs: the model (the drafter beside the target's frozen
embedding and lm_head), the step (every block of the batch in one forward), the per-position
figures (block positions 1..block_size-1 in place of TTT steps) and the held-out acceptance (the
leading run of a block's drafts that equal the target's argmax, plus the bonus token).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import closing
from pathlib import Path
from typing import Any

import torch
from transformers import AutoTokenizer

from eagle3.core.inputs import InputError
from eagle3.core.params import Params, TrainParams, resolve_aux_layers
from eagle3.core.stageio import sha256_file, sha256_json
from eagle3.data.store import MANIFEST, FeatureStore
from eagle3.drafter.dflash import DFlashConfig, DFlashDrafter, resolve_mask_token
from eagle3.drafter.dflash_cost import dflash_train_flops_per_token, dflash_training_memory
from eagle3.drafter.family import family_record
from eagle3.target.fingerprint import read_fingerprint
from eagle3.target.load import load_target_config, resolve_target, tokenizer_sha256
from eagle3.train.checks import check_inputs
from eagle3.train.data import Batch, BatchSource, StoredFeatures, sample_lengths, split_samples
from eagle3.train.dflash import BlockModel, batch_anchors
from eagle3.train.distributed import all_reduce
from eagle3.train.heads import load_target_heads
from eagle3.train.loop import (
    TrainOutcome,
    TrainRecipe,
    _Accumulator,
    _all_reduced,
    _curve_row,
    _to_device,
)
from eagle3.train.online import OnlineSource, prefetched
from eagle3.train.prepare import (
    NOT_IN_KEY,
    SHAPE_KEYS,
    TrainInputs,
    _require,
    precision,
    training_code_sha256,
)
from eagle3.train.ttt import acceptance_length
from eagle3.vocab import load_mapping

HELDOUT_EPOCH = -1  # the anchors' epoch for held-out evaluation: the same blocks every epoch


def dflash_config(params: Params, target_config: Any, target_layers: list[int]) -> DFlashConfig:
    """The drafter's config: the target's sizes, dflash params, train.* shape keys and the mask token."""
    folder = resolve_target(params.target.source)
    tokenizer = AutoTokenizer.from_pretrained(folder, trust_remote_code=params.target.trust_remote_code)
    vocab = (getattr(target_config, "text_config", None) or target_config).vocab_size
    mask_id, mask_text = resolve_mask_token(tokenizer, vocab, params.dflash.mask_token_id)
    d = params.dflash
    shape = {key: getattr(params.train, key) for key in SHAPE_KEYS}
    try:
        return DFlashConfig.from_target_config(
            target_config, d.num_layers, d.block_size, target_layers, mask_id, mask_text, shape
        )
    except ValueError as err:  # e.g. heads not a multiple of the KV heads the target gives
        raise InputError(f"dflash / train shape keys: {err}") from None


def check_memory(
    cfg: DFlashConfig, params: Params, precision: tuple[torch.dtype, bool], topk: int | None
) -> float:
    """The per-device peak `eagle3 plan` plans for (eagle3/drafter/dflash_cost.py), refused above
    train.max_memory_gib."""
    p = params.train
    gib = dflash_training_memory(cfg, p, params.dflash.anchors, p.num_processes, precision, topk)["total_ddp"]
    if gib > p.max_memory_gib:
        raise ValueError(
            f"train: estimated peak memory {gib:.1f} GiB per device for a DFlash drafter "
            f"(batch_size {p.batch_size} over {p.num_processes} device(s), dflash.anchors "
            f"{params.dflash.anchors} x block_size {cfg.block_size}, a vocabulary of {cfg.vocab_size:,}) "
            f"exceeds train.max_memory_gib={p.max_memory_gib}; lower dflash.anchors or train.batch_size, "
            "or raise train.max_memory_gib"
        )
    return gib


def prepare_dflash_inputs(params: Params, features: Path, mapping: Path, report: Path) -> TrainInputs:
    """Read and cross-check every input (the extract, vocab-map and patch-check outputs) for a
    DFlash drafter; the vocab mapping must be vocab-map's DFlash one: the whole vocabulary."""
    _require({report: "patch-check", features / MANIFEST: "extract", mapping: "vocab-map"})
    report_fp = read_fingerprint(report)
    store = FeatureStore(features)
    d2t, t2d, meta = load_mapping(mapping)
    if meta.get("drafter_kind") != "dflash" or not bool(t2d.all()):
        raise InputError(
            f"the vocab mapping (artifacts/vocab-map) is a draft vocabulary of {len(d2t):,} tokens (an "
            "EAGLE-3 drafter's), and a DFlash drafter drafts from the target's whole vocabulary: re-run "
            "the vocab-map stage with drafter.kind: dflash (dvc repro vocab-map)"
        )
    target_config = load_target_config(params.target)
    text = getattr(target_config, "text_config", None) or target_config
    wanted = resolve_aux_layers(params, text.num_hidden_layers)
    if sorted(store.aux_layers) != wanted:
        raise InputError(
            f"the features (artifacts/extract) hold target layers {store.aux_layers}, and the DFlash drafter "
            f"reads {wanted} (dflash.target_layers / dflash.num_layers): re-run patch-check and extract "
            "(dvc repro extract)"
        )
    cfg = dflash_config(params, target_config, wanted)
    features_sha256 = sha256_file(features / MANIFEST)
    folder = Path(resolve_target(params.target.source))
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
    master, autocast = precision(params.train, cfg)
    check_memory(cfg, params, (master, autocast), store.target_topk)
    store.verify()
    embed, head = load_target_heads(params.target.source, torch.bfloat16 if autocast else master)
    train = {k: v for k, v in params.train.model_dump().items() if k not in NOT_IN_KEY}
    material = {
        "train": train,
        "dflash": params.dflash.model_dump(),
        "cfg": cfg.as_dict(),
        "features": features_sha256,
        "mapping": meta.get("features_manifest_sha256"),
        "code": training_code_sha256(),
    }
    return TrainInputs(store, embed, head, d2t, t2d, cfg, sha256_json(material), None, None, features_sha256)


class DFlashRecipe(TrainRecipe):
    """`TrainRecipe` with the DFlash drafter and its block-wise loss (module doc)."""

    def __init__(
        self,
        p: TrainParams,
        inputs: TrainInputs,
        anchors: int,
        loss_decay: float | None,
        checkpoint_dir: Path | None = None,
        online: OnlineSource | None = None,
    ):
        self.anchors, self.loss_decay = anchors, loss_decay
        super().__init__(p, inputs, checkpoint_dir, online)

    @property
    def positions(self) -> int:
        return self.cfg.block_size - 1

    def _check_config(self) -> None:
        if not isinstance(self.cfg, DFlashConfig):
            raise ValueError("a DFlash recipe needs a DFlashConfig (prepare_dflash_inputs builds it)")

    def _flops_per_token(self) -> float:
        src = self.train_src
        blocks = sum(min(self.anchors, n) for n in src.lengths.values()) / max(src.num_tokens, 1)
        return dflash_train_flops_per_token(self.cfg, blocks)

    def _setup_data(self, heldout_only: bool = False) -> None:
        p, store = self.p, self.inputs.store
        train_ids, held_ids = split_samples(len(store), p.heldout_fraction, p.seed)
        if p.max_samples is not None:
            train_ids = train_ids[: p.max_samples]
        if store.online:
            reader = self.online.features
        else:  # every target token is a drafter token: no argmax pass over the store
            lengths = sample_lengths(store)
            in_draft = {s: torch.ones(lengths[s], dtype=torch.bool) for s in train_ids + held_ids}
            reader = StoredFeatures(store, in_draft)
        lengths = sample_lengths(store)
        self.train_src = BatchSource(reader, train_ids, lengths, p.seq_len)
        self.held_src = BatchSource(reader, held_ids, lengths, p.seq_len)

    def _setup_model(self) -> None:
        inputs = self.inputs
        compute = torch.bfloat16 if self.autocast else self.master
        self.drafter = DFlashDrafter(self.cfg).to(self.master)
        self.model = BlockModel(
            self.drafter, inputs.embed.to(compute), inputs.head.to(compute), self.loss_decay
        )
        self.model = self.model.to(self.device)
        self.ddp_model = self.model
        if self.dist.world > 1:
            self.ddp_model = torch.nn.parallel.DistributedDataParallel(
                self.model,
                device_ids=[self.device.index] if self.device.type == "cuda" else None,
                broadcast_buffers=False,
            )

    def _batches(self, source: BatchSource, rows: Sequence[list[int]]) -> Iterator[tuple[list[int], Batch]]:
        """(sample ids, batch) of these rows, in order: the ids draw the rows' anchors."""
        dtype = None if self.autocast else self.master

        def make(samples: list[int]) -> tuple[list[int], Batch]:
            return samples, source.batch(samples, dtype)

        if self.online is not None:
            return prefetched(make, rows, self.online.prefetch_batches)
        return (make(r) for r in rows)

    def _train_step(self, item: tuple[list[int], Batch]) -> dict:
        samples, batch = item
        d = self.dist
        batch = _to_device(batch, self.device)
        anchors, keep = batch_anchors(batch, samples, self.anchors, self.p.seed, self.epoch)
        self.model.train()
        with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.autocast):
            *_, valid = self.model.label_rows(batch, anchors, keep)
            local = self.model.weights[valid.nonzero(as_tuple=True)[2]].sum().double().reshape(1)
            norm = all_reduce(local, d).to(self.device)[0]
            loss, stats = self.ddp_model(batch, anchors, keep, norm)
        (loss * d.world).backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(self.params, self.p.grad_clip)
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.step += 1
        summed, tokens = _all_reduced(stats, batch.num_tokens, d, self.device)
        self.epoch_sums.add(summed)
        self._tokens_seen += tokens
        return _curve_row(self.step, self.epoch, self.scheduler.get_last_lr()[0], summed, float(grad_norm))

    @torch.no_grad()
    def evaluate(self) -> dict:
        """Held-out loss/accuracy per block position and the simulated acceptance length of a block
        (the same anchors every epoch)."""
        source = self.held_src
        acc = _Accumulator(self.positions)
        lengths = []
        with closing(self._batches(source, source.fixed_batches(self.p.batch_size))) as ahead:
            for samples, batch in ahead:
                batch = _to_device(batch, self.device)
                anchors, keep = batch_anchors(batch, samples, self.anchors, self.p.seed, HELDOUT_EPOCH)
                with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.autocast):
                    _, stats, hits = self.model(batch, anchors, keep, chains=True)
                acc.add(stats)
                if len(hits):
                    lengths.append(acceptance_length(hits).cpu())
        out = acc.summary()
        alen = torch.cat(lengths).double() if lengths else torch.ones(1, dtype=torch.float64)
        out["acceptance_length"] = float(alen.mean())
        out["sim_acceptance"] = {f"block {self.cfg.block_size}": out["acceptance_length"]}
        out["chain_survival"] = [float((alen > k + 1).double().mean()) for k in range(self.positions)]
        return out

    def check_init(self) -> dict:
        raise InputError("train.init: a DFlash drafter trains from scratch")

    def _outcome(self) -> TrainOutcome:
        outcome = super()._outcome()
        outcome.metrics["anchors"] = self.anchors
        return outcome


def train_dflash(
    params: Params,
    inputs: TrainInputs,
    checkpoint_dir: Path | None = None,
    on_step: Callable[[dict], None] | None = None,
    on_epoch: Callable[[dict], None] | None = None,
    online: OnlineSource | None = None,
) -> TrainOutcome | None:
    """Set up and run a DFlash recipe: the outcome on rank 0, None on the other ranks."""
    d = params.dflash
    recipe = DFlashRecipe(params.train, inputs, d.anchors, d.loss_decay, checkpoint_dir, online)
    recipe.setup()
    return recipe.train(on_step, on_epoch)
