"""Attention with the training-time-test (TTT) pattern, exact and cheap.

At TTT step n the query at position t attends to the prefix keys of step 0 at positions <= t
(causal) and to its own keys of steps 1..n at the same position t (a diagonal). The reference
form is one scaled_dot_product_attention over the (n+1)T concatenated keys with a boolean
mask; it computes n full T x T blocks of which only the diagonals are used.

The fast form (CPU) runs the prefix with SDPA's own flash kernel, which also returns the
log-sum-exp, and merges the n diagonal scores into the same softmax. Its backward calls the
flash backward with the *merged* output and log-sum-exp, which yields exactly the gradient of
the prefix part of the merged softmax, and adds the diagonal terms by hand. Same result as the
reference (tests check forward and gradients in float64), O(T^2 + nT) instead of O((n+1)T^2).
Ours because no library has it: SDPA and flex attention take one mask over all keys, i.e. the
O((n+1)T^2) reference form.

`TTTCache` is the attention strategy a training unroll passes to `Eagle3Drafter.forward`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

_FLASH = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
_FLASH_BWD = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu_backward", None)


class _MergedTTTAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q: Tensor, k0: Tensor, v0: Tensor, kd: Tensor, vd: Tensor, scale: float) -> Tensor:
        # q, k0, v0 [B, h, T, d]; kd, vd [B, h, T, n, d] (n >= 1 diagonal keys per query)
        o_p, lse_p = _FLASH(q, k0, v0, 0.0, True, scale=scale)
        s_d = torch.einsum("bhtd,bhtnd->bhtn", q, kd) * scale
        lse = torch.logaddexp(lse_p.to(q.dtype), torch.logsumexp(s_d, dim=-1))
        p_d = torch.exp(s_d - lse[..., None])
        out = torch.exp(lse_p.to(q.dtype) - lse)[..., None] * o_p + torch.einsum("bhtn,bhtnd->bhtd", p_d, vd)
        ctx.save_for_backward(q, k0, v0, kd, vd, out, lse, p_d)
        ctx.scale = scale
        return out

    @staticmethod
    def backward(ctx, d_out: Tensor):
        q, k0, v0, kd, vd, out, lse, p_d = ctx.saved_tensors
        scale = ctx.scale
        d_out = d_out.contiguous()
        dq, dk0, dv0 = _FLASH_BWD(
            d_out,
            q,
            k0,
            v0,
            out,
            lse.to(torch.float32) if q.dtype != torch.float64 else lse,
            0.0,
            True,
            scale=scale,
        )
        delta = (d_out * out).sum(-1, keepdim=True)  # [B, h, T, 1]
        d_s = p_d * (torch.einsum("bhtd,bhtnd->bhtn", d_out, vd) - delta)
        dq = dq + torch.einsum("bhtn,bhtnd->bhtd", d_s, kd) * scale
        dkd = d_s[..., None] * q[:, :, :, None, :] * scale
        dvd = p_d[..., None] * d_out[:, :, :, None, :]
        return dq, dk0, dv0, dkd, dvd, None


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


def ttt_attention(q: Tensor, k0: Tensor, v0: Tensor, kd: list[Tensor], vd: list[Tensor]) -> Tensor:
    """TTT attention; q/k/v [B, h, T, d] with k/v already expanded to the query heads.

    kd/vd: the keys/values of steps 1..n (each [B, h, T, d]), attended on the diagonal only.
    On CPU it runs the merged flash form in float32 (CPU bf16 attention backward is very slow)
    or float64; elsewhere the reference form.
    """
    if q.device.type != "cpu" or _FLASH is None or _FLASH_BWD is None:
        return ttt_attention_reference(q, k0, v0, kd, vd)
    dtype = q.dtype
    work = torch.float64 if dtype == torch.float64 else torch.float32
    q32, k32, v32 = q.to(work), k0.to(work), v0.to(work)
    scale = q.shape[-1] ** -0.5
    if not kd:
        out = F.scaled_dot_product_attention(q32, k32, v32, is_causal=True)
    else:
        kds = torch.stack(kd, dim=3).to(work)
        vds = torch.stack(vd, dim=3).to(work)
        out = _MergedTTTAttention.apply(q32, k32, v32, kds, vds, scale)
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
