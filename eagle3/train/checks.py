"""Refuse inputs that do not belong together, before any expensive work.

The features, the vocab mapping and the patch-check report each carry the fingerprint of the
target they were made with; training a drafter across two targets or two tokenizers would
give a model that silently never accepts anything.
"""

from __future__ import annotations

import torch

from eagle3.drafter.config import DrafterConfig


def _mismatch(what: str, key: str, got: object, expected: object, fix: str) -> ValueError:
    return ValueError(f"{what}: {key} is {got!r} but the target has {expected!r}; {fix}")


def check_inputs(
    report_fp: dict,
    features_fp: dict,
    features_aux: list[int],
    mapping_meta: dict,
    d2t: torch.Tensor,
    t2d: torch.Tensor,
    cfg: DrafterConfig,
) -> None:
    """Raise ValueError naming the first input made for another target / tokenizer."""
    rerun_extract = "re-run the extract stage for this target (dvc repro extract)"
    for key in ("target_sha256", "tokenizer_sha256", "num_layers", "hidden_size", "vocab_size"):
        if key in report_fp and features_fp.get(key) != report_fp[key]:
            raise _mismatch(
                "features (artifacts/extract) come from another target",
                key,
                features_fp.get(key),
                report_fp[key],
                rerun_extract,
            )
    if sorted(features_aux) != sorted(report_fp.get("aux_layers", features_aux)):
        raise _mismatch(
            "features (artifacts/extract)", "aux_layers", features_aux, report_fp["aux_layers"], rerun_extract
        )
    if features_fp.get("hidden_size", cfg.target_hidden_size) != cfg.target_hidden_size:
        raise _mismatch(
            "features (artifacts/extract)",
            "hidden_size",
            features_fp.get("hidden_size"),
            cfg.target_hidden_size,
            rerun_extract,
        )
    rerun_vocab = "re-run the vocab-map stage on this target's features (dvc repro vocab-map)"
    tok = mapping_meta.get("tokenizer_sha256")
    if tok is not None and tok != report_fp.get("tokenizer_sha256", tok):
        raise _mismatch(
            "the vocab mapping (artifacts/vocab-map) was built with another tokenizer",
            "tokenizer_sha256",
            tok,
            report_fp["tokenizer_sha256"],
            rerun_vocab,
        )
    size = mapping_meta.get("target_vocab_size", len(t2d))
    if size != cfg.vocab_size or len(t2d) != cfg.vocab_size:
        raise _mismatch(
            "the vocab mapping (artifacts/vocab-map)", "target_vocab_size", size, cfg.vocab_size, rerun_vocab
        )
    if len(d2t) != cfg.draft_vocab_size or int(t2d.sum()) != len(d2t):
        raise ValueError(
            f"the vocab mapping is inconsistent: d2t has {len(d2t)} entries, t2d marks {int(t2d.sum())}; "
            + rerun_vocab
        )
    targets = torch.arange(len(d2t)) + d2t
    if int(targets.min()) < 0 or int(targets.max()) >= cfg.vocab_size or not bool(t2d[targets].all()):
        raise ValueError("the vocab mapping is inconsistent: d2t points outside t2d; " + rerun_vocab)
