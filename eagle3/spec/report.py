"""The per-position acceptance plot: a CSV for `dvc plots` and a PNG for MLflow."""

from __future__ import annotations

from pathlib import Path

from eagle3.stageio import write_csv


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
    import matplotlib  # noqa: PLC0415 - slow import, only for the picture

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

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
