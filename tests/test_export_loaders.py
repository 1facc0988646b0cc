"""Every reference decoder reads our export the way we mean it.

Each `*_plan` function restates one loader's rules, as read in its source, and applies them to
a real exported drafter (config.json + model.safetensors): which embedding and lm_head the
loader ends up with, which EAGLE-3.1 switches it turns on, which file tensors it drops without a
word and which of its parameters the file leaves at their initial values. Sources read:

- SGLang: python/sglang/srt/models/llama_eagle3.py (LlamaForCausalLMEagle3.__init__ and
  load_weights, LlamaModel.__init__: fc_norm, norm_output), models/llama.py (set_embed) and
  speculative/eagle_worker.py (init_lm_head: set_embed, or set_embed_and_head when
  load_lm_head_from_target).
- vLLM: vllm/model_executor/models/llama_eagle3.py (Eagle3LlamaForCausalLM.load_weights,
  LlamaModel.__init__, the post-norm/fc_norm version of vllm-project/vllm#42764),
  models/utils.py (process_eagle_weight) and the EAGLE proposer's load_model (shares the
  target's embedding / lm_head unless the checkpoint has its own, different one).
- EAGLE reference: SafeAILab/EAGLE eagle/model/cnets.py (Model.__init__) and ea_model.py
  (EaModel: load_state_dict(strict=False)).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from tiny_drafters import tiny_drafter_config

from eagle3.drafter import DrafterConfig, Eagle3Drafter, export_drafter, load_drafter
from eagle3.drafter.export import load_drafter_config, trained_ttt_length

H, V, K = 64, 512, 128
TARGET = "target"  # the loader uses the target model's tensor
FILE = "file"  # ... the tensor shipped in model.safetensors
RANDOM = "random"  # ... its own freshly initialised one (a silent failure)
EMBEDDING = "embedding"  # lm_head only: the (target's) embedding matrix, V rows


@dataclass
class Plan:
    """What a loader does with an export."""

    embedding: str
    lm_head: str
    fc_in: int  # input width of the fc it builds
    fc_norm: bool
    norm_output: bool
    ignored: set[str] = field(default_factory=set)  # file tensors dropped silently
    uninitialised: set[str] = field(default_factory=set)  # its parameters the file does not fill
    bad_shapes: set[str] = field(default_factory=set)


def _read(folder: Path) -> tuple[dict, dict[str, tuple[int, ...]]]:
    cfg = json.loads((folder / "config.json").read_text())
    with safe_open(str(folder / "model.safetensors"), "pt") as f:
        shapes = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
    return cfg, shapes


def _llama_eagle3_params(cfg: dict, target_hidden: int, fc_norm: bool, head_dim: int) -> dict:
    """Parameter name (file namespace, unfused) -> shape of the one-layer EAGLE-3 Llama draft."""
    h, heads, kv = cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
    inter, v = cfg["intermediate_size"], cfg["vocab_size"]
    k = cfg.get("draft_vocab_size") or v
    mid = "midlayer."
    params = {
        "embed_tokens.weight": (v, h),
        "fc.weight": (h, 3 * target_hidden),
        "norm.weight": (h,),
        "lm_head.weight": (k, h),
        mid + "self_attn.q_proj.weight": (heads * head_dim, 2 * h),
        mid + "self_attn.k_proj.weight": (kv * head_dim, 2 * h),
        mid + "self_attn.v_proj.weight": (kv * head_dim, 2 * h),
        mid + "self_attn.o_proj.weight": (h, heads * head_dim),
        mid + "mlp.gate_proj.weight": (inter, h),
        mid + "mlp.up_proj.weight": (inter, h),
        mid + "mlp.down_proj.weight": (h, inter),
    }
    for norm in ("input_layernorm", "hidden_norm", "post_attention_layernorm"):
        params[f"{mid}{norm}.weight"] = (h,)
    if fc_norm:
        n_aux = len(cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"])
        params |= {f"fc_norm.{i}.weight": (target_hidden,) for i in range(n_aux)}
    return params


def _account(plan: Plan, params: dict, shapes: dict, shared: set[str]) -> Plan:
    loaded = {n: s for n, s in shapes.items() if n not in ("d2t", "t2d")}
    plan.ignored = set(loaded) - set(params)
    plan.uninitialised = set(params) - set(loaded) - shared
    plan.bad_shapes = {n for n in set(loaded) & set(params) if loaded[n] != params[n]}
    return plan


def sglang_plan(folder: Path) -> Plan:
    cfg, shapes = _read(folder)
    h = cfg["hidden_size"]
    # LlamaForCausalLMEagle3.__init__: a tied config makes the embedding the lm_head; a missing
    # draft_vocab_size sets load_lm_head_from_target (init_lm_head then installs the target's).
    if cfg.get("tie_word_embeddings", False):  # transformers' LlamaConfig default is false
        lm_head = EMBEDDING
    elif cfg.get("draft_vocab_size") is None:
        lm_head = TARGET
    else:
        lm_head = FILE if "lm_head.weight" in shapes else RANDOM
    # LlamaModel: fc width from target_hidden_size if the attribute exists; llama.py set_embed
    # returns early (keeps the draft's own) when it exists and differs from hidden_size.
    target_hidden = cfg.get("target_hidden_size", h)
    own = target_hidden != h
    embedding = (FILE if "embed_tokens.weight" in shapes else RANDOM) if own else TARGET
    fc_norm = bool(cfg.get("fc_norm") or cfg.get("use_aux_norm"))
    plan = Plan(embedding, lm_head, 3 * target_hidden, fc_norm, bool(cfg.get("norm_output", False)))
    head_dim = cfg.get("head_dim") or h // cfg["num_attention_heads"]
    params = _llama_eagle3_params(cfg, target_hidden, fc_norm, head_dim)
    shared = {"embed_tokens.weight"} if embedding == TARGET else set()
    if lm_head != FILE:  # tied: no lm_head parameter of its own, so load_weights skips the file's
        params.pop("lm_head.weight")
    return _account(plan, params, shapes, shared)


def vllm_plan(folder: Path, target_embed: torch.Tensor, target_head: torch.Tensor) -> Plan:
    cfg, shapes = _read(folder)
    h = cfg["hidden_size"]
    # load_weights: t2d dropped, d2t -> draft_id_to_target_id, "model." prefixed to the rest but
    # lm_head; process_eagle_weight flags own embed_tokens / lm_head from the names.
    names = {n for n in shapes if n != "t2d"}
    own_embed = any("embed_tokens" in n for n in names)
    own_head = any("lm_head" in n for n in names)
    with safe_open(str(folder / "model.safetensors"), "pt") as f:
        # the proposer shares the target's anyway when the file's copy is identical
        same_embed = own_embed and torch.equal(f.get_tensor("embed_tokens.weight"), target_embed)
        same_head = own_head and torch.equal(f.get_tensor("lm_head.weight"), target_head)
    embedding = TARGET if not own_embed or same_embed else FILE
    lm_head = TARGET if not own_head or same_head else FILE
    eagle = cfg.get("eagle_config") or {}
    target_hidden = cfg.get("target_hidden_size", h)  # getattr(config, "target_hidden_size", hidden)
    n_aux = len(eagle.get("eagle_aux_hidden_state_layer_ids") or [0, 0, 0])
    fc_norm = bool(cfg.get("fc_norm", False))
    plan = Plan(embedding, lm_head, n_aux * target_hidden, fc_norm, bool(cfg.get("norm_output", False)))
    head_dim = cfg.get("head_dim") or h // cfg["num_attention_heads"]
    params = _llama_eagle3_params(cfg, target_hidden, fc_norm, head_dim)
    if eagle.get("norm_before_fc", cfg.get("norm_before_fc", False)):
        params["input_norm.weight"] = (n_aux * target_hidden,)
    shared = {"embed_tokens.weight"} if embedding == TARGET else set()
    plan = _account(plan, params, shapes, shared | ({"lm_head.weight"} if lm_head == TARGET else set()))
    # vLLM's AutoWeightsLoader raises on a name it has no parameter for: loud, not ignored
    assert not plan.ignored, f"vLLM would refuse {sorted(plan.ignored)}"
    return plan


def eagle_reference_plan(folder: Path) -> Plan:
    cfg, shapes = _read(folder)
    h = cfg["hidden_size"]
    # Model.__init__(load_emb=True): copies the target's embedding only without target_hidden_size;
    # EaModel then load_state_dict(strict=False): a missing embed_tokens.weight stays random.
    if "target_hidden_size" in cfg:
        embedding = FILE if "embed_tokens.weight" in shapes else RANDOM
        target_hidden = cfg["target_hidden_size"]
    else:
        embedding, target_hidden = TARGET, h
    lm_head = FILE if "lm_head.weight" in shapes else RANDOM  # nn.Linear(hidden, draft_vocab_size)
    # no fc_norm / norm_output in cnets.py: the flags are not read, fc_norm.* dropped by strict=False
    plan = Plan(embedding, lm_head, 3 * target_hidden, fc_norm=False, norm_output=False)
    params = _llama_eagle3_params(cfg, target_hidden, False, h // cfg["num_attention_heads"])
    shared = {"embed_tokens.weight"} if embedding == TARGET else set()
    return _account(plan, params, shapes, shared)


# --- a real exported drafter -------------------------------------------------------------------------


def config(**kw) -> DrafterConfig:
    sizes = {"hidden_size": H, "vocab_size": V, "draft_vocab_size": K, "intermediate_size": 96}
    return tiny_drafter_config(**(sizes | {"aux_layer_ids": [1, 3, 5]} | kw))


def target_tensors() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    return torch.randn(V, H, generator=g), torch.randn(V, H, generator=g)


def exported(folder: Path, cfg: DrafterConfig) -> tuple[Eagle3Drafter, Path]:
    torch.manual_seed(0)
    embed, _ = target_tensors()
    model = Eagle3Drafter(cfg, None if cfg.owns_embedding else embed)
    g = torch.Generator().manual_seed(1)
    ids = torch.randperm(V, generator=g)[:K].sort().values
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[ids] = True
    model.set_vocab_mapping(ids - torch.arange(K), t2d)
    export_drafter(model, folder, dtype=torch.float32)
    return model, folder


EAGLE31 = [
    pytest.param({}, id="eagle3"),
    pytest.param({"fc_norm": True, "norm_output": True}, id="eagle3.1"),
    pytest.param({"intermediate_size": 40}, id="narrow-mlp"),
]


# --- SGLang -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("options", EAGLE31)
def test_sglang_uses_target_embedding_our_lm_head_and_our_switches(tmp_path, options):
    model, folder = exported(tmp_path, config(**options))
    plan = sglang_plan(folder)
    assert (plan.embedding, plan.lm_head) == (TARGET, FILE)
    assert (plan.fc_norm, plan.norm_output) == (model.cfg.fc_norm, model.cfg.norm_output)
    assert plan.fc_in == model.fc.in_features
    assert not plan.ignored and not plan.uninitialised and not plan.bad_shapes


def test_sglang_rules_flag_the_silent_failures(tmp_path):
    """The plan catches the two configs that break SGLang quietly (so the test above means something)."""
    _, folder = exported(tmp_path, config())
    cfg = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(cfg | {"tie_word_embeddings": True}))
    assert sglang_plan(folder).lm_head == EMBEDDING  # the V x H embedding instead of our K rows
    assert "lm_head.weight" in sglang_plan(folder).ignored
    cfg.pop("draft_vocab_size")
    (folder / "config.json").write_text(json.dumps(cfg))
    assert sglang_plan(folder).lm_head == TARGET


# --- vLLM -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("options", EAGLE31)
def test_vllm_uses_target_embedding_our_lm_head_and_our_switches(tmp_path, options):
    model, folder = exported(tmp_path, config(**options))
    embed, head = target_tensors()
    plan = vllm_plan(folder, embed, head)
    assert (plan.embedding, plan.lm_head) == (TARGET, FILE)
    assert (plan.fc_norm, plan.norm_output) == (model.cfg.fc_norm, model.cfg.norm_output)
    assert plan.fc_in == model.fc.in_features
    assert not plan.uninitialised and not plan.bad_shapes
    # vLLM prefixes "model." itself: an exported "model.*" name would become "model.model.*"
    assert not any(n.startswith("model.") for n in _read(folder)[1])


def test_vllm_and_sglang_read_d2t_as_offsets(tmp_path):
    model, folder = exported(tmp_path, config())
    with safe_open(str(folder / "model.safetensors"), "pt") as f:
        d2t = f.get_tensor("d2t")
    # vLLM compute_logits: targets = arange(K) + draft_id_to_target_id;
    # SGLang load_weights: hot_token_id = d2t + arange(K)
    assert torch.equal(torch.arange(K) + d2t, model.to_target_ids(torch.arange(K)))


# --- EAGLE reference (SafeAILab/EAGLE) -----------------------------------------------------------------


@pytest.mark.parametrize("options", [pytest.param({}, id="eagle3"), pytest.param({"intermediate_size": 40})])
def test_eagle_reference_copies_the_target_embedding(tmp_path, options):
    model, folder = exported(tmp_path, config(**options))
    cfg = json.loads((folder / "config.json").read_text())
    assert "target_hidden_size" not in cfg  # equal to hidden_size: omitted
    plan = eagle_reference_plan(folder)
    assert (plan.embedding, plan.lm_head) == (TARGET, FILE)
    assert plan.fc_in == model.fc.in_features
    assert not plan.ignored and not plan.uninitialised and not plan.bad_shapes


def test_eagle_reference_cannot_run_eagle31_drafters(tmp_path):
    """cnets.py has neither switch: it would drop fc_norm.* and feed pre-norm states (documented)."""
    _, folder = exported(tmp_path, config(fc_norm=True, norm_output=True))
    plan = eagle_reference_plan(folder)
    assert plan.ignored == {"fc_norm.0.weight", "fc_norm.1.weight", "fc_norm.2.weight"}
    assert not plan.norm_output


# --- a drafter of another width: its own embedding, read from the file by all three ------------------------


def test_other_width_ships_its_embedding_and_every_loader_reads_it(tmp_path):
    cfg = config(hidden_size=48, head_dim=12, target_hidden_size=H)
    model, folder = exported(tmp_path, cfg)
    config_json, shapes = _read(folder)
    assert config_json["target_hidden_size"] == H and shapes["embed_tokens.weight"] == (V, 48)
    embed, head = target_tensors()
    for plan in (sglang_plan(folder), vllm_plan(folder, embed, head), eagle_reference_plan(folder)):
        assert (plan.embedding, plan.lm_head) == (FILE, FILE)
        assert plan.fc_in == 3 * H and not plan.uninitialised and not plan.bad_shapes
    loaded = load_drafter(folder, None, dtype=torch.float32)
    ids, aux, pos = torch.randint(0, V, (1, 6)), torch.randn(1, 6, 3 * H), torch.arange(6)[None]
    with torch.no_grad():
        assert torch.equal(
            loaded.logits(loaded(ids, loaded.project(aux), pos)),
            model.logits(model(ids, model.project(aux), pos)),
        )


# --- our own loader keeps reading old exports ---------------------------------------------------------------


def test_old_exports_still_load(tmp_path):
    """Exports written before this change: target_hidden_size equal to hidden_size, no 3.1 keys."""
    model, folder = exported(tmp_path, config())
    cfg = json.loads((folder / "config.json").read_text())
    for key in ("fc_norm", "norm_output"):
        cfg.pop(key)
    (folder / "config.json").write_text(json.dumps(cfg | {"target_hidden_size": H}))
    assert load_drafter_config(folder) == model.cfg
    embed, _ = target_tensors()
    loaded = load_drafter(folder, embed, dtype=torch.float32)
    assert torch.equal(loaded.lm_head.weight, model.lm_head.weight)


def test_the_trained_ttt_length_rides_where_loaders_ignore_it(tmp_path):
    """eagle_config.ttt_length: every loader plans the same as without it, our config reads the
    same, and the rule on eval.k reads it; an export without it falls back as before."""
    model, folder = exported(tmp_path / "old", config())
    assert trained_ttt_length(folder, default=1) == 1  # no key, no params.yaml: the current params
    recorded = tmp_path / "new"
    export_drafter(model, recorded, dtype=torch.float32, ttt_length=3)
    raw = json.loads((recorded / "config.json").read_text())
    assert raw["eagle_config"]["ttt_length"] == 3 and trained_ttt_length(recorded, default=1) == 3
    assert sglang_plan(recorded) == sglang_plan(folder)
    assert eagle_reference_plan(recorded) == eagle_reference_plan(folder)
    assert load_drafter_config(recorded) == load_drafter_config(folder)


# --- the drafters this repository ships --------------------------------------------------------------

SHIPPED = sorted(p.parent for p in (Path(__file__).resolve().parents[1] / "drafters").glob("*/config.json"))


@pytest.mark.parametrize("folder", SHIPPED, ids=[p.name for p in SHIPPED])
def test_shipped_drafters_load_right_under_every_loader(folder, smollm2):
    """SGLang, vLLM and the EAGLE reference all give a shipped drafter the target's embedding and
    its own lm_head, and our engine loads it against the packaged target."""
    embed = smollm2.model.get_input_embeddings().weight
    head = smollm2.model.get_output_embeddings().weight
    for plan in (sglang_plan(folder), vllm_plan(folder, embed, head)):
        assert (plan.embedding, plan.lm_head) == (TARGET, FILE)
        assert not plan.uninitialised and not plan.bad_shapes
    cfg = load_drafter_config(folder)
    if not (cfg.fc_norm or cfg.norm_output):  # the EAGLE reference has no EAGLE-3.1
        assert (eagle_reference_plan(folder).embedding, eagle_reference_plan(folder).lm_head) == (
            TARGET,
            FILE,
        )
    drafter = load_drafter(folder, embed, dtype=torch.float32)
    assert drafter.cfg.vocab_size == smollm2.vocab_size
    assert (folder / "params.yaml").exists() and (folder / "metrics.json").exists()
