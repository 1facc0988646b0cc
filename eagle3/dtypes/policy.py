"""This machine's dtype per work: `auto` resolved by the rule (rule.py) on a measurement of the
work (probes.py), taken once and kept.

On a GPU bf16 wins every job, and on a CPU without native bf16 float32 does (no measurement
needed). On a CPU with native bf16 the work is measured (~1 min for decoding a 135M target) and
the decision kept under ~/.cache/eagle3/dtype-policy/ (or $EAGLE3_CACHE), keyed by POLICY_VERSION,
CPU model, AVX/AMX flags, torch version, thread count and the work (job, model sizes, verify
tokens or draft rows), so each run resolves identically. A tie is kept too: its answer is the
machine class's default, which no remeasurement near the tie changes. Not kept: a measurement
taken while other processes kept more than LOADED_CORES cores busy (used once, measured again
next time). `eagle3 dtypes --remeasure` forgets the kept decisions of a params file.
"""

from __future__ import annotations

import hashlib
import json
from functools import cache
from pathlib import Path

import torch

from eagle3.core.cache import cache_root
from eagle3.core.device import cpu_model, machine, machine_class, native_bf16, vector_flags
from eagle3.core.stageio import write_json
from eagle3.dtypes.probes import DTYPES, Work, measure
from eagle3.dtypes.rule import decide, explain

# Bumped when the measurement or the rule changes: a decision taken the old way is not reused
# (3: decode timed on the verify step too, the confidence test, ties to the class default).
POLICY_VERSION = 3
# Other processes keeping more than this many cores busy during the measurement: the decision is
# used (CPU time is robust to load) but not kept, so a quiet run decides for good.
LOADED_CORES = 0.25


def policy_path(work: Work) -> Path:
    key = (
        f"{POLICY_VERSION}|{cpu_model()}|{vector_flags()}|{torch.__version__}|{torch.get_num_threads()}|"
        f"{work}"
    )
    return cache_root() / "dtype-policy" / f"{work.job}-{hashlib.sha256(key.encode()).hexdigest()[:16]}.json"


def measure_decision(work: Work) -> dict:
    """The rule's decision on a fresh measurement of `work`, with the measurement's context."""
    times, others = measure(work)
    klass = machine_class()
    return decide(work.job, times, klass) | {
        "machine": machine(),
        "machine_class": klass,
        "work": work.describe(),
        "shape": str(work.shape),
        "others_cores": others,
    }


def kept_decision(work: Work) -> dict | None:
    """The decision kept for `work` on this machine, without measuring; None if none."""
    path = policy_path(work)
    return json.loads(path.read_text()) | {"source": f"kept in {path}"} if path.exists() else None


@cache
def cpu_decision(work: Work) -> dict:
    """This machine's decision for `work`: the kept one, else measured now (and kept unless the
    machine was busy meanwhile). Its "source" says which."""
    if kept := kept_decision(work):
        return kept
    decision = measure_decision(work)
    if decision["others_cores"] > LOADED_CORES:
        busy = f"other processes kept {decision['others_cores']} cores busy while it was measured"
        return decision | {"source": f"measured now, not kept: {busy}"}
    path = policy_path(work)
    write_json(path, decision)
    return decision | {"source": f"measured now, kept in {path}"}


def forget(works: list[Work]) -> None:
    """Drop this machine's kept decisions for `works` (`eagle3 dtypes --remeasure`)."""
    for work in works:
        policy_path(work).unlink(missing_ok=True)
    cpu_decision.cache_clear()


def resolve_dtype(name: str, work: Work | None = None) -> torch.dtype:
    """`auto` = the fastest dtype for `work` on this machine; any other name is taken as is."""
    return DTYPES[resolve_dtype_name(name, work)[0]]


def resolve_dtype_name(name: str, work: Work | None = None, measure: bool = True) -> tuple[str, str]:
    """(dtype name, where the decision came from) for a dtype param value. `work` is needed only
    where a measurement decides (a CPU with native bf16); without it such a CPU keeps the old
    rule, bf16 where native. measure=False leaves "auto" where no kept decision exists yet."""
    if name != "auto":
        return name, "set in params"
    if torch.cuda.is_available():
        return ("bfloat16" if torch.cuda.is_bf16_supported() else "float32"), "GPU rule"
    if not native_bf16():
        return "float32", "no native bf16 on this CPU (emulated bf16 is ~50x slower)"
    if work is None:
        return "bfloat16", "native bf16 on this CPU"
    decision = cpu_decision(work) if measure else kept_decision(work)
    if decision is None:
        return "auto", "not measured on this machine yet (`eagle3 dtypes` measures it, ~1 min)"
    return decision["choice"], f"{explain(decision, decision['machine_class'])}; {decision['source']}"
