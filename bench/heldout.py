"""Exported drafters' held-out top-1 on one pipeline workspace's held-out split, paired.

    python -m bench.heldout DRAFTER_A DRAFTER_B [MORE ...] [--positions drafted] [--json FILE]

A DRAFTER is an exported folder, or a training checkpoint (artifacts/train/checkpoints/last.pt
or a copy of it): runs still training can be compared at the same step.

Run in a workspace whose extract, vocab-map and patch-check outputs the drafters were trained
on (params.yaml's train split gives the held-out samples). Each drafter is scored at every TTT
step on the same positions, whatever convention trained it (train.loss_positions), in three
sets: `drafted`, the tokens decoding drafts (neither an answer's first token, which the
target's prefill gives, nor the one after its end of turn), and `after_assistant` and
`assistant`, the training conventions' own. Intervals are 95% bootstrap intervals over
held-out samples, and each drafter after the first is paired against it (the same resampled
samples for both).
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch

from eagle3.core.params import load_params
from eagle3.core.pipeline import FEATURES, PATCH_REPORT, VOCAB_MAP
from eagle3.decoding.stats import percentile_interval, resample_index
from eagle3.drafter.export import load_drafter
from eagle3.train.distributed import SINGLE_PROCESS
from eagle3.train.loop import TrainRecipe
from eagle3.train.prepare import prepare_inputs


def drafter_weights(path: str, embed: torch.Tensor) -> dict[str, torch.Tensor]:
    """The drafter's tensors: an exported folder's, or a training checkpoint's."""
    if Path(path).is_file():
        state = torch.load(path, weights_only=True)
        print(f"{path}: checkpoint of step {state['step']}, epoch {state['epoch']}")
        return state["model"]
    return load_drafter(path, embed, torch.float32).state_dict()


def per_sample_hits(folders: list[str], positions: list[str], ttt_length: int) -> np.ndarray:
    """[positions, drafters, samples, 2, steps]: top-1 hits and counted positions per held-out
    sample, for each set of positions."""
    params = load_params()
    train = params.train.model_copy(update={"ttt_length": ttt_length, "dtype": "float32", "init": None})
    params = params.model_copy(update={"train": train})
    inputs = prepare_inputs(params, FEATURES, VOCAB_MAP, PATCH_REPORT)
    recipe = TrainRecipe(train, inputs)
    recipe.dist, recipe.device = SINGLE_PROCESS, torch.device("cpu")
    recipe._setup_data(heldout_only=True)
    recipe._setup_model()
    model, source = recipe.model.eval(), recipe.held_src
    own = model.drafter.state_dict()
    out = np.zeros((len(positions), len(folders), len(source.samples), 2, ttt_length))
    for d, folder in enumerate(folders):
        loaded = drafter_weights(folder, inputs.embed)
        with torch.no_grad():
            for name, tensor in own.items():
                if name not in ("d2t", "t2d", "embed_tokens.weight"):
                    tensor.copy_(loaded[name].to(tensor.dtype))
            for i, sample in enumerate(source.samples):
                batch = source.batch([sample], torch.float32)
                for p, counted in enumerate(positions):
                    model.loss = replace(model.loss, positions=counted)
                    _, stats = model(batch)
                    out[p, d, i] = torch.stack([stats.correct, stats.count]).numpy()
    return out


def summary(hits: np.ndarray, names: list[str], seed: int = 0) -> dict:
    """Per drafter and step: top-1 over all counted positions, its interval, and (after the
    first) the paired difference to the first drafter's with its interval."""
    index = resample_index(hits.shape[1], seed)
    resampled = hits[:, index].sum(axis=2)  # [drafters, resamples, 2, steps]
    acc = resampled[:, :, 0] / np.maximum(resampled[:, :, 1], 1)
    totals = hits.sum(axis=1)
    point = totals[:, 0] / np.maximum(totals[:, 1], 1)
    out = {}
    for d, name in enumerate(names):
        steps = []
        for k in range(hits.shape[-1]):
            row = {
                "top1": float(point[d, k]),
                "ci": percentile_interval(acc[d, :, k]),
                "positions": int(totals[d, 1, k]),
            }
            if d:
                row["minus_first"] = float(point[d, k] - point[0, k])
                row["minus_first_ci"] = percentile_interval(acc[d, :, k] - acc[0, :, k])
            steps.append(row)
        out[name] = steps
    return out


def main(argv: list[str] | None = None) -> None:
    formatter = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=formatter)
    parser.add_argument("drafters", nargs="+", metavar="DRAFTER")
    sets = ["drafted", "after_assistant", "assistant"]
    parser.add_argument("--positions", nargs="+", default=sets, choices=sets, help="the sets scored")
    parser.add_argument("--ttt-length", type=int, default=2, help="TTT steps scored")
    parser.add_argument("--json", type=Path, default=None, metavar="FILE")
    args = parser.parse_args(argv)
    if len(args.drafters) < 2:
        parser.error("give two or more drafters: the first is the reference")
    hits = per_sample_hits(args.drafters, args.positions, args.ttt_length)
    result = {"samples": hits.shape[2], "positions": {}}
    for p, counted in enumerate(args.positions):
        result["positions"][counted] = summary(hits[p], args.drafters)
        print(f"-- positions {counted}")
        for name, steps in result["positions"][counted].items():
            cells = []
            for k, s in enumerate(steps):
                cell = f"pos {k + 1}: {s['top1']:.4f} [{s['ci']['lo']:.4f}, {s['ci']['hi']:.4f}]"
                if "minus_first" in s:
                    ci = s["minus_first_ci"]
                    cell += f" ({s['minus_first']:+.4f} [{ci['lo']:+.4f}, {ci['hi']:+.4f}])"
                cells.append(cell)
            print(f"{name}: " + "  ".join(cells))
    if args.json:
        args.json.write_text(json.dumps(result | {"command": sys.argv}, indent=1) + "\n")


if __name__ == "__main__":
    main()
