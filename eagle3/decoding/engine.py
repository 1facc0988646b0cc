"""EAGLE-3 speculative decoding of a transformers target with an `Eagle3Drafter`.

State between steps (m = position of the newest committed token x_m):
- the target's KV cache holds positions 0..m-1 (x_m is fed by the next verification);
- the drafter's cache holds pairs up to some position; the pairs it has not seen yet are
  pending: (fc(aux hidden of position t), token t+1) at position t, the EAGLE alignment the
  trainer uses, for t up to m-1.

One step: (1) the drafter runs the pending pairs, its last output drafts x_{m+1}; further
draft steps feed its own hidden state forward (chain: k tokens; tree: the top-k children of
the best `topk` nodes per level, k levels, then the `tree_budget` best nodes by cumulative
draft log-probability, plus with `lookup_tokens` the prompt-lookup continuation grafted on as
one more branch); its cache is cropped back to the committed pairs afterwards.
(2) One target forward verifies x_m plus all drafted tokens (a tree uses an additive
ancestor mask and explicit position ids) and captures the aux hidden states. (3) The
acceptance rule (verify.py) picks the accepted path and the next token; the target's cache
keeps only the path's entries, and the path's aux states become the new pending pairs.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
from torch import Tensor
from transformers import DynamicCache, PreTrainedModel

from eagle3.decoding import verify
from eagle3.decoding.kv import keep_verified
from eagle3.decoding.lookup import lookup_continuation
from eagle3.decoding.tree import DraftTree, graft_chain, verify_mask
from eagle3.drafter import DrafterCache, Eagle3Drafter
from eagle3.target.capture import capture_hidden_states
from eagle3.target.load import Target


@dataclass
class Generation:
    """What one decoding produced. `tokens` are the new tokens (prompt excluded)."""

    tokens: list[int]
    seconds: float
    accepted: list[int] = field(default_factory=list)  # accepted draft tokens per verification
    # of those, the leading run of drafter-made nodes: what the drafter's tree alone would have
    # accepted in that step (exact for greedy; equal to `accepted` without a lookup branch)
    drafter_accepted: list[int] = field(default_factory=list)
    draft_s: float = 0.0
    verify_s: float = 0.0
    prefill_s: float = 0.0


class TargetRunner:
    """The target split at its final norm: `hidden` runs the decoder stack (the capture hooks
    fire there) and `logits` applies the lm_head to the rows a caller actually needs."""

    def __init__(self, model: PreTrainedModel):
        self.model = model
        self.decoder = model.get_decoder()
        self.head = model.get_output_embeddings()
        self.softcap = getattr(model.config, "final_logit_softcapping", None)
        self.dtype = self.head.weight.dtype

    def hidden(
        self, ids: Tensor, positions: Tensor, cache: DynamicCache, mask: Tensor | None = None
    ) -> Tensor:
        """Final (post-norm) hidden states [T, H] of `ids` [T] at `positions` [T]."""
        out = self.decoder(
            input_ids=ids[None],
            position_ids=positions[None],
            attention_mask=mask,
            cache=cache,
            use_cache=True,
        )
        return out.last_hidden_state[0]

    def logits(self, hidden: Tensor) -> Tensor:
        logits = self.head(hidden)
        if self.softcap:  # Gemma-style final soft-capping, as the model's own forward does
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits


def _finish(tokens: list[int], max_new_tokens: int, eos_ids: frozenset[int]) -> tuple[list[int], bool]:
    """Cut at the first EOS (kept) or at max_new_tokens; True when decoding is over."""
    for i, token in enumerate(tokens[:max_new_tokens]):
        if token in eos_ids:
            return tokens[: i + 1], True
    return tokens[:max_new_tokens], len(tokens) >= max_new_tokens


@torch.no_grad()
def greedy_decode(
    model: PreTrainedModel, prompt_ids: list[int], max_new_tokens: int, eos_ids: frozenset[int]
) -> Generation:
    """Plain greedy decoding, one target forward per token: the baseline."""
    start = time.perf_counter()
    target = TargetRunner(model)
    cache = DynamicCache(config=model.config)
    n = len(prompt_ids)
    hidden = target.hidden(torch.tensor(prompt_ids), torch.arange(n), cache)
    token = target.logits(hidden[-1]).argmax()
    out = [int(token)]
    while len(out) < max_new_tokens and out[-1] not in eos_ids:
        hidden = target.hidden(token.view(1), torch.tensor([n + len(out) - 1]), cache)
        token = target.logits(hidden[-1]).argmax()
        out.append(int(token))
    return Generation(tokens=out, seconds=time.perf_counter() - start)


class SpecEngine:
    """Speculative decoding with an EAGLE-3 drafter; see the module doc for the loop."""

    def __init__(
        self,
        model: PreTrainedModel,
        drafter: Eagle3Drafter,
        decoder_layers: torch.nn.ModuleList,
        final_norm: torch.nn.Module,
        mode: str = "chain",
        k: int = 4,
        topk: int = 4,
        tree_budget: int = 16,
        temperature: float = 0.0,
        seed: int = 0,
        lookup_tokens: int = 0,
    ):
        if mode not in ("chain", "tree"):
            raise ValueError(f"eval.mode must be 'chain' or 'tree' (got {mode!r})")
        if k < 1:
            raise ValueError(f"eval.k must be >= 1 draft tokens per step (got {k})")
        if mode == "tree" and (topk < 1 or tree_budget < 1):
            raise ValueError(f"eval.topk and eval.tree_budget must be >= 1 (got {topk}, {tree_budget})")
        if lookup_tokens < 0 or (lookup_tokens and mode != "tree"):
            raise ValueError(
                f"eval.lookup_tokens needs eval.mode 'tree' and must be >= 0 (got {lookup_tokens})"
            )
        if temperature < 0:
            raise ValueError(f"eval.temperature must be >= 0 (got {temperature})")
        # get_text_config: a multimodal wrapper (Kimi-K2.5) keeps the vocabulary in text_config
        if why := drafter.cfg.mismatch(model.config.get_text_config().vocab_size, len(decoder_layers)):
            raise ValueError(f"the drafter was {why}")
        self.model, self.drafter = model, drafter
        self.target = TargetRunner(model)
        self.layers, self.norm = decoder_layers, final_norm
        self.aux_layers = list(drafter.cfg.aux_layer_ids)
        self.mode, self.k, self.budget = mode, k, tree_budget
        self.topk = min(topk, drafter.cfg.draft_vocab_size)
        self.temperature = temperature
        self.lookup_tokens = lookup_tokens
        self.generator = torch.Generator().manual_seed(seed)
        self.draft_to_target = drafter.to_target_ids(torch.arange(drafter.cfg.draft_vocab_size))

    @property
    def max_depth(self) -> int:
        """The most draft tokens one step can accept: the chain or tree depth, or the lookup branch."""
        return max(self.k, self.lookup_tokens)

    @classmethod
    def for_target(cls, target: Target, drafter: Eagle3Drafter, **settings: object) -> SpecEngine:
        """The engine over a loaded target (its model, decoder layers and final norm)."""
        return cls(target.model, drafter, target.decoder_layers, target.final_norm, **settings)

    # -- probabilities -------------------------------------------------------------------------

    @property
    def sampling(self) -> bool:
        return self.temperature > 0

    def _probs(self, logits: Tensor) -> Tensor:
        return torch.softmax(logits.double() / self.temperature, dim=-1)

    def _next_token(self, logits: Tensor) -> int:
        if not self.sampling:
            return int(logits.argmax())
        return int(torch.multinomial(self._probs(logits), 1, generator=self.generator))

    # -- the acceptance rules (a method each, so a test can plant a faulty one) -----------------

    def accept_chain(self, draft: list[int], q: Tensor | None, hidden: Tensor) -> tuple[int, int]:
        """draft: k target ids; q [k, K]: their draft distributions (sampling); hidden [k+1, H]."""
        # one lm_head call over all k+1 rows costs about what one row does (weights read once)
        logits = self.target.logits(hidden).__getitem__
        if not self.sampling:
            return verify.greedy_chain(draft, logits)
        t2d = {int(t): d for d, t in enumerate(self.draft_to_target.tolist())}
        q_at = [float(q[i, t2d[token]]) for i, token in enumerate(draft)]

        def q_full(i: int) -> Tensor:
            row = torch.zeros(self.target.head.out_features, dtype=torch.float64)
            return row.index_copy_(0, self.draft_to_target, q[i])

        return verify.sample_chain(draft, q_at, q_full, lambda i: self._probs(logits(i)), self.generator)

    def accept_tree(self, tokens: list[int], parents: list[int], hidden: Tensor) -> tuple[list[int], int]:
        """Verification tree (root first) and its hidden states [N, H]: (path, next token)."""
        logits = self.target.logits(hidden).__getitem__
        if not self.sampling:
            return verify.greedy_tree(tokens, parents, logits)
        children: list[list[int]] = [[] for _ in tokens]
        for node, parent in enumerate(parents):
            if parent >= 0:
                children[parent].append(node)  # creation order = draft score order
        return verify.sample_tree(tokens, children, lambda i: self._probs(logits(i)), self.generator)

    # -- drafting --------------------------------------------------------------------------------

    def _draft_token(self, logits: Tensor) -> tuple[Tensor, Tensor | None]:
        """One draft token (target id, shape [1]) from draft logits [K], plus q [K] when sampling."""
        if not self.sampling:
            return self.draft_to_target[logits.argmax().view(1)], None
        q = torch.softmax(logits.double() / self.temperature, dim=-1)
        return self.draft_to_target[torch.multinomial(q, 1, generator=self.generator)], q

    def draft_chain(self, hidden: Tensor, m: int, cache: DrafterCache) -> tuple[Tensor, Tensor | None]:
        """k tokens from the drafter's output `hidden` [1, 1, H] at position m-1."""
        tokens, qs = [], []
        for i in range(self.k):
            token, q = self._draft_token(self.drafter.logits(hidden)[0, -1])
            tokens.append(token)
            qs.append(q)
            if i + 1 < self.k:
                hidden = self.drafter(token.view(1, 1), hidden, torch.tensor([[m + i]]), cache)
        return torch.cat(tokens), (torch.stack(qs) if self.sampling else None)

    def draft_tree(self, hidden: Tensor, m: int, cache: DrafterCache) -> DraftTree:
        """EAGLE-2 style dynamic tree: expand the `topk` best nodes per level, k levels deep."""
        topk, past = self.topk, cache.length
        logp = torch.log_softmax(self.drafter.logits(hidden)[0, -1].float(), dim=-1)
        top = logp.topk(topk)
        tokens = [self.draft_to_target[top.indices]]
        parents = [torch.full((topk,), -1, dtype=torch.long)]
        depths = [torch.ones(topk, dtype=torch.long)]
        scores = [top.values]
        frontier = torch.arange(topk)  # node ids to expand next
        frontier_hidden = hidden.expand(1, topk, -1)
        # Drafter-cache bookkeeping: the slot (after `past`) of each expanded node, and each
        # slot's ancestors among the expanded slots (itself included).
        slot_of: dict[int, int] = {}
        slot_anc = torch.zeros(0, 0, dtype=torch.bool)
        for depth in range(1, self.k):
            all_tokens, all_parents, all_scores = torch.cat(tokens), torch.cat(parents), torch.cat(scores)
            f, n_slots = frontier.shape[0], slot_anc.shape[0]
            parent_slots = [slot_of[p] for p in all_parents[frontier].tolist() if p >= 0]
            seen = slot_anc[parent_slots] if parent_slots else torch.zeros(f, n_slots, dtype=torch.bool)
            prefix = torch.ones(f, past, dtype=torch.bool)
            visible = torch.cat([prefix, seen, torch.eye(f, dtype=torch.bool)], dim=1)
            out = self.drafter(
                all_tokens[frontier][None],
                frontier_hidden,
                torch.full((1, f), m + depth - 1),
                cache,
                attn_mask=visible[None, None],
            )
            grown = torch.zeros(n_slots + f, n_slots + f, dtype=torch.bool)
            grown[:n_slots, :n_slots] = slot_anc
            grown[n_slots:] = visible[:, past:]
            slot_anc = grown
            slot_of.update({node: n_slots + j for j, node in enumerate(frontier.tolist())})

            logp = torch.log_softmax(self.drafter.logits(out)[0].float(), dim=-1)  # [f, K]
            top = logp.topk(topk, dim=-1)
            cand = (all_scores[frontier][:, None] + top.values).reshape(-1)
            first_new = all_tokens.shape[0]
            tokens.append(self.draft_to_target[top.indices.reshape(-1)])
            parents.append(frontier.repeat_interleave(topk))
            depths.append(torch.full((f * topk,), depth + 1, dtype=torch.long))
            scores.append(cand)
            best = cand.topk(min(topk, cand.shape[0])).indices
            frontier = first_new + best
            frontier_hidden = out[:, best // topk]
        tree = DraftTree(torch.cat(tokens), torch.cat(parents), torch.cat(depths), torch.cat(scores))
        return tree.select(self.budget)

    # -- the loop --------------------------------------------------------------------------------

    @torch.no_grad()
    def generate(self, prompt_ids: list[int], max_new_tokens: int, eos_ids: frozenset[int]) -> Generation:
        start = time.perf_counter()
        target, drafter = self.target, self.drafter
        cache, dcache = DynamicCache(config=self.model.config), DrafterCache()
        n = len(prompt_ids)
        result = Generation(tokens=[], seconds=0.0)
        with capture_hidden_states(self.layers, self.norm, self.aux_layers) as cap:
            hidden = target.hidden(torch.tensor(prompt_ids), torch.arange(n), cache)
            out = [self._next_token(target.logits(hidden[-1]))]
            result.prefill_s = time.perf_counter() - start
            pending_aux = cap.aux_hidden()  # [1, n, 3H] for positions 0..n-1
            pending_ids = torch.tensor(prompt_ids[1:] + out)
            m = n  # position of the newest token out[-1]
            done = out[-1] in eos_ids or len(out) >= max_new_tokens
            while not done:
                t0 = time.perf_counter()
                first = m - pending_ids.shape[0]
                last = drafter(
                    pending_ids[None], drafter.project(pending_aux), torch.arange(first, m)[None], dcache
                )[:, -1:]
                if self.mode == "chain":
                    draft, q = self.draft_chain(last, m, dcache)
                    dcache.crop(m)
                    t1 = time.perf_counter()
                    ids = torch.cat([torch.tensor([out[-1]]), draft])
                    hidden = target.hidden(ids, torch.arange(m, m + ids.shape[0]), cache)
                    accepted, nxt = self.accept_chain(draft.tolist(), q, hidden)
                    path = list(range(accepted + 1))
                    drafter_accepted = accepted
                else:
                    tree = self.draft_tree(last, m, dcache)
                    dcache.crop(m)
                    t1 = time.perf_counter()
                    ids, parents, depths = tree.with_root(out[-1])
                    drafted = ids.shape[0]  # nodes past this index come from the lookup branch
                    if self.lookup_tokens:  # the prompt-lookup continuation as one more branch
                        chain = lookup_continuation(prompt_ids + out, self.lookup_tokens)
                        ids, parents, depths = graft_chain(ids, parents, depths, chain)
                    mask = verify_mask(m, parents, depths, target.dtype)
                    hidden = target.hidden(ids, m + depths, cache, mask)
                    path, nxt = self.accept_tree(ids.tolist(), parents.tolist(), hidden)
                    accepted = len(path) - 1
                    # the greedy walk leaves the drafter's tree only where it has no such child
                    drafter_accepted = (
                        next((i for i, node in enumerate(path) if node >= drafted), len(path)) - 1
                    )
                keep_verified(cache, ids.shape[0], path)
                new = ids[path[1:]].tolist() + [nxt]
                pending_aux = cap.aux_hidden()[:, path]
                pending_ids = torch.tensor(new)
                m += len(new)
                t2 = time.perf_counter()
                result.draft_s += t1 - t0
                result.verify_s += t2 - t1
                result.accepted.append(accepted)
                result.drafter_accepted.append(drafter_accepted)
                out, done = _finish(out + new, max_new_tokens, eos_ids)
        result.tokens = out
        result.seconds = time.perf_counter() - start
        return result
