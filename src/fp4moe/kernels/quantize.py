"""Activation quantization to NVFP4 for W4A4 (SPEC section 2), bit-identical to
``fp4moe.nvfp4.quantize_nvfp4``: per-row dynamic, static (a calibrated global per expert)
or one per-tensor global, optionally gathering the rows it reads.

One program a row: an amax pass (per-row dynamic only), then the row in chunks of
BLOCK_C: block amax, e4m3 scale (round to nearest even, saturating), e2m1 codes.
Divisions are ``div_rn`` so that the float operations are those of the reference.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .common import nibble_to_f16, order_rows, to_e4m3

__all__ = [
    "MODE_AMAX_SELF",
    "MODE_FROM_AMAX",
    "MODE_PER_ROW",
    "MODE_SCALAR",
    "MODE_STATIC",
    "amax_rows_kernel",
    "encode_e2m1",
    "quantize_rows_kernel",
]

MODE_PER_ROW = 0  # global = amax(row) / 2688 (1 where the row is 0)
MODE_STATIC = 1  # global = table[row_expert[i]]
MODE_SCALAR = 2  # global = table[0]
MODE_FROM_AMAX = 3  # global = table[0] / 2688 (1 where it is 0): table[0] an amax
# global = amax / 2688 (1 where it is 0), the amax over the first (counted) rows of src
# taken by every program itself: MODE_FROM_AMAX's global without the amax kernel, for
# inputs small enough that each program can read them all
MODE_AMAX_SELF = 4


@triton.jit
def encode_e2m1(v):
    m = tl.abs(v)
    idx = (
        (m > 0.25).to(tl.uint8)
        + (m >= 0.75).to(tl.uint8)
        + (m > 1.25).to(tl.uint8)
        + (m >= 1.75).to(tl.uint8)
        + (m > 2.5).to(tl.uint8)
        + (m >= 3.5).to(tl.uint8)
        + (m > 5.0).to(tl.uint8)
    )
    return idx | ((v < 0).to(tl.uint8) << 3)


@triton.jit
def _row_count(n_rows_ptr, n_rows, COUNT_FROM_PTR: tl.constexpr):
    """Rows to process: ``*n_rows_ptr`` (a device count) or ``n_rows``."""
    if COUNT_FROM_PTR:
        return tl.load(n_rows_ptr)
    else:
        return n_rows


@triton.jit
def _row_amax(row, C: tl.constexpr, BLOCK_C: tl.constexpr):
    """max |x| over one bf16 row of C elements, in fp32."""
    cols = tl.arange(0, BLOCK_C)
    amax = tl.zeros((BLOCK_C,), dtype=tl.float32)
    for c0 in range(0, C, BLOCK_C):
        x = tl.load(row + c0 + cols, mask=c0 + cols < C, other=0.0).to(tl.float32)
        amax = tl.maximum(amax, tl.abs(x))
    return tl.max(amax, axis=0)


@triton.jit
def amax_rows_kernel(
    src_ptr,  # bf16 [rows, C]
    n_rows_ptr,  # int32 pointer to the row count (COUNT_FROM_PTR)
    n_rows,
    amax_ptr,  # fp32 [1], zero before the launch: max |x| over the rows is folded in
    C: tl.constexpr,
    COUNT_FROM_PTR: tl.constexpr,
    BLOCK_C: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    """Per-tensor amax (SPEC 2.1) of the first rows of ``src`` on the device: one program a
    row, an atomic max (exact and order-free, so deterministic) into ``amax_ptr``."""
    i = tl.program_id(0)
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    if i >= _row_count(n_rows_ptr, n_rows, COUNT_FROM_PTR):
        return
    tl.atomic_max(amax_ptr, _row_amax(src_ptr + i.to(tl.int64) * C, C, BLOCK_C), sem="relaxed")


# n_rows not specialized: a row count of 1 made a constant that broke Triton 3.6's
# coalesce pass on sm_90 in MODE_AMAX_SELF's row loop (PassManager::run failed)
@triton.jit(do_not_specialize=["n_rows"])
def quantize_rows_kernel(
    src_ptr,  # bf16 [src_rows, C]
    src_index_ptr,  # int32 [rows]: src row = src_index[i] // DIV (GATHER)
    n_rows_ptr,  # int32 pointer to the row count (COUNT_FROM_PTR)
    n_rows,
    codes_ptr,  # uint8 [rows, C/2]
    scales_ptr,  # e4m3 [rows, C/16]
    global_out_ptr,  # fp32 [rows]
    table_ptr,  # fp32 global table (MODE_STATIC: [E]; MODE_SCALAR: [1])
    row_expert_ptr,  # int32 [rows] (MODE_STATIC)
    C: tl.constexpr,
    MODE: tl.constexpr,
    GATHER: tl.constexpr,
    DIV: tl.constexpr,
    COUNT_FROM_PTR: tl.constexpr,
    BLOCK_C: tl.constexpr,
    USE_PDL: tl.constexpr,
    INTERPRET: tl.constexpr,
    AMAX_C: tl.constexpr,
    SPLIT_C: tl.constexpr = False,
    dec_ptr=None,  # DEC: [rows, C] DEC_DTYPE, the decoded values in the unit order
    DEC: tl.constexpr = False,
    DEC_DTYPE: tl.constexpr = tl.bfloat16,
):
    """One row a program (SPLIT_C: one BLOCK_C chunk of a row a program, grid axis 1, for
    few rows); the per-row amax reads AMAX_C elements at a time. The same bits either way.
    DEC (BLOCK_C a multiple of 64): also the row decoded as ``dequant.dense_rows(order=64)``
    decodes it (e2m1 value times the e4m3 scale times 2^-8, exact; each 64 elements in the
    unit order), the operand of the Gluon GEMMs (``gluon_ws``) with no decode launch."""
    i = tl.program_id(0)
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    if i >= _row_count(n_rows_ptr, n_rows, COUNT_FROM_PTR):
        return
    if GATHER:
        src = (tl.load(src_index_ptr + i) // DIV).to(tl.int64)
    else:
        src = i.to(tl.int64)
    row = src_ptr + src * C
    cols = tl.arange(0, BLOCK_C)

    if MODE == 1:
        g = tl.load(table_ptr + tl.load(row_expert_ptr + i))
    elif MODE == 2:
        g = tl.load(table_ptr)
    else:  # the global from an amax: the row's, a given one, or the counted rows'
        if MODE == 0:
            a = _row_amax(row, C, AMAX_C)  # SPLIT_C: every chunk's program reads the row
        elif MODE == 3:
            a = tl.load(table_ptr)
        else:  # the amax of rows 0 .. count - 1 of src (not gathered), as amax_rows_kernel
            nr = _row_count(n_rows_ptr, n_rows, COUNT_FROM_PTR)
            a = _row_amax(src_ptr, C, AMAX_C)  # row 0 (nr > i >= 0 here)
            r = 1
            while r < nr:  # (a `for` over a runtime bound is fussy in the interpreter)
                a = tl.maximum(a, _row_amax(src_ptr + r.to(tl.int64) * C, C, AMAX_C))
                r += 1
        g = tl.where(a == 0.0, 1.0, tl.math.div_rn(a, 2688.0))
    if SPLIT_C:  # one chunk a program (grid axis 1); the row's global stored once
        tl.store(global_out_ptr + i, g, mask=tl.program_id(1) == 0)
        c_off = tl.program_id(1) * BLOCK_C
        c_span: tl.constexpr = BLOCK_C
    else:
        tl.store(global_out_ptr + i, g)
        c_off = 0
        c_span: tl.constexpr = C

    i64 = i.to(tl.int64)
    six_g = 6.0 * g
    for cb in range(0, c_span, BLOCK_C):
        c0 = cb + c_off
        x = tl.load(row + c0 + cols, mask=c0 + cols < C, other=0.0).to(tl.float32)
        xb = x.reshape(BLOCK_C // 16, 16)
        amax_b = tl.max(tl.abs(xb), axis=1)
        s = tl.minimum(tl.math.div_rn(amax_b, tl.zeros_like(amax_b) + six_g), 448.0)
        s8 = to_e4m3(s, INTERPRET)
        denom = s8.to(tl.float32) * g
        safe = tl.where(denom == 0.0, 1.0, denom)
        v = tl.math.div_rn(xb, tl.broadcast_to(safe[:, None], (BLOCK_C // 16, 16)))
        code = tl.where((denom == 0.0)[:, None], 0, encode_e2m1(v)).to(tl.uint8)
        lo, hi = tl.split(code.reshape(BLOCK_C // 2, 2))
        packed = lo | (hi << 4)
        pc = c0 // 2 + tl.arange(0, BLOCK_C // 2)
        tl.store(codes_ptr + i64 * (C // 2) + pc, packed, mask=pc < C // 2)
        ps = c0 // 16 + tl.arange(0, BLOCK_C // 16)
        tl.store(scales_ptr + i64 * (C // 16) + ps, s8, mask=ps < C // 16)
        if DEC:
            # the operations of gemm.decode_lohi without the asm (code 8: -0)
            val = nibble_to_f16(code).to(tl.float32) * 16384.0
            d = val * (s8.to(tl.float32) * 0.00390625)[:, None]
            d = tl.reshape(order_rows(tl.reshape(d, (1, BLOCK_C)), 1, BLOCK_C, 64), (BLOCK_C,))
            tl.store(dec_ptr + i64 * C + c0 + cols, d.to(DEC_DTYPE), mask=c0 + cols < C)
