"""Export the drafter in SGLang's EAGLE-3 layout and read it back.

`artifacts/train/drafter/` = config.json (see DrafterConfig.to_hf_dict) + model.safetensors
with the keys SGLang's `LlamaForCausalLMEagle3.load_weights` maps: fc.weight, midlayer.*,
norm.weight, lm_head.weight, d2t, t2d, and fc_norm.{0,1,2}.weight with EAGLE-3.1's fc_norm.
Names carry no "model." prefix: vLLM's loader adds it to every name but lm_head/d2t/t2d.

The embedding: a drafter as wide as the target uses the target's, so it is not exported and
config.json has no target_hidden_size; then SGLang (set_embed), vLLM (no embed_tokens in the
file -> has_own_embed_tokens false -> shares) and the EAGLE reference (copies the target's
when target_hidden_size is absent) all use the target's. A drafter of another width cannot;
it exports its own `embed_tokens.weight` and writes target_hidden_size, and all three read the
file's (SGLang's set_embed skips a differing target_hidden_size, vLLM keeps an own embedding,
EAGLE loads it with its state dict). tests/test_export_loaders.py checks each rule.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save
from torch import Tensor

from eagle3.core.stageio import write_bytes, write_json
from eagle3.drafter.config import DrafterConfig
from eagle3.drafter.model import Eagle3Drafter

WEIGHTS = "model.safetensors"
CONFIG = "config.json"
EMBED = "embed_tokens.weight"
TTT_LENGTH_KEY = "ttt_length"  # in eagle_config: the draft steps the drafter was trained for


def export_state_dict(model: Eagle3Drafter, dtype: torch.dtype = torch.bfloat16) -> dict[str, Tensor]:
    """The exported tensors: weights in `dtype`, d2t int64, t2d bool; the embedding only when
    the drafter owns one (see the module doc)."""
    out = {}
    for name, tensor in model.state_dict().items():
        if name == EMBED and not model.cfg.owns_embedding:
            continue
        if name in ("d2t", "t2d"):
            out[name] = tensor.detach().cpu().contiguous()
        else:
            out[name] = tensor.detach().to(device="cpu", dtype=dtype).contiguous()
    return out


def export_drafter(
    model: Eagle3Drafter,
    out_dir: str | Path,
    dtype: torch.dtype = torch.bfloat16,
    ttt_length: int | None = None,
) -> None:
    """Write config.json + model.safetensors; deterministic bytes for the same weights.
    `ttt_length`: the draft steps it was trained for, recorded as eagle_config.ttt_length (a key
    SGLang and vLLM ignore) so that evaluating or serving it deeper is refused."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    model = getattr(model, "module", model)  # unwrap DDP
    config = model.cfg.to_hf_dict()
    config["torch_dtype"] = str(dtype).removeprefix("torch.")
    if ttt_length is not None:
        config["eagle_config"][TTT_LENGTH_KEY] = ttt_length
    write_json(out_dir / CONFIG, config)
    write_bytes(out_dir / WEIGHTS, save(export_state_dict(model, dtype), metadata={"format": "pt"}))


def trained_ttt_length(folder: str | Path, default: int) -> int:
    """The TTT length a drafter was trained with, as its config.json records it. A drafter
    exported before the key existed: its shipped params.yaml (eagle3 ship) says, else `default`
    (the current train.ttt_length, for the train stage's own drafter)."""
    eagle = json.loads((Path(folder) / CONFIG).read_text()).get("eagle_config") or {}
    if TTT_LENGTH_KEY in eagle:
        return int(eagle[TTT_LENGTH_KEY])
    # read raw, not through eagle3.core.params: a folder shipped under an older schema need not
    # validate against today's defaults, and only this one key matters here
    import yaml  # only old shipped folders need it

    shipped = Path(folder) / "params.yaml"
    if not shipped.exists():
        return default
    train = (yaml.safe_load(shipped.read_text()) or {}).get("train") or {}
    return int(train.get("ttt_length", default))


def load_drafter_config(path: str | Path, target_config: object = None) -> DrafterConfig:
    """The drafter's config; with the target's HF config its aux layer ids are read the way
    SGLang reads them for that target (DrafterConfig.from_hf_dict)."""
    path = Path(path)
    if not (path / CONFIG).exists():
        raise FileNotFoundError(f"{path} has no {CONFIG}: not an exported drafter")
    return DrafterConfig.from_hf_dict(json.loads((path / CONFIG).read_text()), target_config)


def load_drafter(
    path: str | Path,
    embed_weight: Tensor | None,
    dtype: torch.dtype = torch.bfloat16,
    target_config: object = None,
) -> Eagle3Drafter:
    """Read an exported drafter back; `embed_weight` is the target's input embedding [V, H]
    (ignored, and may be None, when the drafter ships its own)."""
    path = Path(path)
    cfg = load_drafter_config(path, target_config)
    tensors = load_file(str(path / WEIGHTS))
    embed = _embedding(path, cfg, tensors, embed_weight)
    model = Eagle3Drafter(cfg, embed_weight=embed.to(dtype))
    expected = set(export_state_dict(model)) - {EMBED}
    missing, unexpected = expected - set(tensors), set(tensors) - expected
    if missing or unexpected:
        raise ValueError(
            f"{path / WEIGHTS}: keys do not match the EAGLE-3 layout "
            f"(missing {sorted(missing)}, unexpected {sorted(unexpected)})"
        )
    model.to(dtype)
    model.embed_tokens.weight.data = embed.to(dtype)  # keep sharing the caller's tensor
    state = {k: v for k, v in tensors.items() if k not in ("d2t", "t2d")}
    model.load_state_dict(state, strict=False)
    model.set_vocab_mapping(tensors["d2t"], tensors["t2d"])
    return model.eval().requires_grad_(False)


def _embedding(path: Path, cfg: DrafterConfig, tensors: dict[str, Tensor], target: Tensor | None) -> Tensor:
    """The drafter's own embedding (popped from `tensors`) when it has one, else the target's."""
    if cfg.owns_embedding:
        if EMBED not in tensors:
            raise ValueError(
                f"{path}: target_hidden_size ({cfg.target_hidden_size}) differs from hidden_size "
                f"({cfg.hidden_size}) but {WEIGHTS} has no {EMBED}"
            )
        return tensors.pop(EMBED)
    if target is None:
        raise ValueError(f"{path} ships no {EMBED}: pass the target's input embedding")
    return target
