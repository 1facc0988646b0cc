"""A Kimi-architecture target through every stage: DeepSeek-V3 (MLA attention, MoE with a dense
first layer and a shared expert, YaRN RoPE) with Kimi's 163,840-entry vocabulary, tiny and
random (tests/tiny_targets.py), in its own layout and in Kimi-K2.5's (`text_config` nesting).

What is checked: capture on MoE layers (patch-check, both forms); SGLang's aux-layer-id rule for
this family, as a round trip through a transcription of SGLang 0.5.23's code; the drafter's shape
and RoPE from the target; our export against a published Kimi-K2 EAGLE-3 drafter config; and the
five stages run by DVC, lossless. Acceptance is not checked: with random weights it means nothing.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
import yaml
from conftest import SHAREGPT_SAMPLE
from project_copy import copy_code
from safetensors.torch import save_file
from test_export_loaders import FILE, TARGET, sglang_plan
from test_pipeline import REPO, dvc, run
from test_sglang import server_info
from tiny_targets import KIMI_ROPE, KIMI_VOCAB, TINY, build_deepseek_target, build_kimi_k25_target
from transformers import AutoConfig, DeepseekV3Config, LlamaConfig
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE, DeepseekV3RotaryEmbedding
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

from eagle3.core.layer_ids import layer_id_rule, serving_rule
from eagle3.core.params import TargetParams, default_aux_layers
from eagle3.decoding.engine import SpecEngine, greedy_decode
from eagle3.drafter import DrafterConfig, Eagle3Drafter, export_drafter
from eagle3.drafter.warm_start import read_init_drafter
from eagle3.sglang.server_args import check_server_args
from eagle3.target.capture import Captured
from eagle3.target.load import load_target, load_target_config
from eagle3.target.patch_check import PatchCheckError, run_patch_check

FIXTURES = Path(__file__).parent / "fixtures" / "public-drafters"
FORMS = ("deepseek-v3", "kimi-k2.5")


@pytest.fixture(scope="module")
def targets(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("targets")
    return {
        "deepseek-v3": build_deepseek_target(root / "deepseek-v3"),
        "kimi-k2.5": build_kimi_k25_target(root / "kimi-k2.5"),
    }


def target_params(folder: Path) -> TargetParams:
    return TargetParams(source=str(folder), dtype="float32")


# -- the target and capture ------------------------------------------------------------------------


@pytest.mark.slow
def test_both_layouts_load_as_the_same_language_model(targets):
    deepseek, kimi = (load_target(target_params(targets[form])) for form in FORMS)
    assert type(kimi.model).__name__ == "Kimi_K25ForConditionalGeneration"
    for target in (deepseek, kimi):
        assert (target.num_layers, target.hidden_size, target.vocab_size) == (8, 64, KIMI_VOCAB)
        moe = [isinstance(layer.mlp, DeepseekV3MoE) for layer in target.decoder_layers]
        assert moe == [False] + [True] * 7  # first_k_dense_replace: 1
    ids = deepseek.tokenizer("MLA, MoE and YaRN in one model.", return_tensors="pt").input_ids
    with torch.no_grad():
        logits = deepseek.model(ids).logits
        assert torch.equal(logits, kimi.model(ids).logits)
    # the rows past SmolLM2's 49,152 ids are zero: greedy decoding never picks one
    assert int(logits.argmax(-1).max()) < len(deepseek.tokenizer)


@pytest.mark.slow
@pytest.mark.parametrize("form", FORMS)
def test_patch_check_proves_capture_on_moe_layers(targets, form):
    target = load_target(target_params(targets[form]))
    aux = default_aux_layers(target.num_layers)
    assert aux == [1, 3, 4] and all(isinstance(target.decoder_layers[i].mlp, DeepseekV3MoE) for i in aux)
    report = run_patch_check(target, aux)
    assert report["passed"] and len(report["checks"]) == 3
    assert all(c["logits_bitwise_equal"] and c["states_bitwise_equal"] for c in report["checks"])
    fp = report["fingerprint"]
    assert (fp["num_layers"], fp["hidden_size"], fp["vocab_size"]) == (8, 64, KIMI_VOCAB)
    assert fp["aux_layers"] == aux
    assert report["sglang_aux_layer_ids"] == [1, 3, 4]  # first id 1: SGLang adds the 1 itself
    assert "deepseek" in report["convention"]


@contextmanager
def capture_layer_inputs(decoder_layers, final_norm, layer_ids: list[int]) -> Iterator[Captured]:
    """A wrong capture: for id L the input of layer L (SGLang's hook point L), not its output."""
    captured, inputs = Captured(), {}

    def keep(i: int):
        def hook(_module, args, kwargs):
            inputs[i] = args[0] if args else kwargs["hidden_states"]

        return hook

    def publish(_module, _inputs, output):
        captured.last, captured.aux = output, [inputs[i] for i in sorted(layer_ids)]

    handles = [decoder_layers[i].register_forward_pre_hook(keep(i), with_kwargs=True) for i in layer_ids]
    handles.append(final_norm.register_forward_hook(publish))
    try:
        yield captured
    finally:
        for handle in handles:
            handle.remove()


@pytest.mark.slow
@pytest.mark.parametrize("form", FORMS)
def test_patch_check_catches_a_capture_one_layer_off(targets, form):
    target = load_target(target_params(targets[form]))
    with pytest.raises(PatchCheckError, match=r"aux layer 1 differs from the reference hidden_states\[2\]"):
        run_patch_check(target, [1, 3, 4], capture=capture_layer_inputs)


@pytest.mark.slow
@pytest.mark.parametrize("form", FORMS)
def test_speculative_decoding_is_lossless_on_moe_and_mla(targets, form):
    """Chain and tree (with a lookup branch) verification through MLA's cache and MoE routing give
    plain greedy's tokens, in float64 (the loader then runs the MoE experts one by one)."""
    target = load_target(TargetParams(source=str(targets[form]), dtype="float64"))
    cfg = DrafterConfig.from_target_config(target.config, KIMI_VOCAB, default_aux_layers(target.num_layers))
    torch.manual_seed(0)
    drafter = Eagle3Drafter(cfg, target.model.get_input_embeddings().weight).double().eval()
    prompt = target.tokenizer("Kimi drafts, DeepSeek verifies, and the answer stays the same.").input_ids
    greedy = greedy_decode(target.model, prompt, 12, frozenset())
    for mode, lookup in (("chain", 0), ("tree", 2)):
        engine = SpecEngine.for_target(
            target, drafter, mode=mode, k=2, topk=4, tree_budget=6, lookup_tokens=lookup
        )
        assert engine.generate(prompt, 12, frozenset()).tokens == greedy.tokens


# -- SGLang's aux-layer ids for DeepSeek / Kimi ----------------------------------------------------


def sglang_capture(architecture: str, layer_ids: list[int] | None, num_layers: int) -> list[int]:
    """The decoder layers whose outputs SGLang 0.5.23 captures for a drafter config's
    eagle_aux_hidden_state_layer_ids, transcribed from its source:
    python/sglang/srt/models/deepseek_v2.py DeepseekV2ForCausalLM.set_eagle3_layers_to_capture
    (kimi_k25.py KimiK25ForConditionalGeneration.set_eagle3_layers_to_capture hands the ids to
    that, unchanged) and models/llama.py LlamaForCausalLM.set_eagle3_layers_to_capture. Both
    capture at hook point W the residual stream entering layer W, i.e. the output of layer W - 1
    (DeepseekV2Model.forward: `captured_last_layer_outputs` when `i in self.layers_to_capture`)."""
    deepseek = serving_rule({"architectures": [architecture]}).family == "deepseek"
    if layer_ids is None:
        hooks = [2, num_layers // 2, num_layers - 3]
    elif deepseek and not (layer_ids and layer_ids[0] == 1):
        hooks = list(layer_ids)
    else:
        hooks = [val + 1 for val in layer_ids]
    return [w - 1 for w in hooks]


@pytest.mark.parametrize(
    "architecture", ["DeepseekV3ForCausalLM", "KimiK25ForConditionalGeneration", "LlamaForCausalLM"]
)
@pytest.mark.parametrize("ids", [[1, 29, 57], [2, 30, 58], [3, 10, 20], [1, 2, 3], [5, 30, 59]])
def test_written_ids_make_sglang_capture_our_layers(architecture, ids):
    rule = serving_rule({"architectures": [architecture]})
    written = rule.to_sglang(ids)
    assert sglang_capture(architecture, written, 61) == ids
    assert rule.from_sglang(written) == ids


def test_default_aux_layers_are_what_sglang_captures_without_ids():
    for n in (8, 61):
        assert sglang_capture("DeepseekV3ForCausalLM", None, n) == default_aux_layers(n)
    assert default_aux_layers(61) == [1, 29, 57]  # Kimi-K2/K2.5 and DeepSeek-V3: 61 layers


def test_published_drafters_ids_read_as_sglang_reads_them():
    """SpecForge's Kimi-K2 drafter lists [2, 30, 58], its DeepSeek-V3 drafter [1, 29, 57]: on a
    DeepSeek target SGLang 0.5.23 captures the same layers for both (read as Llama ids they
    would be one layer apart)."""
    deepseek = layer_id_rule("DeepseekV3ForCausalLM")
    for name in ("specforge-kimi-k2-eagle3.json", "specforge-deepseek-v3-671b-eagle3.json"):
        config = json.loads((FIXTURES / name).read_text())
        written = config["eagle_config"]["eagle_aux_hidden_state_layer_ids"]
        assert deepseek.from_sglang(written) == [1, 29, 57]
        assert sglang_capture("DeepseekV3ForCausalLM", written, 61) == [1, 29, 57]
        kimi = DeepseekV3Config(**TINY | {"num_hidden_layers": 61})
        assert DrafterConfig.from_hf_dict(config, kimi).aux_layer_ids == [1, 29, 57]
    assert layer_id_rule("LlamaForCausalLM").from_sglang([2, 30, 58]) == [2, 30, 58]


def test_a_published_kimi_drafter_as_warm_start_reads_its_ids_by_the_targets_rule(tmp_path):
    """train.init of SpecForge's Kimi-K2 drafter, whose config records no family ([2, 30, 58]):
    on a Kimi target its ids are the layers SGLang captures, [1, 29, 57], not the Llama reading.
    (Only the tensors read_init_drafter checks, at their real sizes; no 1.2B weights.)"""
    folder = tmp_path / "kimi-k2-eagle3"
    folder.mkdir()
    config = json.loads((FIXTURES / "specforge-kimi-k2-eagle3.json").read_text())
    (folder / "config.json").write_text(json.dumps(config))
    tensors = {
        "d2t": torch.zeros(config["draft_vocab_size"], dtype=torch.int64),
        "t2d": torch.zeros(config["vocab_size"], dtype=torch.bool),
        "fc.weight": torch.zeros(1, 1),
        "lm_head.weight": torch.zeros(1, 1),
    }
    save_file(tensors, str(folder / "model.safetensors"))
    kimi = DeepseekV3Config(**TINY | {"num_hidden_layers": 61})
    assert read_init_drafter(str(folder), kimi).cfg.aux_layer_ids == [1, 29, 57]
    assert read_init_drafter(str(folder)).cfg.aux_layer_ids == [2, 30, 58]  # what it read before


def test_extraction_servers_are_checked_in_sglang_form():
    """--return-aux-hidden-state-layer-ids goes through the same set_eagle3_layers_to_capture."""
    rule, aux = layer_id_rule("KimiK25ForConditionalGeneration"), [2, 3, 5]
    info = server_info("aux") | {"return_aux_hidden_state_layer_ids": [3, 4, 6]}
    check_server_args("http://s", info, "aux", aux, rule)
    with pytest.raises(
        ValueError, match="resolve to \\[2, 3, 5\\]: --return-aux-hidden-state-layer-ids 3 4 6"
    ):
        check_server_args("http://s", info | {"return_aux_hidden_state_layer_ids": aux}, "aux", aux, rule)


def test_layer_0_cannot_be_asked_of_sglang_on_deepseek():
    rule = layer_id_rule("DeepseekV3ForCausalLM")
    with pytest.raises(ValueError, match="aux layer 0 cannot be captured on deepseek targets"):
        rule.to_sglang([0, 3, 4])
    cfg = DrafterConfig.from_target_config(DeepseekV3Config(**TINY), 300, [0, 3, 4])
    with pytest.raises(ValueError, match="aux layer 0 cannot be captured"):
        cfg.to_hf_dict()  # no export SGLang would read wrong (patch-check refuses it before extract)


# -- the drafter from the target ------------------------------------------------------------------


@pytest.mark.parametrize("form", FORMS)
def test_drafter_takes_the_targets_yarn_and_a_llama_head_width(targets, form, tmp_path):
    target_config = load_target_config(target_params(targets[form]))
    cfg = DrafterConfig.from_target_config(target_config, 32000, [2, 3, 5])
    text = target_config.get_text_config()
    assert text.head_dim == TINY["qk_rope_head_dim"]  # transformers' MLA head_dim: the RoPE part
    assert cfg.head_dim == TINY["hidden_size"] // TINY["num_attention_heads"] == 16
    assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.intermediate_size) == (4, 4, 128)
    assert cfg.rope_parameters == KIMI_ROPE and cfg.max_position_embeddings == 262144
    assert cfg.layer_id_family == "deepseek" and cfg.sglang_aux_layer_ids == [3, 4, 6]
    drafter = Eagle3Drafter(cfg, torch.zeros(KIMI_VOCAB, 64))
    export_drafter(drafter, tmp_path)
    exported = json.loads((tmp_path / "config.json").read_text())
    assert exported["eagle_config"] == {
        "eagle_aux_hidden_state_layer_ids": [3, 4, 6],
        "layer_id_family": "deepseek",
    }
    assert exported["rope_scaling"] == {k: v for k, v in KIMI_ROPE.items() if k != "rope_theta"}
    assert DrafterConfig.from_hf_dict(exported) == cfg
    # YaRN's attention factor (mscale / mscale_all_dim) is the target's; the exported config
    # rebuilds the drafter's rotary exactly (transformers 5 reads rope_parameters)
    rotary = drafter.midlayer.self_attn.rotary.embedding
    assert rotary.attention_scaling == DeepseekV3RotaryEmbedding(text).attention_scaling
    x, pos = torch.randn(1, 4, 5, cfg.head_dim), torch.tensor([[0, 7, 4096, 100000, 262000]])
    loaded = LlamaRotaryEmbedding(AutoConfig.from_pretrained(tmp_path))
    for ours, theirs in zip(rotary(x, pos), loaded(x, pos), strict=True):
        assert torch.equal(ours, theirs)


def test_export_keys_match_a_published_kimi_drafter():
    """Our export for a Kimi-K2.5-shaped target against SpecForge's Kimi-K2 EAGLE-3 drafter config
    (tests/fixtures/public-drafters/README.md): every key an EAGLE-3 loader reads is there."""
    public = json.loads((FIXTURES / "specforge-kimi-k2-eagle3.json").read_text())
    kimi = DeepseekV3Config(
        **TINY
        | dict(
            hidden_size=7168,
            intermediate_size=18432,
            num_hidden_layers=61,
            num_attention_heads=64,
            num_key_value_heads=64,
            q_lora_rank=1536,
            kv_lora_rank=512,
            qk_nope_head_dim=128,
            qk_rope_head_dim=64,
            v_head_dim=128,
        )
    )
    ours = DrafterConfig.from_target_config(kimi, 32000, default_aux_layers(61)).to_hf_dict()
    # keys of theirs that no EAGLE-3 loader reads: token ids, HF training/generation leftovers
    # (max_window_layers, sliding_window and use_sliding_window come from a Qwen2 config)
    unread = {
        "bos_token_id",
        "eos_token_id",
        "initializer_range",
        "attention_dropout",
        "max_window_layers",
        "sliding_window",
        "use_sliding_window",
        "use_cache",
        "transformers_version",
    }
    assert set(public) - set(ours) == unread
    # ours adds: explicit biases off, transformers 5's rope_parameters, EAGLE-3.1's switches
    assert set(ours) - set(public) == {"mlp_bias", "rope_parameters", "fc_norm", "norm_output"}
    same = ("architectures", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
    same += ("num_key_value_heads", "vocab_size", "draft_vocab_size", "tie_word_embeddings", "hidden_act")
    same += ("attention_bias", "torch_dtype")
    assert {k: ours[k] for k in same} == {k: public[k] for k in same}
    # theirs says use_aux_hidden_state: true, SGLang's default when the key is absent (ours)
    assert public["eagle_config"]["use_aux_hidden_state"] is True
    assert "use_aux_hidden_state" not in ours["eagle_config"]
    # the same captured layers, written as SGLang 0.5.23 reads them on a DeepSeek target
    rule = layer_id_rule("KimiK25ForConditionalGeneration")
    ids = "eagle_aux_hidden_state_layer_ids"
    assert rule.from_sglang(ours["eagle_config"][ids]) == rule.from_sglang(public["eagle_config"][ids])
    # differences by decision (docs/scale-out.md, "DeepSeek-V3 / Kimi-K2 / Kimi-K2.5 targets"):
    # head_dim is hidden / heads
    # (theirs 128: settable); RoPE and context are the target's (theirs: theta 1e6, no scaling,
    # a Qwen config's); model_type llama so transformers can read ours (theirs: kimi_k2)
    assert (ours["head_dim"], public["head_dim"]) == (112, 128)
    assert ours["rope_scaling"]["rope_type"] == "yarn" and public["rope_scaling"] is None
    assert (ours["model_type"], public["model_type"]) == ("llama", "kimi_k2")
    LlamaConfig(**ours)  # transformers reads it (the EAGLE reference and vLLM go through it)


# -- the five stages, as DVC runs them --------------------------------------------------------------

PIPELINE = {
    "target": {"dtype": "float32"},
    "data": {"source": str(SHAREGPT_SAMPLE), "num_samples": 6, "max_length": 40},
    "extract": {"shard_samples": 3, "batch_tokens": 128},
    "vocab": {"size": 32000},
    "train": {"epochs": 1, "dtype": "float32", "seq_len": 64},
    # two MT-bench prompts x 8 tokens, the engine against plain greedy (no prompt-lookup peer)
    "eval": {
        "domains": {"chat": 1},  # one MT-bench conversation: its first and second turn
        "max_new_tokens": 8,
        "dtype": "float32",
        "drafter_dtype": "float32",
        "prompt_lookup": False,
    },
}


@pytest.mark.parametrize(
    ("form", "aux", "last_stage"),
    [
        # the default aux layers (written as is), every stage
        ("deepseek-v3", None, "speculative-eval"),
        # Kimi-K2.5's layout with ids SGLang must get + 1, up to the export (its decoding is
        # test_speculative_decoding_is_lossless_on_moe_and_mla's; one eval stage is enough here)
        ("kimi-k2.5", [2, 3, 5], "train"),
    ],
)
@pytest.mark.slow
def test_every_stage_runs_on_a_kimi_architecture_target(targets, tmp_path, form, aux, last_stage):
    root = tmp_path / "project"
    copy_code(root)
    params = yaml.safe_load((REPO / "params.yaml").read_text())
    for section, values in PIPELINE.items():
        params[section].update(values)
    params["target"]["source"] = str(targets[form])
    params["extract"]["aux_layers"] = aux
    (root / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    run(["git", "init", "-q"], root)
    dvc("init", "-q", cwd=root)
    dvc("repro", last_stage, cwd=root)

    aux = aux or [1, 3, 4]  # EAGLE-3's default for 8 layers
    report = json.loads((root / "artifacts/patch-check/report.json").read_text())
    assert report["passed"] and report["fingerprint"]["aux_layers"] == aux
    assert all(c["logits_bitwise_equal"] and c["states_bitwise_equal"] for c in report["checks"])
    manifest = json.loads((root / "artifacts/extract/manifest.json").read_text())
    assert manifest["aux_layers"] == aux
    vocab = json.loads((root / "metrics/vocab-map.json").read_text())
    assert (vocab["draft_vocab_size"], vocab["target_vocab_size"]) == (32000, KIMI_VOCAB)

    drafter = root / "artifacts/train/drafter"
    exported = json.loads((drafter / "config.json").read_text())
    # SGLang's loader rules (tests/test_export_loaders.py): the target's embedding, our K-row head
    plan = sglang_plan(drafter)
    assert (plan.embedding, plan.lm_head, plan.fc_in) == (TARGET, FILE, 3 * 64)
    assert not (plan.ignored or plan.uninitialised or plan.bad_shapes)
    # ... and its aux ids make SGLang capture the layers extraction captured
    written = exported["eagle_config"]["eagle_aux_hidden_state_layer_ids"]
    assert sglang_capture("DeepseekV3ForCausalLM", written, 8) == manifest["aux_layers"]
    assert exported["head_dim"] == 16 and exported["rope_scaling"]["factor"] == KIMI_ROPE["factor"]

    if last_stage == "speculative-eval":
        metrics = json.loads((root / "metrics/speculative-eval.json").read_text())
        assert metrics["lossless"] is True and metrics["greedy_match"] == 1.0
        # the train stage's simulation on the eval's own text, beside the measured share (parity.py)
        chat = metrics["per_domain"]["chat"]["parity"]
        assert metrics["parity_shape"] == "tree 1/8/8" and set(chat) == {"acceptance_length", "1"}
        assert chat["1"]["simulated"] == chat["1"]["measured"] and metrics["parity_gaps"] == []
        assert set(json.loads((root / "metrics/domains.json").read_text())) == {"chat", "x"}
