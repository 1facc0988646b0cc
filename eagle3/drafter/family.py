"""The drafter family's params as the vocab mapping records them, for train to check.

Train's drafter depends on `vocab.size` under eagle3 and on the `dflash` section under dflash,
never on the other family's keys. DVC's params cannot depend on another param, so train lists
none of them: vocab-map, which lists them all and costs seconds, writes this record into
vocab.json (train's dep), and train refuses a mapping whose record is not its params'. A key of
the other family then re-runs vocab-map alone, to the same bytes, and DVC skips train.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from eagle3.core.params import Params


def family_record(params: Params) -> dict:
    """The family's keys train's drafter depends on, as vocab.json records them."""
    if params.drafter.kind == "dflash":
        return {"drafter_kind": "dflash", "dflash": params.dflash.model_dump(mode="json")}
    return {"vocab_size_param": params.vocab.size}


def record_mismatch(recorded: dict, wanted: dict) -> str | None:
    """`key then, params have now` for the first key of `wanted` the mapping recorded otherwise,
    or None. Keys are named as in params.yaml."""
    names = {"drafter_kind": "drafter.kind", "vocab_size_param": "vocab.size", "dflash": "dflash"}
    for key, want in wanted.items():
        have = recorded.get(key)
        if have == want:
            continue
        if isinstance(want, dict) and isinstance(have, dict):
            sub = next((k for k in want if have.get(k) != want[k]), None)
            if sub is not None:
                return f"{names[key]}.{sub} {have.get(sub)!r}, params have {want[sub]!r}"
        return f"{names[key]} {have}, params have {want}"
    return None
