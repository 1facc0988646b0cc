"""Warm start (train.init): an exported drafter, read and checked against this run's target.

A drafter folder in the SGLang/EAGLE layout (config.json + model.safetensors, as export.py writes
and published EAGLE-3 drafters ship) is fine-tuned instead of trained from scratch. Its draft
vocabulary is part of its weights (lm_head rows follow d2t), so vocab-map adopts its d2t/t2d
rather than counting one, and a vocab.size that differs is refused. What makes a drafter belong
to another model is refused before any training, one line per mismatch naming both values: the
hidden size fc and the embedding read, the aux layer ids its fc was trained on, the target
vocabulary its t2d and embedding index, and the RoPE it rotates with. What no config can say
(trained on another model of the same shape, or on other data) the train stage measures before
training: held-out top-1 and simulated acceptance of the drafter as it is (train/loop.py).

`sha256` digests config.json and model.safetensors: vocab-map records it and train refuses a
mapping adopted from another version of the folder (DVC tracks `train.init` as a param, not the
folder's files, see dvc.yaml).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from safetensors import SafetensorError
from safetensors.torch import load_file
from torch import Tensor

from eagle3.core.inputs import InputError
from eagle3.core.stageio import sha256_files
from eagle3.drafter.config import DrafterConfig
from eagle3.drafter.export import CONFIG, EMBED, WEIGHTS
from eagle3.vocab import VocabMap, adopted_vocab_map, draft_size

MAPPING_KEYS = ("d2t", "t2d")


@dataclass(frozen=True)
class InitDrafter:
    folder: str
    cfg: DrafterConfig
    tensors: dict[str, Tensor]  # model.safetensors as stored
    sha256: str  # config.json + model.safetensors
    recorded: dict[str, Any]  # metrics.json of a shipped drafter (eagle3 ship), else {}

    @property
    def d2t(self) -> Tensor:
        return self.tensors["d2t"].long()

    @property
    def t2d(self) -> Tensor:
        return self.tensors["t2d"].bool()

    def weights(self) -> dict[str, Tensor]:
        """The trained tensors to load into a fresh drafter (no mapping, no embedding)."""
        return {k: v for k, v in self.tensors.items() if k not in (*MAPPING_KEYS, EMBED)}


EXPECTED = (
    f"expected an exported drafter folder with {CONFIG} and {WEIGHTS}, e.g. drafters/<name>, "
    "or null to train from scratch"
)


def _contents(folder: str, path: Path, shown: int = 5) -> str:
    """What a folder that is not a drafter holds, for the refusal: the drafter folders directly
    in it first (train.init naming their parent, drafters/, say), else its first entries."""
    entries = sorted(path.iterdir())
    drafters = [e for e in entries if e.is_dir() and all((e / n).is_file() for n in (CONFIG, WEIGHTS))]
    if drafters:
        return "the drafters in it: " + ", ".join(f"{folder.rstrip('/')}/{e.name}" for e in drafters[:shown])
    if not entries:
        return "it is empty"
    names = [e.name + ("/" if e.is_dir() else "") for e in entries[:shown]]
    more = f" and {len(entries) - shown} more" if len(entries) > shown else ""
    return "it holds " + ", ".join(names) + more


def read_init_drafter(folder: str, target_config: Any = None) -> InitDrafter:
    """The drafter at `folder` (train.init); InputError when it is missing or not a drafter. Its
    aux layer ids are read as SGLang reads them for `target_config`'s family (DeepSeek/Kimi ids
    differ from Llama's), so a drafter exported elsewhere, which records no family, reads right."""
    path = Path(folder).expanduser()
    if not path.exists():
        raise InputError(f"train.init: {folder} does not exist ({EXPECTED})")
    if not path.is_dir():
        raise InputError(f"train.init: {folder} is a file, not a folder ({EXPECTED})")
    missing = [name for name in (CONFIG, WEIGHTS) if not (path / name).is_file()]
    if missing:
        raise InputError(
            f"train.init: {folder} is a folder without {' and '.join(missing)}, not an exported "
            f"drafter ({EXPECTED}); {_contents(folder, path)}"
        )
    try:
        cfg = DrafterConfig.from_hf_dict(json.loads((path / CONFIG).read_text()), target_config)
    except (ValueError, KeyError, TypeError) as err:
        raise InputError(
            f"train.init: {folder}/{CONFIG} is not an EAGLE-3 drafter's config ({err})"
        ) from None
    try:
        tensors = load_file(str(path / WEIGHTS))
    except (SafetensorError, OSError) as err:
        raise InputError(f"train.init: {folder}/{WEIGHTS} is unreadable ({err})") from None
    absent = [k for k in (*MAPPING_KEYS, "fc.weight", "lm_head.weight") if k not in tensors]
    if absent:
        raise InputError(
            f"train.init: {folder}/{WEIGHTS} has no {', '.join(absent)} (not an EAGLE-3 drafter)"
        )
    d2t, t2d = tensors["d2t"], tensors["t2d"]
    if tuple(d2t.shape) != (cfg.draft_vocab_size,) or tuple(t2d.shape) != (cfg.vocab_size,):
        raise InputError(
            f"train.init: {folder}: d2t {tuple(d2t.shape)} / t2d {tuple(t2d.shape)} disagree with "
            "config.json "
            f"(draft_vocab_size {cfg.draft_vocab_size}, vocab_size {cfg.vocab_size})"
        )
    metrics = path / "metrics.json"
    recorded = json.loads(metrics.read_text()) if metrics.is_file() else {}
    return InitDrafter(str(folder), cfg, tensors, sha256_files([path / CONFIG, path / WEIGHTS]), recorded)


def _rope(cfg: DrafterConfig) -> str:
    scaling = ", ".join(f"{k} {v}" for k, v in sorted((cfg.rope_scaling or {}).items()))
    return f"theta {cfg.rope_theta:g}" + (f", {scaling}" if scaling else ", default")


def target_mismatches(
    init: DrafterConfig,
    hidden_size: int,
    vocab_size: int,
    aux_layers: list[int],
    rope: DrafterConfig | None = None,
) -> list[str]:
    """One line per way the drafter was made for another target (both values named); `rope`, a
    drafter config derived from the target, adds the RoPE check (it needs the target's config)."""
    lines = []
    if init.hidden_size != hidden_size or init.target_hidden_size != hidden_size:
        got = f"{init.hidden_size}" + (
            f" (reads target states of {init.target_hidden_size})" if init.owns_embedding else ""
        )
        lines.append(f"hidden size: drafter {got}, target {hidden_size}")
    if sorted(init.aux_layer_ids) != sorted(aux_layers):
        lines.append(
            f"aux layer ids: drafter {init.aux_layer_ids}, target features {sorted(aux_layers)} "
            "(extract.aux_layers)"
        )
    if init.vocab_size != vocab_size:
        lines.append(f"target vocabulary: drafter {init.vocab_size:,}, target {vocab_size:,}")
    if rope is not None and (init.rope_theta, init.rope_scaling) != (rope.rope_theta, rope.rope_scaling):
        lines.append(f"RoPE: drafter {_rope(init)}, target {_rope(rope)}")
    return lines


def check_against_target(
    init: InitDrafter,
    hidden_size: int,
    vocab_size: int,
    aux_layers: list[int],
    rope: DrafterConfig | None = None,
) -> None:
    lines = target_mismatches(init.cfg, hidden_size, vocab_size, aux_layers, rope)
    if lines:
        raise InputError(
            f"train.init: {init.folder} was made for another target (train.init: null trains from scratch):"
            + "".join(f"\n  - {line}" for line in lines)
        )


def adopted_mapping(init: InitDrafter, vocab_size_param: int) -> tuple[Tensor, Tensor]:
    """The drafter's own d2t/t2d; refuses a vocab.size that is not its draft vocabulary size."""
    k, v = init.cfg.draft_vocab_size, init.cfg.vocab_size
    if draft_size(vocab_size_param, v) != k:
        raise InputError(
            f"vocab.size is {vocab_size_param:,} but the train.init drafter {init.folder} has a draft "
            f"vocabulary of {k:,} tokens (its d2t/t2d are part of its weights): set vocab.size: {k}"
        )
    return init.d2t, init.t2d


def adopt_vocab_map(
    init: InitDrafter, counts: Any, hidden_size: int, aux_layers: list[int], vocab_size_param: int
) -> VocabMap:
    """vocab-map's warm start: the drafter checked against the features' target (RoPE is checked by
    train, which reads the target's config), then its own mapping with this run's token counts."""
    check_against_target(init, hidden_size, len(counts), aux_layers)
    return adopted_vocab_map(counts, *adopted_mapping(init, vocab_size_param))
