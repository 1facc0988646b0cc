"""Stage vocab-map: the draft vocabulary (d2t/t2d) from loss-masked token counts, plus the coverage curve.

A DFlash drafter (drafter.kind dflash) drafts through the target's own lm_head: its mapping is the
whole vocabulary whatever vocab.size says, written with the same bytes for every vocab.size, so
that DVC finds train's input unchanged. vocab.json records the family's params train depends on
(eagle3/drafter/family.py): train lists none of the family keys and checks this record instead."""

from __future__ import annotations

import hashlib

from eagle3.core.pipeline import COVERAGE_PLOT, FEATURES, VOCAB_MAP, metrics_path
from eagle3.core.stage_commit import staged_outputs
from eagle3.core.stageio import write_csv, write_json
from eagle3.core.tracking import pipeline_run
from eagle3.data.store import MANIFEST, FeatureStore
from eagle3.drafter.family import family_record
from eagle3.drafter.warm_start import adopt_vocab_map, read_init_drafter
from eagle3.target.load import load_target_config
from eagle3.vocab import build_vocab_map, count_tokens, coverage_curve, save_vocab_map
from stages.common import console, reported_failures, validated_params


def main() -> None:
    params = validated_params()
    # staged_outputs: all outputs replaced together at the end, none when the stage fails
    with reported_failures("vocab-map"), staged_outputs("vocab-map") as staged:
        store = FeatureStore(FEATURES)  # refuses an edited manifest
        tokens = store.tokens()  # refuses a token file that differs from the manifest
        fp = store.fingerprint
        counts = count_tokens(tokens["input_ids"].numpy(), tokens["loss_mask"].numpy(), fp.vocab_size)
        init = None
        dflash = params.drafter.kind == "dflash"
        if params.train.init:  # its aux ids read by the target family's rule
            init = read_init_drafter(params.train.init, load_target_config(params.target))
        if dflash:  # the target's whole vocabulary: its own lm_head
            vocab = build_vocab_map(counts, fp.vocab_size)
        elif init is None:
            vocab = build_vocab_map(counts, params.vocab.size)
        else:  # warm start: the drafter's own draft vocabulary (part of its weights)
            vocab = adopt_vocab_map(init, counts, fp.hidden_size, store.aux_layers, params.vocab.size)
        coverage = vocab.coverage()
        metrics = {
            "draft_vocab_size": vocab.draft_size,
            "target_vocab_size": fp.vocab_size,
            "coverage": round(coverage, 6),
            "lm_head_params": vocab.draft_size * fp.hidden_size,
            "distinct_tokens_seen": vocab.distinct_seen,
            "unseen_tokens_filled": vocab.unseen_filled,
        }
        if init is not None:  # the adopted mapping against one counted from this run's tokens
            own = build_vocab_map(counts, vocab.draft_size).coverage()
            metrics |= {
                "init_mapping_coverage": round(coverage, 6),
                "counted_mapping_coverage": round(own, 6),
            }
        meta = metrics | {
            "tokenizer_sha256": fp.tokenizer_sha256,
            "target_sha256": fp.target_sha256,
            # what train checks, so a mapping of another run or another vocab.size is refused
            "features_manifest_sha256": hashlib.sha256((FEATURES / MANIFEST).read_bytes()).hexdigest(),
        }
        # the family's keys train depends on (and not the other family's): train checks them
        meta |= family_record(params)
        if init is not None:  # train refuses a mapping adopted from another version of the folder
            meta |= {"init": init.folder, "init_sha256": init.sha256}
        save_vocab_map(vocab, staged.path(VOCAB_MAP), meta)
        curve = coverage_curve(counts, params.vocab.coverage_grid + [vocab.draft_size])
        rows = [list(p) for p in curve]
        write_csv(staged.path(COVERAGE_PLOT), ["draft_vocab_size", "coverage"], rows)
        write_json(staged.path(metrics_path("vocab-map")), metrics)
        with pipeline_run(params, "vocab-map") as run:
            run.log_metrics(metrics)
    if vocab.unseen_filled and params.drafter.kind != "dflash":
        console.print(
            f"[yellow]only {vocab.distinct_seen} distinct tokens seen; "
            f"{vocab.unseen_filled} draft slots filled with unseen tokens (lowest ids)"
        )
    whole = " (a DFlash drafter's: the target's lm_head)" if params.drafter.kind == "dflash" else ""
    console.print(f"draft vocab {vocab.draft_size:,} of {fp.vocab_size:,}{whole}: coverage {coverage:.4f}")
    if init is not None:
        console.print(
            f"adopted from train.init {init.folder}: coverage {coverage:.4f} of this run's tokens, against "
            f"{metrics['counted_mapping_coverage']:.4f} for a mapping counted from them at the same size"
        )


if __name__ == "__main__":
    main()
