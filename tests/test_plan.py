"""The planner: its regimes on an H200 for the model presets, the options and pins, the
workspace accounting, ``fp4moe plan`` and ``explain`` (no kernel runs here)."""

from __future__ import annotations

import dataclasses
import json
import warnings

import pytest
import torch

import fp4moe
from fp4moe import InapplicableOverride, Options, Tile
from fp4moe.backend import H200, KERNELS, Target, explain, plan_call, workspace_bytes
from fp4moe.backend import heuristics as hx
from fp4moe.presets import MODES, PRESETS

INTERP = Target("interpreter", interpret=True, gluon=False, pdl=False, sm_count=1)
PORTABLE_GPU = Target("a GPU without Gluon", interpret=False, gluon=False, pdl=True, sm_count=108)


def _plan(preset: str, t: int, mode: str = "w4a16", *, target=H200, fused=False, **opt):
    p = PRESETS[preset]
    m, sc = MODES[mode]
    opt.setdefault("valid_fraction", p.local_experts / p.experts)
    return plan_call(t, p.top_k, p.local_experts, p.hidden, p.inter, mode=m, act_scale=sc,
                     fused_finalize=fused, options=Options(**opt), target=target)  # fmt: skip


# The H200 plans of DeepSeek-V3 EP8 W4A16: (tokens, FC1 kernel, FC2 kernel, block_m); the
# prefill kernel's tiles follow each expert's rows (the sort's block_m beside them: 64)
DEEPSEEK = [
    (1, "gluon-split", "gluon-split", 8),
    (16, "gluon-split", "gluon-split", 8),
    (64, "gluon-split", "gluon-split", 8),
    (128, "gluon-whole", "gluon-whole", 16),  # 4 rows: past WHOLE_K_FROM_ROWS
    (256, "gluon-whole", "gluon-whole", 16),
    (384, "gluon-whole", "gluon-whole", 16),  # 12 rows: PREFILL_ABOVE_ROWS
    (512, "gluon-prefill", "gluon-prefill", 64),  # 16 rows: the prefill kernel
    (1024, "gluon-prefill", "gluon-prefill", 64),
    (8192, "gluon-prefill", "gluon-prefill", 64),
]


@pytest.mark.parametrize("t,fc1,fc2,bm", DEEPSEEK)
def test_deepseek_regimes(t, fc1, fc2, bm):
    plan = _plan("deepseek-v3-ep8", t)
    assert (plan.fc1.kernel, plan.fc2.kernel, plan.block_m) == (fc1, fc2, bm)
    mixed = fc1 == "gluon-prefill"  # every expert's rows in tiles of its own size
    assert plan.fc1.mixed == plan.fc2.mixed == plan.mixed_sort == mixed
    assert ("by each expert's routes" in plan.fc1.describe()) == mixed
    assert ("32, 64 and 128 rows (each expert's" in explain(plan)) == mixed
    assert plan.valid_rows == pytest.approx(t * 8 / 8 / 32)
    assert plan.sort == ("triton" if t * 8 <= hx.SORT_KERNEL_MAX_ROUTES else "torch")
    assert plan.pdl and plan.finalize == "deterministic"
    for g in (plan.fc1, plan.fc2):
        assert g.split == (g.kernel == "gluon-split")
        if g.kernel == "gluon-split":  # counters of 64-row tiles over every row block
            assert g.counters > 0 and g.pdl == (t * 8 / 8 <= hx.GLUON_PDL_MAX_ROUTES)
        assert g.kernel != "gluon-prefill" or not g.pdl


def test_other_presets_regimes():
    ts = (1, 192, 256, 512, 8192)
    qwen = {t: _plan("qwen3-30b-a3b", t) for t in ts}
    # FC2's K (768) is one partial segment: the whole-K Gluon kernel on 8-row tiles (beside
    # FC1's split kernel), the portable loop on 16, then the prefill kernel (on 32-row
    # tiles by each expert's rows)
    assert [(qwen[t].fc2.kernel, qwen[t].fc2.tile.block_m) for t in ts] == [
        ("gluon-whole", 8), ("triton", 16), ("gluon-prefill", 64), ("gluon-prefill", 64),
        ("gluon-prefill", 64),
    ]  # fmt: skip
    assert [qwen[t].fc2.mixed for t in (192, 256, 512, 8192)] == [False, True, True, True]
    assert [qwen[t].fc1.kernel for t in ts] == [
        "gluon-split", "gluon-whole", "gluon-prefill", "gluon-prefill", "gluon-prefill",
    ]  # fmt: skip
    assert [qwen[t].block_m for t in (256, 512, 8192)] == [64, 64, 64]
    # K 2880 (a partial last segment; scale rows of 180 bytes, padded in memory for TMA):
    # the Gluon split kernel up to 4 rows, whole-K at 8 and 12 (every route valid), then the
    # prefill kernel (tiles by each expert's rows)
    oss = {t: _plan("gpt-oss-120b-shape", t) for t in (1, 128, 256, 384, 512, 2048, 4096, 8192)}
    assert [(oss[t].fc1.kernel, oss[t].fc1.segments, oss[t].block_m) for t in (1, 128)] == [
        ("gluon-split", 3, 8), ("gluon-split", 3, 8),
    ]  # fmt: skip
    for t in (256, 384):
        assert (oss[t].fc1.kernel, oss[t].fc2.kernel, oss[t].block_m) == (
            "gluon-whole", "gluon-whole", 16)  # fmt: skip
    assert (oss[512].fc1.kernel, oss[512].fc2.kernel, oss[512].fc1.mixed) == (
        "gluon-prefill", "gluon-prefill", True)  # fmt: skip
    assert [(oss[t].fc1.kernel, oss[t].fc2.kernel, oss[t].block_m) for t in (2048, 4096)] == [
        ("gluon-prefill", "gluon-prefill", 64), ("gluon-prefill", "gluon-prefill", 64),
    ]  # fmt: skip
    assert (oss[8192].block_m, oss[2048].fc1.mixed, oss[8192].fc2.mixed) == (64, True, True)
    # static W4A4 (FC1 writes NVFP4: no whole-K FC1) keeps split K at 8 rows
    static = _plan("gpt-oss-120b-shape", 256, "w4a4-static")
    assert (static.fc1.kernel, static.fc2.kernel) == ("gluon-split", "gluon-split")
    # Mixtral-8x7B at 8 rows: whole-K; Qwen3-30B-A3B's FC2 (one segment) cannot at 16 rows
    assert _plan("mixtral-8x7b", 32).fc1.kernel == "gluon-whole"
    assert _plan("mixtral-8x7b", 16).fc1.kernel == "gluon-split"  # 4 rows
    assert _plan("qwen3-30b-a3b", 128).fc1.kernel == "gluon-split"
    # the prefill kernel above 12 rows (PREFILL_ABOVE_ROWS)
    assert _plan("mixtral-8x7b", 48).fc1.kernel == "gluon-whole"  # 12 rows
    for t in (64, 96, 128):  # 16, 24, 32 rows
        mix = _plan("mixtral-8x7b", t)
        assert (mix.fc1.kernel, mix.fc2.kernel, mix.mixed_sort) == ("gluon-prefill",) * 2 + (True,)


def test_contiguous_scale_rows_regimes():
    """Scale rows TMA cannot copy (contiguous rows of 180 bytes, ``scales_tma=False``): the
    whole-K kernel is not taken (the portable loop at 16 rows), and the prefill kernel's
    64-row tiles only up to 64 rows."""
    p = PRESETS["gpt-oss-120b-shape"]

    def plan(t):
        return plan_call(t, p.top_k, p.local_experts, p.hidden, p.inter, target=H200,
                         options=Options(valid_fraction=1.0), scales_tma=False)  # fmt: skip

    assert plan(1).fc1.kernel == "gluon-split"
    assert plan(1).scale_loads and "pointer loads" in explain(plan(1))
    assert not plan(512).scale_loads  # the portable loop reads any row stride
    assert (plan(256).fc1.kernel, plan(256).block_m) == ("gluon-split", 16)
    assert plan(512).fc1.kernel == plan(512).fc2.kernel == "triton"
    assert (plan(2048).block_m, plan(4096).block_m) == (64, 128)
    # shapes whose contiguous rows TMA copies plan alike either way
    q = PRESETS["deepseek-v3-ep8"]
    for t in (1, 128, 1024):
        a, b = (plan_call(t, q.top_k, q.local_experts, q.hidden, q.inter, target=H200,
                          scales_tma=v) for v in (True, False))  # fmt: skip
        assert a == b


@pytest.mark.parametrize("h,i", [(256, 128), (2048, 768), (2880, 2880), (1024, 4096),
                                 (768, 1024), (7168, 2048), (4096, 14336)])  # fmt: skip
def test_portable_never_on_8_row_tiles(h, i):
    """8-row tiles are the Gluon kernels' alone (the portable kernel's Triton dot gives
    other bits there): wherever the plan takes them, both GEMMs run a Gluon kernel, in
    every mode, at decode and middle sizes."""
    for mode in MODES.values():
        for t in (1, 4, 16, 64, 256):
            for e, k in ((8, 2), (128, 8)):
                p = plan_call(t, k, e, h, i, mode=mode[0], act_scale=mode[1], target=H200)
                if p.block_m == 8:
                    assert {p.fc1.kernel, p.fc2.kernel} <= {"gluon-split", "gluon-whole"}, (
                        h, i, mode, t, e, p.fc1.kernel, p.fc2.kernel)  # fmt: skip


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("fused", [False, True])
def test_w4a4_steps(mode, fused):
    """The quantize steps, operands and finalize of each mode at a decode and a prefill
    size."""
    for t in (1, 8192):
        plan = _plan("deepseek-v3-ep8", t, mode, fused=fused)
        assert plan.finalize == ("atomic" if fused else "deterministic")
        assert plan.fc2.epilogue == ("atomic" if fused else "bf16")
        if mode == "w4a16":
            assert (plan.fc1_input, plan.fc2_input) == ("bf16", "bf16")
            continue
        if mode == "w4a8":  # e4m3 rows: by token for the portable loop, by route to prefill
            kernel = "triton" if t == 1 else "gluon-prefill"
            assert (plan.fc1.kernel, plan.fc2.kernel) == (kernel, kernel)
            assert plan.fc1_input == ("e4m3-row" if t == 1 else "e4m3-gather")
            assert plan.fc2_input == "e4m3-row" and not plan.fc1.split and not plan.fc2.split
            continue
        if mode == "w4a4-static":
            assert plan.fc1_input == "static"
            # FC1 writes NVFP4 itself, except on the prefill kernel (bf16, then quantize)
            assert plan.fc2_input == ("fc1-epilogue" if t == 1 else "static")
            assert plan.fc1.epilogue == ("nvfp4" if t == 1 else "bf16")
        elif mode == "w4a4-tensor":
            # one token's rows fit the quantize kernel's own amax; 8192 tokens need a kernel
            assert plan.fc1_input == ("per-tensor" if t == 1 else "per-tensor+amax")
            assert plan.fc1_amax_slot == (t != 1)
        else:
            assert (plan.fc1_input, plan.fc2_input) == ("per-row", "per-row")
        if t == 1:  # the Gluon kernels read rows the quantize kernel decoded
            assert plan.fc1.operand == "decoded"
            assert plan.fc2.operand == ("decode" if mode == "w4a4-static" else "decoded")
            assert plan.fc1.early_weights  # a quantize kernel sits between the sort and FC1
        else:
            assert plan.fc1.operand == plan.fc2.operand == "gather"


def test_portable_targets():
    """Without Gluon every GEMM stays on the portable kernels; the interpreter has no PDL."""
    for t in (1, 64, 256, 1024, 8192):
        for target in (PORTABLE_GPU, INTERP):
            plan = _plan("deepseek-v3-ep8", t, "w4a4-token", target=target)
            assert {plan.fc1.kernel, plan.fc2.kernel} <= {"triton", "triton-split", "triton-dense"}
            assert plan.pdl == (target is PORTABLE_GPU)
    assert _plan("deepseek-v3-ep8", 1, target=INTERP).fc1.tile.block_m == 16
    assert _plan("deepseek-v3-ep8", 8192, target=PORTABLE_GPU).fc1.kernel == "triton-dense"


def test_dispatched_rows():
    """Expert parallelism's expert side: one valid route a row, W4A4 rows quantized by
    their sender (decoded by a launch for the Gluon kernels), the per-tensor amax
    all-reduced by an amax kernel."""
    p = PRESETS["deepseek-v3-ep8"]
    kw = dict(options=Options(valid_fraction=1.0), target=H200, dispatched=True)
    plan = plan_call(8, 1, 32, p.hidden, p.inter, mode="w4a4", act_scale="per_tensor",
                     amax_all_reduce=True, **kw)  # fmt: skip
    assert plan.fc1_input == "dispatched" and plan.fc1.operand == "decode"
    assert plan.fc2_input == "per-tensor+amax" and plan.fc2_amax_slot
    assert not plan.fc1.early_weights and not plan.fused_finalize
    alone = plan_call(8, 1, 32, p.hidden, p.inter, mode="w4a4", act_scale="per_tensor", **kw)
    assert alone.fc2_input == "per-tensor"  # small and not all-reduced: the kernel's own amax


def test_pins():
    """``Options.gemm`` pins both GEMMs' kernel family where it applies and refuses where
    it does not, naming the pin."""
    for g in KERNELS:
        plan = _plan("deepseek-v3-ep8", 64, gemm=g)
        assert plan.fc1.kernel == plan.fc2.kernel == g
    qwen = _plan("qwen3-30b-a3b", 64, gemm="triton-split")  # FC2's K is one segment
    assert (qwen.fc1.kernel, qwen.fc2.kernel) == ("triton-split", "triton")
    qwen = _plan("qwen3-30b-a3b", 64, gemm="gluon-split")  # FC2's K 768: whole-K
    assert (qwen.fc1.kernel, qwen.fc2.kernel) == ("gluon-split", "gluon-whole")
    assert qwen.fc2.tile.block_m == 8 and not qwen.fc2.split
    for g in ("gluon-split", "gluon-whole"):
        with pytest.raises(InapplicableOverride, match=g):
            plan_call(64, 8, 16, 2048, 800, options=Options(gemm=g), target=H200)  # K 800
    with pytest.raises(InapplicableOverride, match="static"):  # FC1's K one segment
        plan_call(64, 8, 16, 1024, 2048, mode="w4a4", act_scale="static",
                  options=Options(gemm="gluon-split"), target=H200)  # fmt: skip
    with pytest.raises(InapplicableOverride, match="gluon-prefill"):
        plan_call(64, 8, 16, 2048, 800, options=Options(gemm="gluon-prefill"), target=H200)
    for g in ("gluon-split", "gluon-whole", "gluon-prefill"):
        with pytest.raises(InapplicableOverride, match="Gluon"):
            _plan("deepseek-v3-ep8", 64, gemm=g, target=INTERP)
    with pytest.raises(InapplicableOverride, match="static"):
        _plan("deepseek-v3-ep8", 64, "w4a4-static", gemm="gluon-whole")


def test_pinned_tiles():
    tile = Tile(32, 64, 128, 4, 2)
    plan = _plan("deepseek-v3-ep8", 4096, fc1_tile=tile, fc2_tile=tile)
    assert plan.fc1.tile == tile and plan.block_m == 32


@pytest.mark.parametrize(
    "kw,match",
    [
        (dict(valid_fraction=0.0), "valid_fraction"),
        (dict(valid_fraction=1.5), "valid_fraction"),
        (dict(valid_fraction=True), "valid_fraction"),
        (dict(pdl=1), "pdl"),
        (dict(gemm="loop3"), "gemm"),
        (dict(poison="yes"), "poison"),
        (dict(fc1_tile=Tile(16, 64, 64)), "both"),
        (dict(fc1_tile=Tile(16, 64, 64), fc2_tile=Tile(32, 64, 64)), "block_m"),
        (dict(fc1_tile=Tile(8, 64, 64), fc2_tile=Tile(8, 64, 64)), "at least 16"),
        (dict(fc1_tile=(16, 64, 64), fc2_tile=(16, 64, 64)), "Tile"),
    ],
)
def test_options_validated(kw, match):
    with pytest.raises((ValueError, TypeError), match=match):
        Options(**kw)


@pytest.mark.parametrize(
    "kw",
    [dict(block_m=12), dict(block_n=8), dict(block_k=512), dict(num_warps=3), dict(num_stages=0)],
)
def test_tile_validated(kw):
    with pytest.raises(ValueError, match=next(iter(kw))):
        Tile(**{**dict(block_m=16, block_n=64, block_k=64), **kw})


def test_plan_call_validated():
    with pytest.raises(ValueError, match="mode"):
        plan_call(1, 8, 32, 7168, 2048, mode="w4a8x", target=H200)
    with pytest.raises(ValueError, match="act_scale"):
        plan_call(1, 8, 32, 7168, 2048, act_scale="token", target=H200)


def test_workspace_bytes():
    """The largest phase grows with the tokens; split K adds its fp32 partials; the fused
    finalize holds an fp32 [T, H] through FC1 too; the decoded-weights path holds a bf16
    copy of the weights."""
    p = PRESETS["deepseek-v3-ep8"]
    sizes = [workspace_bytes(_plan("deepseek-v3-ep8", t)) for t in (1, 16, 256, 1024, 8192)]
    assert sizes == sorted(sizes) and sizes[0] > 0
    one = _plan("deepseek-v3-ep8", 1)
    n, _h, i = 8, p.hidden, p.inter
    partials = one.fc1.segments * n * 2 * i * 4
    assert workspace_bytes(one) >= partials + n * i * 2  # FC1's partials and output
    t = 8192
    fused = workspace_bytes(_plan("deepseek-v3-ep8", t, fused=True))
    rows = workspace_bytes(_plan("deepseek-v3-ep8", t))
    assert fused != rows and min(fused, rows) > t * 8 * i * 2  # FC1's output at least
    dense = _plan("gpt-oss-120b-shape", 8192, gemm="triton-dense")
    assert workspace_bytes(dense) > 128 * 2 * 2880 * 2880 * 2  # FC1's decoded weights


def test_layer_memory_report_uses_the_plan():
    """``MoELayer.memory_report`` gives the planner's workspace of its phases."""
    torch.manual_seed(0)
    e, h, i = 4, 64, 32
    w13, w2 = torch.randn(e, 2 * i, h) * 0.05, torch.randn(e, h, i) * 0.05
    layer = fp4moe.MoELayer(fp4moe.prepare_experts(w13, w2), fp4moe.RouterConfig(top_k=2),
                            gate_weight=torch.randn(e, h))  # fmt: skip
    rep = layer.memory_report(num_tokens=512)
    plan = plan_call(512, 2, e, h, i, mode="w4a4", act_scale="per_token",
                     options=layer.triton_options, target=H200)  # fmt: skip
    assert rep["prefill_workspace_bytes"] == workspace_bytes(plan)


def test_explain_and_summary():
    plan = _plan("deepseek-v3-ep8", 16, "w4a4-token", fused=True)
    text = explain(plan)
    assert "gluon-split (8 rows, K split 7)" in text and "atomic" in text
    assert plan.summary()["fc2"].startswith("gluon-split")
    json.dumps(plan.summary())
    e = fp4moe.prepare_experts(torch.randn(2, 64, 64) * 0.1, torch.randn(2, 64, 32) * 0.1)
    assert fp4moe.plan(e, 4, 2).target is H200  # CPU experts: an H200's plan
    with pytest.raises(ValueError, match="num_tokens"):
        fp4moe.plan(e, -1, 2)
    with pytest.raises(TypeError, match="experts"):
        fp4moe.plan(None, 1, 2)


def test_cli_plan(capsys, tmp_path):
    from fp4moe.cli import main

    out = tmp_path / "plan.json"
    assert main(["plan", "--preset", "deepseek-v3-ep8", "--num-tokens", "1", "16", "256",
                 "1024", "8192", "--json", str(out)]) == 0  # fmt: skip
    text = capsys.readouterr().out
    assert "gluon-split" in text and "gluon-whole" in text and "gluon-prefill" in text
    rows = json.loads(out.read_text())["rows"]
    assert [r["tokens"] for r in rows] == [1, 16, 256, 1024, 8192]
    assert main(["plan", "--num-tokens", "1", "--explain", "--modes", "w4a4-static"]) == 0
    assert "nvfp4 out" in capsys.readouterr().out
    assert main(["plan", "--num-tokens", "-1"]) == 2


def test_gluon_needs_the_tested_triton(monkeypatch):
    """With a Triton other than the tested line the Gluon kernels are off, with one
    warning."""
    import triton

    from fp4moe.backend import device

    device.gluon_supported.cache_clear()
    monkeypatch.setattr(triton, "__version__", "3.9.0")
    try:
        with pytest.warns(RuntimeWarning, match="portable"):
            assert device.gluon_supported() is False
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            assert device.gluon_supported() is False  # once
    finally:
        device.gluon_supported.cache_clear()


def test_w4a8_pins():
    """W4A8 runs on the portable kernel or the prefill kernel; other pins are refused, and
    the prefill pin where the shape or the device does not take it."""
    for g in ("gluon-split", "gluon-whole", "triton-split", "triton-dense"):
        with pytest.raises(InapplicableOverride, match="W4A8"):
            plan_call(16, 8, 32, 7168, 2048, mode="w4a8", options=Options(gemm=g), target=H200)
    p = plan_call(16, 8, 32, 7168, 2048, mode="w4a8", options=Options(gemm="gluon-prefill"),
                  target=H200)  # fmt: skip
    assert p.fc1.kernel == p.fc2.kernel == "gluon-prefill" and p.block_m == 32
    assert not (p.fc1.mixed or p.fc2.mixed)  # W4A8: one tile rows a call
    # W4A8's tile rows: 32 up to 16 rows, 64 up to 32, then 128
    for t, bm in ((512, 32), (768, 64), (1024, 64), (2048, 128)):
        auto = plan_call(t, 8, 32, 7168, 2048, mode="w4a8", target=H200,
                         options=Options(valid_fraction=1 / 8))  # fmt: skip
        assert (auto.fc1.kernel, auto.block_m, auto.mixed_sort) == ("gluon-prefill", bm, False)
    for t in (1024, 2048):  # the pin alone takes the rows the planner's W4A8 rule gives
        auto = plan_call(t, 8, 32, 7168, 2048, mode="w4a8", target=H200,
                         options=Options(valid_fraction=1 / 8))  # fmt: skip
        pin = plan_call(t, 8, 32, 7168, 2048, mode="w4a8", target=H200,
                        options=Options(valid_fraction=1 / 8, gemm="gluon-prefill"))  # fmt: skip
        assert auto.fc1.kernel == "gluon-prefill" and pin.block_m == auto.block_m
    wide = Tile(128, 128, 64, 8, 3)  # a pinned tile's rows where the prefill kernel has them
    p = plan_call(16, 8, 32, 7168, 2048, mode="w4a8", target=H200,
                  options=Options(gemm="gluon-prefill", fc1_tile=wide, fc2_tile=wide))  # fmt: skip
    assert p.block_m == 128
    with pytest.raises(InapplicableOverride, match="gluon-prefill"):
        plan_call(16, 4, 32, 2880, 2000, mode="w4a8", options=Options(gemm="gluon-prefill"),
                  target=H200)  # fmt: skip
    no_gluon = dataclasses.replace(H200, gluon=False)
    with pytest.raises(InapplicableOverride):
        plan_call(16, 8, 32, 7168, 2048, mode="w4a8", options=Options(gemm="gluon-prefill"),
                  target=no_gluon)  # fmt: skip
    assert plan_call(8192, 8, 32, 7168, 2048, mode="w4a8", target=no_gluon).fc1.kernel == "triton"
    # a pinned tile must keep W4A8's K tile (its accumulation order)
    for bad in (Tile(16, 64, 64), Tile(16, 64, 32)):
        with pytest.raises(InapplicableOverride, match="W4A8"):
            plan_call(16, 8, 32, 7168, 2048, mode="w4a8", target=H200,
                      options=Options(fc1_tile=bad, fc2_tile=Tile(16, 64, 128)))  # fmt: skip
    ok = Options(fc1_tile=Tile(64, 64, 128), fc2_tile=Tile(64, 128, 128))
    assert plan_call(16, 8, 32, 7168, 2048, mode="w4a8", target=H200, options=ok).block_m == 64
