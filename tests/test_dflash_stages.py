"""Every stage with drafter.kind: dflash, on tests/fault_harness.py's tiny project (the real SmolLM2 target,
16 ShareGPT samples of 64 tokens): patch-check and extract capture the DFlash target layers (online
features: the store keeps tokens, train computes the layers), vocab-map writes the whole vocabulary
with the same bytes for any vocab.size, train exports a DFlash drafter, speculative-eval decodes
with it losslessly. Bad params and a drafter of the other family fail in one line, changing nothing."""

from __future__ import annotations

import json
from pathlib import Path

import fault_harness as faults
import pytest
from fault_harness import copy_project

from eagle3.core.stageio import sha256_file

REPO = Path(__file__).resolve().parents[1]
DFLASH = {"num_layers": 2, "block_size": 4, "anchors": 8}
# SGLang's rule for 2 draft layers of a 30-layer target: 1 and N-3
LAYERS = [1, 27]
EAGLE3_DRAFTER = REPO / "drafters" / "smollm2-135m-instruct-full"

pytestmark = pytest.mark.timeout(faults.PYTEST_TIMEOUT_S)


def params(project: Path, **overrides: dict) -> None:
    sections = {"drafter": {"kind": "dflash"}, "dflash": dict(DFLASH), "extract": {"features": "online"}}
    for section, values in overrides.items():
        sections[section] = sections.get(section, {}) | values
    faults.write_params(project, **sections)


def must_run(project: Path, stage: str) -> str:
    done = faults.run(project, stage)
    assert done.returncode == 0, f"{stage} failed:\n{done.stderr[-3000:]}"
    return done.stderr


def refused(project: Path, stage: str) -> str:
    """The one line a stage failed with (exit 2: bad input)."""
    done = faults.run(project, stage)
    assert done.returncode == 2, done.stderr[-3000:]
    return done.stderr.strip().splitlines()[-1]


def metrics(project: Path, stage: str) -> dict:
    return json.loads((project / "metrics" / f"{stage}.json").read_text())


def digests(folder: Path) -> dict[str, str]:
    return {p.name: sha256_file(p) for p in sorted(folder.iterdir())}


@pytest.fixture(scope="module")
def project(tmp_path_factory) -> Path:
    """The tiny project with every stage run for a DFlash drafter."""
    project = faults.make_project(tmp_path_factory.mktemp("dflash"))
    params(project)
    for stage in ("patch_check", "extract", "vocab_map", "train", "speculative_eval"):
        must_run(project, stage)
    return project


@pytest.mark.parametrize(
    ("dflash", "line"),
    [
        ({"block_size": 0}, "dflash.block_size: Input should be greater than or equal to 2 (got 0)"),
        ({"target_layers": [1, 40]}, "dflash.target_layers: layer ids [40] are outside the target"),
        ({"mask_token_id": 60000}, "dflash.mask_token_id: outside the target's vocabulary of 49152 tokens"),
    ],
)
def test_bad_dflash_params_fail_before_any_work(tmp_path, dflash, line):
    project = faults.make_project(tmp_path)
    params(project, dflash=dflash)
    assert line in refused(project, "patch_check")
    assert not (project / "artifacts").exists()


def test_the_stages_capture_and_train_the_dflash_layers(project):
    report = json.loads((project / "artifacts/patch-check/report.json").read_text())
    assert report["fingerprint"]["aux_layers"] == LAYERS
    manifest = json.loads((project / "artifacts/extract/manifest.json").read_text())
    assert manifest["aux_layers"] == LAYERS
    config = json.loads((project / "artifacts/train/drafter/config.json").read_text())
    assert config["architectures"] == ["DFlashDraftModel"]
    assert config["num_hidden_layers"] == 2 and config["block_size"] == 4
    # the mask token: SmolLM2's last unused special token
    assert config["dflash_config"] == {
        "target_layer_ids": LAYERS,
        "mask_token_id": 16,
        "mask_token": "<empty_output>",
    }
    train = metrics(project, "train")
    assert set(train["heldout"]) == {f"{m}_{k}" for m in ("acc", "loss") for k in range(3)}
    assert train["draft_vocab_size"] == 49152 and list(train["sim_shapes"]) == ["block 4"]


def test_vocab_map_writes_the_whole_vocabulary_whatever_vocab_size_says(project, tmp_path):
    assert metrics(project, "vocab-map")["coverage"] == 1.0
    assert metrics(project, "vocab-map")["draft_vocab_size"] == 49152
    before = digests(project / "artifacts/vocab-map")
    copy = copy_project(project, tmp_path)
    params(copy, vocab={"size": 4096})
    must_run(copy, "vocab_map")
    assert digests(copy / "artifacts/vocab-map") == before  # DVC finds train's input unchanged


def test_train_refuses_a_mapping_recorded_for_other_dflash_params(project, tmp_path):
    # train lists no dflash key: vocab-map records them in vocab.json, train's dep, and train
    # refuses a record that is not its params' (a hand run that skipped vocab-map)
    copy = copy_project(project, tmp_path)
    params(copy, dflash={"loss_decay": 2.0})
    before = digests(copy / "artifacts/train/drafter")
    line = refused(copy, "train")
    assert "was built for dflash.loss_decay 4.0, params have 2.0" in line and "dvc repro vocab-map" in line
    assert digests(copy / "artifacts/train/drafter") == before


def test_speculative_eval_decodes_losslessly_by_block_position(project):
    m = metrics(project, "speculative-eval")
    assert m["lossless"] is True and m["greedy_match"] == 1.0
    assert list(m["per_position_acceptance"]) == ["1", "2", "3"]  # block_size - 1 drafts a step
    assert m["untrained_steps"] == 0 and m["eval_coverage"] == 1.0
    assert "parity" not in m["per_domain"]["chat"]  # the TTT simulation is of EAGLE-3 drafters only


def test_a_drafter_of_the_other_family_is_refused_in_one_line(project, tmp_path):
    copy = copy_project(project, tmp_path)
    before = digests(copy / "artifacts/speculative-eval")
    params(copy, eval={"drafter": str(EAGLE3_DRAFTER)})
    line = refused(copy, "speculative_eval")
    assert f"eval.drafter: {EAGLE3_DRAFTER} is a eagle3 drafter, but drafter.kind is dflash" in line
    assert digests(copy / "artifacts/speculative-eval") == before
    params(copy, drafter={"kind": "eagle3"})  # the DFlash drafter and mapping, read as EAGLE-3's
    assert "is a dflash drafter, but drafter.kind is eagle3: re-run the train stage" in refused(
        copy, "speculative_eval"
    )
    assert "was made for a dflash drafter" in refused(copy, "train")
