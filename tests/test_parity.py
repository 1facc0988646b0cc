"""Per-position parity (eagle3/decoding/parity.py): the train stage's simulation, run on each
eval prompt's own text, must accept exactly what the decoder's drafter accepted, step by step,
where both do the same computation; a decoder that accepts what the target did not choose is
flagged as a gap. Tiny real target and drafters (tests/test_decoding_fixtures.py), float64."""

from __future__ import annotations

import copy

import pytest
import torch
from test_decoding_engine import WrongChainRule
from test_decoding_fixtures import EOS, engine, fitted_pair, prompts

from eagle3.decoding.evaluate import per_domain, per_position_acceptance, run_comparison
from eagle3.decoding.parity import (
    TextSimulator,
    measured_intervals,
    prompt_steps,
    simulated_parity,
    simulated_shape,
    visited_starts,
)
from eagle3.train.simulate import position_shares

pytestmark = pytest.mark.usefixtures("one_thread")

SETTINGS = {
    "chain 1": dict(mode="chain", k=1),
    "chain 3": dict(mode="chain", k=3),  # the TTT unroll's chains: deeper than simulate.py's trees
    "tree 1/4/4 + lookup": dict(mode="tree", k=1, topk=4, tree_budget=4, lookup_tokens=4),
    "tree 2/3/5 + lookup": dict(mode="tree", k=2, topk=3, tree_budget=5, lookup_tokens=4),
}
DOMAINS = ["chat", "chat", "code", "code"]
NEW_TOKENS = 64


def eval_prompts() -> list[tuple[str, list[int]]]:
    """Two prompts the drafter was fitted on (it accepts for ~40 tokens, then misses) and two
    that repeat their start, where the prompt-lookup branch accepts what the drafter misses."""
    fitted = [(f"fitted-{i}", p) for i, p in enumerate(prompts(8)[:2])]
    repeated = [(f"repeated-{i}", p + p[:6]) for i, p in enumerate(prompts(2, seed=1))]
    return fitted + repeated


@pytest.mark.parametrize("setting", list(SETTINGS))
def test_simulation_accepts_what_the_drafter_accepted_at_every_step(setting):
    target, drafter = fitted_pair()
    spec = engine(target, drafter, **SETTINGS[setting])
    batch = eval_prompts()
    run = run_comparison(spec, batch, NEW_TOKENS, EOS)
    shape, name = simulated_shape(spec)
    assert name == setting.removesuffix(" + lookup")
    simulator = TextSimulator(spec, shape)
    every_differs = False
    for (_, ids), result in zip(batch, run.results, strict=True):
        steps = prompt_steps(
            simulator, ids, result.spec.tokens, result.spec.accepted, result.spec.drafter_accepted
        )
        # at decoding's own steps the train stage's code accepts what the drafter did, step by step
        assert steps.simulated == result.spec.drafter_accepted, result.id
        assert 0 < sum(steps.simulated) < len(steps.simulated) * shape.depth  # hits and misses
        every_differs |= len(steps.simulated_all) != len(steps.simulated)
    assert every_differs  # the train stage counts other positions than decoding visits
    if "lookup" in setting:  # like with like: the lookup branch's tokens are not the drafter's
        assert any(r.spec.accepted != r.spec.drafter_accepted for r in run.results)

    measured = per_domain(run, DOMAINS, spec.max_depth, seed=0)
    metrics = {"per_domain": copy.deepcopy(measured)}
    parity = simulated_parity(spec, [ids for _, ids in batch], run, DOMAINS, seed=0)
    parity.into(metrics)
    assert metrics["parity_shape"] == name and metrics["parity_gaps"] == []
    for domain in ("chat", "code"):
        figures = metrics["per_domain"][domain].pop("parity")
        assert list(figures) == ["acceptance_length"] + [str(k) for k in range(1, shape.depth + 1)]
        for key, row in figures.items():
            assert row["simulated"] == row["measured"], (domain, key)
            ci = row["measured_ci"]  # None where no step of the domain reached that position
            assert ci is None or ci["lo"] <= row["measured"] <= ci["hi"]
            assert row.get("gap", False) is False
    # nothing the eval reported before changed: the parity figures are new keys beside them
    assert metrics["per_domain"] == measured == per_domain(run, DOMAINS, spec.max_depth, seed=0)


def test_a_decoder_that_accepts_what_the_target_did_not_choose_is_a_gap():
    """A planted verification bug (one rejected draft token accepted anyway): the decoder claims
    acceptances that the simulation on its own output does not find."""
    target, drafter = fitted_pair()
    buggy = WrongChainRule(target, drafter, target.model.layers, target.model.norm, mode="chain", k=2)
    batch = eval_prompts()
    run = run_comparison(buggy, batch, NEW_TOKENS, EOS, check=False)
    parity = simulated_parity(buggy, [ids for _, ids in batch], run, DOMAINS, seed=0)
    metrics = {"per_domain": per_domain(run, DOMAINS, buggy.max_depth, seed=0)}
    parity.into(metrics)
    flagged = {(g["domain"], g["position"]) for g in metrics["parity_gaps"]}
    assert ("code", 1) in flagged
    code = metrics["per_domain"]["code"]["parity"]["1"]
    assert code["gap"] is True and code["measured"] == 1.0 > code["simulated"]
    lines = [str(line) for line in parity.report[1:]]
    assert len(lines) == len(flagged)
    assert any(line.startswith("warning: parity gap: code draft position 1: simulated") for line in lines)


def test_steps_start_where_the_decoder_stood_and_intervals_are_over_prompts():
    # prompt of 5 tokens (0..4); the prefill's token sits at 5, so the first step starts at 4;
    # accepting 2 drafts + the bonus moves the newest token 3 on
    assert visited_starts(5, [2, 0, 1]) == [4, 7, 8]
    one = measured_intervals([[2, 0, 1, 1]], depth=2, seed=0)
    assert one["1"] == {"lo": 0.75, "hi": 0.75} and one["2"] == {"lo": 1 / 3, "hi": 1 / 3}
    assert one["acceptance_length"] == {"lo": 2.0, "hi": 2.0}
    two = measured_intervals([[2, 2], [0, 0, 0]], depth=2, seed=0)
    assert two["1"]["lo"] == 0.0 and two["1"]["hi"] == 1.0  # either prompt alone, resampled
    steps = torch.tensor([2, 0, 1, 1], dtype=torch.float64)
    assert position_shares(steps, 2) == {"1": 0.75, "2": pytest.approx(1 / 3)}


def test_shapes_the_simulation_does_not_cover_are_said_not_faked():
    target, drafter = fitted_pair()
    for settings, why in (
        (
            dict(mode="tree", k=3, topk=2, tree_budget=6),
            "tree 3/2/6: the simulation drafts trees up to depth 2",
        ),
        (dict(mode="chain", k=2, temperature=0.7), "eval.temperature 0.7: the simulation is of greedy"),
    ):
        spec = engine(target, drafter, **settings)
        assert simulated_shape(spec)[0] is None
        run = run_comparison(spec, eval_prompts()[:1], 8, EOS, check=False)
        parity = simulated_parity(spec, [eval_prompts()[0][1]], run, ["chat"], seed=0)
        metrics = {"per_domain": per_domain(run, ["chat"], spec.max_depth, seed=0)}
        parity.into(metrics)
        assert "parity_shape" not in metrics and "parity" not in metrics["per_domain"]["chat"]
        assert why in parity.report[0]


def test_position_shares_is_the_evals_per_position_acceptance():
    target, drafter = fitted_pair()
    spec = engine(target, drafter, mode="chain", k=3)
    run = run_comparison(spec, eval_prompts()[:2], 32, EOS)
    steps = torch.tensor([a for r in run.results for a in r.spec.accepted])
    assert per_position_acceptance(run.results, 3) == position_shares(steps, 3)
