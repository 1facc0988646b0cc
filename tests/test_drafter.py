"""The drafter: SGLang layout (names, shapes, config fields), cache semantics, export round trip."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch
from tiny_drafters import tiny_drafter_config

from eagle3.drafter import DrafterCache, DrafterConfig, Eagle3Drafter, export_drafter, load_drafter

H, V, K = 64, 512, 128

# What SGLang's LlamaForCausalLMEagle3 holds (python/sglang/srt/models/llama_eagle3.py): its
# load_weights fuses q/k/v into qkv_proj and gate/up into gate_up_proj, prefixes "model." to
# names that are not top-level, reads d2t (as hot_token_id = d2t + arange) and skips t2d.
SGLANG_PARAMS = {
    "model.fc.weight": lambda c: (c.hidden_size, 3 * c.target_hidden_size),
    "model.midlayer.input_layernorm.weight": lambda c: (c.hidden_size,),
    "model.midlayer.hidden_norm.weight": lambda c: (c.hidden_size,),
    "model.midlayer.post_attention_layernorm.weight": lambda c: (c.hidden_size,),
    "model.midlayer.self_attn.qkv_proj.weight": lambda c: (
        (c.num_attention_heads + 2 * c.num_key_value_heads) * c.head_dim,
        2 * c.hidden_size,
    ),
    "model.midlayer.self_attn.o_proj.weight": lambda c: (c.hidden_size, c.num_attention_heads * c.head_dim),
    "model.midlayer.mlp.gate_up_proj.weight": lambda c: (2 * c.intermediate_size, c.hidden_size),
    "model.midlayer.mlp.down_proj.weight": lambda c: (c.hidden_size, c.intermediate_size),
    "model.norm.weight": lambda c: (c.hidden_size,),
    "lm_head.weight": lambda c: (c.draft_vocab_size, c.hidden_size),
}
STACKED = [
    (".q_proj", ".qkv_proj"),
    (".k_proj", ".qkv_proj"),
    (".v_proj", ".qkv_proj"),
    (".gate_proj", ".gate_up_proj"),
    (".up_proj", ".gate_up_proj"),
]
# config.json fields the SGLang draft model (LlamaConfig + EAGLE-3 extras) reads
SGLANG_CONFIG_FIELDS = [
    "architectures",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "hidden_act",
    "rms_norm_eps",
    "rope_theta",
    "max_position_embeddings",
    "vocab_size",
    "draft_vocab_size",
    "tie_word_embeddings",
    "eagle_config",
    "fc_norm",
    "norm_output",
]


def tiny_config(k: int = K, **kw) -> DrafterConfig:
    return tiny_drafter_config(H, V, k, aux_layer_ids=[1, 3, 5], **kw)


def tiny_mapping(k: int = K) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    target_ids = torch.randperm(V, generator=g)[:k].sort().values
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[target_ids] = True
    return target_ids - torch.arange(k), t2d


def tiny_drafter(seed: int = 0, **kw) -> tuple[Eagle3Drafter, torch.Tensor]:
    torch.manual_seed(seed)
    embed = torch.randn(V, H)
    model = Eagle3Drafter(tiny_config(**kw), embed)
    model.set_vocab_mapping(*tiny_mapping())
    return model, embed


def _sglang_name(key: str) -> tuple[str, str | None]:
    for old, new in STACKED:
        if old in key:
            return "model." + key.replace(old, new), old
    return (key if key == "lm_head.weight" else "model." + key), None


@pytest.mark.parametrize("eagle31", [False, True])
def test_export_keys_and_shapes_match_sglang_loader(tmp_path, eagle31):
    model, _ = tiny_drafter(fc_norm=eagle31, norm_output=eagle31)
    export_drafter(model, tmp_path)
    from safetensors import safe_open

    with safe_open(str(tmp_path / "model.safetensors"), "pt") as f:
        shapes = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
    assert shapes.pop("d2t") == (K,) and shapes.pop("t2d") == (V,)
    assert not any(k.startswith("embed_tokens") for k in shapes)
    cfg = model.cfg
    # SGLang's LlamaModel builds fc_norm = ModuleList of 3 RMSNorm(target_hidden_size) with config.fc_norm
    params = SGLANG_PARAMS | (
        {f"model.fc_norm.{i}.weight": lambda c: (c.target_hidden_size,) for i in range(3)} if eagle31 else {}
    )
    covered: dict[str, int] = {}
    for key, shape in shapes.items():
        name, part = _sglang_name(key)
        assert name in params, f"{key} maps to {name}, which SGLang does not have"
        full = params[name](cfg)
        if part is None:
            assert shape == full, key
        else:  # a shard of a fused parameter: same input width, rows add up below
            assert shape[1:] == full[1:], key
        covered[name] = covered.get(name, 0) + shape[0]
    assert covered == {n: f(cfg)[0] for n, f in params.items()}


@pytest.mark.parametrize("eagle31", [False, True])
def test_config_json_has_sglang_fields(tmp_path, eagle31):
    model, _ = tiny_drafter(fc_norm=eagle31, norm_output=eagle31)
    export_drafter(model, tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    for field in SGLANG_CONFIG_FIELDS:
        assert field in config, field
    assert config["architectures"] == ["LlamaForCausalLMEagle3"]
    assert config["num_hidden_layers"] == 1 and config["tie_word_embeddings"] is False
    assert config["draft_vocab_size"] == K and config["vocab_size"] == V
    assert config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 3, 5]
    assert config["fc_norm"] is eagle31 and config["norm_output"] is eagle31
    # equal to hidden_size: left out, else the EAGLE reference keeps a random embedding
    assert "target_hidden_size" not in config
    assert DrafterConfig.from_hf_dict(config) == model.cfg


def _chain_logits(
    model: Eagle3Drafter, ids: torch.Tensor, aux: torch.Tensor, steps: int
) -> list[torch.Tensor]:
    """Prefill then `steps` one-token draft steps, each fed the previous output (the engine's chain)."""
    t = ids.shape[1] - steps
    cache = DrafterCache()
    hidden = model(ids[:, :t], model.project(aux[:, :t]), torch.arange(t)[None], cache)[:, -1:]
    out = [model.logits(hidden)]
    for i in range(steps):
        hidden = model(ids[:, t + i : t + i + 1], hidden, torch.tensor([[t + i]]), cache)
        out.append(model.logits(hidden))
    return out


@pytest.mark.parametrize("eagle31", [False, True])
def test_round_trip_gives_identical_logits(tmp_path, eagle31):
    model, embed = tiny_drafter(fc_norm=eagle31, norm_output=eagle31)
    if eagle31:  # non-trivial norm scales, so a dropped fc_norm would show
        with torch.no_grad():
            for norm in model.fc_norm:
                norm.weight.uniform_(0.5, 1.5)
    model.to(torch.bfloat16)
    export_drafter(model, tmp_path)
    loaded = load_drafter(tmp_path, embed, dtype=torch.bfloat16)
    ids = torch.randint(0, V, (2, 12))
    aux = torch.randn(2, 12, 3 * H, dtype=torch.bfloat16)
    pos = torch.arange(12)[None]
    with torch.no_grad():
        a = model.logits(model(ids, model.project(aux), pos))
        b = loaded.logits(loaded(ids, loaded.project(aux), pos))
        assert torch.equal(a, b)
        chain_a, chain_b = (
            _chain_logits(model, ids[:1], aux[:1], 3),
            _chain_logits(loaded, ids[:1], aux[:1], 3),
        )
    assert all(torch.equal(x, y) for x, y in zip(chain_a, chain_b, strict=True))
    assert torch.equal(loaded.d2t, model.d2t) and torch.equal(loaded.t2d, model.t2d)
    # deterministic bytes: exporting the loaded model again writes the same file
    export_drafter(loaded, tmp_path / "again")
    first, again = (tmp_path / "model.safetensors"), (tmp_path / "again/model.safetensors")
    assert again.read_bytes() == first.read_bytes()


def test_cache_matches_full_forward_and_crop():
    model, _ = tiny_drafter()
    model.double()
    ids = torch.randint(0, V, (1, 10))
    hidden = model.project(torch.randn(1, 10, 3 * H, dtype=torch.float64))
    pos = torch.arange(10)[None]
    with torch.no_grad():
        full = model(ids, hidden, pos)
        cache = DrafterCache()
        parts = [model(ids[:, :4], hidden[:, :4], pos[:, :4], cache)]
        for i in range(4, 10):
            parts.append(model(ids[:, i : i + 1], hidden[:, i : i + 1], pos[:, i : i + 1], cache))
        assert cache.length == 10
        torch.testing.assert_close(torch.cat(parts, 1), full, rtol=0, atol=1e-12)
        cache.crop(6)
        assert cache.length == 6
        again = model(ids[:, 6:], hidden[:, 6:], pos[:, 6:], cache)
        torch.testing.assert_close(again, full[:, 6:], rtol=0, atol=1e-12)
        # an explicit additive mask equal to the causal one gives the same result
        mask = torch.full((10, 10), float("-inf"), dtype=torch.float64).triu(1)[None, None]
        torch.testing.assert_close(model(ids, hidden, pos, attn_mask=mask), full, rtol=0, atol=1e-12)


def test_attention_strategy_is_passed_in():
    """The model knows no cache type: whatever `attend`s is used (composition, not subclasses)."""
    from eagle3.drafter.model import sdpa
    from eagle3.drafter.ttt_attention import TTTCache

    class Recording:
        def __init__(self) -> None:
            self.calls = 0

        def attend(self, q, k, v, attn_mask):
            self.calls += 1
            return sdpa(q, k, v, attn_mask)

    model, _ = tiny_drafter()
    ids, pos = torch.randint(0, V, (1, 6)), torch.arange(6)[None]
    hidden = model.project(torch.randn(1, 6, 3 * H))
    strategy = Recording()
    with torch.no_grad():
        assert torch.equal(model(ids, hidden, pos, strategy), model(ids, hidden, pos))
    assert strategy.calls == 1
    assert not isinstance(TTTCache(), DrafterCache) and not hasattr(TTTCache, "crop")


def test_to_target_ids_uses_d2t():
    model, _ = tiny_drafter()
    d2t, t2d = tiny_mapping()
    draft = torch.arange(K)
    target = model.to_target_ids(draft)
    assert torch.equal(target, torch.nonzero(t2d).flatten())


def test_embedding_frozen_and_shared():
    model, embed = tiny_drafter()
    assert not model.embed_tokens.weight.requires_grad
    assert model.embed_tokens.weight.data_ptr() == embed.data_ptr()
    with pytest.raises(ValueError, match="embed_weight has shape"):
        Eagle3Drafter(tiny_config(), torch.zeros(V + 1, H))


def test_bad_mapping_rejected():
    model, _ = tiny_drafter()
    d2t, t2d = tiny_mapping()
    with pytest.raises(ValueError, match="shapes"):
        model.set_vocab_mapping(d2t[:-1], t2d)
    bad = t2d.clone()
    bad[bad.nonzero()[0]] = False
    with pytest.raises(ValueError, match="inconsistent"):
        model.set_vocab_mapping(d2t, bad)


def test_norm_output_feeds_the_normed_state_and_norms_once():
    """norm_output: forward returns norm(stream) for the next step; logits are lm_head of it (one
    norm), so the first draft equals EAGLE-3's and only what the next step is fed changes."""
    plain, _ = tiny_drafter()
    post = Eagle3Drafter(replace(plain.cfg, norm_output=True), plain.embed_tokens.weight)
    post.load_state_dict(plain.state_dict())
    plain.double(), post.double()
    ids, pos = torch.randint(0, V, (1, 8)), torch.arange(8)[None]
    hidden = plain.project(torch.randn(1, 8, 3 * H, dtype=torch.float64))
    with torch.no_grad():
        pre, normed = plain(ids, hidden, pos), post(ids, hidden, pos)
        torch.testing.assert_close(normed, plain.norm(pre), rtol=0, atol=1e-12)
        torch.testing.assert_close(post.logits(normed), plain.logits(pre), rtol=0, atol=1e-12)
        assert not torch.allclose(post(ids, normed, pos + 1), plain.norm(plain(ids, pre, pos + 1)))


def test_fc_norm_normalises_each_aux_layer_before_fc():
    model, _ = tiny_drafter(fc_norm=True)
    model.double()
    with torch.no_grad():
        for norm in model.fc_norm:
            norm.weight.uniform_(0.5, 1.5)
    aux = torch.randn(2, 5, 3 * H, dtype=torch.float64)
    low, mid, high = aux.chunk(3, dim=-1)
    # Llama's RMSNorm (HF, SGLang, ours) normalises in float32, also for float64 inputs
    rms = lambda x: (x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-5)).double()  # noqa: E731
    w = [n.weight for n in model.fc_norm]
    expected = model.fc(torch.cat([w[0] * rms(low), w[1] * rms(mid), w[2] * rms(high)], dim=-1))
    with torch.no_grad():
        torch.testing.assert_close(model.project(aux), expected, rtol=0, atol=1e-12)
        # each layer's scale no longer matters (the point of fc_norm): scale one layer by 100
        scaled = torch.cat([low * 100, mid, high], dim=-1)
        torch.testing.assert_close(model.project(scaled), model.project(aux), rtol=0, atol=1e-4)  # eps
        assert (model.fc(scaled) - model.fc(aux)).abs().max() > 1  # without fc_norm it does


def test_intermediate_size_sets_the_mlp_width_and_is_exported(tmp_path):
    from transformers import LlamaConfig

    target = LlamaConfig(hidden_size=H, intermediate_size=256, num_attention_heads=4, vocab_size=V)
    assert DrafterConfig.from_target_config(target, K, [1, 3, 5]).intermediate_size == 256
    cfg = DrafterConfig.from_target_config(target, K, [1, 3, 5], intermediate_size=80)
    model = Eagle3Drafter(cfg, torch.randn(V, H))
    assert model.midlayer.mlp.gate_proj.weight.shape == (80, H)
    export_drafter(model, tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["intermediate_size"] == 80


@pytest.mark.slow
@pytest.mark.parametrize("setting", [dict(mode="chain", k=4), dict(mode="tree", k=3, topk=2, tree_budget=6)])
def test_eagle31_drafter_runs_in_the_unchanged_engine(setting):
    """The engine only calls forward / logits / project, so a 3.1 drafter decodes losslessly as is."""
    from test_decoding_fixtures import EOS, engine, prompts, random_drafter, tiny_target

    from eagle3.decoding.engine import greedy_decode

    target = tiny_target(seed=3)
    base = random_drafter(target, draft_vocab=64)
    drafter = Eagle3Drafter(
        replace(base.cfg, fc_norm=True, norm_output=True), target.get_input_embeddings().weight
    )
    drafter.set_vocab_mapping(base.d2t, base.t2d)
    spec = engine(target, drafter.double().eval().requires_grad_(False), **setting)
    for p in prompts(2, seed=4):
        assert spec.generate(p, 20, EOS).tokens == greedy_decode(target, p, 20, EOS).tokens


def test_rotary_frequencies_stay_float32_when_the_drafter_is_cast_to_bf16():
    drafter, _ = tiny_drafter()
    rotary = next(m for m in drafter.modules() if hasattr(m, "inv_freq"))
    exact = rotary.inv_freq.clone()
    assert exact.dtype == torch.float32
    drafter.to(torch.bfloat16)
    # a bf16 inv_freq would move a high-frequency pair by ~0.6 rad at position 300
    assert rotary.inv_freq.dtype == torch.float32 and torch.equal(rotary.inv_freq, exact)
    assert next(drafter.parameters()).dtype == torch.bfloat16
