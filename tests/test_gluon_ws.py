"""The TMA-fetched Gluon split partials (``kernels.gluon_ws``, ``gluon_decode.KERNEL =
"tma"``): compiled for sm_90 here; loop 3's bits on the GPU."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from fp4moe.kernels.launch import TritonOptions, moe_triton
from fp4moe.reference import moe_reference
from test_kernels import GPU_SHAPES, MODES, _gpu_routes, _mode_id, _x
from testing import TOL, rel_err

SRC = os.path.join(os.path.dirname(__file__), "..", "src")


def test_tma_split_kernel_compiles_for_sm90():
    """Both GEMMs, both tile heights, both main loops: wgmma, no spill, every TMA copy of
    the segment issued (FC1: 4 stages x 2 weights x (4 code boxes + 1 scale box) = 40);
    with the last unit's epilogue: the tile counter's acq_rel atomic, and the fp32 atomic
    add exactly when the finalize is fused."""
    pytest.importorskip("triton")
    code = (
        "from fp4moe.kernels.gluon_ws import compile_sm90\n"
        "for n, k, g, copies in ((2048, 7168, True, 40), (7168, 2048, False, 20)):\n"
        "    for bm in (8, 16):\n"
        "        for asy in (False, True):\n"
        "            c = compile_sm90(n=n, k=k, gated=g, block_m=bm, asynchronous=asy)\n"
        "            ptx = c.asm['ptx']\n"
        "            assert 'wgmma.mma_async' in ptx, (n, bm, asy)\n"
        "            assert '.local' not in ptx, (n, bm, asy)\n"
        "            assert ptx.count('cp.async.bulk.tensor') == copies, (n, bm, asy)\n"
        "    for fused in (False, True):  # the last unit's epilogue (a one-buffer ring)\n"
        "        c = compile_sm90(n=n, k=k, gated=g, block_m=8, asynchronous=True,\n"
        "                         buffers=1, epilogue=True, fused=fused)\n"
        "        ptx = c.asm['ptx']\n"
        "        assert 'atom.global.gpu.acq_rel.add' in ptx and '.local' not in ptx\n"
        "        assert ('atom.global.gpu.relaxed.add.f32' in ptx) == fused\n"
        "print('ok')\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = SRC + os.pathsep + env.get("PYTHONPATH", "")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env=env, timeout=600)  # fmt: skip
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]


def test_split_partials_bad_arguments(monkeypatch):
    """A segment that is no multiple of a stage, a bad tile height and an unknown
    ``gluon_decode.KERNEL`` are refused before anything is launched."""
    pytest.importorskip("triton.experimental.gluon")
    from fp4moe.kernels import gluon_decode, gluon_ws

    x = torch.zeros(4, 2048, dtype=torch.bfloat16)
    i32 = torch.zeros(4, dtype=torch.int32)
    codes = torch.zeros(2, 64, 1024, dtype=torch.uint8)
    scales = torch.zeros(2, 64, 128, dtype=torch.uint8)
    part = torch.zeros(2, 4, 64)
    kw = dict(n=64, topk=1, gated=False, gather=False, ws_rows=4)
    args = (x, i32, codes, scales, i32, i32, i32, part)
    with pytest.raises(ValueError, match="seg % 256"):
        gluon_ws.split_partials_tma(*args, block_m=8, seg=512 + 128, **kw)
    with pytest.raises(ValueError, match="block_m"):
        gluon_ws.split_partials_tma(*args, block_m=32, **kw)
    out = torch.zeros(4, 64, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="counters"):  # the epilogue needs its counters
        gluon_ws.split_partials_tma(*args, block_m=8, out=out, **kw)
    cnt = torch.zeros(4, dtype=torch.int32)
    with pytest.raises(ValueError, match="topk_w"):
        gluon_ws.split_partials_tma(*args, block_m=8, out=out, counters=cnt, fused=True,
                                    w_global=part[0, 0], **kw)  # fmt: skip
    monkeypatch.setattr(gluon_decode, "KERNEL", "tmaa")
    with pytest.raises(ValueError, match=r"gluon_decode\.KERNEL"):
        gluon_decode.split_partials(*args, block_m=8, **kw)


@pytest.mark.gpu
@pytest.mark.parametrize("t", [1, 3, 16, 64, "one-expert"])
@pytest.mark.parametrize("asynchronous", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("buffers", [1, 4], ids=["ring1", "whole"])
def test_tma_split_gpu(monkeypatch, t, asynchronous, buffers):
    """``gluon_decode`` with the TMA partials: loop 3's bits for the whole W4A16 call
    (deterministic finalize; 8-row tiles up to 16 tokens, 16-row at 64), the fused
    finalize within the tolerance; every route on one expert too. ``buffers``: the
    segment's four stages through a one-buffer ring, or all in shared memory at once."""
    from fp4moe.kernels import gluon_decode, gluon_ws
    from test_kernels import _experts

    monkeypatch.setattr(gluon_ws, "ASYNC_WGMMA", asynchronous)
    monkeypatch.setattr(gluon_decode, "KERNEL", "tma")
    monkeypatch.setattr(gluon_ws, "BUFFERS", buffers)
    e, h, i, k, e_total = GPU_SHAPES["deepseek-v3-ep8"]
    experts = _experts(e, h, i, seed=0, device="cuda")
    n = 16 if t == "one-expert" else t
    x = _x(n, h, seed=7, device="cuda")
    ids, w = _gpu_routes(n, k, e, e_total, seed=7)
    if t == "one-expert":
        ids = torch.full_like(ids, 5)
        ids[:, 1:] = -1  # top-1 on expert 5, the other routes masked
    for fused in (False, True):
        a = moe_triton(x, ids, w, experts, mode="w4a16", fused_finalize=fused,
                       options=TritonOptions(poison=True, gluon_decode=False))  # fmt: skip
        b = moe_triton(x, ids, w, experts, mode="w4a16", fused_finalize=fused,
                       options=TritonOptions(poison=True, gluon_decode=True))  # fmt: skip
        if fused:
            ref = moe_reference(x, ids, w, experts, mode="w4a16")
            assert rel_err(b, ref) <= TOL["w4a16"]
        else:
            assert torch.equal(a, b)


@pytest.mark.gpu
@pytest.mark.parametrize("t", [1, 16])
@pytest.mark.parametrize("mode", MODES[1:], ids=_mode_id)
def test_tma_split_w4a4_gpu(t, mode):
    """W4A4 through the TMA kernel (its activation rows decoded once by ``dense_rows``):
    loop 3's bits, deterministic and fused finalize, per-token, static (FC1's NVFP4
    output: the split kernel's epilogue on the Gluon partials) and per-tensor scales."""
    from test_kernels import _experts

    m, sc = mode
    e, h, i, k, e_total = GPU_SHAPES["deepseek-v3-ep8"]
    experts = _experts(e, h, i, seed=0, device="cuda")
    x = _x(t, h, seed=11, device="cuda")
    ids, w = _gpu_routes(t, k, e, e_total, seed=11)
    for fused in (False, True):
        a = moe_triton(x, ids, w, experts, mode=m, act_scale=sc, fused_finalize=fused,
                       options=TritonOptions(poison=True, gluon_decode=False))  # fmt: skip
        b = moe_triton(x, ids, w, experts, mode=m, act_scale=sc, fused_finalize=fused,
                       options=TritonOptions(poison=True))  # fmt: skip
        if fused:
            ref = moe_reference(x, ids, w, experts, mode=m, act_scale=sc)
            assert rel_err(b, ref) <= TOL["w4a4"]
        else:
            assert torch.equal(a, b)
