"""Attention with the training-time-test (TTT) pattern, exact and cheap.

At TTT step n the query at position t attends to the prefix keys of step 0 at positions <= t
(causal) and to its own keys of steps 1..n at the same position t (a diagonal). The reference
form is one scaled_dot_product_attention over the (n+1)T concatenated keys with a boolean
mask; it computes n full T x T blocks of which only the diagonals are used.

The fast form runs the prefix with a flash kernel that also returns the log-sum-exp (CPU:
SDPA's CPU flash kernel in float32/64; CUDA: the CUDA flash kernel in bf16/fp16), and merges
the n diagonal scores into the same softmax. Its backward calls the flash backward with the
*merged* output and log-sum-exp, which yields exactly the gradient of the prefix part of the
merged softmax, and adds the diagonal terms by hand. Same result as the reference (tests check
forward and gradients in float64; on CUDA in bf16, tests/test_train.py, tools/gpu_check.sh),
O(T^2 + nT) instead of O((n+1)T^2). Ours because no library has it: SDPA and flex attention
take one mask over all keys, i.e. the O((n+1)T^2) reference form.

`TTTCache` is the attention strategy a training unroll passes to `Eagle3Drafter.forward`.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor

_FLASH = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
_FLASH_BWD = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu_backward", None)
_LOW_PRECISION = (torch.bfloat16, torch.float16)


class FlashKernel(NamedTuple):
    """A causal flash-attention pair that exposes the log-sum-exp. `forward(q, k, v, scale)` ->
    (out, lse [B, h, T] float32, state); `backward(d_out, q, k, v, out, lse, state, scale)` ->
    (dq, dk, dv), which the merged form calls with the *merged* out and lse."""

    forward: Callable[..., tuple[Tensor, Tensor, Any]]
    backward: Callable[..., tuple[Tensor, Tensor, Tensor]]


def _cpu_forward(q: Tensor, k: Tensor, v: Tensor, scale: float) -> tuple[Tensor, Tensor, None]:
    out, lse = _FLASH(q, k, v, 0.0, True, scale=scale)
    return out, lse, None


def _cpu_backward(d_out, q, k, v, out, lse, state, scale):  # noqa: ANN001, ANN202 (aten's own types)
    lse = lse.to(torch.float32) if q.dtype != torch.float64 else lse
    return _FLASH_BWD(d_out, q, k, v, out, lse, 0.0, True, scale=scale)


def _cuda_forward(q: Tensor, k: Tensor, v: Tensor, scale: float) -> tuple[Tensor, Tensor, tuple]:
    out, lse, cum_q, cum_k, max_q, max_k, rng, unused, _ = torch.ops.aten._scaled_dot_product_flash_attention(
        q, k, v, 0.0, True, False, scale=scale
    )
    return out, lse, (cum_q, cum_k, max_q, max_k, rng, unused)


def _cuda_backward(d_out, q, k, v, out, lse, state, scale):  # noqa: ANN001, ANN202 (aten's own types)
    cum_q, cum_k, max_q, max_k, rng, unused = state
    return torch.ops.aten._scaled_dot_product_flash_attention_backward(
        d_out,
        q,
        k,
        v,
        out,
        lse.to(torch.float32),
        cum_q,
        cum_k,
        max_q,
        max_k,
        0.0,
        True,
        rng,
        unused,
        scale=scale,
    )


CPU_FLASH = FlashKernel(_cpu_forward, _cpu_backward)
CUDA_FLASH = FlashKernel(_cuda_forward, _cuda_backward)  # bf16/fp16 only: the flash kernel's dtypes


class _MergedTTTAttention(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx, q: Tensor, k0: Tensor, v0: Tensor, kd: Tensor, vd: Tensor, scale: float, kernel: FlashKernel
    ) -> Tensor:
        # q, k0, v0 [B, h, T, d]; kd, vd [B, h, T, n, d] (n >= 1 diagonal keys per query). The
        # diagonal terms and the merge run in float32 at least (a no-op for float32/64 inputs).
        acc = torch.float32 if q.dtype in _LOW_PRECISION else q.dtype
        o_p, lse_p, state = kernel.forward(q, k0, v0, scale)
        s_d = torch.einsum("bhtd,bhtnd->bhtn", q.to(acc), kd.to(acc)) * scale
        lse = torch.logaddexp(lse_p.to(acc), torch.logsumexp(s_d, dim=-1))
        p_d = torch.exp(s_d - lse[..., None])
        merged = torch.exp(lse_p.to(acc) - lse)[..., None] * o_p.to(acc)
        out = (merged + torch.einsum("bhtn,bhtnd->bhtd", p_d, vd.to(acc))).to(q.dtype)
        ctx.save_for_backward(q, k0, v0, kd, vd, out, lse, p_d)
        ctx.scale, ctx.kernel, ctx.state = scale, kernel, state
        return out

    @staticmethod
    def backward(ctx, d_out: Tensor):
        q, k0, v0, kd, vd, out, lse, p_d = ctx.saved_tensors
        scale, acc = ctx.scale, p_d.dtype
        d_out = d_out.contiguous()
        dq, dk0, dv0 = ctx.kernel.backward(d_out, q, k0, v0, out, lse, ctx.state, scale)
        d_acc, q_acc = d_out.to(acc), q.to(acc)
        delta = (d_acc * out.to(acc)).sum(-1, keepdim=True)  # [B, h, T, 1]
        d_s = p_d * (torch.einsum("bhtd,bhtnd->bhtn", d_acc, vd.to(acc)) - delta)
        dq = (dq.to(acc) + torch.einsum("bhtn,bhtnd->bhtd", d_s, kd.to(acc)) * scale).to(q.dtype)
        dkd = (d_s[..., None] * q_acc[:, :, :, None, :] * scale).to(kd.dtype)
        dvd = (p_d[..., None] * d_acc[:, :, :, None, :]).to(vd.dtype)
        return dq, dk0, dv0, dkd, dvd, None, None


def ttt_mask(t: int, n: int, device: torch.device) -> Tensor:
    """Boolean [T, (n+1)T]: causal over the prefix block, diagonal over each of n step blocks."""
    causal = torch.ones(t, t, dtype=torch.bool, device=device).tril()
    eye = torch.eye(t, dtype=torch.bool, device=device)
    return torch.cat([causal] + [eye] * n, dim=-1)


def ttt_attention_reference(q: Tensor, k0: Tensor, v0: Tensor, kd: list[Tensor], vd: list[Tensor]) -> Tensor:
    """One SDPA over concatenated keys with the TTT mask (any device, any dtype)."""
    k = torch.cat([k0, *kd], dim=2)
    v = torch.cat([v0, *vd], dim=2)
    mask = ttt_mask(q.shape[2], len(kd), q.device)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


def merged_kernel(q: Tensor) -> FlashKernel | None:
    """The flash pair the merged form runs on for `q`'s device and dtype, or None (the reference
    form): on CPU its flash kernel (inputs in float32 or float64); on CUDA the flash kernel for
    bf16/fp16 at a head size it takes, once a small problem on that device has matched the
    reference, forward and backward (merged_form_checks)."""
    if q.device.type == "cpu":
        return CPU_FLASH if _FLASH is not None and _FLASH_BWD is not None else None
    if q.device.type == "cuda" and q.dtype in _LOW_PRECISION and q.shape[-1] % 8 == 0 and q.shape[-1] <= 256:
        return CUDA_FLASH if merged_form_checks(q.device, q.dtype, q.shape[-1]) else None
    return None


@functools.cache
def merged_form_checks(device: torch.device, dtype: torch.dtype, head_dim: int) -> bool:
    """Whether the CUDA merged form equals the reference on this device, dtype and head size (a
    2-step unroll over 67 positions, output and every gradient within the dtype's tolerance).
    Checked once per process; where it does not match (another torch's kernel arguments) the
    reference form runs, with a warning, rather than a wrong gradient."""
    gen = torch.Generator(device=device).manual_seed(0)
    leaves = [torch.randn(1, 2, 67, head_dim, device=device, dtype=dtype, generator=gen) for _ in range(7)]
    leaves = [x.requires_grad_() for x in leaves]
    q, k0, v0, kd, vd = leaves[0], leaves[1], leaves[2], leaves[3:5], leaves[5:7]
    w = torch.randn_like(q)
    try:
        merged = _MergedTTTAttention.apply(
            q, k0, v0, torch.stack(kd, dim=3), torch.stack(vd, dim=3), head_dim**-0.5, CUDA_FLASH
        )
        ref = ttt_attention_reference(
            *(x.float() for x in (q, k0, v0)), [x.float() for x in kd], [x.float() for x in vd]
        )
        got = [merged, *torch.autograd.grad((merged.float() * w).sum(), leaves)]
        want = [ref, *torch.autograd.grad((ref * w.float()).sum(), leaves)]
        ok = all(
            torch.allclose(a.float(), b.float(), rtol=0.05, atol=0.05) for a, b in zip(got, want, strict=True)
        )
        why = "does not match the reference"
    except RuntimeError as err:  # a torch whose flash kernel takes other arguments
        ok, why = False, f"failed: {err}"
    if not ok:
        warnings.warn(
            f"TTT attention: the merged flash form on {device} {dtype} {why}; using the reference form",
            stacklevel=3,
        )
    return ok


def ttt_attention(q: Tensor, k0: Tensor, v0: Tensor, kd: list[Tensor], vd: list[Tensor]) -> Tensor:
    """TTT attention; q/k/v [B, h, T, d] with k/v already expanded to the query heads.

    kd/vd: the keys/values of steps 1..n (each [B, h, T, d]), attended on the diagonal only.
    On CPU it runs the merged flash form in float32 (CPU bf16 attention backward is very slow)
    or float64; on CUDA in bf16/fp16 with the CUDA flash kernel; elsewhere the reference form.
    """
    kernel = merged_kernel(q)
    if kernel is None:
        return ttt_attention_reference(q, k0, v0, kd, vd)
    dtype = q.dtype
    work = dtype if kernel is not CPU_FLASH else torch.float64 if dtype == torch.float64 else torch.float32
    q32, k32, v32 = q.to(work), k0.to(work), v0.to(work)
    scale = q.shape[-1] ** -0.5
    if not kd:
        out = F.scaled_dot_product_attention(q32, k32, v32, is_causal=True)
    else:
        kds = torch.stack(kd, dim=3).to(work)
        vds = torch.stack(vd, dim=3).to(work)
        out = _MergedTTTAttention.apply(q32, k32, v32, kds, vds, scale, kernel)
    return out.to(dtype)


class TTTCache:
    """Keys of one training-time-test unroll: step 0 is the prefix (attended causally), every
    later step's keys are attended only at the query's own position (see ttt_attention).

    k/v are kept expanded to the query heads. `length` counts the prefix only (positions, not steps).
    """

    def __init__(self) -> None:
        self.k: Tensor | None = None
        self.v: Tensor | None = None
        self.diag_k: list[Tensor] = []
        self.diag_v: list[Tensor] = []

    @property
    def length(self) -> int:
        return 0 if self.k is None else self.k.shape[2]

    def attend(self, q: Tensor, k: Tensor, v: Tensor, attn_mask: Tensor | None) -> Tensor:
        if attn_mask is not None:
            raise ValueError("TTT attention has its own pattern; it takes no attn_mask")
        groups = q.shape[1] // k.shape[1]
        if groups > 1:
            k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        if self.k is None:
            self.k, self.v = k, v
        else:
            self.diag_k.append(k)
            self.diag_v.append(v)
        return ttt_attention(q, self.k, self.v, self.diag_k, self.diag_v)
