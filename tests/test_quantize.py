"""The activation quantize and amax kernels (W4A4) against the reference's NVFP4
quantization, bit for bit: in the interpreter on CPU and (marked ``gpu``) on the GPU."""

from __future__ import annotations

import pytest
import torch

from fp4moe.kernels.gemm.operands import dense_rows
from fp4moe.kernels.quantize import (
    MODE_AMAX_SELF,
    MODE_FROM_AMAX,
    MODE_PER_ROW,
    MODE_SCALAR,
    MODE_STATIC,
    amax_rows,
    decoded_rows_dtype,
    encode_e2m1,
    encode_e2m1_fast,
    quantize_rows,
)
from test_kernels import _x


@pytest.mark.kernel
@pytest.mark.parametrize("split", [False, True], ids=["row", "split"])
@pytest.mark.parametrize("rows,count", [(6, None), (6, 4), (3, 0)])
def test_per_tensor_quantize_on_device_bit_identical(interpret, device, rows, count, split):
    """Per-tensor W4A4 on the device (amax_rows: atomic max, then the quantize kernel takes
    the global from it; or MODE_AMAX_SELF, the quantize kernel's programs taking the amax
    of the counted rows themselves): codes, scales and global bit-identical to
    quantize_nvfp4 on the counted rows; no rows (or all zero) gives amax 0 and global 1."""
    from fp4moe.nvfp4 import quantize_nvfp4

    # split: each row's amax in one wide load and a chunk of a row a program

    x = _x(rows, 96, seed=rows, device=device)
    x[1, 5] = -7.25
    n = rows if count is None else count
    cnt = None if count is None else torch.tensor([count], dtype=torch.int32, device=device)
    amax = amax_rows(x, rows, count=cnt)
    assert amax.item() == (x[:n].abs().amax().float().item() if n else 0.0)
    codes, scales, glob = quantize_rows(x, rows, mode=MODE_FROM_AMAX, table=amax, count=cnt,
                                        split_rows=split)  # fmt: skip
    # MODE_AMAX_SELF: every program takes the amax of the counted rows itself
    own = quantize_rows(x, rows, mode=MODE_AMAX_SELF, count=cnt, poison=True, split_rows=split)
    if n == 0:
        assert amax.item() == 0.0
        return
    q = quantize_nvfp4(x[:n])
    for c_, s_, g_ in ((codes, scales, glob), own):
        assert torch.equal(c_[:n], q.codes)
        assert torch.equal(s_[:n].view(torch.uint8), q.scales.view(torch.uint8))
        assert torch.equal(g_[:n], q.global_scale.expand(n))


def _quantize_split_cases(device, rows, c, seed):
    """(x, kwargs) cases of ``quantize_rows`` for every mode, gathered or not, with and
    without a device count; x has a zero row and saturating and tiny blocks."""
    x = _x(2 * rows + 1, c, seed=seed, device=device)
    x[min(2, rows - 1)] = 0.0
    x[0, :16] = 3.0e4
    x[0, 16:32] = 1.0e-6
    index = torch.randperm(2 * rows, generator=torch.Generator().manual_seed(seed))[:rows]
    index = index.to(torch.int32).to(device)
    table = torch.tensor([0.01, 0.02, 0.5], device=device)
    row_expert = torch.tensor([i % 3 for i in range(rows)], dtype=torch.int32, device=device)
    modes = [
        (MODE_PER_ROW, {}),
        (MODE_STATIC, dict(table=table, row_expert=row_expert)),
        (MODE_SCALAR, dict(table=table[1:2])),
        (MODE_FROM_AMAX, dict(table=torch.tensor([7.5], device=device))),
        (MODE_AMAX_SELF, {}),
    ]
    for gather in (False, True):
        for count in (None, max(rows // 2, 1)):
            cnt = None if count is None else torch.tensor([count], dtype=torch.int32,
                                                          device=device)  # fmt: skip
            for mode, extra in modes:
                kw = dict(mode=mode, count=cnt, poison=True, **extra)
                if gather:
                    kw.update(index=index, div=2)
                yield x, rows if count is None else count, kw


def _same_quantized(a, b, n):
    return all(torch.equal(p[:n].view(torch.uint8), q[:n].view(torch.uint8)) for p, q in zip(a, b))


@pytest.mark.kernel
def test_encode_e2m1_fast_same_codes(interpret, device):
    """``encode_e2m1_fast`` (the quantize kernel's encoding) gives
    ``encode_e2m1``'s code for fp32 values sampled over all bit patterns of [0, 16), every
    tie and its neighbours one ulp away, both signs, large values and infinity."""
    import triton
    import triton.language as tl

    @triton.jit
    def both(v_ptr, a_ptr, b_ptr, n, BLOCK: tl.constexpr, OLD: tl.constexpr,
             FAST: tl.constexpr):  # fmt: skip
        o = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        v = tl.load(v_ptr + o, mask=o < n, other=0.0)
        tl.store(a_ptr + o, OLD(v).to(tl.int32), mask=o < n)
        tl.store(b_ptr + o, FAST(v, v < 0.0), mask=o < n)

    top = int(torch.tensor(16.0).view(torch.int32))
    pat = torch.arange(0, top, 4099, dtype=torch.int64).to(torch.int32).view(torch.float32)
    ties = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0,
                         6.0, 0.0])  # fmt: skip
    near = torch.cat([torch.nextafter(ties, torch.tensor(-1.0)), ties,
                      torch.nextafter(ties, torch.tensor(99.0))])  # fmt: skip
    big = torch.tensor([16.0, 1e3, 1e20, 3e38, float("inf")])
    v = torch.cat([pat, near, big])
    v = torch.cat([v, -v]).to(device)
    a = torch.empty(v.numel(), dtype=torch.int32, device=device)
    b = torch.empty_like(a)
    n = v.numel()
    both[(triton.cdiv(n, 1024),)](v, a, b, n, BLOCK=1024, OLD=encode_e2m1, FAST=encode_e2m1_fast)
    assert torch.equal(a, b)


def _quantize_reference_cases(device, c):
    """(x, rows, kwargs, global) cases for ``quantize_rows`` against ``quantize_blocks``:
    random rows in every mode, and rows built so that a global of 1 (an amax of 2688) or
    2^30 puts values on every e2m1 tie, on -0, on a block of scale 0, on tiny values
    whose quotient rounds to -0 or to the smallest negative subnormal (the sign bit of
    the code then differs), and a saturating block."""
    x = _x(6, c, seed=c, device=device)
    ties = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0]
    blk = torch.tensor([6.0, -0.0] + ties + [-t for t in ties])
    t = torch.zeros(4, c)
    t[:, :16] = blk
    t[:, 16:32] = blk / 2  # scale 0.5
    t[:, 32:48] = 1e-30  # scale 0 with a global of 1
    t[:, 48:64] = torch.tensor([2688.0, -1.0] + [0.5] * 14)  # saturating at 448
    t[2:, :] *= 2.0**30
    t[2:, 64] = 6.0 * 2.0**30  # a block of scale 1 under a global of 2^30 (d = 2^30)
    t[2:, 65] = -(2.0**-120)  # quotient -2^-150: a tie, rounds to -0: code 0
    t[2:, 66] = -1.5 * 2.0**-120  # quotient -1.5 2^-150: rounds to -2^-149: code 8
    t[2:, 67] = -(2.0**-133)
    t[1:4:2, 80:96] = x[:2, 80:96].float()
    t = t.to(torch.bfloat16).to(device)
    one = torch.tensor([2688.0], device=device)
    for name, (src, kw, glob) in {
        "per_row": (x, dict(mode=MODE_PER_ROW), None),
        "from_amax": (x, dict(mode=MODE_FROM_AMAX, table=one / 7), torch.tensor(384.0) / 2688),
        "ties_g1": (t[:2], dict(mode=MODE_FROM_AMAX, table=one), torch.tensor(1.0)),
        "ties_scalar": (t[:2], dict(mode=MODE_SCALAR, table=one / 2688), torch.tensor(1.0)),
        "ties_g2^30": (t[2:], dict(mode=MODE_FROM_AMAX, table=one * 2.0**30),
                       torch.tensor(2.0**30)),
        "ties_per_row": (t[:2], dict(mode=MODE_PER_ROW), None),
    }.items():  # fmt: skip
        yield name, src, kw, glob


@pytest.mark.kernel
@pytest.mark.parametrize("c", [96, 160])
def test_quantize_rows_matches_reference(interpret, device, c):
    """``quantize_rows`` against the reference's ``quantize_blocks``, bitwise (codes,
    scales, globals), on random rows and on rows that hit every tie and the sign of tiny
    quotients (``_quantize_reference_cases``). On the GPU this covers the fast division
    of the modes whose global comes from an amax."""
    from fp4moe.nvfp4 import global_from_amax, quantize_blocks

    for name, src, kw, glob in _quantize_reference_cases(device, c):
        rows = src.shape[0]
        codes, scales, g = quantize_rows(src, rows, poison=True, **kw)
        if glob is None:
            want_g = global_from_amax(src.float().abs().amax(dim=-1))
        else:
            want_g = torch.full((rows,), float(glob), device=device)
        want_c, want_s = quantize_blocks(src, want_g)
        assert torch.equal(g, want_g), name
        assert torch.equal(scales.view(torch.uint8), want_s.view(torch.uint8)), name
        assert torch.equal(codes, want_c), name


@pytest.mark.gpu
def test_quantize_rows_matches_reference_gpu(device):
    """The same at the DeepSeek-V3 widths on the GPU (C 7168 and 2048, 64 rows: the
    unrolled chunks, the fast division)."""
    if device != "cuda":
        pytest.skip("GPU test")
    for c in (7168, 2048):
        test_quantize_rows_matches_reference(False, "cuda", c)


@pytest.mark.kernel
def test_amax_rows_many_rows_a_program(interpret, device):
    """``amax_rows`` with several rows a program (a partial last program, a device count
    that ends inside a program) gives the exact amax."""
    x = _x(10, 96, seed=5, device=device)
    x[9, 7] = -50.0
    x[6, 3] = 40.0
    for per in (None, 3):
        assert amax_rows(x, 10, rows_per_program=per).item() == 50.0
        cnt = torch.tensor([7], dtype=torch.int32, device=device)
        assert amax_rows(x, 10, count=cnt, rows_per_program=per).item() == 40.0
        assert amax_rows(x, 10, count=cnt * 0, rows_per_program=per).item() == 0.0


@pytest.mark.kernel
@pytest.mark.parametrize("programs", [None, 12], ids=["chunks", "spans"])
def test_quantize_split_rows_same_bits(interpret, device, monkeypatch, programs):
    """``quantize_rows`` with a span of a row's chunks a program (``split_rows``) gives the
    codes, scales and globals of one row a program, in every mode: one chunk a span, and
    (a program budget of 12 for 5 rows of 5 chunks) two spans of 3 chunks, the second
    running past the row's end."""
    from fp4moe.kernels import quantize as q

    if device != "cpu":
        pytest.skip("interpreter case; test_quantize_split_rows_gpu runs it on the GPU")
    if programs is not None:
        monkeypatch.setattr(q, "QUANTIZE_SPLIT_PROGRAMS", programs)
    assert q.split_span(5, 160, 32) == (32 if programs is None else 96)
    for x, n, kw in _quantize_split_cases(device, 5, 160, seed=9):
        one = quantize_rows(x, 5, split_rows=False, **kw)
        split = quantize_rows(x, 5, split_rows=True, **kw)
        assert _same_quantized(one, split, n)


def test_split_span():
    """A split row's span: one chunk while rows x chunks fit the program budget, else as
    few whole chunks as keep rows x spans within it; never past one span a row."""
    from fp4moe.kernels.quantize import QUANTIZE_SPLIT_PROGRAMS as P
    from fp4moe.kernels.quantize import split_span

    assert split_span(2, 14336, 256) == 256  # 56 chunks, 112 programs
    assert split_span(256, 14336, 256) == 7 * 256  # 8 spans a row: 2048 programs
    assert split_span(512, 14336, 256) == 14 * 256
    assert split_span(P, 7168, 256) == 7168  # one span a row
    assert split_span(4 * P, 100, 256) == 256
    for rows in (1, 3, 37, 300, 511, 512):
        for c in (64, 2880, 7168, 14336):
            span = split_span(rows, c, 256)
            spans = -(-c // span)
            assert span % 256 == 0 and (rows * spans <= P or spans == 1)
            assert spans * span - c < span  # no span wholly past the row
    with pytest.raises(ValueError, match="rows"):
        split_span(0, 128, 256)


@pytest.mark.gpu
@pytest.mark.parametrize(
    "rows,c", [(1, 7168), (8, 7168), (8, 2048), (64, 768), (256, 14336), (512, 14336),
               (300, 2880)])  # fmt: skip
def test_quantize_split_rows_gpu(device, rows, c):
    """On the GPU: the span-a-program quantize gives the bits of the row-a-program one
    (one chunk a span, and several where rows x chunks pass the program budget)."""
    if device != "cuda":
        pytest.skip("GPU test")
    for x, n, kw in _quantize_split_cases("cuda", rows, c, seed=rows + c):
        one = quantize_rows(x, rows, split_rows=False, **kw)
        split = quantize_rows(x, rows, split_rows=True, **kw)
        assert _same_quantized(one, split, n)


@pytest.mark.kernel
@pytest.mark.parametrize("rows,c", [(5, 128), (17, 192), (3, 64)])
@pytest.mark.parametrize("qmode", ["per_row", "static", "scalar"])
def test_quantize_writes_decoded_rows(interpret, device, rows, c, qmode):
    """``quantize_rows(decoded=...)``: the same codes, scales and globals, and the rows
    decoded bit for bit as ``dense_rows(codes, scales, order=64)`` decodes them (the
    Gluon GEMMs' W4A4 operand), zero rows, tiny values (-0 codes) and a count included;
    few rows (one chunk a program) and many."""
    from fp4moe.kernels import quantize as q

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

    x = torch.zeros(4, 128, dtype=torch.bfloat16)
    dt = decoded_rows_dtype()
    x96 = torch.zeros(4, 96, dtype=torch.bfloat16)
    for bad, src in ((torch.full((4, 64), 7.0, dtype=dt), x),
                     (torch.full((4, 128), 7.0, dtype=torch.float16), x),
                     (torch.full((4, 96), 7.0, dtype=dt), x96)):  # fmt: skip
        with pytest.raises(ValueError, match="decoded"):
            quantize_rows(src, 4, mode=q.MODE_PER_ROW, decoded=bad)
        assert (bad == 7.0).all()


def _e4m3_cases(device: str, c: int):
    """Rows for W4A8's quantize: random over many magnitudes, a zero row, a row whose amax
    is 448 (scale 1: the exact ties of the e4m3 grid, -0, subnormals and the saturating
    end), and tiny values."""
    g = torch.Generator().manual_seed(c)
    x = torch.randn(7, c, generator=g) * torch.logspace(-8, 4, 7)[:, None]
    x[1] = 0.0
    ties = torch.tensor([448.0, 1.0625, -1.1875, -0.0, 2.0**-10, 3 * 2.0**-10, 0.0, -20.5])
    x[2] = 1.0
    x[2, : ties.numel()] = ties
    x[3, :3] = torch.tensor([1e-30, -1e-30, 5e-39])
    return x.to(torch.bfloat16).to(device)


@pytest.mark.kernel
@pytest.mark.parametrize("c", [64, 96, 2048])
@pytest.mark.parametrize("rows_mode", ["few", "spans", "many", "gather"])
def test_e4m3_rows_matches_reference(interpret, device, monkeypatch, c, rows_mode):
    """W4A8's row quantize against ``reference.e4m3_rows``, bitwise (values, -0 and the
    scales; rows of 64 and 2048 in the unit order, 96 in natural order), one row a program,
    one chunk a program, a span of several chunks (the last partly past the row's end), gathered
    rows with a device count (rows past it stay unwritten)."""
    from fp4moe.kernels import quantize
    from fp4moe.kernels.quantize_e4m3 import e4m3_rows, unit_order
    from fp4moe.reference import e4m3_rows as reference

    if c == 2048 and interpret:
        pytest.skip("the model width runs on the GPU")
    src = _e4m3_cases(device, c)
    if rows_mode == "gather":
        index = torch.tensor([6, 0, 13, 4, 9, 2], dtype=torch.int32, device=device)
        count = torch.tensor([5], dtype=torch.int32, device=device)
        q, s = e4m3_rows(src, 6, index=index, div=2, count=count, poison=True)
        want_q, want_s = reference(src[index.long()[:5] // 2])
        assert torch.isnan(s[5]) and bool((q[5].view(torch.uint8) == 0xFF).all())
        q, s = q[:5], s[:5]
    else:
        rows = src.shape[0]
        if rows_mode == "spans":  # one span of 2 chunks a row (c 96: the last partly past it)
            monkeypatch.setattr(quantize, "QUANTIZE_SPLIT_PROGRAMS", rows)
        q, s = e4m3_rows(src, rows, poison=True, split_rows=rows_mode != "many")
        want_q, want_s = reference(src)
    assert torch.equal(s, want_s)
    assert torch.equal(unit_order(q.view(torch.uint8)), want_q.view(torch.uint8))
    assert torch.equal(q.float().abs().amax(dim=1) <= 448, torch.ones_like(s, dtype=torch.bool))
