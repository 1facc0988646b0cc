"""speculative-eval on SGLang (eval.backend: sglang): the drafter measured the way users serve it.

Three servers of the target, started here (eagle3/sglang/launch.py) or given by URL:
plain greedy decoding (the baseline), the drafter under evaluation (EAGLE-3, shape from
eval.mode / k / topk / tree_budget through eagle3/sglang/speculative.py, the mapping `eagle3
serve-command` prints; or DFLASH for a DFlash block drafter, one block a step) and SGLang's NGRAM
speculation (the peer that needs no training, in the
place of the hf backend's prompt lookup). Every prompt is rendered as the hf backend renders it
(eagle3/target/render.py) and sent as input_ids to the three servers in turn, rotating the order
per prompt, greedy; the first prompt warms each server up untimed.

The results become the hf backend's PromptResults, so the metrics, per-category figures and
bootstrap intervals are computed by the same code (eagle3/decoding/evaluate.py, stats.py):
acceptance_length = 1 + correct drafts / verification steps (SGLang's histogram gives the count
per step, not their order), tokens/s from SGLang's own end-to-end latency per request, speedup
against the plain server, prompt_lookup_* = the NGRAM peer. A speculative output that differs
from the plain server's is judged as the hf backend judges it (eagle3/decoding/divergence.py, on
the HF target in the servers' dtype): losslessness is meant in float32; in bf16 differently
batched attention rounds differently and near-ties may flip.

On GPUs (eval.sglang_launch: gpu) the params are the same and only the launch differs: SGLang's
own sgl_kernel and default attention backend, no launcher override, `--tp eval.sglang_tp`:
  python -m sglang.launch_server --model-path TARGET --tp TP --dtype DTYPE --host 127.0.0.1
      --port P --skip-server-warmup --sleep-on-idle --disable-radix-cache [--trust-remote-code]
      [--speculative-algorithm EAGLE3 --speculative-draft-model-path DRAFTER <shape flags> |
       --speculative-algorithm DFLASH --speculative-draft-model-path DRAFTER |
       --speculative-algorithm NGRAM --speculative-num-draft-tokens N]
For Kimi-K2.5 (eval.sglang_tp 8, target.trust_remote_code) the three servers need 8 GPUs each:
start them on three nodes and give their URLs (eval.sglang_url, sglang_eagle3_url,
sglang_ngram_url), or set eval.prompt_lookup false to drop the NGRAM peer.

Everything that can be refused is refused before the first request: a drafter SGLang cannot
load as it should, eval.k past the drafter's trained TTT length, a shape SGLang cannot serve,
an unsupported SGLang, a given server of the wrong kind or shape, a server that fails to start.
"""

from __future__ import annotations

import json
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from transformers import AutoConfig, AutoTokenizer

from eagle3.core.device import machine
from eagle3.core.inputs import InputError
from eagle3.core.params import Params
from eagle3.decoding.divergence import check_divergence
from eagle3.decoding.engine import Generation
from eagle3.decoding.evaluate import (
    EvalOutcome,
    EvalRun,
    PromptResult,
    eval_coverage,
    per_domain,
    summarize,
    summarize_spread,
)
from eagle3.decoding.prompts import Prompt, answered, render_prompts
from eagle3.decoding.report import category_table, domain_table, interval_line
from eagle3.drafter.dflash import ARCHITECTURE as DFLASH_ARCHITECTURE
from eagle3.drafter.dflash_export import drafter_kind, load_dflash_config
from eagle3.drafter.export import load_drafter_config
from eagle3.sglang.client import ServerPool, SGLangError
from eagle3.sglang.launch import (
    Launch,
    LaunchError,
    Server,
    installed_version,
    sglang_python,
    start_servers,
    stop_servers,
    terminated_as_exit,
)
from eagle3.sglang.speculative import (
    DFLASH,
    EAGLE3,
    NGRAM,
    SpecResponse,
    SpecShape,
    check_server,
    dflash_flags,
    dflash_shape,
    eagle3_flags,
    eagle3_shape,
    ngram_flags,
    servable,
)
from eagle3.target.load import has_chat_template, load_target, resolve_target

PLAIN, PEER = "plain", "ngram"
SPEC = "eagle3"  # an EAGLE-3 drafter's server; a DFlash drafter's is "dflash" (SpecServer.kind)
WARMUP_TOKENS = 8
# metrics of the hf backend that SGLang does not report (draft/verify split, prefill time)
NOT_MEASURED = ("draft_ms_per_step", "verify_ms_per_step", "prefill_ms_per_prompt")


@dataclass(frozen=True)
class SpecServer:
    """The speculative server a drafter's family is served by."""

    kind: str  # its name in the servers, tags and rows: eagle3 | dflash
    label: str  # as the report names it
    algorithm: str  # SGLang's --speculative-algorithm
    shape: SpecShape  # what its get_server_info must report
    flags: list[str]
    depth: int  # the most drafts one step can accept: per-position figures, divergence block

    @classmethod
    def of(cls, drafter_dir: Path, shape: SpecShape) -> SpecServer:
        folder = drafter_dir.resolve()
        if drafter_kind(drafter_dir) == "dflash":
            return cls("dflash", "DFlash", DFLASH, shape, dflash_flags(folder), shape.num_draft_tokens - 1)
        return cls(SPEC, "EAGLE-3", EAGLE3, shape, eagle3_flags(folder, shape), shape.num_steps)


def drafter_refusal(drafter_dir: Path, target_config) -> str | None:
    """Why SGLang would not load this drafter as it was trained (some of these it loads
    silently wrong), or None. Both families share the target's embedding and read target layers
    SGLang must capture; a DFlash drafter borrows the target's head too."""
    raw = json.loads((drafter_dir / "config.json").read_text())
    dflash = raw.get("architectures") == [DFLASH_ARCHITECTURE]
    if not dflash:
        if raw.get("architectures") != ["LlamaForCausalLMEagle3"]:
            return (
                f"architectures is {raw.get('architectures')}, SGLang's EAGLE-3 drafter is "
                "LlamaForCausalLMEagle3"
            )
        if raw.get("tie_word_embeddings"):
            return "tie_word_embeddings is true: SGLang would use the embedding as the drafter's lm_head"
        if not raw.get("draft_vocab_size"):
            why = "SGLang would load the target's lm_head in place of the drafter's"
            return f"draft_vocab_size is missing: {why}"
    if not (drafter_dir / "model.safetensors").exists():
        return "model.safetensors is missing"
    hidden = getattr(target_config, "hidden_size", None)
    if hidden is not None and raw.get("hidden_size") != hidden:
        shared = "it drafts through the target's embedding and head"
        why = shared if dflash else "SGLang shares the target's embedding"
        return f"hidden_size {raw.get('hidden_size')} != the target's {hidden}: {why}"
    vocab = getattr(target_config, "vocab_size", None)
    if vocab is not None and raw.get("vocab_size") != vocab:
        return f"vocab_size {raw.get('vocab_size')} != the target's {vocab}"
    if dflash:
        read, ids = "target_layer_ids", load_dflash_config(drafter_dir).target_layer_ids
    else:
        read, ids = "aux layers", load_drafter_config(drafter_dir).aux_layer_ids
    layers = getattr(target_config, "num_hidden_layers", None)
    if layers is not None and max(ids) >= layers - 1:
        return (
            f"{read} {ids}: SGLang captures layer L as the input of layer L + 1, so the target's last "
            f"layer ({layers - 1}) cannot be one"
        )
    return None


def check_inputs(params: Params, drafter_dir: Path) -> tuple[SpecShape, object]:
    """Everything checkable before a server starts: (the shape its server reports, the target's
    config). EAGLE-3: the eval params' shape; DFlash: one block a step, the drafter's size."""
    ev = params.eval
    if ev.temperature != 0:
        raise InputError(f"eval.temperature: {ev.temperature}: backend sglang measures greedy decoding (0)")
    remote = params.target.trust_remote_code
    target_config = AutoConfig.from_pretrained(resolve_target(params.target.source), trust_remote_code=remote)
    if why := drafter_refusal(drafter_dir, target_config):
        raise InputError(f"{drafter_dir}: SGLang cannot load this drafter as trained: {why}")
    if drafter_kind(drafter_dir) == "dflash":
        return dflash_shape(load_dflash_config(drafter_dir).block_size), target_config
    shape = eagle3_shape(ev.mode, ev.k, ev.topk, ev.tree_budget)
    if why := servable(shape):
        raise InputError(f"eval.tree_budget: {ev.tree_budget}: SGLang cannot serve this tree: {why}")
    return shape, target_config


def server_kinds(params: Params, spec: SpecServer) -> dict[str, list[str]]:
    """{kind: SGLang flags} of the servers this evaluation needs."""
    common = ["--trust-remote-code"] if params.target.trust_remote_code else []
    kinds = {PLAIN: common, spec.kind: common + spec.flags}
    if params.eval.prompt_lookup:
        kinds[PEER] = common + ngram_flags(params.eval.prompt_lookup_tokens)
    return kinds


def checked_args(params: Params, urls: dict[str, str], pool: ServerPool, spec: SpecServer) -> dict[str, dict]:
    """Each server's recorded args, after checking its version, kind, shape and dtype."""
    expect = {PLAIN: (None, None, None), spec.kind: (spec.algorithm, spec.shape, None)}
    expect[PEER] = (NGRAM, None, params.eval.prompt_lookup_tokens)
    args = {}
    for kind, url in urls.items():
        algorithm, spec_shape, draft_tokens = expect[kind]
        args[kind] = check_server(url, pool.server_info(url), algorithm, spec_shape, draft_tokens)
    dtypes = {kind: a["dtype"] for kind, a in args.items()}
    wanted = params.eval.dtype
    if len(set(dtypes.values())) > 1 or (wanted != "auto" and dtypes[PLAIN] != wanted):
        raise InputError(
            f"the servers run dtypes {dtypes}; eval.dtype is {wanted}: the three must run one dtype"
        )
    return args


def _request(pool: ServerPool, url: str, ids: list[int], max_new_tokens: int) -> dict:
    body = {"input_ids": ids, "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0}}
    try:
        return pool.generate(url, body)
    except SGLangError as err:
        raise SGLangError(f"SGLang server gone or failing mid-run: {err}") from None


def _answer(pool: ServerPool, url: str, ids: list[int], max_new_tokens: int) -> list[int]:
    return SpecResponse.parse(url, _request(pool, url, ids, max_new_tokens), speculative=False).output_ids


def _flush(pool: ServerPool, url: str, tries: int = 5) -> None:
    """Empty a server's prefix cache after the warm-up (a given server may keep one: the first
    prompt must not start from it). SGLang refuses while its scheduler is still finishing the
    last request, so a refusal is retried."""
    for attempt in range(tries):
        try:
            pool.flush_cache(url)
            return
        except SGLangError:
            if attempt == tries - 1:
                raise
            time.sleep(1)


def decode_all(
    pool: ServerPool,
    urls: dict[str, str],
    batch: list[tuple[str, list[int]]],
    max_new_tokens: int,
    on_prompt: Callable[[str], None] | None = None,
) -> list[dict[str, SpecResponse]]:
    """Every prompt on every server, interleaved and rotated; the first prompt warms them up."""
    kinds = list(urls)
    if batch:
        for url in urls.values():
            _request(pool, url, batch[0][1], WARMUP_TOKENS)
            _flush(pool, url)
    out = []
    for i, (pid, ids) in enumerate(batch):
        shift = i % len(kinds)
        responses = {}
        for kind in kinds[shift:] + kinds[:shift]:
            response = _request(pool, urls[kind], ids, max_new_tokens)
            responses[kind] = SpecResponse.parse(urls[kind], response, speculative=kind != PLAIN)
        out.append(responses)
        if on_prompt is not None:
            on_prompt(pid)
    return out


def _generation(r: SpecResponse) -> Generation:
    accepted = r.accepted()
    return Generation(tokens=r.output_ids, seconds=r.seconds, accepted=accepted, drafter_accepted=accepted)


def _row(result: PromptResult, prompt: Prompt, responses: dict[str, SpecResponse], kind: str) -> dict:
    """The deterministic part of one prompt's results (no timings)."""
    spec = responses[kind]
    row = {
        "id": result.id,
        "category": prompt.category,
        "domain": prompt.domain,
        "prompt_tokens": result.prompt_tokens,
        "new_tokens": len(spec.output_ids),
        "baseline_new_tokens": len(result.baseline.tokens),
        "greedy_match": result.match,
        "steps": spec.verify_steps,
        "correct_drafts_histogram": spec.histogram,
        "spec_tokens": spec.output_ids,
    }
    if not result.match:
        row["baseline_tokens"] = result.baseline.tokens
    if PEER in responses:
        peer = responses[PEER]
        row["ngram_match"] = peer.output_ids == result.baseline.tokens
        row["ngram_steps"] = peer.verify_steps
        row["ngram_correct_drafts_histogram"] = peer.histogram
    if result.divergence is not None:
        row["divergence"] = result.divergence.as_dict()
    return row


def _ngram_acceptance(responses: list[dict[str, SpecResponse]]) -> float:
    steps = sum(r[PEER].verify_steps for r in responses)
    return 1 + sum(r[PEER].correct_drafts for r in responses) / steps if steps else 0.0


def _judge_divergences(params: Params, run: EvalRun, batch: list, dtype: str, block: int) -> None:
    """The hf backend's divergence check on the HF target in the servers' dtype (loaded only
    when some output differs)."""
    differing = [(r, ids) for r, (_, ids) in zip(run.results, batch, strict=True) if not r.match]
    if not differing:
        return
    hf_dtype = dtype if dtype in ("float32", "bfloat16", "float64") else "float32"
    model = load_target(params.target.model_copy(update={"dtype": hf_dtype}), job="decode").model
    for result, ids in differing:
        result.divergence = check_divergence(model, ids, result.baseline.tokens, result.spec.tokens, block)


def launched_servers(
    params: Params, path: str, kinds: dict[str, list[str]], drafter_dir: Path, log_dir: Path | None, spec: str
) -> dict[str, Server]:
    """The eval's servers started here (logs in `log_dir`, else a new temporary folder); a
    speculative server that exits at start is named as refusing the drafter."""
    ev = params.eval
    python = sglang_python(ev.sglang_python)
    installed_version(python)
    logs = log_dir or Path(tempfile.mkdtemp(prefix="eagle3-sglang-"))
    launch = Launch(python, ev.sglang_launch, ev.sglang_tp, ev.dtype, logs)
    try:
        return start_servers(launch, path, kinds)
    except LaunchError as err:
        if f"SGLang {spec} server exited" in str(err):
            raise LaunchError(f"SGLang refused the drafter {drafter_dir}: {err}") from None
        raise


def evaluate_on_sglang(
    params: Params,
    prompts: list[Prompt],
    drafter_dir: Path,
    on_prompt: Callable[[str], None] | None = None,
    log_dir: Path | None = None,
) -> EvalOutcome:
    """The whole evaluation; servers started here write their logs to `log_dir` (default: a new
    temporary folder, named in any error about them) and are always stopped."""
    ev = params.eval
    shape, _ = check_inputs(params, drafter_dir)
    spec = SpecServer.of(drafter_dir, shape)
    path = resolve_target(params.target.source)
    tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=params.target.trust_remote_code)
    chat = has_chat_template(params.target.source)
    render_prompts(tokenizer, [p for p in prompts if p.follows is None], chat)  # renders, before any server
    kinds = server_kinds(params, spec)
    given = {PLAIN: ev.sglang_url, spec.kind: ev.sglang_eagle3_url, PEER: ev.sglang_ngram_url}
    servers = {}
    with terminated_as_exit():
        try:
            if ev.sglang_url:
                urls = {kind: given[kind] for kind in kinds}
                where = "SGLang servers at " + ", ".join(sorted(set(urls.values())))
            else:
                servers = launched_servers(params, path, kinds, drafter_dir, log_dir, spec.kind)
                urls = {kind: server.url for kind, server in servers.items()}
                where = (
                    machine()
                    if ev.sglang_launch == "cpu"
                    else f"{machine()} (host), SGLang on GPUs, tp {ev.sglang_tp}"
                )
            pool = ServerPool(list(urls.values()), timeout_s=3600)
            args = checked_args(params, urls, pool, spec)
            # second turns follow the plain server's greedy answer to the first, as a client sends them
            prompts = answered(
                tokenizer, prompts, chat, lambda ids: _answer(pool, urls[PLAIN], ids, ev.max_new_tokens)
            )
            batch = render_prompts(tokenizer, prompts, chat)
            responses = decode_all(pool, urls, batch, ev.max_new_tokens, on_prompt)
        finally:
            stop_servers(servers)

    run = EvalRun()
    for (pid, ids), r in zip(batch, responses, strict=True):
        peer = _generation(r[PEER]) if PEER in r else None
        plain, drafted = _generation(r[PLAIN]), _generation(r[spec.kind])
        run.results.append(PromptResult(pid, len(ids), plain, drafted, peer))
    dtype = str(args[PLAIN]["dtype"])
    _judge_divergences(params, run, batch, dtype, spec.depth + 1)
    categories = [p.category for p in prompts]
    metrics = summarize(run, spec.depth, True) | summarize_spread(run, categories, spec.depth, ev.seed)
    metrics["per_domain"] = per_domain(run, [p.domain for p in prompts], spec.depth, ev.seed)
    for key in NOT_MEASURED:
        metrics.pop(key, None)
    version = args[PLAIN]["version"]
    metrics |= {
        "backend": "sglang",
        "engine": f"sglang {version}",
        "peer": "sglang NGRAM" if PEER in urls else None,
        "dtype": dtype,
        "drafter_dtype": str(args[spec.kind]["dtype"]),  # SGLang runs the drafter in the server's dtype
        "machine": where,
        "sglang_args": args,
    }
    if PEER in urls:
        metrics["ngram_acceptance_length"] = _ngram_acceptance(responses)
    metrics["eval_coverage"] = eval_coverage(run, _draft_vocabulary(drafter_dir, spec))
    rows = [_row(res, p, r, spec.kind) for res, p, r in zip(run.results, prompts, responses, strict=True)]
    tags = {"eval.backend": "sglang", "eval.engine": f"sglang {version}", "eval.machine": where}
    tags |= {f"eval.sglang_{kind}_args": json.dumps(a, sort_keys=True) for kind, a in args.items()}
    tags["eval.dtype"] = dtype
    report = [summary_line(metrics), domain_table(metrics), category_table(metrics), interval_line(metrics)]
    return EvalOutcome(
        metrics, rows, tags, report, compared=("plain", spec.label), engine="SGLang's speculative"
    )


def _draft_vocabulary(drafter_dir: Path, spec: SpecServer) -> torch.Tensor:
    """t2d: the target tokens the drafter can propose (a DFlash drafter: all of them)."""
    if spec.kind == "dflash":
        return torch.ones(load_dflash_config(drafter_dir).vocab_size, dtype=torch.bool)
    with safe_open(drafter_dir / "model.safetensors", "pt") as f:
        return f.get_tensor("t2d")


def summary_line(metrics: dict) -> str:
    m = metrics
    line = (
        f"SGLang ({m['engine']}, {m['dtype']}): acceptance length {m['acceptance_length']:.2f}, "
        f"{metrics['tokens_per_s']:.2f} tok/s vs {metrics['baseline_tokens_per_s']:.2f} plain: speedup "
        f"{metrics['speedup']:.2f}x"
    )
    if "prompt_lookup_speedup" in metrics:
        peer = (
            f"NGRAM {m['prompt_lookup_speedup']:.2f}x, acceptance length {m['ngram_acceptance_length']:.2f}"
        )
        line += f" ({peer})"
    return line + (
        f"; greedy_match {metrics['greedy_match']:.2f}, {metrics['divergences']} divergence(s), "
        f"lossless: {metrics['lossless']}"
    )
