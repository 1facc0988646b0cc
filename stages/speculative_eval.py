"""Stage speculative-eval: the trained drafter drives real speculative decoding of the target;
plain greedy and prompt-lookup decoding run interleaved in the same process for comparison."""

from __future__ import annotations

from pathlib import Path

from rich.progress import Progress

from eagle3.core.device import Shape, machine, resolve_dtype
from eagle3.core.inputs import InputError
from eagle3.core.packed import pack_linears
from eagle3.core.resolved_dtypes import pinned
from eagle3.core.stageio import write_json, write_metrics
from eagle3.core.tracking import pipeline_run
from eagle3.decoding.engine import SpecEngine
from eagle3.decoding.evaluate import run_comparison, summarize, summarize_spread
from eagle3.decoding.prompts import load_prompts
from eagle3.decoding.report import category_table, interval_line, write_acceptance_plot
from eagle3.drafter.export import load_drafter, load_drafter_config, trained_ttt_length
from eagle3.sglang.evaluate import evaluate_on_sglang, summary_line, unexplained
from eagle3.verifier.load import eos_token_ids, has_chat_template, load_target
from eagle3.verifier.render import render_prompt, user_turn
from eagle3.vocab import coverage_of
from stages.common import console, reported_failures, validated_params

DRAFTER = Path("artifacts/train/drafter")
OUT = Path("artifacts/speculative-eval")
PLOT_CSV, PLOT_PNG = Path("plots/acceptance.csv"), Path("plots/acceptance.png")


def main() -> None:
    params = validated_params()
    ev = params.eval
    with reported_failures("speculative-eval"):
        # Everything checkable without the model first: bad input fails in milliseconds.
        prompts = load_prompts(ev.prompts_file, ev.num_prompts, ev.categories)
        drafter_dir = Path(ev.drafter) if ev.drafter else DRAFTER
        if not (drafter_dir / "config.json").exists():
            hint = "eval.drafter names no exported drafter" if ev.drafter else "run the train stage first"
            raise FileNotFoundError(f"{drafter_dir} holds no exported drafter: {hint}")
        if ev.backend == "sglang":  # SGLang's own speculative decoding, same outputs
            return evaluate_sglang(params, prompts, drafter_dir)
        drafter_cfg = load_drafter_config(drafter_dir)

        # one dtype for all three decoders, the fastest for plain one-token decoding here, as the
        # dtypes stage recorded it
        dtypes = pinned(params, "decode").eval
        target = load_target(params.target.model_copy(update={"dtype": dtypes.dtype}), job="decode")
        if why := drafter_cfg.mismatch(target.vocab_size, target.num_layers):
            raise InputError(f"{drafter_dir} was {why}")
        embed = target.model.get_input_embeddings().weight
        drafter_dtype = resolve_dtype(dtypes.drafter_dtype or dtypes.dtype, "decode", Shape.of(target.config))
        drafter = load_drafter(drafter_dir, embed, dtype=drafter_dtype, target_config=target.config)
        if ev.pack_weights:  # the same packed target serves the baseline, the engine and the peer
            pack_linears(target.model)
            pack_linears(drafter)
        engine = SpecEngine.for_target(
            target,
            drafter,
            mode=ev.mode,
            k=ev.k,
            topk=ev.topk,
            tree_budget=ev.tree_budget,
            lookup_tokens=ev.lookup_tokens,
            temperature=ev.temperature,
            seed=ev.seed,
        )
        ttt_length = trained_ttt_length(drafter_dir, params.train.ttt_length)
        if ev.k > ttt_length:
            console.print(
                f"[yellow]warning:[/] eval.k={ev.k} > the drafter's train.ttt_length={ttt_length}: draft "
                f"positions {ttt_length + 1}..{ev.k} come from unroll steps never trained"
            )
        chat = has_chat_template(params.target.source)
        # rendered as extract renders a training prompt (eagle3/verifier/render.py)
        batch = [(p.id, render_prompt(target.tokenizer, user_turn(p.text), chat).tolist()) for p in prompts]
        eos = eos_token_ids(target.model, target.tokenizer)
        greedy = ev.temperature == 0

        with Progress(console=console, transient=True) as progress:
            task = progress.add_task("speculative-eval", total=len(batch))
            run = run_comparison(
                engine,
                batch,
                ev.max_new_tokens,
                eos,
                prompt_lookup_tokens=ev.prompt_lookup_tokens if ev.prompt_lookup else None,
                check=greedy,
                on_prompt=lambda _: progress.advance(task),
            )
        categories = [p.category for p in prompts]
        depth = engine.max_depth  # acceptance_rate's denominator: the lookup branch may reach past k
        metrics = summarize(run, depth, greedy) | summarize_spread(run, categories, depth, ev.seed)
        # speeds compare only within one machine and dtype: say which with every figure
        measured_on = {
            "dtype": str(target.model.dtype).removeprefix("torch."),
            "drafter_dtype": str(drafter_dtype).removeprefix("torch."),
            "machine": machine(),
        }
        metrics |= measured_on
        # coverage out of sample: of the target's own answers to the benchmark, how many tokens
        # the draft vocabulary holds (vocab-map's coverage is over the training tokens it counted)
        answers = [t for r in run.results for t in r.baseline.tokens]
        metrics["eval_coverage"] = round(coverage_of(answers, drafter.t2d), 6)
        rows = [r.as_dict() | {"category": c} for r, c in zip(run.results, categories, strict=True)]
        write_json(OUT / "results.json", {"prompts": rows})
        write_acceptance_plot(metrics["per_position_acceptance"], PLOT_CSV, PLOT_PNG)
        write_metrics("speculative-eval", metrics)
        with pipeline_run(params, "speculative-eval") as mlrun:
            mlrun.log_metrics(metrics)
            mlrun.set_tags({f"eval.{k}": v for k, v in measured_on.items()})
            mlrun.log_artifact(PLOT_PNG, "plots")
            mlrun.log_artifact(OUT / "results.json", "speculative-eval")

        console.print(
            f"acceptance length {metrics['acceptance_length']:.2f}, {metrics['tokens_per_s']:.1f} tok/s vs "
            f"{metrics['baseline_tokens_per_s']:.1f} plain: speedup {metrics['speedup']:.2f}x"
            + (f" (prompt lookup {metrics['prompt_lookup_speedup']:.2f}x)" if ev.prompt_lookup else "")
        )
        console.print(category_table(metrics))
        console.print(interval_line(metrics))
        if greedy:
            console.print(
                f"greedy_match {metrics['greedy_match']:.2f}, {metrics['divergences']} divergence(s), "
                f"lossless: {metrics['lossless']}"
            )
            bad = [r for r in run.results if r.divergence is not None and not r.divergence.explained]
            if bad:
                lines = [
                    f"prompt {r.id}: token {r.divergence.index}: baseline {r.divergence.baseline_token} vs "
                    f"speculative {r.divergence.spec_token}, logit gap {r.divergence.gap:.4g} > rounding "
                    f"tolerance {r.divergence.tolerance:.4g}"
                    for r in bad
                ]
                raise RuntimeError("speculative output is not lossless:\n  " + "\n  ".join(lines))


def evaluate_sglang(params, prompts, drafter_dir: Path) -> None:
    """eval.backend sglang: servers started (or given), decoded, measured by
    eagle3/sglang/evaluate.py; written as the hf backend writes its results."""
    with Progress(console=console, transient=True) as progress:
        task = progress.add_task("speculative-eval (SGLang)", total=len(prompts))
        result = evaluate_on_sglang(params, prompts, drafter_dir, lambda _: progress.advance(task))
    metrics = result.metrics
    write_json(OUT / "results.json", {"prompts": result.rows})
    write_acceptance_plot(metrics["per_position_acceptance"], PLOT_CSV, PLOT_PNG)
    write_metrics("speculative-eval", metrics)
    with pipeline_run(params, "speculative-eval") as mlrun:
        mlrun.log_metrics(metrics)
        mlrun.set_tags(result.tags | {"eval.dtype": metrics["dtype"]})
        mlrun.log_artifact(PLOT_PNG, "plots")
        mlrun.log_artifact(OUT / "results.json", "speculative-eval")
    console.print(summary_line(metrics))
    console.print(category_table(metrics))
    console.print(interval_line(metrics))
    if not metrics["lossless"]:
        lines = "\n  ".join(unexplained(result.rows))
        raise RuntimeError(f"SGLang's speculative output is not lossless:\n  {lines}")


if __name__ == "__main__":
    main()
