"""The dtypes a pipeline run computes in, decided once and recorded where DVC sees them.

`auto` dtypes are measured on the machine at hand (policy.py) and decided per params
(decisions.py). The dtypes stage writes one small file per job,
artifacts/dtypes/{prefill,train,decode}.json, holding only the resolved names; patch-check and
extract list prefill.json as a dep, train lists train.json, speculative-eval decode.json. So a
decision that changes (another machine, a remeasurement) re-runs exactly the stages it affects,
and an unchanged one rewrites the same bytes and re-runs nothing. The stages take their dtypes
from these files, never from a second measurement that could disagree with what DVC hashed.
"""

from __future__ import annotations

import json
from pathlib import Path

from eagle3.core.device import native_bf16
from eagle3.core.params import Params
from eagle3.core.pipeline import DTYPES
from eagle3.core.stageio import write_json

FOLDER = DTYPES


def record(resolved: dict[str, dict[str, dict[str, str]]], folder: Path = FOLDER) -> None:
    """One file per job with the resolved names only (no timings, no paths): the same decision
    gives the same bytes. train.json also says whether bf16 is native, which decides the
    dtype of the in-draft argmax pass (eagle3/train/data.py)."""
    for job, keys in resolved.items():
        content = {key: value["dtype"] for key, value in keys.items()}
        if job == "train":
            content["native_bf16"] = native_bf16()
        write_json(folder / f"{job}.json", content)


def pinned(params: Params, job: str, folder: Path = FOLDER) -> Params:
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
