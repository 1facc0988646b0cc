"""The EAGLE-3 draft model, laid out exactly like SGLang's `LlamaForCausalLMEagle3`.

One decoder layer (`midlayer`) whose attention reads concat(input_layernorm(embedding),
hidden_norm(hidden)) -- 2H wide -- plus `fc` (3H -> H) that fuses the target's three aux
hidden states, a final `norm` and an `lm_head` over the draft vocabulary (K rows). The
residual stream is the incoming hidden state (not the embedding), as in SGLang; `forward`
returns what the next draft step is fed: the stream before the final norm (EAGLE-3), or after it
with `norm_output` (EAGLE-3.1), and `logits` applies whatever is left (norm + lm_head, or
lm_head). With `fc_norm` (EAGLE-3.1) each of the three aux states is RMS-normed before `fc`.
Both follow SGLang/vLLM `llama_eagle3.py` (see config.py), so callers need not know either flag.

How the layer's attention reads keys is the caller's choice, passed to `forward` as `cache`: an
object with `attend(q, k, v, attn_mask)` (composition: the model knows no cache type). None is
plain causal attention, `DrafterCache` the decoding cache, and training passes its TTT cache
(`ttt_attention.TTTCache`).
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

from eagle3.drafter.config import DrafterConfig
from eagle3.vocab import draft_to_target_ids


class RMSNorm(nn.Module):
    """Llama's RMSNorm: normalise in float32, scale in the input dtype (as HF and SGLang do)."""

    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)


class Rotary(nn.Module):
    """The target's RoPE through transformers' own Llama rotary, so every rope_type it knows
    (default, llama3, yarn, ...) rotates exactly as transformers (and the exported config) say."""

    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        llama = LlamaConfig(
            hidden_size=cfg.hidden_size,
            num_attention_heads=cfg.num_attention_heads,
            num_key_value_heads=cfg.num_key_value_heads,
            head_dim=cfg.head_dim,
            max_position_embeddings=cfg.max_position_embeddings,
            rope_parameters=cfg.rope_parameters,
        )
        self.embedding = LlamaRotaryEmbedding(llama)

    def _apply(self, fn, recurse: bool = True):  # noqa: ANN001 - nn.Module's own signature
        # The frequencies stay float32 whatever the drafter is cast to: a bf16 inv_freq turns
        # position 300 by up to ~0.6 rad, and transformers upcasts it only after the rounding.
        frequencies = {name: getattr(self.embedding, name) for name in ("inv_freq", "original_inv_freq")}
        super()._apply(fn, recurse)
        for name, value in frequencies.items():
            if isinstance(value, Tensor):
                setattr(self.embedding, name, value.to(getattr(self.embedding, name).device))
        return self

    def forward(self, q: Tensor, k: Tensor, position_ids: Tensor) -> tuple[Tensor, Tensor]:
        # q, k [B, heads, T, d]; position_ids [B or 1, T]
        cos, sin = self.embedding(q, position_ids)
        return apply_rotary_pos_emb(q, k, cos, sin)


class AttentionCache(Protocol):
    """What the draft layer's attention is given: it attends new queries to new and held keys."""

    def attend(self, q: Tensor, k: Tensor, v: Tensor, attn_mask: Tensor | None) -> Tensor:
        """q [B, heads, T, d], k/v [B, kv_heads, T, d] (post-RoPE) -> [B, heads, T, d]."""
        ...


def sdpa(q: Tensor, k: Tensor, v: Tensor, attn_mask: Tensor | None, past: int = 0) -> Tensor:
    """Causal attention over (past + new) keys, or under an explicit mask; GQA without copies."""
    gqa = k.shape[1] != q.shape[1]
    if attn_mask is not None:
        if attn_mask.dtype != torch.bool:
            attn_mask = attn_mask.to(q.dtype)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, enable_gqa=gqa)
    # causal over (cache + new): query i sits at absolute index past + i
    t = q.shape[2]
    causal = t > 1
    mask = _causal_mask(t, past, q.device) if causal and past else None
    return F.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, is_causal=causal and not past, enable_gqa=gqa
    )


class DrafterCache:
    """A plain K/V store for decoding: k, v are [B, kv_heads, S, head_dim] (keys post-RoPE)."""

    def __init__(self) -> None:
        self.k: Tensor | None = None
        self.v: Tensor | None = None

    @property
    def length(self) -> int:
        return 0 if self.k is None else self.k.shape[2]

    def append(self, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        if self.k is None:
            self.k, self.v = k, v
        else:
            self.k = torch.cat([self.k, k], dim=2)
            self.v = torch.cat([self.v, v], dim=2)
        return self.k, self.v

    def crop(self, n_keep: int) -> None:
        """Keep the first n_keep positions (drop rejected drafts)."""
        if self.k is not None:
            self.k = self.k[:, :, :n_keep]
            self.v = self.v[:, :, :n_keep]

    def attend(self, q: Tensor, k: Tensor, v: Tensor, attn_mask: Tensor | None) -> Tensor:
        past = self.length
        k, v = self.append(k, v)
        return sdpa(q, k, v, attn_mask, past)


class Attention(nn.Module):
    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        self.heads, self.kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
        self.head_dim = cfg.head_dim
        width = 2 * cfg.hidden_size  # reads concat(embedding, hidden)
        self.q_proj = nn.Linear(width, self.heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(width, self.kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(width, self.kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.heads * self.head_dim, cfg.hidden_size, bias=False)
        self.rotary = Rotary(cfg)

    def forward(
        self, x: Tensor, position_ids: Tensor, cache: AttentionCache | None, attn_mask: Tensor | None
    ) -> Tensor:
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, self.heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        q, k = self.rotary(q, k, position_ids)
        out = sdpa(q, k, v, attn_mask) if cache is None else cache.attend(q, k, v, attn_mask)
        return self.o_proj(out.transpose(1, 2).reshape(b, t, self.heads * self.head_dim))


def _causal_mask(t: int, past: int, device: torch.device) -> Tensor:
    """Boolean [T, past + T]: query i sees keys 0..past+i."""
    rows = torch.arange(t, device=device)[:, None] + past
    return torch.arange(past + t, device=device)[None, :] <= rows


class MLP(nn.Module):
    def __init__(self, hidden: int, inter: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, inter, bias=False)
        self.up_proj = nn.Linear(hidden, inter, bias=False)
        self.down_proj = nn.Linear(inter, hidden, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class MidLayer(nn.Module):
    """SGLang's EAGLE-3 `LlamaDecoderLayer`: attention over [norm(embed), norm(hidden)]."""

    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size)

    def forward(
        self,
        embeds: Tensor,
        hidden: Tensor,
        position_ids: Tensor,
        cache: AttentionCache | None,
        attn_mask: Tensor | None,
    ) -> Tensor:
        residual = hidden
        x = torch.cat([self.input_layernorm(embeds), self.hidden_norm(hidden)], dim=-1)
        residual = residual + self.self_attn(x, position_ids, cache, attn_mask)
        return residual + self.mlp(self.post_attention_layernorm(residual))


class Eagle3Drafter(nn.Module):
    def __init__(self, cfg: DrafterConfig, embed_weight: Tensor | None = None):
        super().__init__()
        self.cfg = cfg
        h = cfg.hidden_size
        self.embed_tokens = nn.Embedding(cfg.vocab_size, h)
        if embed_weight is not None:
            if tuple(embed_weight.shape) != (cfg.vocab_size, h):
                raise ValueError(
                    f"embed_weight has shape {tuple(embed_weight.shape)}, expected the target's "
                    f"[{cfg.vocab_size}, {h}]"
                )
            # shares the target's storage when dtypes agree (no copy for a 1B-param embedding)
            self.embed_tokens.weight = nn.Parameter(embed_weight.detach(), requires_grad=False)
        self.embed_tokens.weight.requires_grad_(False)
        # weights fc_norm.{0,1,2}.weight: the names SGLang/vLLM llama_eagle3.py and SpecForge load
        self.fc_norm = (
            nn.ModuleList(RMSNorm(cfg.target_hidden_size, cfg.rms_norm_eps) for _ in cfg.aux_layer_ids)
            if cfg.fc_norm
            else None
        )
        self.fc = nn.Linear(3 * cfg.target_hidden_size, h, bias=False)
        self.midlayer = MidLayer(cfg)
        self.norm = RMSNorm(h, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(h, cfg.draft_vocab_size, bias=False)
        # identity mapping until vocab-map's is loaded
        self.register_buffer("d2t", torch.zeros(cfg.draft_vocab_size, dtype=torch.int64))
        t2d = torch.zeros(cfg.vocab_size, dtype=torch.bool)
        t2d[: cfg.draft_vocab_size] = True
        self.register_buffer("t2d", t2d)
        self._init_weights(embed_weight is None)

    def _init_weights(self, init_embed: bool) -> None:
        for module in self.modules():
            if isinstance(module, nn.Linear):
                nn.init.normal_(module.weight, std=0.02)
        if init_embed:
            nn.init.normal_(self.embed_tokens.weight, std=0.02)

    def set_vocab_mapping(self, d2t: Tensor, t2d: Tensor) -> None:
        k, v = self.cfg.draft_vocab_size, self.cfg.vocab_size
        if tuple(d2t.shape) != (k,) or tuple(t2d.shape) != (v,):
            raise ValueError(
                f"vocab mapping shapes d2t {tuple(d2t.shape)}, t2d {tuple(t2d.shape)} do not match the "
                f"drafter (K={k}, V={v})"
            )
        target_ids = draft_to_target_ids(d2t.cpu())
        if int(t2d.sum()) != k or not bool(t2d.cpu()[target_ids].all()):
            raise ValueError("vocab mapping is inconsistent: t2d does not mark exactly the targets of d2t")
        self.d2t.copy_(d2t.long())
        self.t2d.copy_(t2d.bool())

    def project(self, aux_hidden: Tensor) -> Tensor:
        """[B, T, 3H] target aux states -> [B, T, H] (per-layer RMSNorm first with fc_norm)."""
        if not torch.is_autocast_enabled():
            aux_hidden = aux_hidden.to(self.fc.weight.dtype)
        if self.fc_norm is not None:
            chunks = aux_hidden.chunk(len(self.fc_norm), dim=-1)
            aux_hidden = torch.cat([norm(x) for norm, x in zip(self.fc_norm, chunks, strict=True)], dim=-1)
        return self.fc(aux_hidden)

    def forward(
        self,
        input_ids: Tensor,
        hidden: Tensor,
        position_ids: Tensor,
        cache: AttentionCache | None = None,
        attn_mask: Tensor | None = None,
    ) -> Tensor:
        """One decoder-layer pass; returns the new hidden [B, T, H] that the next step is fed:
        before the final norm, or after it with norm_output."""
        embeds = self.embed_tokens(input_ids)
        if not torch.is_autocast_enabled():
            embeds = embeds.to(hidden.dtype)
        out = self.midlayer(embeds, hidden, position_ids, cache, attn_mask)
        return self.norm(out) if self.cfg.norm_output else out

    def logits(self, hidden: Tensor) -> Tensor:
        """[B, T, K] over the draft vocabulary from a `forward` output (normed once either way)."""
        return self.lm_head(hidden if self.cfg.norm_output else self.norm(hidden))

    def to_target_ids(self, draft_ids: Tensor) -> Tensor:
        return draft_ids + self.d2t[draft_ids]
