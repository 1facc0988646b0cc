"""`eagle3 report`: a draft-vocabulary sweep turned into an answer. Four plots against the
draft vocabulary size (coverage, acceptance length, draft step time, speedup), the best size
marked, and one paragraph saying where coverage stops paying for draft cost; written as
markdown with PNGs beside it and as one HTML file with the PNGs inside (no network needed).

Two optional inputs (`eagle3 report --plan-target T --paired FILE`):

- a plan target: what each row's draft vocabulary would cost on another target (`eagle3 plan` on
  the row's params with that target, the size capped at its vocabulary, the drafter shape derived
  from it), each cost also as a ratio against the 32,768 row (or the row nearest it);
- `python -m bench.drafters ... --json FILE`: paired intervals of each drafter's speedup against
  the first (the reference) and against each other. A row takes the drafter whose folder name is
  its experiment name, else the one drafter of its draft vocabulary size (the drafter's
  config.json); where a paired interval joins two sizes the verdict ties them by it (contains 0)
  instead of by overlap. Where the file holds every compared size, the verdict also ranks by its
  speedups: one side-by-side run, where each experiment's own speculative-eval ran at its own time
  under its own load.
"""

from __future__ import annotations

import base64
import functools
import html
import json
import math
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from eagle3.cli.experiments import Experiment
from eagle3.core.inputs import InputError

PLOTS = (
    ("coverage", "coverage", "Coverage of loss-masked tokens"),
    ("acceptance_length", "acceptance length", "Acceptance length (95% CI over prompts)"),
    ("draft_ms_per_step", "draft ms per step", "Draft step time"),
    ("speedup", "speedup vs plain greedy", "Speedup (95% CI over prompts)"),
)
Column = tuple[str, Callable[[Experiment], str]]
TABLE: tuple[Column, ...] = (
    ("experiment", lambda e: e.label),
    ("size", lambda e: str(e.draft_vocab_size)),
    ("coverage", lambda e: _fmt(e.number("coverage"), ".4f")),
    ("lm_head params", lambda e: _fmt(e.number("lm_head_params"), ",.0f")),
    # what the size costs, from `eagle3 plan` on the row's own params (docs/scale-out.md "Plan a run")
    ("trainable params (plan)", lambda e: _fmt(_planned(e, "trainable"), ",.0f")),
    ("draft GFLOP/step (plan)", lambda e: _fmt(_planned(e, "draft_gflop"), ".3f")),
    ("held-out top-1", lambda e: _fmt(e.number("heldout_acc_0"), ".4f")),
    ("acceptance length [95% CI]", lambda e: _ci(e, "acceptance_length")),
    ("accepted by draft position", lambda e: _by_position(e)),
    ("drafter's share", lambda e: _fmt(e.number("drafter_acceptance_length"), ".2f")),
    ("acceptance rate", lambda e: _fmt(e.number("acceptance_rate"), ".3f")),
    ("draft ms/step", lambda e: _fmt(e.number("draft_ms_per_step"), ".2f")),
    ("tok/s", lambda e: _fmt(e.number("tokens_per_s"), ".2f")),
    ("speedup [95% CI]", lambda e: _ci(e, "speedup")),
    ("prompt lookup speedup", lambda e: _fmt(e.number("prompt_lookup_speedup"), ".2f")),
    ("train tok/s", lambda e: _fmt(e.number("train_tokens_per_s"), ",.0f")),
)


def _fmt(value: float | None, fmt: str) -> str:
    return "-" if value is None else format(value, fmt)


def _by_position(e: Experiment) -> str:
    """The share of draft steps whose position 1, 2, ... token was accepted: "0.43 / 0.25"."""
    shares, k = [], 1
    while (share := e.number(f"per_position_acceptance.{k}")) is not None:
        shares.append(f"{share:.2f}")
        k += 1
    return " / ".join(shares) or "-"


REFERENCE_SIZE = 32768  # the draft vocabulary the plan-target ratios are taken against (Kimi-K2.5's 32K)
# `eagle3 plan` keys on another target: these describe the drafter of the row's own target
OWN_DRAFTER_KEYS = ("train.init", "extract.aux_layers") + tuple(
    f"train.{k}" for k in ("intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim")
)


@functools.cache
def _target_config(source: str) -> dict:
    from eagle3.cli.plan import read_target_config  # the plan reads configs only when asked

    return read_target_config(source)


@functools.cache
def _plan_of(flat_params: str) -> dict | None:
    """`eagle3 plan` for one row's params (JSON of the flat params), None when they no longer
    validate or the target's config cannot be read here."""
    from eagle3.cli.plan import plan
    from eagle3.core.params import ParamsError, parse_params

    nested: dict = {}
    for key, value in json.loads(flat_params).items():
        section, _, name = key.partition(".")
        nested.setdefault(section, {})[name] = value
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


def _planned(e: Experiment, key: str) -> float | None:
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
        from eagle3.vocab import draft_size  # noqa: PLC0415 - torch, only when a plan target is given

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

    def get(key: str, fmt: str) -> Callable[[Experiment], str]:
        return lambda e: _fmt(None if (c := target.cost(e)) is None else c[key], fmt)

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


def _ci(e: Experiment, key: str) -> str:
    value, lo, hi = e.number(key), e.number(f"{key}_ci.lo"), e.number(f"{key}_ci.hi")
    if value is None or lo is None or hi is None:
        return _fmt(value, ".2f")
    return f"{value:.2f} [{lo:.2f}, {hi:.2f}]"


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


def _own_speed(e: Experiment) -> Speed:
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


@dataclass(frozen=True)
class Verdict:
    best: Experiment | None  # the fastest size on the reference machine; None without speed figures
    compared: list[Experiment]  # the rows the verdict compares: one machine, one set of dtypes
    paragraph: str
    decision: str = ""  # the paragraph's first sentence: the decision on its own
    rule: str = ""  # what decided which sizes tie with the fastest
    # the speedups the verdict ranked by, per experiment: its own speculative-eval's, or the paired
    # bench's one run where that run holds every compared row
    speeds: dict[str, Speed] = field(default_factory=dict)
    one_run: bool = False  # the speeds are the paired bench's


def sweep_rows(experiments: list[Experiment]) -> list[Experiment]:
    """Rows with a draft size, smallest first (a size above the target's vocabulary counts as full)."""
    rows = [e for e in experiments if e.draft_vocab_size is not None]
    return sorted(rows, key=lambda e: (e.draft_vocab_size, e.name))


def verdict(experiments: list[Experiment], paired: Paired | None = None) -> Verdict:
    """Pick the size with the highest speedup and say why, from rows measured alike only. Sizes
    that cannot be told from the fastest tie with it, and the smallest of a tie is the pick: two
    sizes tie when their speedup intervals overlap, or, where `paired` joins them, when the paired
    interval of their difference contains 0. Where `paired` decoded as the rows' evals did and
    holds every row, its one run's speedups rank the rows; a file that decoded otherwise (another
    target, tree or lookup branch) is used for neither, and the paragraph says why."""
    rows = [e for e in sweep_rows(experiments) if e.number("speedup") is not None and e.machine]
    if not rows:
        none = "No experiment has a speculative-eval result yet, so no size can be chosen."
        return Verdict(None, [], none, none)
    reference = Counter(e.measured_on for e in rows).most_common(1)[0][0]
    rows = [e for e in rows if e.measured_on == reference]
    # matched over every row, as the table's paired columns match them
    differs = paired.differences(rows) if paired else []
    matched = paired.match(sweep_rows(experiments)) if paired and not differs else {}
    # speeds from one side-by-side run beat speeds from runs at different times (load drifts)
    one_run = paired.speeds(matched, rows) if matched else None
    speeds = one_run or {e.name: _own_speed(e) for e in rows}
    fastest = max(rows, key=lambda e: speeds[e.name].value)
    unused = ""
    if differs:
        unused = (
            f"{paired.path} is not used: its bench decoded otherwise than these rows' evals "
            f"({'; '.join(differs)})."
        )
    elif paired and one_run is None:
        unused = (
            f"{paired.path} does not hold a drafter with a speedup for every compared row, so each "
            "experiment's own speculative-eval ranks them."
        )

    def pair(a: Experiment, b: Experiment) -> tuple[float, float] | None:
        return paired.between(matched, a, b) if matched else None

    def tied_with(a: Experiment, b: Experiment) -> bool:
        ci = pair(a, b)
        return speeds[a.name].overlaps(speeds[b.name]) if ci is None else ci[0] <= 0 <= ci[1]

    def speed(e: Experiment) -> str:
        return str(speeds[e.name])

    # sizes this many prompts cannot tell from the fastest: the smallest of them is the pick
    # (the same speed within noise, the cheapest head to train, store and serve)
    tied = [e for e in rows if e is not fastest and tied_with(e, fastest)]
    best = min([fastest, *tied], key=lambda e: (e.draft_vocab_size, e.name))
    first, last = rows[0], rows[-1]
    k = best.draft_vocab_size
    by_pair = [e.name for e in rows if e is not fastest and pair(e, fastest) is not None]
    if by_pair:
        rule = (
            f"a size ties where the paired 95% interval of the speedup difference against "
            f"{matched[fastest.name]['name'] if fastest.name in matched else paired.reference} "
            f"contains 0, so judged for {', '.join(by_pair)} "
            f"(bench.drafters on {paired.machine}, {paired.path})"
            + (", by overlapping 95% speedup intervals for the rest" if len(by_pair) < len(rows) - 1 else "")
        )
    else:
        rule = "ties by overlapping 95% speedup intervals" + (
            f" (no paired interval in {paired.path} joins the fastest size with another)" if matched else ""
        )

    def facts(e: Experiment) -> str:
        return (
            f"coverage {_fmt(e.number('coverage'), '.2%')}, "
            f"acceptance length {_fmt(e.number('acceptance_length'), '.2f')}, "
            f"draft step {_fmt(e.number('draft_ms_per_step'), '.2f')} ms"
        )

    if best is fastest:
        decision = (
            f"Decision: a draft vocabulary of {k:,} tokens ({best.name}): the highest speedup, "
            f"{speed(best)}x, and no smaller size ties with it; {rule}."
        )
    else:
        decision = (
            f"Decision: a draft vocabulary of {k:,} tokens ({best.name}, {speed(best)}x): the "
            f"smallest size tied with the fastest, {fastest.draft_vocab_size:,} ({fastest.name}, "
            f"{speed(fastest)}x); {rule}."
        )
    all_tied = best is not fastest and len(tied) + 1 == len(rows)
    if best is fastest:
        text = [f"Speedup peaks at a draft vocabulary of {k:,} tokens ({speed(best)}x, {best.name})."]
    else:
        how = (
            "has an interval that overlaps those of"
            if not any(pair(e, fastest) for e in tied)
            else "cannot be told apart from those of"
        )
        text = [
            f"No size is measurably faster than the others: the highest speedup, "
            f"{speed(fastest)}x at {fastest.draft_vocab_size:,} ({fastest.name}), {how} "
            f"{', '.join(e.name for e in tied)}, so the pick is the smallest of "
            f"them, {k:,} tokens ({speed(best)}x, {best.name}): the same speed within noise with "
            f"the cheapest head ({_fmt(best.number('lm_head_params'), ',.0f')} lm_head parameters)."
        ]
    if all_tied:
        accepted = [e.number("acceptance_length") or 0 for e in rows]
        text.append(
            f"Across all {len(rows)} sizes acceptance length stayed within {min(accepted):.2f}-"
            f"{max(accepted):.2f} while the draft step went from "
            f"{_fmt(first.number('draft_ms_per_step'), '.2f')} to "
            f"{_fmt(last.number('draft_ms_per_step'), '.2f')} ms: past {first.draft_vocab_size:,} "
            "coverage bought no measurable acceptance here."
        )
    elif len({e.draft_vocab_size for e in rows}) == 1:
        text.append("Only one size was measured, so nothing is compared; sweep vocab.size to decide.")
    elif best is last:
        text.append(
            f"It is the largest size tried: from {first.draft_vocab_size:,} ({facts(first)}) to {k:,} "
            f"({facts(best)}) coverage kept paying for its draft cost; try larger sizes."
        )
    elif best is first:
        text.append(
            f"It is the smallest size tried: larger vocabularies raised coverage up to "
            f"{_fmt(last.number('coverage'), '.2%')} ({last.draft_vocab_size:,}), but the acceptance they "
            f"bought never paid for the slower draft step ({facts(last)})."
        )
    else:
        text.append(
            f"Up to {k:,}, coverage pays: from {first.draft_vocab_size:,} ({facts(first)}) to {k:,} "
            f"({facts(best)}). Beyond it coverage stops paying for draft cost: at {last.draft_vocab_size:,} "
            f"({facts(last)}) speedup is {speed(last)}x."
        )
    # the sentence above named the rows tied with the fastest; these are the rest tied with the pick
    ties = [] if all_tied else [e for e in rows if e is not best and e is not fastest and tied_with(e, best)]
    overlapping = [e.name for e in ties if pair(e, best) is None]
    if overlapping:
        text.append(
            f"The speedup intervals of {', '.join(overlapping)} overlap the best one's: this many prompts "
            "cannot tell them apart (raise eval.num_prompts)."
        )
    if len(overlapping) < len(ties):
        text.append(
            f"The paired interval of {', '.join(e.name for e in ties if pair(e, best))} against the best "
            "contains 0: the bench's prompts cannot tell them apart."
        )
    others = len(sweep_rows(experiments)) - len(rows)
    machine, dtypes = reference
    if unused:
        text.append(unused)
    if one_run:
        text.append(
            f"Speedups are from one side-by-side bench.drafters run on {paired.machine} ({paired.path}); "
            "acceptance, coverage and draft step from each experiment's speculative-eval"
        )
    text.append(
        f"{'on' if one_run else 'Speeds were measured on'} {machine} "
        f"({', '.join(f'{k} {v}' for k, v in dtypes) or 'dtypes unknown'})"
        + (f"; {others} row(s) measured elsewhere or without speeds are left out." if others else ".")
    )
    return Verdict(best, rows, " ".join([decision, *text]), decision, rule, speeds, one_run is not None)


def write_plots(
    experiments: list[Experiment], verdict_: Verdict, out: Path, lookup_in_run: float | None = None
) -> list[Path]:
    """One PNG per metric against size; the best size is marked in each. Speedup is plotted as the
    verdict ranked it (the paired bench's one run, where it held every size, with prompt lookup's
    speedup from that run as `lookup_in_run`)."""
    import matplotlib  # slow import

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    rows = verdict_.compared or sweep_rows(experiments)
    paths = []
    for key, label, title in PLOTS:
        one_run = key == "speedup" and verdict_.one_run

        def value(e: Experiment, end: str = "", key: str = key, one_run: bool = one_run) -> float | None:
            if one_run:
                return getattr(verdict_.speeds[e.name], end or "value")
            return e.number(f"{key}_ci.{end}" if end else key)

        points = [(e.draft_vocab_size, e) for e in rows if value(e) is not None]
        fig, ax = plt.subplots(figsize=(6, 3.6), dpi=100)
        if points:
            xs = [x for x, _ in points]
            ys = [value(e) for _, e in points]
            grafted = any(e.params.get("eval.lookup_tokens") for _, e in points)
            series = "drafter + lookup branch" if grafted and key != "coverage" else "drafter"
            if one_run:
                series += ", one bench.drafters run"
            lo = [value(e, "lo") for _, e in points]
            hi = [value(e, "hi") for _, e in points]
            if all(v is not None for v in lo + hi):
                below = [y - low for y, low in zip(ys, lo, strict=True)]
                err = [below, [h - y for y, h in zip(ys, hi, strict=True)]]
                ax.errorbar(xs, ys, yerr=err, fmt="o-", capsize=3, label=series)
            else:
                ax.plot(xs, ys, "o-", label=series)
            ax.set_xscale("log", base=2)
            ax.set_xticks(sorted(set(xs)), [f"{x:,}" for x in sorted(set(xs))], rotation=30)
            if key == "acceptance_length":  # with a lookup branch: the drafter's own part, as servers run it
                pairs = [(x, e.number("drafter_acceptance_length"), e.number(key)) for x, e in points]
                own = [(x, y) for x, y, _ in pairs if y is not None]
                if any(y is not None and y != total for _, y, total in pairs):
                    ax.plot(*zip(*own, strict=True), "^--", color="tab:green", label="drafter's tree alone")
                    ax.legend(loc="best")
            if key == "speedup":  # break-even, and the peer a drafter has to beat
                ax.axhline(1.0, color="grey", linestyle=":", label="plain greedy")
                peer = [(x, e.number("prompt_lookup_speedup")) for x, e in points]
                peer = [(x, y) for x, y in peer if y is not None]
                if one_run:
                    peer = [(x, lookup_in_run) for x, _ in points] if lookup_in_run is not None else []
                if peer:
                    ax.plot(*zip(*peer, strict=True), "s--", color="grey", label="prompt lookup")
                ax.legend(loc="best")
            best = verdict_.best
            if best is not None and value(best) is not None:
                ax.plot([best.draft_vocab_size], [value(best)], "r*", markersize=14, label="best size")
                ax.legend(loc="best")
        ax.set_xlabel("draft vocabulary size")
        ax.set_ylabel(label)
        ax.set_title(title)
        ax.grid(True, alpha=0.3)
        fig.tight_layout()
        path = out / f"{key}.png"
        fig.savefig(path)
        plt.close(fig)
        paths.append(path)
    return paths


def _machines(experiments: list[Experiment]) -> list[tuple[str, list[str]]]:
    by_machine: dict[str, list[str]] = {}
    for e in experiments:
        by_machine.setdefault(e.machine or "not measured", []).append(e.name)
    return list(by_machine.items())


def _markdown(
    experiments: list[Experiment],
    verdict_: Verdict,
    plots: list[Path],
    columns: list[Column],
    notes: list[str],
) -> str:
    header = [label for label, _ in columns]
    lines = ["# Draft vocabulary sweep", "", verdict_.paragraph, ""]
    lines += ["| " + " | ".join(header) + " |", "|" + " --- |" * len(header)]
    lines += ["| " + " | ".join(get(e) for _, get in columns) + " |" for e in sweep_rows(experiments)]
    lines += [
        "",
        "Costs per size are `eagle3 plan -S vocab.size=K` on each row's params (drafter parameters and "
        'one draft step\'s FLOPs; storage, memory and steps: docs/scale-out.md "Plan a run").',
    ]
    for note in notes:
        lines += ["", note]
    lines += ["", "Measured on:", ""] + [f"- {m}: {', '.join(names)}" for m, names in _machines(experiments)]
    lines.append("")
    for path, (_, _, title) in zip(plots, PLOTS, strict=True):
        lines += [f"![{title}]({path.name})", ""]
    return "\n".join(lines)


def _html(
    experiments: list[Experiment],
    verdict_: Verdict,
    plots: list[Path],
    columns: list[Column],
    notes: list[str],
) -> str:
    head = "".join(f"<th>{html.escape(label)}</th>" for label, _ in columns)
    body = "".join(
        "<tr>" + "".join(f"<td>{html.escape(get(e))}</td>" for _, get in columns) + "</tr>"
        for e in sweep_rows(experiments)
    )
    images = "".join(
        f'<img alt="{html.escape(title)}" src="data:image/png;base64,'
        f'{base64.b64encode(path.read_bytes()).decode()}">'
        for path, (_, _, title) in zip(plots, PLOTS, strict=True)
    )
    machines = "".join(
        f"<li>{html.escape(m)}: {html.escape(', '.join(names))}</li>" for m, names in _machines(experiments)
    )
    remarks = "".join(f"<p>{html.escape(note)}</p>" for note in notes)
    style = "body{font-family:sans-serif;max-width:72em;margin:2em auto}td,th{padding:2px 8px}"
    return (
        f"<!doctype html><html><head><meta charset='utf-8'><title>Draft vocabulary sweep</title>"
        f"<style>{style}</style></head><body><h1>Draft vocabulary sweep</h1>"
        f"<p>{html.escape(verdict_.paragraph)}</p><table><tr>{head}</tr>{body}</table>{remarks}"
        f"<p>Measured on:</p><ul>{machines}</ul>{images}</body></html>\n"
    )


def write_report(
    experiments: list[Experiment],
    out: str | Path,
    plan_target: PlanTarget | None = None,
    paired: Paired | None = None,
) -> tuple[Verdict, list[Path]]:
    """report.md (+ PNGs) and report.html (PNGs embedded) under `out`; with `plan_target`, each
    size's planned cost on that target too, with `paired` the bench's paired speedups and ties."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    verdict_ = verdict(experiments, paired)
    plots = write_plots(experiments, verdict_, out, paired.prompt_lookup if paired else None)
    columns, notes = list(TABLE), []
    if plan_target is not None:
        extra, note = plan_columns(experiments, plan_target)
        columns += extra
        notes.append(note)
    if paired is not None:
        columns += [paired.speed_column(experiments), paired.column(experiments)]
        notes.append(paired.note(experiments))
    md, page = out / "report.md", out / "report.html"
    md.write_text(_markdown(experiments, verdict_, plots, columns, notes))
    page.write_text(_html(experiments, verdict_, plots, columns, notes))
    return verdict_, [md, page, *plots]
