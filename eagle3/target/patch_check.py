"""patch-check: prove that hidden-state capture works on this engine and model, and fingerprint both.

Two properties are checked on a few fixed prompts, bit for bit:
  (a) non-invasive: logits with the capture hooks equal logits without them;
  (b) right layers: the captured states equal HF's reference `output_hidden_states`
      (aux layer id i is `hidden_states[i + 1]`; the final state is the post-norm output).
The fingerprint (engine version, weight and tokenizer hashes, sizes, aux layer ids) goes into
the report that extract depends on, so an engine upgrade or another model re-runs extraction.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch
import transformers

from eagle3.core.layer_ids import LAYER_ID_RULES, serving_rule
from eagle3.core.params import Params, check_against_target
from eagle3.core.stageio import sha256_files
from eagle3.dtypes.resolved import pinned
from eagle3.target.capture import capture_hidden_states
from eagle3.target.fingerprint import Fingerprint
from eagle3.target.load import Target, load_target, load_target_config

CHECK_PROMPTS = (
    "The quick brown fox jumps over the lazy dog.",
    "def fibonacci(n):\n    return n if n < 2 else fibonacci(n - 1) + fibonacci(n - 2)",
    "Speculative decoding lets a small model propose tokens that a large model verifies.",
)
# HF and SGLang name the same tensors differently; recorded in the report for the reader.
HF_IDS = "aux layer id i = output of decoder layer i (0-indexed) = HF hidden_states[i + 1]"
CONVENTION = (
    f"{HF_IDS} = what SGLang captures for eagle_aux_hidden_state_layer_ids [i] (it hooks before layer i + 1)"
)


class PatchCheckError(AssertionError):
    pass


def _files_sha256(folder: Path, patterns: tuple[str, ...]) -> str:
    files = [p for pattern in patterns for p in folder.glob(pattern)]
    if not files:
        raise FileNotFoundError(f"no {' / '.join(patterns)} files in {folder}")
    return sha256_files(files)


def _local_folder(target: Target) -> Path:
    path = Path(target.path)
    if path.is_dir():
        return path
    from huggingface_hub import snapshot_download

    return Path(snapshot_download(target.path, local_files_only=True))


def fingerprint(target: Target, aux_layers: list[int]) -> Fingerprint:
    """The in-process engine's fingerprint of `target`: its files' hashes, sizes and dtype."""
    folder = _local_folder(target)
    return Fingerprint(
        engine="transformers",
        engine_version=transformers.__version__,
        torch_version=torch.__version__.split("+")[0],
        target_source=target.source,
        target_sha256=_files_sha256(folder, ("*.safetensors", "*.bin")),
        tokenizer_sha256=_files_sha256(folder, ("tokenizer.json", "tokenizer.model")),
        num_layers=target.num_layers,
        hidden_size=target.hidden_size,
        vocab_size=target.vocab_size,
        aux_layers=tuple(aux_layers),
        dtype=str(target.model.dtype).removeprefix("torch."),
    )


CaptureFn = Callable[..., object]


@torch.no_grad()
def run_patch_check(
    target: Target, aux_layers: list[int], capture: CaptureFn = capture_hidden_states
) -> dict:
    """Check capture on CHECK_PROMPTS; raise PatchCheckError on the first mismatch, else return the report."""
    rule = serving_rule(target.config)
    sglang_ids = rule.to_sglang(aux_layers)  # refuses layers SGLang cannot capture on this target
    checks = []
    for prompt in CHECK_PROMPTS:
        ids = target.tokenizer(prompt, return_tensors="pt").input_ids
        plain = target.model(ids, output_hidden_states=True)
        with capture(target.decoder_layers, target.final_norm, aux_layers) as captured:
            hooked = target.model(ids)
        if not torch.equal(plain.logits, hooked.logits):
            diff = (plain.logits.float() - hooked.logits.float()).abs().max().item()
            raise PatchCheckError(f"capture is invasive: logits change under the hooks (max |diff| {diff:g})")
        for layer, state in zip(aux_layers, captured.aux, strict=True):
            if not torch.equal(state, plain.hidden_states[layer + 1]):
                raise PatchCheckError(
                    f"captured aux layer {layer} differs from the reference hidden_states[{layer + 1}]"
                )
        if not torch.equal(captured.last, plain.hidden_states[-1]):
            raise PatchCheckError("captured last hidden state differs from the post-norm reference")
        checks.append(
            {"prompt_tokens": ids.shape[1], "logits_bitwise_equal": True, "states_bitwise_equal": True}
        )
    report = {
        "fingerprint": fingerprint(target, aux_layers).to_json(),
        "convention": CONVENTION,
        "checks": checks,
        "passed": True,
    }
    if rule is not LAYER_ID_RULES[0]:  # DeepSeek/Kimi: SGLang reads other ids (sglang_engine.py)
        report["convention"] = f"{HF_IDS}; SGLang ({rule.family}): {rule.capture}"
        report["sglang_aux_layer_ids"] = sglang_ids
    return report


def hf_patch_check(params: Params) -> dict:
    """The hf backend's patch-check: the aux layers checked against the target's config before
    the load, then capture on the target loaded in the dtype the dtypes stage recorded."""
    config = load_target_config(params.target).get_text_config()  # Kimi-K2.5 nests it
    aux_layers = check_against_target(params, config.num_hidden_layers, config.vocab_size)
    return run_patch_check(load_target(pinned(params, "prefill").target), aux_layers)
