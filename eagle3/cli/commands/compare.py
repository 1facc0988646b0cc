"""`eagle3 compare`: the experiments side by side, in two narrow tables (quality: vocab size,
coverage, acceptance; then speed: draft cost, tokens/s, speedups) that fit an 80-column terminal.
`eagle3 report` reads and prints them the same way (experiment_arguments, read_rows,
print_comparison).

Speeds compare only between rows measured on the same machine with the same dtypes, so each
speed row carries a letter for where it was measured and a legend spells the letters out.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Iterable
from string import ascii_lowercase, ascii_uppercase
from typing import TYPE_CHECKING

from rich.console import Console, Group, RenderableType
from rich.table import Table
from rich.text import Text

from eagle3.cli.subcommand import Subcommand, fail

if TYPE_CHECKING:  # the rows' type only: reading them imports eagle3.sweep when a command runs
    from eagle3.sweep.experiments import Experiment

MISSING = "-"


def _num(value: float | None, fmt: str) -> str:
    return MISSING if value is None else format(value, fmt)


def _params_count(value: float | None) -> str:
    if value is None:
        return MISSING
    for scale, unit in ((1e9, "B"), (1e6, "M"), (1e3, "K")):
        if value >= scale:
            return f"{value / scale:.1f}{unit}"
    return f"{value:.0f}"


def _with_interval(e: Experiment, key: str, fmt: str) -> str:
    value, lo, hi = e.number(key), e.number(f"{key}_ci.lo"), e.number(f"{key}_ci.hi")
    if value is None:
        return MISSING
    if lo is None or hi is None:
        return format(value, fmt)
    return f"{value:{fmt}} [{lo:{fmt}},{hi:{fmt}}]"


def _size(e: Experiment) -> str:
    requested, used = e.params.get("vocab.size"), e.draft_vocab_size
    if used is None:
        return MISSING
    # a size above the target's vocabulary runs as the full vocabulary: show both (a DFlash
    # drafter always drafts from the whole vocabulary: vocab.size says nothing there)
    return f"{used}" if requested in (None, used) or e.kind == "dflash" else f"{requested}→{used}"


def _head(e: Experiment) -> str:
    # a DFlash drafter drafts through the target's own lm_head: it trains none
    return "target" if e.kind == "dflash" else _params_count(e.number("lm_head_params"))


QUALITY: list[tuple[str, Callable[[Experiment], str]]] = [
    ("vocab\nsize", _size),
    ("coverage", lambda e: _num(e.number("coverage"), ".4f")),
    ("lm_head\nparams", _head),
    ("acceptance length\n[95% CI]", lambda e: _with_interval(e, "acceptance_length", ".2f")),
    ("accept\nrate", lambda e: _num(e.number("acceptance_rate"), ".3f")),
]
SPEED: list[tuple[str, Callable[[Experiment], str]]] = [
    ("draft\nms/step", lambda e: _num(e.number("draft_ms_per_step"), ".2f")),
    ("tok/s", lambda e: _num(e.number("tokens_per_s"), ".2f")),
    ("speedup", lambda e: _num(e.number("speedup"), ".2f")),
    ("prompt lookup\nspeedup", lambda e: _num(e.number("prompt_lookup_speedup"), ".2f")),
]


def _letters(keys: Iterable, alphabet: str) -> dict:
    """A letter per distinct key, in order of first appearance; None gets none."""
    letters: dict = {}
    for key in keys:
        if key is not None and key not in letters:
            letters[key] = alphabet[len(letters) % len(alphabet)]
    return letters


def shape_letters(experiments: list[Experiment]) -> dict[str, str]:
    """A lower-case letter per decoding shape, in order of first appearance."""
    return _letters((e.decoded_at for e in experiments), ascii_lowercase)


def machine_letters(experiments: list[Experiment]) -> dict[tuple, str]:
    """A letter per (machine, dtypes) in order of first appearance; rows never measured get none."""
    return _letters((e.measured_on if e.machine is not None else None for e in experiments), ascii_uppercase)


def _table(
    title: str, columns: list, experiments: list[Experiment], extra: Callable, extra_label: str
) -> Table:
    table = Table(title=title, title_justify="left")
    table.add_column("experiment", overflow="fold", no_wrap=False, max_width=20)
    table.add_column(extra_label, justify="center")
    for label, _ in columns:
        table.add_column(label, justify="right", overflow="fold")
    for e in experiments:
        cells = [e.label, extra(e)] + [get(e) for _, get in columns]
        table.add_row(*cells)
    return table


def _dtypes_text(dtypes: dict[str, str]) -> str:
    order = ("extract", "train", "eval", "drafter")
    return ", ".join(f"{k} {dtypes[k]}" for k in order if k in dtypes) or "dtypes unknown"


def comparison(experiments: list[Experiment]) -> RenderableType:
    """Both tables and the legend of where each speed was measured."""
    letters, shapes = machine_letters(experiments), shape_letters(experiments)
    quality = _table(
        "Draft vocabulary and acceptance (at: the shape drafted at)",
        QUALITY,
        experiments,
        lambda e: shapes.get(e.decoded_at, MISSING),
        "at",
    )
    speed = _table(
        "Speed (compare rows with the same letter only)",
        SPEED,
        experiments,
        lambda e: letters.get(e.measured_on, MISSING),
        "meas.\non",
    )
    legend = Text()
    for shape, letter in shapes.items():
        legend.append(f"{letter}: ", style="bold")
        legend.append(f"{shape}\n")
    if len(shapes) > 1:
        legend.append(
            f"note: these rows drafted at {len(shapes)} shapes; acceptance compares at one shape, or as "
            "each drafter at its own serving shape (`python -m bench.trees` pairs them in one run).\n",
            style="yellow",
        )
    for (machine, dtypes), letter in letters.items():
        legend.append(f"{letter}: ", style="bold")
        legend.append(f"{machine}; {_dtypes_text(dict(dtypes))}\n")
    machines = {machine for machine, _ in letters}
    if len(machines) > 1:
        legend.append(
            f"warning: these rows were measured on {len(machines)} different machines; their "
            "speeds do not compare.\n",
            style="yellow",
        )
    elif len(letters) > 1:
        legend.append("warning: these rows were measured with different dtypes.\n", style="yellow")
    for e in experiments:
        if e.stale:
            legend.append(
                f"{e.label}: {', '.join(e.stale)} did not run for this experiment (a targeted "
                "`dvc exp run`); the figures it left from another run are not shown.\n"
            )
    return Group(quality, Text(), speed, legend)


def print_comparison(experiments: list[Experiment], console: Console | None = None) -> None:
    (console or Console()).print(comparison(experiments))


def experiment_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("names", nargs="*", help="experiments to show (default: all with metrics)")
    parser.add_argument("--source", choices=("dvc", "mlflow"), default="dvc", help="where to read")
    parser.add_argument("--json", help="a saved `dvc exp show --json` output instead of running it")
    parser.add_argument("--all-commits", action="store_true", help="experiments of every commit (dvc)")
    parser.add_argument("--params", default="params.yaml", help="names the MLflow store and experiment")


def warn_of_leftover_workers() -> None:
    from eagle3.cli.queue_workers import leftover_worker_warning

    if warning := leftover_worker_warning():
        Console(stderr=True).print(f"[yellow]warning:[/] {warning}", highlight=False, soft_wrap=True)


def read_rows(args: argparse.Namespace) -> list:
    """The selected experiments as rows (ExperimentsError, ParamsError or InputError: bad input)."""
    from eagle3.sweep.experiments import load_experiments, select

    rows, where = load_experiments(args.source, args.json, args.all_commits, args.params)
    return select(rows, args.names, where)


def _run(args: argparse.Namespace) -> int:
    from eagle3.core.inputs import InputError
    from eagle3.core.params import ParamsError
    from eagle3.sweep.experiments import ExperimentsError

    warn_of_leftover_workers()
    try:
        rows = read_rows(args)
    except (ExperimentsError, ParamsError, InputError) as err:
        return fail(err)
    print_comparison(rows, Console())
    return 0


SUBCOMMAND = Subcommand(
    "compare",
    "compare experiments: vocab size, coverage, acceptance, draft cost, speed, machine",
    experiment_arguments,
    _run,
)
