"""Per-position parity: the train stage's simulated acceptance, run on each eval prompt's own
text, set beside what decoding measured there, per domain.

The train stage simulates acceptance on held-out training text (eagle3/train/simulate.py for
trees up to depth 2, the TTT unroll's chains for chains), which differs from decoding in the
text (held-out ShareGPT, not the eval's domains), the teacher's path (the data's next token, not
the target's) and the positions counted (every one whose target token the draft vocabulary
holds, where decoding visits only those after each accepted run, and misses the others). Here
that same code runs on each prompt followed by the answer the speculative decoder produced (the
target's greedy answer: greedy decoding is lossless), the target's aux states captured over that
text in one forward, so text and teacher are decoding's own. Per draft position:
- `simulated`: at the steps decoding took, each miss counted: equal to `measured` by
  construction, up to rounding (one full forward against incremental ones). A gap is a
  difference between the computation training does and the one serving does: a dtype, the
  capture, the drafter's inputs, a decoding bug;
- `simulated_all`: the train stage's count (every answer position whose target token the draft
  vocabulary holds); its distance from `simulated` is what that counting adds;
- `measured`: the drafter's own share (`drafter_accepted`: a prompt-lookup branch's tokens left
  out, since the simulation has none), with a bootstrap interval over the domain's prompts.
Greedy decoding only; chains of any depth, trees of depth <= 2. Per prompt it costs one target
forward and one drafter pass, after the timed decoding.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch
from rich.table import Table
from rich.text import Text
from torch import Tensor

from eagle3.decoding.engine import SpecEngine
from eagle3.decoding.evaluate import EvalRun
from eagle3.decoding.stats import percentile_interval, resample_index
from eagle3.target.capture import capture_hidden_states
from eagle3.train.data import Batch
from eagle3.train.simulate import DraftShape, accepted_lengths, position_shares
from eagle3.train.ttt import LossConfig, TTTModel, acceptance_length, step_valid

TREE_DEPTH = 2  # the deepest tree simulate.py drafts


def simulated_shape(engine: SpecEngine) -> tuple[DraftShape | None, str]:
    """(the engine's draft shape, its name), or (None, why the simulation does not cover it)."""
    if not isinstance(engine, SpecEngine):  # a DFlash block engine: its training has no TTT simulation
        return None, f"a {type(engine).__name__}: the simulation is of EAGLE-3 drafters"
    if engine.sampling:
        return None, f"eval.temperature {engine.temperature}: the simulation is of greedy decoding"
    if engine.mode == "chain":
        shape = DraftShape(engine.k, 1, engine.k)
    else:
        shape = DraftShape(engine.k, engine.topk, engine.budget)
        if engine.k > TREE_DEPTH:
            return None, f"{shape.name}: the simulation drafts trees up to depth {TREE_DEPTH}"
    return shape, shape.name


class TextSimulator:
    """The train stage's simulation of one draft shape, on texts the engine's target reads."""

    def __init__(self, engine: SpecEngine, shape: DraftShape):
        self.engine, self.shape = engine, shape
        self.chain = shape.topk == 1  # the TTT unroll's chains: any depth
        head_rows = engine.target.head.weight[engine.draft_to_target]  # the K draft rows
        self.model = TTTModel(
            engine.drafter, head_rows.detach(), LossConfig(ttt_length=shape.depth, decay=1.0)
        )

    @torch.no_grad()
    def batch(self, ids: Sequence[int], answer_start: int) -> Batch:
        """One row: `ids` (prompt, then answer from `answer_start`) with the target's aux and final
        states captured in one forward, as extraction captures them, left in the target's dtype
        (the engine's drafter reads them unrounded); the answer is the loss mask."""
        engine, t = self.engine, len(ids)
        input_ids = torch.tensor([list(ids)])
        with capture_hidden_states(engine.layers, engine.norm, engine.aux_layers) as captured:
            engine.target.decoder(input_ids=input_ids, use_cache=False)
        aux, last = captured.aux_hidden(), captured.last
        answer = torch.zeros(1, t, dtype=torch.bool)
        answer[0, answer_start:] = True
        # is the target's full-vocabulary argmax (what decoding must draft) in the draft vocab
        in_draft = torch.zeros(1, t, dtype=torch.bool)
        best = engine.target.logits(last[0, answer_start:]).argmax(-1)
        in_draft[0, answer_start:] = engine.drafter.t2d[best]
        return Batch(
            input_ids=input_ids,
            loss_mask=answer,
            in_draft=in_draft,
            real=torch.ones(1, t, dtype=torch.bool),
            position_ids=torch.arange(t)[None],
            aux_hidden=aux,
            last_hidden=last,
        )

    @torch.no_grad()
    def accepted(self, batch: Batch) -> tuple[Tensor, Tensor]:
        """(draft tokens accepted [T] from each start position t, the newest token at t + 1;
        the positions the train stage counts [T] bool). A position it does not count is a miss."""
        if self.chain:
            _, _, hits = self.model(batch, chains=True)
            lengths = acceptance_length(hits)
        else:
            lengths = accepted_lengths(self.model, batch, (self.shape,))[self.shape.name]
        counted = step_valid(batch, 0)[0]  # the start positions both simulations report, in order
        out = torch.zeros(counted.shape[0], dtype=torch.long)
        out[counted] = lengths.long().cpu() - 1
        return out, counted


def visited_starts(prompt_len: int, accepted: Sequence[int]) -> list[int]:
    """The start position of each decoding step (its newest token's position - 1, the drafter's
    last pending pair), from the accepted draft tokens of every step."""
    starts, newest = [], prompt_len
    for a in accepted:
        starts.append(newest - 1)
        newest += a + 1
    return starts


@dataclass
class PromptSteps:
    """One prompt's accepted draft tokens per step: simulated at decoding's steps, measured
    (the drafter's own), and simulated at every position the train stage counts."""

    simulated: list[int]
    measured: list[int]
    simulated_all: list[int]


def prompt_steps(
    sim: TextSimulator,
    prompt_ids: Sequence[int],
    spec_tokens: Sequence[int],
    accepted: Sequence[int],
    drafter_accepted: Sequence[int],
) -> PromptSteps:
    """The simulation on this prompt and the speculative decoder's answer, at its steps."""
    per_start, counted = sim.accepted(sim.batch(list(prompt_ids) + list(spec_tokens), len(prompt_ids)))
    visited = per_start[visited_starts(len(prompt_ids), accepted)]
    return PromptSteps(visited.tolist(), list(drafter_accepted), per_start[counted].tolist())


def _length(accepted: list[int]) -> float:
    return 1 + sum(accepted) / len(accepted) if accepted else 0.0


def measured_intervals(prompts: Sequence[list[int]], depth: int, seed: int) -> dict[str, dict | None]:
    """{"acceptance_length" | position: 95% bootstrap interval over prompts} of measured steps
    (`prompts`: each prompt's accepted draft tokens per step), resampled as the eval's other
    intervals are (resample_index with the eval seed: the same draws)."""
    counts = np.zeros((len(prompts), depth + 1, 2))  # per prompt: [steps, accepted] and per position
    for i, steps in enumerate(prompts):
        a = np.asarray(steps)
        counts[i, 0] = len(a), a.sum()
        for pos in range(1, depth + 1):
            counts[i, pos] = (a >= pos - 1).sum(), (a >= pos).sum()
    sums = counts[resample_index(len(prompts), seed)].sum(axis=1)  # [resamples, depth + 1, 2]
    with np.errstate(divide="ignore", invalid="ignore"):
        out = {"acceptance_length": percentile_interval(1 + sums[:, 0, 1] / sums[:, 0, 0])}
        for pos in range(1, depth + 1):
            out[str(pos)] = percentile_interval(sums[:, pos, 1] / sums[:, pos, 0])
    return out


def outside(value: float, ci: dict | None) -> bool:
    """The value lies outside the interval (rounding aside: equal ratios of equal counts agree)."""
    return ci is not None and not ci["lo"] - 1e-9 <= value <= ci["hi"] + 1e-9


def domain_parity(prompts: Sequence[PromptSteps], depth: int, seed: int) -> dict[str, dict]:
    """{"acceptance_length" | position: {simulated, simulated_all, measured, measured_ci[, gap]}}."""
    sim = [a for p in prompts for a in p.simulated]
    every = [a for p in prompts for a in p.simulated_all]
    measured = [a for p in prompts for a in p.measured]
    ci = measured_intervals([p.measured for p in prompts], depth, seed)
    out = {
        "acceptance_length": {
            "simulated": _length(sim),
            "simulated_all": _length(every),
            "measured": _length(measured),
            "measured_ci": ci["acceptance_length"],
        }
    }
    shares = [position_shares(torch.tensor(x), depth) for x in (sim, every, measured)]
    for pos in shares[0]:
        simulated, measured_share = shares[0][pos], shares[2][pos]
        out[pos] = {
            "simulated": simulated,
            "simulated_all": shares[1][pos],
            "measured": measured_share,
            "measured_ci": ci[pos],
            "gap": outside(simulated, ci[pos]),
        }
    return out


@dataclass
class Parity:
    """The parity figures of one eval run: per domain, the gaps, the shape, what to print."""

    shape: str | None = None
    per_domain: dict[str, dict] = field(default_factory=dict)
    gaps: list[dict] = field(default_factory=list)
    report: list = field(default_factory=list)

    def into(self, metrics: dict) -> None:
        """Into the eval's metrics: `per_domain.<d>.parity`, `parity_shape`, `parity_gaps`."""
        if self.shape is None:
            return
        for domain, figures in self.per_domain.items():
            metrics["per_domain"][domain]["parity"] = figures
        metrics["parity_shape"] = self.shape
        metrics["parity_gaps"] = self.gaps


def simulated_parity(
    engine: SpecEngine, prompt_ids: Sequence[Sequence[int]], run: EvalRun, domains: Sequence[str], seed: int
) -> Parity:
    """The train stage's simulation on every prompt's text (`prompt_ids` aligned with the run's
    results, `domains` too) beside the measured figures, per domain; gaps flagged."""
    shape, name = simulated_shape(engine)
    if shape is None:
        return Parity(report=[f"parity with the train stage's simulation: not simulated ({name})"])
    sim = TextSimulator(engine, shape)
    steps: dict[str, list[PromptSteps]] = {}
    for ids, result, domain in zip(prompt_ids, run.results, domains, strict=True):
        spec = result.spec
        steps.setdefault(domain, []).append(
            prompt_steps(sim, ids, spec.tokens, spec.accepted, spec.drafter_accepted)
        )
    parity = Parity(name, {d: domain_parity(p, shape.depth, seed) for d, p in steps.items()})
    for domain, figures in parity.per_domain.items():
        for pos, row in figures.items():
            if row.get("gap"):
                parity.gaps.append(
                    {"domain": domain, "position": int(pos)}
                    | {k: row[k] for k in ("simulated", "measured", "measured_ci")}
                )
    parity.report = [parity_table(parity)] + [gap_line(g) for g in parity.gaps]
    return parity


def gap_line(gap: dict) -> Text:
    ci = gap["measured_ci"]
    return Text(
        f"warning: parity gap: {gap['domain']} draft position {gap['position']}: simulated "
        f"{gap['simulated']:.3f} lies outside the measured interval [{ci['lo']:.3f}, {ci['hi']:.3f}] "
        f"(measured {gap['measured']:.3f}; docs/drafters.md says how to read it)",
        style="yellow",
    )


def parity_table(parity: Parity) -> Table:
    """Per domain and draft position: simulated (decoding's steps, every position) and measured."""
    table = Table(title=f"parity with the train stage's simulation ({parity.shape}, drafter tokens only)")
    for title in ("domain", "figure", "simulated", "simulated, every position", "measured", "gap"):
        table.add_column(title, justify="left" if title in ("domain", "figure") else "right")
    for domain, figures in parity.per_domain.items():
        for key, row in figures.items():
            ci = row["measured_ci"]
            table.add_row(
                domain,
                "acceptance length" if key == "acceptance_length" else f"position {key}",
                f"{row['simulated']:.3f}",
                f"{row['simulated_all']:.3f}",
                f"{row['measured']:.3f}" + (f" [{ci['lo']:.3f}, {ci['hi']:.3f}]" if ci else ""),
                "gap" if row.get("gap") else "",
            )
    return table
