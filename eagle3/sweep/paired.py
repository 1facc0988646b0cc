"""bench.drafters' paired speedups (`eagle3 report --paired FILE`) and a row's speedup with its
interval: what the verdict ties sizes by."""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from eagle3.core.inputs import InputError
from eagle3.sweep.experiments import Experiment

Column = tuple[str, Callable[[Experiment], str]]


def _signed(value: float | None, ci: tuple[float, float] | None) -> str:
    if value is None:
        return "-"
    return f"{value:+.2f}" + (f" [{ci[0]:+.2f}, {ci[1]:+.2f}]" if ci else "")


def _interval(entry: dict, key: str) -> tuple[float, float] | None:
    """The entry's `{key}_ci` interval ({"lo", "hi"}), or its `ci` with an empty key."""
    ci = entry.get(f"{key}_ci" if key else "ci")
    if not isinstance(ci, dict) or not all(isinstance(ci.get(end), (int, float)) for end in ("lo", "hi")):
        return None
    return float(ci["lo"]), float(ci["hi"])


# bench.drafters' target and settings -> the params of a row that decoded the same way
BENCH_SETTINGS = {
    "target": "target.source",
    "mode": "eval.mode",
    "k": "eval.k",
    "topk": "eval.topk",
    "tree_budget": "eval.tree_budget",
    "lookup_tokens": "eval.lookup_tokens",
    "tokens": "eval.max_new_tokens",
}


@dataclass(frozen=True)
class Speed:
    """A row's speedup over plain decoding with its 95% interval (lo/hi None where unknown)."""

    value: float
    lo: float | None = None
    hi: float | None = None

    def __str__(self) -> str:
        if self.lo is None or self.hi is None:
            return f"{self.value:.2f}"
        return f"{self.value:.2f} [{self.lo:.2f}, {self.hi:.2f}]"

    def overlaps(self, other: Speed) -> bool:
        ends = (self.lo, self.hi, other.lo, other.hi)
        return None not in ends and self.lo <= other.hi and other.lo <= self.hi


def own_speed(e: Experiment) -> Speed:
    """The row's speedup from its own speculative-eval."""
    return Speed(e.number("speedup"), e.number("speedup_ci.lo"), e.number("speedup_ci.hi"))


@dataclass(frozen=True)
class Paired:
    """`python -m bench.drafters REF B ... --json FILE`: each drafter's speedup (and acceptance
    length) paired against the first drafter's, over the same resampled prompts."""

    path: str
    machine: str
    reference: str  # the reference drafter's folder name
    drafters: tuple[dict, ...]  # the file's entries, the reference first
    prompt_lookup: float | None = None  # transformers' prompt lookup's speedup in the same run
    target: str | None = None  # the bench's --target
    settings: dict = field(default_factory=dict)  # the bench's decoding settings (mode, k, ...)

    @classmethod
    def read(cls, path: str | Path) -> Paired:
        try:
            data = json.loads(Path(path).read_text())
        except FileNotFoundError:
            raise InputError(f"--paired {path} does not exist") from None
        except (OSError, ValueError) as err:
            raise InputError(f"--paired {path}: cannot read it as JSON ({err})") from None
        drafters = data.get("drafters") if isinstance(data, dict) else None
        if (
            not isinstance(drafters, list)
            or len(drafters) < 2
            or not all(isinstance(d, dict) and d.get("name") for d in drafters)
            or not drafters[0].get("reference")
        ):
            raise InputError(
                f"--paired {path}: not the output of `python -m bench.drafters ... --json FILE` "
                "(a list of two or more drafters, the reference first)"
            )
        lookup = (data.get("prompt_lookup") or {}).get("speedup")
        return cls(
            str(path),
            str(data.get("machine") or "an unnamed machine"),
            drafters[0]["name"],
            tuple(drafters),
            float(lookup) if isinstance(lookup, (int, float)) else None,
            data.get("target") if isinstance(data.get("target"), str) else None,
            data.get("settings") if isinstance(data.get("settings"), dict) else {},
        )

    def differences(self, rows: list[Experiment]) -> list[str]:
        """How the bench decoded unlike the rows' speculative-eval ("k 1 (rows: 2)"), from what
        the file and the rows' params both name; empty where nothing differs or nothing is named."""
        out, bench = [], self.settings | {"target": self.target}
        for key, param in BENCH_SETTINGS.items():
            mine = bench.get(key)
            theirs = {e.params[param] for e in rows if e.params.get(param) is not None}
            if mine is not None and theirs and theirs != {mine}:
                out.append(f"{key} {mine} (rows: {', '.join(sorted(map(str, theirs)))})")
        return out

    def match(self, experiments: list[Experiment]) -> dict[str, dict]:
        """Experiment name -> its drafter's entry: the drafter whose folder name is the experiment's
        name, else the one drafter of the row's draft vocabulary size (read from the drafter's
        config.json by the bench); none where two drafters of the file share that size."""
        by_name = {d["name"]: d for d in self.drafters}
        named = {e.name for e in experiments} & set(by_name)
        sizes = Counter(d.get("draft_vocab_size") for d in self.drafters)
        by_size = {
            d["draft_vocab_size"]: d
            for d in self.drafters
            if d["name"] not in named and d.get("draft_vocab_size") and sizes[d["draft_vocab_size"]] == 1
        }
        out = {}
        for e in experiments:
            drafter = by_name.get(e.name) or by_size.get(e.draft_vocab_size)
            if drafter is not None:
                out[e.name] = drafter
        return out

    def between(self, matched: dict[str, dict], a: Experiment, b: Experiment) -> tuple[float, float] | None:
        """The paired 95% interval of one row's speedup minus the other's: from the file's
        difference between any two drafters where it has one, else where one of the two is the
        reference's row and the other a drafter paired against it; else None."""
        da, db = matched.get(a.name), matched.get(b.name)
        if da is None or db is None or da is db:
            return None
        other = (da.get("speedup_minus_drafter") or {}).get(db.get("label"))
        if isinstance(other, dict) and (ci := _interval(other, "")) is not None:
            return ci
        if bool(da.get("reference")) == bool(db.get("reference")):
            return None
        ci = _interval(db if da.get("reference") else da, "speedup_minus_reference")
        return ci if ci is None or not da.get("reference") else (-ci[1], -ci[0])

    def speeds(self, matched: dict[str, dict], rows: list[Experiment]) -> dict[str, Speed] | None:
        """Each row's speedup in the bench's one run, where the file holds a distinct drafter with
        a speedup and its interval for every row (a whole sweep measured side by side); else None."""
        entries = [matched.get(e.name) for e in rows]
        if any(d is None for d in entries) or len({id(d) for d in entries}) < len(rows):
            return None
        out = {}
        for e, d in zip(rows, entries, strict=True):
            value, ci = d.get("speedup"), _interval(d, "speedup")
            if not isinstance(value, (int, float)) or ci is None:
                return None
            out[e.name] = Speed(float(value), *ci)
        return out

    def speed_column(self, experiments: list[Experiment]) -> Column:
        matched = self.match(experiments)

        def get(e: Experiment) -> str:
            d = matched.get(e.name) or {}
            if not isinstance(d.get("speedup"), (int, float)):
                return "-"
            return str(Speed(d["speedup"], *(_interval(d, "speedup") or ())))

        return "speedup, bench.drafters' one run [95% CI]", get

    def column(self, experiments: list[Experiment]) -> Column:
        matched = self.match(experiments)

        def get(e: Experiment) -> str:
            d = matched.get(e.name)
            if d is None:
                return "-"
            if d.get("reference"):
                return "reference"
            value = d.get("speedup_minus_reference")
            return _signed(
                value if isinstance(value, (int, float)) else None, _interval(d, "speedup_minus_reference")
            )

        return f"paired speedup vs {self.reference} [95% CI]", get

    def note(self, experiments: list[Experiment]) -> str:
        matched = self.match(experiments)
        pairs = ", ".join(f"{name} = {d['name']}" for name, d in matched.items()) or "none"
        return (
            f"Paired speedups: `{self.path}` (`python -m bench.drafters --json`, on {self.machine}), each "
            f"drafter's speedup minus {self.reference}'s over the same resampled prompts. Rows take the "
            "drafter named like the experiment, else the one drafter of their draft vocabulary size: "
            f"{pairs}."
        )
