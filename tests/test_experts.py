"""PreparedExperts (numerics section 3): preparing, layout conversion, files and refusals."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from fp4moe.experts import PreparedExperts, align_scale_rows, load_experts, prepare_experts
from fp4moe.kernels.gemm.shapes import scale_rows_tma
from fp4moe.nvfp4 import dequantize_nvfp4, quantize_nvfp4
from testing import random_moe_weights, rel_err

E, H, I = 4, 64, 32  # noqa: E741
F8 = torch.float8_e4m3fn


def bits(t: torch.Tensor) -> torch.Tensor:
    """A tensor's raw bytes (bitwise comparison for any dtype, float8 included)."""
    return t.contiguous().view(torch.uint8)


def assert_same_experts(a: PreparedExperts, b: PreparedExperts) -> None:
    ta, tb = a.tensors(), b.tensors()
    assert sorted(ta) == sorted(tb)
    for k in ta:
        assert ta[k].dtype == tb[k].dtype and ta[k].shape == tb[k].shape, k
        assert torch.equal(bits(ta[k].cpu()), bits(tb[k].cpu())), k


@pytest.fixture(scope="module")
def weights():
    return random_moe_weights(E, H, I, seed=11)


@pytest.fixture(scope="module")
def experts(weights):
    return prepare_experts(*weights)


@pytest.fixture(scope="module")
def static_experts(weights):
    return prepare_experts(*weights, a13_scale=torch.rand(E) + 0.01, a2_scale=0.02)


# --------------------------------------------------------------------------- prepare


def test_prepare_shapes_and_dtypes(experts):
    expected = {
        "w13_codes": ((E, 2 * I, H // 2), torch.uint8),
        "w13_scales": ((E, 2 * I, H // 16), F8),
        "w13_global": ((E, 2), torch.float32),
        "w2_codes": ((E, H, I // 2), torch.uint8),
        "w2_scales": ((E, H, I // 16), F8),
        "w2_global": ((E,), torch.float32),
    }
    tensors = experts.tensors()
    assert sorted(tensors) == sorted(expected)
    for k, (shape, dtype) in expected.items():
        assert tuple(tensors[k].shape) == shape and tensors[k].dtype == dtype, k
        assert tensors[k].is_contiguous() or k.endswith("_scales"), k  # rows 16-byte aligned
    assert experts.a13_scale is None and experts.a2_scale is None
    assert (experts.num_experts, experts.hidden_size, experts.intermediate_size) == (E, H, I)
    assert experts.device.type == "cpu"
    assert "E=4" in repr(experts) and "fields-v2" in repr(experts)


def test_gate_up_down_each_own_global(weights, experts):
    w13, w2 = weights
    for e in range(E):
        gate, up = w13[e, :I], w13[e, I:]
        qg, qu, qd = quantize_nvfp4(gate), quantize_nvfp4(up), quantize_nvfp4(w2[e])
        assert experts.w13_global[e].tolist() == [qg.global_scale.item(), qu.global_scale.item()]
        assert experts.w2_global[e].item() == qd.global_scale.item()
        amax = np.float32(gate.abs().max().item())
        assert experts.w13_global[e, 0].item() == float(amax / np.float32(2688))
        vg, vu = experts.w13_nvfp4(e)
        assert torch.equal(vg.codes, qg.codes) and torch.equal(vu.codes, qu.codes)
        assert torch.equal(bits(vg.scales), bits(qg.scales))
        assert torch.equal(bits(vu.scales), bits(qu.scales))
        vd = experts.w2_nvfp4(e)
        assert torch.equal(vd.codes, qd.codes) and torch.equal(bits(vd.scales), bits(qd.scales))
    # the helper makes up rows smaller than gate rows, so the two globals differ
    assert (experts.w13_global[:, 0] != experts.w13_global[:, 1]).all()


def test_input_dtypes_give_same_experts(weights):
    w13, w2 = (w.to(torch.bfloat16) for w in weights)
    ref = prepare_experts(w13, w2)
    for dt in (torch.float16, torch.float32):
        assert_same_experts(prepare_experts(w13.to(dt), w2.to(dt)), ref)


def test_static_scales(weights, static_experts):
    assert static_experts.a13_scale.shape == (E,) and static_experts.a2_scale.shape == (E,)
    assert static_experts.a13_scale.dtype == torch.float32
    assert (static_experts.a2_scale == np.float32(0.02)).all()  # a scalar is expanded
    assert "static activation scales" in repr(static_experts)


def test_static_scales_are_owned(weights):
    a13, a2 = torch.full((E,), 0.1), torch.full((E,), 0.2)
    ex = prepare_experts(*weights, a13_scale=a13, a2_scale=a2)
    a13.fill_(7.0)  # the caller reuses its tensors; the prepared experts must not change
    a2.fill_(7.0)
    assert (ex.a13_scale == np.float32(0.1)).all() and (ex.a2_scale == np.float32(0.2)).all()


def test_dequantize_close_to_original(weights, experts):
    w13, w2 = weights
    d13, d2 = experts.dequantize(torch.float32)
    assert d13.shape == w13.shape and d2.shape == w2.shape
    # NVFP4 of Gaussian-like weights: about 10% relative RMS error, never far above
    assert rel_err(d13, w13) < 0.13 and rel_err(d2, w2) < 0.13
    for e in range(E):
        gate, up = experts.w13_nvfp4(e)
        assert torch.equal(d13[e, :I], dequantize_nvfp4(gate))
        assert torch.equal(d13[e, I:], dequantize_nvfp4(up))
        assert torch.equal(d2[e], dequantize_nvfp4(experts.w2_nvfp4(e)))
    b13, _ = experts.dequantize()
    assert b13.dtype == torch.bfloat16 and torch.equal(b13, d13.to(torch.bfloat16))


@pytest.mark.parametrize("static", [False, True], ids=["no-static", "static"])
def test_nbytes(experts, static_experts, static):
    ex = static_experts if static else experts
    weights_count = E * 2 * I * H + E * H * I
    expected = weights_count * 0.5625 + (E * 2 + E) * 4 + (2 * E * 4 if static else 0)
    assert ex.nbytes() == expected


# --------------------------------------------------------------------------- layout


@pytest.mark.parametrize("static", [False, True], ids=["no-static", "static"])
def test_linear_round_trip_bit_exact(experts, static_experts, static):
    ex = static_experts if static else experts
    lin = ex.to_linear()
    assert sorted(lin) == sorted(ex.tensors())
    back = PreparedExperts.from_linear(lin)
    assert_same_experts(back, ex)
    for k, v in lin.items():  # new storage: changing the linear form leaves ex alone
        assert v.data_ptr() != getattr(ex, k).data_ptr(), k
    before = ex.w13_codes.clone()
    lin["w13_codes"].fill_(0)
    assert torch.equal(ex.w13_codes, before)


def test_scale_rows_aligned_in_memory(experts):
    """Block-scale rows lie 16 bytes apart in memory (K/16 = 4 and 2 here), the bytes between
    them zero; the linear form and the saved file are contiguous; aligned tensors pass
    through construction uncopied, the caller's contiguous ones are left as they were."""
    for name, c in (("w13_scales", H // 16), ("w2_scales", I // 16)):
        t = getattr(experts, name)
        assert t.stride() == (t.shape[1] * 16, 16, 1) and t.shape[2] == c, name
        assert scale_rows_tma(t)
        pad = torch.as_strided(t.view(torch.uint8), (t.shape[0], t.shape[1], 16), t.stride())
        assert bool((pad[:, :, c:] == 0).all()), name
    lin = experts.to_linear()
    assert all(v.is_contiguous() for v in lin.values())
    kept = lin["w13_scales"].clone()
    again = PreparedExperts.from_linear(lin)
    assert torch.equal(bits(lin["w13_scales"]), bits(kept))  # the caller's tensor unchanged
    assert again.w13_scales.stride(1) == 16 and torch.equal(bits(again.w13_scales), bits(kept))
    same = PreparedExperts(**experts.tensors())
    assert same.w13_scales is experts.w13_scales and same.w2_scales is experts.w2_scales
    raw = PreparedExperts(**lin, validate=False)  # the custom op's rebuild: no copy
    assert raw.w13_scales is lin["w13_scales"]


def test_construction_lays_tensors_out_contiguous(experts):
    """Strided codes and globals (a transposed copy's view) are taken as contiguous copies
    with the same values; the kernels read rows densely."""
    t = experts.tensors()
    odd = {k: v.transpose(-1, -2).contiguous().transpose(-1, -2) if v.dim() == 3 else v
           for k, v in t.items()}  # fmt: skip
    assert not odd["w13_codes"].is_contiguous()
    built = PreparedExperts(**odd)
    assert built.w13_codes.is_contiguous() and built.w2_codes.is_contiguous()
    assert scale_rows_tma(built.w13_scales) and scale_rows_tma(built.w2_scales)
    assert_same_experts(built, experts)
    assert not odd["w13_codes"].is_contiguous()  # the caller's tensor as it was


def test_align_scale_rows():
    s = torch.arange(2 * 3 * 20, dtype=torch.uint8).reshape(2, 3, 20).view(F8)
    a = align_scale_rows(s)
    assert a.shape == s.shape and a.stride() == (96, 32, 1) and torch.equal(bits(a), bits(s))
    assert align_scale_rows(a) is a
    wide = torch.zeros(2, 3, 32, dtype=torch.uint8).view(F8)
    assert align_scale_rows(wide) is wide  # 32 bytes a row already
    assert not scale_rows_tma(wide[:, :, 1:17])  # rows start off 16 bytes
    assert scale_rows_tma(align_scale_rows(wide[:, :, 1:17]))
    with pytest.raises(ValueError, match="scales"):
        align_scale_rows(s[0])


def test_from_linear_refusals(experts):
    lin = experts.to_linear()
    with pytest.raises(ValueError, match=r"missing"):
        PreparedExperts.from_linear({k: v for k, v in lin.items() if k != "w2_global"})
    with pytest.raises(ValueError, match=r"unknown"):
        PreparedExperts.from_linear({**lin, "bias": torch.zeros(1)})
    with pytest.raises(ValueError, match=r"w2_scales"):
        PreparedExperts.from_linear({**lin, "w2_scales": lin["w2_scales"][:, :, :1]})
    with pytest.raises(ValueError, match=r"w13_global"):
        PreparedExperts.from_linear({**lin, "w13_global": lin["w13_global"].double()})
    with pytest.raises(ValueError, match=r"a13_scale, a2_scale"):
        PreparedExperts.from_linear({**lin, "a13_scale": torch.ones(E)})


# --------------------------------------------------------------------------- files


@pytest.mark.parametrize("static", [False, True], ids=["no-static", "static"])
def test_save_load_round_trip(tmp_path, experts, static_experts, static):
    ex = static_experts if static else experts
    path = tmp_path / "experts.safetensors"
    ex.save(path)
    with safe_open(str(path), framework="pt") as f:
        meta = f.metadata()
    assert meta["format"] == "fp4moe.prepared_experts"
    assert meta["layout"] == "fields" and meta["layout_version"] == "2"
    assert_same_experts(load_experts(path), ex)
    assert_same_experts(load_experts(str(path), device="cpu"), ex)


@pytest.mark.parametrize("static", [False, True], ids=["no-static", "static"])
def test_load_converts_a_linear_version_1_file(tmp_path, experts, static_experts, static):
    """A file of layout version 1 (the linear form, as earlier fp4moe wrote it) loads as the
    same experts: its codes moved to the fields layout on load."""
    ex = static_experts if static else experts
    path = tmp_path / "v1.safetensors"
    lin = ex.to_linear()
    meta = {"format": "fp4moe.prepared_experts", "layout": "linear", "layout_version": "1",
            "num_experts": str(E), "hidden_size": str(H), "intermediate_size": str(I),
            "tensors": json.dumps({k: {"shape": list(v.shape), "dtype": str(v.dtype)}
                                   for k, v in lin.items()})}  # fmt: skip
    save_file(lin, str(path), metadata=meta)
    assert_same_experts(load_experts(path), ex)
    assert not torch.equal(lin["w13_codes"], ex.w13_codes)  # the bits did move
    for name, version in (("fields", "1"), ("linear", "2")):  # a name of another version
        bad = _rewrite(path, tmp_path / "bad.safetensors",
                       meta={"layout": name, "layout_version": version})  # fmt: skip
        with pytest.raises(ValueError, match=r"path.*layout"):
            load_experts(bad)


def test_load_with_device(tmp_path, experts):
    path = tmp_path / "experts.safetensors"
    experts.save(path)
    loaded = load_experts(path, device="meta")  # placement only; meta needs no GPU
    assert loaded.device.type == "meta"
    assert all(t.device.type == "meta" for t in loaded.tensors().values())
    if torch.cuda.is_available():
        assert_same_experts(load_experts(path, device="cuda"), experts)


def _rewrite(src, dst, *, meta=None, drop=(), replace=None, meta_drop=()):
    """Copy a saved file with changed metadata or tensors."""
    tensors = load_file(str(src))
    with safe_open(str(src), framework="pt") as f:
        md = dict(f.metadata())
    md.update(meta or {})
    for k in meta_drop:
        md.pop(k)
    for k in drop:
        tensors.pop(k)
    tensors.update(replace or {})
    save_file(tensors, str(dst), metadata=md)
    return dst


@pytest.fixture
def saved(tmp_path, experts):
    path = tmp_path / "good.safetensors"
    experts.save(path)
    return path


def test_load_refuses_missing_path(tmp_path):
    with pytest.raises(ValueError, match=r"path.*no such file"):
        load_experts(tmp_path / "nope.safetensors")


def test_load_refuses_foreign_file(tmp_path):
    path = tmp_path / "foreign.safetensors"
    save_file({"weight": torch.randn(4, 4)}, str(path))  # plain tensors, no metadata
    with pytest.raises(ValueError, match=r"path.*not an fp4moe"):
        load_experts(path)


def test_load_refuses_not_safetensors(tmp_path):
    path = tmp_path / "junk.safetensors"
    path.write_bytes(b"\x00" * 3 + b"not a safetensors file at all" * 10)
    with pytest.raises(ValueError, match=r"path"):
        load_experts(path)


def test_load_refuses_wrong_format_name(tmp_path, saved):
    bad = _rewrite(saved, tmp_path / "bad.safetensors", meta={"format": "someone.else"})
    with pytest.raises(ValueError, match=r"path.*not an fp4moe"):
        load_experts(bad)


def test_load_refuses_wrong_layout(tmp_path, saved):
    bad = _rewrite(saved, tmp_path / "bad.safetensors", meta={"layout": "swizzled"})
    with pytest.raises(ValueError, match=r"path.*layout"):
        load_experts(bad)


@pytest.mark.parametrize("version", ["3", "99"])
def test_load_refuses_newer_layout_version(tmp_path, saved, version):
    bad = _rewrite(saved, tmp_path / "bad.safetensors", meta={"layout_version": version})
    with pytest.raises(ValueError, match=r"path.*newer"):
        load_experts(bad)


@pytest.mark.parametrize("version", ["0", "-1", "one", ""])
def test_load_refuses_invalid_layout_version(tmp_path, saved, version):
    bad = _rewrite(saved, tmp_path / "bad.safetensors", meta={"layout_version": version})
    with pytest.raises(ValueError, match=r"path.*layout.version"):
        load_experts(bad)


@pytest.mark.parametrize("keep", [1, 8, 100, -200, -1], ids=lambda k: f"keep{k}")
def test_load_refuses_truncated_file(tmp_path, saved, keep):
    data = saved.read_bytes()
    bad = tmp_path / "cut.safetensors"
    bad.write_bytes(data[:keep] if keep > 0 else data[: len(data) + keep])
    with pytest.raises(ValueError, match=r"path"):
        load_experts(bad)


def test_load_refuses_missing_tensor(tmp_path, saved):
    bad = _rewrite(saved, tmp_path / "bad.safetensors", drop=["w2_global"])
    with pytest.raises(ValueError, match=r"path"):
        load_experts(bad)


def test_load_refuses_missing_tensor_declared_consistently(tmp_path, saved):
    with safe_open(str(saved), framework="pt") as f:
        declared = json.loads(f.metadata()["tensors"])
    declared.pop("w2_global")
    bad = _rewrite(
        saved,
        tmp_path / "bad.safetensors",
        drop=["w2_global"],
        meta={"tensors": json.dumps(declared)},
    )
    with pytest.raises(ValueError, match=r"path.*w2_global"):
        load_experts(bad)


def test_load_refuses_shape_mismatch(tmp_path, saved, experts):
    wrong = experts.w2_scales[:, :, :1].contiguous()
    bad = _rewrite(saved, tmp_path / "bad.safetensors", replace={"w2_scales": wrong})
    with pytest.raises(ValueError, match=r"path.*w2_scales"):
        load_experts(bad)


@pytest.mark.parametrize(
    "field,byte,pattern",
    [("w13_scales", 0x7F, "NaN"), ("w2_scales", 0xFF, "NaN"), ("w2_scales", 0x81, "negative")],
    ids=["nan", "negative-nan", "negative"],
)
def test_load_refuses_bad_block_scales(tmp_path, saved, experts, field, byte, pattern):
    """The same check as the checkpoint loaders (check_block_scales)."""
    bits = getattr(experts, field).view(torch.uint8).clone()
    bits[1, 2, 0] = byte
    bad = _rewrite(saved, tmp_path / "bad.safetensors",
                   replace={field: bits.view(torch.float8_e4m3fn)})  # fmt: skip
    with pytest.raises(ValueError, match=rf"path.*{field}.*{pattern}"):
        load_experts(bad)


@pytest.mark.parametrize("value", [float("inf"), float("nan"), 0.0, -1.0])
def test_load_refuses_bad_global_scales(tmp_path, saved, experts, value):
    g = experts.w13_global.clone()
    g[0, 1] = value
    bad = _rewrite(saved, tmp_path / "bad.safetensors", replace={"w13_global": g})
    with pytest.raises(ValueError, match=r"path.*w13_global.*finite and positive"):
        load_experts(bad)


def test_load_refuses_dtype_mismatch(tmp_path, saved, experts):
    wrong = experts.w2_global.double()
    bad = _rewrite(saved, tmp_path / "bad.safetensors", replace={"w2_global": wrong})
    with pytest.raises(ValueError, match=r"path.*w2_global"):
        load_experts(bad)


def test_load_refuses_metadata_shape_disagreement(tmp_path, saved):
    bad = _rewrite(saved, tmp_path / "bad.safetensors", meta={"hidden_size": "128"})
    with pytest.raises(ValueError, match=r"path.*metadata"):
        load_experts(bad)


def test_load_refuses_missing_metadata_key(tmp_path, saved):
    bad = _rewrite(saved, tmp_path / "bad.safetensors", meta_drop=["num_experts"])
    with pytest.raises(ValueError, match=r"path.*num_experts"):
        load_experts(bad)


@pytest.mark.parametrize(
    "key,value",
    [("tensors", "{not json"), ("tensors", "[1, 2]"), ("num_experts", "four")],
    ids=["tensors-not-json", "tensors-not-mapping", "num_experts-not-int"],
)
def test_load_refuses_corrupt_metadata_value(tmp_path, saved, key, value):
    bad = _rewrite(saved, tmp_path / "bad.safetensors", meta={key: value})
    with pytest.raises(ValueError, match=r"path"):
        load_experts(bad)


def test_saved_file_is_not_pickle(saved):
    head = saved.read_bytes()[:8]
    header_len = int.from_bytes(head, "little")
    assert 0 < header_len < os.path.getsize(saved)
    assert saved.read_bytes()[8:9] == b"{"


# --------------------------------------------------------------------------- prepare refusals


def _bad(w, index, value):
    w = w.clone()
    w[index] = value
    return w


def _cases():
    w13, w2 = random_moe_weights(2, 64, 32, seed=3)
    w13_h48, w2_h48 = random_moe_weights(2, 48, 32, seed=3)
    w13_i48, w2_i48 = random_moe_weights(2, 64, 48, seed=3)
    nan, inf = float("nan"), float("inf")
    return [
        ("w13-nan", (_bad(w13, (1, 3, 5), nan), w2), {}, ValueError, "w13.*NaN"),
        ("w13-inf", (_bad(w13, (0, 0, 0), -inf), w2), {}, ValueError, "w13.*Inf"),
        ("w2-nan", (w13, _bad(w2, (1, 63, 31), nan)), {}, ValueError, "w2.*NaN"),
        ("w2-inf", (w13, _bad(w2, (0, 1, 2), inf)), {}, ValueError, "w2.*Inf"),
        ("w13-bf16-inf", (_bad(w13, (0, 0, 0), inf).bfloat16(), w2), {}, ValueError, "w13"),
        ("w13-int", (w13.to(torch.int32), w2), {}, TypeError, "w13"),
        ("w2-int", (w13, w2.to(torch.int8)), {}, TypeError, "w2"),
        ("w13-fp8", (w13.to(F8), w2), {}, TypeError, "w13"),
        ("w13-not-tensor", (w13.tolist(), w2), {}, TypeError, "w13"),
        ("w13-2d", (w13[0], w2), {}, ValueError, "w13"),
        ("w2-4d", (w13, w2[None]), {}, ValueError, "w2"),
        ("H-48", (w13_h48, w2_h48), {}, ValueError, "w13.*H=48"),
        ("I-48", (w13_i48, w2_i48), {}, ValueError, "w13.*I=48"),
        ("odd-2I", (w13[:, :63], w2), {}, ValueError, "w13"),
        ("w2-transposed", (w13, w2.transpose(1, 2)), {}, ValueError, "w2"),
        ("w2-fewer-experts", (w13, w2[:1]), {}, ValueError, "w2"),
        ("only-a13", (w13, w2), {"a13_scale": 0.1}, ValueError, "a13_scale, a2_scale"),
        ("only-a2", (w13, w2), {"a2_scale": 0.1}, ValueError, "a13_scale, a2_scale"),
        ("a13-shape", (w13, w2), {"a13_scale": torch.ones(3), "a2_scale": 1.0}, ValueError, "a13"),
        ("a2-shape", (w13, w2), {"a13_scale": 1.0, "a2_scale": torch.ones(2, 1)}, ValueError, "a2"),
        ("a13-zero", (w13, w2), {"a13_scale": 0.0, "a2_scale": 1.0}, ValueError, "a13"),
        ("a2-negative", (w13, w2), {"a13_scale": 1.0, "a2_scale": -0.5}, ValueError, "a2"),
        (
            "a13-nan",
            (w13, w2),
            {"a13_scale": torch.tensor([1.0, nan]), "a2_scale": 1.0},
            ValueError,
            "a13",
        ),
        ("a2-inf", (w13, w2), {"a13_scale": 1.0, "a2_scale": inf}, ValueError, "a2"),
    ]


_CASES = _cases()


@pytest.mark.parametrize(
    "args,kwargs,exc,pattern", [c[1:] for c in _CASES], ids=[c[0] for c in _CASES]
)
def test_prepare_refuses(args, kwargs, exc, pattern):
    with pytest.raises(exc, match=pattern):
        prepare_experts(*args, **kwargs)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a second device (CUDA)")
def test_prepare_refuses_device_mismatch():
    w13, w2 = random_moe_weights(2, 64, 32, seed=3)
    with pytest.raises(ValueError, match=r"w2"):
        prepare_experts(w13, w2.cuda())


def test_prepare_does_not_modify_inputs(weights):
    w13, w2 = weights
    c13, c2 = w13.clone(), w2.clone()
    prepare_experts(w13, w2, a13_scale=0.1, a2_scale=0.2)
    assert torch.equal(w13, c13) and torch.equal(w2, c2)


@pytest.mark.parametrize("bad", [0.0, -1.0, float("nan"), float("inf")])
def test_from_linear_refuses_bad_static_scales(bad):
    w13 = torch.randn(2, 64, 64)
    w2 = torch.randn(2, 64, 32)
    t = prepare_experts(w13, w2, a13_scale=0.01, a2_scale=0.01).to_linear()
    t["a2_scale"][1] = bad
    with pytest.raises(ValueError, match="a2_scale"):
        PreparedExperts.from_linear(t)
