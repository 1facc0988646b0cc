"""`eagle3 report --shapes FILE`: which TTT length to train and which shape to serve, from a
bench.trees file of a TTT sweep's drafters measured at the same shapes, per domain, paired. The
figures are bench.trees' own summary of decodings built here, so the decision is tested on the
file format the bench writes."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from eagle3.cli.command import main
from eagle3.core.inputs import InputError
from eagle3.decoding.engine import Generation
from eagle3.sweep.depth import ShapeRun, decide

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # bench/ is no installed package: import it as `python -m bench.x` does
from bench.trees import parse_shape, summarize  # noqa: E402

SHAPES = ("chain:3", "tree:5:8:16")
SWEEP_PARAMS = {"data": {"num_samples": 1450}, "train": {"epochs": 1, "ttt_length": 1}}


def decoding(steps: list[int], seconds: float) -> Generation:
    return Generation(list(range(len(steps) + sum(steps))), seconds, steps, steps)


def bench_file(tmp_path: Path, accepted: dict[str, dict[str, list[int]]], params: dict | None = None) -> Path:
    """A bench.trees --json file: drafters t1 (TTT 1), t3 (TTT 3) and shipped (TTT 2, other
    data), each at every shape; `accepted[drafter][shape]` is every step's accepted drafts, the
    same for every prompt but the tree's longer. Decoding time is one unit a step."""
    drafters = {"t1": 1, "t3": 3, "shipped": 2}
    labels = {f"{d}:{s}": (d, s) for d in drafters for s in SHAPES}
    depths = {label: parse_shape(s)[1]["k"] for label, (_, s) in labels.items()}
    domains = {}
    for domain, prompts in (("chat", 4), ("code", 4)):
        rows = []
        for p in range(prompts):
            row = {"plain": decoding([0] * 24, 24.0)}
            for label, (d, s) in labels.items():
                steps = accepted[d][s] + ([p % 2] if p else [])  # prompts differ a little
                row[label] = decoding(steps, float(len(steps)))
            rows.append(row)
        domains[domain] = summarize(rows, depths, seed=0)
    train = params or {
        d: SWEEP_PARAMS | {"train": {"epochs": 1, "ttt_length": n}} for d, n in drafters.items()
    }
    train["shipped"] = {"data": {"num_samples": 12000}, "train": {"epochs": 3, "ttt_length": 2}}
    data = {
        "machine": "bench box",
        "command": "python -m bench.trees ...",
        "settings": {label: {"drafter": d, **parse_shape(s)[1]} for label, (d, s) in labels.items()},
        "ttt_lengths": drafters,
        "train_params": train,
        "domains": domains,
    }
    path = tmp_path / "trees.json"
    path.write_text(json.dumps(data))
    return path


def test_a_deeper_ttt_that_accepts_more_at_the_fastest_shape_is_picked(tmp_path):
    accepted = {
        "t1": {"chain:3": [1] * 8, "tree:5:8:16": [2] * 8},
        "t3": {"chain:3": [1] * 8, "tree:5:8:16": [4] * 8},  # better only at the deep tree
        "shipped": {"chain:3": [3] * 8, "tree:5:8:16": [5] * 8},  # best of all, but other data
    }
    run = ShapeRun.read(bench_file(tmp_path, accepted))
    assert run.sweep == ("t1", "t3")  # the shipped drafter's params differ beyond the TTT length
    verdict = decide(run, {"rows": [{"ttt": 1, "x_first": 1.0}, {"ttt": 3, "x_first": 2.7}]})
    assert (verdict.ttt, verdict.shape) == (3, "tree 5/8/16")
    assert verdict.paragraph.startswith("Train TTT 3 (t3) and serve tree 5/8/16.")
    assert "Measurably below it: TTT 1." in verdict.paragraph
    table = verdict.markdown
    t3 = next(line for line in table.splitlines() if line.startswith("| t3 | 3 | 2.70x |"))
    assert t3.split("|")[-2].strip().startswith("**")  # bold: t3 is the sweep's best at the tree
    assert "| shipped (other data) | 2 | -" in table


def test_a_tie_at_the_serving_shape_goes_to_the_shorter_unroll(tmp_path):
    same = {"chain:3": [2] * 8, "tree:5:8:16": [3] * 8}
    accepted = {"t1": same, "t3": same, "shipped": same}
    verdict = decide(ShapeRun.read(bench_file(tmp_path, accepted)), None)
    assert verdict.ttt == 1 and verdict.drafter == "t1"
    assert "TTT 3 is within its paired 95% interval in every domain, at a longer unroll" in verdict.paragraph


def test_drafters_trained_on_different_data_are_no_sweep(tmp_path):
    same = {"chain:3": [2] * 8, "tree:5:8:16": [3] * 8}
    params = {
        "t1": SWEEP_PARAMS,
        "t3": {"data": {"num_samples": 99}, "train": {"epochs": 1, "ttt_length": 3}},
    }
    path = bench_file(tmp_path, {"t1": same, "t3": same, "shipped": same}, params)
    with pytest.raises(InputError, match="no two drafters differ in train.ttt_length alone"):
        ShapeRun.read(path)


def test_report_writes_depth_md_and_refuses_a_file_of_another_bench(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    same = {"chain:3": [2] * 8, "tree:5:8:16": [3] * 8}
    path = bench_file(tmp_path, {"t1": same, "t3": same, "shipped": same})
    assert main(["report", "--shapes", str(path), "--out", "out"]) == 0
    assert "Train TTT 1 (t1)" in capsys.readouterr().out
    assert (tmp_path / "out" / "depth.md").read_text().startswith("# Training depth and serving shape")
    other = tmp_path / "drafters.json"
    other.write_text(json.dumps({"machine": "m", "drafters": []}))
    assert main(["report", "--shapes", str(other)]) == 2
    err = capsys.readouterr().err
    assert "no settings, domains, ttt_lengths, train_params" in err and len(err.strip().splitlines()) == 1
