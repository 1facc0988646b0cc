"""The pipeline, declared once: each stage's command, outputs, params and the artifacts it reads.

Everything else is derived from this module. `eagle3 pipeline write` writes dvc.yaml from it,
each stage's code deps being the project modules its command can import (eagle3/derived/); the
stages import their artifact paths from here; eagle3/core/stage_commit.py takes each stage's
outputs from here; `eagle3 pipeline check` (and tests/test_derived.py) fails when dvc.yaml is
not what this module and the code give.

Why the code declares the stages and writes dvc.yaml, rather than reading dvc.yaml:
- the deps are computed (the import closure), so dvc.yaml needs a writer in any case, and a file
  that is partly written by hand and partly by a program keeps neither's guarantees;
- the stages take their paths as Python values, checked when this module is imported: no YAML is
  parsed at run time and no stage depends on the working directory holding dvc.yaml;
- a typed declaration refuses what DVC would accept silently (a params key the schema lacks, an
  out that is not persisted, an input no earlier stage writes), in one line naming the stage;
- the comments that explain a DVC setting are declared with the entry they explain, so they move
  with it, and the writer emits them: dvc.yaml stays readable.

This module holds data only, no behaviour, so no stage lists it as a dep although every stage
imports it: what a stage's part of it changes, DVC sees in that stage's entry of dvc.yaml.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal

# The artifacts the stages write and read, by name. A stage's outputs below are made of these;
# code that reads another stage's output imports its name from here.
DTYPES = Path("artifacts/dtypes")  # one decision file per job: prefill.json, train.json, decode.json
PATCH_CHECK = Path("artifacts/patch-check")
PATCH_REPORT = PATCH_CHECK / "report.json"  # the fingerprint of the target and engine
FEATURES = Path("artifacts/extract")  # the feature store
VOCAB_MAP = Path("artifacts/vocab-map")
DRAFTER = Path("artifacts/train/drafter")  # the exported drafter
# Not an output: DVC must not delete it before a re-run, so an interrupted train run can resume.
CHECKPOINTS = DRAFTER.parent / "checkpoints"
EVAL_RESULTS = Path("artifacts/speculative-eval")
COVERAGE_PLOT = Path("plots/coverage.csv")
TRAIN_CURVE = Path("plots/train_curve.csv")
TRAIN_ACC_BY_POSITION = Path("plots/train_acc_by_position.csv")
SIM_ACCEPTANCE = Path("plots/sim_acceptance.csv")
ACCEPTANCE_CSV = Path("plots/acceptance.csv")
ACCEPTANCE_PNG = Path("plots/acceptance.png")
# acceptance and speedup per domain, short keys: what `dvc exp show` leads with
DOMAINS_METRICS = Path("metrics/domains.json")


def dtype_record(job: str) -> Path:
    """The dtypes stage's decision file of `job` (prefill, train or decode)."""
    return DTYPES / f"{job}.json"


def metrics_path(stage: str) -> Path:
    """The metrics file of `stage` (a stage declared with metrics=True)."""
    return Path("metrics") / f"{stage}.json"


@dataclass(frozen=True)
class Entry:
    """A deps or params entry with why it is there: `note` ends its line in dvc.yaml, `above`
    is written on the lines before it."""

    value: str
    note: str = ""
    above: str = ""


@dataclass(frozen=True)
class Output:
    """One output. Every output is persisted: DVC deletes any other before it runs the stage, so
    a stage that then fails would lose the last run's outputs (eagle3/core/stage_commit.py)."""

    path: Path
    kind: Literal["outs", "metrics", "plots"] = "outs"
    cache: bool = True  # metrics and plots are committed to git, not to DVC's cache
    persist: bool = True
    x: str | None = None  # plots: the columns and title `dvc plots show` uses
    y: str | None = None
    title: str | None = None
    above: str = ""  # a comment written on the lines before it in dvc.yaml


def plot(path: Path, x: str | None = None, y: str | None = None, title: str | None = None) -> Output:
    return Output(path, "plots", cache=False, x=x, y=y, title=title)


@dataclass(frozen=True)
class Stage:
    """One stage: `python -m <module>`, what it writes, the params it re-runs on, and the
    other stages' outputs it reads. Its code deps are not declared: they are derived."""

    name: str
    module: str
    outs: tuple[Output, ...]
    params: tuple[str | Entry, ...]
    metrics: bool = True  # writes metrics/<name>.json
    plots: tuple[Output, ...] = ()
    reads: tuple[Path | Entry, ...] = ()  # outputs of earlier stages, listed after the code
    files: tuple[str | Entry, ...] = ()  # deps that are no Python module of the project
    whole: tuple[str, ...] = ()  # packages listed whole, though the stage imports part of them
    always_changed: bool = False
    staged: bool = True  # writes every output through eagle3/core/stage_commit.py
    about: str = ""  # comment lines above its cmd
    deps_above: str = ""  # comment lines above its deps
    params_note: str = ""  # comment at the end of its `params:` line

    @property
    def cmd(self) -> str:
        return f"python -m {self.module}"

    @property
    def outputs(self) -> tuple[Output, ...]:
        """Its outs, metrics and plots, in dvc.yaml's order."""
        metrics = (Output(metrics_path(self.name), "metrics", cache=False),) if self.metrics else ()
        return self.outs + metrics + self.plots

    @property
    def output_paths(self) -> tuple[str, ...]:
        return tuple(out.path.as_posix() for out in self.outputs)

    @property
    def param_keys(self) -> tuple[str, ...]:
        return tuple(p.value if isinstance(p, Entry) else p for p in self.params)


HEADER = """\
Every out is `persist: true`: DVC deletes any other out before it runs the stage, so a stage that
then fails (a bad param, a missing file, a dead server) would lose the last run's outputs. Each
stage replaces all its outputs together only when it succeeds (eagle3/core/stage_commit.py).
persist turns DVC's run-cache off for the stage; every stage had it off already (each has a
persist out since before, and dtypes is always_changed)."""

STAGES: tuple[Stage, ...] = (
    Stage(
        "dtypes",
        "stages.dtypes",
        outs=tuple(Output(dtype_record(job)) for job in ("prefill", "train", "decode")),
        params=(
            "target",
            "train.dtype",
            "train.intermediate_size",
            "train.num_attention_heads",
            "train.num_key_value_heads",
            "train.head_dim",
            "vocab.size",
            "eval.dtype",
            "eval.drafter_dtype",
            "eval.mode",
            "eval.k",
            "eval.topk",
            "eval.tree_budget",
            "eval.lookup_tokens",
        ),
        metrics=False,
        always_changed=True,
        staged=False,  # each decision file is written on its own, atomically
        about="Resolves `auto` dtypes on this machine (eagle3/dtypes/resolved.py) on every run: its "
        "files change only when a decision does, and only the stages listing that file re-run.",
        params_note="what a decision depends on: the dtype params, the sizes and the eval draft shape "
        "measured",
    ),
    Stage(
        "patch-check",
        "stages.patch_check",
        outs=(
            Output(
                PATCH_CHECK,
                above="persist: DVC would delete the old report before the stage can reject bad params.",
            ),
        ),
        params=(
            "target",
            "extract.backend",
            "extract.aux_layers",
            "extract.sglang_target",
            "extract.sglang_top_logprobs",
            Entry("drafter.kind", note="dflash: the layers captured are dflash.target_layers"),
            "dflash.target_layers",
            Entry("dflash.num_layers", note="dflash.target_layers null: one target layer per draft layer"),
        ),
        reads=(dtype_record("prefill"),),
    ),
    Stage(
        "extract",
        "stages.extract",
        outs=(
            Output(
                FEATURES,
                above="persist: a re-run keeps the intact shards (a damaged one is recomputed alone). An "
                f"unfinished run keeps its shards beside it ({FEATURES.as_posix()}.partial), outside DVC: "
                "`dvc exp run` checks out the committed store before running, deleting what a killed run "
                "left here.",
            ),
        ),
        params=("target", "data", "extract"),
        reads=(
            dtype_record("prefill"),
            Entry(
                PATCH_REPORT.as_posix(),
                above="the layers captured: the report's fingerprint, as patch-check resolves them from "
                "extract.aux_layers or, under drafter.kind dflash, dflash.target_layers / num_layers. No "
                "params of their own here: a family key that leaves the layers as they are rewrites the "
                "same report, and DVC skips the extraction.",
            ),
        ),
    ),
    Stage(
        "vocab-map",
        "stages.vocab_map",
        outs=(
            Output(
                VOCAB_MAP,
                above="persist turns DVC's run-cache off for this stage: the run-cache key drops every "
                'params key named `size` (dvc 3.67 hashes with exclude=["size", "nfiles"]), so it '
                "would restore another vocab.size's mapping. The stage rewrites both files on every run.",
            ),
        ),
        params=(
            "vocab",
            Entry("target", note="the target's vocabulary size"),
            Entry(
                "train.init",
                above="warm start: the drafter's own d2t/t2d are adopted. DVC deps cannot be conditional, "
                "so the folder is tracked by this param (its path); its files' sha256 goes into vocab.json, "
                "and train refuses a mapping adopted from other bytes than the folder holds now. A drafter "
                "replaced in place at the same path: `dvc repro -f vocab-map train`.",
            ),
            Entry("drafter.kind", note="dflash: the whole vocabulary, whatever vocab.size says"),
            Entry(
                "dflash",
                above="the family's keys train depends on go into vocab.json (eagle3/drafter/family.py), "
                "not into train's params: a key of the other family re-runs this stage to the same bytes, "
                "and DVC skips train",
            ),
        ),
        plots=(
            plot(
                COVERAGE_PLOT,
                "draft_vocab_size",
                "coverage",
                "Coverage of loss-masked tokens by draft vocabulary size",
            ),
        ),
        reads=(FEATURES,),
        # all of eagle3/drafter but cost.py, listed whole as it was before the deps were derived: a
        # narrower list would change dvc.lock's deps and re-run vocab-map for nothing
        whole=("eagle3/drafter",),
    ),
    Stage(
        "train",
        "stages.train",
        outs=(
            Output(
                DRAFTER,
                above="persist: bad params must not delete the last drafter before the stage fails. The "
                f"resumable checkpoints live next to it ({CHECKPOINTS.as_posix()}), outside DVC.",
            ),
        ),
        params=(
            "train",
            Entry(
                "target",
                note="an online store's features come from the target; a warm start checks its source",
            ),
            Entry("extract.batch_tokens", note="online hf: the forward extraction would run"),
            "extract.pack_weights",
        ),
        plots=(
            plot(TRAIN_CURVE, "step", "loss", "Training loss per step (mean over TTT positions)"),
            plot(
                TRAIN_ACC_BY_POSITION,
                "ttt_position",
                "heldout_acc",
                "Held-out top-1 accuracy by TTT position",
            ),
            plot(
                SIM_ACCEPTANCE,
                "epoch",
                "acceptance_length",
                "Simulated acceptance length per epoch and draft shape (held-out features)",
            ),
        ),
        reads=(dtype_record("prefill"), dtype_record("train"), FEATURES, VOCAB_MAP, PATCH_REPORT),
        deps_above="an online store (extract.features: online) computes its features here, with extraction's "
        "own code (eagle3/data, eagle3/target) or from SGLang servers",
    ),
    Stage(
        "speculative-eval",
        "stages.speculative_eval",
        outs=(
            Output(
                EVAL_RESULTS,
                above="persist: DVC would delete the last results before the stage can reject bad params.",
            ),
            Output(DOMAINS_METRICS, "metrics", cache=False),
        ),
        params=(
            "target",
            "eval",
            Entry("train.ttt_length", note="the trained depth, for untrained_steps"),
            Entry(
                "data", note="the long domain: conversations of the training source held out from training"
            ),
            Entry("drafter.kind", note="the family eval.drafter must be, and the engine that decodes it"),
        ),
        plots=(
            plot(
                ACCEPTANCE_CSV,
                "position",
                "acceptance",
                "Acceptance by draft position (given the previous drafts were accepted)",
            ),
            plot(ACCEPTANCE_PNG),
        ),
        reads=(dtype_record("decode"), DRAFTER),
        files=(Entry("tools/sglang_cpu", note="eval.backend sglang on a CPU launches SGLang through it"),),
    ),
)
STAGE_BY_NAME = {stage.name: stage for stage in STAGES}
# The metrics files DVC shows (dvc.yaml's top-level metrics): the per-domain headline alone.
# `dvc exp show` lists every metric column before any param, and cuts columns off at the
# terminal's right edge, so each further file there (speculative-eval.json has ~125 keys) pushed
# the params that differ off a 120-column screen. Every stage's own metrics file is a plain
# output, committed with each experiment, which `eagle3 compare` and `eagle3 report` read from the
# experiment's commit (eagle3/sweep/experiments.py) and MLflow logs.
SHOWN_METRICS: tuple[Path, ...] = (DOMAINS_METRICS,)
# The stages that write metrics, in pipeline order: a stage's MLflow run also logs its upstream's.
STAGES_WITH_METRICS = tuple(stage.name for stage in STAGES if stage.metrics)

# Modules a stage imports whose changes cannot change what it writes: no stage lists them as deps.
NOT_DEPS = {
    "eagle3/core/tracking.py": "MLflow logging (metrics files are written before it runs)",
    "eagle3/__init__.py": "the package map and its LAYERS order, read only by tests/test_layers.py",
    "eagle3/core/pipeline.py": "this declaration: DVC sees a stage's part of it in dvc.yaml",
}

# (stage or "*", params key or section, module or "*") -> why the stage may read it without listing
# it. The transport keys (TRANSPORT_KEYS in eagle3/core/params.py) are allowed everywhere: they
# change no byte.
UNLISTED_READS: dict[tuple[str, str, str], str] = {
    ("*", "tracking", "eagle3/core/tracking.py"): "where MLflow logs; every output is written before it",
    ("dtypes", "train", "eagle3/train/prepare.py"): (
        "dtype_shapes hands the train section to drafter_config, which reads its shape keys (listed) "
        "and fc_norm/norm_output, which no measured size depends on; the module's other reads are "
        "the train stage's"
    ),
    ("*", "extract.aux_layers", "eagle3/core/params.py"): (
        "check_against_target, in the module every stage imports for the schema; the stages that "
        "resolve aux layers with it list the key (an online sglang train refuses servers whose layers "
        "differ from the store's)"
    ),
    **{
        ("train", key, "*"): (
            "the drafter family's keys: vocab-map lists them and records the family's in vocab.json "
            "(eagle3/drafter/family.py), train's dep, and train refuses a record that is not its params'"
        )
        for key in ("drafter.kind", "vocab.size", "dflash")
    },
    **{
        ("dtypes", key, "eagle3/drafter/family.py"): (
            "family_record, called by train's input checks in eagle3/train/prepare.py; dtypes imports that "
            "module for dtype_shapes alone"
        )
        for key in ("drafter.kind", "dflash")
    },
    ("*", "drafter.kind", "eagle3/core/params.py"): (
        "check_against_target resolves the layers the drafter family reads and checks them, before any "
        "work; the stages that capture or train list the key"
    ),
    ("*", "dflash", "eagle3/core/params.py"): (
        "check_against_target refuses DFlash target layers or a mask token outside the target before any "
        "work; the stages that capture or train list what they use"
    ),
    ("*", "train.target_topk", "eagle3/core/params.py"): (
        "check_against_target refuses a top-N larger than the target's vocabulary before any work; "
        "train, which uses it, lists it"
    ),
    ("*", "extract", "eagle3/sglang/features.py"): (
        "the servers: their addresses (transport keys), and a target mode checked against the store's "
        "fingerprint before any request"
    ),
    ("patch-check", "extract", "eagle3/sglang/patch_check.py"): (
        "the servers to check: their addresses (transport keys) and the target-mode keys it lists"
    ),
    ("train", "data", "eagle3/data/extract.py"): (
        "the extraction loop's selection: train imports the module for capture_rows and never runs "
        "the loop (an online store holds the samples extract selected)"
    ),
    ("train", "extract", "eagle3/data/extract.py"): "the same module's loop: shards, store dtype, resume key",
}
