"""The extraction loop: conversations -> (optional self-distillation) -> one captured forward -> shards.

Work is cut into shards of `extract.shard_samples` samples, each processed in batches that
never straddle a shard, so an interrupted run that resumes at a shard boundary computes
exactly what an uninterrupted run would (byte-identical shards).

A sample's features are a function of the sample alone: its forward is padded on the right to a
width that depends on its own length only (FORWARD_WIDTH_MULTIPLE), only samples of the same
padded width share a forward, and a row's result does not depend on the rows beside it (measured
on this project's CPUs in float32 and bf16, and checked by tests/test_online.py). So
`capture_rows` gives the same bytes whichever samples it is handed together, which is what lets
online training (extract.features: online, eagle3/train/online.py) compute them again, batch by
batch, equal to the store's. They may depend on torch's thread count (on an AMX Xeon they did; on
the Zen 4 they do not), so the store records the count its forwards ran at (`capture_threads`)
and online training runs its forwards at that count.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn
from safetensors import safe_open

from eagle3.core.packed import pack_linears
from eagle3.core.params import TRANSPORT_KEYS, Params
from eagle3.core.stageio import code_sha256, sha256_json
from eagle3.data.conversations import load_conversations, split_order
from eagle3.data.onpolicy import generate_with_features
from eagle3.data.store import (
    JOURNAL,
    SCHEMA_VERSION,
    Sample,
    feature_bytes_per_token,
    publish_store,
    resume_shards,
    work_folder,
    write_journal,
    write_manifest,
    write_shard,
    write_tokens,
)
from eagle3.dtypes.resolved import pinned
from eagle3.target.capture import capture_hidden_states
from eagle3.target.fingerprint import Fingerprint
from eagle3.target.load import Target, eos_token_ids, has_chat_template, load_target
from eagle3.target.render import Message, Rendered, render_conversation, render_prompt


@dataclass
class Selected:
    messages: list[Message]
    rendered: Rendered | None  # None under self-distillation: the target writes the answer


def select_conversations(params: Params, tokenizer, chat: bool) -> list[Selected]:
    """The first `data.num_samples` conversations of a seeded order (its held-out tail excluded:
    eagle3/data/conversations.py split_order) with enough to learn from:
    >= `data.min_assistant_tokens` assistant tokens, or under self-distillation a first prompt
    that leaves room for that many answer tokens within `data.max_length`."""
    data = params.data
    conversations = load_conversations(data.source)
    chosen: list[Selected] = []
    training, heldout = split_order(len(conversations), data.seed)
    for index in training:
        messages = conversations[index]
        if data.regenerate:
            rendered = None
            fits = any(m["role"] == "user" for m in messages) and (
                len(render_prompt(tokenizer, messages, chat)) <= data.max_length - data.min_assistant_tokens
            )
        else:
            rendered = render_conversation(tokenizer, messages, data.max_length, chat)
            fits = int(rendered.loss_mask.sum()) >= data.min_assistant_tokens
        if fits:
            chosen.append(Selected(messages, rendered))
            if len(chosen) == data.num_samples:
                return chosen
    room = "prompts that leave room for" if data.regenerate else "conversations with >="
    raise ValueError(
        f"data.num_samples: asked for {data.num_samples}, but {data.source} has only {len(chosen)} "
        f"{room} {data.min_assistant_tokens} assistant tokens outside the {len(heldout)} held out for "
        f"evaluation (allowed: <= {len(chosen)})"
    )


def onpolicy_group(
    target: Target, group: list[list[Message]], params: Params, chat: bool, aux_layers: list[int]
) -> list[Sample]:
    """Self-distil a shard's conversations: the target answers each first exchange and the
    features come from that same generation (eagle3/data/onpolicy.py), returned in order.

    Prompts join the running batch shortest first, so rows that prefill together are of
    similar length (every row is left-padded to the longest in the cache).
    """
    data = params.data
    prompts = [render_prompt(target.tokenizer, m, chat) for m in group]
    order = sorted(range(len(group)), key=lambda i: (len(prompts[i]), i))
    outputs = generate_with_features(
        target,
        [prompts[i] for i in order],
        data.regenerate_max_new_tokens,
        data.max_length,
        aux_layers,
        eos_token_ids(target.model, target.tokenizer),
        batch_size=data.regenerate_batch_size,
        prefill_tokens=params.extract.batch_tokens,
    )
    samples: list[Sample | None] = [None] * len(group)
    for i, (rendered, aux, last) in zip(order, outputs, strict=True):
        samples[i] = Sample(
            input_ids=torch.from_numpy(rendered.input_ids),
            loss_mask=torch.from_numpy(rendered.loss_mask),
            aux_hidden=aux,
            last_hidden=last,
        )
    return samples


# A sample's forward is padded on the right to a multiple of this many tokens. The padding comes
# after its tokens, so the causal attention keeps it out of their states, and the width depends on
# the sample's own length only, so its bytes do not depend on the samples beside it (they do
# depend on the width, in their last bits: attention and matmuls block differently). Why pad: the
# target's forwards then take a few shapes rather than one per sample length, and on a CPU each
# new shape leaves oneDNN kernels and heap behind, so online training's memory grew with the data.
FORWARD_WIDTH_MULTIPLE = 32


def forward_width(length: int) -> int:
    """The width a sample of this length is forwarded at."""
    return -(-length // FORWARD_WIDTH_MULTIPLE) * FORWARD_WIDTH_MULTIPLE


def padded_ids(rendered: list[Rendered]) -> torch.Tensor:
    """[rows, width] token ids of samples of one forward width, right-padded with id 0."""
    widths = {forward_width(len(r.input_ids)) for r in rendered}
    if len(widths) != 1:
        raise ValueError(f"one forward takes samples of one padded width, got widths {sorted(widths)}")
    ids = np.zeros((len(rendered), widths.pop()), dtype=np.int64)
    for row, r in enumerate(rendered):
        ids[row, : len(r.input_ids)] = r.input_ids
    return torch.from_numpy(ids)


def token_batches(lengths: list[int], batch_tokens: int) -> list[list[int]]:
    """Indices grouped by equal forward width, at most batch_tokens tokens (padding included) a
    forward (a longer sample goes alone)."""
    widths = [forward_width(n) for n in lengths]
    order = sorted(range(len(lengths)), key=lambda i: (widths[i], i))
    batches: list[list[int]] = []
    current: list[int] = []
    for i in order:
        if current and (widths[current[0]] != widths[i] or (len(current) + 1) * widths[i] > batch_tokens):
            batches.append(current)
            current = []
        current.append(i)
    if current:
        batches.append(current)
    return batches


def token_sample(rendered: Rendered, **features: torch.Tensor) -> Sample:
    """A sample of these tokens (copied: the rendering's arrays stay the caller's) and features."""
    ids, mask = torch.from_numpy(rendered.input_ids.copy()), torch.from_numpy(rendered.loss_mask.copy())
    return Sample(ids, mask, **features)


@torch.no_grad()
def capture_batch(target: Target, rendered: list[Rendered], aux_layers: list[int]) -> list[Sample]:
    """Captured forwards of samples of one forward width (token_batches groups them so), one row
    a forward: a matmul's blocking, and so its rounding, may depend on the number of rows (on an
    AMX Xeon, float32 and bfloat16 alike), which would make a sample's bytes depend on the
    samples beside it. At one row a forward they depend on its padded width alone."""
    samples = []
    for r in rendered:
        ids = padded_ids([r])
        with capture_hidden_states(target.decoder_layers, target.final_norm, aux_layers) as captured:
            # The base model only: the lm_head (V x H per token) is not needed here.
            target.model.model(input_ids=ids, use_cache=False)
        aux, last, n = captured.aux_hidden(), captured.last, len(r.input_ids)
        samples.append(
            token_sample(
                r,
                aux_hidden=aux[0, :n].to(torch.bfloat16).clone(),
                last_hidden=last[0, :n].to(torch.bfloat16).clone(),
            )
        )
    return samples


def capture_rows(
    target: Target,
    rendered: list[Rendered],
    aux_layers: list[int],
    batch_tokens: int,
    advance: Callable[[int, int], None] | None = None,
) -> list[Sample]:
    """The features of each sample, in order, computed in equal-width forwards of at most
    `batch_tokens` tokens: the same bytes for a sample whichever others come with it."""
    samples: list[Sample | None] = [None] * len(rendered)
    for batch in token_batches([len(r.input_ids) for r in rendered], batch_tokens):
        captured = capture_batch(target, [rendered[i] for i in batch], aux_layers)
        for i, sample in zip(batch, captured, strict=True):
            samples[i] = sample
        if advance:
            advance(len(batch), sum(len(rendered[i].input_ids) for i in batch))
    return samples


# The code that computes a shard's bytes: shards written by other code are not resumed, or
# `dvc repro` after a change to it keeps the old features (it did when forwards were first padded).
EXTRACTION_CODE = ("data", "target", "sglang", "core/packed.py")


@functools.cache
def extraction_code_sha256() -> str:
    return code_sha256(Path(__file__).resolve().parents[1], EXTRACTION_CODE)


def config_hash(params: Params, fingerprint: Fingerprint, capture_threads: int | None = None) -> str:
    """What a shard's journal entry must match to be resumed: params, target, code and the torch
    threads the capture ran at (a forward's last bits may depend on them: one store, one count)."""
    # where the servers are and how many requests fly change no byte: a resumed run may use others
    transport = {key.split(".", 1)[1] for key in TRANSPORT_KEYS if key.startswith("extract.")}
    extract = params.extract.model_dump(exclude=transport)
    if params.extract.backend != "sglang":  # the SGLang keys do not touch an hf extraction
        extract = {k: v for k, v in extract.items() if not k.startswith("sglang_")}
    material = {"data": params.data.model_dump(), "extract": extract, "fp": fingerprint.to_json()}
    if capture_threads is not None:
        material["capture_threads"] = capture_threads
    return sha256_json(material | {"code": extraction_code_sha256()})


def _progress() -> Progress:
    return Progress(
        TextColumn("[bold]extract"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("samples"),
        TextColumn("{task.fields[tok_s]:>7,.0f} tok/s"),
        TimeRemainingColumn(),
    )


# (selected conversations of one shard, advance(samples, tokens)) -> their samples, in order
GroupFn = Callable[[list[Selected], Callable[[int, int], None]], list[Sample]]


@dataclass(frozen=True)
class ExtractionPlan:
    """How one backend's extraction runs in the shared loop: the tokenizer and rendering that
    select the conversations, the target's hidden size, its shard computation, N when its
    samples hold the target's top-N predictions in place of last_hidden (SGLang top logprobs),
    and the torch threads its forwards run at when they run in this process (hf)."""

    tokenizer: object
    chat: bool
    hidden_size: int
    compute: GroupFn
    target_topk: int | None = None
    capture_threads: int | None = None


def hf_group_fn(target: Target, params: Params, aux_layers: list[int]) -> GroupFn:
    """The hf backend: captured forwards of the loaded target (or its own generations)."""
    chat = has_chat_template(target.source)

    def compute(group: list[Selected], advance: Callable[[int, int], None]) -> list[Sample]:
        if params.data.regenerate:
            samples = onpolicy_group(target, [s.messages for s in group], params, chat, aux_layers)
            advance(len(group), sum(len(s.input_ids) for s in samples))
            return samples
        rendered = [s.rendered for s in group]
        return capture_rows(target, rendered, aux_layers, params.extract.batch_tokens, advance)

    return compute


@torch.no_grad()
def reference_sample(target: Target, rendered: Rendered, aux_layers: list[int]) -> Sample:
    """One sample's features from the plain forward's own output_hidden_states, no capture hooks
    (what patch-check compares the capture with): online training's sampled re-check."""
    ids, n = padded_ids([rendered]), len(rendered.input_ids)  # padded as the capture pads it
    states = target.model.model(input_ids=ids, output_hidden_states=True, use_cache=False).hidden_states
    return token_sample(
        rendered,
        aux_hidden=torch.cat([states[layer + 1][0, :n] for layer in aux_layers], -1).to(torch.bfloat16),
        last_hidden=states[-1][0, :n].to(torch.bfloat16),
    )


def tokens_only(compute: GroupFn, params: Params) -> GroupFn:
    """extract.features: online keeps the tokens alone. Rendered text needs no target at all;
    self-distilled answers are generated (and their features dropped: training recomputes them
    with a prefill forward, which rounds differently from the generation's own steps)."""

    def online(group: list[Selected], advance: Callable[[int, int], None]) -> list[Sample]:
        if params.data.regenerate:
            return [s.tokens_only() for s in compute(group, advance)]
        samples = [token_sample(s.rendered) for s in group]
        advance(len(group), sum(len(s.input_ids) for s in samples))
        return samples

    return online


def extract_features(
    target: Target,
    params: Params,
    aux_layers: list[int],
    fingerprint: Fingerprint,
    out_dir: Path,
    **options: int | dict | None,
) -> dict:
    """Fill `out_dir` with shards, token file and manifest; resumes an interrupted run of the same
    config. `options`: run_extraction's `stop_after_shards`, `stats` and `publish`."""
    chat = has_chat_template(target.source)
    compute = hf_group_fn(target, params, aux_layers)
    # On some CPUs (an AMX Xeon) a forward's last bits depend on the thread count: the store records
    # it, and online training runs its forwards at it (eagle3/train/online.py)
    threads = torch.get_num_threads()
    plan = ExtractionPlan(target.tokenizer, chat, target.hidden_size, compute, capture_threads=threads)
    return run_extraction(plan, params, aux_layers, fingerprint, out_dir, **options)


def extract_on_hf(
    params: Params, fingerprint: Fingerprint, out_dir: Path, **options: int | dict | None
) -> tuple[dict, str]:
    """The hf backend's extraction: the target loaded as the dtypes stage recorded (weights packed
    where that pays), the store filled; returns the manifest and the dtype it computed in."""
    target = load_target(pinned(params, "prefill").target)
    if params.extract.pack_weights:
        pack_linears(target.model)  # a no-op outside float32 on CPU
    manifest = extract_features(target, params, list(fingerprint.aux_layers), fingerprint, out_dir, **options)
    return manifest, str(target.model.dtype).removeprefix("torch.")


def seal_store(
    work: Path,
    key: str,
    shards: list[dict],
    plan: ExtractionPlan,
    params: Params,
    aux_layers: list[int],
    fingerprint: Fingerprint,
    num_samples: int,
) -> dict:
    """The completed shards in `work` made a store: its token file and sealed manifest."""
    hidden_size, online = plan.hidden_size, params.extract.features == "online"
    # Token file from the shards themselves: what vocab-map counts is exactly what was stored.
    ids, masks, offsets = [], [], [torch.zeros(1, dtype=torch.int64)]
    for entry in shards:
        with safe_open(str(work / entry["file"]), framework="pt") as f:
            ids.append(f.get_tensor("input_ids"))
            masks.append(f.get_tensor("loss_mask"))
            offsets.append(f.get_tensor("offsets")[1:] + offsets[-1][-1])
    write_tokens(work, torch.cat(ids), torch.cat(masks), torch.cat(offsets))
    dtype = params.extract.store_dtype  # float8_e4m3fn: fp8 rows + a float32 scale each (store.py)
    manifest = {
        "schema_version": SCHEMA_VERSION,
        "fingerprint": fingerprint.to_json(),
        "aux_layers": list(aux_layers),
        "dtype": dtype,
        "hidden_size": hidden_size,
        "num_samples": num_samples,
        "num_tokens": sum(s["tokens"] for s in shards),
        "num_loss_tokens": int(sum(int(m.sum()) for m in masks)),
        "bytes_per_token": feature_bytes_per_token(hidden_size, dtype) + 4 + 1,
        "data": params.data.model_dump(),
        "shards": shards,
    }
    if topk := plan.target_topk:  # the target's top-N (id int32 + logprob float32), not last_hidden
        manifest |= {
            "target_topk": topk,
            "bytes_per_token": feature_bytes_per_token(hidden_size, dtype, topk) + 4 + 1,
        }
    if online:  # the tokens alone: training computes the features (dtype: what it rounds them to)
        manifest |= {"features": "online", "bytes_per_token": 4 + 1}
    if plan.capture_threads is not None:  # an online store: the count training's forwards take
        manifest["capture_threads"] = plan.capture_threads
    manifest = write_manifest(work, manifest, key)  # sealed: tokens sha256, config hash, checksum
    (work / JOURNAL).unlink()  # the sealed manifest vouches for the shards now
    return manifest


def run_extraction(
    plan: ExtractionPlan,
    params: Params,
    aux_layers: list[int],
    fingerprint: Fingerprint,
    out_dir: Path,
    stop_after_shards: int | None = None,
    stats: dict | None = None,
    publish: bool = True,
) -> dict:
    """The backend-independent part: select, cut into shards, resume, write shards and manifest;
    `plan.compute` turns one shard's conversations into samples. `stop_after_shards` ends the
    run early (as an interruption would), for tests. `stats`, when given, gets
    "computed_tokens" and "computed_seconds": the shards this run computed, not those it resumed
    (the manifest is the same either way). `publish`: the completed work folder replaces `out_dir`
    here; the extract stage passes False and commits it with its other outputs."""
    tokenizer, chat = plan.tokenizer, plan.chat
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    work = work_folder(out_dir)  # shards and journal until the run completes (store.py)
    key = config_hash(params, fingerprint, plan.capture_threads)
    # Bad data fails here, before anything of the last run is removed.
    selected = select_conversations(params, tokenizer, chat)
    # Intact shards of this config (journal or finished manifest), now in `work`; the out is kept.
    done = resume_shards(out_dir, key)
    per_shard = params.extract.shard_samples
    groups = [selected[i : i + per_shard] for i in range(0, len(selected), per_shard)]
    online = params.extract.features == "online"
    compute = tokens_only(plan.compute, params) if online else plan.compute
    tokens_done, started = 0, time.perf_counter()
    with _progress() as progress:
        task = progress.add_task("extract", total=len(selected), tok_s=0.0)

        def advance(samples: int, tokens: int) -> None:
            nonlocal tokens_done
            tokens_done += tokens
            progress.update(task, advance=samples, tok_s=tokens_done / (time.perf_counter() - started))

        for index, group in enumerate(groups):
            if index in done:
                progress.advance(task, len(group))
                continue
            if stop_after_shards is not None and index >= stop_after_shards:
                return {"interrupted_after": index}
            done[index] = write_shard(work, index, compute(group, advance), params.extract.store_dtype)
            write_journal(work, key, [done[i] for i in sorted(done)])
    if stats is not None:
        stats.update(computed_tokens=tokens_done, computed_seconds=time.perf_counter() - started)
    shards = [done[i] for i in range(len(groups))]

    # The new store is completed in the work folder; the last one stays in place until then.
    manifest = seal_store(work, key, shards, plan, params, aux_layers, fingerprint, len(selected))
    if publish:  # else the caller puts the work folder in place (the extract stage's commit)
        publish_store(out_dir)
    return manifest
