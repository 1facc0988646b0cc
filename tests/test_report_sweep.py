"""A draft-vocabulary sweep end to end on real DVC, real MLflow and the real SmolLM2 at tiny
sizes: `dvc exp run --queue -S vocab.size=A,B` run by two queue workers at once re-uses the one
extraction, lands as one MLflow run per experiment named after it, and `eagle3 compare` and
`eagle3 report` read the result (from DVC and from MLflow)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import mlflow
import pytest
from background import dvc_queue_started, project_env
from project_copy import REPO, copy_code
from test_pipeline import TINY, dvc, run, write_params

from eagle3.cli.command import main

pytestmark = pytest.mark.slow

# the smallest run of every stage: 1 epoch over 6 samples, 1 prompt x 8 new tokens
SWEEP = TINY | {
    "extract": TINY["extract"] | {"pack_weights": False},
    "train": {"epochs": 1, "seq_len": 40, "batch_size": 2, "warmup_steps": 0, "dtype": "float32"},
    "eval": {"domains": {"code": 1}, "max_new_tokens": 8, "dtype": "float32", "drafter_dtype": "float32"},
}
SIZES = (200, 400)
# The two workers run at once: each experiment's stages get their share of the cores. Torch's
# default (every core per process) had 2 x 2 threads spinning on 2 cores, which made the
# experiments several times slower than one thread each (seen at 0.2 tok/s in speculative-eval).
QUEUE_ENV = {"OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 2) // len(SIZES)))}


def wait_for_queue(project: Path, timeout_s: float = 1200) -> str:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        done = dvc("queue", "status", cwd=project, check=False)
        status = done.stdout + done.stderr
        # A worker rewrites its executor-info JSON in place (DVC's `modify_json`: truncate, then
        # write), so a status read in between finds an empty file and fails with "Expecting
        # value". That read says nothing about the queue: ask again. Any other failure is real.
        if done.returncode != 0 and "Expecting value" not in done.stderr:
            raise AssertionError(f"dvc queue status failed:\n{status}")
        if done.returncode == 0 and not any(state in status for state in ("Queued", "Running")):
            return status
        time.sleep(2)
    raise AssertionError(f"queue still busy after {timeout_s:.0f} s:\n{status}")


def eagle3(*args: str, capsys) -> tuple[int, str, str]:
    """`eagle3 ARGS` in this process (the caller is in the project, with the environment the
    project's commands get): exit code, stdout, stderr. A fresh interpreter per command cost
    seconds of imports each, for the same code: the project's copy is this package's."""
    capsys.readouterr()
    code = main(list(args))
    out, err = capsys.readouterr()
    return code, out, err


# Past the suite's 15-minute default: 12-15 min measured on a 2-core machine under other load
# (one run hit 900 s), and its own queue wait alone allows 1200 s, so that fails first and says why.
@pytest.mark.timeout(2400)
def test_queued_sweep_reuses_one_extraction_and_is_compared_and_reported(tmp_path, monkeypatch, capsys):
    project = tmp_path / "project"
    copy_code(project)
    write_params(project, SWEEP)
    run(["git", "init", "-q"], project)
    run(["git", "config", "user.email", "ci@example.com"], project)
    run(["git", "config", "user.name", "ci"], project)
    dvc("init", "-q", cwd=project)
    dvc("config", "core.analytics", "false", cwd=project)
    dvc("repro", "extract", cwd=project)  # the one extraction every sweep point re-uses
    run(["git", "add", "-A"], project)
    run(["git", "commit", "-qm", "baseline: features extracted"], project)

    queued = dvc("exp", "run", "--queue", "-S", f"vocab.size={','.join(map(str, SIZES))}", cwd=project)
    assert queued.stdout.count("Queued experiment") == len(SIZES)
    # its daemon and workers write to a file, in their own session, and are ended for sure on
    # leaving: a worker can miss the empty queue and outlive it (docs/experiments.md, "Leftover
    # queue workers")
    with dvc_queue_started(project, 2, project_env() | QUEUE_ENV):
        status = wait_for_queue(project)
    assert status.count("Success") == len(SIZES), status

    mlflow.set_tracking_uri(f"sqlite:///{project / 'mlflow.db'}")
    runs = mlflow.search_runs(search_all_experiments=True, output_format="list")
    # extraction ran once, in the baseline's `dvc repro`; no sweep point ran it again
    extracted = [r for r in runs if "eagle3.stage.extract" in r.data.tags]
    assert len(extracted) == 1 and "DVC_EXP_NAME" not in extracted[0].data.tags
    sweep = [r for r in runs if r.data.tags.get("DVC_EXP_NAME")]
    assert len(sweep) == len(SIZES) and len({r.info.experiment_id for r in runs}) == 1
    assert sorted(int(r.data.params["vocab.size"]) for r in sweep) == list(SIZES)
    for r in sweep:
        assert r.info.run_name == r.data.tags["DVC_EXP_NAME"]
        assert "eagle3.stage.extract" not in r.data.tags and "eagle3.stage.speculative-eval" in r.data.tags
        assert {"coverage", "acceptance_rate", "tokens_per_s", "speedup"} <= set(r.data.metrics)
        assert r.data.metrics["draft_vocab_size"] == int(r.data.params["vocab.size"])  # not mixed up
    # the top-K sets are nested, so the benchmark answers' coverage cannot fall as K grows
    small, large = sorted(sweep, key=lambda r: int(r.data.params["vocab.size"]))
    assert 0 < small.data.metrics["eval_coverage"] <= large.data.metrics["eval_coverage"] <= 1
    first, second = sorted(sweep, key=lambda r: r.info.start_time)
    assert second.info.start_time < first.info.end_time  # two workers really ran them together
    names = [r.info.run_name for r in sweep]

    # the project's commands' environment: none of the caller's MLflow or DVC settings, 80 columns
    for key in [k for k in os.environ if k.startswith(("MLFLOW_", "DVC_"))]:
        monkeypatch.delenv(key)
    monkeypatch.setenv("PATH", project_env()["PATH"])
    monkeypatch.setenv("COLUMNS", "80")
    monkeypatch.chdir(project)
    for source in ("dvc", "mlflow"):
        code, shown, err = eagle3("compare", "--source", source, capsys=capsys)
        assert code == 0, err
        assert all(name in shown for name in names) and "coverage" in shown
        assert max(map(len, shown.splitlines())) <= 80
    # the README's form of DVC's own table, in a 120-column terminal: each experiment's headline
    # per domain (acceptance under the domain's name, speedup under x.<domain>) and the param that
    # differs, first and whole. DVC never narrows a queued run's State and Executor columns
    # ("Success", "Dvc-task") nor the first dep column (here every dep differs: this master has no
    # dvc.lock), and with them the table overflows into "…" everywhere: the README drops them.
    drop = "State|Executor|.*/"
    assert f"dvc exp show --only-changed --drop '{drop}'" in (REPO / "README.md").read_text()
    form = ["--only-changed", "--drop", drop]
    shown = [sys.executable, "-m", "dvc", "exp", "show", *form, "--no-pager"]
    env = project_env() | {"COLUMNS": "120"}
    table = subprocess.run(shown, cwd=project, env=env, capture_output=True, text=True, check=True).stdout
    header = next(line for line in table.splitlines() if "Experiment" in line)
    assert header.split()[:5] == ["Experiment", "Created", "code", "x.code", "vocab.size"], table
    at = header.index("vocab.size")
    rows = {name: next(line for line in table.splitlines() if f"[{name}]" in line) for name in names}
    assert sorted(int(row[at : at + 10]) for row in rows.values()) == list(SIZES), table
    assert max(map(len, table.splitlines())) <= 120
    code, _, err = eagle3("compare", "no-such-exp", capsys=capsys)
    assert code == 2 and "unknown experiment 'no-such-exp'" in err

    code, _, err = eagle3("report", *names, "--out", "report", capsys=capsys)
    assert code == 0, err
    out = project / "report"
    markdown = (out / "report.md").read_text()
    assert all(name in markdown for name in names)
    # what decides a size, per row: the train stage's held-out top-1, the eval's per-position share
    lines = markdown.splitlines()
    header = [c.strip() for c in next(line for line in lines if line.startswith("| experiment")).split("|")]
    for name in names:
        cells = next(x for x in lines if x.startswith(f"| {name} |")).split("|")
        row = dict(zip(header, (c.strip() for c in cells), strict=True))
        assert 0 <= float(row["held-out top-1"]) <= 1
        assert row["drafted at"].startswith("EAGLE-3 tree ")  # from the row's params: eval.mode tree
        assert all(0 <= float(share) <= 1 for share in row["accepted by draft position"].split(" / "))
    assert "Speedup peaks at a draft vocabulary of" in markdown or "No size is measurably faster" in markdown
    for plot in ("coverage", "acceptance_length", "draft_ms_per_step", "speedup"):
        assert (out / f"{plot}.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert f"({plot}.png)" in markdown
    assert "data:image/png;base64," in (out / "report.html").read_text()
