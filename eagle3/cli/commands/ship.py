"""`eagle3 ship NAME`: copy the trained drafter with what produced it into drafters/NAME/."""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

from eagle3.cli.subcommand import Subcommand, fail
from eagle3.core.pipeline import DRAFTER, metrics_path
from eagle3.core.stageio import write_json


def ship(name: str, drafter: str = DRAFTER.as_posix(), folder: str = "drafters") -> Path:
    """Copy a trained drafter with the params and metrics that produced it into drafters/<name>/,
    so it can be committed and evaluated later with `eval.drafter` (no retraining)."""
    src, out = Path(drafter), Path(folder) / name
    for needed in (src / "config.json", src / "model.safetensors", Path("params.yaml")):
        if not needed.exists():
            raise FileNotFoundError(f"{needed} is missing: train a drafter first (dvc repro)")
    out.mkdir(parents=True, exist_ok=True)
    for file in ("config.json", "model.safetensors"):
        shutil.copyfile(src / file, out / file)
    shutil.copyfile("params.yaml", out / "params.yaml")
    metrics = {
        stage: json.loads(path.read_text())
        for stage in ("extract", "vocab-map", "train", "speculative-eval")
        if (path := metrics_path(stage)).exists()
    }
    write_json(out / "metrics.json", metrics)
    return out


def _run(args: argparse.Namespace) -> int:
    try:
        print(ship(args.name))
    except FileNotFoundError as err:
        return fail(err, soft_wrap=False)
    return 0


SUBCOMMAND = Subcommand(
    "ship",
    "copy the trained drafter, params.yaml and metrics into drafters/NAME/ (to commit)",
    lambda parser: parser.add_argument("name"),
    _run,
)
