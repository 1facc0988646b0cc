"""`eagle3 report --plan-target T --paired FILE` on rows of known numbers: each size priced on
another target (Kimi-K2.5's config) against the 32K row, the bench's paired intervals deciding
ties, and bench/drafters.py's N-drafter figures (no model: synthetic generations)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from eagle3.cli.command import main
from eagle3.core.inputs import InputError
from eagle3.core.params import Params, parse_params
from eagle3.decoding.engine import Generation
from eagle3.sweep.costs import PlanTarget, plan_columns
from eagle3.sweep.decide import verdict
from eagle3.sweep.experiments import Experiment
from eagle3.sweep.paired import Paired
from eagle3.sweep.plan import plan, read_target_config
from eagle3.sweep.render import write_report

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # bench/ is no installed package: import it as `python -m bench.x` does
from bench.drafters import report, summarize, to_json  # noqa: E402

KIMI = REPO / "tests" / "fixtures" / "kimi-k2.5"
MACHINE = "AMD EPYC, 2 cores, AVX512-BF16"
DTYPES = {"eval": "float32", "drafter": "bfloat16"}
SIZES = (16384, 32768, 65536, 262144)
# a Gemma-3-270M-shaped target (vocabulary 262,144): the rows' own target
GEMMA = {
    "hidden_size": 640, "num_hidden_layers": 18, "num_attention_heads": 4, "num_key_value_heads": 1,
    "head_dim": 256, "vocab_size": 262144, "intermediate_size": 2048, "max_position_embeddings": 32768,
    "rope_theta": 1e6,
}  # fmt: skip


def row(name: str, size: int, speedup: float, half_width: float, params: dict | None = None) -> Experiment:
    metrics = {
        "draft_vocab_size": size,
        "coverage": 1.0,
        "lm_head_params": size * 640,
        "acceptance_length": 2.8,
        "draft_ms_per_step": 5.0 * size / 32768,
        "speedup": speedup,
        "speedup_ci.lo": speedup - half_width,
        "speedup_ci.hi": speedup + half_width,
    }
    return Experiment(name, params or {"vocab.size": size}, metrics, MACHINE, DTYPES)


def gemma_rows(tmp_path: Path, sizes=SIZES) -> list[Experiment]:
    """The sweep as `dvc exp show` gives it: full params of a Gemma run, with its own drafter
    shape keys and aux layers set (which must not carry over to another target)."""
    (tmp_path / "gemma").mkdir(exist_ok=True)
    (tmp_path / "gemma" / "config.json").write_text(json.dumps(GEMMA))
    own = {
        "target.source": str(tmp_path / "gemma"),
        "train.num_attention_heads": 4,
        "train.head_dim": 256,
        "extract.aux_layers": [1, 8, 14],
    }
    return [
        row(f"gemma-{size // 1024}k", size, 1.5, 0.1, Params().flat() | own | {"vocab.size": size})
        for size in sizes
    ]


def cells(columns, e: Experiment) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for label, get in columns:
        out.setdefault(label, []).append(get(e))
    return out


def kimi_plan(size: int) -> dict:
    """`eagle3 plan --target kimi-k2.5 -S vocab.size=SIZE` on default params, computed apart."""
    return plan(parse_params({"vocab": {"size": size}}), read_target_config(str(KIMI)))


@pytest.mark.slow
def test_plan_target_prices_each_size_on_kimi_against_the_32k_row(tmp_path):
    rows = gemma_rows(tmp_path)
    target = PlanTarget.read(str(KIMI))
    assert (target.label, target.vocab_size) == ("kimi-k2.5", 163840)
    columns, note = plan_columns(rows, target)
    by_size = {e.draft_vocab_size: cells(columns, e) for e in rows}
    assert by_size[32768]["x 32K"] == ["1.00", "1.00", "1.00"]  # trainable, GFLOP, memory
    # 262,144 on Kimi's 163,840-token vocabulary is the full vocabulary
    assert by_size[262144]["kimi-k2.5 vocab (plan)"] == ["163,840"]
    full, k32 = kimi_plan(163840), kimi_plan(32768)
    # the Gemma run's own shape keys and aux layers are left out: Kimi's drafter is derived from Kimi
    assert target.cost(rows[-1])["trainable"] == full["drafter"]["params"]["trainable"]
    assert target.cost(rows[1])["trainable"] == k32["drafter"]["params"]["trainable"]
    trainable = full["drafter"]["params"]["trainable"] / k32["drafter"]["params"]["trainable"]
    flops = full["flops"]["draft_step"] / k32["flops"]["draft_step"]
    memory = (
        full["training"]["memory_gib_per_device"]["total_ddp"]
        / k32["training"]["memory_gib_per_device"]["total_ddp"]
    )
    assert by_size[262144]["x 32K"] == [f"{trainable:.2f}", f"{flops:.2f}", f"{memory:.2f}"]
    assert trainable > 1.5  # the full head is no rounding error
    assert by_size[262144]["kimi-k2.5 trainable (plan)"] == [f"{full['drafter']['params']['trainable']:,.0f}"]
    assert "divides by the 32,768 row (gemma-32k)" in note

    # no 32,768 row: the nearest (16,384 and 65,536 are as near in log2; the smaller) is the reference
    columns, note = plan_columns(gemma_rows(tmp_path, (16384, 65536, 262144)), target)
    assert "x 16K" in [label for label, _ in columns] and "no row has 32,768" in note and "16,384" in note

    write_report(rows, tmp_path / "report", target)
    markdown = (tmp_path / "report" / "report.md").read_text()
    header = next(line for line in markdown.splitlines() if line.startswith("| experiment"))
    assert "| trainable params (plan) |" in header  # the existing columns stay
    assert (
        "| kimi-k2.5 trainable (plan) | x 32K |" in header and "kimi-k2.5 train GiB/device (plan)" in header
    )
    assert "<th>kimi-k2.5 draft GFLOP/step (plan)</th>" in (tmp_path / "report" / "report.html").read_text()


def test_a_bad_plan_target_or_paired_file_is_one_line_before_experiments_are_read(
    tmp_path, monkeypatch, capsys
):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(InputError, match="neither a config.json"):
        PlanTarget.read(str(tmp_path / "none"))
    # no experiments file either: the plan target is refused first
    assert main(["report", "--json", "missing.json", "--plan-target", "no-such-target"]) == 2
    err = capsys.readouterr().err
    assert "plan target: 'no-such-target' is neither a config.json" in err and "missing.json" not in err
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "config.json").write_text('{"hidden_size": 8}')
    assert main(["report", "--json", "missing.json", "--plan-target", str(tmp_path / "bad")]) == 2
    assert "not a language model's config" in capsys.readouterr().err
    assert main(["report", "--json", "missing.json", "--paired", "nope.json"]) == 2
    assert "--paired nope.json does not exist" in capsys.readouterr().err
    (tmp_path / "other.json").write_text('{"drafters": []}')
    assert main(["report", "--json", "missing.json", "--paired", "other.json"]) == 2
    assert "not the output of `python -m bench.drafters" in capsys.readouterr().err


def paired_file(tmp_path: Path, diffs: dict[int, tuple[float, float, float]]) -> Paired:
    """A bench.drafters --json file: the 32K drafter first (the reference), the others by size."""
    drafters = [{"name": "gemma-32k", "label": "A", "reference": True, "draft_vocab_size": 32768}]
    for i, (size, (value, lo, hi)) in enumerate(diffs.items()):
        drafters.append(
            {
                "name": f"candidate-{size}",
                "label": "BCDE"[i],
                "reference": False,
                "draft_vocab_size": size,
                "speedup_minus_reference": value,
                "speedup_minus_reference_ci": {"lo": lo, "hi": hi},
            }
        )
    path = tmp_path / "paired.json"
    path.write_text(json.dumps({"machine": "bench box", "drafters": drafters}))
    return Paired.read(path)


def test_paired_intervals_decide_ties_where_they_join_two_sizes(tmp_path):
    rows = [
        row("base-16k", 16384, 1.40, 0.15),
        row("base-32k", 32768, 1.50, 0.15),
        row("base-64k", 65536, 1.30, 0.15),
        row("base-256k", 262144, 1.00, 0.05),
    ]
    # overlap alone: 16K's interval overlaps the fastest's (32K), so the smallest of the tie wins
    alone = verdict(rows)
    assert alone.best.name == "base-16k"
    assert alone.decision.startswith("Decision: a draft vocabulary of 16,384 tokens (base-16k")
    assert alone.paragraph.startswith(alone.decision) and "overlapping 95% speedup intervals" in alone.rule
    assert "No size is measurably faster" in alone.paragraph

    # the bench paired 16K against 32K on the same prompts: measurably slower, so 32K is the pick
    slower = paired_file(tmp_path, {16384: (-0.10, -0.16, -0.04), 65536: (-0.2, -0.3, -0.1)})
    decided = verdict(rows, slower)
    assert decided.best.name == "base-32k"
    assert decided.decision.startswith("Decision: a draft vocabulary of 32,768 tokens (base-32k)")
    assert "paired 95% interval of the speedup difference against gemma-32k contains 0" in decided.decision
    assert "so judged for base-16k, base-64k (bench.drafters on bench box" in decided.rule
    assert decided.rule.endswith(", by overlapping 95% speedup intervals for the rest")
    assert "Speedup peaks at a draft vocabulary of 32,768" in decided.paragraph

    # the other way: intervals apart, yet the paired difference contains 0, so the tie goes to 16K
    apart = [row("base-16k", 16384, 1.10, 0.05), *rows[1:]]
    assert verdict(apart).best.name == "base-32k"
    tied = verdict(apart, paired_file(tmp_path, {16384: (-0.40, -0.85, 0.02)}))
    assert tied.best.name == "base-16k" and "cannot be told apart from those of base-16k" in tied.paragraph

    write_report(rows, tmp_path / "report", paired=slower)
    markdown = (tmp_path / "report" / "report.md").read_text()
    assert "paired speedup vs gemma-32k [95% CI]" in markdown
    line = next(x for x in markdown.splitlines() if x.startswith("| base-16k"))
    assert line.endswith("| -0.10 [-0.16, -0.04] |")
    assert next(x for x in markdown.splitlines() if x.startswith("| base-32k")).endswith("| reference |")
    assert next(x for x in markdown.splitlines() if x.startswith("| base-256k")).endswith("| - |")
    assert "base-16k = candidate-16384" in markdown


def test_a_paired_run_holding_every_size_ranks_them_and_ties_any_two(tmp_path):
    # each experiment's own eval: 32K looks fastest (16K's ran beside other work and lost speed)
    rows = [
        row("base-16k", 16384, 1.10, 0.05),
        row("base-32k", 32768, 1.30, 0.05),
        row("base-64k", 65536, 1.20, 0.05),
        row("base-256k", 262144, 0.90, 0.05),
    ]
    assert verdict(rows).best.name == "base-32k"
    # one side-by-side run of all four: 16K fastest, 64K tied with it, 32K and 256K measurably slower
    one_run = {
        16384: (1.40, 1.30, 1.50),
        32768: (1.25, 1.15, 1.35),
        65536: (1.33, 1.20, 1.45),
        262144: (1.0, 0.9, 1.1),
    }
    minus = {  # (a, b) -> paired interval of a's speedup minus b's
        (16384, 32768): (0.05, 0.25), (16384, 65536): (-0.02, 0.16), (16384, 262144): (0.3, 0.5),
        (32768, 65536): (-0.2, 0.04), (32768, 262144): (0.1, 0.4), (65536, 262144): (0.2, 0.45),
    }  # fmt: skip
    labels = dict(zip(one_run, "BACD", strict=True))  # the reference (32K) is A, as the bench names it
    drafters = []
    for size, (value, lo, hi) in one_run.items():
        others = {}
        for (a, b), (d_lo, d_hi) in minus.items():
            if size in (a, b):
                sign = 1 if size == a else -1
                ends = sorted((sign * d_lo, sign * d_hi))
                others[labels[b if size == a else a]] = {
                    "value": sum(ends) / 2,
                    "ci": dict(zip(("lo", "hi"), ends, strict=True)),
                }
        drafters.append(
            {
                "name": f"gemma-{size // 1024}k-drafter", "label": labels[size], "reference": size == 32768,
                "draft_vocab_size": size, "speedup": value, "speedup_ci": {"lo": lo, "hi": hi},
                "speedup_minus_drafter": others,
            }
        )  # fmt: skip
    drafters.insert(0, drafters.pop(1))  # the reference first
    path = tmp_path / "all.json"
    run = {"machine": "bench box", "target": "gemma3-270m", "settings": {"k": 2, "lookup_tokens": 0}}
    path.write_text(json.dumps(run | {"drafters": drafters, "prompt_lookup": {"speedup": 2.1}}))
    paired = Paired.read(path)
    assert paired.prompt_lookup == 2.1

    decided = verdict(rows, paired)
    assert decided.one_run and decided.best.name == "base-16k"
    assert decided.speeds["base-16k"].value == 1.40
    assert decided.decision.startswith(
        "Decision: a draft vocabulary of 16,384 tokens (base-16k): the highest"
    )
    assert "1.40 [1.30, 1.50]x" in decided.decision
    # 64K ties 16K by the paired interval of two drafters, neither of them the reference
    assert "against gemma-16k-drafter contains 0, so judged for base-32k, base-64k, base-256k" in decided.rule
    assert "The paired interval of base-64k against the best contains 0" in decided.paragraph
    assert "one side-by-side bench.drafters run on bench box" in decided.paragraph

    # rows whose evals decoded otherwise (tree depth 1, a lookup branch): the file decides nothing
    grafted = [
        row(e.name, e.draft_vocab_size, e.number("speedup"), 0.05, {"eval.k": 1, "eval.lookup_tokens": 4})
        for e in rows
    ]
    other = verdict(grafted, paired)
    assert not other.one_run and other.best.name == "base-32k"
    assert (
        "is not used: its bench decoded otherwise than these rows' evals (k 2 (rows: 1); " in other.paragraph
    )
    assert "lookup_tokens 0 (rows: 4))" in other.paragraph and "paired" not in other.rule

    # an older file (pairs against the reference only) still ranks by its run; 16K-64K by overlap
    for d in drafters:
        d.pop("speedup_minus_drafter")
    drafters[1]["speedup_minus_reference"], drafters[1]["speedup_minus_reference_ci"] = (
        0.15,
        {"lo": 0.05, "hi": 0.25},
    )
    path.write_text(json.dumps({"machine": "bench box", "drafters": drafters}))
    older = verdict(rows, Paired.read(path))
    assert older.best.name == "base-16k" and "by overlapping 95% speedup intervals for the rest" in older.rule

    write_report(rows, tmp_path / "report", paired=paired)
    markdown = (tmp_path / "report" / "report.md").read_text()
    assert "speedup, bench.drafters' one run [95% CI]" in markdown
    line = next(x for x in markdown.splitlines() if x.startswith("| base-64k"))
    assert "| 1.33 [1.20, 1.45] |" in line

    # a file missing one size: each experiment's own speeds rank, as before
    drafters.pop()
    path.write_text(json.dumps({"machine": "bench box", "drafters": drafters}))
    partial = verdict(rows, Paired.read(path))
    assert not partial.one_run and partial.speeds["base-32k"].value == 1.30
    assert "does not hold a drafter with a speedup for every compared row" in partial.paragraph


def test_paired_rows_match_by_experiment_name_before_draft_size(tmp_path):
    paired = paired_file(tmp_path, {16384: (0.0, -0.1, 0.1), 65536: (0.0, -0.1, 0.1)})
    rows = [
        row("candidate-65536", 16384, 1.0, 0.1),
        row("other-16k", 16384, 1.0, 0.1),
        row("x", 32768, 1, 0.1),
    ]
    matched = paired.match(rows)
    # by name, though its size says 16K; 16K's drafter still goes to the row of its size
    assert {k: v["name"] for k, v in matched.items()} == {
        "candidate-65536": "candidate-65536",
        "other-16k": "candidate-16384",
        "x": "gemma-32k",
    }
    twice = paired_file(tmp_path, {16384: (0.0, -0.1, 0.1)})
    twice = Paired(
        twice.path, twice.machine, twice.reference, (*twice.drafters, twice.drafters[1] | {"name": "z"})
    )
    assert "other-16k" not in twice.match(rows)  # two drafters of one size: neither is guessed


def gen(tokens: int, seconds: float, accepted: list[int] | None = None) -> Generation:
    return Generation(list(range(tokens)), seconds, accepted or [])


def bench_rows() -> list[dict[str, Generation]]:
    """Per prompt: plain, A (reference), B (A's very generations), C (A's tokens in half the
    time), lookup."""
    rows = []
    for i in range(6):
        a = gen(20 + i, 1.0 + 0.3 * (i % 3), [1, 2, 0, 3, 1, 2][: 3 + i % 3])
        rows.append(
            {
                "plain": gen(20 + i, 2.0 + 0.1 * i),
                "A": a,
                "B": a,
                "C": Generation(a.tokens, a.seconds / 2, [2] * len(a.accepted)),
                "lookup": gen(20 + i, 1.8),
            }
        )
    return rows


def test_bench_pairs_every_drafter_against_the_first_and_writes_json(tmp_path, capsys):
    summary = summarize(bench_rows(), ["A", "B", "C"], lookup=True, seed=0)
    a, b, c = (summary["decoders"][x] for x in "ABC")
    assert "speedup_minus_reference" not in a  # the reference
    # B decodes exactly as A: every paired difference is 0, on every resample
    assert b["speedup_minus_reference"] == 0 and b["speedup_minus_reference_ci"] == {"lo": 0.0, "hi": 0.0}
    assert b["acceptance_length_minus_reference"] == 0
    # C: A's tokens in half the time on every prompt, so twice A's tokens/s on every resample
    assert c["speedup"] == pytest.approx(2 * a["speedup"])
    assert c["speedup_minus_reference"] == pytest.approx(a["speedup"])
    assert c["tokens_per_s_over_reference"] == pytest.approx(1.0)
    assert c["tokens_per_s_over_reference_ci"] == pytest.approx({"lo": 1.0, "hi": 1.0})
    assert c["speedup_minus_reference_ci"]["lo"] > 0 and c["acceptance_length"] == 3.0
    assert c["acceptance_length_minus_reference_ci"]["lo"] > 0
    assert {"speedup_minus_prompt_lookup", "speedup_minus_prompt_lookup_ci"} <= set(a)
    # every pair, not only against the reference: C leads B as it leads A, and B - C mirrors it
    assert set(b["speedup_minus_drafter"]) == {"A", "C"} and "B" not in b["speedup_minus_drafter"]
    c_b, b_c = c["speedup_minus_drafter"]["B"], b["speedup_minus_drafter"]["C"]
    assert c_b["value"] == pytest.approx(c["speedup_minus_reference"]) and c_b["ci"]["lo"] > 0
    assert b_c["value"] == pytest.approx(-c_b["value"]) and b_c["ci"]["hi"] < 0

    report(summary)
    out = capsys.readouterr().out
    assert "B - A: acceptance length +0.000 [0.000, 0.000], tokens/s +0.000 [0.000, 0.000] (paired)" in out
    assert "C - A: acceptance length" in out and "C - prompt lookup: speedup" in out

    meta = {
        x: {"path": f"drafters/d{x}", "name": f"d{x}", "draft_vocab_size": 16384 * (i + 1)}
        for i, x in enumerate("ABC")
    }
    data = to_json(
        summary, meta, {"machine": MACHINE, "command": "python -m bench.drafters dA dB dC --json f"}
    )
    text = json.dumps(data, allow_nan=False)  # plain JSON: no NaN
    assert [d["name"] for d in data["drafters"]] == ["dA", "dB", "dC"] and data["reference"] == "drafters/dA"
    assert [d["reference"] for d in data["drafters"]] == [True, False, False]
    assert data["prompt_lookup"]["speedup"] > 0 and data["command"].endswith("--json f")
    # what `eagle3 report --paired` reads: C's row, by its draft vocabulary size
    (tmp_path / "p.json").write_text(text)
    paired = Paired.read(tmp_path / "p.json")
    assert paired.reference == "dA" and paired.machine == MACHINE
    rows = [row("exp-16k", 16384, 1.0, 0.1), row("exp-48k", 49152, 1.5, 0.1)]
    label, get = paired.column(rows)
    assert label == "paired speedup vs dA [95% CI]"
    assert get(rows[0]) == "reference" and get(rows[1]).startswith(f"{c['speedup_minus_reference']:+.2f} [+")

    # two drafters: the printed lines are the ones bench.drafters always printed
    two = summarize(bench_rows(), ["A", "B"], lookup=False, seed=0)
    assert set(two["decoders"]) == {"A", "B"}
    report(two)
    lines = capsys.readouterr().out.splitlines()
    assert [line.split(":")[0] for line in lines] == ["A", "B", "B - A"]
