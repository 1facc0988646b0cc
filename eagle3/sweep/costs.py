"""Each sweep row's cost from `eagle3 plan`: on the row's own target (the report's plan columns)
and, with `eagle3 report --plan-target T`, on another target, as a ratio to the 32,768 row's."""

from __future__ import annotations

import functools
import json
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from eagle3.core.inputs import InputError
from eagle3.sweep.decide import fmt, sweep_rows
from eagle3.sweep.experiments import Experiment
from eagle3.sweep.paired import Column

REFERENCE_SIZE = 32768  # the draft vocabulary the plan-target ratios are taken against (Kimi-K2.5's 32K)
# `eagle3 plan` keys on another target: these describe the drafter of the row's own target
OWN_DRAFTER_KEYS = ("train.init", "extract.aux_layers") + tuple(
    f"train.{k}" for k in ("intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim")
)


@functools.cache
def _target_config(source: str) -> dict:
    from eagle3.sweep.plan import read_target_config  # the plan reads configs only when asked

    return read_target_config(source)


@functools.cache
def _plan_of(flat_params: str) -> dict | None:
    """`eagle3 plan` for one row's params (JSON of the flat params), None when they no longer
    validate or the target's config cannot be read here."""
    from eagle3.core.params import ParamsError, parse_params
    from eagle3.sweep.plan import plan

    nested: dict = {}
    for key, value in json.loads(flat_params).items():
        *parents, name = key.split(".")  # a mapping param nests deeper: eval.domains.chat
        level = nested
        for part in parents:
            level = level.setdefault(part, {})
        level[name] = value
    try:
        params = parse_params(nested)
        result = plan(params, _target_config(params.target.source))
    except (ParamsError, InputError, OSError, ValueError, KeyError):
        return None
    return {
        "trainable": result["drafter"]["params"]["trainable"],
        "draft_gflop": result["flops"]["draft_step"] / 1e9,
        "train_gib": result["training"]["memory_gib_per_device"]["total_ddp"],
        "draft_vocab_size": result["drafter"]["draft_vocab_size"],
    }


def planned(e: Experiment, key: str) -> float | None:
    cost = _plan_of(json.dumps(e.params, sort_keys=True)) if e.params else None
    return None if cost is None else cost[key]


@dataclass(frozen=True)
class PlanTarget:
    """Another target to price every row's draft vocabulary on (`eagle3 report --plan-target`)."""

    source: str  # as `eagle3 plan --target` takes it: config.json, HF folder or packaged name
    label: str  # for column names: the folder's name (kimi-k2.5), or the packaged name
    vocab_size: int

    @classmethod
    def read(cls, source: str) -> PlanTarget:
        """InputError (the plan's own message) when `source` is no language model's config."""
        config = _target_config(source)
        path = Path(source).expanduser()
        if path.is_dir():
            label = path.resolve().name
        elif path.exists():
            label = path.resolve().parent.name if path.name == "config.json" else path.stem
        else:
            label = source
        return cls(source, label, int(config["vocab_size"]))

    def cost(self, e: Experiment) -> dict | None:
        """The plan of the row's params on this target at the row's draft vocabulary (capped at
        the target's): the target section replaced, the drafter shape derived from the target."""
        from eagle3.vocab import draft_size  # torch, only when a plan target is given

        size = e.draft_vocab_size
        if size is None:
            return None
        flat = {
            k: v for k, v in e.params.items() if not k.startswith("target.") and k not in OWN_DRAFTER_KEYS
        }
        flat |= {"target.source": self.source, "vocab.size": draft_size(size, self.vocab_size)}
        return _plan_of(json.dumps(flat, sort_keys=True))


def _short(size: int) -> str:
    return f"{size // 1024}K" if size % 1024 == 0 else f"{size:,}"


def plan_reference(experiments: list[Experiment], target: PlanTarget) -> Experiment | None:
    """The row the plan-target ratios divide by: draft vocabulary 32,768, else the one nearest it
    (in log2; the smaller on a tie), among rows the plan prices."""
    rows = [e for e in sweep_rows(experiments) if target.cost(e) is not None]
    if not rows:
        return None
    return min(rows, key=lambda e: (abs(math.log2(e.draft_vocab_size / REFERENCE_SIZE)), e.draft_vocab_size))


def _ratio(value: float | None, reference: float | None) -> str:
    return "-" if value is None or not reference else f"{value / reference:.2f}"


def plan_columns(experiments: list[Experiment], target: PlanTarget) -> tuple[list[Column], str]:
    """The plan-target columns (each cost, then its ratio to the reference row's) and the note
    that says how they were made and which row is the reference."""
    ref = plan_reference(experiments, target)
    base = target.cost(ref) if ref is not None else None
    ratio_label = f"x {_short(ref.draft_vocab_size) if ref is not None else _short(REFERENCE_SIZE)}"
    name = target.label

    def get(key: str, spec: str) -> Callable[[Experiment], str]:
        return lambda e: fmt(None if (c := target.cost(e)) is None else c[key], spec)

    def ratio(key: str) -> Callable[[Experiment], str]:
        return lambda e: _ratio(
            None if (c := target.cost(e)) is None else c[key], None if base is None else base[key]
        )

    columns: list[Column] = [
        (f"{name} vocab (plan)", get("draft_vocab_size", ",.0f")),
        (f"{name} trainable (plan)", get("trainable", ",.0f")),
        (ratio_label, ratio("trainable")),
        (f"{name} draft GFLOP/step (plan)", get("draft_gflop", ".3f")),
        (ratio_label, ratio("draft_gflop")),
        (f"{name} train GiB/device (plan)", get("train_gib", ".1f")),
        (ratio_label, ratio("train_gib")),
    ]
    if ref is None:
        which = "no row could be planned there, so no ratio"
    elif ref.draft_vocab_size == REFERENCE_SIZE:
        which = f"`{ratio_label}` divides by the {REFERENCE_SIZE:,} row ({ref.name})"
    else:
        which = (
            f"no row has {REFERENCE_SIZE:,}: `{ratio_label}` divides by the nearest, "
            f"{ref.draft_vocab_size:,} ({ref.name})"
        )
    note = (
        f"`{name} ... (plan)` columns: `eagle3 plan --target {target.source}` on each row's params at its "
        f"draft vocabulary (capped at the target's {target.vocab_size:,}), with the drafter shape and aux "
        "layers derived from that target; trainable drafter parameters, one draft step's GFLOP and "
        f"training memory per device (DDP, the row's train settings); {which}."
    )
    return columns, note
