"""What speculative-eval shows: the per-position acceptance plot (a CSV for `dvc plots`, a PNG
for MLflow) and the console tables of per-category metrics and bootstrap intervals."""

from __future__ import annotations

from pathlib import Path

from rich.table import Table

from eagle3.core.stageio import write_csv
from eagle3.decoding.stats import LEVEL, RESAMPLES

# (metric key, column title) of the per-category table.
CATEGORY_COLUMNS = (
    ("num_prompts", "prompts"),
    ("acceptance_length", "acceptance length"),
    ("acceptance_rate", "acceptance rate"),
    ("speedup", "speedup"),
    ("prompt_lookup_speedup", "prompt lookup speedup"),
)
# (interval key, label) of the interval line.
INTERVALS = (
    ("acceptance_length_ci", "acceptance length"),
    ("speedup_ci", "speedup"),
    ("prompt_lookup_speedup_ci", "prompt lookup speedup"),
    ("speedup_minus_prompt_lookup_ci", "speedup - prompt lookup"),
)


def acceptance_rows(per_position: dict[str, float]) -> list[list[float]]:
    """[position, conditional acceptance, share of steps reaching that position]."""
    rows, reached = [], 1.0
    for pos in sorted(per_position, key=int):
        reached *= per_position[pos]
        rows.append([int(pos), round(per_position[pos], 6), round(reached, 6)])
    return rows


def write_acceptance_plot(per_position: dict[str, float], csv_path: Path, png_path: Path | None) -> None:
    rows = acceptance_rows(per_position)
    write_csv(csv_path, ["position", "acceptance", "cumulative"], rows)
    if png_path is None:
        return
    import matplotlib  # slow import, only for the picture

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5, 3.2), dpi=100)
    positions = [r[0] for r in rows]
    ax.bar(positions, [r[1] for r in rows], color="#4c72b0", label="P(accept | previous accepted)")
    ax.plot(positions, [r[2] for r in rows], "o-", color="#dd8452", label="P(reach position)")
    ax.set_xlabel("draft position")
    ax.set_ylabel("acceptance")
    ax.set_ylim(0, 1)
    ax.set_xticks(positions)
    ax.legend(fontsize=8)
    fig.tight_layout()
    png_path.parent.mkdir(parents=True, exist_ok=True)
    # no timestamp in the metadata: the same numbers give the same bytes
    fig.savefig(png_path, metadata={"Software": None})
    plt.close(fig)


def _cell(value: float | int | None) -> str:
    if value is None or value != value:  # NaN: nothing to divide by
        return "-"
    return str(value) if isinstance(value, int) else f"{value:.3f}"


def category_table(metrics: dict) -> Table:
    """Per-category rows (metrics["per_category"]) and, with more than one category, the total."""
    per_category = metrics["per_category"]
    columns = [(key, title) for key, title in CATEGORY_COLUMNS if key in metrics or key == "num_prompts"]
    table = Table(title="speculative-eval per category")
    table.add_column("category")
    for _, title in columns:
        table.add_column(title, justify="right")
    for category, row in per_category.items():
        table.add_row(category, *(_cell(row.get(key)) for key, _ in columns))
    if len(per_category) > 1:
        table.add_row("all", *(_cell(metrics.get(key)) for key, _ in columns), style="bold")
    return table


def _with_ci(row: dict, key: str) -> str:
    ci = row.get(f"{key}_ci")
    return _cell(row.get(key)) + (f" [{ci['lo']:.2f}, {ci['hi']:.2f}]" if ci else "")


def domain_table(metrics: dict) -> Table:
    """Per-domain rows (metrics["per_domain"]): acceptance and speedup with their intervals, and
    acceptance by draft position."""
    table = Table(title="speculative-eval per domain")
    for title in ("domain", "prompts", "acceptance length", "speedup", "prompt lookup", "by position"):
        table.add_column(title, justify="left" if title in ("domain", "by position") else "right")
    for domain, row in metrics["per_domain"].items():
        positions = " ".join(
            f"{v:.2f}" for _, v in sorted(row["per_position_acceptance"].items(), key=lambda kv: int(kv[0]))
        )
        table.add_row(
            domain,
            str(row["num_prompts"]),
            _with_ci(row, "acceptance_length"),
            _with_ci(row, "speedup"),
            _cell(row.get("prompt_lookup_speedup")),
            positions,
        )
    return table


def interval_line(metrics: dict) -> str:
    """The bootstrap intervals in one line, e.g. `speedup [1.02, 1.31]`."""
    parts = []
    for key, label in INTERVALS:
        if key in metrics:
            ci = metrics[key]
            parts.append(f"{label} " + (f"[{ci['lo']:.3f}, {ci['hi']:.3f}]" if ci else "-"))
    head = f"{LEVEL:.0%} intervals over prompts ({RESAMPLES} bootstrap resamples): "
    return head + ", ".join(parts)


def headline(metrics: dict) -> str:
    """Acceptance and speed in one line, with the prompt-lookup peer's speedup where it ran."""
    m = metrics
    line = (
        f"acceptance length {m['acceptance_length']:.2f}, {m['tokens_per_s']:.1f} tok/s vs "
        f"{m['baseline_tokens_per_s']:.1f} plain: speedup {m['speedup']:.2f}x"
    )
    if "prompt_lookup_speedup" in m:
        line += f" (prompt lookup {m['prompt_lookup_speedup']:.2f}x)"
    return line
