"""Stage speculative-eval: the trained drafter drives real speculative decoding of the target;
plain greedy and prompt-lookup decoding run interleaved in the same process for comparison
(hf backend, eagle3/decoding/), or SGLang's own servers decode (eagle3/sglang/evaluate.py)."""

from __future__ import annotations

from pathlib import Path

from rich.progress import Progress

from eagle3.core.params import Params
from eagle3.core.resolved_dtypes import pinned
from eagle3.core.stageio import write_json, write_metrics
from eagle3.core.tracking import pipeline_run
from eagle3.decoding.evaluate import eval_coverage, run_comparison, summarize, summarize_spread, unexplained
from eagle3.decoding.prompts import Prompt, load_prompts
from eagle3.decoding.report import category_table, headline, interval_line, write_acceptance_plot
from eagle3.decoding.setup import DecodingSetup, engine_settings, eval_drafter
from eagle3.sglang.evaluate import evaluate_on_sglang, summary_line
from stages.common import console, reported_failures, validated_params

OUT = Path("artifacts/speculative-eval")
PLOT_CSV, PLOT_PNG = Path("plots/acceptance.csv"), Path("plots/acceptance.png")


def main() -> None:
    params = validated_params()
    ev = params.eval
    with reported_failures("speculative-eval"):
        # Everything checkable without the model first: bad input fails in milliseconds.
        prompts = load_prompts(ev.prompts_file, ev.num_prompts, ev.categories)
        drafter_dir = eval_drafter(params)  # refuses eval.k past the drafter's trained TTT length
        if ev.backend == "sglang":  # SGLang's own speculative decoding, same outputs
            return evaluate_sglang(params, prompts, drafter_dir)
        # one dtype for all three decoders, the fastest for plain one-token decoding here, as the
        # dtypes stage recorded it
        setup = DecodingSetup.for_eval(pinned(params, "decode"), drafter_dir)
        engine = setup.engine(**engine_settings(ev))
        greedy = ev.temperature == 0
        with Progress(console=console, transient=True) as progress:
            task = progress.add_task("speculative-eval", total=len(prompts))
            run = run_comparison(
                engine,
                setup.render(prompts),
                ev.max_new_tokens,
                setup.eos,
                prompt_lookup_tokens=ev.prompt_lookup_tokens if ev.prompt_lookup else None,
                check=greedy,
                on_prompt=lambda _: progress.advance(task),
            )
        categories = [p.category for p in prompts]
        depth = engine.max_depth  # acceptance_rate's denominator: the lookup branch may reach past k
        metrics = summarize(run, depth, greedy) | summarize_spread(run, categories, depth, ev.seed)
        measured_on = setup.measured_on()  # speeds compare only within one machine and dtype
        metrics |= measured_on | {"eval_coverage": eval_coverage(run, setup.drafter.t2d)}
        rows = [r.as_dict() | {"category": c} for r, c in zip(run.results, categories, strict=True)]
        publish(params, metrics, rows, {f"eval.{k}": v for k, v in measured_on.items()})
        console.print(headline(metrics))
        console.print(category_table(metrics))
        console.print(interval_line(metrics))
        if greedy:
            console.print(
                f"greedy_match {metrics['greedy_match']:.2f}, {metrics['divergences']} divergence(s), "
                f"lossless: {metrics['lossless']}"
            )
        if bad := unexplained(rows):
            raise RuntimeError("speculative output is not lossless:\n  " + "\n  ".join(bad))


def evaluate_sglang(params: Params, prompts: list[Prompt], drafter_dir: Path) -> None:
    """eval.backend sglang: servers started (or given), decoded, measured by
    eagle3/sglang/evaluate.py; written as the hf backend writes its results."""
    with Progress(console=console, transient=True) as progress:
        task = progress.add_task("speculative-eval (SGLang)", total=len(prompts))
        result = evaluate_on_sglang(params, prompts, drafter_dir, lambda _: progress.advance(task))
    metrics = result.metrics
    publish(params, metrics, result.rows, result.tags | {"eval.dtype": metrics["dtype"]})
    console.print(summary_line(metrics))
    console.print(category_table(metrics))
    console.print(interval_line(metrics))
    if bad := unexplained(result.rows, "plain", "EAGLE-3"):
        raise RuntimeError("SGLang's speculative output is not lossless:\n  " + "\n  ".join(bad))


def publish(params: Params, metrics: dict, rows: list[dict], tags: dict[str, str]) -> None:
    """Results, plot and metrics (both backends write the same files), then the MLflow run."""
    write_json(OUT / "results.json", {"prompts": rows})
    write_acceptance_plot(metrics["per_position_acceptance"], PLOT_CSV, PLOT_PNG)
    write_metrics("speculative-eval", metrics)
    with pipeline_run(params, "speculative-eval") as mlrun:
        mlrun.log_metrics(metrics)
        mlrun.set_tags(tags)
        mlrun.log_artifact(PLOT_PNG, "plots")
        mlrun.log_artifact(OUT / "results.json", "speculative-eval")


if __name__ == "__main__":
    main()
