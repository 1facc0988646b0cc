"""Stage patch-check: prove capture reads the right layers on this engine; fingerprint the target.
The backend extract.backend names does the work (eagle3/backends.py).

hf: capture is non-invasive and equals HF's reference states. sglang: the servers run a
supported version in the right mode and their rows agree with the HF reference (bf16 tolerance).
"""

from __future__ import annotations

from eagle3.backends import backend_for
from eagle3.core.pipeline import PATCH_REPORT, metrics_path
from eagle3.core.stage_commit import staged_outputs
from eagle3.core.stageio import write_json
from eagle3.core.tracking import pipeline_run
from eagle3.target.fingerprint import Fingerprint
from stages.common import console, reported_failures, validated_params


def main() -> None:
    params = validated_params()
    # staged_outputs: all outputs replaced together at the end, none when the stage fails
    with reported_failures("patch-check"), staged_outputs("patch-check") as staged:
        report = backend_for(params.extract.backend).patch_check(params)
        write_json(staged.path(PATCH_REPORT), report)
        fp = Fingerprint.from_json(report["fingerprint"], str(PATCH_REPORT))
        metrics = {
            "patch_check_passed": True,
            "num_layers": fp.num_layers,
            "hidden_size": fp.hidden_size,
        }
        write_json(staged.path(metrics_path("patch-check")), metrics)
        with pipeline_run(params, "patch-check") as run:
            run.log_metrics(metrics)
    console.print(f"patch-check passed: aux layers {list(fp.aux_layers)}, {fp.engine} {fp.engine_version}")


if __name__ == "__main__":
    main()
