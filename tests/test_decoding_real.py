"""One end-to-end check on the real default target (SmolLM2-135M-Instruct) in float64."""

from __future__ import annotations

import pytest
import torch

from eagle3.core.params import TargetParams, default_aux_layers
from eagle3.decoding.engine import SpecEngine, greedy_decode
from eagle3.decoding.prompts import load_prompts
from eagle3.drafter import DrafterConfig, Eagle3Drafter
from eagle3.target.load import eos_token_ids
from eagle3.target.render import render_prompt, user_turn

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def smollm2():
    from eagle3.target.load import load_target

    try:
        return load_target(TargetParams(dtype="float64"))
    except (FileNotFoundError, ImportError, OSError) as err:
        pytest.skip(f"default target not available: {err}")


@pytest.mark.parametrize("setting", [dict(mode="chain", k=3), dict(mode="tree", k=3, topk=3, tree_budget=8)])
def test_smollm2_float64_speculative_equals_greedy(smollm2, setting):
    target = smollm2
    cfg = DrafterConfig.from_target_config(target.config, 2048, default_aux_layers(target.num_layers))
    torch.manual_seed(0)
    embed = target.model.get_input_embeddings().weight
    drafter = Eagle3Drafter(cfg, embed).double().eval().requires_grad_(False)
    engine = SpecEngine.for_target(target, drafter, **setting)
    prompt = render_prompt(target.tokenizer, user_turn(load_prompts(None, 1)[0].text), chat=True).tolist()
    eos = eos_token_ids(target.model, target.tokenizer)
    base = greedy_decode(target.model, prompt, 10, eos)
    assert engine.generate(prompt, 10, eos).tokens == base.tokens


def test_a_second_drafter_on_the_loaded_target_decodes_as_if_loaded_alone():
    """bench/drafters.py compares two drafters on one loaded (and packed) target: the second
    must draft exactly as it does when it is loaded with a target of its own."""
    from pathlib import Path

    from eagle3.decoding.setup import DecodingSetup

    shipped = Path(__file__).parents[1] / "drafters" / "smollm2-135m-instruct-full"
    target = TargetParams(dtype="float32")
    try:
        alone = DecodingSetup.load(target, shipped, "bfloat16")
    except (FileNotFoundError, ImportError, OSError) as err:
        pytest.skip(f"default target not available: {err}")
    untrained = DecodingSetup.load(target, None, "bfloat16")
    second = untrained.with_drafter(shipped)
    assert second.target is untrained.target and second.drafter_dtype == torch.bfloat16
    prompt = alone.render(load_prompts(None, 1))[0][1]
    settings = dict(mode="tree", k=2, topk=4, tree_budget=6)
    runs = [s.engine(**settings).generate(prompt, 24, s.eos) for s in (alone, second, untrained)]
    assert runs[0].tokens == runs[1].tokens and runs[0].accepted == runs[1].accepted
    assert sum(runs[1].accepted) > sum(runs[2].accepted)  # the trained drafter, not the untrained one
