"""Stage extract: conversations -> captured aux/last hidden states in a sharded feature store, by
the backend extract.backend names (eagle3/backends.py)."""

from __future__ import annotations

import time

from eagle3.backends import backend_for, require_engine
from eagle3.core.device import machine
from eagle3.core.pipeline import FEATURES, PATCH_REPORT, metrics_path
from eagle3.core.stage_commit import staged_outputs
from eagle3.core.stageio import write_json
from eagle3.core.tracking import pipeline_run
from eagle3.data.store import work_folder
from eagle3.target.fingerprint import read_fingerprint
from stages.common import console, reported_failures, validated_params


def main() -> None:
    params = validated_params()
    # staged_outputs: all outputs replaced together at the end, none when the stage fails;
    # the new store is the completed work folder (eagle3/data/store.py), adopted by the commit
    with reported_failures("extract"), staged_outputs("extract") as staged:
        if not PATCH_REPORT.exists():
            raise FileNotFoundError(f"{PATCH_REPORT} is missing: run the patch-check stage first")
        fingerprint = read_fingerprint(PATCH_REPORT)
        if fingerprint.target_source != params.target.source:
            raise ValueError(
                f"target.source is '{params.target.source}' but {PATCH_REPORT} checked "
                f"'{fingerprint.target_source}': run patch-check again"
            )
        backend = backend_for(params.extract.backend)
        require_engine(backend, fingerprint, str(PATCH_REPORT))
        started = time.perf_counter()
        stats: dict = {}
        manifest, dtype = backend.extract(params, fingerprint, FEATURES, stats=stats, publish=False)
        staged.adopt(FEATURES, work_folder(FEATURES))
        seconds = time.perf_counter() - started
        metrics = {
            "num_samples": manifest["num_samples"],
            "num_tokens": manifest["num_tokens"],
            "num_loss_tokens": manifest["num_loss_tokens"],
            "bytes_per_token": manifest["bytes_per_token"],
            "dtype": dtype,
        }
        # the rate of what this run computed: resumed shards cost nothing and would inflate it
        if stats.get("computed_tokens"):
            metrics["extract_tokens_per_s"] = round(stats["computed_tokens"] / stats["computed_seconds"], 1)
        write_json(staged.path(metrics_path("extract")), metrics)
        with pipeline_run(params, "extract") as run:
            run.log_metrics(metrics)
            tags = {"extract.dtype": metrics["dtype"], "extract.machine": machine()}
            run.set_tags(tags | {"extract.engine": f"{fingerprint.engine} {fingerprint.engine_version}"})
    resumed = manifest["num_tokens"] - stats.get("computed_tokens", 0)
    console.print(
        f"extracted {manifest['num_tokens']:,} tokens of {manifest['num_samples']} samples in {seconds:.0f} s"
        + (f" ({resumed:,} resumed from earlier shards)" if resumed else "")
    )


if __name__ == "__main__":
    main()
