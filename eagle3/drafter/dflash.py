"""The DFlash block drafter (arXiv 2602.06036), laid out as SGLang 0.5.23 loads it for
`--speculative-algorithm DFLASH` (srt/models/dflash.py `DFlashDraftModel`).

What it computes, as the reference (z-lab/dflash dflash/model.py) and SGLang do:
- context: the target's hidden states of the layers `target_layer_ids` (output ids, as
  extract.aux_layers), concatenated per token and projected, hidden_norm(fc(...)) -> H. Each
  draft layer turns that projection (no input norm) into its own keys and values at the token's
  position: k_norm(k_proj(ctx)) rotated, v_proj(ctx);
- a block: the last verified token (the anchor) then `block_size - 1` mask tokens, embedded with
  the target's own embedding, at positions anchor .. anchor + block_size - 1. Each of
  `num_hidden_layers` Qwen3-style decoder layers (q_norm/k_norm per head, RoPE, SwiGLU MLP) lets
  every block position attend to the context before the anchor and to the whole block, in both
  directions (SGLang: ENCODER_ONLY attention);
- output: norm(hidden) of block position k >= 1, through the target's lm_head, is the draft of
  the token at anchor + k (same-position prediction, not next-token).

The drafter has no embedding and no lm_head of its own: it borrows the target's, so its
vocabulary is the target's (no d2t/t2d). The mask token is a real id of the target's vocabulary
(SGLang refuses one past it), whose embedding row is the target's.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from transformers.models.llama.modeling_llama import rotate_half

from eagle3.drafter.config import _checked_rope_scaling, _llama_head_dim, _rope_scaling, _rope_theta
from eagle3.drafter.model import MLP, RMSNorm, Rotary

ARCHITECTURE = "DFlashDraftModel"  # the name SGLang's model registry maps to srt/models/dflash.py


@dataclass
class DFlashConfig:
    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    vocab_size: int  # the target's: the drafter drafts through its lm_head
    num_hidden_layers: int
    block_size: int
    # output ids of the target layers fed to fc (id L = the output of decoder layer L)
    target_layer_ids: list[int] = field(default_factory=list)
    num_target_layers: int = 0  # the target's decoder layers (SGLang warns when the runtime's differ)
    mask_token_id: int = 0
    mask_token: str | None = None  # its text in the target's tokenizer (SGLang checks the two agree)
    hidden_act: str = "silu"
    rope_scaling: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        if self.block_size < 2:
            raise ValueError(f"block_size must be >= 2 (the anchor and a draft), got {self.block_size}")
        if not self.target_layer_ids:
            raise ValueError("target_layer_ids must list at least one layer id")
        if not 0 <= self.mask_token_id < self.vocab_size:
            raise ValueError(f"mask_token_id must be in 0..{self.vocab_size - 1}, got {self.mask_token_id}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )
        if self.hidden_act != "silu":
            raise ValueError(f"hidden_act: only 'silu' is supported, got {self.hidden_act!r}")
        self.target_layer_ids = [int(i) for i in self.target_layer_ids]
        self.rope_scaling = _checked_rope_scaling(self.rope_scaling)

    @property
    def draft_vocab_size(self) -> int:
        """The drafter proposes from the target's whole vocabulary (it borrows its lm_head)."""
        return self.vocab_size

    @property
    def target_hidden_size(self) -> int:
        return self.hidden_size

    @property
    def rope_parameters(self) -> dict[str, Any]:
        return {"rope_theta": self.rope_theta, "rope_type": "default"} | (self.rope_scaling or {})

    @classmethod
    def from_target_config(
        cls,
        target_hf_config: Any,
        num_layers: int,
        block_size: int,
        target_layer_ids: list[int],
        mask_token_id: int,
        mask_token: str | None = None,
        shape: dict[str, int | None] | None = None,
    ) -> DFlashConfig:
        """Sizes from the target's HF config (its width, heads, MLP and RoPE), as the reference
        drafters take them; `shape` overrides intermediate_size / heads / head_dim (train.*)."""
        c = getattr(target_hf_config, "text_config", None) or target_hf_config
        heads = c.num_attention_heads
        sizes = {
            "intermediate_size": c.intermediate_size,
            "num_attention_heads": heads,
            "num_key_value_heads": getattr(c, "num_key_value_heads", None) or heads,
            "head_dim": _llama_head_dim(c),
        }
        sizes |= {k: v for k, v in (shape or {}).items() if v is not None}
        return cls(
            hidden_size=c.hidden_size,
            rms_norm_eps=float(getattr(c, "rms_norm_eps", 1e-6)),
            rope_theta=_rope_theta(c),
            rope_scaling=_rope_scaling(c),
            max_position_embeddings=c.max_position_embeddings,
            vocab_size=c.vocab_size,
            num_hidden_layers=num_layers,
            block_size=block_size,
            target_layer_ids=list(target_layer_ids),
            num_target_layers=c.num_hidden_layers,
            mask_token_id=mask_token_id,
            mask_token=mask_token,
            hidden_act=getattr(c, "hidden_act", "silu"),
            **sizes,
        )

    def to_hf_dict(self) -> dict[str, Any]:
        """config.json as SGLang's parse_dflash_draft_config and DFlashDraftModel read it (a Qwen3
        config plus block_size, num_target_layers and dflash_config), in the form SpecForge and
        z-lab export their drafters."""
        d = {
            "architectures": [ARCHITECTURE],
            "model_type": "qwen3",
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "hidden_act": self.hidden_act,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_parameters": self.rope_parameters,
            "max_position_embeddings": self.max_position_embeddings,
            "vocab_size": self.vocab_size,
            "attention_bias": False,
            "attention_dropout": 0.0,
            # full attention in every layer: SGLang then attends without a causal mask (ENCODER_ONLY)
            "layer_types": ["full_attention"] * self.num_hidden_layers,
            "use_sliding_window": False,
            "sliding_window": None,
            "tie_word_embeddings": False,
            "block_size": self.block_size,
            "num_target_layers": self.num_target_layers,
            "dflash_config": {
                "target_layer_ids": list(self.target_layer_ids),
                "mask_token_id": self.mask_token_id,
            },
            "torch_dtype": "bfloat16",
        }
        if self.mask_token is not None:
            d["dflash_config"]["mask_token"] = self.mask_token
        if self.rope_scaling is not None:
            d["rope_scaling"] = dict(self.rope_scaling)
        return d

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any]) -> DFlashConfig:
        """The config of an exported DFlash drafter (refuses another architecture)."""
        arch = d.get("architectures") or []
        if ARCHITECTURE not in arch:
            raise ValueError(f"config.json: architectures must contain {ARCHITECTURE!r}, got {arch}")
        dflash = d.get("dflash_config") or {}
        layers = dflash.get("target_layer_ids", d.get("target_layer_ids"))
        mask = dflash.get("mask_token_id", d.get("mask_token_id"))
        block = dflash.get("block_size", d.get("block_size"))
        needed = {"target_layer_ids": layers, "mask_token_id": mask, "block_size": block}
        missing = [k for k, v in needed.items() if v is None]
        if missing:
            raise ValueError(f"config.json: DFlash drafter without {', '.join(missing)}")
        heads = d["num_attention_heads"]
        return cls(
            hidden_size=d["hidden_size"],
            intermediate_size=d["intermediate_size"],
            num_attention_heads=heads,
            num_key_value_heads=d.get("num_key_value_heads") or heads,
            head_dim=d.get("head_dim") or d["hidden_size"] // heads,
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            rope_theta=_rope_theta(d),
            rope_scaling=_rope_scaling(d),
            max_position_embeddings=d["max_position_embeddings"],
            vocab_size=d["vocab_size"],
            num_hidden_layers=d["num_hidden_layers"],
            block_size=int(block),
            target_layer_ids=list(layers),
            num_target_layers=int(d.get("num_target_layers") or 0),
            mask_token_id=int(mask),
            mask_token=dflash.get("mask_token", d.get("mask_token")),
            hidden_act=d.get("hidden_act", "silu"),
        )

    def mismatch(self, vocab_size: int, num_layers: int) -> str | None:
        """Why this drafter cannot run on a target of these sizes, or None when it fits."""
        if self.vocab_size != vocab_size or max(self.target_layer_ids) >= num_layers:
            return (
                f"trained for another target (vocab {self.vocab_size}, layers {self.target_layer_ids}; "
                f"target vocab {vocab_size}, {num_layers} layers)"
            )
        return None

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def rotate(x: Tensor, rotary: Rotary, position_ids: Tensor) -> Tensor:
    """RoPE of `x` [B, heads, T, d] alone at `position_ids` [B or 1, T] (keys of the context)."""
    cos, sin = rotary.embedding(x, position_ids)
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return x * cos + rotate_half(x) * sin


class BlockAttention(nn.Module):
    """Qwen3 attention (per-head q_norm / k_norm before RoPE) whose queries, the block's, attend to
    keys of the context (handed in per layer) and of the block itself."""

    def __init__(self, cfg: DFlashConfig):
        super().__init__()
        self.heads, self.kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
        self.head_dim = cfg.head_dim
        h = cfg.hidden_size
        self.q_proj = nn.Linear(h, self.heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(h, self.kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(h, self.kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.heads * self.head_dim, h, bias=False)
        self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.rotary = Rotary(cfg)

    def keys_values(self, x: Tensor, position_ids: Tensor) -> tuple[Tensor, Tensor]:
        """Rotated keys and values [B, kv_heads, T, d] of `x` [B, T, H] (SGLang's kv_proj_only +
        k_norm + RoPE: what it writes into the draft KV cache for context tokens)."""
        b, t, _ = x.shape
        k = self.k_norm(self.k_proj(x).view(b, t, self.kv_heads, self.head_dim)).transpose(1, 2)
        v = self.v_proj(x).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        return rotate(k, self.rotary, position_ids), v

    def forward(
        self, x: Tensor, position_ids: Tensor, context: tuple[Tensor, Tensor], mask: Tensor | None
    ) -> Tensor:
        b, t, _ = x.shape
        q = self.q_norm(self.q_proj(x).view(b, t, self.heads, self.head_dim)).transpose(1, 2)
        q = rotate(q, self.rotary, position_ids)
        k, v = self.keys_values(x, position_ids)
        k, v = torch.cat([context[0], k], dim=2), torch.cat([context[1], v], dim=2)
        if mask is not None and mask.dtype != torch.bool:
            mask = mask.to(q.dtype)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=self.kv_heads != self.heads)
        return self.o_proj(out.transpose(1, 2).reshape(b, t, self.heads * self.head_dim))


class BlockLayer(nn.Module):
    """SGLang's DFlashDecoderLayer: pre-norm attention and MLP with residuals."""

    def __init__(self, cfg: DFlashConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = BlockAttention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size)

    def forward(
        self, h: Tensor, position_ids: Tensor, context: tuple[Tensor, Tensor], mask: Tensor | None
    ) -> Tensor:
        h = h + self.self_attn(self.input_layernorm(h), position_ids, context, mask)
        return h + self.mlp(self.post_attention_layernorm(h))


class DFlashDrafter(nn.Module):
    """The block drafter; parameter names are the exported ones (export: eagle3/drafter/dflash_export.py)."""

    def __init__(self, cfg: DFlashConfig):
        super().__init__()
        self.cfg = cfg
        h = cfg.hidden_size
        self.fc = nn.Linear(len(cfg.target_layer_ids) * h, h, bias=False)
        self.hidden_norm = RMSNorm(h, cfg.rms_norm_eps)
        self.layers = nn.ModuleList(BlockLayer(cfg) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(h, cfg.rms_norm_eps)
        for module in self.modules():
            if isinstance(module, nn.Linear):
                nn.init.normal_(module.weight, std=0.02)

    @property
    def t2d(self) -> Tensor:
        """Which target ids it can propose: all of them (it drafts through the target's head)."""
        return torch.ones(self.cfg.vocab_size, dtype=torch.bool)

    def project(self, aux_hidden: Tensor) -> Tensor:
        """[B, T, nH] target layer outputs -> [B, T, H] context states hidden_norm(fc(.))."""
        if not torch.is_autocast_enabled():
            aux_hidden = aux_hidden.to(self.fc.weight.dtype)
        return self.hidden_norm(self.fc(aux_hidden))

    def context(self, aux_hidden: Tensor, position_ids: Tensor) -> list[tuple[Tensor, Tensor]]:
        """Per layer, the keys and values [B, kv_heads, T, d] of context tokens at `position_ids`."""
        ctx = self.project(aux_hidden)
        return [layer.self_attn.keys_values(ctx, position_ids) for layer in self.layers]

    def forward(
        self,
        block_embeds: Tensor,
        position_ids: Tensor,
        context: list[tuple[Tensor, Tensor]],
        mask: Tensor | None = None,
    ) -> Tensor:
        """Final-normed hidden states [B, Q, H] of the block positions (embedded block tokens
        `block_embeds` [B, Q, H] at `position_ids` [B, Q]) attending to `context` (per layer, keys
        then the block's own); `mask` [B or 1, 1, Q, S + Q] (True = visible), None = all visible."""
        h = block_embeds
        if not torch.is_autocast_enabled():
            h = h.to(self.fc.weight.dtype)
        for layer, kv in zip(self.layers, context, strict=True):
            h = layer(h, position_ids, kv, mask)
        return self.norm(h)


class ContextCache:
    """The context keys and values a decoding has fed the drafter so far, per layer."""

    def __init__(self, num_layers: int):
        self.kv: list[tuple[Tensor, Tensor]] | None = None
        self.num_layers = num_layers

    @property
    def length(self) -> int:
        return 0 if self.kv is None else self.kv[0][0].shape[2]

    def append(self, kv: list[tuple[Tensor, Tensor]]) -> list[tuple[Tensor, Tensor]]:
        if self.kv is None:
            self.kv = kv
        else:
            self.kv = [
                (torch.cat([k0, k1], dim=2), torch.cat([v0, v1], dim=2))
                for (k0, v0), (k1, v1) in zip(self.kv, kv, strict=True)
            ]
        return self.kv


def resolve_mask_token(tokenizer: Any, vocab_size: int, wanted: int | None = None) -> tuple[int, str | None]:
    """(id, text) of the mask token: `wanted` (dflash.mask_token_id) when given, else the
    tokenizer's own mask token, else its last added special token that is none of bos/eos/pad/unk
    and absent from its chat template (a token no rendered conversation holds)."""
    vocab_size = int(vocab_size)
    if wanted is not None:
        if not 0 <= wanted < vocab_size:
            raise ValueError(
                f"dflash.mask_token_id: outside the target's vocabulary of {vocab_size} tokens "
                f"(allowed: 0..{vocab_size - 1}, or null) (got {wanted})"
            )
        return wanted, tokenizer.convert_ids_to_tokens(wanted) if tokenizer is not None else None
    if getattr(tokenizer, "mask_token_id", None) is not None and tokenizer.mask_token_id < vocab_size:
        return int(tokenizer.mask_token_id), tokenizer.mask_token
    used = {tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id, tokenizer.unk_token_id}
    template = tokenizer.chat_template if isinstance(tokenizer.chat_template, str) else ""
    candidates = [
        (i, tok.content)
        for i, tok in sorted(tokenizer.added_tokens_decoder.items())
        if tok.special and i < vocab_size and i not in used and tok.content not in template
    ]
    if not candidates:
        raise ValueError(
            "dflash.mask_token_id: null, and the target's tokenizer has neither a mask token nor an "
            "unused special token: set dflash.mask_token_id to an id the data never holds"
        )
    return candidates[-1]
