"""The Gluon decode GEMMs (``kernels.gluon_ws``, ``TritonOptions.gluon_decode``): compiled
for sm_90 here, the quantize kernels' decoded rows in the interpreter; loop 3's bits on
the GPU."""

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


def _compile_check(code: str) -> None:
    """Run ``code`` (compiles for sm_90 and prints ok) in a process without the
    interpreter: this one has the kernels imported for it."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = SRC + os.pathsep + env.get("PYTHONPATH", "")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env=env, timeout=600)  # fmt: skip
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]


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
        "    for box in (1, 2):  # CODE_BOX3, CODE_WIDE: a box a stage and weight\n"
        "        c = compile_sm90(n=n, k=k, gated=g, block_m=8, asynchronous=True,\n"
        "                         buffers=1, epilogue=True, box3=box)\n"
        "        assert c.asm['ptx'].count('cp.async.bulk.tensor') == copies * 2 // 5\n"
        "        assert '.local' not in c.asm['ptx']\n"
        "print('ok')\n"
    )
    _compile_check(code)


def test_tma_stage_k_and_pdl_compile_for_sm90():
    """Ring stages below 256 K (``stage_k``): one 3-D code box a stage and weight, the
    scale box once a 256-K group (FC1, one segment of 1024 K: 16 / 8 stages x 2 weights
    + 4 groups x 2), no spill, the scale ring of ``scale_slots``; with ``pdl`` one grid
    wait and one release, FC1 waiting before any copy (its schedule comes from the kernel
    just before) and FC2 with ``early_weights`` issuing copies before it. K segments of 512
    (``seg``) compile with half the copies and the activation rows' shared memory."""
    pytest.importorskip("triton")
    code = (
        "from fp4moe.kernels.gluon_ws import compile_sm90, scale_slots\n"
        "assert [scale_slots(b, 64) for b in (1, 2, 3, 4, 5)] == [1, 2, 2, 2, 2]\n"
        "assert [scale_slots(b, 128) for b in (1, 2, 3, 4)] == [1, 2, 2, 3]\n"
        "assert [scale_slots(b, 256) for b in (1, 2, 4)] == [1, 2, 4]\n"
        "for sk, nb, copies in ((64, 2, 40), (128, 2, 24), (128, 3, 24)):\n"
        "    c = compile_sm90(n=2048, k=7168, gated=True, block_m=8, asynchronous=True,\n"
        "                     buffers=nb, epilogue=True, box3=True, stage_k=sk)\n"
        "    ptx = c.asm['ptx']\n"
        "    assert ptx.count('cp.async.bulk.tensor') == copies, (sk, nb)\n"
        "    assert '.local' not in ptx and 'wgmma.mma_async' in ptx, (sk, nb)\n"
        "for n, k, g, early in ((2048, 7168, True, False), (7168, 2048, False, True)):\n"
        "    c = compile_sm90(n=n, k=k, gated=g, block_m=8, asynchronous=True, buffers=1,\n"
        "                     epilogue=True, box3=True, pdl=True, early_weights=early)\n"
        "    ptx = c.asm['ptx']\n"
        "    assert c.metadata.launch_pdl\n"
        "    assert ptx.count('griddepcontrol.wait') == 1\n"
        "    assert ptx.count('griddepcontrol.launch_dependents') == 1\n"
        "    first = ptx.index('cp.async.bulk.tensor') < ptx.index('griddepcontrol.wait')\n"
        "    assert first == early, (n, early)\n"
        "c = compile_sm90(n=7168, k=2048, gated=False, block_m=8, buffers=1, epilogue=True)\n"
        "assert 'griddepcontrol' not in c.asm['ptx'] and not c.metadata.launch_pdl\n"
        "# K segments of 512 (launch.SEGMENT): half the copies and the rows' shared memory\n"
        "kw = dict(n=2048, k=7168, gated=True, block_m=8, asynchronous=True, buffers=1,\n"
        "          epilogue=True, box3=2)\n"
        "a, b = compile_sm90(**kw), compile_sm90(**kw, seg=512)\n"
        "assert b.asm['ptx'].count('cp.async.bulk.tensor') == 8 and '.local' not in b.asm['ptx']\n"
        "assert b.metadata.shared == a.metadata.shared - 8 * 512 * 2\n"
        "print('ok')\n"
    )
    _compile_check(code)


def test_tma_a_tma_compiles_for_sm90():
    """``A_TMA``: the activation rows come with each stage as one 3-D box (FC1: 16 weight
    copies + 4 row copies a 1024-K segment; FC2: 8 + 4), no register staging of the
    segment (no shared stores but the epilogue's), less shared memory, no spill; with
    early weights (FC2 under PDL) the rows' first copy comes after the grid wait and the
    weights' before it; ``out_unit_order`` compiles (FC1's epilogue). The timing
    diagnostics (``DIAG``): 1 leaves out the decode, 2 the copies and their waits, 3
    both, 4 both and the wgmmas (the epilogue's counter stays)."""
    pytest.importorskip("triton")
    code = (
        "from fp4moe.kernels.gluon_ws import compile_sm90\n"
        "for n, k, g, copies in ((2048, 7168, True, 20), (7168, 2048, False, 12)):\n"
        "    for bm in (8, 16):\n"
        "        kw = dict(n=n, k=k, gated=g, block_m=bm, asynchronous=True, buffers=1,\n"
        "                  epilogue=True, box3=2)\n"
        "        base = compile_sm90(**kw)\n"
        "        c = compile_sm90(**kw, a_tma=True, out_unit_order=g)\n"
        "        ptx = c.asm['ptx']\n"
        "        assert ptx.count('cp.async.bulk.tensor') == copies, (n, bm)\n"
        "        assert ptx.count('cp.async.bulk.tensor.3d') == 4, (n, bm)\n"
        "        assert '.local' not in ptx and 'wgmma.mma_async' in ptx\n"
        "        assert c.metadata.shared < base.metadata.shared - 4096 * bm // 8\n"
        "        assert base.asm['ptx'].count('st.shared') > ptx.count('st.shared')\n"
        "c = compile_sm90(n=7168, k=2048, gated=False, block_m=8, asynchronous=True,\n"
        "                 buffers=1, epilogue=True, box3=2, a_tma=True, pdl=True,\n"
        "                 early_weights=True)\n"
        "ptx = c.asm['ptx']\n"
        "w = ptx.index('griddepcontrol.wait')\n"
        "assert ptx.index('cp.async.bulk.tensor.2d') < w < ptx.index('cp.async.bulk.tensor.3d')\n"
        "# DIAG (timing only): 1 no decode (no asm), 2 no copies and no waits, 3 neither\n"
        "kw = dict(n=2048, k=7168, gated=True, block_m=8, asynchronous=True, buffers=1,\n"
        "          epilogue=True, box3=2)\n"
        "d0, d1, d2, d3, d4 = (compile_sm90(**kw, diag=d).asm['ptx'] for d in range(5))\n"
        "assert d0.count('fma.rn.bf16x2') > 0 == d1.count('fma.rn.bf16x2')\n"
        "assert d2.count('fma.rn.bf16x2') == d0.count('fma.rn.bf16x2')\n"
        "assert d1.count('cp.async.bulk.tensor') == d0.count('cp.async.bulk.tensor') > 0\n"
        "assert d2.count('cp.async.bulk.tensor') == 0 == d2.count('mbarrier.try_wait')\n"
        "assert d3.count('fma.rn.bf16x2') == 0 == d3.count('cp.async.bulk.tensor')\n"
        "assert d3.count('mbarrier.try_wait') == 0 and 'wgmma.mma_async' in d3\n"
        "assert 'wgmma.mma_async' not in d4 and d4.count('cp.async.bulk.tensor') == 0\n"
        "assert d4.count('fma.rn.bf16x2') == 0 and 'atom.global.gpu.acq_rel.add' in d4\n"
        "print('ok')\n"
    )
    _compile_check(code)


def test_split_partials_bad_arguments():
    """A segment that is no multiple of a stage, a bad tile height, the epilogue without
    its counters or router weights, and a bad ``grid_blocks`` (or one without the sort's
    ``valid_blocks``) are refused before anything is launched."""
    pytest.importorskip("triton.experimental.gluon")
    from fp4moe.kernels import gluon_ws

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
    with pytest.raises(ValueError, match="stage_k"):
        gluon_ws.split_partials_tma(*args, block_m=8, stage_k=96, **kw)
    out = torch.zeros(4, 64, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="counters"):  # the epilogue needs its counters
        gluon_ws.split_partials_tma(*args, block_m=8, out=out, **kw)
    cnt = torch.zeros(4, dtype=torch.int32)
    with pytest.raises(ValueError, match="topk_w"):
        gluon_ws.split_partials_tma(*args, block_m=8, out=out, counters=cnt, fused=True,
                                    w_global=part[0, 0], **kw)  # fmt: skip
    # grid_blocks: an int >= 0, and it needs the sort's valid_blocks
    with pytest.raises(ValueError, match="valid_blocks"):
        gluon_ws.split_partials_tma(*args, block_m=8, grid_blocks=2, **kw)
    for bad in (-1, 1.5, True):
        with pytest.raises(ValueError, match="grid_blocks"):
            gluon_ws.split_partials_tma(*args, block_m=8, grid_blocks=bad,
                                        valid_blocks=i32[:1], **kw)  # fmt: skip
    # persist: an int >= 0, with the sort's valid_blocks, not with a_tma or grid_blocks
    for bad in (-1, 2.0, True):
        with pytest.raises(ValueError, match="persist"):
            gluon_ws.split_partials_tma(*args, block_m=8, persist=bad, valid_blocks=i32[:1],
                                        **kw)  # fmt: skip
    with pytest.raises(ValueError, match="persist needs valid_blocks"):
        gluon_ws.split_partials_tma(*args, block_m=8, persist=4, **kw)
    with pytest.raises(ValueError, match="persist needs valid_blocks"):
        gluon_ws.split_partials_tma(*args, block_m=8, persist=4, valid_blocks=i32[:1],
                                    grid_blocks=2, **kw)  # fmt: skip


def _same_as_loop3(x, ids, w, experts, m, sc, **options):
    """The call with ``options`` against loop 3 (``gluon_decode`` off), both poisoned:
    the same bits with deterministic finalize, the fused finalize within the tolerance
    of the reference."""
    for fused in (False, True):
        a = moe_triton(x, ids, w, experts, mode=m, act_scale=sc, fused_finalize=fused,
                       options=TritonOptions(poison=True, gluon_decode=False))  # fmt: skip
        b = moe_triton(x, ids, w, experts, mode=m, act_scale=sc, fused_finalize=fused,
                       options=TritonOptions(poison=True, **options))  # fmt: skip
        if fused:
            ref = moe_reference(x, ids, w, experts, mode=m, act_scale=sc)
            assert rel_err(b, ref) <= TOL[m], (m, sc)
        else:
            assert torch.equal(a, b), (m, sc)


def _small_case(device, *, seed: int):
    """Interpreter-sized experts (4 of H 128, I 64), 5 tokens of x and top-2 routes, a
    fifth of them masked."""
    from test_kernels import _experts, _routes

    experts = _experts(4, 128, 64, seed=seed, device=device)
    x = _x(5, 128, seed=seed, device=device)
    ids, w = _routes(5, 2, 4, seed=seed, device=device, masked=0.2)
    return experts, x, ids, w


def _spy_gemm(monkeypatch, pick):
    """Record ``pick(kwargs)`` of every ``launch._gemm`` call from now on (the list)."""
    from fp4moe.kernels import launch

    seen = []
    real = launch._gemm

    def spy(*args, **kw):
        seen.append(pick(kw))
        return real(*args, **kw)

    monkeypatch.setattr(launch, "_gemm", spy)
    return seen


def _deepseek_case(t, *, seed: int, expert: int):
    """DeepSeek-V3 EP8 experts, x and routes on the GPU for ``t`` tokens, or 16 tokens
    with "one-expert" (top-1 on ``expert``, the other routes masked) or "all-masked"."""
    from test_kernels import _experts

    e, h, i, k, e_total = GPU_SHAPES["deepseek-v3-ep8"]
    experts = _experts(e, h, i, seed=0, device="cuda")
    n = t if isinstance(t, int) else 16
    x = _x(n, h, seed=seed, device="cuda")
    ids, w = _gpu_routes(n, k, e, e_total, seed=seed)
    if t == "one-expert":
        ids = torch.full_like(ids, expert)
        ids[:, 1:] = -1
    elif t == "all-masked":
        ids = torch.full_like(ids, -1)
    return experts, x, ids, w


@pytest.mark.gpu
@pytest.mark.parametrize("t", [1, 3, 16, 64, "one-expert", "all-masked"])
@pytest.mark.parametrize("asynchronous", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("buffers", [1, 4], ids=["ring1", "whole"])
def test_tma_split_gpu(monkeypatch, t, asynchronous, buffers):
    """``gluon_decode`` (the TMA kernel): loop 3's bits for the whole W4A16 call
    (deterministic finalize; 8-row tiles up to 16 tokens, 16-row at 64), the fused
    finalize within the tolerance; every route on one expert, and every route masked
    (zeros, no NaN from the poisoned buffers), too. ``buffers``: the
    segment's four stages through a one-buffer ring, or all in shared memory at once."""
    from fp4moe.kernels import gluon_ws

    monkeypatch.setattr(gluon_ws, "ASYNC_WGMMA", asynchronous)
    monkeypatch.setattr(gluon_ws, "BUFFERS", buffers)
    experts, x, ids, w = _deepseek_case(t, seed=7, expert=5)
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
        if t == "all-masked":
            assert not b.float().abs().any()  # zeros (NaN would fail this too)


@pytest.mark.gpu
@pytest.mark.parametrize("t", [1, 16, "one-expert"])
@pytest.mark.parametrize(
    "variant", ["sk64-b2", "sk128-b2", "sk128-b3", "pdl-off", "pdl-late", "box3"]
)
def test_tma_stage_k_and_pdl_gpu(monkeypatch, t, variant):
    """Ring stages of 64 and 128 K (the scales in their own ring; the 3-D code boxes), the
    Gluon kernels launched without PDL or with PDL but FC2 copying only after its wait,
    and the 3-D code boxes at 256 K (``CODE_WIDE`` off): loop 3's bits
    for whole W4A16 and W4A4 per-token calls (deterministic finalize), every route on one
    expert too."""
    from fp4moe.kernels import gluon_ws

    if variant.startswith("sk"):
        sk, nb = variant[2:].split("-b")
        monkeypatch.setattr(gluon_ws, "STAGE_K", int(sk))
        monkeypatch.setattr(gluon_ws, "BUFFERS", int(nb))
    elif variant == "pdl-off":
        monkeypatch.setattr(gluon_ws, "PDL", False)
    elif variant == "box3":  # one 3-D box of 32-byte rows a stage (CODE_WIDE off)
        monkeypatch.setattr(gluon_ws, "CODE_WIDE", False)
    else:
        monkeypatch.setattr(gluon_ws, "EARLY_WEIGHTS", False)
    experts, x, ids, w = _deepseek_case(t, seed=17, expert=3)
    for m, sc in MODES[:2]:
        a = moe_triton(x, ids, w, experts, mode=m, act_scale=sc,
                       options=TritonOptions(poison=True, gluon_decode=False))  # fmt: skip
        b = moe_triton(x, ids, w, experts, mode=m, act_scale=sc,
                       options=TritonOptions(poison=True))  # fmt: skip
        assert torch.equal(a, b), (m, sc)


@pytest.mark.gpu
@pytest.mark.parametrize("t", [1, 16])
@pytest.mark.parametrize("mode", MODES[:2], ids=_mode_id)
def test_tma_four_boxes_gpu(monkeypatch, t, mode):
    """``gluon_ws.CODE_BOX3`` and ``CODE_WIDE`` off: a stage's codes as four 2-D TMA boxes
    (the default is one wide box, ``test_tma_split_gpu``) give loop 3's bits, W4A16 and
    W4A4 per-token."""
    from fp4moe.kernels import gluon_ws
    from test_kernels import _experts

    monkeypatch.setattr(gluon_ws, "CODE_BOX3", False)
    monkeypatch.setattr(gluon_ws, "CODE_WIDE", False)
    m, sc = mode
    e, h, i, k, e_total = GPU_SHAPES["deepseek-v3-ep8"]
    experts = _experts(e, h, i, seed=0, device="cuda")
    x = _x(t, h, seed=13, device="cuda")
    ids, w = _gpu_routes(t, k, e, e_total, seed=13)
    a = moe_triton(x, ids, w, experts, mode=m, act_scale=sc,
                   options=TritonOptions(poison=True, gluon_decode=False))  # fmt: skip
    b = moe_triton(x, ids, w, experts, mode=m, act_scale=sc, options=TritonOptions(poison=True))
    assert torch.equal(a, b)


@pytest.mark.gpu
@pytest.mark.parametrize("t", [1, 16])
@pytest.mark.parametrize("mode", MODES[1:], ids=_mode_id)
@pytest.mark.parametrize("qdec", [False, True], ids=["dense_rows", "quantize_decoded"])
def test_tma_split_w4a4_gpu(t, mode, qdec):
    """W4A4 through the TMA kernel (its activation rows decoded once by ``dense_rows``, or
    by the quantize kernels: ``quantize_decoded``): loop 3's bits, deterministic and fused
    finalize, per-token, static (FC1's NVFP4 output: the split kernel's epilogue on the
    Gluon partials) and per-tensor scales."""
    from test_kernels import _experts

    m, sc = mode
    e, h, i, k, e_total = GPU_SHAPES["deepseek-v3-ep8"]
    experts = _experts(e, h, i, seed=0, device="cuda")
    x = _x(t, h, seed=11, device="cuda")
    ids, w = _gpu_routes(t, k, e, e_total, seed=11)
    _same_as_loop3(x, ids, w, experts, m, sc, quantize_decoded=qdec)


@pytest.mark.kernel
@pytest.mark.parametrize("rows,c", [(5, 128), (40, 192), (3, 64)])
@pytest.mark.parametrize("qmode", ["per_row", "static", "scalar"])
def test_quantize_writes_decoded_rows(interpret, device, rows, c, qmode):
    """``quantize_rows(decoded=...)``: the same codes, scales and globals, and the rows
    decoded bit for bit as ``dense_rows(codes, scales, order=64)`` decodes them (the
    Gluon GEMMs' W4A4 operand), zero rows, tiny values (-0 codes) and a count included;
    few rows (one chunk a program) and many."""
    from fp4moe.kernels import quantize as q
    from fp4moe.kernels.dequant import dense_rows
    from fp4moe.kernels.launch import decoded_rows_dtype, quantize_rows

    g = torch.Generator().manual_seed(rows * c)
    x = torch.randn(rows + 2, c, generator=g) * torch.rand(rows + 2, 1, generator=g) * 4
    x[1] = 0.0  # an all-zero row
    x[2, : c // 2] *= 1e-6  # codes of tiny values: -0 and +0
    x = x.to(torch.bfloat16).to(device)
    index = torch.arange(rows, dtype=torch.int32, device=device).flip(0) * 2  # gather // 2
    kw = dict(index=index, div=2)
    if qmode == "per_row":
        kw["mode"] = q.MODE_PER_ROW
    elif qmode == "static":
        parity = torch.arange(rows, dtype=torch.int32, device=device) % 2
        kw.update(mode=q.MODE_STATIC, table=torch.tensor([0.01, 0.02], device=device),
                  row_expert=parity)  # fmt: skip
    else:
        kw.update(mode=q.MODE_SCALAR, table=torch.tensor([0.005], device=device))
    count = torch.tensor([rows - 1], dtype=torch.int32, device=device)  # the last row left
    base = quantize_rows(x, rows, count=count, **kw)
    dec = torch.full((rows, c), float("nan"), dtype=decoded_rows_dtype(), device=device)
    got = quantize_rows(x, rows, count=count, decoded=dec, **kw)
    for a, b in zip(base, got):  # codes, scales, globals unchanged
        assert torch.equal(a[: rows - 1].view(torch.uint8), b[: rows - 1].view(torch.uint8))
    want = dense_rows(got[0][: rows - 1], got[1][: rows - 1], order=64)
    assert want.dtype == dec.dtype
    bits = torch.int32 if dec.dtype == torch.float32 else torch.int16
    assert torch.equal(dec[: rows - 1].view(bits), want.view(bits))  # -0 kept
    assert torch.isnan(dec[rows - 1]).all()  # past the count: not written


def test_quantize_decoded_bad_argument():
    """A decoded buffer of the wrong shape or dtype, or a row width that is no multiple of
    64, is refused before anything is launched, the buffer untouched."""
    from fp4moe.kernels import quantize as q
    from fp4moe.kernels.launch import decoded_rows_dtype, quantize_rows

    x = torch.zeros(4, 128, dtype=torch.bfloat16)
    dt = decoded_rows_dtype()
    x96 = torch.zeros(4, 96, dtype=torch.bfloat16)
    for bad, src in ((torch.full((4, 64), 7.0, dtype=dt), x),
                     (torch.full((4, 128), 7.0, dtype=torch.float16), x),
                     (torch.full((4, 96), 7.0, dtype=dt), x96)):  # fmt: skip
        with pytest.raises(ValueError, match="decoded"):
            quantize_rows(src, 4, mode=q.MODE_PER_ROW, decoded=bad)
        assert (bad == 7.0).all()


@pytest.mark.kernel
@pytest.mark.parametrize("mode", MODES[1:], ids=_mode_id)
def test_quantize_decoded_plumbing(interpret, device, monkeypatch, mode):
    """``quantize_decoded`` where the Gluon kernels would run (forced here: the interpreter
    runs loop 3, which ignores the decoded rows): the quantize kernels of FC1's input and,
    unless static W4A4's FC1 writes NVFP4 itself, of FC2's input get decoded buffers of
    the right shape, and the call's bits do not change."""
    from fp4moe.kernels import launch

    m, sc = mode
    experts, x, ids, w = _small_case(device, seed=3)
    base = moe_triton(x, ids, w, experts, mode=m, act_scale=sc)
    seen = []
    real = launch.quantize_rows

    def spy(src, rows, **kw):
        if kw.get("decoded") is not None:
            seen.append(tuple(kw["decoded"].shape))
        return real(src, rows, **kw)

    monkeypatch.setattr(launch, "quantize_rows", spy)
    monkeypatch.setattr(TritonOptions, "gluon_runs", lambda self, *a: True)
    out = moe_triton(x, ids, w, experts, mode=m, act_scale=sc,
                     options=TritonOptions(quantize_decoded=True))  # fmt: skip
    assert torch.equal(out, base)
    rows1 = 10 if sc == "static" else 5  # static: each sorted route's row
    assert seen == ([(rows1, 128)] if sc == "static" else [(rows1, 128), (10, 64)])
    seen.clear()
    moe_triton(x, ids, w, experts, mode=m, act_scale=sc)  # on by default
    assert seen == ([(rows1, 128)] if sc == "static" else [(rows1, 128), (10, 64)])
    seen.clear()
    moe_triton(x, ids, w, experts, mode=m, act_scale=sc,
               options=TritonOptions(quantize_decoded=False))  # fmt: skip
    assert seen == []


@pytest.mark.kernel
@pytest.mark.parametrize("mode", MODES, ids=_mode_id)
def test_fc1_early_plumbing(interpret, device, monkeypatch, mode):
    """``TritonOptions.fc1_early``: ``moe_triton`` lets FC1 issue its weight copies before
    its grid wait only for W4A4 (a quantize kernel runs between the sort and FC1) and only
    with the option (on by default); FC2 always may (the sort is two kernels back). The
    call's bits do not change (in the interpreter loop 3 runs and ignores the flag)."""
    m, sc = mode
    experts, x, ids, w = _small_case(device, seed=5)
    seen = _spy_gemm(monkeypatch, lambda kw: (kw["gated"], kw.get("early_weights", False)))
    base = moe_triton(x, ids, w, experts, mode=m, act_scale=sc,
                      options=TritonOptions(fc1_early=False))  # fmt: skip
    assert seen == [(True, False), (False, True)]
    seen.clear()
    out = moe_triton(x, ids, w, experts, mode=m, act_scale=sc)
    assert seen == [(True, m == "w4a4"), (False, True)]
    assert torch.equal(out, base)


@pytest.mark.gpu
@pytest.mark.parametrize("t", [1, 16])
@pytest.mark.parametrize("mode", MODES[1:], ids=_mode_id)
def test_fc1_early_gpu(t, mode):
    """``fc1_early`` on the GPU: W4A4's FC1 on the Gluon kernel issuing its first weight
    copies before its grid wait gives loop 3's bits, deterministic finalize, every W4A4
    scale mode."""
    m, sc = mode
    experts, x, ids, w = _deepseek_case(t, seed=19, expert=0)
    a = moe_triton(x, ids, w, experts, mode=m, act_scale=sc,
                   options=TritonOptions(poison=True, gluon_decode=False))  # fmt: skip
    b = moe_triton(x, ids, w, experts, mode=m, act_scale=sc,
                   options=TritonOptions(poison=True, fc1_early=True))  # fmt: skip
    assert torch.equal(a, b)


@pytest.mark.kernel
@pytest.mark.parametrize("mode", MODES, ids=_mode_id)
def test_gluon_a_tma_plumbing(interpret, device, monkeypatch, mode):
    """``TritonOptions.gluon_a_tma`` where the Gluon kernels would run (forced here; the
    interpreter runs loop 3): W4A16's FC1 writes unit-order rows that FC2 reads as such,
    both GEMMs take ``a_tma``; W4A4's FC2 takes it, its FC1 only for static scales (the
    decoded rows in sorted order; the others are staged in the kernel, which decides that
    itself). Off by default. Loop 3 reads and writes the unit order too
    (``ordered_x``), so the call's bits do not change."""
    m, sc = mode
    experts, x, ids, w = _small_case(device, seed=9)
    base = moe_triton(x, ids, w, experts, mode=m, act_scale=sc)
    fields = ("a_tma", "out_ordered", "a_ordered")
    seen = _spy_gemm(monkeypatch, lambda kw: tuple(kw.get(f, False) for f in fields))
    monkeypatch.setattr(TritonOptions, "gluon_runs", lambda self, *a: True)
    moe_triton(x, ids, w, experts, mode=m, act_scale=sc)
    assert seen == [(False, False, False)] * 2  # off by default
    seen.clear()
    out = moe_triton(x, ids, w, experts, mode=m, act_scale=sc,
                     options=TritonOptions(gluon_a_tma=True))  # fmt: skip
    if m == "w4a16":
        assert seen == [(True, True, False), (True, False, True)]
    else:  # FC1's own decision comes in _gemm (token-order rows: staged)
        assert seen == [(True, False, False), (True, False, False)]
    assert torch.equal(out, base)


@pytest.mark.gpu
@pytest.mark.parametrize("t", [1, 16, 64, "one-expert"])
@pytest.mark.parametrize("mode", MODES, ids=_mode_id)
def test_gluon_a_tma_gpu(t, mode):
    """``gluon_a_tma`` on the GPU: loop 3's bits for whole calls (deterministic finalize),
    the fused finalize within the tolerance, every mode; W4A16's FC1 input gathered into
    sorted unit order and FC1's rows written so for FC2."""
    m, sc = mode
    experts, x, ids, w = _deepseek_case(t, seed=23, expert=1)
    _same_as_loop3(x, ids, w, experts, m, sc, gluon_a_tma=True)


def test_tma_grid_blocks_compiles_for_sm90():
    """``LOOP`` (``grid_blocks``): each program loops over its row blocks; the body is
    compiled once (the same TMA copies as without the loop), its registers capped by
    ``LOOP_MAXNREG`` (the loop let them grow past 160) with no spill and the same shared
    memory, and under PDL with early weights one grid wait (the first block's)."""
    pytest.importorskip("triton")
    code = (
        "from fp4moe.kernels.gluon_ws import compile_sm90, LOOP_MAXNREG\n"
        "for n, k, g in ((2048, 7168, True), (7168, 2048, False)):\n"
        "    for bm in (8, 16):\n"
        "        kw = dict(n=n, k=k, gated=g, block_m=bm, asynchronous=True, buffers=1,\n"
        "                  epilogue=True, box3=2, pdl=True, early_weights=not g)\n"
        "        base = compile_sm90(**kw)\n"
        "        c = compile_sm90(**kw, loop_blocks=1, maxnreg=LOOP_MAXNREG[g, bm])\n"
        "        ptx = c.asm['ptx']\n"
        "        assert '.local' not in ptx and 'wgmma.mma_async' in ptx, (n, bm)\n"
        "        assert f'.maxnreg {LOOP_MAXNREG[g, bm]}' in ptx, (n, bm)\n"
        "        assert ptx.count('cp.async.bulk.tensor') == \\\n"
        "            base.asm['ptx'].count('cp.async.bulk.tensor'), (n, bm)\n"
        "        assert ptx.count('griddepcontrol.wait') == 1, (n, bm)\n"
        "        assert c.metadata.shared <= base.metadata.shared + 256, (n, bm)\n"
        "        assert 'ld.global.cg' in ptx\n"
        "# uncapped, the loop's registers stay near the kernel's without it (66 / 51): the\n"
        "# rows' wgmma descriptors are not hoisted out of the loop (211 / 168 when they were)\n"
        "from fp4moe.kernels.common import resource_usage\n"
        "for n, k, g, most in ((2048, 7168, True, 88), (7168, 2048, False, 64)):\n"
        "    c = compile_sm90(n=n, k=k, gated=g, block_m=8, asynchronous=True, buffers=1,\n"
        "                     epilogue=True, box3=2, loop_blocks=1)\n"
        "    regs = resource_usage(c)['REG']\n"
        "    assert regs <= most, (n, regs)\n"
        "c = compile_sm90(n=2048, k=7168, gated=True, block_m=8, asynchronous=True, buffers=1,\n"
        "                 epilogue=True, box3=2, a_fp4=True, loop_blocks=1, maxnreg=80)\n"
        "assert '.local' not in c.asm['ptx']\n"
        "print('ok')\n"
    )
    _compile_check(code)


def test_tma_persist_compiles_for_sm90():
    """``PERSIST`` (``gluon_persist``): one loop over a program's units, compiled once: the
    body's TMA copies plus one stage's (the next unit's first, 2 code and 2 scale boxes
    for FC1, 1 and 1 for FC2), one grid wait under PDL with early weights, no local
    memory, and registers within ``PERSIST_PER_SM``'s count (uncapped: FC1 / FC2 72 / 56
    at 8 rows against 66 / 51 without the loop); the slots it assumes fit the shared
    memory."""
    pytest.importorskip("triton")
    code = (
        "from fp4moe.kernels.common import resource_usage\n"
        "from fp4moe.kernels.gluon_ws import compile_sm90, PERSIST_PER_SM\n"
        "for n, k, g, extra in ((2048, 7168, True, 4), (7168, 2048, False, 2)):\n"
        "    for bm in (8, 16):\n"
        "        kw = dict(n=n, k=k, gated=g, block_m=bm, asynchronous=True, buffers=1,\n"
        "                  epilogue=True, box3=2, pdl=True, early_weights=True)\n"
        "        base = compile_sm90(**kw)\n"
        "        c = compile_sm90(**kw, persist=True)\n"
        "        ptx = c.asm['ptx']\n"
        "        assert '.local' not in ptx and 'wgmma.mma_async' in ptx, (n, bm)\n"
        "        assert ptx.count('cp.async.bulk.tensor') == \\\n"
        "            base.asm['ptx'].count('cp.async.bulk.tensor') + extra, (n, bm)\n"
        "        assert ptx.count('griddepcontrol.wait') == 1, (n, bm)\n"
        "        res = resource_usage(c)\n"
        "        regs = res['REG']\n"
        "        assert res['STACK'] == 0, (n, bm)\n"
        "        slots = PERSIST_PER_SM[g, bm]\n"
        "        assert regs * 128 * slots <= 65536, (n, bm, regs)\n"
        "        assert (c.metadata.shared + 1024) * slots <= 228 * 1024, (n, bm)\n"
        "c = compile_sm90(n=2048, k=7168, gated=True, block_m=8, asynchronous=True, buffers=1,\n"
        "                 epilogue=True, box3=2, a_fp4=True, persist=True)\n"
        "assert '.local' not in c.asm['ptx']\n"
        "print('ok')\n"
    )
    _compile_check(code)


def test_tma_x_ring_compiles_for_sm90():
    """``XRING`` (``gluon_ws.X_RING``): the rows a ring stage at a time in two buffers of
    SK / 64 * BM rows instead of the segment's 16 units: the same TMA copies, wgmma, no
    local memory, shared memory smaller by (SEG - 2 SK) * BM * 2 bytes; the 8-row tiles
    under ``X_RING_MAXNREG`` without a stack, so two weight buffers fit 5 FC1 and 8 FC2
    programs an SM (registers and shared memory). Not with A_TMA, LOOP or PERSIST (a
    compile-time assertion)."""
    pytest.importorskip("triton")
    code = (
        "from fp4moe.kernels.common import resource_usage\n"
        "from fp4moe.kernels.gluon_ws import compile_sm90, X_RING_MAXNREG\n"
        "for n, k, g in ((2048, 7168, True), (7168, 2048, False)):\n"
        "    for bm in (8, 16):\n"
        "        for nb in (1, 2):\n"
        "            kw = dict(n=n, k=k, gated=g, block_m=bm, asynchronous=True, buffers=nb,\n"
        "                      epilogue=True, box3=2, pdl=True, early_weights=True)\n"
        "            base = compile_sm90(**kw)\n"
        "            c = compile_sm90(**kw, x_ring=True, maxnreg=X_RING_MAXNREG.get((g, bm)))\n"
        "            ptx = c.asm['ptx']\n"
        "            assert '.local' not in ptx and 'wgmma.mma_async' in ptx, (n, bm, nb)\n"
        "            assert ptx.count('cp.async.bulk.tensor') == \\\n"
        "                base.asm['ptx'].count('cp.async.bulk.tensor'), (n, bm, nb)\n"
        "            saved = (1024 - 2 * 256) * bm * 2\n"
        "            assert c.metadata.shared == base.metadata.shared - saved, (n, bm, nb)\n"
        "            if (g, bm) in X_RING_MAXNREG:\n"
        "                res = resource_usage(c)\n"
        "                assert res['STACK'] == 0 and res['REG'] <= X_RING_MAXNREG[g, bm]\n"
        "                if nb == 2:\n"
        "                    slots = 5 if g else 8\n"
        "                    assert slots * (c.metadata.shared + 1024) <= 228 * 1024\n"
        "                    assert slots * 128 * res['REG'] <= 65536, (n, res)\n"
        "try:\n"
        "    compile_sm90(n=2048, k=7168, gated=True, block_m=8, buffers=1, box3=2,\n"
        "                 x_ring=True, persist=True)\n"
        "    raise SystemExit('XRING with PERSIST compiled')\n"
        "except Exception as exc:\n"
        "    assert 'XRING' in str(exc) or 'XRING' in repr(exc.__cause__), exc\n"
        "print('ok')\n"
    )
    _compile_check(code)


@pytest.mark.gpu
@pytest.mark.parametrize("t", [0, 1, 16, 64, "one-expert", "all-masked"])
@pytest.mark.parametrize("buffers", [1, 2])
@pytest.mark.parametrize("mode", MODES[:3], ids=_mode_id)
def test_gluon_x_ring_gpu(monkeypatch, t, buffers, mode):
    """``gluon_ws.X_RING`` on the GPU (8-row tiles), with one and two weight
    buffers: loop 3's bits for whole calls (deterministic finalize), the fused finalize
    within the tolerance, every mode; no token, and every route masked gives zeros."""
    _flags_same_as_loop3(monkeypatch, dict(X_RING=True, BUFFERS=buffers), t, mode, seed=37,
                         expert=6)  # fmt: skip


def _flags_same_as_loop3(monkeypatch, flags, t, mode, *, seed, expert):
    """With the ``gluon_ws`` module ``flags`` set: whole calls of ``_deepseek_case(t)``
    give loop 3's bits (``_same_as_loop3``), and every route masked gives zeros."""
    from fp4moe.kernels import gluon_ws

    for name, value in flags.items():
        monkeypatch.setattr(gluon_ws, name, value)
    m, sc = mode
    experts, x, ids, w = _deepseek_case(t, seed=seed, expert=expert)
    _same_as_loop3(x, ids, w, experts, m, sc)
    if t == "all-masked":
        out = moe_triton(x, ids, w, experts, mode=m, act_scale=sc,
                         options=TritonOptions(poison=True))  # fmt: skip
        assert not out.float().abs().any()


def test_tma_l2_prefetch_compiles_for_sm90():
    """``L2`` (``gluon_ws.L2_AHEAD``): the ring's first copies, then the stages beyond it
    prefetched into L2 with ``cp.async.bulk.prefetch.L2`` (one instruction a thread for
    the first L2 stages of codes and one of scales, then one pair after each of the next
    stages lands), with the same TMA copies and wgmma, the same shared memory, no local
    memory, and registers within the 6 (FC1) / 8 (FC2) programs an SM that its shared
    memory allows; ``_l2_ahead`` caps it at the stages beyond the ring and keeps it off
    the loop, the persistent grid and the tiled copy."""
    pytest.importorskip("triton")
    code = (
        "from fp4moe.kernels import gluon_ws\n"
        "from fp4moe.kernels.common import resource_usage\n"
        "from fp4moe.kernels.gluon_ws import compile_sm90\n"
        "for n, k, g in ((2048, 7168, True), (7168, 2048, False)):\n"
        "    kw = dict(n=n, k=k, gated=g, block_m=8, asynchronous=True, buffers=1,\n"
        "              epilogue=True, box3=2, pdl=True, early_weights=not g)\n"
        "    base = compile_sm90(**kw)\n"
        "    bptx = base.asm['ptx']\n"
        "    assert 'cp.async.bulk.prefetch.L2' not in bptx\n"
        "    for l2, issued in ((1, 6), (2, 4), (3, 2)):\n"
        "        c = compile_sm90(**kw, l2=l2)\n"
        "        ptx = c.asm['ptx']\n"
        "        assert ptx.count('cp.async.bulk.prefetch.L2.global') == issued, (g, l2)\n"
        "        assert ptx.count('cp.async.bulk.tensor') == bptx.count('cp.async.bulk.tensor')\n"
        "        assert ptx.count('wgmma.mma_async') == bptx.count('wgmma.mma_async')\n"
        "        assert c.metadata.shared == base.metadata.shared and '.local' not in ptx\n"
        "        res = resource_usage(c)\n"
        "        slots = 6 if g else 8\n"
        "        assert res['STACK'] == 0 and slots * 128 * res['REG'] <= 65536, (g, l2, res)\n"
        "gluon_ws.L2_AHEAD = 3\n"
        "assert gluon_ws._l2_ahead(2, 0, 0, 256, 1024, 1) == 3\n"
        "assert gluon_ws._l2_ahead(2, 0, 0, 256, 1024, 2) == 2\n"
        "assert gluon_ws._l2_ahead(2, 0, 0, 256, 1024, 4) == 0\n"
        "assert gluon_ws._l2_ahead(3, 0, 0, 256, 1024, 1) == 0\n"
        "assert gluon_ws._l2_ahead(2, 4, 0, 256, 1024, 1) == 0\n"
        "assert gluon_ws._l2_ahead(2, 0, 6, 256, 1024, 1) == 0\n"
        "gluon_ws.L2_AHEAD = 0\n"
        "assert gluon_ws._l2_ahead(2, 0, 0, 256, 1024, 1) == 0\n"
        "print('ok')\n"
    )
    _compile_check(code)


@pytest.mark.gpu
@pytest.mark.parametrize("t", [0, 1, 16, 64, "one-expert", "all-masked"])
@pytest.mark.parametrize("ahead", [1, 3])
@pytest.mark.parametrize("mode", MODES[:3], ids=_mode_id)
def test_gluon_l2_prefetch_gpu(monkeypatch, t, ahead, mode):
    """``gluon_ws.L2_AHEAD`` on the GPU: the prefetch is a hint, so loop 3's bits for
    whole calls (deterministic finalize), the fused finalize within the tolerance, every
    mode; no token, every route on one expert, every route masked (zeros)."""
    _flags_same_as_loop3(monkeypatch, dict(L2_AHEAD=ahead), t, mode, seed=41, expert=5)


def test_rot_asm_gives_the_same_registers():
    """``gemm._CHUNK_DECODE_ROT_ASM`` (``gluon_ws.ROT_LAYOUT``) builds from the rotated
    code words (``cuda_decode.rotated_codes``) exactly the eight registers that
    ``_CHUNK_DECODE_ASM`` builds from today's (its integer part, before the scale's fma,
    run by ``test_cuda_decode._run_ptx``): for every one-bit word in either register and
    2000 random word pairs; so the same wgmma operands, the same bits."""
    from fp4moe.kernels import cuda_decode, gemm
    from test_cuda_decode import _run_ptx

    def lines(asm: str) -> list[str]:
        return [ln.strip().rstrip(";") for ln in asm.split("\n") if ln.strip()]

    base, rot = lines(gemm._CHUNK_DECODE_ASM.value), lines(gemm._CHUNK_DECODE_ROT_ASM.value)
    g = torch.Generator().manual_seed(5)
    pairs = [(1 << b, 0) for b in range(32)] + [(0, 1 << b) for b in range(32)]
    pairs += torch.randint(0, 1 << 32, (2000, 2), generator=g, dtype=torch.int64).tolist()
    words = torch.tensor([[w >> (8 * i) & 0xFF for w in p for i in range(4)] for p in pairs],
                         dtype=torch.uint8)  # fmt: skip
    rotated = cuda_decode.rotated_codes(words).to(torch.int64)
    rw = rotated[:, 0::4] | rotated[:, 1::4] << 8 | rotated[:, 2::4] << 16 | rotated[:, 3::4] << 24
    scales = {f"${10 + j}": 0 for j in range(4)}
    for (w0, w1), (v0, v1) in zip(pairs, rw.tolist()):
        a = _run_ptx(base, {"$8": w0, "$9": w1, **scales})
        b = _run_ptx(rot, {"$8": v0, "$9": v1, **scales})
        assert [b[f"${j}"] for j in range(8)] == [a[f"${j}"] for j in range(8)], (w0, w1)


def test_rot_layout_compiles_for_sm90():
    """``ROT`` (``gluon_ws.ROT_LAYOUT``): the split kernels with the rotated layout's
    decode (no PRMT/IMAD decode, its rotations instead), the same wgmma, no local memory,
    registers within the 6 (FC1) / 8 (FC2) programs an SM, and 20 to 28 fewer SASS
    instructions a unit of 8 code words (FC1: 16 such units a program, FC2 8); the
    prefill kernels too (their main loop's 8 units), with no more registers."""
    pytest.importorskip("triton")
    code = (
        "import re, subprocess, tempfile\n"
        "from pathlib import Path\n"
        "import triton\n"
        "from fp4moe.kernels import gluon_prefill\n"
        "from fp4moe.kernels.common import resource_usage\n"
        "from fp4moe.kernels.gluon_ws import compile_sm90\n"
        "dump = Path(triton.__file__).parent / 'backends' / 'nvidia' / 'bin' / 'cuobjdump'\n"
        "def sass_count(c):\n"
        "    with tempfile.NamedTemporaryFile(suffix='.cubin') as f:\n"
        "        f.write(c.asm['cubin']); f.flush()\n"
        "        out = subprocess.run([str(dump), '-sass', f.name], capture_output=True,\n"
        "                             text=True).stdout\n"
        "    return len(re.findall(r'/\\*[0-9a-f]{4,}\\*/\\s+[^;]*;', out))\n"
        "for n, k, g, units, regs in ((2048, 7168, True, 16, 80), (7168, 2048, False, 8, 64)):\n"
        "    kw = dict(n=n, k=k, gated=g, block_m=8, asynchronous=True, buffers=1,\n"
        "              epilogue=True, box3=2, pdl=True)\n"
        "    base, rot = compile_sm90(**kw), compile_sm90(**kw, rot=True)\n"
        "    p0, p1 = base.asm['ptx'], rot.asm['ptx']\n"
        "    assert 'mul.lo.u32 u, u, 0x1040' in p0 and 'mul.lo.u32 u, u, 0x1040' not in p1\n"
        "    assert 'shf.l.wrap.b32 r12' in p1 and 'shf.l.wrap.b32 r12' not in p0\n"
        "    assert p0.count('wgmma.mma_async') == p1.count('wgmma.mma_async') > 0\n"
        "    assert '.local' not in p1\n"
        "    assert resource_usage(rot)['REG'] <= regs, resource_usage(rot)\n"
        "    if dump.is_file():\n"
        "        d = sass_count(base) - sass_count(rot)\n"
        "        assert 20 * units <= d <= 28 * units, (n, d)\n"
        "    base = gluon_prefill.compile_sm90(n=n, k=k, gated=g)\n"
        "    rot = gluon_prefill.compile_sm90(n=n, k=k, gated=g, rot=True)\n"
        "    assert 'shf.l.wrap.b32 r12' in rot.asm['ptx'] and '.local' not in rot.asm['ptx']\n"
        "    assert resource_usage(rot)['REG'] <= resource_usage(base)['REG']\n"
        "    if dump.is_file():\n"
        "        assert 20 * 8 <= sass_count(base) - sass_count(rot) <= 28 * 8\n"
        "print('ok')\n"
    )
    _compile_check(code)


@pytest.mark.gpu
@pytest.mark.parametrize("t", [0, 1, 16, 64, 4096, "one-expert", "all-masked"])
@pytest.mark.parametrize("mode", MODES[:3], ids=_mode_id)
def test_gluon_rot_layout_gpu(monkeypatch, t, mode):
    """``gluon_ws.ROT_LAYOUT`` on the GPU: the codes' rotated copy decoded into the same
    registers, so whole calls (deterministic finalize) give the bits they give without it,
    no token included, on the split, whole-K and (4096 tokens) prefill kernels; the fused
    finalize within the reference's tolerance; every route on one expert; every route
    masked (zeros)."""
    from fp4moe.kernels import gluon_ws

    m, sc = mode
    experts, x, ids, w = _deepseek_case(t, seed=43, expert=3)
    outs = []
    for rot in (False, True):
        monkeypatch.setattr(gluon_ws, "ROT_LAYOUT", rot)
        outs.append(moe_triton(x, ids, w, experts, mode=m, act_scale=sc,
                               options=TritonOptions(poison=True)))  # fmt: skip
    assert torch.equal(outs[0], outs[1]), (t, m, sc)
    fused = moe_triton(x, ids, w, experts, mode=m, act_scale=sc, fused_finalize=True,
                       options=TritonOptions(poison=True))  # fmt: skip
    assert rel_err(fused, moe_reference(x, ids, w, experts, mode=m, act_scale=sc)) <= TOL[m]
    if t == "all-masked":
        assert not outs[1].float().abs().any()


def test_tiled_weights_layout():
    """``gluon_ws.tiled_weights`` (the TILED experiment): the box the kernel reads for the
    64-row tile of ``row`` and 256-K stage ``st``, rows (row // 64 * K/256 + st) * 64 ..
    + 63 of the tiled copy, holds exactly those rows' 128 code bytes and 16 scale bytes of
    that stage; the copy is made once a tensor."""
    pytest.importorskip("triton.experimental.gluon")
    from fp4moe.kernels import gluon_ws

    g = torch.Generator().manual_seed(3)
    e, r, k = 2, 192, 1024
    codes = torch.randint(0, 256, (e, r, k // 2), generator=g, dtype=torch.uint8)
    scales = torch.randint(0, 127, (e, r, k // 16), generator=g, dtype=torch.uint8)
    scales = scales.view(torch.float8_e4m3fn)
    c, s = gluon_ws.tiled_weights(codes, scales)
    ks = k // 256
    cf, sf = codes.reshape(-1, k // 2), scales.view(torch.uint8).reshape(-1, k // 16)
    for row in range(0, e * r, 64):
        for st in range(ks):
            at = (row // 64 * ks + st) * 64
            assert torch.equal(c[at : at + 64], cf[row : row + 64, st * 128 : st * 128 + 128])
            assert torch.equal(s[at : at + 64], sf[row : row + 64, st * 16 : st * 16 + 16])
    again = gluon_ws.tiled_weights(codes, scales)
    assert again[0] is c and again[1] is s
    gluon_ws.TILED_CACHE.clear()


def test_persist_rule(monkeypatch):
    """``TritonOptions.persist_programs``: off by default, on the CPU and with
    ``gluon_grid_blocks``; "auto" the SMs times ``PERSIST_PER_SM``, an int that many an
    SM; bad values are refused by name."""
    from fp4moe.kernels.gluon_ws import PERSIST_PER_SM

    class Props:
        multi_processor_count = 132

    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda d: Props())
    cuda = torch.device("cuda")
    assert TritonOptions().persist_programs(True, 8, cuda) == 0
    auto = TritonOptions(gluon_persist="auto")
    for (g, bm), n in PERSIST_PER_SM.items():
        assert auto.persist_programs(g, bm, cuda) == 132 * n
    assert auto.persist_programs(True, 8, torch.device("cpu")) == 0
    assert TritonOptions(gluon_persist=3).persist_programs(False, 16, cuda) == 396
    both = TritonOptions(gluon_persist="auto", gluon_grid_blocks=4)
    assert both.persist_programs(True, 8, cuda) == 0
    for bad in (0, -1, True, 1.5, "all"):
        with pytest.raises(ValueError, match="gluon_persist"):
            TritonOptions(gluon_persist=bad)


def test_grid_blocks_rule():
    """``TritonOptions.grid_blocks``: None the worst case (0), an int capped by the
    schedule's blocks, "auto" the expected valid blocks (touched experts + valid routes / 8,
    plus 2) of evenly spread routes; bad values are refused by name."""
    from fp4moe.kernels.sort import max_blocks

    opt = TritonOptions(valid_fraction=1 / 8)
    assert opt.grid_blocks(128, 32, 8, max_blocks(128, 32, 8)) == 0  # the default
    fixed = TritonOptions(gluon_grid_blocks=5)
    assert fixed.grid_blocks(128, 32, 8, 48) == 5
    assert fixed.grid_blocks(8, 32, 8, 3) == 3
    auto = TritonOptions(valid_fraction=1 / 8, gluon_grid_blocks="auto")
    # DeepSeek-V3 EP8: 1, 16 and 128 tokens (8 routes each, an eighth of them local)
    assert [auto.grid_blocks(8 * t, 32, 8, max_blocks(8 * t, 32, 8)) for t in (1, 16, 128)] == [
        4, 17, 50,
    ]  # fmt: skip
    assert auto.grid_blocks(0, 32, 8, 0) == 0  # no routes: no loop
    # Mixtral (every route local, 8 experts): capped by the worst case
    full = TritonOptions(valid_fraction=1.0, gluon_grid_blocks="auto")
    assert full.grid_blocks(2, 8, 8, max_blocks(2, 8, 8)) == max_blocks(2, 8, 8)
    for bad in (0, -2, True, 2.5, "all"):
        with pytest.raises(ValueError, match="gluon_grid_blocks"):
            TritonOptions(gluon_grid_blocks=bad)


@pytest.mark.kernel
@pytest.mark.parametrize("mode", MODES[:2], ids=_mode_id)
def test_grid_blocks_plumbing(interpret, device, monkeypatch, mode):
    """``gluon_grid_blocks`` reaches both GEMMs as ``grid_blocks`` (0 by default), and
    the call's bits do not change (the interpreter runs loop 3, which has no such grid)."""
    m, sc = mode
    experts, x, ids, w = _small_case(device, seed=3)
    base = moe_triton(x, ids, w, experts, mode=m, act_scale=sc)
    seen = _spy_gemm(monkeypatch, lambda kw: kw.get("grid_blocks", 0))
    moe_triton(x, ids, w, experts, mode=m, act_scale=sc)
    assert seen == [0, 0]
    seen.clear()
    out = moe_triton(x, ids, w, experts, mode=m, act_scale=sc,
                     options=TritonOptions(gluon_grid_blocks=2))  # fmt: skip
    assert seen == [2, 2]
    assert torch.equal(out, base)


@pytest.mark.gpu
@pytest.mark.parametrize("t", [0, 1, 16, 64, "one-expert", "all-masked"])
@pytest.mark.parametrize(
    "opt",
    [("gluon_grid_blocks", 1), ("gluon_grid_blocks", 3), ("gluon_grid_blocks", "auto"),
     ("gluon_persist", 1), ("gluon_persist", "auto")],
    ids=["grid_blocks-1", "grid_blocks-3", "grid_blocks-auto", "persist-1", "persist-auto"],
)  # fmt: skip
@pytest.mark.parametrize("mode", MODES[:3], ids=_mode_id)
def test_gluon_loop_gpu(t, opt, mode):
    """The Gluon kernels' loops on the GPU, ``gluon_grid_blocks`` (1 and 3 row blocks make
    every program loop over several valid blocks: 16 tokens on one expert 2 blocks, 64
    tokens about 27; "auto" leaves a few empty programs) and ``gluon_persist`` (one
    program an SM, 132, takes several units: 16 tokens about 7, 64 about 40, with the next
    unit's copies issued in the last; "auto" fills the SMs): loop 3's bits for whole calls
    (deterministic finalize), the fused finalize within the tolerance; no token (an empty
    grid), and every route masked gives zeros."""
    m, sc = mode
    experts, x, ids, w = _deepseek_case(t, seed=29, expert=4)
    _same_as_loop3(x, ids, w, experts, m, sc, **dict([opt]))
    if t == "all-masked":
        out = moe_triton(x, ids, w, experts, mode=m, act_scale=sc,
                         options=TritonOptions(poison=True, **dict([opt])))  # fmt: skip
        assert not out.float().abs().any()


@pytest.mark.gpu
@pytest.mark.parametrize(
    "opt",
    [{"gluon_grid_blocks": 2}, {"gluon_grid_blocks": "auto"}, {"gluon_persist": "auto"}],
    ids=["grid_blocks-2", "grid_blocks-auto", "persist-auto"],
)
def test_gluon_loop_graph_replay_gpu(opt):
    """A CUDA graph captured with ``gluon_grid_blocks`` or ``gluon_persist`` replays other
    routes, with more valid row blocks (units) than the grid has programs as well as
    fewer, with loop 3's bits: the loops' counts are read on the device at each replay."""
    import fp4moe
    from test_kernels import _experts

    e, h, i, k, e_total = GPU_SHAPES["deepseek-v3-ep8"]
    experts = _experts(e, h, i, seed=0, device="cuda")
    runner = fp4moe.MoERunner(experts, max_tokens=64, top_k=k, mode="w4a16",
                              options=TritonOptions(**opt))  # fmt: skip
    for t in (1, 16, 64):
        runner(_x(t, h, seed=1, device="cuda"), *_gpu_routes(t, k, e, e_total, seed=1))
    for t, seed in ((16, 2), (16, 3), (1, 4), (64, 5), (16, 6)):
        x = _x(t, h, seed=seed, device="cuda")
        ids, w = _gpu_routes(t, k, e, e_total, seed=seed)
        if seed == 6:  # every route on experts 0 .. 3: 4 x 4 row blocks of 8
            ids = (torch.arange(t * k, device="cuda").reshape(t, k) % 4).to(torch.int32)
        want = moe_triton(x, ids, w, experts, mode="w4a16",
                          options=TritonOptions(gluon_decode=False))  # fmt: skip
        assert torch.equal(runner(x, ids, w), want), (t, seed)


def test_quantize_amax_self_compiles_for_sm90():
    """``quantize_rows_kernel`` in ``MODE_AMAX_SELF`` (the row loop over a count) compiles
    for sm_90 in both grids, with the count given and from a pointer, and with
    ``ROW_FIRST`` (``launch.QUANTIZE_ROW_FIRST``), with no local memory; its ``n_rows`` is
    not specialized, since a count of 1 (a constant) broke Triton 3.6's coalesce pass
    there."""
    pytest.importorskip("triton")
    code = (
        "import triton.language as tl\n"
        "from fp4moe.kernels.common import compile_sm90\n"
        "from fp4moe.kernels.quantize import MODE_AMAX_SELF, quantize_rows_kernel as k\n"
        "assert k.do_not_specialize == ['n_rows']\n"
        "ptrs = {'src_ptr': '*bf16', 'src_index_ptr': '*i32', 'n_rows_ptr': '*i32',\n"
        "        'codes_ptr': '*u8', 'scales_ptr': '*fp8e4nv', 'global_out_ptr': '*fp32',\n"
        "        'table_ptr': '*fp32', 'row_expert_ptr': '*i32'}\n"
        "for split, cfp, first in ((False, False, False), (False, True, False),\n"
        "                          (True, False, False), (True, True, False),\n"
        "                          (False, True, True), (True, True, True)):\n"
        "    const = dict(C=7168, MODE=MODE_AMAX_SELF, GATHER=False, DIV=1,\n"
        "                 COUNT_FROM_PTR=cfp, BLOCK_C=512, USE_PDL=True, INTERPRET=False,\n"
        "                 AMAX_C=1024, SPLIT_C=split, dec_ptr=None, DEC=False,\n"
        "                 DEC_DTYPE=tl.bfloat16, ROW_FIRST=first)\n"
        "    c = compile_sm90(k, ptrs, const, ints=('n_rows',), num_warps=4)\n"
        "    assert '.local' not in c.asm['ptx']\n"
        "print('ok')\n"
    )
    _compile_check(code)


def test_tile_rows_128_compiles_for_sm90():
    """``gluon_ws.TILE_ROWS`` 128: 8 warps a program (two warpgroups on one 128-row tile),
    both GEMMs and tile heights, fused or not, W4A4's rows: the same TMA copies (each box
    twice as tall) and wgmma instructions as 64-row tiles, no local memory; FC1's 8-row
    tiles fit 64 registers with no stack (4 programs of 52 KB an SM) and 16-row tiles 80;
    the kernel refuses 128 rows with the loop over blocks, PERSIST or X_RING."""
    pytest.importorskip("triton")
    code = (
        "from fp4moe.kernels import gluon_ws\n"
        "from fp4moe.kernels.common import resource_usage\n"
        "from fp4moe.kernels.gluon_ws import compile_sm90\n"
        "for n, k, g in ((2048, 7168, True), (7168, 2048, False)):\n"
        "    for bm in (8, 16):\n"
        "        for fused in ((False, True) if not g else (False,)):\n"
        "            for a4 in (False, True):\n"
        "                kw = dict(n=n, k=k, gated=g, block_m=bm, asynchronous=True,\n"
        "                          buffers=1, epilogue=True, fused=fused, a_fp4=a4, box3=2,\n"
        "                          pdl=True, early_weights=not g)\n"
        "                base = compile_sm90(**kw).asm['ptx']\n"
        "                cap = gluon_ws._maxnreg(g, bm, 0, 0, False, 128).get('maxnreg')\n"
        "                c = compile_sm90(**kw, tile_rows=128, maxnreg=cap)\n"
        "                ptx = c.asm['ptx']\n"
        "                assert '.local' not in ptx, (g, bm, fused, a4)\n"
        "                assert c.metadata.num_warps == 8 and '.reqntid 256' in ptx\n"
        "                for op in ('cp.async.bulk.tensor', 'wgmma.mma_async'):\n"
        "                    assert ptx.count(op) == base.count(op), (g, bm, op)\n"
        "                r = resource_usage(c)\n"
        "                assert r['STACK'] == 0 and r['LOCAL'] == 0, (g, bm, r)\n"
        "                if g:\n"
        "                    assert r['REG'] <= (64 if bm == 8 else 80), (bm, r)\n"
        "                if g and bm == 8:\n"
        "                    assert c.metadata.shared <= 227 * 1024 // 4, c.metadata.shared\n"
        "for bad in (dict(loop_blocks=4), dict(persist=True), dict(x_ring=True)):\n"
        "    try:\n"
        "        compile_sm90(n=2048, k=7168, gated=True, block_m=8, asynchronous=True,\n"
        "                     buffers=1, epilogue=True, box3=2, tile_rows=128, **bad)\n"
        "    except Exception as exc:\n"
        "        assert 'TR 128' in str(exc) or 'TR 128' in repr(exc.__cause__), exc\n"
        "    else:\n"
        "        raise SystemExit(f'TR 128 with {bad} compiled')\n"
        "print('ok')\n"
    )
    _compile_check(code)


def test_tile_rows_host_rule(monkeypatch):
    """``_tile_rows``: 128 only where ``TILE_ROWS`` says so and the launch is the
    one-block body with CODE_WIDE boxes of 256-K stages and N a multiple of 128; any other
    value of ``TILE_ROWS`` is refused, naming it."""
    from fp4moe.kernels import gluon_ws

    args = dict(n=2048, box=2, stage_k=256, grid_blocks=0, persist=0, a_tma=False,
                out_unit_order=False, l2=0, x_ring=False)  # fmt: skip
    assert gluon_ws._tile_rows(**args) == 64  # the default
    monkeypatch.setattr(gluon_ws, "TILE_ROWS", 128)
    assert gluon_ws._tile_rows(**args) == 128
    for change in (dict(n=2880), dict(box=1), dict(stage_k=128), dict(grid_blocks=4),
                   dict(persist=528), dict(a_tma=True), dict(out_unit_order=True),
                   dict(l2=1), dict(x_ring=True)):  # fmt: skip
        assert gluon_ws._tile_rows(**{**args, **change}) == 64, change
    monkeypatch.setattr(gluon_ws, "TILE_ROWS", 96)
    with pytest.raises(ValueError, match="TILE_ROWS"):
        gluon_ws._tile_rows(**args)


@pytest.mark.gpu
@pytest.mark.parametrize("t", [0, 1, 16, 64, "one-expert", "all-masked"])
@pytest.mark.parametrize("mode", MODES[:3], ids=_mode_id)
def test_gluon_tile_rows_gpu(monkeypatch, t, mode):
    """``gluon_ws.TILE_ROWS`` 128 on the GPU: loop 3's bits for whole calls
    (deterministic finalize), the fused finalize within the tolerance, every mode; no
    token, and every route masked gives zeros."""
    _flags_same_as_loop3(monkeypatch, dict(TILE_ROWS=128), t, mode, seed=41, expert=5)


def test_sched_ahead_compiles_for_sm90():
    """``SA`` (``gluon_ws.SCHED_AHEAD``, off: refuted in session 19): the block's expert,
    start and end are the kernel's first three ``.cg`` loads, all before its first branch
    (off: one load, the branch, then the other two), with the same copies, wgmmas,
    registers and shared memory."""
    pytest.importorskip("triton")
    code = (
        "from fp4moe.kernels.common import resource_usage\n"
        "from fp4moe.kernels.gluon_ws import compile_sm90\n"
        "def first(ptx):\n"
        "    body = [x.strip() for x in ptx.split('.entry')[1].splitlines()]\n"
        "    return [x for x in body if x.startswith('ld.global.cg') or ' bra' in x][:4]\n"
        "for n, k, g in ((2048, 7168, True), (7168, 2048, False)):\n"
        "    kw = dict(n=n, k=k, gated=g, block_m=8, asynchronous=True, buffers=1,\n"
        "              epilogue=True, box3=2)\n"
        "    base, sa = compile_sm90(**kw), compile_sm90(**kw, sched_ahead=True)\n"
        "    b, s = base.asm['ptx'], sa.asm['ptx']\n"
        "    f, g0 = first(s), first(b)\n"
        "    assert all(x.startswith('ld.') for x in f[:3]) and ' bra' in f[3], f\n"
        "    assert g0[0].startswith('ld.') and ' bra' in g0[1], g0\n"
        "    for op in ('cp.async.bulk.tensor', 'wgmma.mma_async'):\n"
        "        assert s.count(op) == b.count(op), op\n"
        "    assert sa.metadata.shared == base.metadata.shared and '.local' not in s\n"
        "    assert resource_usage(sa)['REG'] <= resource_usage(base)['REG'] + 2\n"
        "print('ok')\n"
    )
    _compile_check(code)
