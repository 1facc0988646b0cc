"""What SGLang 0.5.23's DFLASH speculative path lacks on a CPU, supplied in place (see README.md).

launch_server.py calls install() in the launching process and, through multiprocessing's spawn
(which re-runs the launcher's module level in every child as `__mp_main__`), in the scheduler
process too, when the command line names `--speculative-algorithm DFLASH`.
"""

from __future__ import annotations

import functools

CPU_DRAFT_BACKEND = "intel_amx"


class _DflashOnCpu:
    """Stands in for `current_platform` while SGLang resolves the DFLASH args: the in-tree CPU
    platform refuses DFLASH outright (speculative_hook._handle_dflash allows cuda, npu and xpu
    only), although the worker has a non-Triton path for every step it takes."""

    def __init__(self, platform) -> None:
        self._platform = platform

    def __getattr__(self, name: str):
        return getattr(self._platform, name)

    def is_out_of_tree(self) -> bool:
        return True

    def supports_speculative_algorithm(self, algorithm: str) -> bool:
        return algorithm == "DFLASH"

    def supports_speculative_draft_attention_backend(self, algorithm: str, backend: str) -> bool:
        return backend == CPU_DRAFT_BACKEND

    def get_default_speculative_draft_attention_backend(self, algorithm: str) -> str:
        return CPU_DRAFT_BACKEND


def _allow_dflash_on_cpu() -> None:
    from sglang.srt.arg_groups import speculative_hook

    original = speculative_hook._handle_dflash
    if getattr(original, "_cpu_shim", False):
        return

    @functools.wraps(original)
    def handle_dflash(server_args) -> None:
        platform = speculative_hook.current_platform
        speculative_hook.current_platform = _DflashOnCpu(platform)
        try:
            original(server_args)
        finally:
            speculative_hook.current_platform = platform

    handle_dflash._cpu_shim = True
    speculative_hook._handle_dflash = handle_dflash


def _draft_backend_choice() -> None:
    # The draft worker (draft_worker_common.resolve_draft_worker_attention_backend) falls back to
    # flashinfer for a backend outside this list; add_draft_attention_backend_choices is SGLang's
    # own extension point for it.
    from sglang.srt.arg_groups.choices import (
        DRAFT_ATTENTION_BACKEND_CHOICES,
        add_draft_attention_backend_choices,
    )

    if CPU_DRAFT_BACKEND not in DRAFT_ATTENTION_BACKEND_CHOICES:
        add_draft_attention_backend_choices([CPU_DRAFT_BACKEND])


def _linear_verify_topk() -> None:
    # intel_amx_backend reads spec_info.tree_topk in TARGET_VERIFY to decide whether a tree mask
    # applies; EagleVerifyInput and NgramVerifyInput define it, DFlashVerifyInput does not. A
    # DFlash block is a chain (topk is 1 by construction) and carries no custom mask.
    from sglang.srt.speculative.dflash_info import DFlashVerifyInput

    if not hasattr(DFlashVerifyInput, "tree_topk"):
        DFlashVerifyInput.tree_topk = property(lambda self: 1)


def _record_stream_on_cpu() -> None:
    # DFlashWorkerV2.forward_batch_generation calls batch.seq_lens.record_stream(current stream),
    # unguarded (the EAGLE workers skip non-CUDA tensors, spec_utils.record_stream_each). A CPU
    # has no streams: torch.cpu.current_stream() is a stub that record_stream rejects ("unknown
    # parameter type") and aten has no CPU record_stream kernel, so on a CPU tensor it is a no-op.
    import torch

    original = torch.Tensor.record_stream
    if getattr(original, "_cpu_shim", False):
        return

    @functools.wraps(original)
    def record_stream(self, stream):
        if self.device.type == "cpu":
            return None
        return original(self, stream)

    record_stream._cpu_shim = True
    torch.Tensor.record_stream = record_stream


def _input_embeds_in_model_dtype() -> None:
    # The DFlash draft forward is the one extend forward that comes with input_embeds (the
    # target's embedding of the block: the verified token, then mask tokens), and
    # ModelRunner._extend_forward_kwargs casts input_embeds to bfloat16 whatever the model's
    # dtype: a float32 (or float16) drafter then fails in its first linear ("expected m1 and m2
    # to have the same dtype"). Not CPU-specific; the cast here is to the runner's own dtype.
    from sglang.srt.model_executor.model_runner import ModelRunner

    original = ModelRunner._extend_forward_kwargs
    if getattr(original, "_cpu_shim", False):
        return

    @functools.wraps(original)
    def extend_forward_kwargs(self, forward_batch, pp_proxy_tensors) -> dict:
        kwargs = original(self, forward_batch, pp_proxy_tensors)
        if forward_batch.input_embeds is not None and forward_batch.replace_embeds is None:
            kwargs["input_embeds"] = forward_batch.input_embeds.to(self.model_config.dtype)
        return kwargs

    extend_forward_kwargs._cpu_shim = True
    ModelRunner._extend_forward_kwargs = extend_forward_kwargs


def install() -> None:
    _allow_dflash_on_cpu()
    _record_stream_on_cpu()
    _input_embeds_in_model_dtype()
    _draft_backend_choice()
    _linear_verify_topk()
