"""Training: TTT attention exactness, exact resume, DDP under torchrun, input checks, export agreement.

Tiny configs (H=32, V=256) on a feature store built in the documented format; the resume and
DDP checks compare whole training runs. Run as a script under torchrun, this file is also the
DDP worker the test launches.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import shutil
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from conftest import made_up_fingerprint
from tiny_drafters import tiny_drafter_config

import eagle3.train.argmax as argmax_module
import eagle3.train.loop as loop_module
from eagle3.core.params import ParamsError, TrainParams, parse_params
from eagle3.core.stageio import write_json
from eagle3.data.store import MANIFEST, SCHEMA_VERSION, FeatureStore, Sample, write_shard
from eagle3.drafter import DrafterConfig, TTTCache, export_drafter, load_drafter
from eagle3.drafter.ttt_attention import ttt_attention, ttt_attention_reference
from eagle3.dtypes.precision import precision_of
from eagle3.target.fingerprint import Fingerprint
from eagle3.train.argmax import cache_file, target_argmax
from eagle3.train.checkpoint import trainable_state
from eagle3.train.checks import check_inputs
from eagle3.train.data import BatchSource, StoredFeatures, sample_lengths, split_samples
from eagle3.train.loop import train_drafter, warmup_cosine
from eagle3.train.prepare import (
    TrainInputs,
    check_memory,
    check_target_topk,
    drafter_config,
    training_code_sha256,
)
from eagle3.train.ttt import acceptance_length, topk_target

H, V, K = 32, 256, 64
REPO = Path(__file__).resolve().parents[1]


def tiny_store(folder: Path, n: int = 24, seed: int = 0) -> FeatureStore:
    """Features with a learnable rule: the next token is a function of aux_hidden."""
    g = torch.Generator().manual_seed(seed)
    samples = []
    for _ in range(n):
        t = int(torch.randint(12, 40, (1,), generator=g))
        ids = torch.randint(0, V, (t,), generator=g).int()
        aux = torch.randn(t, 3 * H, generator=g)
        samples.append(
            Sample(
                ids,
                (torch.rand(t, generator=g) > 0.2).to(torch.uint8),
                aux.bfloat16(),
                torch.randn(t, H, generator=g).bfloat16(),
            )
        )
    folder.mkdir(parents=True, exist_ok=True)
    shards = [write_shard(folder, j, samples[j * 8 : (j + 1) * 8]) for j in range((n + 7) // 8)]
    write_json(
        folder / MANIFEST,
        {
            "schema_version": SCHEMA_VERSION,
            "fingerprint": _fp().to_json(),
            "aux_layers": [1, 2, 3],
            "shards": shards,
        },
    )
    return FeatureStore(folder)


def tiny_cfg(k: int = K) -> DrafterConfig:
    return tiny_drafter_config(H, V, k, max_position_embeddings=512)


def tiny_inputs(folder: Path, p: TrainParams | None = None) -> TrainInputs:
    """The tiny features and target; the drafter config carries `p`'s architecture choices."""
    g = torch.Generator().manual_seed(1)
    embed, head = torch.randn(V, H, generator=g), torch.randn(V, H, generator=g)
    ids = torch.arange(K) * 3  # every third token is in the draft vocab
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[ids] = True
    norm = 1 + 0.1 * torch.randn(H, generator=g)
    return TrainInputs(
        tiny_store(folder),
        embed,
        head,
        ids - torch.arange(K),
        t2d,
        drafter_config(tiny_cfg(), p or tiny_params()),
        run_key="tiny",
        final_norm=norm,
    )


def tiny_params(**kw) -> TrainParams:
    base = dict(
        epochs=2,
        seq_len=32,
        batch_size=4,
        warmup_steps=2,
        heldout_fraction=0.2,
        checkpoint_every=2,
        ttt_length=3,
        dtype="float32",
        lr=3e-3,
    )
    return TrainParams(**(base | kw))


class Interrupted(Exception):
    """Raised from on_step: the run stops as a kill would, after its last checkpoint."""


def interrupt_after(p: TrainParams, inputs: TrainInputs, folder: Path, steps: int) -> None:
    """Train until `steps` optimizer steps are done, then interrupt the run."""

    def stop(row: dict) -> None:
        if row["step"] >= steps:
            raise Interrupted

    with pytest.raises(Interrupted):
        train_drafter(p, inputs, folder, on_step=stop)


# --- TTT attention -------------------------------------------------------------------------------


def test_ttt_attention_fast_path_equals_reference_with_gradients():
    torch.manual_seed(0)
    b, h, t, d = 2, 3, 9, 8
    leaves = [torch.randn(b, h, t, d, dtype=torch.float64, requires_grad=True) for _ in range(3 + 2 * 3)]
    q, k0, v0, kd, vd = leaves[0], leaves[1], leaves[2], leaves[3:6], leaves[6:9]
    w = torch.randn(b, h, t, d, dtype=torch.float64)
    fast = ttt_attention(q, k0, v0, kd, vd)
    ref = ttt_attention_reference(q, k0, v0, kd, vd)
    torch.testing.assert_close(fast, ref, rtol=0, atol=1e-12)
    for gf, gr in zip(
        torch.autograd.grad((fast * w).sum(), leaves),
        torch.autograd.grad((ref * w).sum(), leaves),
        strict=True,
    ):
        torch.testing.assert_close(gf, gr, rtol=0, atol=1e-12)


def _max_errors(form, device: str, dtype: torch.dtype) -> list[tuple[float, float]]:
    """Per output and gradient (q, k0, v0, 3 diagonal k, 3 diagonal v): the max error of `form`
    and of the masked reference form, both in `dtype` on `device`, against float64 on the CPU."""
    torch.manual_seed(0)
    b, h, t, d = 2, 4, 300, 64
    exact = [torch.randn(b, h, t, d, dtype=torch.float64, requires_grad=True) for _ in range(3 + 2 * 3)]
    w = torch.randn(b, h, t, d, dtype=torch.float64)

    def run(f, leaves, weight):
        out = f(leaves[0], leaves[1], leaves[2], leaves[3:6], leaves[6:9])
        return [out, *torch.autograd.grad((out * weight).sum(), leaves)]

    want = run(ttt_attention_reference, exact, w)
    low = [x.detach().to(device, dtype).requires_grad_() for x in exact]
    got = run(form, low, w.to(device, dtype))
    masked = run(ttt_attention_reference, low, w.to(device, dtype))
    return [
        ((g.double().cpu() - e).abs().max().item(), (m.double().cpu() - e).abs().max().item())
        for g, m, e in zip(got, masked, want, strict=True)
    ]


def test_ttt_attention_merged_form_in_bf16_is_as_close_as_the_masked_form():
    """The merge's low-precision path (float32 merge of a bf16 flash kernel's output, as on CUDA)
    on the CPU flash kernel: no worse than the reference form in bf16, forward and gradients."""
    from eagle3.drafter.ttt_attention import CPU_FLASH, _MergedTTTAttention

    def merged(q, k0, v0, kd, vd):
        scale = q.shape[-1] ** -0.5
        return _MergedTTTAttention.apply(q, k0, v0, torch.stack(kd, 3), torch.stack(vd, 3), scale, CPU_FLASH)

    for merged_err, masked_err in _max_errors(merged, "cpu", torch.bfloat16):
        assert merged_err <= 1.5 * masked_err, (merged_err, masked_err)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (tools/gpu_check.sh runs it)")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_ttt_attention_merged_form_on_cuda_equals_the_reference(dtype):
    """On CUDA the merged flash form runs (its one-time check passed) and is as close to the
    float64 reference as the masked reference form in the same dtype, forward and every gradient."""
    from eagle3.drafter.ttt_attention import CUDA_FLASH, merged_kernel

    assert merged_kernel(torch.zeros(1, 1, 8, 64, device="cuda", dtype=dtype)) is CUDA_FLASH
    for merged_err, masked_err in _max_errors(ttt_attention, "cuda", dtype):
        assert merged_err <= 2 * masked_err + 1e-3, (merged_err, masked_err)


@pytest.mark.parametrize("eagle31", [False, True])
def test_ttt_step_matches_inference_with_a_cache(eagle31):
    """Step k of the TTT unroll at position t equals drafting k tokens after the prefix 0..t
    (with norm_output both feed the normed state: the engine needs no change)."""
    from eagle3.drafter import DrafterCache, Eagle3Drafter

    torch.manual_seed(0)
    cfg = replace(tiny_cfg(), fc_norm=eagle31, norm_output=eagle31)
    model = Eagle3Drafter(cfg, torch.randn(V, H)).double()
    t_len, steps = 8, 3
    ids = torch.randint(0, model.cfg.vocab_size, (1, t_len + steps))
    hidden0 = model.project(torch.randn(1, t_len, 3 * model.cfg.target_hidden_size, dtype=torch.float64))
    pos = torch.arange(t_len)[None]
    with torch.no_grad():
        cache, hidden, outs = TTTCache(), hidden0, []
        for k in range(steps):
            hidden = model(ids[:, 1 + k : 1 + k + t_len], hidden, pos + k, cache)
            outs.append(hidden)
        for t in (0, 3, t_len - 1):  # chain drafting from prefix 0..t with a plain cache
            c = DrafterCache()
            h = model(ids[:, 1 : t + 2], hidden0[:, : t + 1], pos[:, : t + 1], c)[:, -1:]
            torch.testing.assert_close(h, outs[0][:, t : t + 1], rtol=0, atol=1e-10)
            for k in range(1, steps):
                h = model(ids[:, t + 1 + k : t + 2 + k], h, torch.tensor([[t + k]]), c)
                torch.testing.assert_close(h, outs[k][:, t : t + 1], rtol=0, atol=1e-10)


def test_acceptance_length_counts_leading_hits():
    hits = torch.tensor([[1, 1, 0, 1], [0, 1, 1, 1], [1, 1, 1, 1]], dtype=torch.bool)
    assert acceptance_length(hits).tolist() == [3, 1, 5]


def test_topk_target_keeps_the_targets_top_n_inside_the_draft_vocab():
    torch.manual_seed(0)
    hidden, head = torch.randn(2, 5, 8), torch.randn(12, 8)
    draft_ids = torch.tensor([0, 2, 3, 5, 7, 11])  # target ids of the 6 draft slots
    slot = torch.full((12,), -1)
    slot[draft_ids] = torch.arange(6)
    full = topk_target(hidden, head, slot, 12)  # every token: the draft rows' own softmax
    assert torch.allclose(full, (hidden @ head[draft_ids].T).softmax(-1), atol=1e-6)
    top2 = topk_target(hidden, head, slot, 2)
    logits = hidden @ head.T
    best = logits.topk(2, dim=-1).indices
    for b, t in [(0, 0), (1, 3)]:
        kept = [int(i) for i in best[b, t] if slot[i] >= 0]
        assert (top2[b, t] > 0).sum() == len(kept)  # nothing outside the target's top 2
        if kept:
            assert torch.isclose(top2[b, t].sum(), torch.tensor(1.0))


@pytest.mark.slow
def test_training_on_the_targets_top_n_learns_and_differs_from_the_full_distribution(tmp_path):
    inputs = tiny_inputs(tmp_path / "f")
    top1 = train_drafter(tiny_params(epochs=3, target_topk=1), inputs)
    full = train_drafter(tiny_params(epochs=3), inputs)
    assert top1.curve[-1]["loss"] < top1.curve[0]["loss"]
    assert not torch.equal(top1.drafter.fc.weight, full.drafter.fc.weight)


# --- data ------------------------------------------------------------------------------------------


def top_n_store(source: FeatureStore, head: torch.Tensor, n: int, folder: Path) -> FeatureStore:
    """`source` with the target's top-n (from last_hidden and `head`) in place of last_hidden,
    as an SGLang top-logprobs extraction stores it."""
    samples = []
    for i in range(len(source)):
        f = source.sample(i)
        top = (f["last_hidden"].float() @ head.T).log_softmax(-1).topk(n, dim=-1)
        samples.append(
            Sample(f["input_ids"], f["loss_mask"], f["aux_hidden"], None, top.indices.int(), top.values)
        )
    folder.mkdir(parents=True)
    shards = [write_shard(folder, j, samples[j * 8 : (j + 1) * 8]) for j in range((len(samples) + 7) // 8)]
    manifest = {k: v for k, v in source.manifest.items() if k != "shards"}
    write_json(folder / MANIFEST, manifest | {"shards": shards, "target_topk": n})
    return FeatureStore(folder)


@pytest.mark.slow
def test_a_top_n_store_trains_like_the_top_n_taken_from_last_hidden(tmp_path):
    """What SGLang's top logprobs give is what train.target_topk simulates from last_hidden."""
    inputs = tiny_inputs(tmp_path / "f")
    stored = replace(inputs, store=top_n_store(inputs.store, inputs.head, 5, tmp_path / "top5"))
    assert set(stored.store.sample(0)) == {
        "input_ids",
        "loss_mask",
        "aux_hidden",
        "target_topk_ids",
        "target_topk_logprobs",
    }
    simulated = train_drafter(tiny_params(epochs=2, target_topk=5), inputs)
    from_store = train_drafter(tiny_params(epochs=2), stored)
    assert [r["loss"] for r in from_store.curve] == pytest.approx(
        [r["loss"] for r in simulated.curve], rel=1e-4
    )
    torch.testing.assert_close(
        from_store.drafter.fc.weight, simulated.drafter.fc.weight, rtol=1e-3, atol=1e-5
    )
    # fewer of the stored top-N is a different target; more than the store holds is refused
    top2 = train_drafter(tiny_params(epochs=2, target_topk=2), stored)
    assert top2.curve[-1]["loss"] != pytest.approx(from_store.curve[-1]["loss"], rel=1e-4)
    check_target_topk(tiny_params(target_topk=5), 5)
    with pytest.raises(ValueError, match="holds the target's top 5 only"):
        check_target_topk(tiny_params(target_topk=6), 5)


def test_split_and_batches_are_deterministic(tmp_path):
    inputs = tiny_inputs(tmp_path / "f")
    train, held = split_samples(len(inputs.store), 0.2, seed=0)
    assert not set(train) & set(held) and len(train) + len(held) == 24
    lengths = {s: inputs.store.sample(s)["input_ids"].numel() for s in range(24)}
    in_draft = {s: torch.ones(n, dtype=torch.bool) for s, n in lengths.items()}
    src = BatchSource(StoredFeatures(inputs.store, in_draft), train, sample_lengths(inputs.store), seq_len=32)
    assert src.epoch_batches(1, 0, 4) == src.epoch_batches(1, 0, 4) != src.epoch_batches(2, 0, 4)
    batch = src.batch(src.epoch_batches(0, 0, 4)[0])
    assert batch.aux_hidden.shape[-1] == 3 * H and batch.input_ids.shape[1] <= 32
    assert batch.num_tokens == sum(min(lengths[s], 32) for s in src.epoch_batches(0, 0, 4)[0])


# --- training loop ----------------------------------------------------------------------------------


@pytest.mark.slow
def test_training_learns_and_reports(tmp_path):
    inputs = tiny_inputs(tmp_path / "f")
    out = train_drafter(tiny_params(epochs=6), inputs)
    first, last = out.curve[0], out.curve[-1]
    assert last["loss"] < first["loss"]
    assert len(out.metrics["heldout"]["acc"]) == 3 and 1.0 <= out.metrics["acceptance_length"] <= 4.0
    assert out.metrics["steps"] == len(out.curve)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (tools/gpu_check.sh runs it)")
def test_a_gpu_trains_the_cpu_drafter(tmp_path, monkeypatch):
    """The loop on the GPU (device_of picks it) and on the CPU from the same inputs in float32:
    the same curve and weights up to rounding, so no step or loss is computed differently there."""
    p, used = tiny_params(epochs=2), []
    chosen = loop_module.device_of
    monkeypatch.setattr(loop_module, "device_of", lambda d: used.append(chosen(d)) or used[-1])
    gpu = train_drafter(p, tiny_inputs(tmp_path / "gpu"))
    monkeypatch.setattr(loop_module, "device_of", lambda d: used.append(torch.device("cpu")) or used[-1])
    cpu = train_drafter(p, tiny_inputs(tmp_path / "cpu"))
    assert [d.type for d in used] == ["cuda", "cpu"]
    assert next(gpu.drafter.parameters()).device.type == "cpu"  # handed back on the CPU
    assert len(gpu.curve) == len(cpu.curve)
    for on_gpu, on_cpu in zip(gpu.curve, cpu.curve, strict=True):
        assert on_gpu["loss"] == pytest.approx(on_cpu["loss"], rel=1e-3)
    torch.testing.assert_close(gpu.drafter.state_dict(), cpu.drafter.state_dict(), rtol=1e-3, atol=1e-3)


@pytest.mark.slow
def test_eagle31_trains_exports_and_reloads(tmp_path):
    p = tiny_params(epochs=2, fc_norm=True, norm_output=True)
    inputs = tiny_inputs(tmp_path / "f", p)
    out = train_drafter(p, inputs)
    drafter = out.drafter
    assert drafter.cfg.fc_norm and drafter.cfg.norm_output
    assert out.curve[-1]["loss"] < out.curve[0]["loss"]
    # the per-layer norms were trained (they start at ones)
    assert all(not torch.equal(n.weight, torch.ones(H)) for n in drafter.fc_norm)
    export_drafter(drafter, tmp_path / "drafter", dtype=torch.float32)
    config = json.loads((tmp_path / "drafter/config.json").read_text())
    assert config["fc_norm"] is True and config["norm_output"] is True
    loaded = load_drafter(tmp_path / "drafter", inputs.embed, dtype=torch.float32)
    batch = inputs.store.sample(0)
    ids = batch["input_ids"].long()[None, :16]
    aux = batch["aux_hidden"].float()[None, :16]
    pos = torch.arange(16)[None]
    with torch.no_grad():
        first = drafter.logits(drafter(ids, drafter.project(aux), pos))
        again = loaded.logits(loaded(ids, loaded.project(aux), pos))
    assert torch.equal(first, again)


@pytest.mark.slow
def test_intermediate_size_param_sets_the_drafter_mlp(tmp_path):
    p = tiny_params(epochs=1, intermediate_size=24)
    out = train_drafter(p, tiny_inputs(tmp_path / "f", p))
    assert out.drafter.cfg.intermediate_size == 24
    assert out.drafter.midlayer.mlp.down_proj.weight.shape == (H, 24)


@pytest.mark.slow
def test_frozen_head_stays_the_target_head_and_is_not_optimised(tmp_path):
    inputs = tiny_inputs(tmp_path / "f")
    out = train_drafter(tiny_params(epochs=2, head_trainable=False), inputs, tmp_path / "ck")
    drafter = out.drafter
    rows = inputs.head[torch.arange(K) + inputs.d2t]
    assert torch.equal(drafter.lm_head.weight, rows) and torch.equal(drafter.norm.weight, inputs.final_norm)
    assert not drafter.lm_head.weight.requires_grad and not drafter.norm.weight.requires_grad
    assert out.curve[-1]["loss"] < out.curve[0]["loss"]  # the rest still learns
    state = torch.load(tmp_path / "ck/last.pt", weights_only=False)
    trainable = {n for n, q in drafter.named_parameters() if q.requires_grad}
    assert not trainable & {"lm_head.weight", "norm.weight", "embed_tokens.weight"}
    assert len(state["optimizer"]["param_groups"][0]["params"]) == len(trainable)


def test_a_drafter_config_without_the_train_params_is_refused(tmp_path):
    inputs = tiny_inputs(tmp_path / "f")  # built for the default params: no fc_norm
    with pytest.raises(ValueError, match="does not carry the train params"):
        train_drafter(tiny_params(fc_norm=True), inputs)


@pytest.mark.parametrize(("warmup", "total"), [(10, 546), (2, 10), (0, 7), (5, 2)])
def test_warmup_cosine_gives_the_former_learning_rates_bitwise(warmup, total):
    """transformers' schedule, one step ahead, equals the schedule this project used before it:
    (s+1)/(w+1) of the peak in warmup, then cosine from the peak to 10% of it."""

    def former(step: int) -> float:
        if step < warmup:
            return (step + 1) / (warmup + 1)
        progress = min(1.0, (step - warmup) / max(1, total - warmup))
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress))

    def lrs(make) -> list[float]:
        optimizer = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=2e-3)
        scheduler, out = make(optimizer), []
        for _ in range(total + 1):
            out.append(scheduler.get_last_lr()[0])
            optimizer.step()
            scheduler.step()
        return out

    ours = lrs(lambda o: warmup_cosine(o, warmup, total))
    assert ours == lrs(lambda o: torch.optim.lr_scheduler.LambdaLR(o, former))
    assert ours[0] > 0  # the first step trains (transformers' own step 0 has lr 0)


def test_frozen_head_needs_target_init():
    with pytest.raises(ParamsError, match=r"train.head_init: target or train.head_trainable: true"):
        parse_params({"train": {"head_trainable": False, "head_init": "random"}})


@pytest.mark.slow
@pytest.mark.parametrize("head_init", ["target", "random"])
def test_head_init_starts_from_the_target_head_and_norm(tmp_path, head_init):
    inputs = tiny_inputs(tmp_path / "f")
    # lr so small that the weights are still their initial values after training
    out = train_drafter(tiny_params(epochs=1, lr=1e-12, head_init=head_init), inputs)
    rows = inputs.head[torch.arange(K) + inputs.d2t]
    from_target = torch.allclose(out.drafter.lm_head.weight, rows, atol=1e-6) and torch.allclose(
        out.drafter.norm.weight, inputs.final_norm, atol=1e-6
    )
    assert from_target == (head_init == "target")


@pytest.mark.slow
def test_resume_gives_bitwise_identical_weights(tmp_path):
    inputs = tiny_inputs(tmp_path / "f")
    p = tiny_params()
    whole = train_drafter(p, inputs, tmp_path / "a")
    interrupt_after(p, inputs, tmp_path / "b", steps=3)
    resumed = train_drafter(p, inputs, tmp_path / "b")  # from the step-2 checkpoint
    a, b = trainable_state(whole.drafter), trainable_state(resumed.drafter)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert whole.curve == resumed.curve and whole.metrics["heldout"] == resumed.metrics["heldout"]
    # a checkpoint of another run (other key) is ignored, not resumed
    other = TrainInputs(**{**inputs.__dict__, "run_key": "other"})
    fresh = train_drafter(p, other, tmp_path / "b")
    assert all(torch.equal(trainable_state(fresh.drafter)[k], a[k]) for k in a)


def _ddp_worker(out: Path, folder: Path) -> None:
    torch.set_num_threads(1)
    computed = []  # the samples whose argmax this rank multiplied out itself
    one_sample = argmax_module._argmax
    argmax_module._argmax = lambda store, s, head: computed.append(s) or one_sample(store, s, head)
    inputs = TrainInputs(**{**tiny_inputs(folder).__dict__, "features_sha256": "f"})
    result = train_drafter(tiny_params(), inputs)
    write_json(Path(f"{out}.rank{os.environ['RANK']}.json"), computed)
    if result is not None:
        torch.save({"curve": result.curve, "state": trainable_state(result.drafter)}, out)


@pytest.mark.slow
def test_two_process_gloo_matches_one_process(tmp_path):
    one = tmp_path / "one.pt"
    two = tmp_path / "two.pt"
    path = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    # gloo on the CPU, also on a machine with a GPU (two ranks there would want two GPUs)
    env = dict(os.environ, PYTHONPATH=path, OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")
    for nproc, out in ((1, one), (2, two)):
        env["EAGLE3_CACHE"] = str(tmp_path / f"cache{nproc}")
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc_per_node={nproc}",
            str(Path(__file__)),
            str(out),
            str(tmp_path / f"f{nproc}"),
        ]
        res = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300, cwd=REPO)
        assert res.returncode == 0, res.stderr[-3000:]
    a, b = torch.load(one), torch.load(two)
    assert len(a["curve"]) == len(b["curve"])
    for ra, rb in zip(a["curve"], b["curve"], strict=True):
        assert ra["loss"] == pytest.approx(rb["loss"], rel=1e-4, abs=1e-5)
    for k in a["state"]:
        torch.testing.assert_close(a["state"][k], b["state"][k], rtol=1e-3, atol=1e-4)
    # the two ranks split the target's argmax between them and each kept the other's half: the
    # cache rank 0 wrote holds every sample, with the one-process run's values
    alone = json.loads(Path(f"{one}.rank0.json").read_text())
    halves = [json.loads(Path(f"{two}.rank{r}.json").read_text()) for r in (0, 1)]
    assert sorted(alone) == sorted(halves[0] + halves[1]) == list(range(24))
    assert len(halves[0]) == len(halves[1]) == 12
    (kept_one,) = (tmp_path / "cache1" / "target-argmax").iterdir()
    (kept_two,) = (tmp_path / "cache2" / "target-argmax").iterdir()
    by_one, by_two = torch.load(kept_one), torch.load(kept_two)
    assert sorted(by_two) == sorted(by_one) == list(range(24))
    assert all(torch.equal(by_one[s], by_two[s]) for s in by_one)


# --- input checks -----------------------------------------------------------------------------------


def _fp(**fields: object) -> Fingerprint:
    """The tiny target's fingerprint (its sizes; made-up hashes), `fields` replaced."""
    tiny = {"num_layers": 8, "hidden_size": H, "vocab_size": V, "aux_layers": (1, 2, 3)}
    return made_up_fingerprint(**(tiny | fields))


def test_too_large_vocab_is_refused_before_training():
    with pytest.raises(ValueError, match=r"estimated peak memory .* train.max_memory_gib"):
        check_memory(
            DrafterConfig(**{**tiny_cfg().as_dict(), "vocab_size": 262144, "draft_vocab_size": 262144}),
            TrainParams(batch_size=64, seq_len=4096, max_memory_gib=8),
            precision_of(torch.bfloat16),
        )


def test_features_from_another_target_are_refused(tmp_path):
    inputs = tiny_inputs(tmp_path / "f")
    features = _fp(target_sha256="another")
    with pytest.raises(ValueError, match="features .* another target: target_sha256"):
        check_inputs(
            _fp(),
            features,
            [1, 2, 3],
            {"tokenizer_sha256": "tok", "target_vocab_size": V},
            inputs.d2t,
            inputs.t2d,
            inputs.drafter_cfg,
        )


def test_mapping_from_another_tokenizer_is_refused(tmp_path):
    inputs = tiny_inputs(tmp_path / "f")
    with pytest.raises(ValueError, match="vocab mapping .* another tokenizer"):
        check_inputs(
            _fp(),
            _fp(),
            [1, 2, 3],
            {"tokenizer_sha256": "other", "target_vocab_size": V},
            inputs.d2t,
            inputs.t2d,
            inputs.drafter_cfg,
        )
    with pytest.raises(ValueError, match="target_vocab_size"):
        check_inputs(
            _fp(),
            _fp(),
            [1, 2, 3],
            {"tokenizer_sha256": "tok", "target_vocab_size": V * 2},
            inputs.d2t,
            inputs.t2d,
            inputs.drafter_cfg,
        )


# --- export -----------------------------------------------------------------------------------------


def test_export_agrees_with_vocab_map_and_reloads(tmp_path):
    from eagle3.vocab import build_vocab_map, load_mapping, save_vocab_map

    counts = torch.randint(0, 50, (V,)).numpy()
    vocab = build_vocab_map(counts, K)
    save_vocab_map(vocab, tmp_path / "vm", {"target_vocab_size": V, "tokenizer_sha256": "tok"})
    d2t, t2d, _ = load_mapping(tmp_path / "vm")
    inputs = tiny_inputs(tmp_path / "f")
    inputs = TrainInputs(**{**inputs.__dict__, "d2t": d2t, "t2d": t2d})
    out = train_drafter(tiny_params(epochs=1), inputs)
    export_drafter(out.drafter, tmp_path / "drafter")
    config = json.loads((tmp_path / "drafter/config.json").read_text())
    assert config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 2, 3]
    loaded = load_drafter(tmp_path / "drafter", inputs.embed, dtype=torch.float32)
    assert torch.equal(loaded.d2t, d2t) and torch.equal(loaded.t2d, t2d)


if __name__ == "__main__":  # DDP worker for test_two_process_gloo_matches_one_process
    _ddp_worker(Path(sys.argv[1]), Path(sys.argv[2]))


@pytest.mark.slow
def test_max_samples_trains_on_fewer_samples_against_the_same_heldout_set(tmp_path):
    inputs = tiny_inputs(tmp_path / "f")
    full = train_drafter(tiny_params(epochs=1), inputs).metrics
    part = train_drafter(tiny_params(epochs=1, max_samples=5), inputs).metrics
    assert part["heldout_tokens"] == full["heldout_tokens"]
    assert 0 < part["train_tokens"] < full["train_tokens"]
    assert part["steps"] < full["steps"]


# --- the target's argmax, kept per feature store ---------------------------------------------------


@pytest.mark.slow
def test_the_target_argmax_is_kept_per_feature_store_and_trains_the_same_bytes(tmp_path, monkeypatch):
    monkeypatch.setenv("EAGLE3_CACHE", str(tmp_path / "cache"))
    inputs = tiny_inputs(tmp_path / "f")
    store, head, samples = inputs.store, inputs.head, list(range(len(inputs.store)))
    direct = {s: (store.sample(s)["last_hidden"].float() @ head.T).argmax(-1) for s in samples}
    assert all(
        torch.equal(ids.long(), direct[s]) for s, ids in target_argmax(store, samples, head, "m").items()
    )
    path = cache_file("m", head)
    # read back, not recomputed: a value edited in the cache file comes back as edited
    kept = torch.load(path, weights_only=True)
    kept[3] = torch.full_like(kept[3], 7)
    torch.save(kept, path)
    assert torch.equal(target_argmax(store, [3], head, "m")[3], kept[3])
    # another head (its bytes), or other features, is another entry
    assert cache_file("m", head * 2) != path and cache_file("other manifest", head) != path
    path.write_bytes(b"damaged")  # a damaged cache file is recomputed, never trusted
    assert all(
        torch.equal(ids.long(), direct[s]) for s, ids in target_argmax(store, samples, head, "m").items()
    )

    p = tiny_params(epochs=1)
    keyed = TrainInputs(**{**inputs.__dict__, "features_sha256": "f"})
    kept_before = set((tmp_path / "cache" / "target-argmax").iterdir())
    cold = trainable_state(train_drafter(p, keyed, tmp_path / "a").drafter)
    assert len(set((tmp_path / "cache" / "target-argmax").iterdir()) - kept_before) == 1
    warm = trainable_state(train_drafter(p, keyed, tmp_path / "b").drafter)
    uncached = trainable_state(train_drafter(p, inputs, tmp_path / "c").drafter)
    assert all(torch.equal(cold[k], warm[k]) and torch.equal(cold[k], uncached[k]) for k in cold)


def test_a_killed_argmax_pass_keeps_what_it_wrote_and_the_next_computes_the_rest(tmp_path, monkeypatch):
    monkeypatch.setenv("EAGLE3_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(argmax_module, "CHUNK", 4)
    monkeypatch.setattr(argmax_module, "WRITE_EVERY_S", 0.0)  # write after every chunk
    inputs = tiny_inputs(tmp_path / "f")
    store, head, samples = inputs.store, inputs.head, list(range(len(inputs.store)))
    one_sample, computed = argmax_module._argmax, []

    def killed_at_the_tenth(store, s, head):
        if len(computed) == 9:
            raise KeyboardInterrupt
        computed.append(s)
        return one_sample(store, s, head)

    monkeypatch.setattr(argmax_module, "_argmax", killed_at_the_tenth)
    with pytest.raises(KeyboardInterrupt):
        target_argmax(store, samples, head, "m")
    assert len(torch.load(cache_file("m", head), weights_only=True)) == 8  # two whole chunks
    computed.clear()
    monkeypatch.setattr(
        argmax_module, "_argmax", lambda store, s, head: computed.append(s) or one_sample(store, s, head)
    )
    resumed = target_argmax(store, samples, head, "m")
    assert computed == samples[8:]
    direct = target_argmax(store, samples, head)  # no cache at all
    assert all(torch.equal(resumed[s], direct[s]) for s in samples)


@pytest.mark.slow
def test_a_run_sees_few_matmul_shapes_and_the_same_loss(tmp_path, monkeypatch):
    """Batch widths and the head's row counts are padded to fixed multiples (each new shape made
    oneDNN build and cache kernels, and peak RSS grew with the steps); the padding changes no loss."""
    import eagle3.train.ttt as ttt_module
    from eagle3.drafter.model import Eagle3Drafter
    from eagle3.train.data import WIDTH_MULTIPLE

    rows, widths = [], []
    logits = Eagle3Drafter.logits

    def recording(self, hidden):
        rows.append(hidden.shape[0])
        return logits(self, hidden)

    monkeypatch.setattr(Eagle3Drafter, "logits", recording)
    batch = BatchSource.batch

    def recording_batch(self, *args, **kwargs):
        made = batch(self, *args, **kwargs)
        widths.append(made.input_ids.shape[1])
        return made

    monkeypatch.setattr(BatchSource, "batch", recording_batch)
    p = tiny_params(epochs=2, seq_len=64)
    padded = train_drafter(p, tiny_inputs(tmp_path / "a", p))
    assert rows and all(n % ttt_module.ROW_MULTIPLE == 0 for n in rows)
    assert widths and all(w % WIDTH_MULTIPLE == 0 for w in widths)  # samples are 13-37 tokens
    monkeypatch.setattr(ttt_module, "ROW_MULTIPLE", 1)
    rows.clear()
    unpadded = train_drafter(p, tiny_inputs(tmp_path / "b", p))
    assert len(set(rows)) > 2  # without it the count differs batch to batch
    for a, b in zip(padded.curve, unpadded.curve, strict=True):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5)


def test_a_checkpoint_of_other_training_code_is_not_resumed(tmp_path, monkeypatch):
    """`dvc repro` after a change to the training code must train again, not finish the old
    run: the run key carries the code's digest, and only the training code's."""
    shutil.copytree(REPO / "eagle3", tmp_path / "eagle3", ignore=shutil.ignore_patterns("__pycache__"))
    # the copy's prepare.py, loaded in this process (its own __file__, so it digests the copied
    # package): a fresh interpreter per digest cost ~10 s of imports each for the same answer
    spec = importlib.util.spec_from_file_location("copied_prepare", tmp_path / "eagle3/train/prepare.py")
    copied = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "copied_prepare", copied)  # dataclasses look their module up
    spec.loader.exec_module(copied)

    def code_key() -> str:
        return copied.training_code_sha256.__wrapped__()  # uncached: each call reads the files now

    before = code_key()
    assert before == training_code_sha256()  # the copy digests as the package itself does
    with open(tmp_path / "eagle3/cli/commands/compare.py", "a") as f:
        f.write("# not training code\n")
    assert code_key() == before
    with open(tmp_path / "eagle3/train/ttt.py", "a") as f:
        f.write("# training code\n")
    assert code_key() != before
