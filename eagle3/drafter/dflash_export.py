"""Export a DFlash drafter in the layout SGLang 0.5.23 loads for `--speculative-algorithm DFLASH`,
read it back, and tell the two drafter families apart.

`artifacts/train/drafter/` = config.json (DFlashConfig.to_hf_dict) + model.safetensors with the
names DFlashDraftModel.load_weights maps (srt/models/dflash.py): fc.weight, hidden_norm.weight,
norm.weight and per layer layers.{i}.input_layernorm / post_attention_layernorm,
self_attn.{q,k,v,o}_proj, self_attn.{q,k}_norm, mlp.{gate,up,down}_proj (SGLang stacks q/k/v
and gate/up itself). No embedding, no lm_head: both are the target's.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save
from torch import Tensor

from eagle3.core.inputs import InputError
from eagle3.core.stageio import write_bytes, write_json
from eagle3.drafter.config import ARCHITECTURE as EAGLE3_ARCHITECTURE
from eagle3.drafter.dflash import ARCHITECTURE, DFlashConfig, DFlashDrafter

WEIGHTS = "model.safetensors"
CONFIG = "config.json"
# the drafter families by the architecture their config.json names (drafter.kind's values)
KINDS = {EAGLE3_ARCHITECTURE: "eagle3", ARCHITECTURE: "dflash"}


def export_dflash(model: DFlashDrafter, out_dir: str | Path, dtype: torch.dtype = torch.bfloat16) -> None:
    """Write config.json + model.safetensors; deterministic bytes for the same weights."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    model = getattr(model, "module", model)  # unwrap DDP
    config = model.cfg.to_hf_dict()
    config["torch_dtype"] = str(dtype).removeprefix("torch.")
    state = model.state_dict()
    tensors = {k: v.detach().to(device="cpu", dtype=dtype).contiguous() for k, v in state.items()}
    write_json(out_dir / CONFIG, config)
    write_bytes(out_dir / WEIGHTS, save(tensors, metadata={"format": "pt"}))


def load_dflash_config(path: str | Path) -> DFlashConfig:
    path = Path(path)
    if not (path / CONFIG).exists():
        raise FileNotFoundError(f"{path} has no {CONFIG}: not an exported drafter")
    return DFlashConfig.from_hf_dict(json.loads((path / CONFIG).read_text()))


def load_dflash(path: str | Path, dtype: torch.dtype = torch.bfloat16) -> DFlashDrafter:
    """Read an exported DFlash drafter back, refusing a file whose tensors differ from its config."""
    path = Path(path)
    cfg = load_dflash_config(path)
    tensors: dict[str, Tensor] = load_file(str(path / WEIGHTS))
    model = DFlashDrafter(cfg)
    own = model.state_dict()
    missing, unexpected = set(own) - set(tensors), set(tensors) - set(own)
    bad = [k for k in set(own) & set(tensors) if tuple(own[k].shape) != tuple(tensors[k].shape)]
    if missing or unexpected or bad:
        raise ValueError(
            f"{path / WEIGHTS}: tensors do not match the DFlash layout of its config.json "
            f"(missing {sorted(missing)}, unexpected {sorted(unexpected)}, other shapes {sorted(bad)})"
        )
    model.load_state_dict(tensors)
    return model.to(dtype).eval().requires_grad_(False)


def drafter_kind(path: str | Path) -> str:
    """The family of an exported drafter (eagle3 or dflash), read from its config.json."""
    config = Path(path) / CONFIG
    if not config.exists():
        raise FileNotFoundError(f"{Path(path)} has no {CONFIG}: not an exported drafter")
    archs = json.loads(config.read_text()).get("architectures") or []
    kinds = {KINDS[a] for a in archs if a in KINDS}
    if len(kinds) != 1:
        raise InputError(
            f"{config}: architectures {archs} name no drafter family this project trains "
            f"(allowed: {', '.join(KINDS)})"
        )
    return kinds.pop()


def check_drafter_kind(path: str | Path, kind: str, key: str = "eval.drafter") -> None:
    """Refuse (one line) a drafter of the other family than drafter.kind asks for; `key` names
    where the folder came from (eval.drafter, or None: the train stage's output)."""
    have = drafter_kind(path)
    if have != kind:
        fix = f"give a {kind} drafter" if key else "re-run the train stage (dvc repro train)"
        raise InputError(
            f"{key or 'the trained drafter'}: {path} is a {have} drafter, but drafter.kind is {kind}: "
            f"{fix}, or set drafter.kind: {have}"
        )
