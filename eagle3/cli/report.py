"""`eagle3 report`: a draft-vocabulary sweep turned into an answer. Four plots against the
draft vocabulary size (coverage, acceptance length, draft step time, speedup), the best size
marked, and one paragraph saying where coverage stops paying for draft cost; written as
markdown with PNGs beside it and as one HTML file with the PNGs inside (no network needed).
"""

from __future__ import annotations

import base64
import functools
import html
import json
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from eagle3.cli.experiments import Experiment

PLOTS = (
    ("coverage", "coverage", "Coverage of loss-masked tokens"),
    ("acceptance_length", "acceptance length", "Acceptance length (95% CI over prompts)"),
    ("draft_ms_per_step", "draft ms per step", "Draft step time"),
    ("speedup", "speedup vs plain greedy", "Speedup (95% CI over prompts)"),
)
TABLE = (
    ("experiment", lambda e: e.label),
    ("size", lambda e: str(e.draft_vocab_size)),
    ("coverage", lambda e: _fmt(e.number("coverage"), ".4f")),
    ("lm_head params", lambda e: _fmt(e.number("lm_head_params"), ",.0f")),
    # what the size costs, from `eagle3 plan` on the row's own params (docs/scale-out.md "Plan a run")
    ("trainable params (plan)", lambda e: _fmt(_planned(e, "trainable"), ",.0f")),
    ("draft GFLOP/step (plan)", lambda e: _fmt(_planned(e, "draft_gflop"), ".3f")),
    ("acceptance length [95% CI]", lambda e: _ci(e, "acceptance_length")),
    ("drafter's share", lambda e: _fmt(e.number("drafter_acceptance_length"), ".2f")),
    ("acceptance rate", lambda e: _fmt(e.number("acceptance_rate"), ".3f")),
    ("draft ms/step", lambda e: _fmt(e.number("draft_ms_per_step"), ".2f")),
    ("tok/s", lambda e: _fmt(e.number("tokens_per_s"), ".2f")),
    ("speedup [95% CI]", lambda e: _ci(e, "speedup")),
    ("prompt lookup speedup", lambda e: _fmt(e.number("prompt_lookup_speedup"), ".2f")),
)


def _fmt(value: float | None, fmt: str) -> str:
    return "-" if value is None else format(value, fmt)


@functools.cache
def _plan_of(flat_params: str) -> dict | None:
    """`eagle3 plan` for one row's params (JSON of the flat params), None when they no longer
    validate or the target's config cannot be read here."""
    from eagle3.cli.plan import plan, read_target_config  # noqa: PLC0415
    from eagle3.core.inputs import InputError  # noqa: PLC0415 - the plan reads configs only when asked
    from eagle3.core.params import ParamsError, parse_params  # noqa: PLC0415

    nested: dict = {}
    for key, value in json.loads(flat_params).items():
        section, _, name = key.partition(".")
        nested.setdefault(section, {})[name] = value
    try:
        params = parse_params(nested)
        result = plan(params, read_target_config(params.target.source))
    except (ParamsError, InputError, OSError, ValueError, KeyError):
        return None
    return {
        "trainable": result["drafter"]["params"]["trainable"],
        "draft_gflop": result["flops"]["draft_step"] / 1e9,
    }


def _planned(e: Experiment, key: str) -> float | None:
    cost = _plan_of(json.dumps(e.params, sort_keys=True)) if e.params else None
    return None if cost is None else cost[key]


def _ci(e: Experiment, key: str) -> str:
    value, lo, hi = e.number(key), e.number(f"{key}_ci.lo"), e.number(f"{key}_ci.hi")
    if value is None or lo is None or hi is None:
        return _fmt(value, ".2f")
    return f"{value:.2f} [{lo:.2f}, {hi:.2f}]"


@dataclass(frozen=True)
class Verdict:
    best: Experiment | None  # the fastest size on the reference machine; None without speed figures
    compared: list[Experiment]  # the rows the verdict compares: one machine, one set of dtypes
    paragraph: str


def sweep_rows(experiments: list[Experiment]) -> list[Experiment]:
    """Rows with a draft size, smallest first (a size above the target's vocabulary counts as full)."""
    rows = [e for e in experiments if e.draft_vocab_size is not None]
    return sorted(rows, key=lambda e: (e.draft_vocab_size, e.name))


def _overlaps(a: Experiment, b: Experiment) -> bool:
    a_lo, a_hi, b_lo, b_hi = (e.number(f"speedup_ci.{end}") for e in (a, b) for end in ("lo", "hi"))
    return None not in (a_lo, a_hi, b_lo, b_hi) and a_lo <= b_hi and b_lo <= a_hi


def verdict(experiments: list[Experiment]) -> Verdict:
    """Pick the size with the highest speedup and say why, from rows measured alike only."""
    rows = [e for e in sweep_rows(experiments) if e.number("speedup") is not None and e.machine]
    if not rows:
        return Verdict(None, [], "No experiment has a speculative-eval result yet, so no size can be chosen.")
    reference = Counter(e.measured_on for e in rows).most_common(1)[0][0]
    rows = [e for e in rows if e.measured_on == reference]
    fastest = max(rows, key=lambda e: e.number("speedup"))
    # sizes this many prompts cannot tell from the fastest: the smallest of them is the pick
    # (the same speed within noise, the cheapest head to train, store and serve)
    tied = [e for e in rows if e is not fastest and _overlaps(e, fastest)]
    best = min([fastest, *tied], key=lambda e: (e.draft_vocab_size, e.name))
    first, last = rows[0], rows[-1]
    k = best.draft_vocab_size

    def facts(e: Experiment) -> str:
        return (
            f"coverage {_fmt(e.number('coverage'), '.2%')}, "
            f"acceptance length {_fmt(e.number('acceptance_length'), '.2f')}, "
            f"draft step {_fmt(e.number('draft_ms_per_step'), '.2f')} ms"
        )

    all_tied = best is not fastest and len(tied) + 1 == len(rows)
    if best is fastest:
        text = [
            f"Speedup peaks at a draft vocabulary of {k:,} tokens ({_ci(best, 'speedup')}x, {best.name})."
        ]
    else:
        text = [
            f"No size is measurably faster than the others: the highest speedup, "
            f"{_ci(fastest, 'speedup')}x at {fastest.draft_vocab_size:,} ({fastest.name}), has an interval "
            f"that overlaps those of {', '.join(e.name for e in tied)}, so the pick is the smallest of "
            f"them, {k:,} tokens ({_ci(best, 'speedup')}x, {best.name}): the same speed within noise with "
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
            f"({facts(last)}) speedup is {_ci(last, 'speedup')}x."
        )
    # the sentence above named the rows tied with the fastest; these are the rest tied with the pick
    ties = (
        []
        if all_tied
        else [e.name for e in rows if e is not best and e is not fastest and _overlaps(e, best)]
    )
    if ties:
        text.append(
            f"The speedup intervals of {', '.join(ties)} overlap the best one's: this many prompts "
            "cannot tell them apart (raise eval.num_prompts)."
        )
    others = len(sweep_rows(experiments)) - len(rows)
    machine, dtypes = reference
    text.append(
        f"Speeds were measured on {machine} ({', '.join(f'{k} {v}' for k, v in dtypes) or 'dtypes unknown'})"
        + (f"; {others} row(s) measured elsewhere or without speeds are left out." if others else ".")
    )
    return Verdict(best, rows, " ".join(text))


def write_plots(experiments: list[Experiment], verdict_: Verdict, out: Path) -> list[Path]:
    """One PNG per metric against size; the best size is marked in each."""
    import matplotlib  # noqa: PLC0415 - slow import

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt  # noqa: PLC0415

    rows = verdict_.compared or sweep_rows(experiments)
    paths = []
    for key, label, title in PLOTS:
        points = [(e.draft_vocab_size, e) for e in rows if e.number(key) is not None]
        fig, ax = plt.subplots(figsize=(6, 3.6), dpi=100)
        if points:
            xs = [x for x, _ in points]
            ys = [e.number(key) for _, e in points]
            grafted = any(e.params.get("eval.lookup_tokens") for _, e in points)
            series = "drafter + lookup branch" if grafted and key != "coverage" else "drafter"
            lo = [e.number(f"{key}_ci.lo") for _, e in points]
            hi = [e.number(f"{key}_ci.hi") for _, e in points]
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
                if peer:
                    ax.plot(*zip(*peer, strict=True), "s--", color="grey", label="prompt lookup")
                ax.legend(loc="best")
            best = verdict_.best
            if best is not None and best.number(key) is not None:
                ax.plot([best.draft_vocab_size], [best.number(key)], "r*", markersize=14, label="best size")
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


def _markdown(experiments: list[Experiment], verdict_: Verdict, plots: list[Path]) -> str:
    header = [label for label, _ in TABLE]
    lines = ["# Draft vocabulary sweep", "", verdict_.paragraph, ""]
    lines += ["| " + " | ".join(header) + " |", "|" + " --- |" * len(header)]
    lines += ["| " + " | ".join(get(e) for _, get in TABLE) + " |" for e in sweep_rows(experiments)]
    lines += [
        "",
        "Costs per size are `eagle3 plan -S vocab.size=K` on each row's params (drafter parameters and "
        'one draft step\'s FLOPs; storage, memory and steps: docs/scale-out.md "Plan a run").',
    ]
    lines += ["", "Measured on:", ""] + [f"- {m}: {', '.join(names)}" for m, names in _machines(experiments)]
    lines.append("")
    for path, (_, _, title) in zip(plots, PLOTS, strict=True):
        lines += [f"![{title}]({path.name})", ""]
    return "\n".join(lines)


def _html(experiments: list[Experiment], verdict_: Verdict, plots: list[Path]) -> str:
    head = "".join(f"<th>{html.escape(label)}</th>" for label, _ in TABLE)
    body = "".join(
        "<tr>" + "".join(f"<td>{html.escape(get(e))}</td>" for _, get in TABLE) + "</tr>"
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
    style = "body{font-family:sans-serif;max-width:72em;margin:2em auto}td,th{padding:2px 8px}"
    return (
        f"<!doctype html><html><head><meta charset='utf-8'><title>Draft vocabulary sweep</title>"
        f"<style>{style}</style></head><body><h1>Draft vocabulary sweep</h1>"
        f"<p>{html.escape(verdict_.paragraph)}</p><table><tr>{head}</tr>{body}</table>"
        f"<p>Measured on:</p><ul>{machines}</ul>{images}</body></html>\n"
    )


def write_report(experiments: list[Experiment], out: str | Path) -> tuple[Verdict, list[Path]]:
    """report.md (+ PNGs) and report.html (PNGs embedded) under `out`."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    verdict_ = verdict(experiments)
    plots = write_plots(experiments, verdict_, out)
    md, page = out / "report.md", out / "report.html"
    md.write_text(_markdown(experiments, verdict_, plots))
    page.write_text(_html(experiments, verdict_, plots))
    return verdict_, [md, page, *plots]
