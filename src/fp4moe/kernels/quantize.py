"""Activation quantization to NVFP4 for W4A4 (numerics section 2), bit-identical to
``fp4moe.nvfp4.quantize_nvfp4``: per-row dynamic, static (a calibrated global per expert)
or one per-tensor global, optionally gathering the rows it reads.

One program a row: an amax pass (per-row dynamic only), then the row in chunks of
BLOCK_C: block amax, e4m3 scale (round to nearest even, saturating), e2m1 codes.
Divisions are ``div_rn`` so that the float operations are those of the reference.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .common import empty, interpreting, launch, nibble_to_f16, pdl_wait_release, to_e4m3

__all__ = [
    "MODE_AMAX_SELF",
    "MODE_FROM_AMAX",
    "MODE_PER_ROW",
    "MODE_SCALAR",
    "MODE_STATIC",
    "amax_rows",
    "amax_rows_kernel",
    "decoded_rows_dtype",
    "encode_e2m1",
    "encode_e2m1_fast",
    "quantize_rows",
    "quantize_rows_kernel",
    "row_amax",
    "row_count",
    "source_row",
    "split_span",
]

# Launch shapes (the same bits at any of them). Up to QUANTIZE_SPLIT_ROWS rows, a span of
# a row's QUANTIZE_SPLIT_C-element chunks a program instead of one row a program, and the
# amax passes read a row in one load of up to AMAX_WIDE_C elements instead of a chain of
# 1024-element loads (max is exact in any order). On the H200 (DeepSeek-V3 EP8) one chunk
# a program took W4A4 per-token from 82.2 to 77.3 us at 1 token and per-tensor from 120.8
# to 111.4 us at 16 tokens. Each span's program re-reads its row for the amax, so a span
# holds as few chunks as keep rows x spans within QUANTIZE_SPLIT_PROGRAMS (``split_span``):
# one chunk where rows are few, several where rows are many and long.
QUANTIZE_SPLIT_ROWS = 512
QUANTIZE_SPLIT_C = 256
QUANTIZE_SPLIT_PROGRAMS = 2048
AMAX_WIDE_C = 8192
AMAX_ROWS = 16  # amax_rows above QUANTIZE_SPLIT_ROWS rows: rows a program (one atomic each)

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
def encode_e2m1_fast(v, neg):
    """``encode_e2m1`` in fewer operations, as int32, with the sign bit from ``neg`` (for
    the same code: ``v < 0``): the same index for every finite or infinite fp32 (checked
    exhaustively over [0, 16) and for large values). |v| is rounded to nearest even on the
    e2m1 grid by adding and subtracting a power of two whose ulp is the grid's step there
    (0.5 below 2, 1 below 4, 2 above), so ties fall where numerics 2.3 puts them; the index of
    r is r + min(r, 2), at most 7. (NaN is outside the contract: a NaN block's scale
    already differs from the reference, whose amax propagates it.)"""
    m = tl.abs(v)
    big = tl.where(m < 2.0, 4194304.0, tl.where(m < 4.0, 8388608.0, 16777216.0))
    r = (m + big) - big
    idx = tl.minimum(r + tl.minimum(r, 2.0), 7.0).to(tl.int32)
    return idx | (neg.to(tl.int32) << 3)


@triton.jit
def row_count(n_rows_ptr, n_rows, COUNT_FROM_PTR: tl.constexpr):
    """Rows to process: ``*n_rows_ptr`` (a device count) or ``n_rows``."""
    if COUNT_FROM_PTR:
        return tl.load(n_rows_ptr)
    else:
        return n_rows


@triton.jit
def source_row(src_ptr, src_index_ptr, i, C: tl.constexpr, GATHER: tl.constexpr,
               DIV: tl.constexpr):  # fmt: skip
    """The first element of row ``i``'s source row of [., C] ``src``: ``src_index[i] // DIV``
    (GATHER), else row ``i``."""
    if GATHER:
        src = (tl.load(src_index_ptr + i) // DIV).to(tl.int64)
    else:
        src = i.to(tl.int64)
    return src_ptr + src * C


@triton.jit
def row_amax(row, C: tl.constexpr, BLOCK_C: tl.constexpr):
    """max |x| over one bf16 row of C elements, in fp32."""
    cols = tl.arange(0, BLOCK_C)
    amax = tl.zeros((BLOCK_C,), dtype=tl.float32)
    for c0 in range(0, C, BLOCK_C):
        x = tl.load(row + c0 + cols, mask=c0 + cols < C, other=0.0).to(tl.float32)
        amax = tl.maximum(amax, tl.abs(x))
    return tl.max(amax, axis=0)


@triton.jit
def _rows_amax(src_ptr, nr, C: tl.constexpr, BLOCK_C: tl.constexpr):
    """max |x| over rows 0 .. nr - 1 (nr >= 1) of bf16 [., C] in fp32: RB rows at once
    (a [RB, BLOCK_C] tile of at most 8192 elements), so that few short rows cost one
    load's latency, not one a row (Qwen3's FC2 input at 1 token, 8 rows of 768, took 3 us
    a launch row by row on the H200)."""
    RB: tl.constexpr = max(1, min(16, 8192 // BLOCK_C))
    cols = tl.arange(0, BLOCK_C)
    rr = tl.arange(0, RB)
    acc = tl.zeros((RB, BLOCK_C), dtype=tl.float32)
    r = 0
    while r < nr:  # (a `for` over a runtime bound is fussy in the interpreter)
        rows = r + rr
        base = src_ptr + rows.to(tl.int64)[:, None] * C
        for c0 in range(0, C, BLOCK_C):
            m = (rows < nr)[:, None] & (c0 + cols < C)[None, :]
            x = tl.load(base + c0 + cols[None, :], mask=m, other=0.0).to(tl.float32)
            acc = tl.maximum(acc, tl.abs(x))
        r += RB
    return tl.max(tl.max(acc, axis=1), axis=0)


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
    ROWS: tl.constexpr = 1,  # rows a program
):
    """Per-tensor amax (numerics 2.1) of the first rows of ``src`` on the device: ROWS rows a
    program, then one atomic max (exact and order-free, so deterministic) into
    ``amax_ptr``. (One row a program made one atomic on the same address a row: 8192 of
    them for an 8192-token x.)"""
    p = tl.program_id(0)
    pdl_wait_release(USE_PDL)
    n = row_count(n_rows_ptr, n_rows, COUNT_FROM_PTR)
    if p * ROWS >= n:
        return
    cols = tl.arange(0, BLOCK_C)
    acc = tl.zeros((BLOCK_C,), dtype=tl.float32)
    for j in range(ROWS):
        i = p * ROWS + j
        row = src_ptr + i.to(tl.int64) * C
        for c0 in tl.static_range(0, C, BLOCK_C):
            x = tl.load(row + c0 + cols, mask=(c0 + cols < C) & (i < n), other=0.0)
            acc = tl.maximum(acc, tl.abs(x.to(tl.float32)))
    tl.atomic_max(amax_ptr, tl.max(acc, axis=0), sem="relaxed")


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
    SPAN: tl.constexpr = 0,
    dec_ptr=None,  # DEC: [rows, C] DEC_DTYPE, the decoded values in the unit order
    DEC: tl.constexpr = False,
    DEC_DTYPE: tl.constexpr = tl.bfloat16,
):
    """One row a program (SPAN > 0: SPAN elements of a row a program, grid axis 1, BLOCK_C
    at a time, for few rows); the per-row amax reads AMAX_C elements at a time. The same
    bits either way.
    DEC (BLOCK_C a multiple of 64): also the row decoded as ``operands.dense_rows(order=64)``
    decodes it (e2m1 value times the e4m3 scale times 2^-8, exact; each 64 elements in the
    unit order), the operand of the Gluon GEMMs with no decode launch."""
    FAST_DIV_MODES: tl.constexpr = MODE == 0 or MODE == 3 or MODE == 4
    i = tl.program_id(0)
    pdl_wait_release(USE_PDL)
    if i >= row_count(n_rows_ptr, n_rows, COUNT_FROM_PTR):
        return
    row = source_row(src_ptr, src_index_ptr, i, C, GATHER, DIV)

    if MODE == 1:
        g = tl.load(table_ptr + tl.load(row_expert_ptr + i))
    elif MODE == 2:
        g = tl.load(table_ptr)
    else:  # the global from an amax: the row's, a given one, or the counted rows'
        if MODE == 0:
            a = row_amax(row, C, AMAX_C)  # SPAN: every span's program reads the row
        elif MODE == 3:
            a = tl.load(table_ptr)
        else:  # the amax of rows 0 .. count - 1 of src (not gathered), as amax_rows_kernel
            nr = row_count(n_rows_ptr, n_rows, COUNT_FROM_PTR)
            a = _rows_amax(src_ptr, nr, C, AMAX_C)
        g = tl.where(a == 0.0, 1.0, tl.math.div_rn(a, 2688.0))
    if SPAN > 0:  # one span a program (grid axis 1); the row's global stored once
        tl.store(global_out_ptr + i, g, mask=tl.program_id(1) == 0)
        c_off = tl.program_id(1) * SPAN
        c_span: tl.constexpr = SPAN
    else:
        tl.store(global_out_ptr + i, g)
        c_off = 0
        c_span: tl.constexpr = C

    i64 = i.to(tl.int64)
    # A global from an amax bounds every quotient (numerics 2: a block's values over its scale
    # times the global stay below 6 * 2^9 * 2688), so there the divisions take the fast
    # path of div_rn (its reciprocal once a block, not once an element) when the global
    # keeps every operand in the range where that path is exact; else div_rn itself.
    if FAST_DIV_MODES and not INTERPRET:
        if (g >= 6.462348535570529e-27) & (g <= 1.5474250491067253e26):  # 2^-87 .. 2^87
            _quantize_span(row, c_off, i64, g, codes_ptr, scales_ptr, C, BLOCK_C, c_span,
                           INTERPRET, dec_ptr, DEC, DEC_DTYPE, True)  # fmt: skip
        else:
            _quantize_span(row, c_off, i64, g, codes_ptr, scales_ptr, C, BLOCK_C, c_span,
                           INTERPRET, dec_ptr, DEC, DEC_DTYPE, False)  # fmt: skip
    else:
        _quantize_span(row, c_off, i64, g, codes_ptr, scales_ptr, C, BLOCK_C, c_span,
                       INTERPRET, dec_ptr, DEC, DEC_DTYPE, False)  # fmt: skip


@triton.jit
def _quantize_span(row, c_off, i64, g, codes_ptr, scales_ptr, C: tl.constexpr,
                   BLOCK_C: tl.constexpr, SPAN: tl.constexpr, INTERPRET: tl.constexpr,
                   dec_ptr, DEC: tl.constexpr, DEC_DTYPE: tl.constexpr,
                   FAST: tl.constexpr):  # fmt: skip
    """Elements c_off .. c_off + SPAN of a row, BLOCK_C at a time (``_quantize_chunk``).
    Unrolled, each chunk loaded before the one before it is stored: the compiler cannot
    move a load above a store that may alias it, so otherwise every chunk's load waits
    for the last chunk's stores (one load in flight a thread)."""
    six_g = 6.0 * g
    y6 = _fast_rcp(six_g, FAST)
    xb = _load_chunk(row, c_off, C, BLOCK_C)
    for cb in tl.static_range(0, SPAN, BLOCK_C):
        x_now = xb
        if cb + BLOCK_C < SPAN:
            xb = _load_chunk(row, cb + BLOCK_C + c_off, C, BLOCK_C)
        _quantize_chunk(x_now, cb + c_off, i64, g, six_g, y6, codes_ptr, scales_ptr, C,
                        BLOCK_C, INTERPRET, dec_ptr, DEC, DEC_DTYPE, FAST)  # fmt: skip


@triton.jit
def _fast_rcp(d, FAST: tl.constexpr):
    """div_rn's reciprocal of ``d`` (MUFU.RCP and one Newton step, as its fast path forms
    it; FAST only, else 0)."""
    if FAST:
        r = tl.inline_asm_elementwise("rcp.approx.ftz.f32 $0, $1;", "=r,r", [d],
                                      dtype=tl.float32, is_pure=True, pack=1)  # fmt: skip
        return tl.fma(r, tl.fma(-d, r, 1.0), r)
    else:
        return d * 0.0


@triton.jit
def _div(x, d, y, FAST: tl.constexpr):
    """x / d rounded to nearest even: div_rn, or (FAST, ``y = _fast_rcp(d)``) the fast path
    of div_rn's own expansion, the same bits wherever that path applies (operands and
    quotient away from overflow and underflow; a quotient near underflow encodes to 0
    either way)."""
    if FAST:
        q0 = tl.fma(x, y, 0.0)
        return tl.fma(y, tl.fma(-d, q0, x), q0)
    else:
        return tl.math.div_rn(x, d)


@triton.jit
def _load_chunk(row, c0, C: tl.constexpr, BLOCK_C: tl.constexpr):
    """Elements c0 .. c0 + BLOCK_C of a bf16 row as fp32 [BLOCK_C / 16, 16] (one NVFP4
    block a row; zeros past C)."""
    offs = c0 + tl.arange(0, BLOCK_C // 16)[:, None] * 16 + tl.arange(0, 16)[None, :]
    return tl.load(row + offs, mask=offs < C, other=0.0).to(tl.float32)


@triton.jit
def _quantize_chunk(xb, c0, i64, g, six_g, y6, codes_ptr, scales_ptr, C: tl.constexpr,
                    BLOCK_C: tl.constexpr, INTERPRET: tl.constexpr, dec_ptr,
                    DEC: tl.constexpr, DEC_DTYPE: tl.constexpr,
                    FAST: tl.constexpr = False):  # fmt: skip
    """Elements c0 .. c0 + BLOCK_C of one row (``xb``, ``_load_chunk``'s [blocks, 16]) to
    codes, scales (and DEC: decoded values) of row ``i64``. A 16-element block's amax,
    scale and codes stay in the threads that hold it: no layout conversion through shared
    memory (a 1-D form needed two barriers a chunk, about 42 SASS instructions an
    element)."""
    NBK: tl.constexpr = BLOCK_C // 16
    amax_b = tl.max(tl.abs(xb), axis=1)
    s = tl.minimum(_div(amax_b, tl.zeros_like(amax_b) + six_g, y6, FAST), 448.0)
    s8 = to_e4m3(s, INTERPRET)
    denom = s8.to(tl.float32) * g
    # a block with scale 0 has codes 0: over +inf every quotient is +-0 (and not < 0)
    safe = tl.where(denom == 0.0, float("inf"), denom)
    if FAST:  # there the reciprocal is 0 over 1
        zero = denom == 0.0
        dd = tl.where(zero, 1.0, denom)
        y = tl.where(zero, 0.0, _fast_rcp(dd, FAST))
        v = _div(xb, dd[:, None], y[:, None], FAST)
        # x / d < 0 exactly where x * 2^150 < -d (x < 0 and |x| / d > 2^-150; else it
        # rounds to -0 or 0): the fast path's quotient may round differently only far
        # below the e2m1 grid, where the sign is all that counts. Exact: scaling by 2^75
        # twice, an overflow to -inf included; never for a block of scale 0 (-inf < -inf).
        neg = (xb * 3.777893186295716e22) * 3.777893186295716e22 < -safe[:, None]
    else:
        v = tl.math.div_rn(xb, tl.broadcast_to(safe[:, None], (NBK, 16)))
        neg = v < 0.0
    code = encode_e2m1_fast(v, neg)
    # four code bytes a 32-bit word, built in int32 (uint8 tensors cost byte permutes and
    # shifts an element): nibble n of a word holds element 8 w + n of the block
    c32 = tl.reshape(code, (NBK, 2, 8))
    sh = (tl.arange(0, 8) * 4)[None, None, :]
    word = tl.sum(c32 << sh, axis=2)  # [blocks, 2]: disjoint bits, so the sum is an OR
    pw = (c0 // 8 + tl.arange(0, NBK)[:, None] * 2 + tl.arange(0, 2)[None, :]).to(tl.int64)
    wptr = (codes_ptr + i64 * (C // 2)).to(tl.pointer_type(tl.int32), bitcast=True)
    tl.store(wptr + pw, word, mask=pw < C // 8)
    ps = c0 // 16 + tl.arange(0, NBK)
    if INTERPRET:
        tl.store(scales_ptr + i64 * (C // 16) + ps, s8, mask=ps < C // 16)
    else:
        # one byte a block stored in the layout the block's reduction left it in (by both
        # threads that hold the block): tl.store converts it to a coalesced layout through
        # shared memory, two barriers a chunk that keep the next chunk's load behind them
        tl.inline_asm_elementwise(
            "{ .reg .pred p; setp.ne.b16 p, $3, 0; @p st.global.u8 [$1], $2; mov.u32 $0, 0; }",
            "=r,l,h,h", [scales_ptr + i64 * (C // 16) + ps,
                         s8.to(tl.uint8, bitcast=True).to(tl.int16),
                         (ps < C // 16).to(tl.int16)],
            dtype=tl.int32, is_pure=False, pack=1,
        )  # fmt: skip
    if DEC:
        # the operations of gemm.decode_lohi without the asm (code 8: -0), each value
        # stored at its unit-order position (element 16 q + 4 s + 2 a + b of a 64-element
        # unit goes to 16 s + 8 b + 2 q + a): a scattered store, but no reshape of the
        # [blocks, 16] tile (reshaping it to the order of order_rows decoded wrong values
        # on the GPU, right ones in the interpreter)
        val = nibble_to_f16(code).to(tl.float32) * 16384.0
        d = val * (s8.to(tl.float32) * 0.00390625)[:, None]
        k = tl.arange(0, NBK)[:, None] * 16 + tl.arange(0, 16)[None, :]
        e = k % 64
        pos = k - e + 16 * ((e // 4) % 4) + 8 * (e % 2) + 2 * (e // 16) + (e // 2) % 2
        tl.store(dec_ptr + i64 * C + c0 + pos, d.to(DEC_DTYPE), mask=c0 + k < C)


def _row_block(c: int, wide: bool = False) -> int:
    """Elements of a C-wide row a quantize or amax program loads at once: 1024 (64 in the
    interpreter), or with ``wide`` (few rows) a whole row up to AMAX_WIDE_C."""
    cap = AMAX_WIDE_C if wide else (64 if interpreting() else 1024)
    return min(triton.next_power_of_2(c), cap)


def split_span(rows: int, c: int, chunk: int) -> int:
    """Elements of a C-wide row one program quantizes when a row is split over programs: a
    whole number of ``chunk``-element chunks, as few as keep rows x spans within
    QUANTIZE_SPLIT_PROGRAMS (one chunk for few rows; each span's program reads its whole
    row for a per-row amax, so fewer spans read less)."""
    if rows < 1 or c < 1 or chunk < 1:
        raise ValueError(
            f"split_span: rows, c and chunk must be positive, got {rows}, {c}, {chunk}"
        )
    n = triton.cdiv(c, chunk)
    spans = max(1, min(n, QUANTIZE_SPLIT_PROGRAMS // rows))
    return triton.cdiv(n, spans) * chunk


def decoded_rows_dtype() -> torch.dtype:
    """dtype of decoded operand rows (``operands.dense_rows``, ``quantize_rows(decoded=)``):
    bf16, fp32 in the interpreter (whose bf16 dot is unreliable)."""
    return torch.float32 if interpreting() else torch.bfloat16


def quantize_rows(
    src: torch.Tensor,
    rows: int,
    *,
    mode: int,
    pdl: bool = False,
    index: torch.Tensor | None = None,
    div: int = 1,
    count: torch.Tensor | None = None,
    table: torch.Tensor | None = None,
    row_expert: torch.Tensor | None = None,
    poison: bool = False,
    decoded: torch.Tensor | None = None,
    split_rows: bool | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """NVFP4 codes uint8 [rows, C/2], e4m3 scales [rows, C/16] and fp32 globals [rows] of
    rows of ``src`` (bf16 [., C]); ``mode`` (``MODE_*``) picks the global: per row, the
    one scalar in ``table`` (or an amax there, ``MODE_FROM_AMAX``; or taken over the
    counted rows by every program, ``MODE_AMAX_SELF``), or (static) ``table[row_expert[r]]``.
    ``index`` / ``div`` gather source row ``index[r] // div``; ``count`` (a device scalar)
    limits the rows. ``decoded`` ([rows, C] of ``decoded_rows_dtype()``, C a multiple of
    64): also receives the rows decoded as ``operands.dense_rows(order=64)`` gives them
    (the Gluon GEMMs' W4A4 operand). ``split_rows``: a span of a row's chunks a program
    (``split_span``) and wide amax loads (None: up to ``QUANTIZE_SPLIT_ROWS`` rows); the
    same bits either way."""
    c = src.shape[1]
    dec = {}
    if decoded is not None:
        if c % 64 or decoded.shape != (rows, c) or decoded.dtype != decoded_rows_dtype():
            raise ValueError(
                f"decoded: expected [{rows}, {c}] {decoded_rows_dtype()} with {c} a multiple "
                f"of 64, got {list(decoded.shape)} {decoded.dtype}"
            )
        dec_dtype = tl.float32 if decoded.dtype == torch.float32 else tl.bfloat16
        dec = dict(dec_ptr=decoded, DEC=True, DEC_DTYPE=dec_dtype)
    dev = src.device
    codes = empty((rows, c // 2), torch.uint8, dev, poison)
    scales = empty((rows, c // 16), torch.float8_e4m3fn, dev, poison)
    glob = empty((rows,), torch.float32, dev, poison)
    if rows == 0:
        return codes, scales, glob
    dummy = glob
    block_c = _row_block(c)
    few = rows <= QUANTIZE_SPLIT_ROWS if split_rows is None else split_rows
    grid, split = (rows,), {}
    chunk = QUANTIZE_SPLIT_C
    if interpreting() and c <= 256:  # small test rows still split into several chunks
        chunk = 64 if dec else 32
    if few and c > chunk:  # few rows: a span of a row's chunks a program
        span = split_span(rows, c, chunk)
        grid, split = (rows, triton.cdiv(c, span)), dict(SPAN=span)
        block_c = chunk
    launch(
        quantize_rows_kernel, grid, pdl,
        src, index if index is not None else dummy, count if count is not None else dummy,
        rows, codes, scales, glob,
        table if table is not None else dummy, row_expert if row_expert is not None else dummy,
        c, MODE=mode, GATHER=index is not None, DIV=div, COUNT_FROM_PTR=count is not None,
        BLOCK_C=block_c, AMAX_C=_row_block(c, few), INTERPRET=interpreting(), num_warps=4,
        **split, **dec,
    )  # fmt: skip
    return codes, scales, glob


def amax_rows(
    src: torch.Tensor,
    rows: int,
    *,
    count: torch.Tensor | None = None,
    pdl: bool = False,
    out: torch.Tensor | None = None,
    rows_per_program: int | None = None,
) -> torch.Tensor:
    """fp32 [1]: max |x| over the first ``rows`` rows of bf16 ``src`` [., C] (``count``, a
    device scalar, limits them further), on the device; 0 for no rows. ``out``: an fp32
    [1] zero on ``src``'s device to fold the amax into (e.g. a slot the sort kernel
    cleared before this launch); None: a zeroed tensor of its own. ``rows_per_program``:
    None: one up to ``QUANTIZE_SPLIT_ROWS`` rows (wide loads), else ``AMAX_ROWS``."""
    if out is None:
        out = torch.zeros(1, dtype=torch.float32, device=src.device)
    elif out.dtype != torch.float32 or out.numel() != 1 or out.device != src.device:
        raise ValueError(f"amax_rows: out must be one fp32 zero on {src.device}, got "
                         f"{out.dtype} [{out.numel()}] on {out.device}")  # fmt: skip
    if rows == 0:
        return out
    c = src.shape[1]
    # few rows: a row a program (the launch's latency is what counts); many: AMAX_ROWS rows
    # a program and one atomic each
    few = rows <= QUANTIZE_SPLIT_ROWS
    per = rows_per_program or (1 if few else AMAX_ROWS)
    launch(
        amax_rows_kernel, (triton.cdiv(rows, per),), pdl,
        src, count if count is not None else out, rows, out, c,
        COUNT_FROM_PTR=count is not None, BLOCK_C=_row_block(c, few and per == 1),
        ROWS=per, num_warps=4,
    )  # fmt: skip
    return out
