"""Stage patch-check: prove capture reads the right layers on this engine; fingerprint the target.

hf: capture is non-invasive and equals HF's reference states. sglang: the servers run a
supported version in the right mode and their rows agree with the HF reference (bf16 tolerance).
"""

from __future__ import annotations

from pathlib import Path

from eagle3.core.params import check_against_target
from eagle3.core.resolved_dtypes import pinned
from eagle3.core.stage_commit import staged_outputs
from eagle3.core.stageio import metrics_path, write_json
from eagle3.core.tracking import pipeline_run
from eagle3.verifier.load import load_target, load_target_config
from eagle3.verifier.patch_check import run_patch_check
from stages.common import console, reported_failures, validated_params

OUT = Path("artifacts/patch-check")


def main() -> None:
    params = validated_params()
    # staged_outputs: all outputs replaced together at the end, none when the stage fails (issue 44)
    with reported_failures("patch-check"), staged_outputs("patch-check") as staged:
        if params.extract.backend == "sglang":
            # imported here: the hf path needs none of the HTTP client
            from eagle3.sglang.patch_check import sglang_patch_check

            report = sglang_patch_check(params)
        else:
            config = load_target_config(params.target).get_text_config()  # Kimi-K2.5 nests it
            aux_layers = check_against_target(params, config.num_hidden_layers, config.vocab_size)
            report = run_patch_check(load_target(pinned(params, "prefill").target), aux_layers)
        write_json(staged.path(OUT / "report.json"), report)
        fp = report["fingerprint"]
        metrics = {
            "patch_check_passed": True,
            "num_layers": fp["num_layers"],
            "hidden_size": fp["hidden_size"],
        }
        write_json(staged.path(metrics_path("patch-check")), metrics)
        with pipeline_run(params, "patch-check") as run:
            run.log_metrics(metrics)
    console.print(f"patch-check passed: aux layers {fp['aux_layers']}, {fp['engine']} {fp['engine_version']}")


if __name__ == "__main__":
    main()
