"""Speculative decoding of a transformers target with a DFlash block drafter: a block drafted in
one drafter forward, verified in one target forward.

State between steps (m = position of the newest committed token x_m, the bonus token):
- the target's KV cache holds positions 0..m-1 (x_m is fed by the next verification);
- the drafter's context cache holds keys and values of the target-layer features of positions
  0..m-1 (ContextCache), added as the target computes them: the prompt's at prefill, then the
  verified tokens' after each step.

One step: (1) the drafter runs the block [x_m, mask x (B-1)] at positions m..m+B-1 over the whole
context; its outputs at block positions 1..B-1 through the target's lm_head give the drafts
y_1..y_{B-1} (argmax, or sampled at eval.temperature). (2) One target forward verifies
[x_m, y_1..y_{B-1}] and captures the target layers. (3) The chain acceptance rule (verify.py, as
for EAGLE-3: greedy, or speculative sampling) accepts y_1..y_a and gives the next token; the
target's cache keeps x_m, y_1..y_a, whose features become the drafter's new context.

This is the reference's loop (z-lab/dflash dflash_generate, SGLang's DFLASH worker), so
`Generation.accepted` per step is the leading run of the block's drafts accepted: acceptance by
position within the block is per_position_acceptance over depth block_size - 1.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch
from torch import Tensor
from transformers import DynamicCache, PreTrainedModel

from eagle3.core.inputs import InputError
from eagle3.core.packed import pack_linears
from eagle3.core.params import Params, TargetParams
from eagle3.decoding import verify
from eagle3.decoding.engine import Generation, TargetRunner, _finish
from eagle3.decoding.kv import keep_verified
from eagle3.decoding.setup import DecodingSetup
from eagle3.drafter.dflash import ContextCache, DFlashDrafter
from eagle3.drafter.dflash_export import drafter_kind, load_dflash, load_dflash_config
from eagle3.dtypes.policy import resolve_dtype
from eagle3.dtypes.probes import DraftShape, Shape, Work
from eagle3.target.capture import capture_hidden_states
from eagle3.target.load import Target, load_target


class DFlashEngine:
    """Speculative decoding with a DFlash drafter; see the module doc for the loop."""

    def __init__(
        self,
        model: PreTrainedModel,
        drafter: DFlashDrafter,
        decoder_layers: torch.nn.ModuleList,
        final_norm: torch.nn.Module,
        temperature: float = 0.0,
        seed: int = 0,
    ):
        if temperature < 0:
            raise ValueError(f"eval.temperature must be >= 0 (got {temperature})")
        if why := drafter.cfg.mismatch(model.config.get_text_config().vocab_size, len(decoder_layers)):
            raise ValueError(f"the drafter was {why}")
        self.model, self.drafter = model, drafter
        self.target = TargetRunner(model)
        self.embed = model.get_input_embeddings()
        self.layers, self.norm = decoder_layers, final_norm
        self.block, self.mask_id = drafter.cfg.block_size, drafter.cfg.mask_token_id
        self.temperature = temperature
        self.generator = torch.Generator().manual_seed(seed)

    @property
    def max_depth(self) -> int:
        """The most drafts one step can accept: the block's drafted positions."""
        return self.block - 1

    @classmethod
    def for_target(cls, target: Target, drafter: DFlashDrafter, **settings: object) -> DFlashEngine:
        return cls(target.model, drafter, target.decoder_layers, target.final_norm, **settings)

    @property
    def sampling(self) -> bool:
        return self.temperature > 0

    def _probs(self, logits: Tensor) -> Tensor:
        return torch.softmax(logits.double() / self.temperature, dim=-1)

    def _next_token(self, logits: Tensor) -> int:
        if not self.sampling:
            return int(logits.argmax())
        return int(torch.multinomial(self._probs(logits), 1, generator=self.generator))

    def draft_block(
        self, anchor: int, m: int, context: list[tuple[Tensor, Tensor]]
    ) -> tuple[Tensor, Tensor | None]:
        """block_size - 1 drafts after `anchor` at position m (target ids), and their draft
        distributions [B-1, V] when sampling."""
        ids = torch.full((1, self.block), self.mask_id, dtype=torch.long)
        ids[0, 0] = anchor
        embeds = self.embed(ids)
        hidden = self.drafter(embeds, torch.arange(m, m + self.block)[None], context)
        # the drafter's rows through the target's own head, as training scored them
        head = self.target.head
        logits = head(hidden[0, 1:].to(head.weight.dtype))
        if not self.sampling:
            return logits.argmax(-1), None
        q = self._probs(logits)
        return torch.multinomial(q, 1, generator=self.generator)[:, 0], q

    def accept(self, draft: list[int], q: Tensor | None, hidden: Tensor) -> tuple[int, int]:
        """The chain rule on the verification's hidden states [B, H]: (accepted count, next token)."""
        logits = self.target.logits(hidden).__getitem__
        if not self.sampling:
            return verify.greedy_chain(draft, logits)
        q_at = [float(q[i, token]) for i, token in enumerate(draft)]
        return verify.sample_chain(
            draft, q_at, lambda i: q[i], lambda i: self._probs(logits(i)), self.generator
        )

    @torch.no_grad()
    def generate(self, prompt_ids: list[int], max_new_tokens: int, eos_ids: frozenset[int]) -> Generation:
        start = time.perf_counter()
        target, drafter = self.target, self.drafter
        cache, context = DynamicCache(config=self.model.config), ContextCache(len(drafter.layers))
        n = len(prompt_ids)
        result = Generation(tokens=[], seconds=0.0)
        with capture_hidden_states(self.layers, self.norm, drafter.cfg.target_layer_ids) as cap:
            hidden = target.hidden(torch.tensor(prompt_ids), torch.arange(n), cache)
            out = [self._next_token(target.logits(hidden[-1]))]
            result.prefill_s = time.perf_counter() - start
            pending, pending_at = cap.aux_hidden(), torch.arange(n)  # features of positions 0..n-1
            m = n  # position of the newest token out[-1]
            done = out[-1] in eos_ids or len(out) >= max_new_tokens
            while not done:
                t0 = time.perf_counter()
                kv = context.append(drafter.context(pending, pending_at[None]))
                draft, q = self.draft_block(out[-1], m, kv)
                t1 = time.perf_counter()
                ids = torch.cat([torch.tensor([out[-1]]), draft])
                hidden = target.hidden(ids, torch.arange(m, m + self.block), cache)
                accepted, nxt = self.accept(draft.tolist(), q, hidden)
                keep_verified(cache, self.block, list(range(accepted + 1)))
                pending, pending_at = cap.aux_hidden()[:, : accepted + 1], torch.arange(m, m + accepted + 1)
                new = draft[:accepted].tolist() + [nxt]
                m += len(new)
                result.draft_s += t1 - t0
                result.verify_s += time.perf_counter() - t1
                result.accepted.append(accepted)
                result.drafter_accepted.append(accepted)
                out, done = _finish(out + new, max_new_tokens, eos_ids)
        result.tokens = out
        result.seconds = time.perf_counter() - start
        return result


def block_shape(block_size: int) -> DraftShape:
    """A DFlash step as the dtype probes see it: a chain of block_size - 1 drafts, verified at once."""
    return DraftShape(mode="chain", k=block_size - 1, topk=1, tree_budget=block_size - 1, lookup_tokens=0)


class DFlashSetup(DecodingSetup):
    """A target and a DFlash drafter loaded for decoding (DecodingSetup's interface: speculative-eval
    and the benches take either). The EAGLE-3 draft-shape keys (eval.mode, k, topk, tree_budget,
    lookup_tokens) do not apply: a step drafts the drafter's block."""

    @classmethod
    def load(
        cls,
        target: TargetParams,
        drafter_dir: Path | None,
        drafter_dtype: str | None = None,
        pack: bool = True,
        draft: DraftShape | None = None,
    ) -> DFlashSetup:
        if drafter_dir is None:
            raise ValueError("a DFlash decoding needs an exported DFlash drafter")
        cfg = load_dflash_config(drafter_dir)
        shape = block_shape(cfg.block_size)
        loaded = load_target(target, job="decode", draft=shape)
        if why := cfg.mismatch(loaded.vocab_size, loaded.num_layers):
            raise InputError(f"{drafter_dir} was {why}")
        dtype = loaded.model.dtype
        if drafter_dtype is not None:
            dtype = resolve_dtype(drafter_dtype, Work.of("draft", Shape.of(cfg, cfg.vocab_size), shape))
        drafter = load_dflash(drafter_dir, dtype)
        if pack:
            pack_linears(loaded.model)
            pack_linears(drafter)
        return cls(loaded, drafter, dtype, pack)

    def with_drafter(self, drafter_dir: Path) -> DFlashSetup:
        drafter = load_dflash(drafter_dir, self.drafter_dtype)
        if why := drafter.cfg.mismatch(self.target.vocab_size, self.target.num_layers):
            raise InputError(f"{drafter_dir} was {why}")
        if self.packed:
            pack_linears(drafter)
        return DFlashSetup(self.target, drafter, self.drafter_dtype, self.packed)

    def engine(self, **settings: object) -> DFlashEngine:
        kept = {k: settings[k] for k in ("temperature", "seed") if k in settings}
        return DFlashEngine.for_target(self.target, self.drafter, **kept)


def setup_class(drafter_dir: Path) -> type[DecodingSetup]:
    """The decoding setup of the drafter's family (its config.json's architecture)."""
    return DFlashSetup if drafter_kind(drafter_dir) == "dflash" else DecodingSetup


def setup_for_eval(params: Params, drafter_dir: Path) -> DecodingSetup:
    """The drafter's decoding setup, of its family, for speculative-eval's params."""
    return setup_class(drafter_dir).for_eval(params, drafter_dir)
