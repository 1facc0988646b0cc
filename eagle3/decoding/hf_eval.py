"""eval.backend hf: our engine, plain greedy decoding and prompt lookup on the same prompts, run
interleaved in one process (one packed target serves all three), summarized as SGLang's
evaluation is (eagle3/sglang/evaluate.py), so the stage treats both alike."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from eagle3.core.params import Params
from eagle3.decoding.dflash import setup_for_eval
from eagle3.decoding.engine import greedy_decode
from eagle3.decoding.evaluate import (
    EvalOutcome,
    eval_coverage,
    per_domain,
    run_comparison,
    summarize,
    summarize_spread,
)
from eagle3.decoding.parity import simulated_parity
from eagle3.decoding.prompts import Prompt, answered
from eagle3.decoding.report import category_table, domain_table, headline, interval_line
from eagle3.decoding.setup import engine_settings
from eagle3.dtypes.resolved import pinned


def evaluate_on_hf(
    params: Params, prompts: list[Prompt], drafter_dir: Path, on_prompt: Callable[[str], None] | None = None
) -> EvalOutcome:
    ev = params.eval
    # one dtype for all three decoders, the fastest for plain one-token decoding here, as the
    # dtypes stage recorded it
    # (an EAGLE-3 or a DFlash drafter: the setup of its family, whose engine has one interface)
    setup = setup_for_eval(pinned(params, "decode"), drafter_dir)
    engine = setup.engine(**engine_settings(ev))
    model, eos = setup.target.model, setup.eos
    # second turns follow the target's own greedy answer to the first, as a chat client sends them
    prompts = answered(
        setup.target.tokenizer,
        prompts,
        setup.chat,
        lambda ids: greedy_decode(model, ids, ev.max_new_tokens, eos).tokens,
    )
    greedy = ev.temperature == 0
    rendered = setup.render(prompts)
    run = run_comparison(
        engine,
        rendered,
        ev.max_new_tokens,
        setup.eos,
        prompt_lookup_tokens=ev.prompt_lookup_tokens if ev.prompt_lookup else None,
        check=greedy,
        on_prompt=on_prompt,
    )
    categories = [p.category for p in prompts]
    depth = engine.max_depth  # acceptance_rate's denominator: the lookup branch may reach past k
    metrics = summarize(run, depth, greedy) | summarize_spread(run, categories, depth, ev.seed)
    domains = [p.domain for p in prompts]
    metrics["per_domain"] = per_domain(run, domains, depth, ev.seed)
    # the train stage's simulation on each prompt's own text, after the timed decoding
    parity = simulated_parity(engine, [ids for _, ids in rendered], run, domains, ev.seed)
    parity.into(metrics)
    measured_on = setup.measured_on()  # speeds compare only within one machine and dtype
    metrics |= measured_on | {"eval_coverage": eval_coverage(run, setup.drafter.t2d)}
    rows = [
        r.as_dict() | {"category": p.category, "domain": p.domain}
        for r, p in zip(run.results, prompts, strict=True)
    ]
    report = [headline(metrics), domain_table(metrics), category_table(metrics), interval_line(metrics)]
    report += parity.report
    if greedy:
        report.append(
            f"greedy_match {metrics['greedy_match']:.2f}, {metrics['divergences']} divergence(s), "
            f"lossless: {metrics['lossless']}"
        )
    tags = {f"eval.{k}": v for k, v in measured_on.items()}
    return EvalOutcome(metrics, rows, tags, report)
