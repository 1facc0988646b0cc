"""Which TTT length to train and which draft shape to serve (`eagle3 report --shapes FILE`), from
one paired same-shape run of the drafters (`python -m bench.trees --json FILE`) and, optionally,
the train step's cost per TTT length (`python -m bench.ttt --json FILE`).

A TTT length is compared only at equal serving shapes: a deeper tree accepts more whatever the
drafter, so a drafter measured at a deeper shape than another looks better for its shape's sake.
The sweep's points are the drafters whose training params differ in `train.ttt_length` alone;
others in the same run (shipped drafters trained on other data) are shown, never picked.

The rule, per shape: the drafter with the highest acceptance length averaged over the domains is
best; a drafter is tied with it when, in every domain, the paired 95% interval of its acceptance
minus the best's reaches zero. The shape to serve is the one whose best sweep point has the
highest speedup averaged over domains; the TTT to train is the cheapest to train (lowest TTT
length) among the points tied with the best at that shape.
"""

from __future__ import annotations

import json
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from eagle3.core.inputs import InputError
from eagle3.core.params import flatten

# params that say nothing about the drafter a run trains: the swept key, where it is measured
# and logged
NOT_TRAINING = ("train.ttt_length", "eval.", "tracking.", "dtypes.")


def shape_name(settings: dict[str, Any]) -> str:
    if settings["mode"] == "block":  # a DFlash drafter's one-forward block
        return f"block {settings['block_size']}"
    if settings["mode"] == "chain":
        return f"chain {settings['k']}"
    lookup = settings.get("lookup_tokens") or 0
    return f"tree {settings['k']}/{settings['topk']}/{settings['tree_budget']}" + (
        f" +{lookup} lookup" if lookup else ""
    )


def _training(params: dict | None) -> tuple | None:
    if params is None:
        return None
    flat = flatten(params)
    return tuple(sorted((k, repr(v)) for k, v in flat.items() if not k.startswith(NOT_TRAINING)))


@dataclass(frozen=True)
class ShapeRun:
    """A bench.trees JSON file, read: who was measured at which shape, per domain."""

    path: str
    machine: str
    command: str
    ttt: dict[str, int]  # drafter -> trained TTT length
    sweep: tuple[str, ...]  # the drafters that differ in their TTT length alone, by TTT
    labels: dict[str, dict[str, str]]  # shape name -> drafter -> the run's label for it
    domains: dict[str, dict[str, dict]]  # domain -> label -> figures

    @classmethod
    def read(cls, path: str | Path) -> ShapeRun:
        try:
            data = json.loads(Path(path).read_text())
        except (OSError, json.JSONDecodeError) as err:
            raise InputError(f"--shapes {path}: not readable as JSON ({err})") from err
        missing = [k for k in ("settings", "domains", "ttt_lengths", "train_params") if k not in data]
        if missing:
            raise InputError(
                f"--shapes {path}: no {', '.join(missing)}; expected `python -m bench.trees ... --json FILE` "
                "from a bench that records each drafter's TTT length and params"
            )
        labels: dict[str, dict[str, str]] = {}
        for label, settings in data["settings"].items():
            labels.setdefault(shape_name(settings), {})[settings["drafter"]] = label
        ttt = {name: int(n) for name, n in data["ttt_lengths"].items()}
        # the largest group of drafters whose training params agree but for the TTT length
        groups: dict[tuple, list[str]] = {}
        for name, params in data["train_params"].items():
            if (key := _training(params)) is not None and name in ttt:
                groups.setdefault(key, []).append(name)
        sweep = max(groups.values(), key=lambda g: len({ttt[n] for n in g}), default=[])
        if len({ttt[n] for n in sweep}) < 2:
            raise InputError(
                f"--shapes {path}: no two drafters differ in train.ttt_length alone (each drafter's "
                "folder needs the params.yaml that trained it, as `eagle3 ship` writes)"
            )
        return cls(
            str(path),
            data.get("machine", "unknown machine"),
            data.get("command", ""),
            ttt,
            tuple(sorted(sweep, key=lambda n: ttt[n])),
            labels,
            data["domains"],
        )

    def mean(self, label: str, key: str) -> float:
        return statistics.fmean(figures[label][key] for figures in self.domains.values())

    def tied(self, label: str, best: str) -> bool:
        """In no domain is `label`'s acceptance below `best`'s by more than the paired interval."""
        if label == best:
            return True
        for figures in self.domains.values():
            ci = figures[label]["acceptance_length_minus_drafter"][best]["ci"]
            if ci is None or ci["hi"] < 0:
                return False
        return True


@dataclass(frozen=True)
class DepthVerdict:
    ttt: int
    drafter: str
    shape: str
    paragraph: str
    markdown: str


def _cost_by_ttt(costs: dict | None) -> dict[int, float]:
    """bench.ttt's train time per token against its first TTT length, by TTT length."""
    return {int(r["ttt"]): float(r["x_first"]) for r in (costs or {}).get("rows", [])}


def decide(run: ShapeRun, costs: dict | None = None) -> DepthVerdict:
    shared = [s for s, by in run.labels.items() if all(n in by for n in run.sweep)]
    if not shared:
        raise InputError(f"--shapes {run.path}: no shape measured every sweep point ({', '.join(run.sweep)})")
    best_at: dict[str, str] = {}
    for shape in shared:
        # equal means: the shorter unroll
        best_at[shape] = max(
            run.sweep, key=lambda n: (run.mean(run.labels[shape][n], "acceptance_length"), -run.ttt[n])
        )
    serve = max(shared, key=lambda s: run.mean(run.labels[s][best_at[s]], "speedup"))
    by = run.labels[serve]
    tied = [n for n in run.sweep if run.tied(by[n], by[best_at[serve]])]
    pick = min(tied, key=lambda n: run.ttt[n])
    cost = _cost_by_ttt(costs)
    best = best_at[serve]
    parts = [
        f"Train TTT {run.ttt[pick]} ({pick}) and serve {serve}.",
        f"At {serve}, the shape whose best drafter is fastest here "
        f"({run.mean(by[best], 'speedup'):.2f}x over plain decoding, mean of {len(run.domains)} domains), "
        f"TTT {run.ttt[best]} accepts most ({run.mean(by[best], 'acceptance_length'):.2f})",
    ]
    if pick != best:
        parts[-1] += (
            f", and TTT {run.ttt[pick]} ({run.mean(by[pick], 'acceptance_length'):.2f}) is within the paired "
            f"95% interval of it in every domain, for "
            + (
                f"{cost[run.ttt[pick]] / cost[run.ttt[best]]:.2f}x its train time per token."
                if run.ttt[pick] in cost and run.ttt[best] in cost
                else "a shorter unroll (a train step's time grows about linearly with TTT length)."
            )
        )
    elif longer := [str(run.ttt[n]) for n in tied if n != pick]:
        parts[-1] += (
            f"; TTT {', '.join(longer)} {'is' if len(longer) == 1 else 'are'} within its paired 95% "
            "interval in every domain, at a longer unroll to train."
        )
    else:
        parts[-1] += "."
    untied = [n for n in run.sweep if n not in tied]
    if untied:
        parts.append(f"Measurably below it: TTT {', '.join(str(run.ttt[n]) for n in untied)}.")
    paragraph = " ".join(parts)
    return DepthVerdict(
        run.ttt[pick], pick, serve, paragraph, _markdown(run, shared, best_at, cost, paragraph)
    )


def _markdown(
    run: ShapeRun, shapes: list[str], best_at: dict[str, str], cost: dict[int, float], paragraph: str
) -> str:
    others = [n for n in run.ttt if n not in run.sweep]
    header = ["drafter", "TTT", "train time / token"] + [f"{s}: accept (speedup)" for s in shapes]
    lines = ["# Training depth and serving shape", "", paragraph, ""]
    lines += ["| " + " | ".join(header) + " |", "|" + " --- |" * len(header)]
    for name in [*run.sweep, *others]:
        cells = [name + ("" if name in run.sweep else " (other data)"), str(run.ttt[name])]
        cells.append(f"{cost[run.ttt[name]]:.2f}x" if run.ttt[name] in cost else "-")
        for shape in shapes:
            label = run.labels[shape].get(name)
            if label is None:
                cells.append("-")
                continue
            mark = "**" if best_at[shape] == name else ""
            cells.append(
                f"{mark}{run.mean(label, 'acceptance_length'):.2f}{mark} ({run.mean(label, 'speedup'):.2f}x)"
            )
        lines.append("| " + " | ".join(cells) + " |")
    lines += [
        "",
        f"Acceptance length and speedup over plain decoding are means over the domains "
        f"({', '.join(run.domains)}); bold: the sweep's best at that shape. Train time per token is "
        "against the first TTT length of the cost bench (`python -m bench.ttt`).",
        "",
        "## By domain",
        "",
    ]
    for domain, figures in run.domains.items():
        lines += [
            f"### {domain}",
            "",
            "| drafter | " + " | ".join(shapes) + " |",
            "|" + " --- |" * (1 + len(shapes)),
        ]
        for name in [*run.sweep, *others]:
            cells = []
            for shape in shapes:
                label = run.labels[shape].get(name)
                f = figures.get(label) if label else None
                if not f:
                    cells.append("-")
                    continue
                ci = f.get("acceptance_length_ci") or {}
                cells.append(f"{f['acceptance_length']:.2f} [{ci.get('lo', 0):.2f}, {ci.get('hi', 0):.2f}]")
            lines.append(f"| {name} | " + " | ".join(cells) + " |")
        lines.append("")
    lines += [f"Measured on: {run.machine}", "", f"Command: `{run.command}`", ""]
    return "\n".join(lines)
