"""Online features (extract.features: online): the store keeps tokens only and training computes
each batch's features from the target. Checked on the real stages with the real SmolLM2 at tiny
sizes: a sample's features do not depend on the samples computed beside it, online training
writes the offline drafter's bytes, a killed online run resumes to them, and the prefetch queue
keeps its order and depth. The stores are extracted at 2 torch threads, whatever the session runs
at, and train at the session's count (1 a rank under torchrun): online forwards must run at the
count the store records, since on some CPUs (an AMX Xeon) a forward's bits depend on it."""

from __future__ import annotations

import json
import signal
import threading
import time
from pathlib import Path

import fault_harness as faults
import pytest
import torch
import yaml
from fault_harness import copy_project

from eagle3.core.params import Params, TargetParams, load_params
from eagle3.data.extract import capture_rows, select_conversations, token_batches
from eagle3.data.store import FeatureStore, Sample
from eagle3.target.load import has_chat_template, load_target
from eagle3.target.render import Rendered
from eagle3.train.online import disagreement, hf_features, prefetched

DRAFTER = "artifacts/train/drafter"
CHECKPOINTS = "artifacts/train/checkpoints"
# The extract stage's torch threads here: another count than the train ranks' (1 each under
# torchrun on 2 cores, and 1 everywhere under xdist), whether or not the module runs alone.
CAPTURE_THREADS = 2
CAPTURE_ENV = {"OMP_NUM_THREADS": str(CAPTURE_THREADS)}


# --- the prefetch queue --------------------------------------------------------------------------


def test_prefetch_keeps_the_order_and_never_runs_past_its_depth():
    made, consumed, ahead = [], [], []
    lock = threading.Lock()

    def make(i: int) -> int:
        with lock:
            made.append(i)
            ahead.append(len(made) - len(consumed))  # made and not yet handed over, this one included
        time.sleep(0.002 * (i % 3))  # uneven work
        return i * 10

    for value in prefetched(make, list(range(20)), depth=3):
        consumed.append(value)
        time.sleep(0.005)  # a consumer slower than the producer: the queue fills
    assert consumed == [i * 10 for i in range(20)]
    assert max(ahead) <= 3 + 1 and max(ahead) >= 3  # the depth ahead plus the one being used


def test_prefetch_raises_at_the_failing_item_and_closing_stops_the_thread():
    def make(i: int) -> int:
        if i == 4:
            raise RuntimeError("server gone")
        return i

    got = []
    with pytest.raises(RuntimeError, match="server gone"):
        for value in prefetched(make, list(range(10)), depth=2):
            got.append(value)
    assert got == [0, 1, 2, 3]

    made = []
    ahead = prefetched(lambda i: made.append(i) or i, list(range(100)), depth=2)
    assert next(ahead) == 0
    ahead.close()
    count = len(made)
    time.sleep(0.05)
    assert len(made) == count <= 4  # stopped: nothing more is made after close
    assert not [t for t in threading.enumerate() if t.name == "eagle3-prefetch"]


# --- features are a function of the sample ------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_samples_features_do_not_depend_on_the_samples_beside_it(dtype):
    """Real SmolLM2: each sample alone, with others of its forward width (31, 17 and 9 tokens are
    all forwarded at 32), and in other groups gives the same bytes."""
    target = load_target(TargetParams(dtype=dtype))
    params = Params.model_validate({"data": {"num_samples": 8, "max_length": 48}})
    chat = has_chat_template(target.source)
    full = [s.rendered for s in select_conversations(params, target.tokenizer, chat)]
    cut = [48, 48, 31, 48, 31, 17, 48, 9]  # shared lengths and lengths of their own
    rendered = [Rendered(r.input_ids[:n], r.loss_mask[:n]) for r, n in zip(full, cut, strict=True)]
    lengths = [len(r.input_ids) for r in rendered]
    aux = [1, 14, 26]
    assert token_batches(lengths, 4096) == [[2, 4, 5, 7], [0, 1, 3, 6]]  # shorter rows padded to 32
    assert token_batches(lengths, 64) == [[2, 4], [5, 7], [0], [1], [3], [6]]
    alone = [capture_rows(target, [r], aux, 4096)[0] for r in rendered]
    together = capture_rows(target, rendered, aux, 4096)
    reversed_ = capture_rows(target, rendered[::-1], aux, 4096)[::-1]
    pairs = capture_rows(target, rendered, aux, 2 * max(lengths))  # at most two rows a forward
    for i, a in enumerate(alone):
        for other in (together[i], reversed_[i], pairs[i]):
            assert torch.equal(a.aux_hidden, other.aux_hidden) and torch.equal(
                a.last_hidden, other.last_hidden
            )
            assert disagreement(a, other) is None


# --- the real stages ----------------------------------------------------------------------------


def set_features(project: Path, mode: str, recheck_every: int | None = None) -> None:
    params = yaml.safe_load((project / "params.yaml").read_text())
    params["extract"] |= {"features": mode}
    if recheck_every is not None:
        params["online"] = params.get("online", {}) | {"recheck_every": recheck_every}
    (project / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))


def drafter_bytes(project: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted((project / DRAFTER).iterdir())}


def kill_once_exists(project: Path, stage: str, path: str) -> bool:
    """Start `stage` and SIGKILL it as soon as `path` exists; False if it finished first."""
    proc, began = faults.start(project, stage), time.monotonic()
    while proc.poll() is None:
        assert time.monotonic() - began < faults.STAGE_TIMEOUT_S
        if (project / path).exists():
            proc.send_signal(signal.SIGKILL)
            proc.wait()
            return True
        time.sleep(0.01)
    return False


@pytest.fixture(scope="module")
def offline(faults_stages, tmp_path_factory) -> tuple[Path, dict[str, bytes], dict]:
    """The tiny project (the session's, through vocab-map) extracted again at CAPTURE_THREADS
    threads and trained from its feature store: its drafter bytes and train metrics. Read only:
    tests train in copies."""
    project = copy_project(faults_stages, tmp_path_factory.mktemp("offline"))
    faults.must_run(project, "extract", env=CAPTURE_ENV)  # resumes every shard if it ran at 2
    faults.must_run(project, "vocab_map")
    assert FeatureStore(project / "artifacts/extract").capture_threads == CAPTURE_THREADS
    faults.must_run(project, "train")
    metrics = json.loads((project / "metrics/train.json").read_text())
    return project, drafter_bytes(project), metrics


@pytest.fixture(scope="module")
def online(offline, tmp_path_factory) -> Path:
    """The same project with online features (extract.features online, a re-check every 3rd
    batch): extract and vocab-map run again, no drafter yet. Read only: tests train in copies."""
    project = copy_project(offline[0], tmp_path_factory.mktemp("online"))
    faults.remove(project, [DRAFTER, CHECKPOINTS])  # nothing of the store's training is at hand
    set_features(project, "online", recheck_every=3)
    faults.must_run(project, "extract", env=CAPTURE_ENV)
    faults.must_run(project, "vocab_map")
    assert FeatureStore(project / "artifacts/extract").capture_threads == CAPTURE_THREADS
    return project


def test_online_forwards_run_at_the_stores_threads_on_the_prefetch_thread(
    offline, online, one_thread, monkeypatch
):
    """The in-process feature source with the caller on 1 thread and the store extracted at 2:
    every target forward runs at 2 on the background thread that computes batches ahead, the
    caller keeps its 1, and the features are the store's bytes."""
    monkeypatch.chdir(online)  # where the train stage runs: its params and recorded dtypes
    store = FeatureStore("artifacts/extract")
    feed = hf_features(load_params(), store)
    assert feed.target_topk is None  # the in-process target's store holds final-norm states
    assert torch.get_num_threads() == 1  # loading the target left the caller's count alone
    seen: list[int] = []
    counting = torch.nn.modules.module.register_module_forward_pre_hook(
        lambda *_: seen.append(torch.get_num_threads())
    )
    samples = [[0, 3], [5]]
    try:
        tokens = [[store.sample(i) for i in batch] for batch in samples]
        rendered = [[Rendered(t["input_ids"].numpy(), t["loss_mask"].numpy()) for t in b] for b in tokens]
        computed = list(prefetched(feed.compute, rendered, depth=1))
        again = feed.recheck.again(rendered[0][0])
    finally:
        counting.remove()
    assert seen and set(seen) == {CAPTURE_THREADS}
    assert torch.get_num_threads() == 1
    stored = FeatureStore(offline[0] / "artifacts/extract")
    for batch, features in zip(samples, computed, strict=True):
        for i, sample in zip(batch, features, strict=True):
            row = stored.sample(i)
            assert torch.equal(sample.aux_hidden, row["aux_hidden"])
            assert torch.equal(sample.last_hidden, row["last_hidden"])
    assert disagreement(computed[0][0], again) is None


def without_timings(metrics: dict) -> dict:
    return faults._without_timings(metrics)


@pytest.mark.timeout(1800)
def test_online_training_writes_the_offline_drafter_and_resumes_to_it(offline, online, tmp_path):
    _, stored_drafter, stored_metrics = offline
    stored_bytes = sum(p.stat().st_size for p in (offline[0] / "artifacts/extract").iterdir())
    project = copy_project(online, tmp_path)
    store = FeatureStore(project / "artifacts/extract")
    assert store.online and store.keys == ("input_ids", "loss_mask")
    online_bytes = sum(p.stat().st_size for p in (project / "artifacts/extract").iterdir())
    assert online_bytes * 20 < stored_bytes  # tokens only: no hidden states on disk
    faults.must_run(project, "train")
    assert drafter_bytes(project) == stored_drafter
    online_metrics = json.loads((project / "metrics/train.json").read_text())
    assert without_timings(online_metrics) == without_timings(stored_metrics)

    # killed once its first checkpoint is in place, then run again: the same bytes
    faults.remove(project, [DRAFTER, CHECKPOINTS])
    assert kill_once_exists(project, "train", f"{CHECKPOINTS}/last.pt")
    assert not (project / DRAFTER / "model.safetensors").exists()
    done = faults.run(project, "train")
    assert done.returncode == 0, done.stderr[-2000:]
    assert "train: resuming" in done.stderr and "at step 0 " not in done.stderr
    assert drafter_bytes(project) == stored_drafter


def test_the_recheck_refuses_drifted_features():
    """What the sampled re-check catches: a shifted position, another layer, all-zero rows, a
    different best token; bf16 rounding of the same rows passes."""
    g = torch.Generator().manual_seed(0)
    ids, mask = torch.arange(12, dtype=torch.int32), torch.ones(12, dtype=torch.uint8)
    aux, last = torch.randn(12, 3 * 16, generator=g), torch.randn(12, 16, generator=g)
    good = Sample(ids, mask, aux.bfloat16(), last.bfloat16())
    assert disagreement(good, Sample(ids, mask, (aux * 1.001).bfloat16(), last.bfloat16())) is None
    shifted = Sample(ids, mask, aux.roll(1, 0).bfloat16(), last.bfloat16())
    assert "aux_hidden worst row cosine" in disagreement(good, shifted)
    zero = last.clone()
    zero[5] = 0
    assert "all-zero rows (first at position 5)" in disagreement(
        good, Sample(ids, mask, aux.bfloat16(), zero.bfloat16())
    )
    top = torch.randint(0, 100, (12, 4), generator=g)
    a = Sample(ids, mask, aux.bfloat16(), target_topk_ids=top, target_topk_logprobs=torch.zeros(12, 4))
    b = Sample(ids, mask, aux.bfloat16(), target_topk_ids=top + 1, target_topk_logprobs=torch.zeros(12, 4))
    assert "best token agrees on 0.000" in disagreement(a, b)


@pytest.mark.timeout(1800)
def test_online_under_torchrun_writes_the_two_process_offline_drafter(offline, online, tmp_path):
    """train.num_processes 2 (torchrun, gloo): each rank computes its own rows' features, at the
    store's 2 threads while it trains at 1, and the drafter equals the one two ranks train from
    the store."""
    trained = {}
    for mode, built in (("store", offline[0]), ("online", online)):
        project = copy_project(built, tmp_path / mode)  # its extract and vocab-map already run
        assert FeatureStore(project / "artifacts/extract").online == (mode == "online")
        params = yaml.safe_load((project / "params.yaml").read_text())
        params["train"] |= {"num_processes": 2, "batch_size": 2, "epochs": 1}  # one epoch shows it
        (project / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
        faults.remove(project, [DRAFTER, CHECKPOINTS])
        faults.must_run(project, "train")
        trained[mode] = drafter_bytes(project)
        assert json.loads((project / "metrics/train.json").read_text())["processes"] == 2
    assert trained["online"] == trained["store"]
