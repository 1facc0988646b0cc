"""Stage speculative-eval: the trained drafter drives real speculative decoding of the target;
plain greedy and prompt-lookup decoding run interleaved in the same process for comparison
(hf backend, eagle3/decoding/hf_eval.py), or SGLang's own servers decode (eagle3/sglang/evaluate.py).
Both backends write the same files."""

from __future__ import annotations

from rich.progress import Progress

from eagle3.backends import backend_for
from eagle3.core.params import Params
from eagle3.core.pipeline import ACCEPTANCE_CSV, ACCEPTANCE_PNG, DOMAINS_METRICS, EVAL_RESULTS, metrics_path
from eagle3.core.stage_commit import StagedOutputs, staged_outputs
from eagle3.core.stageio import write_json
from eagle3.core.tracking import pipeline_run
from eagle3.decoding.domains import load_domains, token_counter
from eagle3.decoding.evaluate import EvalOutcome, headline_by_domain, unexplained
from eagle3.decoding.report import write_acceptance_plot
from eagle3.decoding.setup import drafter_depth, eval_drafter
from eagle3.drafter.dflash_export import check_drafter_kind
from stages.common import console, reported_failures, validated_params


def main() -> None:
    params = validated_params()
    ev = params.eval
    # staged_outputs: all outputs replaced together at the end, none when the stage fails
    with reported_failures("speculative-eval"), staged_outputs("speculative-eval") as staged:
        # Everything checkable without the model first: bad input fails in milliseconds.
        counter = token_counter(params.target) if "long" in ev.domains else None
        prompts = load_domains(ev, params.data, counter)
        drafter_dir = eval_drafter(params)
        # the family drafter.kind names
        check_drafter_kind(drafter_dir, params.drafter.kind, "eval.drafter" if ev.drafter else None)
        untrained, warning = 0, None  # a DFlash drafter drafts the block it was trained for
        if params.drafter.kind == "eagle3":  # deeper than trained: served, noted
            untrained, warning = drafter_depth(params, drafter_dir)
        if warning:
            console.print(f"[yellow]{warning}[/yellow]")
        evaluate = backend_for(ev.backend).evaluate
        with Progress(console=console, transient=True) as progress:
            task = progress.add_task(f"speculative-eval ({ev.backend})", total=len(prompts))
            outcome = evaluate(params, prompts, drafter_dir, lambda _: progress.advance(task))
        outcome.metrics["untrained_steps"] = untrained
        publish(params, outcome, staged)
        for line in outcome.report:
            console.print(line)
        if bad := unexplained(outcome.rows, *outcome.compared):
            raise RuntimeError(f"{outcome.engine} output is not lossless:\n  " + "\n  ".join(bad))


def publish(params: Params, outcome: EvalOutcome, staged: StagedOutputs) -> None:
    """Results, plot and metrics (staged: in place once the stage succeeds), then the MLflow run
    (which keeps them for a run refused as not lossless)."""
    results, png = staged.path(EVAL_RESULTS / "results.json"), staged.path(ACCEPTANCE_PNG)
    write_json(results, {"prompts": outcome.rows})
    write_acceptance_plot(outcome.metrics["per_position_acceptance"], staged.path(ACCEPTANCE_CSV), png)
    write_json(staged.path(metrics_path("speculative-eval")), outcome.metrics)
    write_json(staged.path(DOMAINS_METRICS), headline_by_domain(outcome.metrics))
    with pipeline_run(params, "speculative-eval") as mlrun:
        mlrun.log_metrics(outcome.metrics)
        mlrun.set_tags(outcome.tags)
        mlrun.log_artifact(png, "plots")
        mlrun.log_artifact(results, "speculative-eval")


if __name__ == "__main__":
    main()
