"""The sweep's decision: which draft vocabulary size to use, and one paragraph saying why.

Only rows measured alike are compared (the machine and dtypes most rows share). Sizes that cannot
be told from the fastest tie with it, and the smallest of a tie is the pick: two sizes tie when
their speedup intervals overlap, or, where a paired bench file joins them, when the paired
interval of their difference contains 0. Where that file decoded as the rows' evals did and holds
every row, its one run's speedups rank the rows; a file that decoded otherwise (another target,
tree or lookup branch) is used for neither, and the paragraph says why.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from eagle3.sweep.experiments import Experiment
from eagle3.sweep.paired import Paired, Speed, own_speed


def fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


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


@dataclass(frozen=True)
class Ranking:
    """The rows one verdict compares, the speeds it ranks them by and how it ties two of them."""

    rows: list[Experiment]  # measured alike, smallest size first
    reference: tuple  # (machine, dtypes) the rows share
    speeds: dict[str, Speed]
    paired: Paired | None
    matched: dict[str, dict]  # experiment name -> its drafter in `paired` (empty: not used)
    one_run: bool  # the speeds are the paired bench's one run
    unused: str  # why `paired` is not used, or ""

    @property
    def fastest(self) -> Experiment:
        return max(self.rows, key=lambda e: self.speeds[e.name].value)

    def pair(self, a: Experiment, b: Experiment) -> tuple[float, float] | None:
        return self.paired.between(self.matched, a, b) if self.matched else None

    def tied_with(self, a: Experiment, b: Experiment) -> bool:
        ci = self.pair(a, b)
        return self.speeds[a.name].overlaps(self.speeds[b.name]) if ci is None else ci[0] <= 0 <= ci[1]

    def speed(self, e: Experiment) -> str:
        return str(self.speeds[e.name])


def rank(experiments: list[Experiment], paired: Paired | None) -> Ranking | None:
    """The rows with a speedup on the machine and dtypes most of them share, and what ranks them
    (`paired`'s one run where it decoded alike and holds every row); None without any speedup."""
    rows = [e for e in sweep_rows(experiments) if e.number("speedup") is not None and e.machine]
    if not rows:
        return None
    reference = Counter(e.measured_on for e in rows).most_common(1)[0][0]
    rows = [e for e in rows if e.measured_on == reference]
    # matched over every row, as the table's paired columns match them
    differs = paired.differences(rows) if paired else []
    matched = paired.match(sweep_rows(experiments)) if paired and not differs else {}
    # speeds from one side-by-side run beat speeds from runs at different times (load drifts)
    one_run = paired.speeds(matched, rows) if matched else None
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
    speeds = one_run or {e.name: own_speed(e) for e in rows}
    return Ranking(rows, reference, speeds, paired, matched, one_run is not None, unused)


def tie_rule(r: Ranking) -> str:
    """What decided which sizes tie with the fastest: paired intervals, overlapping ones, or both."""
    fastest, paired = r.fastest, r.paired
    by_pair = [e.name for e in r.rows if e is not fastest and r.pair(e, fastest) is not None]
    if not by_pair:
        return "ties by overlapping 95% speedup intervals" + (
            f" (no paired interval in {paired.path} joins the fastest size with another)" if r.matched else ""
        )
    return (
        f"a size ties where the paired 95% interval of the speedup difference against "
        f"{r.matched[fastest.name]['name'] if fastest.name in r.matched else paired.reference} "
        f"contains 0, so judged for {', '.join(by_pair)} "
        f"(bench.drafters on {paired.machine}, {paired.path})"
        + (", by overlapping 95% speedup intervals for the rest" if len(by_pair) < len(r.rows) - 1 else "")
    )


def _facts(e: Experiment) -> str:
    return (
        f"coverage {fmt(e.number('coverage'), '.2%')}, "
        f"acceptance length {fmt(e.number('acceptance_length'), '.2f')}, "
        f"draft step {fmt(e.number('draft_ms_per_step'), '.2f')} ms"
    )


def _decision(r: Ranking, best: Experiment, rule: str) -> str:
    fastest, k = r.fastest, best.draft_vocab_size
    if best is fastest:
        return (
            f"Decision: a draft vocabulary of {k:,} tokens ({best.name}): the highest speedup, "
            f"{r.speed(best)}x, and no smaller size ties with it; {rule}."
        )
    return (
        f"Decision: a draft vocabulary of {k:,} tokens ({best.name}, {r.speed(best)}x): the "
        f"smallest size tied with the fastest, {fastest.draft_vocab_size:,} ({fastest.name}, "
        f"{r.speed(fastest)}x); {rule}."
    )


def _headline(r: Ranking, best: Experiment, tied: list[Experiment]) -> str:
    fastest, k = r.fastest, best.draft_vocab_size
    if best is fastest:
        return f"Speedup peaks at a draft vocabulary of {k:,} tokens ({r.speed(best)}x, {best.name})."
    how = (
        "has an interval that overlaps those of"
        if not any(r.pair(e, fastest) for e in tied)
        else "cannot be told apart from those of"
    )
    return (
        f"No size is measurably faster than the others: the highest speedup, "
        f"{r.speed(fastest)}x at {fastest.draft_vocab_size:,} ({fastest.name}), {how} "
        f"{', '.join(e.name for e in tied)}, so the pick is the smallest of "
        f"them, {k:,} tokens ({r.speed(best)}x, {best.name}): the same speed within noise with "
        f"the cheapest head ({fmt(best.number('lm_head_params'), ',.0f')} lm_head parameters)."
    )


def _where_coverage_pays(r: Ranking, best: Experiment, all_tied: bool) -> str:
    """Where the pick sits among the sizes tried, and what coverage bought on either side of it."""
    rows, k = r.rows, best.draft_vocab_size
    first, last = rows[0], rows[-1]
    if all_tied:
        accepted = [e.number("acceptance_length") or 0 for e in rows]
        return (
            f"Across all {len(rows)} sizes acceptance length stayed within {min(accepted):.2f}-"
            f"{max(accepted):.2f} while the draft step went from "
            f"{fmt(first.number('draft_ms_per_step'), '.2f')} to "
            f"{fmt(last.number('draft_ms_per_step'), '.2f')} ms: past {first.draft_vocab_size:,} "
            "coverage bought no measurable acceptance here."
        )
    if len({e.draft_vocab_size for e in rows}) == 1:
        return "Only one size was measured, so nothing is compared; sweep vocab.size to decide."
    if best is last:
        return (
            f"It is the largest size tried: from {first.draft_vocab_size:,} ({_facts(first)}) to {k:,} "
            f"({_facts(best)}) coverage kept paying for its draft cost; try larger sizes."
        )
    if best is first:
        return (
            f"It is the smallest size tried: larger vocabularies raised coverage up to "
            f"{fmt(last.number('coverage'), '.2%')} ({last.draft_vocab_size:,}), but the acceptance they "
            f"bought never paid for the slower draft step ({_facts(last)})."
        )
    return (
        f"Up to {k:,}, coverage pays: from {first.draft_vocab_size:,} ({_facts(first)}) to {k:,} "
        f"({_facts(best)}). Beyond it coverage stops paying for draft cost: at {last.draft_vocab_size:,} "
        f"({_facts(last)}) speedup is {r.speed(last)}x."
    )


def _ties_with_the_pick(r: Ranking, best: Experiment, all_tied: bool) -> list[str]:
    """The rows tied with the pick beyond those tied with the fastest, and why they tie."""
    fastest = r.fastest
    others = [] if all_tied else [e for e in r.rows if e is not best and e is not fastest]
    ties = [e for e in others if r.tied_with(e, best)]
    overlapping = [e.name for e in ties if r.pair(e, best) is None]
    text = []
    if overlapping:
        text.append(
            f"The speedup intervals of {', '.join(overlapping)} overlap the best one's: this many prompts "
            "cannot tell them apart (raise eval.num_prompts)."
        )
    if len(overlapping) < len(ties):
        text.append(
            f"The paired interval of {', '.join(e.name for e in ties if r.pair(e, best))} against the best "
            "contains 0: the bench's prompts cannot tell them apart."
        )
    return text


def _provenance(r: Ranking, left_out: int) -> list[str]:
    """Where the speeds come from, and the rows the verdict did not compare."""
    machine, dtypes = r.reference
    text = [r.unused] if r.unused else []
    if r.one_run:
        text.append(
            f"Speedups are from one side-by-side bench.drafters run on {r.paired.machine} ({r.paired.path}); "
            "acceptance, coverage and draft step from each experiment's speculative-eval"
        )
    text.append(
        f"{'on' if r.one_run else 'Speeds were measured on'} {machine} "
        f"({', '.join(f'{k} {v}' for k, v in dtypes) or 'dtypes unknown'})"
        + (f"; {left_out} row(s) measured elsewhere or without speeds are left out." if left_out else ".")
    )
    return text


def verdict(experiments: list[Experiment], paired: Paired | None = None) -> Verdict:
    """Pick the size with the highest speedup and say why, from rows measured alike only (the
    module doc says how sizes tie and when `paired` ranks them)."""
    r = rank(experiments, paired)
    if r is None:
        none = "No experiment has a speculative-eval result yet, so no size can be chosen."
        return Verdict(None, [], none, none)
    fastest = r.fastest
    # sizes this many prompts cannot tell from the fastest: the smallest of them is the pick
    # (the same speed within noise, the cheapest head to train, store and serve)
    tied = [e for e in r.rows if e is not fastest and r.tied_with(e, fastest)]
    best = min([fastest, *tied], key=lambda e: (e.draft_vocab_size, e.name))
    all_tied = best is not fastest and len(tied) + 1 == len(r.rows)
    rule = tie_rule(r)
    decision = _decision(r, best, rule)
    text = [
        decision,
        _headline(r, best, tied),
        _where_coverage_pays(r, best, all_tied),
        *_ties_with_the_pick(r, best, all_tied),
        *_provenance(r, len(sweep_rows(experiments)) - len(r.rows)),
    ]
    return Verdict(best, r.rows, " ".join(text), decision, rule, r.speeds, r.one_run)
