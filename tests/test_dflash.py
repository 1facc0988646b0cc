"""The DFlash block drafter at tiny sizes: its params, the block-wise loss (anchors, mask, labels),
training on a tiny target's own continuations, and decoding that is lossless and accepts blocks."""

from __future__ import annotations

import functools
import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from test_decoding_fixtures import EOS, LAYERS, V, prompts, tiny_target
from tiny_drafters import tiny_drafter_config
from transformers import AutoTokenizer

from eagle3.core.inputs import InputError
from eagle3.core.params import Params, ParamsError, check_against_target, parse_params, resolve_aux_layers
from eagle3.decoding.dflash import DFlashEngine
from eagle3.decoding.engine import greedy_decode
from eagle3.drafter.dflash import ContextCache, DFlashConfig, DFlashDrafter, resolve_mask_token
from eagle3.drafter.dflash_cost import dflash_params, dflash_training_memory
from eagle3.drafter.dflash_export import check_drafter_kind, drafter_kind, export_dflash, load_dflash
from eagle3.drafter.export import export_drafter
from eagle3.sweep.plan import plan, read_target_config
from eagle3.target.capture import capture_hidden_states
from eagle3.target.load import resolve_target
from eagle3.train.data import Batch
from eagle3.train.dflash import BlockModel, batch_anchors, block_mask, position_weights, sample_anchors

pytestmark = pytest.mark.usefixtures("one_thread")
KIMI = Path(__file__).parent / "fixtures" / "kimi-k2.5"

LAYER_IDS = [0, 2]
BLOCK = 4
MASK = 5


def config(target, **overrides) -> DFlashConfig:
    fields = dict(
        num_layers=2, block_size=BLOCK, target_layer_ids=LAYER_IDS, mask_token_id=MASK, mask_token=None
    )
    return DFlashConfig.from_target_config(target.config, **(fields | overrides))


# --- params ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        (
            {"dflash": {"block_size": 0}},
            "dflash.block_size: Input should be greater than or equal to 2 (got 0)",
        ),
        (
            {"dflash": {"num_layers": 0}},
            "dflash.num_layers: Input should be greater than or equal to 1 (got 0)",
        ),
        ({"dflash": {"target_layers": [3, 3]}}, "dflash.target_layers: must be distinct layer ids >= 0"),
        ({"drafter": {"kind": "medusa"}}, "drafter.kind: Input should be 'eagle3' or 'dflash'"),
        (
            {"drafter": {"kind": "dflash"}, "extract": {"aux_layers": [1, 2, 3]}},
            "extract.aux_layers ([1, 2, 3]) are the EAGLE-3 drafter's; a DFlash drafter reads "
            "dflash.target_layers",
        ),
        (
            {"drafter": {"kind": "dflash"}, "train": {"init": "drafters/x"}},
            "train.init (drafters/x) warm-starts an EAGLE-3 drafter",
        ),
    ],
)
def test_bad_dflash_params_are_refused_in_one_line(raw, expected):
    with pytest.raises(ParamsError) as err:
        parse_params(raw)
    assert expected in err.value.one_line()


def test_against_the_target_layers_and_the_mask_token_are_checked():
    params = parse_params({"drafter": {"kind": "dflash"}, "dflash": {"target_layers": [1, 14, 29]}})
    with pytest.raises(ParamsError, match=r"dflash.target_layers: layer ids \[29\] are outside the target"):
        check_against_target(params, num_layers=30, vocab_size=49152)
    params = parse_params({"drafter": {"kind": "dflash"}, "dflash": {"mask_token_id": 49152}})
    with pytest.raises(ParamsError, match="dflash.mask_token_id: outside the target's vocabulary of 49152"):
        check_against_target(params, num_layers=30, vocab_size=49152)
    # the same keys mean nothing to an EAGLE-3 run
    eagle = parse_params({"dflash": {"mask_token_id": 10**6}})
    assert check_against_target(eagle, num_layers=30, vocab_size=49152) == [1, 14, 26]


def test_the_captured_layers_follow_the_drafter_family():
    dflash = parse_params({"drafter": {"kind": "dflash"}})
    # SGLang's build_target_layer_ids: z-lab's Qwen3-4B/8B drafters read [1, 9, 17, 25, 33] of 36
    assert resolve_aux_layers(dflash, 36) == [1, 9, 17, 25, 33]
    assert resolve_aux_layers(dflash, 30) == [1, 8, 14, 20, 27]
    one = parse_params({"drafter": {"kind": "dflash"}, "dflash": {"num_layers": 1}})
    assert resolve_aux_layers(one, 30) == [15]
    listed = parse_params({"drafter": {"kind": "dflash"}, "dflash": {"target_layers": [20, 3]}})
    assert resolve_aux_layers(listed, 30) == [3, 20]
    assert resolve_aux_layers(parse_params({}), 30) == [1, 14, 26]


def test_the_mask_token_defaults_to_an_unused_special_token():
    tokenizer = AutoTokenizer.from_pretrained(resolve_target("smollm2-135m-instruct"))
    assert resolve_mask_token(tokenizer, 49152) == (16, "<empty_output>")
    assert resolve_mask_token(tokenizer, 49152, 5) == (5, "<file_sep>")
    with pytest.raises(ValueError, match="dflash.mask_token_id: outside"):
        resolve_mask_token(tokenizer, 49152, 49152)


# --- the block-wise loss --------------------------------------------------------------------------


def test_anchors_are_assistant_tokens_drawn_the_same_for_a_sample():
    mask = torch.tensor([0, 0, 1, 1, 1, 0, 1, 1, 1, 1], dtype=torch.bool)
    draw = functools.partial(sample_anchors, mask, 9, 3)
    a = draw(torch.Generator().manual_seed(7))
    assert len(a) == 3 and a.tolist() == sorted(a.tolist())
    assert all(mask[i] and i + 1 < 9 for i in a.tolist())
    assert torch.equal(a, draw(torch.Generator().manual_seed(7)))
    assert sample_anchors(mask, 9, 100, torch.Generator()).tolist() == [2, 3, 4, 6, 7]


def test_batch_anchors_depend_on_the_sample_not_on_its_batch():
    ids = torch.arange(20).view(2, 10)
    mask = torch.ones(2, 10, dtype=torch.bool)
    real = torch.ones(2, 10, dtype=torch.bool)
    batch = Batch(ids, mask, real, real, torch.arange(10).expand(2, 10), torch.zeros(2, 10, 8))
    a, keep = batch_anchors(batch, [11, 12], 3, seed=0, epoch=1)
    b, _ = batch_anchors(
        Batch(*(t.flip(0) for t in (ids, mask, real, real)), batch.position_ids, batch.aux_hidden),
        [12, 11],
        3,
        seed=0,
        epoch=1,
    )
    assert torch.equal(a, b.flip(0)) and keep.all()
    other, _ = batch_anchors(batch, [11, 12], 3, seed=0, epoch=2)
    assert not torch.equal(a, other)  # another epoch, other blocks


def test_a_block_sees_the_context_before_its_anchor_and_its_own_block():
    anchors = torch.tensor([[2, 5]])
    keep = torch.tensor([[True, True]])
    real = torch.tensor([[True] * 7 + [False]])
    mask = block_mask(anchors, keep, real, 3)[0, 0]
    assert mask.shape == (6, 8 + 6)
    assert mask[0, :8].tolist() == [True, True] + [False] * 6  # block 0: context 0, 1
    assert mask[3, :8].tolist() == [True] * 5 + [False] * 3  # block 1: context 0..4
    own = mask[:, 8:]
    assert own[:3, :3].all() and own[3:, 3:].all() and not own[:3, 3:].any() and not own[3:, :3].any()
    padded = block_mask(anchors, torch.tensor([[True, False]]), real, 3)[0, 0]
    assert not padded[3:, :8].any()  # a padded anchor sees no context


def test_position_weights_decay_from_the_first_draft():
    w = position_weights(5, 4.0)
    assert w[0] == 1 and torch.allclose(w, torch.exp(-torch.arange(4.0) / 4))
    assert torch.equal(position_weights(5, None), torch.ones(4))


def features(target, seqs: list[list[int]]) -> Batch:
    """A batch of the sequences with the target's features, every token an assistant token."""
    ids = torch.tensor(seqs)
    with torch.no_grad(), capture_hidden_states(target.model.layers, target.model.norm, LAYER_IDS) as cap:
        target(ids)
    real = torch.ones_like(ids, dtype=torch.bool)
    pos = torch.arange(ids.shape[1]).expand_as(ids)
    return Batch(ids, real.clone(), real, real, pos, cap.aux_hidden().float(), cap.last.float())


def test_training_drafts_what_decoding_drafts():
    """The block of anchor a in training (a masked forward over every block at once) equals the
    decoding step at a: context 0..a-1 in the drafter's cache, the block at a..a+B-1."""
    target = tiny_target(dtype=torch.float32, seed=2)
    batch = features(target, [prompts(1, length=16, seed=2)[0]])
    torch.manual_seed(0)
    drafter = DFlashDrafter(config(target)).eval()
    model = BlockModel(drafter, target.get_input_embeddings().weight, target.lm_head.weight, 4.0)
    anchors, keep = torch.tensor([[3, 9]]), torch.ones(1, 2, dtype=torch.bool)
    ctx = drafter.context(batch.aux_hidden, batch.position_ids)
    n = anchors.shape[1]
    ids = torch.full((1, n, BLOCK), MASK)
    ids[0, :, 0] = batch.input_ids[0, anchors[0]]
    pos = (anchors[:, :, None] + torch.arange(BLOCK)).view(1, -1)
    trained = drafter(model.embed[ids.view(1, -1)], pos, ctx, block_mask(anchors, keep, batch.real, BLOCK))
    engine = DFlashEngine(target, drafter, target.model.layers, target.model.norm)
    for j, a in enumerate(anchors[0].tolist()):
        cache = ContextCache(len(drafter.layers))
        kv = cache.append(drafter.context(batch.aux_hidden[:, :a], torch.arange(a)[None]))
        embeds = engine.embed(ids[:, j])
        decoded = drafter(embeds, torch.arange(a, a + BLOCK)[None], kv)
        assert torch.allclose(decoded[0], trained[0, j * BLOCK : (j + 1) * BLOCK], atol=1e-5)


def test_labels_count_assistant_tokens_inside_the_sample():
    target = tiny_target(dtype=torch.float32)
    batch = features(target, prompts(1, length=8))
    batch.loss_mask[0, 5] = False
    batch.real[0, 7] = False
    model = BlockModel(
        DFlashDrafter(config(target)), target.get_input_embeddings().weight, target.lm_head.weight, None
    )
    b, n, k, p, _ = model.label_rows(batch, torch.tensor([[2, 4]]), torch.tensor([[True, True]]))
    # anchor 2 drafts 3, 4, (5: no assistant token); anchor 4 drafts (5), 6, (7: padding)
    assert p.tolist() == [3, 4, 6] and k.tolist() == [0, 1, 1] and n.tolist() == [0, 0, 1]


@functools.cache
def fitted_pair(steps: int = 150) -> tuple:
    """A float64 tiny target and a DFlash drafter trained with the block-wise loss on the target's
    own greedy continuations of prompts(8); with its top-1 agreement per block position before and
    after training."""
    target = tiny_target(seed=0)
    seqs = [p + greedy_decode(target, p, 30, frozenset()).tokens for p in prompts(8)]
    batch = features(target.float(), seqs)
    target.double()
    torch.manual_seed(1)
    drafter = DFlashDrafter(config(target, num_layers=1))
    embed, head = target.get_input_embeddings().weight.float(), target.lm_head.weight.float()
    model = BlockModel(drafter, embed, head, 4.0)
    opt = torch.optim.Adam(drafter.parameters(), lr=1e-2)
    accuracy = []
    for step in range(steps):
        anchors, keep = batch_anchors(batch, list(range(8)), 16, seed=0, epoch=step)
        loss, stats = model(batch, anchors, keep)
        opt.zero_grad()
        loss.backward()
        opt.step()
        accuracy.append(stats.correct / stats.count)
    return target, drafter.double().eval().requires_grad_(False), accuracy


def test_the_block_wise_loss_trains_a_drafter_that_decodes_losslessly_and_accepts_blocks():
    target, drafter, accuracy = fitted_pair()
    # every block position learns the target's argmax (3 of 320 tokens at chance)
    assert (accuracy[0] < 0.05).all() and (accuracy[-1] > 0.5).all()
    engine = DFlashEngine(target, drafter, target.model.layers, target.model.norm)
    assert engine.max_depth == BLOCK - 1
    accepted = []
    for p in prompts(8)[:4]:
        out = engine.generate(p, 30, EOS)
        assert out.tokens == greedy_decode(target, p, 30, EOS).tokens
        accepted += out.accepted
    assert sum(accepted) / len(accepted) >= 1.0  # a step accepts more than one draft on average
    assert any(0 < a < BLOCK - 1 for a in accepted) and BLOCK - 1 in accepted  # partial and whole blocks


def test_a_random_drafter_is_lossless_and_sampling_runs():
    target = tiny_target(seed=3)
    torch.manual_seed(4)
    drafter = DFlashDrafter(config(target, mask_token_id=V - 2)).to(torch.bfloat16).eval()
    engine = DFlashEngine(target, drafter, target.model.layers, target.model.norm)
    for p in prompts(3, seed=4):
        assert engine.generate(p, 25, EOS).tokens == greedy_decode(target, p, 25, EOS).tokens
    sampler = DFlashEngine(target, drafter.double(), target.model.layers, target.model.norm, temperature=0.8)
    out = sampler.generate(prompts(1)[0], 20, frozenset())
    assert len(out.tokens) == 20 and all(0 <= t < V for t in out.tokens)
    with pytest.raises(ValueError, match="trained for another target"):
        DFlashEngine(
            target,
            DFlashDrafter(config(target, target_layer_ids=[LAYERS])),
            target.model.layers,
            target.model.norm,
        )


# --- export and costs -----------------------------------------------------------------------------


def test_the_export_round_trips_and_names_its_family(tmp_path):
    target = tiny_target(dtype=torch.float32)
    drafter = DFlashDrafter(config(target, mask_token="<m>"))
    export_dflash(drafter, tmp_path / "d", dtype=torch.float32)
    again = load_dflash(tmp_path / "d", torch.float32)
    assert again.cfg == drafter.cfg
    for name, tensor in drafter.state_dict().items():
        assert torch.equal(again.state_dict()[name], tensor), name
    d = json.loads((tmp_path / "d" / "config.json").read_text())
    assert d["architectures"] == ["DFlashDraftModel"] and d["block_size"] == BLOCK
    assert d["dflash_config"] == {"target_layer_ids": LAYER_IDS, "mask_token_id": MASK, "mask_token": "<m>"}
    assert drafter_kind(tmp_path / "d") == "dflash"
    export_drafter(_eagle3(), tmp_path / "e")
    assert drafter_kind(tmp_path / "e") == "eagle3"
    with pytest.raises(InputError, match="is a eagle3 drafter, but drafter.kind is dflash"):
        check_drafter_kind(tmp_path / "e", "dflash")
    export_dflash(drafter, tmp_path / "same", dtype=torch.float32)  # deterministic bytes
    assert (tmp_path / "same" / "model.safetensors").read_bytes() == (
        tmp_path / "d" / "model.safetensors"
    ).read_bytes()


def _eagle3():
    from eagle3.drafter import Eagle3Drafter

    return Eagle3Drafter(tiny_drafter_config())


def test_costs_count_the_modules_the_drafter_builds():
    target = tiny_target(dtype=torch.float32)
    cfg = config(target)
    drafter = DFlashDrafter(cfg)
    assert dflash_params(cfg)["trainable"] == sum(p.numel() for p in drafter.parameters())
    p = parse_params({}).train
    small = dflash_training_memory(cfg, p, 8, 1, (torch.float32, False))
    large = dflash_training_memory(cfg, p, 64, 1, (torch.float32, False))
    assert large["activations"] > small["activations"] and large["weights_frozen"] == small["weights_frozen"]


# --- eagle3 plan ----------------------------------------------------------------------------------


def test_the_plan_prices_the_dflash_drafter_beside_eagle3s_for_smollm2_and_kimi():
    smollm2 = read_target_config("smollm2-135m-instruct")
    result = plan(parse_params({"drafter": {"kind": "dflash"}}), smollm2)["dflash"]
    assert result["active"] and result["config"]["target_layer_ids"] == [1, 8, 14, 20, 27]
    cfg = DFlashConfig.from_target_config(SimpleNamespace(**smollm2), 5, 8, [1, 8, 14, 20, 27], 16)
    assert result["params"]["trainable"] == sum(p.numel() for p in DFlashDrafter(cfg).parameters())
    assert result["params"]["frozen"] == 2 * 49152 * 576  # the target's embedding and whole lm_head
    assert result["store_bytes_per_token"] == 6 * 576 * 2 + 10  # five layers and last_hidden, bf16
    # one block of 7 drafts against EAGLE-3's 7 steps over an 8,192-token draft vocabulary
    assert result["flops"]["draft_step"] > result["flops"]["eagle3_steps_same_drafts"] > 0
    kimi = plan(Params(), read_target_config(str(KIMI)), world=8)["dflash"]
    assert not kimi["active"] and kimi["config"]["target_layer_ids"] == [1, 15, 30, 44, 58]
    assert kimi["params"]["frozen"] == 2 * 163840 * 7168
    assert kimi["memory_gib_per_device"]["total_fsdp"] < kimi["memory_gib_per_device"]["total_ddp"]


# --- serving ----------------------------------------------------------------------------------------


def test_serve_command_and_sglang_eval_take_the_dflash_launch(tmp_path):
    from eagle3.cli.commands.serve import serve_commands
    from eagle3.sglang.evaluate import SpecServer, drafter_refusal
    from eagle3.sglang.speculative import dflash_shape

    target = tiny_target(dtype=torch.float32)
    export_dflash(DFlashDrafter(config(target)), tmp_path / "d", dtype=torch.float32)
    params = parse_params({"drafter": {"kind": "dflash"}, "eval": {"drafter": str(tmp_path / "d")}})
    commands = serve_commands(params, tp=8)
    folder = (tmp_path / "d").resolve()
    assert f"--speculative-algorithm DFLASH --speculative-draft-model-path {folder}" in commands["sglang"]
    assert "--speculative-num-steps" not in commands["sglang"] and "--tp 8" in commands["sglang"]
    assert f'"method":"dflash","model":"{folder}","num_speculative_tokens":{BLOCK - 1}' in commands["vllm"]
    assert f"a DFlash block of {BLOCK}" in commands["notes"]
    # eval.backend sglang serves it as DFLASH, checks one block a step, counts block - 1 positions
    spec = SpecServer.of(tmp_path / "d", dflash_shape(BLOCK))
    assert (spec.kind, spec.algorithm, spec.depth) == ("dflash", "DFLASH", BLOCK - 1)
    assert spec.flags == ["--speculative-algorithm", "DFLASH", "--speculative-draft-model-path", str(folder)]
    layers = target.config.num_hidden_layers
    fits = SimpleNamespace(hidden_size=target.config.hidden_size, num_hidden_layers=layers, vocab_size=V)
    assert drafter_refusal(tmp_path / "d", fits) is None
    narrower = SimpleNamespace(**(vars(fits) | {"hidden_size": target.config.hidden_size * 2}))
    assert "drafts through the target's embedding and head" in drafter_refusal(tmp_path / "d", narrower)
    shallow = SimpleNamespace(**(vars(fits) | {"num_hidden_layers": max(LAYER_IDS) + 1}))
    assert "cannot be one" in drafter_refusal(tmp_path / "d", shallow)
    # an EAGLE-3 drafter where drafter.kind is dflash: refused in one line, naming both
    export_drafter(_eagle3(), tmp_path / "e")
    with pytest.raises(InputError, match="--drafter: .* is a eagle3 drafter, but drafter.kind is dflash"):
        serve_commands(params, str(tmp_path / "e"))
