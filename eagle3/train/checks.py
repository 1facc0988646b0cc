"""Refuse inputs that do not belong together, before any expensive work.

The features, the vocab mapping and the patch-check report each carry the fingerprint of the
target they were made with; training a drafter across two targets or two tokenizers would
give a model that silently never accepts anything. The vocab mapping also records the features
it was counted from and its drafter family's params (eagle3/drafter/family.py), so a mapping
copied from another run is refused too.
"""

from __future__ import annotations

import torch

from eagle3.core.inputs import InputError
from eagle3.drafter.config import DrafterConfig
from eagle3.drafter.family import record_mismatch
from eagle3.target.fingerprint import Fingerprint
from eagle3.vocab import draft_to_target_ids


def _mismatch(what: str, key: str, got: object, expected: object, fix: str) -> InputError:
    return InputError(f"{what}: {key} is {got!r} but the target has {expected!r}; {fix}")


def check_inputs(
    report_fp: Fingerprint,
    features_fp: Fingerprint,
    features_aux: list[int],
    mapping_meta: dict,
    d2t: torch.Tensor,
    t2d: torch.Tensor,
    cfg: DrafterConfig,
    features_sha256: str | None = None,
    family: dict | None = None,
    target_tokenizer_sha256: str | None = None,
) -> None:
    """Raise InputError naming the first input made for another target / tokenizer / run.

    `features_sha256` (of the features' manifest.json) and `family` (family_record of the params)
    are checked against what the mapping recorded; `target_tokenizer_sha256` is the tokenizer of
    the target as it is now, checked against the one the features were made with."""
    _check_features(report_fp, features_fp, features_aux, cfg, target_tokenizer_sha256)
    _check_mapping(report_fp, mapping_meta, d2t, t2d, cfg, features_sha256, family)


def _check_features(
    report_fp: Fingerprint,
    features_fp: Fingerprint,
    features_aux: list[int],
    cfg: DrafterConfig,
    target_tokenizer_sha256: str | None,
) -> None:
    """The features against the patch-check report's target, the tokenizer as it is now and the
    drafter's hidden size."""
    rerun_extract = "re-run the extract stage for this target (dvc repro extract)"
    tok_now, tok_features = target_tokenizer_sha256, features_fp.tokenizer_sha256
    if tok_now is not None and tok_now != tok_features:
        raise InputError(
            "the target's tokenizer files changed since the features (artifacts/extract) were made "
            f"(tokenizer_sha256 {tok_now[:12]}... now, {tok_features[:12]}... then); re-run patch-check "
            "and everything after it (dvc repro --force --downstream patch-check)"
        )
    for key in ("target_sha256", "tokenizer_sha256", "num_layers", "hidden_size", "vocab_size"):
        if getattr(features_fp, key) != getattr(report_fp, key):
            raise _mismatch(
                "features (artifacts/extract) come from another target",
                key,
                getattr(features_fp, key),
                getattr(report_fp, key),
                rerun_extract,
            )
    if sorted(features_aux) != sorted(report_fp.aux_layers):
        raise _mismatch(
            "features (artifacts/extract)",
            "aux_layers",
            features_aux,
            list(report_fp.aux_layers),
            rerun_extract,
        )
    if features_fp.hidden_size != cfg.target_hidden_size:
        raise _mismatch(
            "features (artifacts/extract)",
            "hidden_size",
            features_fp.hidden_size,
            cfg.target_hidden_size,
            rerun_extract,
        )


def _check_mapping(
    report_fp: Fingerprint,
    mapping_meta: dict,
    d2t: torch.Tensor,
    t2d: torch.Tensor,
    cfg: DrafterConfig,
    features_sha256: str | None,
    family: dict | None,
) -> None:
    """The vocab mapping against the features it was counted from, the family's params, the
    target's tokenizer and vocabulary, and itself (d2t and t2d agree)."""
    rerun_vocab = "re-run the vocab-map stage on this target's features (dvc repro vocab-map)"
    made_from = mapping_meta.get("features_manifest_sha256")
    if features_sha256 is not None and made_from is not None and made_from != features_sha256:
        raise InputError(
            "the vocab mapping (artifacts/vocab-map/vocab.json) was counted from other features than "
            f"artifacts/extract/manifest.json (another run's?); {rerun_vocab}"
        )
    if family is not None and (why := record_mismatch(mapping_meta, family)):
        raise InputError(
            f"the vocab mapping (artifacts/vocab-map/vocab.json) was built for {why} (another run's?); "
            + rerun_vocab
        )
    tok = mapping_meta.get("tokenizer_sha256")
    if tok is not None and tok != report_fp.tokenizer_sha256:
        raise _mismatch(
            "the vocab mapping (artifacts/vocab-map) was built with another tokenizer",
            "tokenizer_sha256",
            tok,
            report_fp.tokenizer_sha256,
            rerun_vocab,
        )
    size = mapping_meta.get("target_vocab_size", len(t2d))
    if size != cfg.vocab_size or len(t2d) != cfg.vocab_size:
        raise _mismatch(
            "the vocab mapping (artifacts/vocab-map)", "target_vocab_size", size, cfg.vocab_size, rerun_vocab
        )
    if len(d2t) != cfg.draft_vocab_size or int(t2d.sum()) != len(d2t):
        raise InputError(
            f"the vocab mapping is inconsistent: d2t has {len(d2t)} entries, t2d marks {int(t2d.sum())}; "
            + rerun_vocab
        )
    targets = draft_to_target_ids(d2t)
    if int(targets.min()) < 0 or int(targets.max()) >= cfg.vocab_size or not bool(t2d[targets].all()):
        raise InputError("the vocab mapping is inconsistent: d2t points outside t2d; " + rerun_vocab)
