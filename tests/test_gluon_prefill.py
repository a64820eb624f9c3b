"""The prefill GEMMs in Gluon (``kernels.gluon_prefill``, ``TritonOptions.gluon_prefill``):
compiled for sm_90 and the path's choices here; loop 3's (the dense path's) bits on the
GPU."""

from __future__ import annotations

import pytest
import torch

from fp4moe.bench import warm_up
from fp4moe.kernels.launch import TritonOptions, moe_triton, workspace_bytes
from fp4moe.reference import moe_reference
from test_gluon_ws import _compile_check
from test_kernels import GPU_SHAPES, MODES, _edge_inputs, _gpu_routes, _mode_id, _x
from testing import TOL, pretend_hopper, rel_err


def test_prefill_kernel_compiles_for_sm90():
    """Both GEMMs, bf16 rows and the fused finalize, W4A4's globals: wgmma with the
    weights from registers, no local memory, registers within 255 for the 8 warps, the
    ring's five TMA copies a stage issued for its two first stages and as each of a
    segment's four (unrolled) stages is refilled,
    one program an SM of shared memory (two 82-KB stages), the fp32 atomic add exactly
    when fused."""
    pytest.importorskip("triton")
    code = (
        "from fp4moe.kernels.common import resource_usage\n"
        "from fp4moe.kernels.gluon_prefill import compile_sm90\n"
        "for n, k, g in ((2048, 7168, True), (7168, 2048, False)):\n"
        "    for fused in (False, True) if not g else (False,):\n"
        "        for a_fp4 in (False, True):\n"
        "            c = compile_sm90(n=n, k=k, gated=g, fused=fused, a_fp4=a_fp4)\n"
        "            ptx = c.asm['ptx']\n"
        "            res = resource_usage(c)\n"
        "            assert '.local' not in ptx and res['STACK'] == 0, (n, fused, a_fp4)\n"
        "            assert res['REG'] <= 255 and 'wgmma.mma_async' in ptx\n"
        "            assert ptx.count('cp.async.bulk.tensor') == 5 * (2 + 4), (n, fused)\n"
        "            assert ('atom.global.gpu.relaxed.add.v2.f32' in ptx) == fused\n"
        "            assert 2 * 82 * 1024 <= c.metadata.shared <= 227 * 1024\n"
        "            d = compile_sm90(n=n, k=k, gated=g, fused=fused, a_fp4=a_fp4, defer=True)\n"
        "            dptx = d.asm['ptx']\n"
        "            assert '.local' not in dptx and resource_usage(d)['REG'] <= 255\n"
        "            assert dptx.count('cp.async.bulk.tensor') == 5 * (2 + 4)\n"
        "print('ok')\n"
    )
    _compile_check(code)


def test_prefill_applies_and_rejects():
    """``applies``: whole 1024-K segments and whole weight tiles (64 outputs gated, 128
    not); ``prefill_gemm`` names what does not fit before touching a device."""
    from fp4moe.kernels import gluon_prefill

    assert gluon_prefill.applies(2048, 7168, True) and gluon_prefill.applies(7168, 2048, False)
    assert gluon_prefill.applies(768, 2048, True)  # Qwen3's FC1
    assert not gluon_prefill.applies(2048, 768, False)  # Qwen3's FC2: K 768
    assert not gluon_prefill.applies(2880, 2880, True)  # gpt-oss: K 2880
    assert not gluon_prefill.applies(7168 - 64, 2048, False)  # not whole 128-row tiles
    assert gluon_prefill.applies_to_call(7168, 2048)  # DeepSeek-V3: both GEMMs
    assert not gluon_prefill.applies_to_call(2048, 768)  # Qwen3: FC1 only
    xs = torch.zeros(4, 768, dtype=torch.bfloat16)
    z = torch.zeros(1, dtype=torch.int32)
    with pytest.raises(ValueError, match="K % 1024"):
        gluon_prefill.prefill_gemm(xs, z, z, z, z, z, z, z, z, n=2048, topk=8, gated=False,
                                   out_scale=1.0)  # fmt: skip
    xs = torch.zeros(4, 1024, dtype=torch.float32)
    with pytest.raises(ValueError, match="xs must be contiguous bf16"):
        gluon_prefill.prefill_gemm(xs, z, z, z, z, z, z, z, z, n=1024, topk=8, gated=False,
                                   out_scale=1.0)  # fmt: skip
    xs = torch.zeros(4, 1024, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="fused"):
        gluon_prefill.prefill_gemm(xs, z, z, z, z, z, z, z, z, n=1024, topk=8, gated=False,
                                   out_scale=1.0, fused=True)  # fmt: skip


def test_prefill_runs_only_on_the_dense_path_of_a_hopper_gpu(monkeypatch):
    """``prefill_runs``: the option on, loop 3, the call on the dense path, and a Hopper
    GPU with the Gluon kernels (never in the interpreter or on this machine)."""
    on = TritonOptions(gluon_prefill=True, valid_fraction=1.0)
    assert not on.prefill_runs(8192 * 8, 32)  # no GPU here (or the interpreter)
    pretend_hopper(monkeypatch)
    assert on.prefill_runs(8192 * 8, 32)  # 2048 valid rows an expert: dense
    assert not on.prefill_runs(16 * 8, 32)  # 4: not dense
    off = TritonOptions(gluon_prefill=False, valid_fraction=1.0)
    assert not off.prefill_runs(8192 * 8, 32)
    assert not TritonOptions(gluon_prefill=True, chunked=2, valid_fraction=1.0).prefill_runs(
        8192 * 8, 32
    )


def test_prefill_above_moves_the_dense_path_where_both_gemms_fit(monkeypatch):
    """With both GEMMs of the shape on ``gluon_prefill``, the dense path starts above
    ``prefill_above`` (32) valid rows an expert instead of ``dense_above`` (192); a shape
    with one GEMM that does not fit (Qwen3's FC2, K 768), the option off, no GPU, or
    ``prefill_above`` None keep ``dense_above``."""
    on = TritonOptions(valid_fraction=1.0)
    assert TritonOptions().prefill_above == 32
    ds, qwen = (7168, 2048), (2048, 768)
    assert not on.dense_for(33 * 32, 32, ds)  # no Hopper GPU here
    pretend_hopper(monkeypatch)
    assert not on.dense_for(32 * 32, 32, ds) and on.dense_for(33 * 32, 32, ds)
    assert not on.dense_for(97 * 32, 32) and on.dense_for(193 * 32, 32)  # no shape given
    assert not on.dense_for(150 * 32, 32, qwen) and on.dense_for(193 * 32, 32, qwen)
    off = TritonOptions(valid_fraction=1.0, gluon_prefill=False)
    assert not off.dense_for(150 * 32, 32, ds)
    assert not TritonOptions(valid_fraction=1.0, prefill_above=None).dense_for(150 * 32, 32, ds)
    assert not TritonOptions(valid_fraction=1.0, dense_above=None).dense_for(10**6, 32, ds)
    for bad in (-1, 1.5, True):
        with pytest.raises(ValueError, match="prefill_above"):
            TritonOptions(prefill_above=bad)
        with pytest.raises(ValueError, match="prefill_above_long"):
            TritonOptions(prefill_above_long=bad)
    # prefill_above_long (28) where both GEMMs' K reach 4096 (Mixtral-8x7B), not DeepSeek-V3
    mix = (4096, 14336)
    assert TritonOptions().prefill_above_long == 28
    assert not on.dense_for(28 * 8, 8, mix) and on.dense_for(29 * 8, 8, mix)
    assert not on.dense_for(32 * 32, 32, ds)
    no_long = TritonOptions(valid_fraction=1.0, prefill_above_long=None)
    assert not no_long.dense_for(32 * 8, 8, mix) and no_long.dense_for(33 * 8, 8, mix)
    assert not TritonOptions(valid_fraction=1.0, prefill_above=None).dense_for(150 * 8, 8, mix)


def test_workspace_bytes_on_the_prefill_path(monkeypatch):
    """On ``gluon_prefill`` no weight is decoded: the FC1 phase holds the gathered rows
    (all routes x H, bf16) instead of every expert's decoded w13, and static W4A4's FC1
    writes bf16 (the two-step path)."""
    pretend_hopper(monkeypatch)
    t, k, h, i, e = 1024, 8, 2048, 1024, 32
    off = TritonOptions(gluon_prefill=False, valid_fraction=1.0)
    on = TritonOptions(gluon_prefill=True, valid_fraction=1.0)
    for mode, sc in (("w4a16", "per_token"), ("w4a4", "static")):
        dense = workspace_bytes(t, k, h, i, e, mode=mode, act_scale=sc, block_m=128,
                                options=off)  # fmt: skip
        pre = workspace_bytes(t, k, h, i, e, mode=mode, act_scale=sc, block_m=128, options=on)
        assert pre < dense, (mode, pre, dense)
    n = t * k
    pre = workspace_bytes(t, k, h, i, e, block_m=128, options=on)
    sort = 4 * (3 * n + 2 * e + 1 + 3 * (-(-n // 128) + min(e, n)))
    assert pre == sort + n * i * 2 + n * i * 2 + n * h * 2  # FC2: a, its rows, route rows


@pytest.mark.gpu
@pytest.mark.parametrize("t", [1, 64, 2048, "one-expert", "all-masked"])
@pytest.mark.parametrize("mode", MODES, ids=_mode_id)
@pytest.mark.parametrize("fused", [False, True], ids=["deterministic", "fused"])
@pytest.mark.parametrize("shape", ["deepseek-v3-ep8", "qwen3-30b-a3b"])
def test_gluon_prefill_gpu(gpu_experts, shape, t, mode, fused):
    """On the GPU, the dense path's GEMMs on ``gluon_prefill`` give the dense path's bits
    (loop 3's) with the deterministic finalize and its tolerance fused, every mode; the
    reference's tolerance; every route masked gives zeros. Qwen3's FC2 (K 768) stays on
    the decoded weights, so that shape mixes the two. Outputs poisoned first."""
    e, h, _, k, e_total = GPU_SHAPES[shape]
    experts = gpu_experts(shape)
    m, sc = mode
    tt = 512 if isinstance(t, str) else t
    # one expert: many 128-row blocks of it, a partial last one
    x, ids, w = _edge_inputs(tt, t, h, k, e, e_total, seed=7)
    outs = {}
    for on in (False, True):
        opt = TritonOptions(dense_above=0, gluon_prefill=on, poison=True)  # dense at any size
        outs[on] = moe_triton(x, ids, w, experts, mode=m, act_scale=sc, fused_finalize=fused,
                              options=opt)  # fmt: skip
    if t == "all-masked":
        assert not outs[True].float().abs().any()
        return
    if not fused:
        assert torch.equal(outs[False], outs[True])
    ref = moe_reference(x, ids, w, experts, mode=m, act_scale=sc)
    assert rel_err(outs[True], ref) <= TOL[m]


@pytest.mark.gpu
def test_gluon_prefill_graph_replay_gpu(gpu_experts):
    """A CUDA graph of a prefill call, captured once, replays the eager call's bits with
    other routes of the same size."""
    e, h, _, k, e_total = GPU_SHAPES["deepseek-v3-ep8"]
    experts = gpu_experts("deepseek-v3-ep8")
    opt = TritonOptions(dense_above=0, gluon_prefill=True)
    x = _x(1024, h, seed=3, device="cuda")
    ids, w = _gpu_routes(1024, k, e, e_total, seed=3)
    static = [x.clone(), ids.clone(), w.clone()]

    def call():
        return moe_triton(*static, experts, options=opt)

    warm_up(call, 1)  # one call on a side stream before the capture
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = call()
    for seed in (4, 5):
        ids2, w2 = _gpu_routes(1024, k, e, e_total, seed=seed)
        static[1].copy_(ids2)
        static[2].copy_(w2)
        g.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, moe_triton(x, ids2, w2, experts, options=opt))


@pytest.mark.gpu
@pytest.mark.parametrize("t", [1, 16, 64, "one-expert"])
@pytest.mark.parametrize("fused", [False, True], ids=["deterministic", "fused"])
def test_gluon_whole_k_gpu(gpu_experts, t, fused):
    """``gluon_whole_k`` (the decode-size W4A16 GEMMs on the prefill kernel with the
    schedule's 8-row blocks): the Gluon split kernels' bits (loop 3's) with the
    deterministic finalize, the reference's tolerance either way. Outputs poisoned."""
    e, h, _, k, e_total = GPU_SHAPES["deepseek-v3-ep8"]
    experts = gpu_experts("deepseek-v3-ep8")
    tt = 4 if isinstance(t, str) else t
    x = _x(tt, h, seed=11, device="cuda")
    ids, w = _gpu_routes(tt, k, e, e_total, seed=11)
    if t == "one-expert":
        ids = torch.full_like(ids, 3)
    outs = {}
    for on in (False, True):
        opt = TritonOptions(gluon_whole_k=on, poison=True)
        outs[on] = moe_triton(x, ids, w, experts, fused_finalize=fused, options=opt)
    if not fused:
        assert torch.equal(outs[False], outs[True])
    assert rel_err(outs[True], moe_reference(x, ids, w, experts)) <= TOL["w4a16"]


@pytest.mark.gpu
@pytest.mark.parametrize("variant", ["defer", "bm64", "bm64x2-defer"])
@pytest.mark.parametrize("mode", MODES, ids=_mode_id)
def test_gluon_prefill_variants_gpu(gpu_experts, monkeypatch, variant, mode):
    """``gluon_prefill``'s experiments (``DEFER``; 64-row blocks, ``BM``; two programs an
    SM, ``PER_SM``) give loop 3's bits with the deterministic finalize (DeepSeek-V3's
    shape, 2048 tokens: 64 valid rows an expert, dense at any size)."""
    from fp4moe.kernels import gluon_prefill

    monkeypatch.setattr(gluon_prefill, "DEFER", "defer" in variant)
    monkeypatch.setattr(gluon_prefill, "BM", 64 if "bm64" in variant else 128)
    monkeypatch.setattr(gluon_prefill, "PER_SM", {8: 2, 64: 2} if "x2" in variant else {8: 2})
    e, h, _, k, e_total = GPU_SHAPES["deepseek-v3-ep8"]
    experts = gpu_experts("deepseek-v3-ep8")
    m, sc = mode
    x = _x(2048, h, seed=13, device="cuda")
    ids, w = _gpu_routes(2048, k, e, e_total, seed=13)
    loop3 = moe_triton(x, ids, w, experts, mode=m, act_scale=sc,
                       options=TritonOptions(dense_above=None, poison=True))  # fmt: skip
    out = moe_triton(x, ids, w, experts, mode=m, act_scale=sc,
                     options=TritonOptions(dense_above=0, poison=True))  # fmt: skip
    assert torch.equal(loop3, out)
