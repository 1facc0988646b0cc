"""Decoding the target with a drafter, set up once for everyone who does it: speculative-eval
(both backends), the benches (bench/decoding.py, trees.py, drafters.py) and `eagle3 serve-command`.

- which drafter, and what its depth means: eval.k draft steps past the TTT length the drafter was
  trained with are served as SGLang and EAGLE serve them (a fair question to measure, e.g. two
  drafters at one shape), with a warning and the count of untrained steps in the metrics;
- the target and the drafter in their decoding dtypes, the drafter checked against the target,
  both oneDNN-packed (one packed target serves the baseline, the engine and the peer);
- prompts rendered as extraction renders a training prompt, and the engine of the eval params.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from eagle3.core.device import machine
from eagle3.core.inputs import InputError
from eagle3.core.packed import pack_linears
from eagle3.core.params import EvalParams, Params, TargetParams, default_aux_layers
from eagle3.core.pipeline import DRAFTER
from eagle3.decoding.engine import SpecEngine
from eagle3.decoding.prompts import Prompt, render_prompts
from eagle3.drafter import DrafterConfig, Eagle3Drafter
from eagle3.drafter.export import CONFIG, load_drafter, load_drafter_config, trained_ttt_length
from eagle3.dtypes.policy import resolve_dtype
from eagle3.dtypes.probes import DraftShape, Shape, Work
from eagle3.target.load import Target, eos_token_ids, has_chat_template, load_target

# Draft vocabulary of the untrained drafter the benches use where no exported one is given.
UNTRAINED_DRAFT_VOCAB = 8192


def untrained_steps(k: int, ttt_length: int) -> int:
    """Draft steps of a depth-`k` draft that the drafter's TTT unroll never trained."""
    return max(0, k - ttt_length)


def depth_warning(k: int, ttt_length: int) -> str | None:
    """The one warning on depth, for every backend, bench and serving command: None when the
    drafter was trained for all `k` steps."""
    if not (extra := untrained_steps(k, ttt_length)):
        return None
    steps = f"step {k} was" if extra == 1 else f"steps {ttt_length + 1}..{k} were"
    return (
        f"warning: eval.k {k} is deeper than the drafter's trained TTT length ({ttt_length}): draft "
        f"{steps} never trained (served as SGLang serves them; recorded as untrained_steps: {extra})"
    )


def eval_drafter(params: Params, folder: str | None = None) -> Path:
    """The drafter to evaluate or serve: `folder`, else eval.drafter, else the train stage's;
    refused unless it is an exported drafter (its depth: drafter_depth)."""
    path = Path(folder or params.eval.drafter or DRAFTER)
    if not (path / CONFIG).exists():
        if folder or params.eval.drafter:
            hint = f"{'--drafter' if folder else 'eval.drafter'} names no exported drafter"
        else:
            hint = "run the train stage first"
        raise FileNotFoundError(f"{path} holds no exported drafter ({CONFIG} is missing): {hint}")
    return path


def drafter_depth(params: Params, drafter_dir: Path) -> tuple[int, str | None]:
    """(untrained_steps, warning or None) of serving `drafter_dir` at eval.k draft steps."""
    trained = trained_ttt_length(drafter_dir, params.train.ttt_length)
    return untrained_steps(params.eval.k, trained), depth_warning(params.eval.k, trained)


def engine_settings(ev: EvalParams) -> dict:
    """The SpecEngine keywords the eval params set."""
    return {
        "mode": ev.mode,
        "k": ev.k,
        "topk": ev.topk,
        "tree_budget": ev.tree_budget,
        "lookup_tokens": ev.lookup_tokens,
        "temperature": ev.temperature,
        "seed": ev.seed,
    }


def _check_fits(drafter_dir: Path, target: Target) -> None:
    if why := load_drafter_config(drafter_dir).mismatch(target.vocab_size, target.num_layers):
        raise InputError(f"{drafter_dir} was {why}")


@dataclass
class DecodingSetup:
    """A target and a drafter loaded for decoding, and what every decoder of the pair needs."""

    target: Target
    drafter: Eagle3Drafter
    drafter_dtype: torch.dtype
    packed: bool = True

    @classmethod
    def load(
        cls,
        target: TargetParams,
        drafter_dir: Path | None,
        drafter_dtype: str | None = None,
        pack: bool = True,
        draft: DraftShape | None = None,
    ) -> DecodingSetup:
        """The target in target.dtype (auto: the fastest here for decoding at the draft shape
        `draft`, None: the default eval's) and the drafter of `drafter_dir` in `drafter_dtype`
        (None: the target's; auto: the fastest for its step at `draft`), both packed unless `pack`
        is off (a no-op outside float32 on CPU). `drafter_dir` None: an untrained drafter of the
        target's shape, for the benches (acceptance ~0: it measures the engine's own overhead)."""
        loaded = load_target(target, job="decode", draft=draft)
        if drafter_dir is not None:
            _check_fits(drafter_dir, loaded)
        if drafter_dir is None:
            cfg = DrafterConfig.from_target_config(
                loaded.config, UNTRAINED_DRAFT_VOCAB, default_aux_layers(loaded.num_layers)
            )
        else:
            cfg = load_drafter_config(drafter_dir)
        dtype = loaded.model.dtype
        if drafter_dtype is not None:
            work = Work.of("draft", Shape.of(cfg, cfg.draft_vocab_size), draft)
            dtype = resolve_dtype(drafter_dtype, work)
        embed = loaded.model.get_input_embeddings().weight
        if drafter_dir is None:
            drafter = Eagle3Drafter(cfg, embed).to(dtype).eval().requires_grad_(False)
        else:
            drafter = load_drafter(drafter_dir, embed, dtype=dtype, target_config=loaded.config)
        if pack:
            pack_linears(loaded.model)
            pack_linears(drafter)
        return cls(loaded, drafter, dtype, pack)

    def with_drafter(self, drafter_dir: Path) -> DecodingSetup:
        """Another exported drafter on this same loaded target, in the same dtype and packing: two
        drafters compared in one run (bench/drafters.py) share one target and its weights."""
        _check_fits(drafter_dir, self.target)
        embed = self.target.model.get_input_embeddings().weight
        drafter = load_drafter(drafter_dir, embed, dtype=self.drafter_dtype, target_config=self.target.config)
        if self.packed:
            pack_linears(drafter)
        return DecodingSetup(self.target, drafter, self.drafter_dtype, self.packed)

    @classmethod
    def for_eval(cls, params: Params, drafter_dir: Path) -> DecodingSetup:
        """As speculative-eval decodes: eval.dtype for the target (and the plain and prompt-lookup
        peers), eval.drafter_dtype (null: eval.dtype), eval.pack_weights. Pass params pinned to
        the dtypes stage's record to decode in the dtypes it measured."""
        ev = params.eval
        target = params.target.model_copy(update={"dtype": ev.dtype})
        return cls.load(target, drafter_dir, ev.drafter_dtype, ev.pack_weights, DraftShape.of(ev))

    @property
    def eos(self) -> frozenset[int]:
        return eos_token_ids(self.target.model, self.target.tokenizer)

    @property
    def chat(self) -> bool:
        """The target renders prompts with its chat template (else as plain paragraphs)."""
        return has_chat_template(self.target.source)

    def render(self, prompts: Sequence[Prompt]) -> list[tuple[str, list[int]]]:
        """(id, token ids) of each prompt, rendered as extract renders a training prompt."""
        return render_prompts(self.target.tokenizer, prompts, self.chat)

    def engine(self, **settings: object) -> SpecEngine:
        return SpecEngine.for_target(self.target, self.drafter, **settings)

    def measured_on(self) -> dict[str, str]:
        """Speeds compare only within one machine and dtype: what every figure is measured on."""
        return {
            "dtype": str(self.target.model.dtype).removeprefix("torch."),
            "drafter_dtype": str(self.drafter_dtype).removeprefix("torch."),
            "machine": machine(),
        }
