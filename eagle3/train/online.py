"""Online features: each training batch's features come from the target while the drafter trains.

An online store (extract.features: online) keeps the tokens only. `OnlineFeatures` asks a
`FeatureFn` for the features of a batch's samples: the in-process target's `capture_rows`
(the very function extraction stores with, so a sample's features are the store's bytes) or
SGLang servers (built by the train stage: eagle3/sglang/online.py). The target's full-vocabulary
argmax, which training masks by, comes from the same forward. `prefetched` computes batches
ahead of the drafter's step on a background thread, at most `depth` at a time: memory is set
by the queue, not by the data. Every `recheck_every`-th batch one sample is computed again on
its own (hf: the reference forward without capture hooks; sglang: another request) and must
agree, so features that go wrong mid-run (a server restarted on other weights, states leaking
between requests, all-zero rows) stop training instead of training on them.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from functools import partial
from typing import TypeVar

import torch
from torch import Tensor

from eagle3.core.device import torch_threads
from eagle3.core.inputs import InputError
from eagle3.core.packed import pack_linears
from eagle3.core.params import Params
from eagle3.data.extract import capture_rows, reference_sample
from eagle3.data.store import FEATURE_KEYS, TOPK_KEYS, FeatureStore, Sample
from eagle3.dtypes.resolved import pinned
from eagle3.target.load import load_target
from eagle3.target.render import Rendered
from eagle3.train.argmax import argmax_rows
from eagle3.train.data import argmax_head
from eagle3.train.prepare import TrainInputs

# rendered samples -> their features, in order (aux_hidden, and last_hidden or the top-N)
FeatureFn = Callable[[list[Rendered]], list[Sample]]

# A sample computed again must agree row by row with the batch's computation: bf16 rounding of
# the same computation scores ~1.0; a wrong layer, a shifted position or another model far lower.
MIN_ROW_COSINE = 0.99
MIN_TOP1_AGREEMENT = 0.9

T = TypeVar("T")
R = TypeVar("R")


@dataclass(frozen=True)
class Recheck:
    """Every `every`-th batch (0: never), its first sample computed again by `again`, which
    `source` names in the message when the two disagree."""

    every: int
    again: Callable[[Rendered], Sample]
    source: str


@dataclass(frozen=True)
class OnlineFeed:
    """What a backend's online role gives training for an online store: the features of rendered
    samples, in order; the re-check of one sample computed again; and N when the samples hold the
    target's top-N logprobs in place of its final-norm states (None)."""

    compute: FeatureFn
    recheck: Recheck
    target_topk: int | None


class OnlineFeatures:
    """Per-sample rows of an online store: its tokens, and features computed now."""

    def __init__(
        self,
        store: FeatureStore,
        compute: FeatureFn,
        head: Tensor,
        t2d: Tensor,
        target_topk: int | None = None,
        recheck: Recheck | None = None,
    ):
        self.store, self.compute, self.head, self.t2d = store, compute, head, t2d
        self.keys = TOPK_KEYS if target_topk else FEATURE_KEYS
        self.target_topk = target_topk
        self.recheck = recheck
        self.calls = 0

    def rows(self, samples: list[int]) -> dict[int, dict[str, Tensor]]:
        tokens = [self.store.sample(s) for s in samples]
        rendered = [Rendered(t["input_ids"].numpy(), t["loss_mask"].numpy()) for t in tokens]
        computed = self.compute(rendered)
        rows = {}
        for s, t, c in zip(samples, tokens, computed, strict=True):
            if not torch.equal(c.input_ids.int(), t["input_ids"].int()):
                raise InputError(f"online features: sample {s} came back for other tokens than were sent")
            rows[s] = {key: getattr(c, key) for key in self.keys} | {"in_draft": self.in_draft(c)}
        if self.recheck and self.recheck.every and self.calls % self.recheck.every == 0:
            self._recheck(samples[0], rendered[0], computed[0])
        self.calls += 1
        return rows

    def in_draft(self, sample: Sample) -> Tensor:
        """Is the target's argmax at each position inside the draft vocab (as target_in_draft)."""
        if bool(self.t2d.all()):  # the whole vocabulary (a DFlash drafter's): no argmax to take
            return torch.ones(len(sample.input_ids), dtype=torch.bool)
        if sample.target_topk_ids is not None:
            return self.t2d[sample.target_topk_ids[:, 0].long()].clone()
        return self.t2d[argmax_rows(sample.last_hidden, self.head).long()]

    def _recheck(self, s: int, rendered: Rendered, first: Sample) -> None:
        why = disagreement(first, self.recheck.again(rendered))
        if why:
            raise InputError(
                f"online features drift: sample {s} computed again on its own by {self.recheck.source} "
                f"disagrees with its batch ({why}); nothing after the last checkpoint was kept. Check "
                "that the target was not changed or restarted with other arguments, then run patch-check"
            )


def at_threads(threads: int | None, fn: Callable[..., R]) -> Callable[..., R]:
    """`fn` run with torch at `threads` intra-op threads on the calling thread (None: as it is)."""

    def run(*args, **kwargs) -> R:
        with torch_threads(threads):
            return fn(*args, **kwargs)

    return run


def hf_features(params: Params, store: FeatureStore) -> OnlineFeed:
    """The in-process target as the online store's feature source: loaded as extraction loads it
    (the prefill dtype the dtypes stage recorded, packed weights), computing with extraction's
    own `capture_rows` at the torch threads extraction ran at (the store's `capture_threads`: on
    some CPUs a forward's bits depend on them); the re-check is its plain forward's
    output_hidden_states. Its store holds final-norm states, not a top-N."""
    engine = store.fingerprint.engine
    if engine != "transformers":
        raise InputError(
            f"the online store was checked on {engine}, not the in-process target (transformers): "
            "train it with extract.backend: sglang and its servers, or extract again with backend: hf"
        )
    with torch_threads(None):  # target.threads is for the target's forwards, not the drafter's
        target = load_target(pinned(params, "prefill").target)
    if params.extract.pack_weights:
        pack_linears(target.model)  # as extraction does: the same bytes come out
    aux = store.aux_layers
    # Every rank at extraction's count, whatever the ranks share the cores at: 2 ranks at 2
    # threads on 2 cores oversubscribe them, which costs time, not bytes. A store without the
    # count (written before it was recorded) runs at target.threads, as it was extracted.
    threads = store.capture_threads or params.target.threads
    compute = at_threads(
        threads, partial(capture_rows, target, aux_layers=aux, batch_tokens=params.extract.batch_tokens)
    )
    recheck = Recheck(
        params.online.recheck_every,
        at_threads(threads, partial(reference_sample, target, aux_layers=aux)),
        "the in-process target's plain forward (output_hidden_states)",
    )
    return OnlineFeed(compute, recheck, target_topk=None)


def disagreement(a: Sample, b: Sample) -> str | None:
    """Why two computations of one sample's features disagree, or None when they agree."""
    for key in ("aux_hidden", "last_hidden"):
        x, y = getattr(a, key), getattr(b, key)
        if x is None or y is None:
            continue
        if x.shape != y.shape:
            return f"{key} shape {tuple(x.shape)} against {tuple(y.shape)}"
        zero = (x.float().abs().amax(-1) == 0) | (y.float().abs().amax(-1) == 0)
        if zero.any():
            return f"{key} has all-zero rows (first at position {int(zero.nonzero()[0, 0])})"
        worst = torch.nn.functional.cosine_similarity(x.float(), y.float(), dim=-1).min().item()
        if not worst >= MIN_ROW_COSINE:  # NaN fails too
            return f"{key} worst row cosine {worst:.4f} < {MIN_ROW_COSINE}"
    if a.target_topk_ids is not None and b.target_topk_ids is not None:
        agree = (a.target_topk_ids[:, 0] == b.target_topk_ids[:, 0]).float().mean().item()
        if agree < MIN_TOP1_AGREEMENT:
            return f"the target's best token agrees on {agree:.3f} of positions < {MIN_TOP1_AGREEMENT}"
    return None


def prefetched(make: Callable[[T], R], items: Sequence[T], depth: int) -> Iterator[R]:
    """make(item) for each item, in order, computed on a background thread at most `depth` items
    ahead of the one the consumer holds (so depth + 1 are alive at most). An exception in `make`
    is raised here, at the item it belongs to; closing the iterator stops the thread after the
    item it is making."""
    if depth < 1:
        raise ValueError(f"prefetch depth must be >= 1 (got {depth})")
    done: queue.Queue = queue.Queue()
    slots = threading.Semaphore(depth)
    stop = threading.Event()

    def work() -> None:
        for item in items:
            while not slots.acquire(timeout=0.05):
                if stop.is_set():
                    return
            if stop.is_set():
                return
            try:
                done.put((True, make(item)))
            except BaseException as err:  # handed to the consumer, raised at this item
                done.put((False, err))
                return

    thread = threading.Thread(target=work, name="eagle3-prefetch", daemon=True)
    thread.start()
    try:
        for _ in items:
            ok, value = done.get()
            if not ok:
                raise value
            slots.release()  # the next one may be made while this one is used
            yield value
    finally:
        stop.set()
        thread.join()


@dataclass(frozen=True)
class OnlineSource:
    """Where an online store's batches get their features, and how far ahead they are computed."""

    features: OnlineFeatures
    prefetch_batches: int


def online_source(inputs: TrainInputs, feed: OnlineFeed, prefetch_batches: int) -> OnlineSource:
    """The feature source of an online store, taking the argmax as a store's pass would."""
    head = argmax_head(inputs.head)
    features = OnlineFeatures(inputs.store, feed.compute, head, inputs.t2d, feed.target_topk, feed.recheck)
    return OnlineSource(features, prefetch_batches)
