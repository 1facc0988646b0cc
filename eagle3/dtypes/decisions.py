"""What each dtype param of a params file resolves to here, and on what work: the dtypes stage
and `eagle3 dtypes` print it, resolved.py records it.

`shapes` are the model sizes the params build ({"target", "drafter" (the layer train builds),
"draft" (that layer over the draft vocabulary)}; eagle3/train/prepare.py dtype_shapes): this
module reads only the params that choose the work and the dtypes, each by its full key, so
`eagle3 pipeline check` (tests/test_derived.py) can hold the dtypes stage's params list to them."""

from __future__ import annotations

from rich.table import Table

from eagle3.core.params import Params
from eagle3.dtypes.policy import forget, resolve_dtype_name
from eagle3.dtypes.probes import DraftShape, Job, Shape, Work

Resolved = dict[Job, dict[str, dict[str, str]]]


def draft_shape(params: Params) -> DraftShape:
    """The eval's draft shape: how many tokens a verify step carries, and the drafter's rows."""
    return DraftShape(
        params.eval.mode, params.eval.k, params.eval.topk, params.eval.tree_budget, params.eval.lookup_tokens
    )


def wanted(params: Params, shapes: dict[str, Shape]) -> dict[str, dict[str, tuple[str, Work]]]:
    """{record file: {param key: (its value, the work `auto` is decided on)}}."""
    draft = draft_shape(params)
    target = Work.of("decode", shapes["target"], draft)
    drafter_dtype = params.eval.drafter_dtype
    return {
        "prefill": {"target.dtype": (params.target.dtype, Work.of("prefill", shapes["target"]))},
        "train": {"train.dtype": (params.train.dtype, Work.of("train", shapes["drafter"]))},
        "decode": {
            "eval.dtype": (params.eval.dtype, target),
            # null = eval.dtype, resolved as the target's
            "eval.drafter_dtype": (params.eval.dtype, target)
            if drafter_dtype is None
            else (drafter_dtype, Work.of("draft", shapes["draft"], draft)),
        },
    }


def resolve(params: Params, shapes: dict[str, Shape], measure: bool = True) -> Resolved:
    """{record file: {param key: {"dtype": resolved name, "why": what decided it}}};
    measure=False leaves "auto" where no kept measurement decides yet."""
    resolved: Resolved = {}
    for job, keys in wanted(params, shapes).items():
        resolved[job] = {}
        for key, (name, work) in keys.items():
            dtype, why = resolve_dtype_name(name, work, measure)
            resolved[job][key] = {"dtype": dtype, "why": why, "work": work.describe()}
    return resolved


def forget_params(params: Params, shapes: dict[str, Shape]) -> None:
    """Drop this machine's kept decisions for the work `params` decide on (`--remeasure`)."""
    forget([work for keys in wanted(params, shapes).values() for _, work in keys.values()])


def table(resolved: Resolved) -> Table:
    """A rich table of the decisions: job, param, dtype, and what decided it."""
    out = Table(title="dtypes", title_justify="left")
    for column in ("record", "param", "dtype", "measured on", "decided by"):
        out.add_column(column)
    for job, keys in resolved.items():
        for key, value in keys.items():
            out.add_row(job, key, value["dtype"], value.get("work", ""), value["why"])
    return out
