"""The drafter: SGLang layout (names, shapes, config fields), cache semantics, export round trip."""

from __future__ import annotations

import json

import pytest
import torch

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
    "target_hidden_size",
    "tie_word_embeddings",
    "eagle_config",
]


def tiny_config(k: int = K) -> DrafterConfig:
    return DrafterConfig(
        hidden_size=H,
        intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        max_position_embeddings=256,
        hidden_act="silu",
        vocab_size=V,
        draft_vocab_size=k,
        target_hidden_size=H,
        aux_layer_ids=[1, 3, 5],
    )


def tiny_mapping(k: int = K) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    target_ids = torch.randperm(V, generator=g)[:k].sort().values
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[target_ids] = True
    return target_ids - torch.arange(k), t2d


def tiny_drafter(seed: int = 0) -> tuple[Eagle3Drafter, torch.Tensor]:
    torch.manual_seed(seed)
    embed = torch.randn(V, H)
    model = Eagle3Drafter(tiny_config(), embed)
    model.set_vocab_mapping(*tiny_mapping())
    return model, embed


def _sglang_name(key: str) -> tuple[str, str | None]:
    for old, new in STACKED:
        if old in key:
            return "model." + key.replace(old, new), old
    return (key if key == "lm_head.weight" else "model." + key), None


def test_export_keys_and_shapes_match_sglang_loader(tmp_path):
    model, _ = tiny_drafter()
    export_drafter(model, tmp_path)
    from safetensors import safe_open

    with safe_open(str(tmp_path / "model.safetensors"), "pt") as f:
        shapes = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
    assert shapes.pop("d2t") == (K,) and shapes.pop("t2d") == (V,)
    assert not any(k.startswith("embed_tokens") for k in shapes)
    cfg = model.cfg
    covered: dict[str, int] = {}
    for key, shape in shapes.items():
        name, part = _sglang_name(key)
        assert name in SGLANG_PARAMS, f"{key} maps to {name}, which SGLang does not have"
        full = SGLANG_PARAMS[name](cfg)
        if part is None:
            assert shape == full, key
        else:  # a shard of a fused parameter: same input width, rows add up below
            assert shape[1:] == full[1:], key
        covered[name] = covered.get(name, 0) + shape[0]
    assert covered == {n: f(cfg)[0] for n, f in SGLANG_PARAMS.items()}


def test_config_json_has_sglang_fields(tmp_path):
    model, _ = tiny_drafter()
    export_drafter(model, tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    for field in SGLANG_CONFIG_FIELDS:
        assert field in config, field
    assert config["architectures"] == ["LlamaForCausalLMEagle3"]
    assert config["num_hidden_layers"] == 1 and config["tie_word_embeddings"] is False
    assert config["draft_vocab_size"] == K and config["vocab_size"] == V
    assert config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 3, 5]
    assert DrafterConfig.from_hf_dict(config) == model.cfg


def test_round_trip_gives_identical_logits(tmp_path):
    model, embed = tiny_drafter()
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
