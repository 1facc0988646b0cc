"""The fp8 feature store (extract.store_dtype: float8_e4m3fn): aux_hidden and last_hidden kept as
float8_e4m3fn with a float32 scale per token row (row amax / 448), read back as bf16.

What is checked: the shards' hidden-state bytes are half the bf16 ones plus 4 bytes a row per
tensor; the round trip is within e4m3's rounding (3 mantissa bits: a relative error of at most
2^-4 an element, 2^-4 + 2^-8 with bf16's rounding of the result); a zero row stays zero; a real
extraction gives byte-identical shards twice, equal to quantizing the bf16 store's shards; a
damaged fp8 shard is refused like a bf16 one; training runs on an fp8 store.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from conftest import SHAREGPT_SAMPLE, made_up_fingerprint
from test_train import tiny_inputs, tiny_params

from eagle3.core.params import ParamsError, parse_params
from eagle3.core.stageio import write_json
from eagle3.data.extract import config_hash, extract_features
from eagle3.data.store import (
    FP8,
    MANIFEST,
    SCALES,
    SCHEMA_VERSION,
    CorruptStoreError,
    FeatureStore,
    Sample,
    write_shard,
)
from eagle3.target.patch_check import fingerprint
from eagle3.train.loop import train_drafter

H = 64
AUX = [1, 14, 26]
# e4m3 keeps 3 mantissa bits: rounding to nearest is off by at most half a step, 2^-4 of the
# value; the dequantized float32 is rounded to bf16 (8 bits: 2^-9) once more. Elements below
# e4m3's smallest normal (2^-6 x the row's scale) are rounded to its subnormal steps of 2^-9:
# off by at most 2^-10 x the scale.
REL = 2**-4 + 2**-8
SUBNORMAL = 2**-10


def tensor_bytes(path: Path) -> dict[str, int]:
    """Bytes of each tensor in a safetensors file, from its header."""
    raw = path.read_bytes()
    header = json.loads(raw[8 : 8 + int.from_bytes(raw[:8], "little")])
    return {k: v["data_offsets"][1] - v["data_offsets"][0] for k, v in header.items() if k != "__metadata__"}


def states(t: int, width: int, g: torch.Generator) -> torch.Tensor:
    """bf16 rows shaped like a decoder's: mostly O(1), a few outlier columns, row scales from
    1e-3 to 1e3, and one all-zero row."""
    rows = torch.randn(t, width, generator=g)
    rows[:, :3] *= 200  # massive activations in fixed channels
    rows *= 10 ** torch.empty(t, 1).uniform_(-3, 3, generator=g)
    rows[t // 2] = 0
    return rows.bfloat16()


def samples(n: int, top_n: int | None = None, seed: int = 0) -> list[Sample]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        t = int(torch.randint(5, 30, (1,), generator=g))
        ids = torch.randint(0, 100, (t,), generator=g).int()
        mask = (torch.rand(t, generator=g) > 0.3).to(torch.uint8)
        aux = states(t, 3 * H, g)
        if top_n is None:
            out.append(Sample(ids, mask, aux, states(t, H, g)))
        else:
            logprobs = torch.rand(t, top_n, generator=g).log().sort(-1, descending=True).values
            out.append(
                Sample(ids, mask, aux, None, torch.randint(0, 100, (t, top_n), generator=g).int(), logprobs)
            )
    return out


def store_of(folder: Path, shards: list[list[Sample]], dtype: str, top_n: int | None = None) -> FeatureStore:
    """A store of `shards` as extraction writes one (manifest dtype, target_topk)."""
    folder.mkdir(parents=True)
    entries = [write_shard(folder, j, group, dtype) for j, group in enumerate(shards)]
    manifest = {"schema_version": SCHEMA_VERSION, "fingerprint": {}, "aux_layers": [1, 2, 3], "dtype": dtype}
    write_json(folder / MANIFEST, manifest | {"shards": entries} | ({"target_topk": top_n} if top_n else {}))
    return FeatureStore(folder)


def fp8_copy(source: FeatureStore, folder: Path) -> FeatureStore:
    """`source` (a bf16 store) quantized shard by shard into an fp8 store."""
    groups, start = [], 0
    for entry in source.shards:
        groups.append([Sample(**source.sample(i)) for i in range(start, start + entry["samples"])])
        start += entry["samples"]
    folder.mkdir(parents=True)
    entries = [write_shard(folder, j, group, FP8) for j, group in enumerate(groups)]
    manifest = {k: v for k, v in source.manifest.items() if k not in ("shards", "checksum")}
    write_json(folder / MANIFEST, manifest | {"shards": entries, "dtype": FP8})
    return FeatureStore(folder)


def row_errors(got: torch.Tensor, want: torch.Tensor) -> torch.Tensor:
    """Per row: |got - want| / |want| (L2), 0 for a zero row."""
    err = (got.float() - want.float()).norm(dim=-1)
    return err / want.float().norm(dim=-1).clamp_min(torch.finfo(torch.float32).tiny)


@pytest.mark.parametrize("top_n", [None, 5], ids=["last_hidden", "top-N"])
def test_fp8_shard_holds_half_the_hidden_state_bytes_plus_a_scale_per_row(tmp_path, top_n):
    group = samples(6, top_n)
    rows = sum(len(s.input_ids) for s in group)
    for name, dtype in (("bf16", "bfloat16"), ("fp8", FP8)):
        (tmp_path / name).mkdir()
        write_shard(tmp_path / name, 0, group, dtype)
    bf16 = tensor_bytes(tmp_path / "bf16" / "shard-00000.safetensors")
    fp8 = tensor_bytes(tmp_path / "fp8" / "shard-00000.safetensors")
    quantized = [k for k in SCALES if k in bf16]
    assert quantized == (["aux_hidden", "last_hidden"] if top_n is None else ["aux_hidden"])
    for key in quantized:
        assert fp8[key] * 2 == bf16[key] == rows * (3 * H if key == "aux_hidden" else H) * 2
        assert fp8[SCALES[key]] == rows * 4  # float32, one a row
    # everything else as in a bf16 shard, and no scale of a tensor the store does not hold
    assert {k: v for k, v in fp8.items() if k not in SCALES and k not in SCALES.values()} == {
        k: v for k, v in bf16.items() if k not in SCALES
    }
    assert set(fp8) - set(bf16) == {SCALES[k] for k in quantized}
    saved = sum(bf16.values()) - sum(fp8.values())
    assert saved == sum(bf16[k] // 2 - rows * 4 for k in quantized)


@pytest.mark.parametrize("top_n", [None, 5], ids=["last_hidden", "top-N"])
def test_round_trip_is_within_e4m3s_rounding_and_a_zero_row_stays_zero(tmp_path, top_n):
    group = samples(8, top_n)
    store = store_of(tmp_path / "s", [group[:5], group[5:]], FP8, top_n)
    assert store.keys == (
        ("input_ids", "loss_mask", "aux_hidden", "last_hidden")
        if top_n is None
        else ("input_ids", "loss_mask", "aux_hidden", "target_topk_ids", "target_topk_logprobs")
    )
    worst, errors = 0.0, []
    for i, sample in enumerate(group):
        read = store.sample(i)
        assert list(read) == list(store.keys)
        assert torch.equal(read["input_ids"], sample.input_ids) and torch.equal(
            read["loss_mask"], sample.loss_mask
        )
        if top_n:  # not quantized: the very values
            assert torch.equal(read["target_topk_ids"], sample.target_topk_ids)
            assert torch.equal(read["target_topk_logprobs"], sample.target_topk_logprobs)
        for key in [k for k in SCALES if getattr(sample, k) is not None]:
            got, want = read[key], getattr(sample, key)
            assert got.dtype == torch.bfloat16 and got.shape == want.shape
            zero = want.float().abs().amax(-1) == 0
            assert zero.any() and torch.equal(got[zero], want[zero])  # zeros, exactly
            scale = want.float().abs().amax(-1, keepdim=True) / 448
            bound = REL * want.float().abs() + SUBNORMAL * scale
            assert ((got.float() - want.float()).abs() <= bound).all(), key
            rel = row_errors(got, want)[~zero]
            errors.append(rel)
            worst = max(worst, float(rel.max()))
    errors = torch.cat(errors)
    print(f"fp8 round trip, relative row error (L2): max {worst:.4f}, mean {float(errors.mean()):.4f}")
    assert worst <= REL


def test_zero_row_gets_scale_one(tmp_path):
    store_of(tmp_path / "s", [samples(2)], FP8)
    from safetensors import safe_open

    with safe_open(str(tmp_path / "s" / "shard-00000.safetensors"), "pt") as f:
        aux, scale = f.get_tensor("aux_hidden"), f.get_tensor("aux_scale")
    zero = aux.float().abs().amax(-1) == 0
    assert aux.dtype == torch.float8_e4m3fn and scale.dtype == torch.float32
    assert zero.any() and (scale[zero] == 1).all() and (scale[~zero] != 1).all()
    assert aux.float().abs().amax(-1)[~zero].eq(448).all()  # each row's amax is stored as 448


def test_online_with_an_fp8_store_is_refused_naming_both_keys():
    with pytest.raises(ParamsError) as err:
        parse_params({"extract": {"features": "online", "store_dtype": FP8}})
    assert (
        "extract: store_dtype float8_e4m3fn shrinks stored hidden states, and features: online stores none: "
        "set store_dtype: bfloat16 or features: store" in str(err.value)
    )
    assert parse_params({"extract": {"store_dtype": FP8}}).extract.store_dtype == FP8


@pytest.mark.slow
def test_training_runs_on_an_fp8_store(tmp_path):
    """The loop reads the fp8 store as bf16 (dequantized) and learns as on the bf16 store."""
    inputs = tiny_inputs(tmp_path / "bf16")
    fp8 = replace(inputs, store=fp8_copy(inputs.store, tmp_path / "fp8"))
    assert fp8.store.sample(0)["last_hidden"].dtype == torch.bfloat16
    on_bf16 = train_drafter(tiny_params(epochs=6), inputs)
    on_fp8 = train_drafter(tiny_params(epochs=6), fp8)
    first, last = on_fp8.curve[0]["loss"], on_fp8.curve[-1]["loss"]
    bf16_first, bf16_last = on_bf16.curve[0]["loss"], on_bf16.curve[-1]["loss"]
    print(
        f"tiny training, first -> last loss: bf16 {bf16_first:.4f} -> {bf16_last:.4f}, "
        f"fp8 {first:.4f} -> {last:.4f}; held-out acc_0 bf16 {on_bf16.metrics['heldout']['acc'][0]:.4f}, "
        f"fp8 {on_fp8.metrics['heldout']['acc'][0]:.4f}"
    )
    assert last < first
    assert last == pytest.approx(on_bf16.curve[-1]["loss"], rel=0.05)


# --- a real extraction (SmolLM2-135M, 6 samples of <= 40 tokens) ---------------------------------


def real_params(dtype: str):
    return parse_params(
        {
            "target": {"dtype": "float32"},
            "data": {"source": str(SHAREGPT_SAMPLE), "num_samples": 6, "max_length": 40, "seed": 3},
            "extract": {"shard_samples": 2, "batch_tokens": 128, "store_dtype": dtype},
        }
    )


@pytest.fixture(scope="module")
def extracted(smollm2, tmp_path_factory) -> dict[str, Path]:
    fp = fingerprint(smollm2, AUX)
    out = {}
    for name, dtype in (("bf16", "bfloat16"), ("fp8", FP8), ("fp8 again", FP8)):
        out[name] = tmp_path_factory.mktemp(name.replace(" ", "-"))
        extract_features(smollm2, real_params(dtype), AUX, fp, out[name])
    return out


def test_real_fp8_store_is_half_the_size_and_deterministic(extracted, tmp_path):
    bf16, fp8 = FeatureStore(extracted["bf16"]), FeatureStore(extracted["fp8"])
    fp8.verify()
    assert (bf16.dtype, fp8.dtype) == ("bfloat16", FP8)
    assert bf16.manifest["bytes_per_token"] == (3 * 576 + 576) * 2 + 4 + 1 == 4613
    assert fp8.manifest["bytes_per_token"] == (3 * 576 + 576) * 1 + 2 * 4 + 4 + 1 == 2317
    assert fp8.manifest["config_hash"] != bf16.manifest["config_hash"]  # store_dtype is in the hash
    for name in ("shard-00000.safetensors", "tokens.safetensors"):
        a, b = tensor_bytes(extracted["bf16"] / name), tensor_bytes(extracted["fp8"] / name)
        if name == "tokens.safetensors":
            assert a == b
        else:
            assert b["aux_hidden"] * 2 == a["aux_hidden"] and b["last_hidden"] * 2 == a["last_hidden"]
    # two runs: the same bytes, every file
    names = sorted(p.name for p in extracted["fp8"].iterdir())
    assert names == sorted(p.name for p in extracted["fp8 again"].iterdir())
    for name in names:
        assert (extracted["fp8"] / name).read_bytes() == (extracted["fp8 again"] / name).read_bytes(), name
    # and a function of the bf16 features: quantizing the bf16 store's shards gives the fp8 shards
    copy = fp8_copy(bf16, tmp_path / "copy")
    assert [e["sha256"] for e in copy.shards] == [e["sha256"] for e in fp8.shards]
    worst, errors = 0.0, []
    for i in range(len(bf16)):
        a, b = bf16.sample(i), fp8.sample(i)
        assert list(a) == list(b) and all(a[k].dtype == b[k].dtype for k in a)
        assert torch.equal(a["input_ids"], b["input_ids"])
        for key in SCALES:
            rel = row_errors(b[key], a[key])
            errors.append(rel)
            worst = max(worst, float(rel.max()))
    errors = torch.cat(errors)
    print(f"SmolLM2 fp8 store, relative row error (L2): max {worst:.4f}, mean {float(errors.mean()):.4f}")
    assert worst <= REL


@pytest.mark.parametrize("damage", ["truncated", "flipped byte"])
def test_damaged_fp8_shard_is_refused_by_name(extracted, tmp_path, damage):
    for path in extracted["fp8"].iterdir():
        (tmp_path / path.name).write_bytes(path.read_bytes())
    shard = tmp_path / "shard-00001.safetensors"
    data = shard.read_bytes()
    if damage == "truncated":
        shard.write_bytes(data[: len(data) // 2])
    else:  # one byte of the last tensor written (fp8 rows or a scale)
        shard.write_bytes(data[:-50] + bytes([data[-50] ^ 0x01]) + data[-49:])
    with pytest.raises(CorruptStoreError, match=f"{shard} is corrupt or truncated"):
        FeatureStore(tmp_path).verify()


def test_config_hash_tells_the_store_dtypes_apart():
    fp = made_up_fingerprint()
    assert config_hash(real_params("bfloat16"), fp) != config_hash(real_params(FP8), fp)
