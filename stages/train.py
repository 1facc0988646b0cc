"""Stage train: features + vocab mapping -> a drafter exported for SGLang: EAGLE-3, or with
drafter.kind dflash a DFlash block drafter (eagle3/train/dflash_loop.py).

With train.num_processes > 1 the stage re-launches itself under torchrun (DDP); launched by
torchrun directly (`torchrun --nproc_per_node N -m stages.train`) it just joins the group.
"""

from __future__ import annotations

import os
import sys

from eagle3.backends import backend_of
from eagle3.core.params import Params
from eagle3.core.pipeline import (
    CHECKPOINTS,
    DRAFTER,
    FEATURES,
    PATCH_REPORT,
    SIM_ACCEPTANCE,
    TRAIN_ACC_BY_POSITION,
    TRAIN_CURVE,
    VOCAB_MAP,
    metrics_path,
)
from eagle3.core.stage_commit import staged_outputs
from eagle3.core.stageio import write_json
from eagle3.core.tracking import pipeline_run
from eagle3.drafter.dflash_export import export_dflash
from eagle3.drafter.export import export_drafter
from eagle3.dtypes.resolved import pinned
from eagle3.train.dflash_loop import prepare_dflash_inputs, train_dflash
from eagle3.train.distributed import (
    CUBLAS_DETERMINISTIC,
    is_main_process,
    launched_by_torchrun,
    relaunch_under_torchrun,
)
from eagle3.train.loop import train_drafter
from eagle3.train.online import OnlineSource, online_source
from eagle3.train.prepare import TrainInputs, prepare_inputs
from eagle3.train.report import RunLogger, stage_metrics, summary_line, write_plots
from stages.common import console, reported_failures, validated_params

# before any CUDA work of this process (the online target's forward too): deterministic GPU training
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", CUBLAS_DETERMINISTIC)


def prepare(params: Params) -> tuple[TrainInputs, OnlineSource | None]:
    """This stage's inputs, read and cross-checked (fails before any expensive work), and for an
    online store its feature source: the backend that made the store (the in-process target, or
    SGLang servers)."""
    read = prepare_dflash_inputs if params.drafter.kind == "dflash" else prepare_inputs
    inputs = read(params, FEATURES, VOCAB_MAP, PATCH_REPORT)
    if not inputs.store.online:
        return inputs, None
    # the backend that made the store computes its features: the store's fingerprint names it
    feed = backend_of(inputs.store.fingerprint).online(params, inputs.store)
    return inputs, online_source(inputs, feed, params.online.prefetch_batches)


def main() -> None:
    params = validated_params()
    p = params.train
    if p.num_processes > 1 and not launched_by_torchrun():
        sys.exit(relaunch_under_torchrun(p.num_processes, "stages.train"))
    with reported_failures("train"):
        pinned_params = pinned(params, "train")  # computes in the dtype the dtypes stage recorded
        (inputs, online), p = prepare(pinned_params), pinned_params.train
        dflash = params.drafter.kind == "dflash"

        def train(**hooks):
            if dflash:
                return train_dflash(pinned_params, inputs, CHECKPOINTS, online=online, **hooks)
            return train_drafter(p, inputs, CHECKPOINTS, online=online, **hooks)

        if not is_main_process():
            train()
            return
        # staged_outputs: all outputs replaced together at the end, none when the stage fails
        with staged_outputs("train") as staged, pipeline_run(params, "train") as run:
            log = RunLogger(run)
            outcome = train(on_step=log.on_step, on_epoch=log.on_epoch)
            if dflash:
                export_dflash(outcome.drafter, staged.path(DRAFTER))
            else:
                export_drafter(outcome.drafter, staged.path(DRAFTER), ttt_length=p.ttt_length)
            metrics = stage_metrics(outcome)
            write_json(staged.path(metrics_path("train")), metrics)
            write_plots(outcome, *map(staged.path, (TRAIN_CURVE, TRAIN_ACC_BY_POSITION, SIM_ACCEPTANCE)))
            log.finish(metrics, outcome.metrics["dtype"], staged.path(DRAFTER) / "config.json")
    first = "block position 1" if params.drafter.kind == "dflash" else "TTT position 0"
    console.print(summary_line(metrics, DRAFTER, first))


if __name__ == "__main__":
    main()
