"""The decode-size Gluon GEMMs with whole-K programs (``gluon_ws.split_partials_tma(
whole=True)``, ``TritonOptions.gluon_whole_upto``): compiled for sm_90 and the path's
choices here; loop 3's bits on the GPU."""

from __future__ import annotations

import pytest
import torch

from fp4moe.kernels import gluon_ws
from fp4moe.kernels.gemm import GemmConfig
from fp4moe.kernels.launch import TritonOptions, moe_triton, workspace_bytes
from fp4moe.reference import moe_reference
from test_gluon_ws import _compile_check
from test_kernels import GPU_SHAPES, MODES, _edge_inputs, _edge_routes, _gpu_routes, _mode_id, _x
from testing import TOL, pretend_hopper, rel_err


def test_whole_kernel_compiles_for_sm90():
    """Both GEMMs, 8- and 16-row tiles, bf16 rows or the fused finalize, W4A4's globals:
    wgmma, no local memory, FC1 at 16-row tiles within 128 registers (four programs an
    SM); the ring's copies (a stage's two weights: a code and a scale box each) for the
    first stage, the three refills of each segment and the next segment's first stage,
    once in the code (the segments are a loop, not unrolled); no tile counter (no
    acq_rel atomic), and the fp32 atomic add exactly when fused."""
    pytest.importorskip("triton")
    code = (
        "from fp4moe.kernels.common import resource_usage\n"
        "from fp4moe.kernels.gluon_ws import compile_sm90\n"
        "for n, k, g in ((2048, 7168, True), (7168, 2048, False)):\n"
        "    for bm in (8, 16):\n"
        "        for fused, a_fp4 in ((False, False), (not g, False), (False, True)):\n"
        "            c = compile_sm90(n=n, k=k, gated=g, block_m=bm, asynchronous=True,\n"
        "                             buffers=1, epilogue=True, fused=fused, a_fp4=a_fp4,\n"
        "                             box3=2, whole=True, pdl=not g, early_weights=not g)\n"
        "            ptx = c.asm['ptx']\n"
        "            res = resource_usage(c)\n"
        "            key = (n, bm, fused, a_fp4)\n"
        "            assert '.local' not in ptx and res['STACK'] == 0, key\n"
        "            assert 'wgmma.mma_async' in ptx, key\n"
        "            assert res['REG'] <= (128 if bm == 16 else 96), (key, res['REG'])\n"
        "            w = 2 if g else 1\n"
        "            assert ptx.count('cp.async.bulk.tensor') == 2 * w * (1 + 3 + 1), key\n"
        "            assert 'acq_rel' not in ptx, key\n"
        "            assert ('atom.global.gpu.relaxed.add' in ptx) == fused, key\n"
        "print('ok')\n"
    )
    _compile_check(code)


def test_whole_runs_where_loop_3_would_not_split(monkeypatch):
    """``whole_runs``: off at 0 and without a Hopper GPU; with ``gluon_whole_upto`` set
    (28 by default), GEMMs that loop 3 runs unsplit and not dense, up to that many
    expected valid rows an expert, of K over one segment, at 8- or 16-row tiles; FC1 not
    where it writes NVFP4 (static W4A4) or takes the fused amax."""
    cfg16 = GemmConfig(16, 64, 128)
    off = TritonOptions(valid_fraction=1.0, gluon_whole_upto=0)
    on = TritonOptions(valid_fraction=1.0, gluon_whole_upto=16)
    assert TritonOptions().gluon_whole_upto == 28
    assert not on.whole_runs(False, False, 7168, False, cfg16, 10 * 32, 32)  # no GPU here
    pretend_hopper(monkeypatch)
    assert not off.whole_runs(False, False, 7168, False, cfg16, 10 * 32, 32)
    assert on.whole_runs(False, False, 7168, False, cfg16, 10 * 32, 32)
    assert on.whole_runs(False, False, 2048, True, cfg16, 16 * 32, 32)
    assert not on.whole_runs(False, False, 7168, False, cfg16, 17 * 32, 32)  # above upto
    assert not on.whole_runs(True, False, 7168, False, cfg16, 10 * 32, 32)  # split
    assert not on.whole_runs(False, True, 7168, False, cfg16, 10 * 32, 32)  # dense
    assert not on.whole_runs(False, False, 1024, False, cfg16, 10 * 32, 32)  # one segment
    assert not on.whole_runs(False, False, 768, False, cfg16, 10 * 32, 32)  # Qwen3's FC2
    assert not on.whole_runs(False, False, 7168, False, GemmConfig(64, 128, 64), 320, 32)
    assert not TritonOptions(valid_fraction=1.0, gluon_whole_upto=16, gluon_decode=False
                             ).whole_runs(False, False, 7168, False, cfg16, 320, 32)  # fmt: skip
    args = (False, False, 7168, cfg16, 10 * 32, 32)
    assert on.fc1_whole_runs("w4a16", "per_token", *args)
    assert on.fc1_whole_runs("w4a4", "per_token", *args)
    assert not on.fc1_whole_runs("w4a4", "static", *args)  # FC1 writes NVFP4
    famax = TritonOptions(valid_fraction=1.0, gluon_whole_upto=16, fused_amax=True)
    assert not famax.fc1_whole_runs("w4a4", "per_tensor", *args)
    for bad in (-1, True, "8"):
        with pytest.raises(ValueError, match="gluon_whole_upto"):
            TritonOptions(gluon_whole_upto=bad)


def test_workspace_bytes_without_partials(monkeypatch):
    """On the whole-K kernels a call holds no split-K partials: DeepSeek-V3 EP8's shape
    at 256 tokens (loop 3 unsplit: no partials either way), and at 64 tokens with
    ``gluon_upto`` lowered so that the call is not on the split Gluon kernels, the
    same bytes as loop 3 unsplit, fewer than loop 3 split."""
    pretend_hopper(monkeypatch)
    h, i, e = 7168, 2048, 32
    base = dict(valid_fraction=0.125)
    for t, extra in ((256, {}), (64, dict(gluon_upto=1.0))):
        opt_off = TritonOptions(**base, **extra, gluon_whole_upto=0)
        opt_on = TritonOptions(**base, **extra, gluon_whole_upto=16)
        off = workspace_bytes(t, 8, h, i, e, options=opt_off)
        on = workspace_bytes(t, 8, h, i, e, options=opt_on)
        assert on <= off, (t, on, off)
    split = workspace_bytes(64, 8, h, i, e, options=TritonOptions(**base, split_k=True))
    opt = TritonOptions(**base, gluon_upto=1.0, gluon_whole_upto=16)
    whole = workspace_bytes(64, 8, h, i, e, options=opt)
    assert whole < split


def test_split_partials_tma_whole_rejects():
    """``whole`` needs ``out`` (its epilogue) and the one-block body; the partials are
    needed otherwise. Named before any device work."""
    x = torch.zeros(8, 2048, dtype=torch.bfloat16)
    z = torch.zeros(4, dtype=torch.int32)
    w = torch.zeros(4, 1024, 1024, dtype=torch.uint8)
    kw = dict(n=1024, topk=8, gated=False, gather=False, block_m=16, ws_rows=8)
    with pytest.raises(ValueError, match="whole needs out"):
        gluon_ws.split_partials_tma(x, z, w, w, z, z, z, None, whole=True, **kw)
    out = torch.zeros(8, 1024, dtype=torch.bfloat16)
    g = torch.ones(4)
    with pytest.raises(ValueError, match="whole needs out"):
        gluon_ws.split_partials_tma(x, z, w, w, z, z, z, None, whole=True, out=out,
                                    w_global=g, a_tma=True, **kw)  # fmt: skip
    with pytest.raises(ValueError, match="part"):
        gluon_ws.split_partials_tma(x, z, w, w, z, z, z, None, out=out, w_global=g,
                                    counters=torch.zeros(64, dtype=torch.int32), **kw)  # fmt: skip


@pytest.mark.gpu
@pytest.mark.parametrize("t", [128, 256, "one-expert", "all-masked", "qwen3"])
@pytest.mark.parametrize("mode", MODES, ids=_mode_id)
@pytest.mark.parametrize("fused", [False, True], ids=["deterministic", "fused"])
def test_gluon_whole_gpu(gpu_experts, monkeypatch, t, mode, fused):
    """On the GPU, GEMMs on the whole-K Gluon kernels give loop 3's bits with the
    deterministic finalize, the reference's tolerance either way, every mode; DeepSeek-V3
    EP8 at 128 and 256 tokens (5 and 11 expected valid rows an expert), every route on
    one expert (many 16-row blocks), every route masked (zeros), and Qwen3 at 1024
    tokens (its FC1 whole, its FC2, K 768, on loop 3; static W4A4's FC1, which writes
    NVFP4, too). Outputs poisoned first; the kernel asserted to have run where it
    applies."""
    shape = "qwen3-30b-a3b" if t == "qwen3" else "deepseek-v3-ep8"
    e, h, _, k, e_total = GPU_SHAPES[shape]
    experts = gpu_experts(shape)
    m, sc = mode
    tt = {"qwen3": 1024}.get(t, 256) if isinstance(t, str) else t
    x, ids, w = _edge_inputs(tt, t, h, k, e, e_total, seed=17)
    wholes = []
    spl = gluon_ws.split_partials_tma

    def spy(*a, **kw):
        wholes.append(kw.get("whole", False))
        return spl(*a, **kw)

    monkeypatch.setattr(gluon_ws, "split_partials_tma", spy)
    outs = {}
    for upto in (0.0, 16.0):
        opt = TritonOptions(gluon_whole_upto=upto, poison=True)
        outs[upto] = moe_triton(x, ids, w, experts, mode=m, act_scale=sc,
                                fused_finalize=fused, options=opt)  # fmt: skip
    # Qwen3's static W4A4: FC1 writes NVFP4 (loop 3), FC2's K 768 is one segment
    assert (True in wholes) == (not (t == "qwen3" and sc == "static")), wholes
    if t == "all-masked":
        assert not outs[16.0].float().abs().any()
        return
    if not fused:
        assert torch.equal(outs[0.0], outs[16.0])
    ref = moe_reference(x, ids, w, experts, mode=m, act_scale=sc)
    assert rel_err(outs[16.0], ref) <= TOL[m]


def test_whole_fill_splits_a_gemm_of_too_few_whole_k_programs(monkeypatch):
    """``gluon_whole_fill``: a GEMM that would run whole-K splits K instead where its
    expected whole-K programs fill fewer than that many times the SMs' slots
    (``gluon_ws.WHOLE_PER_SM``): Mixtral-8x7B at 64 tokens (16 rows an expert), FC2's 8 x
    64 = 512 programs for 5 x 132 slots, not FC1's 8 x 224; DeepSeek-V3 EP8 at 256 tokens
    neither. Off (0) by default."""
    from fp4moe.kernels.gluon_ws import WHOLE_PER_SM
    from fp4moe.kernels.launch import gemm_configs_for, sm_count

    pretend_hopper(monkeypatch)
    assert TritonOptions().gluon_whole_fill == 0 and WHOLE_PER_SM == {True: 4, False: 5}
    assert sm_count() == 132  # no GPU here: the H200's
    mix = (4096, 14336)
    for fill, want in ((0.0, (False, False)), (1.0, (False, True)), (8.0, (True, True))):
        o = TritonOptions(valid_fraction=1.0, gluon_whole_fill=fill)
        cfgs = gemm_configs_for(128, 8, *mix, "w4a16", o)
        assert {c.block_m for c in cfgs} == {16}
        assert o.gemm_splits(128, 8, *mix, *cfgs) == want, fill
    o = TritonOptions(valid_fraction=1 / 8, gluon_whole_fill=1.0)
    cfgs = gemm_configs_for(2048, 32, 7168, 2048, "w4a16", o)
    assert o.gemm_splits(2048, 32, 7168, 2048, *cfgs) == (False, False)
    for bad in (-1, True, "1"):
        with pytest.raises(ValueError, match="gluon_whole_fill"):
            TritonOptions(gluon_whole_fill=bad)


def test_whole_wide_configs(monkeypatch):
    """``gluon_whole_wide``: above that many expected valid rows an expert, a call whose
    GEMMs run whole-K takes 32-row tiles (both GEMMs), which only the whole-K kernel
    takes (``gluon_applies(whole=True)``); at or below it, and off (None), 16-row tiles.
    21.5 by default. DeepSeek-V3 EP8 (valid fraction 1/8) at 768 / 1024 tokens is 24 / 32
    rows an expert."""
    from fp4moe.kernels.launch import gemm_configs_for, gluon_applies

    pretend_hopper(monkeypatch)
    monkeypatch.setattr("fp4moe.kernels.launch.gluon_available", lambda: True)
    assert TritonOptions().gluon_whole_wide == 21.5
    ds = (7168, 2048)
    base = dict(valid_fraction=1 / 8, gluon_whole_upto=32.0)
    for wide, t, bm in ((None, 768, 16), (16.0, 768, 32), (16.0, 1024, 32), (16.0, 512, 16),
                        (24.0, 768, 16)):  # fmt: skip
        o = TritonOptions(**base, gluon_whole_wide=wide)
        cfgs = gemm_configs_for(t * 8, 32, *ds, "w4a16", o, "per_token")
        assert {c.block_m for c in cfgs} == {bm}, (wide, t, cfgs)
        assert all(o.whole_runs(False, False, k, False, c, t * 8, 32)
                   for k, c in zip(ds, cfgs)), (wide, t)  # fmt: skip
    # the defaults: 32-row tiles above 21.5 rows, whole-K up to 28, the prefill kernels
    # for long K (Mixtral-8x7B) from 29 rows
    d = TritonOptions(valid_fraction=1 / 8)
    for t, bm, whole in ((672, 16, True), (704, 32, True), (896, 32, True), (928, None, False)):
        cfgs = gemm_configs_for(t * 8, 32, *ds, "w4a16", d, "per_token")
        if bm is not None:
            assert {c.block_m for c in cfgs} == {bm}, (t, cfgs)
        assert d.whole_runs(False, False, 7168, False, cfgs[0], t * 8, 32) == whole, t
    mix, dm = (4096, 14336), TritonOptions(valid_fraction=1.0)
    assert {c.block_m for c in gemm_configs_for(88 * 2, 8, *mix, "w4a16", dm)} == {32}
    assert not dm.dense_for(112 * 2, 8, mix) and dm.dense_for(116 * 2, 8, mix)
    c32 = GemmConfig(32, 64, 128)
    assert gluon_applies(7168, False, c32, whole=True)
    assert not gluon_applies(7168, False, c32)  # the split kernels: 8 or 16 rows
    for bad in (-1, True, "16"):
        with pytest.raises(ValueError, match="gluon_whole_wide"):
            TritonOptions(gluon_whole_wide=bad)


@pytest.mark.parametrize(
    "name",
    ["gluon_upto", "gluon_whole_upto", "gluon_whole_over", "gluon_whole_fill",
     "gluon_whole_wide", "gluon_pdl_upto", "valid_fraction"],
)  # fmt: skip
def test_number_options_refuse_nan(name):
    """Every number option of ``TritonOptions`` refuses NaN by name (a NaN threshold would
    compare false everywhere and quietly turn its path off or on); the optional ones
    (``gluon_whole_over``, ``gluon_whole_wide``) used to take it (session 20's review)."""
    with pytest.raises(ValueError, match=name):
        TritonOptions(**{name: float("nan")})


def test_whole_wide_kernel_compiles_for_sm90():
    """The whole-K kernel at 32-row tiles (``gluon_whole_wide``): both GEMMs, bf16 rows or
    the fused finalize, W4A4's globals; wgmma of N 32, no local memory, the segment's rows
    staged a 256-K stage at a time (FC1 within 160 registers: two programs an SM), the
    same copies as at 16 rows; and the 16-row kernel refuses nothing new: 32-row tiles
    are for WHOLE only (the split kernels are refused at launch)."""
    pytest.importorskip("triton")
    code = (
        "from fp4moe.kernels.common import resource_usage\n"
        "from fp4moe.kernels.gluon_ws import compile_sm90\n"
        "for n, k, g in ((2048, 7168, True), (7168, 2048, False)):\n"
        "    for fused, a_fp4 in ((False, False), (not g, False), (False, True)):\n"
        "        c = compile_sm90(n=n, k=k, gated=g, block_m=32, asynchronous=True,\n"
        "                         buffers=1, epilogue=True, fused=fused, a_fp4=a_fp4,\n"
        "                         box3=2, whole=True, pdl=not g, early_weights=not g)\n"
        "        ptx = c.asm['ptx']\n"
        "        res = resource_usage(c)\n"
        "        key = (n, fused, a_fp4)\n"
        "        assert '.local' not in ptx and res['STACK'] == 0, key\n"
        "        assert 'wgmma.mma_async.sync.aligned.m64n32k16' in ptx, key\n"
        "        assert res['REG'] <= (160 if g else 112), (key, res['REG'])\n"
        "        assert 2 * (c.metadata.shared + 1024) <= 233472, c.metadata.shared\n"
        "        w = 2 if g else 1\n"
        "        assert ptx.count('cp.async.bulk.tensor') == 2 * w * (1 + 3 + 1), key\n"
        "print('ok')\n"
    )
    _compile_check(code)


def test_split_partials_tma_32_rows_whole_only():
    """32-row tiles are the whole-K kernel's only; the split kernel refuses them by name,
    before any device work."""
    x = torch.zeros(8, 2048, dtype=torch.bfloat16)
    z = torch.zeros(4, dtype=torch.int32)
    w = torch.zeros(4, 1024, 1024, dtype=torch.uint8)
    part = torch.zeros(16, dtype=torch.float32)
    kw = dict(n=1024, topk=8, gated=False, gather=False, block_m=32, ws_rows=8)
    with pytest.raises(ValueError, match="32 with whole"):
        gluon_ws.split_partials_tma(x, z, w, w, z, z, z, part, **kw)


@pytest.mark.gpu
@pytest.mark.parametrize("t", [768, 1024, "one-expert", "all-masked"])
@pytest.mark.parametrize("mode", MODES, ids=_mode_id)
@pytest.mark.parametrize("fused", [False, True], ids=["deterministic", "fused"])
def test_gluon_whole_wide_gpu(gpu_experts, monkeypatch, t, mode, fused):
    """On the GPU, the whole-K kernels at 32-row tiles (``gluon_whole_wide`` 16,
    ``gluon_whole_upto`` 32) give loop 3's bits with the deterministic finalize and the
    reference's tolerance either way, every mode: DeepSeek-V3 EP8 at 768 and 1024 tokens
    (24 and 32 expected valid rows an expert: one or two 32-row blocks), every route on
    one expert (many blocks), every route masked (zeros; added after session 20's GPU
    time, not yet run there). Outputs poisoned first; the 32-row whole-K launches
    asserted."""
    e, h, _, k, e_total = GPU_SHAPES["deepseek-v3-ep8"]
    experts = gpu_experts("deepseek-v3-ep8")
    m, sc = mode
    tt = 1024 if isinstance(t, str) else t
    x = _x(tt, h, seed=19, device="cuda")
    ids, w = _gpu_routes(tt, k, e, e_total, seed=19)
    ids = _edge_routes(ids, t, expert=5)
    launches = []
    spl = gluon_ws.split_partials_tma

    def spy(*a, **kw):
        launches.append((kw.get("whole", False), kw.get("block_m")))
        return spl(*a, **kw)

    monkeypatch.setattr(gluon_ws, "split_partials_tma", spy)
    base = dict(valid_fraction=1 / 8, poison=True, gluon_whole_upto=32.0)
    loop3 = moe_triton(x, ids, w, experts, mode=m, act_scale=sc, fused_finalize=fused,
                       options=TritonOptions(**base, gluon_decode=False))  # fmt: skip
    assert not launches
    out = moe_triton(x, ids, w, experts, mode=m, act_scale=sc, fused_finalize=fused,
                     options=TritonOptions(**base, gluon_whole_wide=16.0))  # fmt: skip
    assert (True, 32) in launches, launches
    if t == "all-masked":
        assert not out.float().abs().any() and not loop3.float().abs().any()
        return
    if not fused:
        assert torch.equal(out, loop3)
    ref = moe_reference(x, ids, w, experts, mode=m, act_scale=sc)
    assert rel_err(out, ref) <= TOL[m]
