"""The target's input embedding and lm_head, read straight from its safetensors files.

Training needs only these two matrices (the drafter's frozen embedding, and the target
logits recomputed from last_hidden); loading the whole target for them would cost the
memory of every decoder layer (hundreds of GB for a Kimi-size target).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch
from safetensors import safe_open
from torch import Tensor

from eagle3.target.load import resolve_target

EMBED_SUFFIX = "embed_tokens.weight"
HEAD_NAMES = ("lm_head.weight", "language_model.lm_head.weight")


def _tensor_files(folder: Path) -> dict[str, Path]:
    """Tensor name -> file, from the safetensors index when there is one."""
    index = folder / "model.safetensors.index.json"
    if index.exists():
        mapping = json.loads(index.read_text())["weight_map"]
        return {name: folder / file for name, file in mapping.items()}
    files: dict[str, Path] = {}
    for path in sorted(folder.glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as f:
            files.update({name: path for name in f.keys()})
    if not files:
        raise FileNotFoundError(f"{folder} holds no *.safetensors weights")
    return files


def _read(files: dict[str, Path], name: str, dtype: torch.dtype) -> Tensor:
    with safe_open(str(files[name]), framework="pt") as f:
        return f.get_tensor(name).to(dtype)


def _target_files(source: str) -> tuple[Path, dict, dict[str, Path]]:
    """(folder, text config, tensor name -> file) of the target `source` (params target.source)."""
    folder = Path(resolve_target(source))
    config = json.loads((folder / "config.json").read_text())
    # multimodal configs nest the language model's keys; top-level ones fill the gaps
    text = config | (config.get("text_config") or {})
    return folder, text, _tensor_files(folder)


def load_target_heads(source: str, dtype: torch.dtype = torch.bfloat16) -> tuple[Tensor, Tensor]:
    """(input embedding [V, H], lm_head [V, H]) of the target `source` (params target.source)."""
    folder, text, files = _target_files(source)
    embed_names = sorted(n for n in files if n.endswith(EMBED_SUFFIX) and "vision" not in n)
    if not embed_names:
        raise ValueError(f"{folder}: no tensor named *{EMBED_SUFFIX}")
    embed = _read(files, embed_names[0], dtype)
    head_name = next((n for n in HEAD_NAMES if n in files), None)
    tied = text.get("tie_word_embeddings", True)
    if head_name is not None:
        return embed, _read(files, head_name, dtype)
    if not tied:
        raise ValueError(f"{folder}: tie_word_embeddings is false but there is no lm_head.weight")
    return embed, embed


def load_target_final_norm(source: str, dtype: torch.dtype = torch.float32) -> Tensor:
    """The target's final norm scale [H], as a Llama-style RMSNorm weight (the drafter's kind).

    Gemma's norms scale by (1 + w), so its weight is shifted by one.
    """
    folder, text, files = _target_files(source)
    # outside every numbered block (".layers.3.", Kimi-K2.5's ".blocks.3.") and the vision parts
    names = sorted(
        n
        for n in files
        if n.endswith("norm.weight")
        and not re.search(r"\.\d+\.", n)
        and not any(part in n for part in ("vision", "mm_projector"))
    )
    if len(names) != 1:
        raise ValueError(f"{folder}: expected one final norm weight outside the layers, found {names}")
    weight = _read(files, names[0], torch.float32)
    if "gemma" in str(text.get("model_type", "")):
        weight = weight + 1.0
    return weight.to(dtype)
