"""`eagle3 report`'s files: four plots against the draft vocabulary size (coverage, acceptance
length, draft step time, speedup) with the best size marked, the comparison table and the
verdict, as markdown with PNGs beside it and as one HTML file with the PNGs inside (no network
needed)."""

from __future__ import annotations

import base64
import html
from pathlib import Path

from eagle3.sweep.costs import PlanTarget, plan_columns, planned
from eagle3.sweep.decide import Verdict, fmt, sweep_rows, verdict
from eagle3.sweep.experiments import Experiment
from eagle3.sweep.paired import Column, Paired

PLOTS = (
    ("coverage", "coverage", "Coverage of loss-masked tokens"),
    ("acceptance_length", "acceptance length", "Acceptance length (95% CI over prompts)"),
    ("draft_ms_per_step", "draft ms per step", "Draft step time"),
    ("speedup", "speedup vs plain greedy", "Speedup (95% CI over prompts)"),
)
TABLE: tuple[Column, ...] = (
    ("experiment", lambda e: e.label),
    ("size", lambda e: str(e.draft_vocab_size)),
    ("coverage", lambda e: fmt(e.number("coverage"), ".4f")),
    ("lm_head params", lambda e: fmt(e.number("lm_head_params"), ",.0f")),
    # what the size costs, from `eagle3 plan` on the row's own params (docs/scale-out.md "Plan a run")
    ("trainable params (plan)", lambda e: fmt(planned(e, "trainable"), ",.0f")),
    ("draft GFLOP/step (plan)", lambda e: fmt(planned(e, "draft_gflop"), ".3f")),
    ("held-out top-1", lambda e: fmt(e.number("heldout_acc_0"), ".4f")),
    ("drafted at", lambda e: e.decoded_at or "-"),  # acceptance compares at one shape
    ("acceptance length [95% CI]", lambda e: _ci(e, "acceptance_length")),
    ("accepted by draft position", lambda e: _by_position(e)),
    ("drafter's share", lambda e: fmt(e.number("drafter_acceptance_length"), ".2f")),
    ("acceptance rate", lambda e: fmt(e.number("acceptance_rate"), ".3f")),
    ("draft ms/step", lambda e: fmt(e.number("draft_ms_per_step"), ".2f")),
    ("tok/s", lambda e: fmt(e.number("tokens_per_s"), ".2f")),
    ("speedup [95% CI]", lambda e: _ci(e, "speedup")),
    ("prompt lookup speedup", lambda e: fmt(e.number("prompt_lookup_speedup"), ".2f")),
    ("train tok/s", lambda e: fmt(e.number("train_tokens_per_s"), ",.0f")),
)


def _by_position(e: Experiment) -> str:
    """The share of draft steps whose position 1, 2, ... token was accepted: "0.43 / 0.25"."""
    shares, k = [], 1
    while (share := e.number(f"per_position_acceptance.{k}")) is not None:
        shares.append(f"{share:.2f}")
        k += 1
    return " / ".join(shares) or "-"


def _ci(e: Experiment, key: str) -> str:
    value, lo, hi = e.number(key), e.number(f"{key}_ci.lo"), e.number(f"{key}_ci.hi")
    if value is None or lo is None or hi is None:
        return fmt(value, ".2f")
    return f"{value:.2f} [{lo:.2f}, {hi:.2f}]"


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
                # clamped: a point and its interval are sums taken in another order, so a
                # one-prompt interval can sit a rounding error off its point
                below = [max(y - low, 0.0) for y, low in zip(ys, lo, strict=True)]
                err = [below, [max(h - y, 0.0) for y, h in zip(ys, hi, strict=True)]]
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
