"""Checkpoint readers and writers (fp4moe.checkpoints): round trips, slicing, errors, and
files written by the formats' own tools (compressed-tensors, NVIDIA ModelOpt) when those
packages are installed."""

from __future__ import annotations

import json
import os

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import save_file

from fp4moe.checkpoint_source import CheckpointSource
from fp4moe.checkpoints import (
    load_checkpoint_experts,
    modelopt_expert_tensors,
    save_compressed_tensors_experts,
    save_modelopt_experts,
)
from fp4moe.experts import PreparedExperts, prepare_experts
from fp4moe.nvfp4 import NVFP4Tensor, dequantize_blocks, dequantize_nvfp4

E, H, I = 3, 64, 32  # noqa: E741 (the contract's notation)
PREFIX = "model.layers.3.mlp.experts"
MIXTRAL = ("w1", "w3", "w2")


def make_experts(seed: int = 0, static: bool = True, e: int = E, i: int = I) -> PreparedExperts:
    """Random experts whose gate and up matrices have different global scales."""
    gen = torch.Generator().manual_seed(seed)
    w13 = torch.randn(e, 2 * i, H, generator=gen)
    w13[:, i:] *= 3.0  # up rows: a larger amax, so another global scale
    w2 = torch.randn(e, H, i, generator=gen)
    a13 = torch.rand(e, generator=gen) + 0.1 if static else None
    a2 = torch.rand(e, generator=gen) + 0.1 if static else None
    return prepare_experts(w13.bfloat16(), w2.bfloat16(), a13_scale=a13, a2_scale=a2)


@pytest.fixture(scope="module")
def experts() -> PreparedExperts:
    ex = make_experts()
    assert bool((ex.w13_global[:, 0] != ex.w13_global[:, 1]).all())
    return ex


def bits(t: torch.Tensor) -> torch.Tensor:
    """The stored bits, so that equality is bit equality (also for NaN and -0)."""
    return t.view({1: torch.uint8, 4: torch.int32}[t.element_size()])


def assert_identical(a: PreparedExperts, b: PreparedExperts) -> None:
    la, lb = a.to_linear(), b.to_linear()
    assert sorted(la) == sorted(lb)
    for k in la:
        assert la[k].dtype == lb[k].dtype and la[k].shape == lb[k].shape, k
        assert torch.equal(bits(la[k]), bits(lb[k])), k


def assert_ct_round_trip(a: PreparedExperts, b: PreparedExperts) -> None:
    """Codes and block scales bit for bit; fp32 globals equal or one ulp apart (numerics 1)."""
    la, lb = a.to_linear(), b.to_linear()
    assert sorted(la) == sorted(lb)
    for k in la:
        if la[k].dtype == torch.float32:
            assert int((bits(la[k]) - bits(lb[k])).abs().max()) <= 1, k
        else:
            assert torch.equal(bits(la[k]), bits(lb[k])), k


def expert_slice(ex: PreparedExperts, start: int, stop: int) -> PreparedExperts:
    return PreparedExperts.from_linear({k: v[start:stop] for k, v in ex.to_linear().items()})


def write_shards(sd: dict[str, torch.Tensor], folder, n_shards: int = 2) -> None:
    """HF sharded layout: keys dealt round-robin (so one expert spans both shards)."""
    weight_map, shards = {}, [{} for _ in range(n_shards)]
    for j, k in enumerate(sorted(sd)):
        name = f"model-{j % n_shards + 1:05d}-of-{n_shards:05d}.safetensors"
        shards[j % n_shards][k] = sd[k]
        weight_map[k] = name
    for s, shard in enumerate(shards):
        save_file(shard, os.path.join(folder, f"model-{s + 1:05d}-of-{n_shards:05d}.safetensors"))
    with open(os.path.join(folder, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": 0}, "weight_map": weight_map}, f)


# ------------------------------------------------------------------------- round trips


@pytest.mark.parametrize("static", [True, False], ids=["static", "no-static"])
def test_modelopt_file_round_trip(tmp_path, static):
    ex = make_experts(1, static=static)
    path = tmp_path / "experts.safetensors"
    sd = save_modelopt_experts(ex, path, prefix=PREFIX)
    assert path.is_file()
    assert sd[f"{PREFIX}.0.gate_proj.weight"].dtype == torch.uint8
    assert sd[f"{PREFIX}.0.gate_proj.weight_scale_2"].shape == ()
    assert (f"{PREFIX}.0.down_proj.input_scale" in sd) == static
    back = load_checkpoint_experts(path, prefix=PREFIX, num_experts=E)
    assert_identical(ex, back)
    assert back.device == torch.device("cpu")


def test_modelopt_sharded_directory_reads_each_header_once(tmp_path, experts, monkeypatch):
    sd = save_modelopt_experts(experts, prefix=PREFIX)
    sd["model.layers.2.mlp.experts.0.gate_proj.weight"] = torch.zeros(4, dtype=torch.uint8)
    sd["lm_head.weight"] = torch.zeros(2, 2)
    write_shards(sd, tmp_path)

    import fp4moe.checkpoint_source as module

    opened: list[str] = []
    real = module.read_safetensors_header

    def counting(path):
        opened.append(os.path.basename(path))
        return real(path)

    monkeypatch.setattr(module, "read_safetensors_header", counting)
    back = load_checkpoint_experts(str(tmp_path), prefix=PREFIX, num_experts=E)
    assert_identical(experts, back)
    assert sorted(opened) == sorted(set(opened)) and len(opened) == 2


def test_truncated_shard_and_bad_headers(tmp_path, experts):
    path = tmp_path / "model.safetensors"
    save_modelopt_experts(experts, path, prefix=PREFIX)
    whole = path.read_bytes()
    path.write_bytes(whole[:-10])  # the last tensor ends past the file
    with pytest.raises(ValueError, match="truncated or not a safetensors file"):
        load_checkpoint_experts(path, prefix=PREFIX, num_experts=E)
    path.write_bytes(b"\xff" * 8 + whole[8:])
    with pytest.raises(ValueError, match=r"truncated or not a safetensors file \(header size"):
        load_checkpoint_experts(path, prefix=PREFIX, num_experts=E)


def test_single_model_safetensors_directory(tmp_path, experts):
    save_modelopt_experts(experts, tmp_path / "model.safetensors", prefix=PREFIX)
    assert_identical(experts, load_checkpoint_experts(tmp_path, prefix=PREFIX, num_experts=E))


@pytest.mark.parametrize("names", [("gate_proj", "up_proj", "down_proj"), MIXTRAL], ids=str)
def test_modelopt_tensors_are_views_of_the_experts(experts, names):
    """What a state dict holds: the writer's keys and bits, contiguous; the codes linear
    copies (the experts hold the fields layout), the globals views, the block scales views
    but where the experts hold them with padded rows (K/16 of 4 and 2 bytes here)."""
    views = modelopt_expert_tensors(experts, prefix=PREFIX, names=names)
    written = save_modelopt_experts(experts, prefix=PREFIX, names=names)
    assert sorted(views) == sorted(written)
    storages = {t.untyped_storage().data_ptr() for t in experts.tensors().values()}
    for k, v in views.items():
        assert v.is_contiguous(), k
        shared = v.untyped_storage().data_ptr() in storages
        assert shared != k.endswith((".weight_scale", ".weight")), k
        assert v.dtype == written[k].dtype and v.shape == written[k].shape, k
        assert torch.equal(bits(v.contiguous()), bits(written[k])), k
    loaded = load_checkpoint_experts(views, prefix=PREFIX, num_experts=E)
    assert_identical(loaded, experts)
    assert loaded.w13_scales.stride(1) == loaded.w2_scales.stride(1) == 16  # rows aligned


def test_modelopt_tensors_codes_device(experts):
    """codes_device moves the linear code copies only; the scales and globals stay views on
    the experts' device."""
    moved = modelopt_expert_tensors(experts, prefix=PREFIX, codes_device="meta")
    here = modelopt_expert_tensors(experts, prefix=PREFIX)
    assert sorted(moved) == sorted(here)
    for k, v in moved.items():
        want = "meta" if k.endswith(".weight") else "cpu"
        assert v.device.type == want, k
        assert v.shape == here[k].shape and v.dtype == here[k].dtype, k


def test_checkpoint_source_reads_headers_and_closes(tmp_path, experts):
    save_modelopt_experts(experts, tmp_path / "model.safetensors", prefix=PREFIX)
    key = f"{PREFIX}.1.down_proj.weight_scale"
    with CheckpointSource(tmp_path) as src:
        assert src.folder == str(tmp_path) and src.has(key)
        assert src.info(key) == (torch.float8_e4m3fn, (H, I // 16))
        assert src.nbytes() == sum(
            t.numel() * t.element_size()
            for t in save_modelopt_experts(experts, prefix=PREFIX).values()
        )
        # an open source is read by the loader and left open
        assert_identical(load_checkpoint_experts(src, prefix=PREFIX, num_experts=E), experts)
        assert torch.equal(
            src.read([key])[key].view(torch.uint8), experts.w2_scales[1].view(torch.uint8)
        )
    with CheckpointSource({key: experts.w2_scales[1]}) as sd:
        assert sd.info(key) == (torch.float8_e4m3fn, (H, I // 16)) and sd.folder is None


def test_state_dict_and_mixtral_names(experts):
    sd = save_modelopt_experts(experts, {}, prefix="m.block_sparse_moe.experts", names=MIXTRAL)
    assert "m.block_sparse_moe.experts.2.w3.weight" in sd
    assert "m.block_sparse_moe.experts.2.up_proj.weight" not in sd
    back = load_checkpoint_experts(sd, prefix="m.block_sparse_moe.experts", num_experts=E)
    assert_identical(experts, back)
    # Gate and up keep their own global scales.
    assert torch.equal(back.w13_global, experts.w13_global)
    assert bool((back.w13_global[:, 0] != back.w13_global[:, 1]).all())


@pytest.mark.parametrize("names", [None, MIXTRAL], ids=["hf-names", "mixtral-names"])
def test_compressed_tensors_round_trip(tmp_path, experts, names):
    kw = {"names": names} if names else {}
    path = tmp_path / "ct.safetensors"
    sd = save_compressed_tensors_experts(experts, path, prefix=PREFIX, **kw)
    gate = (names or ("gate_proj",))[0]
    enc = sd[f"{PREFIX}.1.{gate}.weight_global_scale"]
    assert enc.shape == (1,) and enc.dtype == torch.float32
    assert torch.equal(enc, torch.reciprocal(experts.w13_global[1, :1]))
    back = load_checkpoint_experts(path, prefix=PREFIX, num_experts=E)
    assert_ct_round_trip(experts, back)
    assert bool((back.w13_global[:, 0] != back.w13_global[:, 1]).all())
    # Where 1 / (1 / g) == g in fp32 the round trip is exact.
    exact = torch.reciprocal(torch.reciprocal(experts.w13_global)) == experts.w13_global
    assert torch.equal(back.w13_global[exact], experts.w13_global[exact])


@settings(max_examples=300, deadline=None)
@given(st.floats(min_value=2.0**-100, max_value=2.0**100, allow_subnormal=False, width=32))
def test_reciprocal_of_reciprocal_is_within_one_ulp(g):
    # The documented bound of the compressed-tensors round trip of a global scale.
    t = torch.tensor([g], dtype=torch.float32)
    back = torch.reciprocal(torch.reciprocal(t))
    assert int((bits(back) - bits(t)).abs()) <= 1


@pytest.mark.parametrize("fmt", ["modelopt", "compressed-tensors"])
@pytest.mark.parametrize("rng", [(0, 1), (1, 3), (2, 3), (0, 3)], ids=str)
def test_expert_range_equals_slice(experts, fmt, rng):
    save = save_modelopt_experts if fmt == "modelopt" else save_compressed_tensors_experts
    sd = save(experts, prefix=PREFIX)
    part = load_checkpoint_experts(sd, prefix=PREFIX, num_experts=E, expert_range=rng, format=fmt)
    whole = load_checkpoint_experts(sd, prefix=PREFIX, num_experts=E, format=fmt)
    assert_identical(expert_slice(whole, *rng), part)
    assert part.num_experts == rng[1] - rng[0]


def test_expert_offset_then_range(experts):
    # Rank 1 of an expert-parallel group writes its experts as global experts 3, 4, 5.
    sd = save_modelopt_experts(make_experts(7), prefix=PREFIX)
    save_modelopt_experts(experts, sd, prefix=PREFIX, expert_offset=E)
    back = load_checkpoint_experts(sd, prefix=PREFIX, num_experts=2 * E, expert_range=(E, 2 * E))
    assert_identical(experts, back)


def test_auto_detection(experts):
    mo = save_modelopt_experts(experts, prefix=PREFIX)
    ct = save_compressed_tensors_experts(experts, prefix=PREFIX)
    assert_identical(
        load_checkpoint_experts(mo, prefix=PREFIX, num_experts=E),
        load_checkpoint_experts(mo, prefix=PREFIX, num_experts=E, format="modelopt"),
    )
    assert_identical(
        load_checkpoint_experts(ct, prefix=PREFIX, num_experts=E),
        load_checkpoint_experts(ct, prefix=PREFIX, num_experts=E, format="compressed-tensors"),
    )
    with pytest.raises(ValueError, match=r"weight_packed.*'modelopt'"):
        load_checkpoint_experts(mo, prefix=PREFIX, num_experts=E, format="compressed-tensors")


def test_tolerated_variants(experts):
    """uint8 block scales, [1]-shaped ModelOpt scalars, []-shaped compressed-tensors ones."""
    sd = save_modelopt_experts(experts, prefix=PREFIX)
    for k in list(sd):
        if k.endswith(".weight_scale"):
            sd[k] = sd[k].view(torch.uint8)
        elif k.endswith(("weight_scale_2", "input_scale")):
            sd[k] = sd[k].reshape(1)
    assert_identical(experts, load_checkpoint_experts(sd, prefix=PREFIX + ".", num_experts=E))
    ct = save_compressed_tensors_experts(experts, prefix=PREFIX)
    ct = {k: v.reshape(()) if v.numel() == 1 else v for k, v in ct.items()}
    assert_ct_round_trip(experts, load_checkpoint_experts(ct, prefix=PREFIX, num_experts=E))


def test_a13_is_max_of_gate_and_up_input_scales(experts):
    sd = save_modelopt_experts(experts, prefix=PREFIX)
    sd[f"{PREFIX}.1.up_proj.input_scale"] = torch.tensor(7.5)
    sd[f"{PREFIX}.2.gate_proj.input_scale"] = torch.tensor(9.25)
    back = load_checkpoint_experts(sd, prefix=PREFIX, num_experts=E)
    want = experts.a13_scale.clone()
    want[1], want[2] = 7.5, 9.25
    assert torch.equal(back.a13_scale, want)
    assert torch.equal(back.a2_scale, experts.a2_scale)
    ct = save_compressed_tensors_experts(experts, prefix=PREFIX)
    ct[f"{PREFIX}.0.gate_proj.input_global_scale"] = torch.tensor([0.125])  # decode 8
    back = load_checkpoint_experts(ct, prefix=PREFIX, num_experts=E)
    assert float(back.a13_scale[0]) == 8.0


def test_parameters_in_state_dict_and_device(experts):
    sd = {
        k: torch.nn.Parameter(v, requires_grad=v.is_floating_point() and v.element_size() == 4)
        for k, v in save_modelopt_experts(experts, prefix=PREFIX).items()
    }
    back = load_checkpoint_experts(sd, prefix=PREFIX, num_experts=E, device="cpu")
    assert not any(t.requires_grad for t in back.to_linear().values())
    assert_identical(experts, back)


# ------------------------------------------------------------------------- bad input


def _mo() -> dict[str, torch.Tensor]:
    return save_modelopt_experts(make_experts(2), prefix=PREFIX)


def _key(e: int, proj: str, leaf: str) -> str:
    return f"{PREFIX}.{e}.{proj}.{leaf}"


def _drop(sd, key):
    del sd[key]
    return sd


def _set(sd, key, value):
    sd[key] = value
    return sd


def _wider_expert(sd):
    other = save_modelopt_experts(make_experts(3, e=3, i=64), prefix=PREFIX)
    sd.update({k: v for k, v in other.items() if f"{PREFIX}.2." in k})
    return sd


BAD_CHECKPOINTS = {
    "missing-global": (
        lambda sd: _drop(sd, _key(1, "up_proj", "weight_scale_2")),
        r"missing tensor '.*\.1\.up_proj\.weight_scale_2'",
    ),
    "missing-down-codes": (
        lambda sd: _drop(sd, _key(2, "down_proj", "weight")),
        r"missing tensor '.*\.2\.down_proj\.weight'",
    ),
    "codes-dtype": (
        lambda sd: _set(sd, _key(0, "up_proj", "weight"), torch.zeros(I, H // 2, dtype=torch.int8)),
        r"up_proj\.weight: expected torch\.uint8 \[32, 32\].*got torch\.int8",
    ),
    "gate-codes-rank": (
        lambda sd: _set(
            sd, _key(0, "gate_proj", "weight"), torch.zeros(I * H // 2, dtype=torch.uint8)
        ),
        r"gate_proj\.weight: expected torch\.uint8 \[I, H/2\], got torch\.uint8 \[1024\]",
    ),
    "scales-shape": (
        lambda sd: _set(
            sd,
            _key(1, "down_proj", "weight_scale"),
            torch.zeros(H, I // 32, dtype=torch.float8_e4m3fn),
        ),
        r"down_proj\.weight_scale: expected .*\[64, 2\].*got torch\.float8_e4m3fn \[64, 1\]",
    ),
    "scales-dtype": (
        lambda sd: _set(sd, _key(1, "gate_proj", "weight_scale"), torch.ones(I, H // 16)),
        r"gate_proj\.weight_scale: expected torch\.float8_e4m3fn.*got torch\.float32",
    ),
    "scales-nan": (
        lambda sd: _set(
            sd,
            _key(0, "gate_proj", "weight_scale"),
            torch.full((I, H // 16), 0x7F, dtype=torch.uint8),
        ),
        r"gate_proj\.weight_scale: block scales hold NaN",
    ),
    "scales-negative": (
        lambda sd: _set(
            sd,
            _key(0, "down_proj", "weight_scale"),
            (-torch.ones(H, I // 16)).to(torch.float8_e4m3fn),
        ),
        r"down_proj\.weight_scale: block scales must be non-negative",
    ),
    "inconsistent-experts": (
        _wider_expert,
        r"\.2\.gate_proj\.weight: expected torch\.uint8 \[32, 32\].*got torch\.uint8 \[64, 32\]"
        r".*same shapes",
    ),
    "global-not-scalar": (
        lambda sd: _set(sd, _key(0, "gate_proj", "weight_scale_2"), torch.ones(2)),
        r"gate_proj\.weight_scale_2: expected a float32 .*scalar.*got torch\.float32 \[2\]",
    ),
    "global-int": (
        lambda sd: _set(sd, _key(0, "gate_proj", "weight_scale_2"), torch.tensor(1)),
        r"weight_scale_2: expected a float32 .*scalar.*got torch\.int64",
    ),
    "global-zero": (
        lambda sd: _set(sd, _key(2, "down_proj", "weight_scale_2"), torch.tensor(0.0)),
        r"down_proj\.weight_scale_2: decode global scale must be finite and positive",
    ),
    "global-inf": (
        lambda sd: _set(sd, _key(2, "up_proj", "weight_scale_2"), torch.tensor(float("inf"))),
        r"up_proj\.weight_scale_2: decode global scale must be finite and positive",
    ),
    "partial-input-scales": (
        lambda sd: _drop(sd, _key(1, "down_proj", "input_scale")),
        r"present for every loaded expert.*or for none.*\.1\.down_proj\.input_scale",
    ),
    "h-not-multiple-of-32": (
        lambda sd: {k: v[..., :8] if k.endswith("gate_proj.weight") else v for k, v in sd.items()},
        r"H and I must be multiples of 32.*H=16",
    ),
    "unquantized": (
        lambda sd: {
            _key(e, p, "weight"): torch.zeros(2, 2)
            for e in range(E)
            for p in ("gate_proj", "up_proj", "down_proj")
        },
        r"format detection found neither",
    ),
    "both-formats": (
        lambda sd: _set(
            sd, _key(0, "gate_proj", "weight_packed"), torch.zeros(I, H // 2, dtype=torch.uint8)
        ),
        r"both formats",
    ),
}


@pytest.mark.parametrize("case", list(BAD_CHECKPOINTS))
def test_bad_checkpoint(case):
    corrupt, message = BAD_CHECKPOINTS[case]
    with pytest.raises(ValueError, match=message):
        load_checkpoint_experts(corrupt(_mo()), prefix=PREFIX, num_experts=E)


def test_bad_compressed_tensors_encode_scale():
    sd = save_compressed_tensors_experts(make_experts(2), prefix=PREFIX)
    sd[_key(1, "gate_proj", "weight_global_scale")] = torch.tensor([0.0])
    with pytest.raises(ValueError, match=r"1\.gate_proj\.weight_global_scale: encode scale"):
        load_checkpoint_experts(sd, prefix=PREFIX, num_experts=E)
    sd[_key(1, "gate_proj", "weight_global_scale")] = torch.tensor([1e-45])  # 1/it overflows
    with pytest.raises(ValueError, match=r"weight_global_scale: decode global scale"):
        load_checkpoint_experts(sd, prefix=PREFIX, num_experts=E)


BAD_ARGUMENTS = {
    "num-experts-too-many": ({"num_experts": 4}, ValueError, r"num_experts: 4 given.*no '.*\.3\."),
    "num-experts-too-few": ({"num_experts": 2}, ValueError, r"num_experts: 2 given.*also holds"),
    "num-experts-zero": ({"num_experts": 0}, ValueError, r"num_experts: must be at least 1"),
    "num-experts-float": ({"num_experts": 3.0}, TypeError, r"num_experts: expected an int"),
    "num-experts-bool": ({"num_experts": True}, TypeError, r"num_experts: expected an int"),
    "range-past-end": ({"expert_range": (1, 4)}, ValueError, r"expert_range: .*got \(1, 4\)"),
    "range-empty": ({"expert_range": (2, 2)}, ValueError, r"expert_range: .*start < stop"),
    "range-negative": ({"expert_range": (-1, 2)}, ValueError, r"expert_range: expected 0 <="),
    "range-not-pair": ({"expert_range": (1,)}, TypeError, r"expert_range: expected a pair"),
    "range-floats": ({"expert_range": (0.0, 1.0)}, TypeError, r"expert_range: expected a pair"),
    "format-unknown": ({"format": "gguf"}, ValueError, r"format: expected 'auto' or one of"),
    "prefix-type": ({"prefix": 3}, TypeError, r"prefix: expected a str"),
    "prefix-empty": ({"prefix": "."}, ValueError, r"prefix: must name"),
    "prefix-wrong": ({"prefix": "model.layers.4.mlp.experts"}, ValueError, r"no key starts with"),
    "prefix-partial": ({"prefix": "model.layers.3.mlp"}, ValueError, r"keys under the prefix"),
}


@pytest.mark.parametrize("case", list(BAD_ARGUMENTS))
def test_bad_arguments(case):
    kwargs, error, message = BAD_ARGUMENTS[case]
    args = {"prefix": PREFIX, "num_experts": E, **kwargs}
    with pytest.raises(error, match=message):
        load_checkpoint_experts(_mo(), **args)


def test_bad_sources(tmp_path):
    kw = {"prefix": PREFIX, "num_experts": E}
    with pytest.raises(TypeError, match="source: expected a path"):
        load_checkpoint_experts(12, **kw)
    with pytest.raises(TypeError, match=r"source: state dict value 'a' must be a torch\.Tensor"):
        load_checkpoint_experts({"a": [1, 2]}, **kw)
    with pytest.raises(ValueError, match="source: no such file or directory"):
        load_checkpoint_experts(tmp_path / "absent.safetensors", **kw)
    with pytest.raises(ValueError, match=r"holds neither model\.safetensors\.index\.json"):
        load_checkpoint_experts(tmp_path, **kw)
    junk = tmp_path / "junk.safetensors"
    junk.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json")
    with pytest.raises(ValueError, match="truncated or not a safetensors file"):
        load_checkpoint_experts(junk, **kw)
    folder = tmp_path / "sharded"
    folder.mkdir()
    write_shards(_mo(), folder)
    os.remove(folder / "model-00002-of-00002.safetensors")
    with pytest.raises(ValueError, match=r"maps '.*' to '.*model-00002-of-00002.*does not exist"):
        load_checkpoint_experts(folder, **kw)
    (folder / "model.safetensors.index.json").write_text("{}")
    with pytest.raises(ValueError, match="not a valid safetensors index"):
        load_checkpoint_experts(folder, **kw)


def test_bad_save_arguments(experts, tmp_path):
    with pytest.raises(TypeError, match="experts: expected a PreparedExperts"):
        save_modelopt_experts(experts.to_linear(), prefix=PREFIX)
    with pytest.raises(ValueError, match="prefix: expected a non-empty"):
        save_modelopt_experts(experts, prefix="")
    with pytest.raises(ValueError, match="names: expected three distinct"):
        save_modelopt_experts(experts, prefix=PREFIX, names=("w1", "w1", "w2"))
    with pytest.raises(ValueError, match="names: expected three distinct"):
        save_compressed_tensors_experts(experts, prefix=PREFIX, names="w1")
    with pytest.raises(ValueError, match="expert_offset: expected an int >= 0"):
        save_modelopt_experts(experts, prefix=PREFIX, expert_offset=-1)
    with pytest.raises(TypeError, match="path_or_dict: expected a path, a dict or None"):
        save_modelopt_experts(experts, 5, prefix=PREFIX)


# ------------------------------------------------------------------------- the formats' own tools
# These need the tools (not in the default test extras); they are skipped without them.


def _ours(back: PreparedExperts, e: int, p: int) -> NVFP4Tensor:
    return back.w2_nvfp4(e) if p == 2 else back.w13_nvfp4(e)[p]


def _ct_model(seed: int):
    """A module tree whose experts sit at ``model.layers.0.mlp.experts``, quantized to NVFP4
    and compressed by compressed-tensors itself (calibration by its own helpers)."""
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import (
        QuantizationConfig,
        apply_quantization_config,
        preset_name_to_scheme,
    )
    from compressed_tensors.quantization.utils import calculate_qparams, generate_gparam

    torch.manual_seed(seed)

    def expert():
        m = torch.nn.Module()
        m.gate_proj = torch.nn.Linear(H, I, bias=False)
        m.up_proj = torch.nn.Linear(H, I, bias=False)
        m.down_proj = torch.nn.Linear(I, H, bias=False)
        with torch.no_grad():
            m.up_proj.weight *= 3.0  # gate and up get different global scales
        return m

    root = torch.nn.Module()
    root.model = torch.nn.Module()
    root.model.layers = torch.nn.ModuleList([torch.nn.Module()])
    root.model.layers[0].mlp = torch.nn.Module()
    root.model.layers[0].mlp.experts = torch.nn.ModuleList([expert() for _ in range(E)])
    root = root.to(torch.bfloat16)
    scheme = preset_name_to_scheme("NVFP4", ["Linear"])
    apply_quantization_config(
        root, QuantizationConfig(config_groups={"g": scheme}), show_progress=False
    )
    with torch.no_grad():
        for j, mod in enumerate(m for m in root.modules() if isinstance(m, torch.nn.Linear)):
            w = mod.weight
            gs = generate_gparam(w.min(), w.max())  # encode scale, the tool's convention
            blocks = w.unflatten(-1, (-1, 16))
            s, _ = calculate_qparams(
                blocks.amin(-1), blocks.amax(-1), scheme.weights, global_scale=gs
            )
            mod.weight_global_scale.copy_(gs)
            mod.weight_scale.data = s
            mod.input_global_scale.copy_(torch.tensor([1000.0 + 250.0 * j]))
    ModelCompressor.from_pretrained_model(root, "nvfp4-pack-quantized").compress_model(root)
    return root.state_dict(), scheme


def test_compressed_tensors_tool_checkpoint(tmp_path):
    pytest.importorskip("compressed_tensors")
    from compressed_tensors.compressors.nvfp4.base import NVFP4PackedCompressor
    from compressed_tensors.compressors.nvfp4.helpers import unpack_fp4_from_uint8
    from compressed_tensors.quantization.lifecycle.forward import dequantize

    sd, scheme = _ct_model(0)
    prefix = "model.layers.0.mlp.experts"
    assert f"{prefix}.0.gate_proj.weight_packed" in sd
    save_file({k: v.contiguous() for k, v in sd.items()}, tmp_path / "model.safetensors")
    back = load_checkpoint_experts(tmp_path, prefix=prefix, num_experts=E)
    assert bool((back.w13_global[:, 0] != back.w13_global[:, 1]).all())
    for e in range(E):
        inputs = []
        for p, proj in enumerate(("gate_proj", "up_proj", "down_proj")):
            k = f"{prefix}.{e}.{proj}."
            packed, scale, enc = (
                sd[k + x] for x in ("weight_packed", "weight_scale", "weight_global_scale")
            )
            rows, cols = packed.shape[0], packed.shape[1] * 2
            q = _ours(back, e, p)
            # Codes and block scales bit for bit: e2m1 values times block scales.
            tool_blocks = unpack_fp4_from_uint8(packed, rows, cols, dtype=torch.float32)
            tool_blocks = tool_blocks * scale.float().repeat_interleave(16, dim=-1)
            assert torch.equal(dequantize_blocks(q.codes, q.scales), tool_blocks)
            assert torch.equal(q.global_scale, torch.reciprocal(enc.float()).reshape(()))
            # Whole values: the tool's own dequantization, fp32 and its bf16 decompress.
            codes32 = unpack_fp4_from_uint8(packed, rows, cols, dtype=torch.float32)
            tool32 = dequantize(
                codes32, scale.float(), args=scheme.weights, global_scale=enc, dtype=torch.float32
            )
            torch.testing.assert_close(dequantize_nvfp4(q), tool32, rtol=2**-21, atol=0)
            state = {"weight_packed": packed, "weight_scale": scale, "weight_global_scale": enc}
            tool16 = NVFP4PackedCompressor.decompress(state, scheme)["weight"]
            assert tool16.dtype == torch.bfloat16
            torch.testing.assert_close(
                dequantize_nvfp4(q, torch.bfloat16), tool16, rtol=2**-7, atol=0
            )
            inputs.append(torch.reciprocal(sd[k + "input_global_scale"].float()).reshape(()))
        assert torch.equal(back.a13_scale[e], torch.maximum(inputs[0], inputs[1]))
        assert torch.equal(back.a2_scale[e], inputs[2])


def test_compressed_tensors_tool_reads_our_files(experts):
    pytest.importorskip("compressed_tensors")
    from compressed_tensors.compressors.nvfp4.base import NVFP4PackedCompressor
    from compressed_tensors.quantization import preset_name_to_scheme

    scheme = preset_name_to_scheme("NVFP4", ["Linear"])
    sd = save_compressed_tensors_experts(experts, prefix=PREFIX)
    for e in range(E):
        for p, proj in enumerate(("gate_proj", "up_proj", "down_proj")):
            k = f"{PREFIX}.{e}.{proj}."
            state = {x: sd[k + x] for x in ("weight_packed", "weight_scale", "weight_global_scale")}
            tool16 = NVFP4PackedCompressor.decompress(state, scheme)["weight"]
            ours = dequantize_nvfp4(_ours(experts, e, p), torch.bfloat16)
            torch.testing.assert_close(ours, tool16, rtol=2**-7, atol=0)


def test_modelopt_tool_quantizer_agrees_with_prepare_experts():
    """ModelOpt's own NVFP4 quantizer, per matrix, gives our codes, block scales and global
    bit for bit; its dequantization of the file we read agrees with ours."""
    pytest.importorskip("modelopt.torch.quantization.qtensor")
    from modelopt.torch.quantization.qtensor import NVFP4QTensor

    gen = torch.Generator().manual_seed(5)
    w13 = torch.randn(E, 2 * I, H, generator=gen).bfloat16()
    w13[:, I:] *= 3
    w2 = torch.randn(E, H, I, generator=gen).bfloat16()
    ours = prepare_experts(w13, w2)
    sd = {}
    for e in range(E):
        for proj, w in zip(("gate_proj", "up_proj", "down_proj"), (w13[e, :I], w13[e, I:], w2[e])):
            q, scale, scale_2 = NVFP4QTensor.quantize(w, 16)
            k = f"{PREFIX}.{e}.{proj}."
            sd |= {
                k + "weight": q._quantized_data,
                k + "weight_scale": scale,
                k + "weight_scale_2": scale_2,
            }
    back = load_checkpoint_experts(sd, prefix=PREFIX, num_experts=E)
    assert_identical(ours, back)
    for e in range(E):
        for p, proj in enumerate(("gate_proj", "up_proj", "down_proj")):
            k = f"{PREFIX}.{e}.{proj}."
            q = _ours(back, e, p)
            qt = NVFP4QTensor(q.shape, torch.bfloat16, sd[k + "weight"])
            kw = {"scale": sd[k + "weight_scale"], "block_sizes": {-1: 16}}
            blocks = qt.dequantize(dtype=torch.float32, double_scale=torch.tensor(1.0), **kw)
            assert torch.equal(dequantize_blocks(q.codes, q.scales), blocks)
            full = qt.dequantize(dtype=torch.float32, double_scale=sd[k + "weight_scale_2"], **kw)
            torch.testing.assert_close(dequantize_nvfp4(q), full, rtol=2**-21, atol=0)


@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral"])
def test_modelopt_tool_hf_export(tmp_path, arch):
    """A tiny HF MoE model quantized by ModelOpt (mtq NVFP4_DEFAULT_CFG) and exported by its
    export_hf_checkpoint: our reader decodes the file as ModelOpt's NVFP4QTensor does."""
    pytest.importorskip("transformers")
    mtq = pytest.importorskip("modelopt.torch.quantization")
    import transformers
    from modelopt.torch.export import export_hf_checkpoint
    from modelopt.torch.quantization.qtensor import NVFP4QTensor
    from safetensors import safe_open

    common = dict(
        vocab_size=128, hidden_size=H, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, head_dim=32, num_experts_per_tok=2, max_position_embeddings=64,
    )  # fmt: skip
    if arch == "mixtral":
        cfg = transformers.MixtralConfig(
            intermediate_size=I, num_local_experts=4, architectures=["MixtralForCausalLM"], **common
        )
        model, block, names = transformers.MixtralForCausalLM, "block_sparse_moe", MIXTRAL
    else:
        cfg = transformers.Qwen3MoeConfig(
            intermediate_size=64, moe_intermediate_size=I, num_experts=4, decoder_sparse_step=1,
            mlp_only_layers=[], architectures=["Qwen3MoeForCausalLM"], **common,
        )  # fmt: skip
        model, block, names = (
            transformers.Qwen3MoeForCausalLM,
            "mlp",
            ("gate_proj", "up_proj", "down_proj"),
        )
    torch.manual_seed(0)
    m = model(cfg).to(torch.bfloat16).eval()
    ids = torch.randint(0, 128, (4, 16))
    mtq.quantize(m, mtq.NVFP4_DEFAULT_CFG, lambda mm: mm(ids))
    export_hf_checkpoint(m, export_dir=tmp_path)
    prefix = f"model.layers.0.{block}.experts"
    back = load_checkpoint_experts(tmp_path, prefix=prefix, num_experts=4)
    part = load_checkpoint_experts(tmp_path, prefix=prefix, num_experts=4, expert_range=(1, 3))
    assert_identical(expert_slice(back, 1, 3), part)
    files = [f for f in os.listdir(tmp_path) if f.endswith(".safetensors")]
    with safe_open(str(tmp_path / files[0]), framework="pt") as f:
        sd = {k: f.get_tensor(k) for k in f.keys() if k.startswith(prefix)}  # noqa: SIM118
    for e in range(4):
        ins = []
        for p, proj in enumerate(names):
            k = f"{prefix}.{e}.{proj}."
            q = _ours(back, e, p)
            assert torch.equal(q.codes, sd[k + "weight"])
            assert torch.equal(bits(q.scales), bits(sd[k + "weight_scale"]))
            assert torch.equal(q.global_scale, sd[k + "weight_scale_2"].reshape(()))
            qt = NVFP4QTensor(q.shape, torch.bfloat16, sd[k + "weight"])
            kw = {"scale": sd[k + "weight_scale"], "block_sizes": {-1: 16}}
            blocks = qt.dequantize(dtype=torch.float32, double_scale=torch.tensor(1.0), **kw)
            assert torch.equal(dequantize_blocks(q.codes, q.scales), blocks)
            full = qt.dequantize(dtype=torch.float32, double_scale=sd[k + "weight_scale_2"], **kw)
            torch.testing.assert_close(dequantize_nvfp4(q), full, rtol=2**-21, atol=0)
            ins.append(sd[k + "input_scale"].reshape(()))
        assert torch.equal(back.a13_scale[e], torch.maximum(ins[0], ins[1]))
        assert torch.equal(back.a2_scale[e], ins[2])
    # And the file we write for these experts is read back the same.
    assert_identical(
        back,
        load_checkpoint_experts(
            save_modelopt_experts(back, prefix=prefix, names=names), prefix=prefix, num_experts=4
        ),
    )
