"""Stage patch-check: prove capture is non-invasive and reads the right layers; fingerprint the target."""

from __future__ import annotations

from pathlib import Path

from eagle3.params import check_against_target
from eagle3.stageio import write_json, write_metrics
from eagle3.target.load import load_target, load_target_config
from eagle3.target.patch_check import run_patch_check
from eagle3.tracking import pipeline_run
from stages.common import console, reported_failures, validated_params

OUT = Path("artifacts/patch-check")


def main() -> None:
    params = validated_params()
    with reported_failures("patch-check"):
        if params.extract.backend != "hf":
            raise ValueError(
                f"extract.backend: '{params.extract.backend}' is checked on an SGLang server "
                "(`eagle3[sglang]`, GPU); this stage runs the 'hf' backend (allowed here: hf)"
            )
        config = load_target_config(params.target)
        aux_layers = check_against_target(params, config.num_hidden_layers, config.vocab_size)
        target = load_target(params.target)
        report = run_patch_check(target, aux_layers)
        write_json(OUT / "report.json", report)
        fp = report["fingerprint"]
        metrics = {
            "patch_check_passed": True,
            "num_layers": fp["num_layers"],
            "hidden_size": fp["hidden_size"],
        }
        write_metrics("patch-check", metrics)
        with pipeline_run(params, "patch-check") as run:
            run.log_metrics(metrics)
    console.print(f"patch-check passed: aux layers {aux_layers}, {fp['engine']} {fp['engine_version']}")


if __name__ == "__main__":
    main()
