"""What a training run reports: the stage's metrics file, its plots, and its MLflow run."""

from __future__ import annotations

from pathlib import Path

from eagle3.core.device import machine
from eagle3.core.stageio import write_csv
from eagle3.core.tracking import StageRun
from eagle3.train.loop import TrainOutcome


def per_position(summary: dict) -> dict:
    """{acc_k, loss_k} of a per-TTT-position summary, rounded for the metrics file."""
    out = {f"acc_{k}": round(a, 6) for k, a in enumerate(summary["acc"])}
    out |= {f"loss_{k}": round(x, 6) for k, x in enumerate(summary["loss"])}
    return out


def stage_metrics(outcome: TrainOutcome) -> dict:
    """metrics/train.json: the held-out figures that decide a drafter, and what produced them."""
    m = outcome.metrics
    metrics = {
        # named apart from speculative-eval's measured figures: both land in one MLflow run
        "sim_acceptance_length": round(m["acceptance_length"], 4),
        "heldout_acc_0": round(m["heldout_acc_0"], 6),
        "chance_acc": m["chance_acc"],
        "heldout": per_position(m["heldout"]),
        "train": per_position(m["train"]),
        # the eval's draft shapes simulated on held-out features (train/simulate.py)
        "sim_shapes": {name: round(v, 4) for name, v in m["heldout"].get("sim_acceptance", {}).items()},
        # by draft position, as speculative-eval's per_position_acceptance: {shape: {position: share}}
        "sim_per_position": {
            name: {pos: round(v, 6) for pos, v in shares.items()}
            for name, shares in m["heldout"].get("sim_per_position", {}).items()
        },
        "chain_survival": {
            f"depth_{k + 1}": round(s, 6) for k, s in enumerate(m["heldout"]["chain_survival"])
        },
        "steps": m["steps"],
        "train_tokens": m["train_tokens"],
        "heldout_tokens": m["heldout_tokens"],
        "draft_vocab_size": outcome.drafter.cfg.draft_vocab_size,
        "processes": m["processes"],
        "dtype": m["dtype"],
    } | (  # a run resumed from a finished checkpoint trained nothing: no rate to report
        {"train_tokens_per_s": round(m["tokens_per_s"], 1)} if m["tokens_per_s"] else {}
    )
    if m.get("init"):  # warm start: the drafter as it was, before training (train/loop.py check_init)
        metrics["init_heldout_acc_0"] = round(m["init"]["heldout_acc_0"], 6)
        metrics["init_sim_acceptance_length"] = round(m["init"]["acceptance_length"], 4)
        init_shapes = m["init"].get("sim_acceptance", {})
        metrics["init_sim_shapes"] = {name: round(v, 4) for name, v in init_shapes.items()}
    return metrics


def _key(shape_name: str) -> str:
    """An MLflow-safe metric name of a shape: "tree 2/4/6" -> "tree_2_4_6"."""
    return shape_name.replace(" ", "_").replace("/", "_")


def write_plots(outcome: TrainOutcome, curve: Path, by_position: Path, sim_acceptance: Path) -> None:
    """The training curve (per step), the accuracy by TTT position and the simulated acceptance
    curve (per epoch and draft shape), each a CSV at the path given."""
    held, train = outcome.metrics["heldout"], outcome.metrics["train"]
    positions = range(len(held["acc"]))
    keys = ["step", "epoch", "lr", "loss"] + [f"acc_{k}" for k in positions]
    write_csv(curve, keys, [[row[k] for k in keys] for row in outcome.curve])
    write_csv(
        by_position,
        ["ttt_position", "heldout_acc", "train_acc", "heldout_loss"],
        [[k, held["acc"][k], train["acc"][k], held["loss"][k]] for k in positions],
    )
    rows = [
        [epoch["epoch"], name, round(length, 4)]
        for epoch in outcome.epochs
        for name, length in epoch["heldout"].get("sim_acceptance", {}).items()
    ]
    write_csv(sim_acceptance, ["epoch", "shape", "acceptance_length"], rows)


def summary_line(metrics: dict, out: Path, first: str = "TTT position 0") -> str:
    """The stage's last line; `first`: what the first draft position is called (a DFlash drafter's:
    block position 1)."""
    return (
        f"drafter: held-out top-1 acc at {first} {metrics['heldout_acc_0']:.3f} "
        f"(chance {metrics['chance_acc']:.5f}), "
        f"simulated acceptance length {metrics['sim_acceptance_length']:.2f}, "
        + (f"{r:,.0f} tok/s" if (r := metrics.get("train_tokens_per_s")) else "resumed, nothing trained")
        + f" -> {out}"
    )


class RunLogger:
    """Logs a training run to its MLflow run: each step, each epoch's held-out figures, the end."""

    def __init__(self, run: StageRun):
        self.run = run

    def on_step(self, row: dict) -> None:
        metrics = {f"train.{k}": v for k, v in row.items() if k not in ("step", "epoch")}
        self.run.log_metrics(metrics, step=row["step"])

    def on_epoch(self, result: dict) -> None:
        held = result["heldout"]
        metrics = {"heldout.acceptance_length": held["acceptance_length"]}
        metrics |= {f"sim.{_key(name)}": v for name, v in held.get("sim_acceptance", {}).items()}
        metrics |= {f"heldout.{k}": v for k, v in per_position(held).items()}
        self.run.log_metrics(metrics, step=result["epoch"])

    def finish(self, metrics: dict, dtype: str, drafter_config: Path) -> None:
        self.run.log_metrics({k: v for k, v in metrics.items() if k != "chance_acc"})
        self.run.set_tags({"train.dtype": dtype, "train.machine": machine()})
        self.run.log_artifact(drafter_config, "drafter")
