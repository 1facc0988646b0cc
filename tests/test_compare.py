"""`eagle3 compare` / `eagle3 report` on rows of known numbers: machines are told apart, the
table fits 80 columns, the best size and its reasoning follow the numbers, bad input is one line.
(tests/test_report_sweep.py runs the same commands on a real queued sweep.)"""

from __future__ import annotations

import io
import json
import subprocess
import sys

import pytest
from background import project_env
from rich.console import Console

from eagle3.cli.command import main
from eagle3.cli.commands.compare import comparison
from eagle3.cli.queue_workers import WORKER_PID_DIR
from eagle3.sweep.decide import verdict
from eagle3.sweep.experiments import Experiment, ExperimentsError, from_dvc_json, select, stale_stages
from eagle3.sweep.render import write_report

ZEN3 = "AMD EPYC, 2 cores, no native bf16, torch 2.13.0+cpu, 2 threads"
FP32 = {"extract": "float32", "train": "float32", "eval": "float32", "drafter": "bfloat16"}


def row(name: str, size: int, coverage: float, accept: float, draft_ms: float, speedup: float, machine=ZEN3):
    metrics = {
        "draft_vocab_size": size,
        "coverage": coverage,
        "lm_head_params": size * 576,
        "acceptance_length": accept,
        "acceptance_length_ci.lo": accept - 0.04,
        "acceptance_length_ci.hi": accept + 0.04,
        "acceptance_rate": accept - 1,
        "draft_ms_per_step": draft_ms,
        "tokens_per_s": 10 * speedup,
        "speedup": speedup,
        "speedup_ci.lo": speedup - 0.01,
        "speedup_ci.hi": speedup + 0.01,
        "prompt_lookup_speedup": 1.13,
    }
    return Experiment(name, {"vocab.size": size}, metrics, machine, FP32)


SWEEP = [
    row("tiny-vocab", 4096, 0.94, 1.20, 3.1, 1.00),
    row("mid-vocab", 16384, 0.985, 1.27, 6.0, 1.05),
    row("full-vocab", 49152, 1.0, 1.28, 14.0, 0.96),
]


def render(rows: list[Experiment]) -> str:
    console = Console(width=80, record=True, file=io.StringIO())
    console.print(comparison(rows))
    return console.export_text()


def test_table_fits_80_columns_and_marks_rows_from_another_machine():
    other = row("zen4-run", 8192, 0.97, 1.25, 2.0, 1.4, machine="AMD EPYC 9B14, 2 cores, AVX512-BF16")
    text = render(SWEEP + [other])
    assert max(map(len, text.splitlines())) <= 80
    for name in ("tiny-vocab", "mid-vocab", "full-vocab", "zen4-run"):
        assert name in text
    assert "1.27 [1.23,1.31]" in text and "9.4M" in text  # acceptance interval, lm_head params
    assert f"A: {ZEN3}" in text and "B: AMD EPYC 9B14" in text
    assert "measured on 2 different machines" in text
    assert "different machines" not in render(SWEEP)


def test_each_row_names_the_shape_it_drafted_at_and_a_mix_of_shapes_is_flagged():
    # acceptance compares only at one shape: an EAGLE-3 tree and a DFlash block each get a letter
    tree = {"eval.mode": "tree", "eval.k": 5, "eval.topk": 8, "eval.tree_budget": 16, "eval.lookup_tokens": 0}
    eagle3 = Experiment("eagle3-1m", {"vocab.size": 8192} | tree, row("e", 8192, 0.93, 1.82, 38, 0.9).metrics)
    block = {"drafter.kind": "dflash", "dflash.block_size": 8, "vocab.size": 8192} | tree
    dflash = Experiment("dflash-1m", block, row("d", 49152, 1.0, 1.33, 27, 0.7).metrics)
    text = render([eagle3, dflash])
    assert max(map(len, text.splitlines())) <= 80
    assert "a: EAGLE-3 tree 5/8/16" in text and "b: DFlash block 8" in text
    assert "drafted at 2 shapes" in text
    # a DFlash drafter drafts from the whole vocabulary through the target's own head
    assert "8192→49152" not in text and "target" in text.split("dflash-1m")[1].splitlines()[0]
    same = [Experiment(e.name, e.params | tree, e.metrics) for e in SWEEP]
    assert "shapes" not in render(same) and "a: EAGLE-3 tree 5/8/16" in render(same)


def test_rows_differing_only_in_extract_or_train_dtype_share_a_letter():
    # a queued DVC experiment skips extraction, so its MLflow run carries no extract dtype; its
    # speeds, taken by speculative-eval on the same machine and decoding dtypes, still compare
    baseline = SWEEP[1]
    queued = Experiment(
        "queued", baseline.params, baseline.metrics, ZEN3, {"eval": "float32", "drafter": "bfloat16"}
    )
    assert queued.measured_on == baseline.measured_on
    text = render([baseline, queued])
    assert "B:" not in text and "different dtypes" not in text
    other_eval = Experiment("bf16-eval", baseline.params, baseline.metrics, ZEN3, FP32 | {"eval": "bfloat16"})
    assert "B:" in render([baseline, other_eval])


@pytest.mark.slow
def test_verdict_picks_the_fastest_size_and_says_where_coverage_stops_paying(tmp_path):
    found = verdict(SWEEP)
    assert found.best.name == "mid-vocab"
    assert "Speedup peaks at a draft vocabulary of 16,384 tokens" in found.paragraph
    assert "coverage stops paying for draft cost: at 49,152" in found.paragraph
    # a faster row from another machine does not win: its speed does not compare
    fast_elsewhere = row("zen4-run", 8192, 0.97, 1.25, 2.0, 3.0, machine="another machine")
    assert verdict(SWEEP + [fast_elsewhere]).best.name == "mid-vocab"

    result, files = write_report(SWEEP, tmp_path / "report")
    names = {f.name for f in files}
    assert {"report.md", "report.html", "coverage.png", "speedup.png"} <= names
    assert result.paragraph in (tmp_path / "report" / "report.md").read_text()
    page = (tmp_path / "report" / "report.html").read_text()
    assert 'src="data:image/png;base64,' in page and 'src="http' not in page  # offline: nothing fetched


def test_sizes_within_noise_of_the_fastest_pick_the_smallest():
    def wide(name, size, accept, draft_ms, speedup):
        e = row(name, size, 1.0, accept, draft_ms, speedup)
        return Experiment(
            e.name,
            e.params,
            e.metrics | {"speedup_ci.lo": speedup - 0.2, "speedup_ci.hi": speedup + 0.2},
            e.machine,
            e.dtypes,
        )

    rows = [
        wide("small", 4096, 1.98, 3.2, 1.25),
        wide("mid", 32768, 1.99, 5.0, 1.32),
        wide("big", 49152, 1.97, 6.4, 1.30),
    ]
    found = verdict(rows)
    assert found.best.name == "small"  # same speed within noise, cheapest head
    assert (
        "No size is measurably faster" in found.paragraph
        and "1.32 [1.12, 1.52]x at 32,768" in found.paragraph
    )
    assert "acceptance length stayed within 1.97-1.99" in found.paragraph
    # separable intervals still pick the fastest
    assert verdict(SWEEP).best.name == "mid-vocab"


def test_bad_input_is_one_clear_line(tmp_path, monkeypatch, capsys):
    with pytest.raises(ExperimentsError, match="no experiments with metrics"):
        select([], None, "`dvc exp show`")
    with pytest.raises(ExperimentsError, match=r"unknown experiment 'nope' in x \(known: tiny-vocab"):
        select(SWEEP, ["nope"], "x")
    monkeypatch.chdir(tmp_path)
    (tmp_path / "shown.json").write_text("[]")
    assert main(["compare", "--json", "shown.json"]) == 2
    assert capsys.readouterr().err.strip() == (
        "error: no experiments with metrics in shown.json: run `dvc repro` or `dvc exp run` first"
    )
    assert main(["report", "--json", "missing.json"]) == 2
    assert "missing.json does not exist" in capsys.readouterr().err


def test_running_and_queued_experiments_are_left_out_of_dvc_rows():
    def state(accept: float) -> dict:
        metrics = {"metrics/speculative-eval.json": {"data": {"acceptance_length": accept}}}
        return {"data": {"metrics": metrics, "params": {"params.yaml": {"data": {"vocab": {"size": 8}}}}}}

    def exp(name: str, executor_state: str) -> dict:
        # DVC shows a running experiment with its baseline's metrics until it finishes
        return {"name": name, "executor": {"state": executor_state}, "revs": [state(1.5)]}

    shown = [
        {
            "rev": "abc1234",
            "name": "main",
            **state(1.5),
            "experiments": [
                exp("done", "success"),
                exp("busy", "running"),
                exp("waiting", "queued"),
                exp("broke", "failed"),
            ],
        }
    ]
    assert [r.name for r in from_dvc_json(shown)] == ["main", "done"]


@pytest.mark.slow
def test_compare_warns_of_a_queue_worker_alive_with_an_empty_queue(tmp_path, monkeypatch, capsys):
    """A real DVC project with an empty queue whose worker pid file names a live process: a
    stand-in worker that only sleeps, its arguments naming it a queue worker as DVC's do."""
    for cmd in (["git", "init", "-q"], [sys.executable, "-m", "dvc", "init", "-q"]):
        subprocess.run(cmd, cwd=tmp_path, env=project_env(), check=True, capture_output=True, timeout=120)
    shown = [
        {
            "rev": "abc1234",
            "name": "main",
            "data": {
                "metrics": {"metrics/speculative-eval.json": {"data": {"acceptance_length": 1.5}}},
                "params": {"params.yaml": {"data": {"vocab": {"size": 8}}}},
            },
        }
    ]
    (tmp_path / "shown.json").write_text(json.dumps(shown))
    monkeypatch.chdir(tmp_path)
    pid_file = tmp_path / WORKER_PID_DIR / "dvc-exp-worker-1.pid"
    pid_file.parent.mkdir(parents=True, exist_ok=True)
    sleeper = "import time; time.sleep(600)"
    worker = subprocess.Popen(
        [sys.executable, "-c", sleeper, "dvc", "exp", "queue-worker", "dvc-exp-000000-1@localhost"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        pid_file.write_text(str(worker.pid))
        assert main(["compare", "--json", "shown.json"]) == 0
        shown_out = capsys.readouterr()
        assert shown_out.err == (
            f"warning: a DVC queue worker is still alive with nothing queued or running (pid "
            f"{worker.pid}): `dvc queue stop` ends it; if it stays, `kill {worker.pid}`\n"
        )
        assert "main" in shown_out.out  # the table as usual
        # a live process that is no queue worker (the pid file outlived its worker, the pid reused)
        other = subprocess.Popen([sys.executable, "-c", sleeper], stdout=subprocess.DEVNULL)
        try:
            pid_file.write_text(str(other.pid))
            assert main(["compare", "--json", "shown.json"]) == 0
            assert capsys.readouterr().err == ""
        finally:
            other.kill()
            other.wait(timeout=30)
        pid_file.write_text(str(worker.pid))
    finally:
        worker.kill()
        worker.wait(timeout=30)
    assert main(["compare", "--json", "shown.json"]) == 0
    assert capsys.readouterr().err == ""  # the same pid file, its worker gone: no warning


def test_a_stage_is_stale_behind_a_rebuilt_input_and_so_is_what_it_feeds():
    def entry(deps: dict, outs: dict) -> dict:
        return {
            "deps": [{"path": p, "md5": h} for p, h in deps.items()],
            "outs": [{"path": p, "md5": h} for p, h in outs.items()],
        }

    lock = {
        "stages": {
            "extract": entry({"stages/extract.py": "s1"}, {"artifacts/extract": "new.dir"}),
            "vocab-map": entry({"artifacts/extract": "old.dir"}, {"artifacts/vocab-map": "v.dir"}),
            "train": entry({"artifacts/vocab-map": "v.dir"}, {"artifacts/train/drafter": "d.dir"}),
            "speculative-eval": entry({"artifacts/train/drafter": "d.dir"}, {}),
        }
    }
    assert stale_stages(lock) == {"vocab-map", "train", "speculative-eval"}
    lock["stages"]["vocab-map"]["deps"][0]["md5"] = "new.dir"  # the whole chain re-ran
    assert stale_stages(lock) == set()
    assert stale_stages({}) == set()
