"""patch-check passes on the real target and fails when capture is invasive or reads the wrong layer."""

from __future__ import annotations

from contextlib import contextmanager

import pytest
from conftest import made_up_fingerprint

from eagle3.core.inputs import InputError
from eagle3.target.capture import capture_hidden_states
from eagle3.target.fingerprint import Fingerprint
from eagle3.target.patch_check import PatchCheckError, run_patch_check

AUX = [1, 14, 26]


def test_patch_check_passes_and_fingerprints(smollm2):
    report = run_patch_check(smollm2, AUX)
    fp = report["fingerprint"]
    assert report["passed"] and fp["aux_layers"] == AUX
    assert (fp["num_layers"], fp["hidden_size"], fp["vocab_size"]) == (30, 576, 49152)
    assert len(fp["target_sha256"]) == 64 and len(fp["tokenizer_sha256"]) == 64
    assert run_patch_check(smollm2, AUX) == report  # deterministic
    # the report's object is the type's, key for key: an SGLang engine's keys absent, torch's there
    assert set(fp) == {
        "engine", "engine_version", "torch_version", "target_source", "target_sha256",
        "tokenizer_sha256", "num_layers", "hidden_size", "vocab_size", "aux_layers", "dtype",
    }  # fmt: skip
    typed = Fingerprint.from_json(fp, "report.json")
    assert typed.to_json() == fp and typed.aux_layers == tuple(AUX) and typed.servers is None


def test_a_fingerprint_without_a_key_is_refused_by_name():
    fp = made_up_fingerprint().to_json()
    assert Fingerprint.from_json(fp, "report.json") == made_up_fingerprint()
    del fp["tokenizer_sha256"]
    refused = r"^report.json: the fingerprint has no tokenizer_sha256; run patch-check again$"
    with pytest.raises(InputError, match=refused):
        Fingerprint.from_json(fp, "report.json")
    with pytest.raises(InputError, match="report.json: the fingerprint is not a JSON object"):
        Fingerprint.from_json(None, "report.json")


def test_invasive_capture_is_caught(smollm2):
    @contextmanager
    def invasive(layers, norm, ids):
        handle = layers[ids[0]].register_forward_hook(
            lambda m, i, out: (out[0] if isinstance(out, tuple) else out).mul_(1.001)
        )
        with capture_hidden_states(layers, norm, ids) as captured:
            yield captured
        handle.remove()

    with pytest.raises(PatchCheckError, match="capture is invasive"):
        run_patch_check(smollm2, AUX, capture=invasive)


def test_capture_of_the_wrong_layer_is_caught(smollm2):
    def off_by_one(layers, norm, ids):  # the classic HF-index vs layer-id mistake
        return capture_hidden_states(layers, norm, [i + 1 for i in ids])

    with pytest.raises(PatchCheckError, match="captured aux layer 1 differs"):
        run_patch_check(smollm2, AUX, capture=off_by_one)
