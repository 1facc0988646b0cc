"""Deciding the dtype of each job for a params file: what `auto` resolves to here and why
(eagle3/core/device.py measures; eagle3/core/resolved_dtypes.py records the outcome for DVC)."""

from __future__ import annotations

from rich.table import Table

from eagle3.core.device import Job, Shape, resolve_dtype_name
from eagle3.core.params import Params


def shapes(params: Params) -> dict[str, Shape]:
    """The sizes each measurement is taken at: the target's, and the drafter layer train builds."""
    from eagle3.drafter.config import DrafterConfig  # heavy imports, stage-only
    from eagle3.train.prepare import drafter_config
    from eagle3.verifier.load import load_target_config

    config = load_target_config(params.target)
    text = getattr(config, "text_config", None) or config
    aux = [0, 1, 2]  # the drafter layer's sizes do not depend on which layers feed it
    base = DrafterConfig.from_target_config(config, text.vocab_size, aux)  # K does not enter Shape
    return {"target": Shape.of(config), "drafter": Shape.of(drafter_config(base, params.train))}


def resolve(params: Params, measure: bool = True) -> dict[Job, dict[str, dict[str, str]]]:
    """{job: {param key: {"dtype": resolved name, "why": where the decision came from}}};
    measure=False leaves "auto" where no kept measurement decides yet."""
    sizes = shapes(params)
    ev = params.eval
    wanted: dict[Job, dict[str, tuple[str, Job, Shape]]] = {
        "prefill": {"target.dtype": (params.target.dtype, "prefill", sizes["target"])},
        "train": {"train.dtype": (params.train.dtype, "train", sizes["drafter"])},
        "decode": {
            "eval.dtype": (ev.dtype, "decode", sizes["target"]),
            "eval.drafter_dtype": (ev.drafter_dtype or ev.dtype, "decode", sizes["target"]),
        },
    }
    resolved: dict[Job, dict[str, dict[str, str]]] = {}
    for job, keys in wanted.items():
        resolved[job] = {}
        for key, (name, measured_as, shape) in keys.items():
            dtype, why = resolve_dtype_name(name, measured_as, shape, measure)
            resolved[job][key] = {"dtype": dtype, "why": why}
    return resolved


def forget(params: Params) -> None:
    """Drop this machine's kept measurements for the shapes `params` use (`eagle3 dtypes --remeasure`)."""
    from eagle3.core.device import JOBS, cpu_decision, policy_path

    for shape in shapes(params).values():
        for job in JOBS:
            policy_path(job, shape).unlink(missing_ok=True)
    cpu_decision.cache_clear()


def table(resolved: dict[Job, dict[str, dict[str, str]]]):
    """A rich table of the decisions: job, param, dtype, and what decided it."""
    out = Table(title="dtypes", title_justify="left")
    for column in ("job", "param", "dtype", "decided by"):
        out.add_column(column)
    for job, keys in resolved.items():
        for key, value in keys.items():
            out.add_row(job, key, value["dtype"], value["why"])
    return out
