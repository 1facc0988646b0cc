"""Stage train: features + vocab mapping -> an EAGLE-3 drafter exported for SGLang.

With train.num_processes > 1 the stage re-launches itself under torchrun (DDP); launched by
torchrun directly (`torchrun --nproc_per_node N -m stages.train`) it just joins the group.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import torch

from eagle3.data.store import MANIFEST, FeatureStore
from eagle3.device import machine
from eagle3.drafter.config import DrafterConfig
from eagle3.drafter.export import export_drafter
from eagle3.params import Params
from eagle3.stageio import read_json, write_csv, write_metrics
from eagle3.target.load import load_target_config, resolve_target, tokenizer_sha256
from eagle3.tracking import pipeline_run
from eagle3.train.checks import check_inputs
from eagle3.train.heads import load_target_final_norm, load_target_heads
from eagle3.train.loop import TrainInputs, check_memory, drafter_config, precision, train_drafter
from eagle3.vocab import MAPPING, load_mapping
from stages.common import console, reported_failures, validated_params

FEATURES = Path("artifacts/extract")
MAPPING_DIR = Path("artifacts/vocab-map")
REPORT = Path("artifacts/patch-check/report.json")
OUT = Path("artifacts/train/drafter")
# Not a DVC out: DVC must not delete it before a re-run, so an interrupted run can resume.
CHECKPOINTS = Path("artifacts/train/checkpoints")
# Params that do not change the trained weights (a checkpoint stays valid across them).
NOT_IN_KEY = ("checkpoint_every", "max_memory_gib")


def relaunch_under_torchrun(n: int) -> int:
    env = dict(os.environ)
    if not torch.cuda.is_available():  # share the cores instead of oversubscribing them
        env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // n)))
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={n}",
        "-m",
        "stages.train",
    ]
    return subprocess.call(cmd, env=env)


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def run_key(params: Params, cfg: DrafterConfig) -> str:
    train = {k: v for k, v in params.train.model_dump().items() if k not in NOT_IN_KEY}
    material = {
        "train": train,
        "cfg": cfg.as_dict(),
        "features": _sha256(FEATURES / MANIFEST),
        "mapping": _sha256(MAPPING_DIR / MAPPING),
    }
    return hashlib.sha256(json.dumps(material, sort_keys=True).encode()).hexdigest()


def prepare(params: Params) -> TrainInputs:
    """Read and cross-check every input; fails before any expensive work."""
    for path, stage in (
        (REPORT, "patch-check"),
        (FEATURES / MANIFEST, "extract"),
        (MAPPING_DIR, "vocab-map"),
    ):
        if not path.exists():
            raise FileNotFoundError(f"{path} is missing: run the {stage} stage first")
    report_fp = read_json(REPORT)["fingerprint"]
    store = FeatureStore(FEATURES)  # refuses an edited manifest
    d2t, t2d, meta = load_mapping(MAPPING_DIR)  # refuses a damaged or mismatched mapping file
    base = DrafterConfig.from_target_config(load_target_config(params.target), len(d2t), store.aux_layers)
    cfg = drafter_config(base, params.train)  # train.intermediate_size, fc_norm, norm_output
    folder = Path(resolve_target(params.target.source))  # a hub id has no local tokenizer to check
    check_inputs(
        report_fp,
        store.fingerprint,
        store.aux_layers,
        meta,
        d2t,
        t2d,
        cfg,
        features_sha256=_sha256(FEATURES / MANIFEST),
        vocab_size=params.vocab.size,
        target_tokenizer_sha256=tokenizer_sha256(folder) if folder.is_dir() else None,
    )
    check_memory(cfg, params.train)
    store.verify()  # every shard and the token file against the manifest's sha256
    master, autocast = precision(params.train, cfg)
    embed, head = load_target_heads(params.target.source, torch.bfloat16 if autocast else master)
    norm = load_target_final_norm(params.target.source, master)
    return TrainInputs(store, embed, head, d2t, t2d, cfg, run_key(params, cfg), norm)


def per_position(summary: dict) -> dict:
    out = {f"acc_{k}": round(a, 6) for k, a in enumerate(summary["acc"])}
    out |= {f"loss_{k}": round(x, 6) for k, x in enumerate(summary["loss"])}
    return out


def main() -> None:
    params = validated_params()
    p = params.train
    if p.num_processes > 1 and "WORLD_SIZE" not in os.environ:
        sys.exit(relaunch_under_torchrun(p.num_processes))
    main_rank = int(os.environ.get("RANK", "0")) == 0
    with reported_failures("train"):
        inputs = prepare(params)
        if not main_rank:
            train_drafter(p, inputs, CHECKPOINTS, progress=False)
            return
        with pipeline_run(params, "train") as run:

            def on_step(row: dict) -> None:
                run.log_metrics(
                    {f"train.{k}": v for k, v in row.items() if k not in ("step", "epoch")}, step=row["step"]
                )

            def on_epoch(result: dict) -> None:
                held = result["heldout"]
                run.log_metrics(
                    {"heldout.acceptance_length": held["acceptance_length"]}
                    | {f"heldout.{k}": v for k, v in per_position(held).items()},
                    step=result["epoch"],
                )

            outcome = train_drafter(p, inputs, CHECKPOINTS, on_step=on_step, on_epoch=on_epoch)
            export_drafter(outcome.drafter, OUT)
            m = outcome.metrics
            metrics = {
                # named apart from speculative-eval's measured figures: both land in one MLflow run
                "sim_acceptance_length": round(m["acceptance_length"], 4),
                "heldout_acc_0": round(m["heldout_acc_0"], 6),
                "chance_acc": m["chance_acc"],
                "heldout": per_position(m["heldout"]),
                "train": per_position(m["train"]),
                "chain_survival": {
                    f"depth_{k + 1}": round(s, 6) for k, s in enumerate(m["heldout"]["chain_survival"])
                },
                "steps": m["steps"],
                "train_tokens": m["train_tokens"],
                "heldout_tokens": m["heldout_tokens"],
                "draft_vocab_size": inputs.drafter_cfg.draft_vocab_size,
                "processes": m["processes"],
                "dtype": m["dtype"],
                "train_tokens_per_s": round(m["tokens_per_s"] or 0.0, 1),
            }
            write_metrics("train", metrics)
            keys = ["step", "epoch", "lr", "loss"] + [f"acc_{k}" for k in range(p.ttt_length)]
            write_csv(Path("plots/train_curve.csv"), keys, [[row[k] for k in keys] for row in outcome.curve])
            held, train = m["heldout"], m["train"]
            write_csv(
                Path("plots/train_acc_by_position.csv"),
                ["ttt_position", "heldout_acc", "train_acc", "heldout_loss"],
                [[k, held["acc"][k], train["acc"][k], held["loss"][k]] for k in range(p.ttt_length)],
            )
            run.log_metrics({k: v for k, v in metrics.items() if k != "chance_acc"})
            run.set_tags({"train.dtype": m["dtype"], "train.machine": machine()})
            run.log_artifact(OUT / "config.json", "drafter")
    console.print(
        f"drafter: held-out top-1 acc at TTT position 0 {metrics['heldout_acc_0']:.3f} "
        f"(chance {metrics['chance_acc']:.5f}), "
        f"simulated acceptance length {metrics['sim_acceptance_length']:.2f}, "
        f"{metrics['train_tokens_per_s']:,.0f} tok/s -> {OUT}"
    )


if __name__ == "__main__":
    main()
