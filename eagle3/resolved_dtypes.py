"""The dtypes a pipeline run computes in, decided once and recorded where DVC sees them.

`auto` dtypes are measured on the machine at hand (eagle3/device.py). The dtypes stage resolves
them and writes one small file per job, artifacts/dtypes/{prefill,train,decode}.json, holding
only the resolved names; patch-check and extract list prefill.json as a dep, train lists
train.json, speculative-eval decode.json. So a decision that changes (another machine, a
remeasurement) re-runs exactly the stages it affects, and an unchanged one rewrites the same
bytes and re-runs nothing. The stages take their dtypes from these files, never from a second
measurement that could disagree with what DVC hashed.
"""

from __future__ import annotations

import json
from pathlib import Path

from eagle3.device import Job, Shape, native_bf16, resolve_dtype_name
from eagle3.params import Params
from eagle3.stageio import write_json

FOLDER = Path("artifacts/dtypes")


def _shapes(params: Params) -> dict[str, Shape]:
    """The sizes each measurement is taken at: the target's, and the drafter layer train builds."""
    from eagle3.drafter.config import DrafterConfig  # noqa: PLC0415 - heavy imports, stage-only
    from eagle3.target.load import load_target_config  # noqa: PLC0415
    from eagle3.train.prepare import drafter_config  # noqa: PLC0415

    config = load_target_config(params.target)
    text = getattr(config, "text_config", None) or config
    aux = [0, 1, 2]  # the drafter layer's sizes do not depend on which layers feed it
    base = DrafterConfig.from_target_config(config, min(params.vocab.size, text.vocab_size), aux)
    return {"target": Shape.of(config), "drafter": Shape.of(drafter_config(base, params.train))}


def resolve(params: Params, measure: bool = True) -> dict[Job, dict[str, dict[str, str]]]:
    """{job: {param key: {"dtype": resolved name, "why": where the decision came from}}};
    measure=False leaves "auto" where no kept measurement decides yet."""
    shapes = _shapes(params)
    ev = params.eval
    wanted: dict[Job, dict[str, tuple[str, Job, Shape]]] = {
        "prefill": {"target.dtype": (params.target.dtype, "prefill", shapes["target"])},
        "train": {"train.dtype": (params.train.dtype, "train", shapes["drafter"])},
        "decode": {
            "eval.dtype": (ev.dtype, "decode", shapes["target"]),
            "eval.drafter_dtype": (ev.drafter_dtype or ev.dtype, "decode", shapes["target"]),
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
    from eagle3.device import JOBS, cpu_decision, policy_path  # noqa: PLC0415

    for shape in _shapes(params).values():
        for job in JOBS:
            policy_path(job, shape).unlink(missing_ok=True)
    cpu_decision.cache_clear()


def table(resolved: dict[Job, dict[str, dict[str, str]]]):
    """A rich table of the decisions: job, param, dtype, and what decided it."""
    from rich.table import Table  # noqa: PLC0415

    out = Table(title="dtypes", title_justify="left")
    for column in ("job", "param", "dtype", "decided by"):
        out.add_column(column)
    for job, keys in resolved.items():
        for key, value in keys.items():
            out.add_row(job, key, value["dtype"], value["why"])
    return out


def record(resolved: dict[Job, dict[str, dict[str, str]]], folder: Path = FOLDER) -> None:
    """One file per job with the resolved names only (no timings, no paths): the same decision
    gives the same bytes. train.json also says whether bf16 is native, which decides the
    dtype of the in-draft argmax pass (eagle3/train/data.py)."""
    for job, keys in resolved.items():
        content = {key: value["dtype"] for key, value in keys.items()}
        if job == "train":
            content["native_bf16"] = native_bf16()
        write_json(folder / f"{job}.json", content)


def pinned(params: Params, job: Job, folder: Path = FOLDER) -> Params:
    """`params` with each `auto` dtype of `job` replaced by the recorded decision; explicit
    dtypes stay as set. Without a record (a stage run outside DVC) the params are returned
    unchanged and resolve live."""
    path = folder / f"{job}.json"
    if not path.exists():
        return params
    recorded = json.loads(path.read_text())
    sections = params.model_dump()
    for key, dtype in recorded.items():
        section, _, name = key.partition(".")
        # auto, or a drafter_dtype of null (= eval.dtype, recorded resolved)
        if name and sections[section][name] in ("auto", None):
            sections[section][name] = dtype
    return type(params).model_validate(sections)
