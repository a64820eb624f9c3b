"""W4A8's activation rows (numerics section 5a), bit-identical to
``fp4moe.reference.e4m3_rows``: s = amax(|row|) / 448 in fp32 (1 for a row of zeros) and
q = e4m3(row / s), rounded to nearest even and saturating at 448, optionally gathering
the rows it reads.

One program a row (``SPAN``: a span of a row's chunks a program, for few rows): the row's
amax, then its elements divided by s with ``div_rn`` (the reference's quotient) and
cast with the hardware's round-to-nearest-even, saturating conversion.

Rows whose width is a multiple of 64 are stored in W4A8's unit order (``unit_order``):
in each 64 elements, position 16 s + 4 q + 2 a + b holds element 16 q + 4 s + 2 a + b
(q and s swapped), the K order of the FP8 GEMMs (``gemm.decode.decode_e4m3``), so that a
thread's 16 decoded weights are its wgmma fragment's bytes.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .common import empty, interpreting, launch, pdl_wait_release, to_e4m3
from .quantize import row_amax, row_count, source_row, split_span

__all__ = ["e4m3_rows", "e4m3_rows_kernel", "unit_order"]

# few rows: a span of a row's SPLIT_C-element chunks a program (each span's program reads
# the whole row for its amax; ``quantize.split_span``), as the NVFP4 quantize kernel does
SPLIT_ROWS = 512
SPLIT_C = 1024


def unit_order(x: torch.Tensor) -> torch.Tensor:
    """Rows [..., C] (C a multiple of 64) between natural and W4A8's unit order (the
    permutation is its own inverse); other widths are returned as they are."""
    c = x.shape[-1]
    if c % 64:
        return x
    v = x.reshape(*x.shape[:-1], c // 64, 4, 4, 4)
    return v.transpose(-3, -2).reshape(x.shape)


@triton.jit(do_not_specialize=["n_rows"])
def e4m3_rows_kernel(
    src_ptr,  # bf16 [src_rows, C]
    src_index_ptr,  # int32 [rows]: src row = src_index[i] // DIV (GATHER)
    n_rows_ptr,  # int32 pointer to the row count (COUNT_FROM_PTR)
    n_rows,
    q_ptr,  # float8_e4m3fn [rows, C]
    s_ptr,  # fp32 [rows]
    C: tl.constexpr,
    GATHER: tl.constexpr,
    DIV: tl.constexpr,
    COUNT_FROM_PTR: tl.constexpr,
    BLOCK_C: tl.constexpr,
    AMAX_C: tl.constexpr,
    SPAN: tl.constexpr,  # elements of a row a program (grid axis 1); 0: one row a program
    USE_PDL: tl.constexpr,
    INTERPRET: tl.constexpr,
):
    i = tl.program_id(0)
    pdl_wait_release(USE_PDL)
    if i >= row_count(n_rows_ptr, n_rows, COUNT_FROM_PTR):
        return
    row = source_row(src_ptr, src_index_ptr, i, C, GATHER, DIV)
    amax = row_amax(row, C, AMAX_C)
    s = tl.where(amax == 0.0, 1.0, tl.math.div_rn(amax, 448.0))
    out = q_ptr + i.to(tl.int64) * C
    if SPAN > 0:
        tl.store(s_ptr + i, s, mask=tl.program_id(1) == 0)
        c_off = tl.program_id(1) * SPAN
        for cb in tl.static_range(0, SPAN, BLOCK_C):  # past the row's end: masked
            _chunk(row, out, c_off + cb, s, C, BLOCK_C, INTERPRET)
    else:
        tl.store(s_ptr + i, s)
        for c0 in range(0, C, BLOCK_C):
            _chunk(row, out, c0, s, C, BLOCK_C, INTERPRET)


@triton.jit
def _chunk(row, out, c0, s, C: tl.constexpr, BLOCK_C: tl.constexpr, INTERPRET: tl.constexpr):
    """Elements c0 .. c0 + BLOCK_C of a row: e4m3(x / s), saturating."""
    cols = c0 + tl.arange(0, BLOCK_C)
    m = cols < C
    x = tl.load(row + cols, mask=m, other=0.0).to(tl.float32)
    v = tl.math.div_rn(x, tl.zeros_like(x) + s)
    v = tl.minimum(tl.maximum(v, -448.0), 448.0)
    if C % 64 == 0:  # the unit order: q and s of element 16 q + 4 s + 2 a + b swapped
        e = cols % 64
        cols = cols - e + 16 * ((e // 4) % 4) + 4 * (e // 16) + e % 4
    tl.store(out + cols, to_e4m3(v, INTERPRET), mask=m)


def e4m3_rows(
    src: torch.Tensor,
    rows: int,
    *,
    pdl: bool = False,
    index: torch.Tensor | None = None,
    div: int = 1,
    count: torch.Tensor | None = None,
    poison: bool = False,
    split_rows: bool | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """float8_e4m3fn [rows, C] and fp32 scales [rows] of rows of ``src`` (bf16 [., C]),
    ``reference.e4m3_rows`` bit for bit, each row in the unit order where C is a multiple
    of 64 (``unit_order``). ``index`` / ``div`` gather source row
    ``index[r] // div``; ``count`` (a device scalar) limits the rows (those past it are
    left unwritten). ``split_rows``: a span of a row's chunks a program
    (``quantize.split_span``; None: up to ``SPLIT_ROWS`` rows); the same bits either way."""
    c = src.shape[1]
    dev = src.device
    q = empty((rows, c), torch.float8_e4m3fn, dev, poison)
    s = empty((rows,), torch.float32, dev, poison)
    if rows == 0:
        return q, s
    interp = interpreting()
    cap = 64 if interp else SPLIT_C
    block_c = min(triton.next_power_of_2(c), cap)
    few = (rows <= SPLIT_ROWS if split_rows is None else split_rows) and c > block_c
    span = split_span(rows, c, block_c) if few else 0
    grid = (rows, triton.cdiv(c, span)) if few else (rows,)
    launch(
        e4m3_rows_kernel, grid, pdl,
        src, index if index is not None else s, count if count is not None else s, rows, q, s,
        c, GATHER=index is not None, DIV=div, COUNT_FROM_PTR=count is not None,
        BLOCK_C=block_c, AMAX_C=min(triton.next_power_of_2(c), 64 if interp else 8192),
        SPAN=span, INTERPRET=interp, num_warps=4,
    )  # fmt: skip
    return q, s
