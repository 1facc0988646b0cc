"""Tiny real components for the speculative-decoding tests (imported by the test_decoding_* files).

A random 4-layer Llama (transformers) as the target, and EAGLE-3 drafters over it: a random
one (the "bad" drafter: lossless but slow) and one briefly fitted to the target's own greedy
continuations (the "good" drafter: many drafts accepted, so the multi-token paths run).
Tests over these models run on one thread (the `one_thread` fixture of conftest.py).
"""

from __future__ import annotations

import functools

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from eagle3.decoding.engine import SpecEngine, greedy_decode
from eagle3.drafter import DrafterConfig, Eagle3Drafter
from eagle3.target.capture import capture_hidden_states

V, H, LAYERS = 320, 64, 4
AUX = [0, 1, 2]
EOS = frozenset({V - 1})


def tiny_target(dtype: torch.dtype = torch.float64, seed: int = 0, vocab: int = V) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=vocab,
        hidden_size=H,
        intermediate_size=128,
        num_hidden_layers=LAYERS,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=512,
        rope_theta=10000.0,
        tie_word_embeddings=False,
        initializer_range=0.2,
        bos_token_id=0,
        eos_token_id=vocab - 1,
        pad_token_id=vocab - 1,
    )
    return LlamaForCausalLM(cfg).to(dtype).eval().requires_grad_(False)


def random_drafter(target: LlamaForCausalLM, draft_vocab: int | None = None, seed: int = 1) -> Eagle3Drafter:
    """Random weights; with draft_vocab < V a random d2t/t2d mapping."""
    vocab = target.config.vocab_size
    k = draft_vocab or vocab
    cfg = DrafterConfig.from_target_config(target.config, k, AUX)
    torch.manual_seed(seed)
    drafter = Eagle3Drafter(cfg, target.get_input_embeddings().weight)
    if k < vocab:
        ids = torch.randperm(vocab)[:k].sort().values
        t2d = torch.zeros(vocab, dtype=torch.bool)
        t2d[ids] = True
        drafter.set_vocab_mapping(ids - torch.arange(k), t2d)
    dtype = target.get_input_embeddings().weight.dtype
    return drafter.to(dtype).eval().requires_grad_(False)


def prompts(n: int, length: int = 10, seed: int = 0, vocab: int = V) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(1, vocab - 1, (length,), generator=g).tolist() for _ in range(n)]


@functools.cache
def fitted_pair(seed: int = 0) -> tuple[LlamaForCausalLM, Eagle3Drafter]:
    """A float64 target and a drafter fitted (step 0 and one self-fed step) to its greedy outputs
    on `prompts(8)`: most drafts on those prompts are right. Fitted in float32 (faster)."""
    target = tiny_target(seed=seed)
    seqs = [p + greedy_decode(target, p, 40, frozenset()).tokens for p in prompts(8, seed=seed)]
    ids = torch.tensor(seqs)
    with torch.no_grad(), capture_hidden_states(target.model.layers, target.model.norm, AUX) as cap:
        target(ids)
        aux = cap.aux_hidden().float()
    drafter = random_drafter(target, seed=seed + 1).float().requires_grad_(True)
    drafter.embed_tokens.weight.requires_grad_(False)
    pos = torch.arange(ids.shape[1] - 2)[None]
    opt = torch.optim.Adam([p for p in drafter.parameters() if p.requires_grad], lr=3e-3)
    ce = torch.nn.functional.cross_entropy
    for _ in range(120):
        hidden = drafter(ids[:, 1:-1], drafter.project(aux[:, :-2]), pos)
        loss = ce(drafter.logits(hidden).flatten(0, 1), ids[:, 2:].flatten())
        # one self-fed step: the drafter's own hidden at t drafts token t+3
        second = drafter(ids[:, 2:-1], hidden[:, :-1], pos[:, :-1] + 1)
        loss = loss + 0.5 * ce(drafter.logits(second).flatten(0, 1), ids[:, 3:].flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()
    return target, drafter.double().eval().requires_grad_(False)


def engine(target: LlamaForCausalLM, drafter: Eagle3Drafter, **kw) -> SpecEngine:
    return SpecEngine(target, drafter, target.model.layers, target.model.norm, **kw)
