"""The portable grouped NVFP4 GEMM in Triton: FC1 (gather + SwiGLU epilogue) and FC2 (route
rows or fused finalize). It runs on any GPU Triton supports and in Triton's interpreter,
at any shape whose K is a multiple of 32; the Gluon kernels (``gluon_decode``,
``gluon_prefill``) compute the same sums on Hopper.

Orientation: every tile computes acc[BN, BM] = W[BN, BK] @ X^T[BK, BM] ("swap A and B"):
the weight tile, decoded in registers, is the MMA's register-side operand, and tokens
are the narrow dimension, so decode sizes (a handful of rows per expert) still fill a
tile of 64+ weight rows.

The main loop: K in fixed segments of ``SEGMENT`` (1024) elements, each segment's dot
chain summed from zero and the segment sums added in segment order, acc = ((0 + P_0) +
P_1) + ...; within a segment K is in the decode's unit order (``decode``). W4A8's
segments are ``FP8_GROUP`` K (FP8 dot chains from zero, the Gluon prefill kernel's sums).
With ``SPLIT`` one program a segment writes its fp32 partial P_s and the last program of a
tile to finish sums the partials in segment order: the same operations, so the same bits,
as the in-register sums. Every kernel family keeps this order, so the bits do not depend on
the kernel, the tile or the token count (batch invariance, docs/numerics.md).

Modes of the kernel: ``SPLIT`` (one K segment a program), ``REDUCE_ONLY`` (with SPLIT: a
Gluon kernel wrote the partials; this kernel sums them and runs the epilogue),
``W_DENSE`` (both operands decoded once a call by ``operands``, loaded instead of
decoded; with a grouped raster, ``GROUP_M``), ``OUT_FP4`` (FC1 of static W4A4 writes its
activation as NVFP4 with the expert's calibrated global).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..common import order_rows, pdl_wait_release, to_bf16, to_e4m3
from ..quantize import encode_e2m1
from .decode import decode_e4m3, decode_permuted
from .shapes import FP8_GROUP, SEGMENT, k_order, scale_rows_2d

__all__ = ["moe_gemm_kernel", "portable_gemm"]


@triton.jit
def _chunk_ptrs(a_ptr, a_scales_ptr, w_codes_ptr, w_scales_ptr, row_g, src,
                K: tl.constexpr, BK: tl.constexpr, A_FP4: tl.constexpr,
                W_DENSE: tl.constexpr, W_SROW: tl.constexpr):  # fmt: skip
    """Pointers of the first K tile for ``_chunk_tile``: weight codes and scales of the
    rows ``row_g`` (scale rows ``W_SROW`` bytes apart; W_DENSE: rows of decoded weights,
    ``operands.dense_weights``);
    activation codes and scales (W4A4) or bf16 rows (W4A16) of ``src`` (W_DENSE: rows of
    the activation operand already in the loop's order, decoded for W4A4)."""
    if W_DENSE:
        cw2 = w_codes_ptr + row_g[:, None] * K + tl.arange(0, BK)[None, :]
    else:
        # the code words (fields layout: each 32-bit word is decoded on its own)
        cw = w_codes_ptr.to(tl.pointer_type(tl.int32), bitcast=True)
        cw2 = cw + row_g[:, None] * (K // 8) + tl.arange(0, BK // 8)[None, :]
    sw2 = w_scales_ptr + row_g[:, None] * W_SROW + tl.arange(0, BK // 16)[None, :]
    if A_FP4 and not W_DENSE:
        ca2 = a_ptr + src[:, None] * (K // 2) + tl.arange(0, BK // 2)[None, :]
        sa2 = a_scales_ptr + src[:, None] * (K // 16) + tl.arange(0, BK // 16)[None, :]
        xp2 = ca2
    else:
        xp2 = a_ptr + src[:, None] * K + tl.arange(0, BK)[None, :]
        ca2 = xp2
        sa2 = xp2
    return cw2, sw2, xp2, ca2, sa2


@triton.jit
def _chunk_tile(
    kb, acc_g, acc_u, cw2, sw2, xp2, ca2, sa2, m_mask, n_mask,
    N: tl.constexpr, K: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
    GATED: tl.constexpr, A_FP4: tl.constexpr, DECODE_ASM: tl.constexpr, DOT_DTYPE: tl.constexpr,
    W_SROW: tl.constexpr, W_DENSE: tl.constexpr = False, ORDER: tl.constexpr = 32,
    A_FP8: tl.constexpr = False,
):  # fmt: skip
    """One K tile of the main loop: load, decode, dot. W_DENSE: both operand tiles are
    loaded already decoded and in the loop's order (the values ``decode_permuted`` and the
    register permutation give), so the dots see the same operands: the same bits. A_FP8
    (W4A8): e4m3 rows (stored in the unit order where ORDER is 64) and e4m3 weights in
    the same order, one FP8 dot (the caller chains them in groups of FP8_GROUP K)."""
    KW: tl.constexpr = K // 8  # the up rows' code words: N rows of K / 8 words on
    KS: tl.constexpr = W_SROW  # the up rows' scales: N rows of W_SROW bytes on
    if A_FP8:
        x8 = tl.trans(tl.load(xp2 + kb * BK, mask=m_mask[:, None], other=0.0).to(DOT_DTYPE))
        cg = tl.load(cw2 + kb * (BK // 8), mask=n_mask[:, None], other=0)
        sg = tl.load(sw2 + kb * (BK // 16), mask=n_mask[:, None], other=0.0)
        wg = decode_e4m3(cg, sg, BN, BK, DECODE_ASM, ORDER)
        acc_g = tl.dot(wg, x8, acc_g)
        if GATED:
            cu = tl.load(cw2 + N * KW + kb * (BK // 8), mask=n_mask[:, None], other=0)
            su = tl.load(sw2 + N * KS + kb * (BK // 16), mask=n_mask[:, None], other=0.0)
            wu = decode_e4m3(cu, su, BN, BK, DECODE_ASM, ORDER)
            acc_u = tl.dot(wu, x8, acc_u)
        return acc_g, acc_u
    if W_DENSE:  # the activation operand, already in the loop's order (and decoded)
        x = tl.trans(tl.load(xp2 + kb * BK, mask=m_mask[:, None], other=0.0))
    elif A_FP4:
        ac = tl.load(ca2 + kb * (BK // 2), mask=m_mask[:, None], other=0)
        asc = tl.load(sa2 + kb * (BK // 16), mask=m_mask[:, None], other=0.0)
        x = tl.trans(decode_permuted(ac, asc, BM, BK, DECODE_ASM, DOT_DTYPE, ORDER))
    else:  # contiguous rows, put in the loop's order in registers
        x = tl.load(xp2 + kb * BK, mask=m_mask[:, None], other=0.0).to(DOT_DTYPE)
        x = tl.trans(order_rows(x, BM, BK, ORDER))
    if W_DENSE:
        wg = tl.load(cw2 + kb * BK, mask=n_mask[:, None], other=0.0)
        acc_g = tl.dot(wg, x, acc_g)
        if GATED:
            wu = tl.load(cw2 + N * K + kb * BK, mask=n_mask[:, None], other=0.0)
            acc_u = tl.dot(wu, x, acc_u)
    else:
        cg = tl.load(cw2 + kb * (BK // 8), mask=n_mask[:, None], other=0)
        sg = tl.load(sw2 + kb * (BK // 16), mask=n_mask[:, None], other=0.0)
        wg = decode_permuted(cg, sg, BN, BK, DECODE_ASM, DOT_DTYPE, ORDER, FIELDS=True)
        acc_g = tl.dot(wg, x, acc_g)
        if GATED:
            cu = tl.load(cw2 + N * KW + kb * (BK // 8), mask=n_mask[:, None], other=0)
            su = tl.load(sw2 + N * KS + kb * (BK // 16), mask=n_mask[:, None], other=0.0)
            wu = decode_permuted(cu, su, BN, BK, DECODE_ASM, DOT_DTYPE, ORDER, FIELDS=True)
            acc_u = tl.dot(wu, x, acc_u)
    return acc_g, acc_u


@triton.jit
def _segment(
    first, NT: tl.constexpr, acc_g, acc_u, cw2, sw2, xp2, ca2, sa2, m_mask, n_mask,
    N: tl.constexpr, K: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
    GATED: tl.constexpr, A_FP4: tl.constexpr, DECODE_ASM: tl.constexpr, DOT_DTYPE: tl.constexpr,
    W_DENSE: tl.constexpr, ORDER: tl.constexpr, A_FP8: tl.constexpr, W_SROW: tl.constexpr,
):  # fmt: skip
    """One K segment in registers: NT tiles from tile ``first`` summed from zero (a
    constexpr trip count and no branch, which the software pipeliner needs), then added
    to the running sums."""
    pg = tl.zeros((BN, BM), dtype=tl.float32)
    pu = tl.zeros((BN, BM), dtype=tl.float32)
    for j in range(0, NT):
        pg, pu = _chunk_tile(
            first + j, pg, pu, cw2, sw2, xp2, ca2, sa2, m_mask, n_mask,
            N, K, BM, BN, BK, GATED, A_FP4, DECODE_ASM, DOT_DTYPE, W_SROW, W_DENSE, ORDER,
            A_FP8,
        )  # fmt: skip
    acc_g = acc_g + pg
    if GATED:
        acc_u = acc_u + pu
    return acc_g, acc_u


@triton.jit
def _block_rows(
    pid_m, block_start_ptr, block_end_ptr, sorted_routes_ptr, BM: tl.constexpr,
    TOPK: tl.constexpr, A_GATHER: tl.constexpr, FUSED: tl.constexpr,
):  # fmt: skip
    """Rows of row block ``pid_m``: sorted positions, their mask, their flat routes (read
    when gathered or fused; else the positions) and the activation rows they read."""
    start = tl.load(block_start_ptr + pid_m)
    end = tl.load(block_end_ptr + pid_m)
    offs_m = start + tl.arange(0, BM)
    m_mask = offs_m < end
    if A_GATHER or FUSED:
        route = tl.load(sorted_routes_ptr + offs_m, mask=m_mask, other=0)
    else:
        route = offs_m
    if A_GATHER:
        src = route // TOPK
    else:
        src = offs_m
    src = tl.where(m_mask, src, 0).to(tl.int64)
    return offs_m, m_mask, route, src


@triton.jit
def _split_unit(
    pid_m, pid_n, s_id, a_ptr, a_scales_ptr, a_global_ptr, sorted_routes_ptr, topk_w_ptr,
    w_codes_ptr, w_scales_ptr, w_global_ptr, out_ptr, out_scales_ptr, out_global_ptr,
    out_table_ptr, block_expert_ptr, block_start_ptr, block_end_ptr, part_ptr, cnt_ptr,
    ws_rows,
    N: tl.constexpr, K: tl.constexpr, TOPK: tl.constexpr, GATED: tl.constexpr,
    A_FP4: tl.constexpr, A_GATHER: tl.constexpr, FUSED: tl.constexpr,
    OUT_SCALE: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
    DOT_DTYPE: tl.constexpr, INTERPRET: tl.constexpr, DECODE_ASM: tl.constexpr,
    OUT_FP4: tl.constexpr, SEG_TILES: tl.constexpr, W_DENSE: tl.constexpr,
    REDUCE_ONLY: tl.constexpr, ORDER: tl.constexpr, W_SROW: tl.constexpr,
):  # fmt: skip
    """Split K, one unit: K segment ``s_id`` of the tile (row block ``pid_m``, weight rows
    ``pid_n``), a dot chain from zero written as the fp32 partial P_s; the last unit of a
    tile to finish sums the partials in segment order and runs the epilogue: the same
    operations, so the same bits, as the in-register loop's ((0 + P_0) + P_1) + ....
    REDUCE_ONLY: another kernel wrote every P_s (the Gluon split kernel)."""
    e64 = tl.load(block_expert_ptr + pid_m).to(tl.int64)
    offs_m, m_mask, route, src = _block_rows(
        pid_m, block_start_ptr, block_end_ptr, sorted_routes_ptr, BM, TOPK, A_GATHER, FUSED
    )
    offs_n = pid_n * BN + tl.arange(0, BN)
    n_mask = offs_n < N
    if GATED:
        gn: tl.constexpr = 2 * N
    else:
        gn: tl.constexpr = N
    KB: tl.constexpr = K // BK
    REM: tl.constexpr = KB % SEG_TILES
    NSEG: tl.constexpr = KB // SEG_TILES + (REM > 0)
    pmask = n_mask[:, None] & m_mask[None, :]
    prow = part_ptr + offs_m.to(tl.int64)[None, :] * gn + offs_n[:, None]
    stride = ws_rows.to(tl.int64) * gn
    last = True
    if not REDUCE_ONLY:
        cw2, sw2, xp2, ca2, sa2 = _chunk_ptrs(
            a_ptr, a_scales_ptr, w_codes_ptr, w_scales_ptr, e64 * gn + offs_n, src, K, BK,
            A_FP4, W_DENSE, W_SROW,
        )  # fmt: skip
        acc_g = tl.zeros((BN, BM), dtype=tl.float32)
        acc_u = tl.zeros((BN, BM), dtype=tl.float32)
        for j in range(0, SEG_TILES):
            kb = s_id * SEG_TILES + j
            if REM == 0:  # noqa: SIM114 (a constexpr: no runtime bound check when full)
                acc_g, acc_u = _chunk_tile(
                    kb, acc_g, acc_u, cw2, sw2, xp2, ca2, sa2, m_mask, n_mask,
                    N, K, BM, BN, BK, GATED, A_FP4, DECODE_ASM, DOT_DTYPE, W_SROW, W_DENSE,
                    ORDER,
                )  # fmt: skip
            elif kb < KB:
                acc_g, acc_u = _chunk_tile(
                    kb, acc_g, acc_u, cw2, sw2, xp2, ca2, sa2, m_mask, n_mask,
                    N, K, BM, BN, BK, GATED, A_FP4, DECODE_ASM, DOT_DTYPE, W_SROW, W_DENSE,
                    ORDER,
                )  # fmt: skip
        tl.store(prow + s_id * stride, acc_g, mask=pmask)
        if GATED:
            tl.store(prow + s_id * stride + N, acc_u, mask=pmask)
        tile = pid_m * tl.cdiv(N, BN) + pid_n
        done = tl.atomic_add(cnt_ptr + tile, 1, sem="acq_rel")
        last = done == NSEG - 1
        if last:
            tl.store(cnt_ptr + tile, 0)  # ready for the next call (and graph replay)
    if last:
        acc_g = tl.zeros((BN, BM), dtype=tl.float32)
        acc_u = tl.zeros((BN, BM), dtype=tl.float32)
        for sg_i in range(0, NSEG):  # .cg: other SMs wrote them; read from L2, not L1
            acc_g = acc_g + tl.load(
                prow + sg_i * stride, mask=pmask, other=0.0, cache_modifier=".cg"
            )
            if GATED:
                acc_u = acc_u + tl.load(
                    prow + sg_i * stride + N, mask=pmask, other=0.0, cache_modifier=".cg"
                )
        _epilogue(
            acc_g, acc_u, e64, offs_m, m_mask, route, src, offs_n, n_mask, pid_n,
            a_global_ptr, w_global_ptr, topk_w_ptr, out_ptr, out_scales_ptr, out_global_ptr,
            out_table_ptr, N, TOPK, GATED, A_FP4, FUSED, OUT_FP4, OUT_SCALE, BM, BN, INTERPRET,
        )  # fmt: skip


@triton.jit
def moe_gemm_kernel(
    a_ptr,  # bf16 [rows, K] or NVFP4 codes uint8 [rows, K/2]; W_DENSE: [rows, K] loop order
    a_scales_ptr,  # e4m3 [rows, K/16] (A_FP4)
    a_global_ptr,  # fp32 [rows] (A_FP4)
    sorted_routes_ptr,  # int32 [T*K]: sorted position -> flat route t*TOPK + k
    topk_w_ptr,  # fp32 [T*TOPK] (FUSED)
    w_codes_ptr,  # uint8 [E, W_ROWS, K/2]; W_DENSE: decoded [E, W_ROWS, K] (DOT_DTYPE)
    w_scales_ptr,  # e4m3 [E, W_ROWS, K/16], rows W_SROW bytes apart
    w_global_ptr,  # fp32 [E, W_GLOBALS]
    out_ptr,  # bf16 [rows, N] (sorted order), fp32 [T, N] (FUSED) or codes [rows, N/2] (OUT_FP4)
    out_scales_ptr,  # e4m3 [rows, N/16] (OUT_FP4)
    out_global_ptr,  # fp32 [rows] (OUT_FP4)
    out_table_ptr,  # fp32 [E]: the static global of the output per expert (OUT_FP4)
    block_expert_ptr,
    block_start_ptr,
    block_end_ptr,
    part_ptr,  # fp32 [segments, ws_rows, (2 if GATED) * N] segment partials (SPLIT)
    cnt_ptr,  # int32 [tiles]: segments finished per output tile, reset by the last (SPLIT)
    ws_rows,
    N: tl.constexpr,
    K: tl.constexpr,
    TOPK: tl.constexpr,
    GATED: tl.constexpr,
    A_FP4: tl.constexpr,
    A_GATHER: tl.constexpr,
    FUSED: tl.constexpr,
    OUT_SCALE: tl.constexpr,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    USE_PDL: tl.constexpr,
    INTERPRET: tl.constexpr,
    DECODE_ASM: tl.constexpr,
    OUT_FP4: tl.constexpr,
    SEG_TILES: tl.constexpr,
    SPLIT: tl.constexpr,
    W_DENSE: tl.constexpr,
    GROUP_M: tl.constexpr,
    REDUCE_ONLY: tl.constexpr,
    ORDER: tl.constexpr,
    BLOCKS_LAST: tl.constexpr,
    W_SROW: tl.constexpr,  # bytes between weight scale rows (K / 16, or padded)
    A_FP8: tl.constexpr = False,
):
    if GROUP_M:
        # One grid axis in groups of GROUP_M tile rows: consecutive programs sweep the
        # weight tiles of GROUP_M row blocks, so both the (dense) weight tiles and the
        # activation rows are reused from L2 instead of read again from HBM.
        NT: tl.constexpr = (N + BN - 1) // BN
        p = tl.program_id(0)
        num_m = tl.num_programs(0) // NT
        first_m = (p // (GROUP_M * NT)) * GROUP_M
        size_m = tl.minimum(num_m - first_m, GROUP_M)
        pid_m = first_m + (p % (GROUP_M * NT)) % size_m
        pid_n = (p % (GROUP_M * NT)) // size_m
    else:
        pid_n = tl.program_id(0)
        if BLOCKS_LAST:  # split K on a (tiles, segments, blocks) grid
            pid_m = tl.program_id(2)
        else:
            pid_m = tl.program_id(1)
    pdl_wait_release(USE_PDL)
    e = tl.load(block_expert_ptr + pid_m)
    if e < 0:
        return
    tl.static_assert(not (SPLIT and A_FP8), "W4A8 never splits K")
    if SPLIT:  # one K segment of one tile (0 with REDUCE_ONLY)
        if BLOCKS_LAST:
            s_id = tl.program_id(1)
        else:
            s_id = tl.program_id(2)
        _split_unit(
            pid_m, pid_n, s_id, a_ptr, a_scales_ptr, a_global_ptr,
            sorted_routes_ptr, topk_w_ptr, w_codes_ptr, w_scales_ptr, w_global_ptr, out_ptr,
            out_scales_ptr, out_global_ptr, out_table_ptr, block_expert_ptr, block_start_ptr,
            block_end_ptr, part_ptr, cnt_ptr, ws_rows, N, K, TOPK, GATED, A_FP4,
            A_GATHER, FUSED, OUT_SCALE, BM, BN, BK, DOT_DTYPE, INTERPRET, DECODE_ASM, OUT_FP4,
            SEG_TILES, W_DENSE, REDUCE_ONLY, ORDER, W_SROW,
        )  # fmt: skip
        return
    e64 = e.to(tl.int64)
    offs_m, m_mask, route, src = _block_rows(
        pid_m, block_start_ptr, block_end_ptr, sorted_routes_ptr, BM, TOPK, A_GATHER, FUSED
    )
    offs_n = pid_n * BN + tl.arange(0, BN)
    n_mask = offs_n < N
    if GATED:
        w_rows_total = 2 * N
    else:
        w_rows_total = N
    row_g = e64 * w_rows_total + offs_n
    acc_g = tl.zeros((BN, BM), dtype=tl.float32)
    acc_u = tl.zeros((BN, BM), dtype=tl.float32)  # (not GATED: unused)
    cw2, sw2, xp2, ca2, sa2 = _chunk_ptrs(
        a_ptr, a_scales_ptr, w_codes_ptr, w_scales_ptr, row_g, src, K, BK, A_FP4, W_DENSE,
        W_SROW,
    )  # fmt: skip
    KB: tl.constexpr = K // BK
    NFULL: tl.constexpr = KB // SEG_TILES  # full segments, then REM tiles in a last one
    REM: tl.constexpr = KB % SEG_TILES
    if not GATED:
        acc_u = acc_g
    # Full segments, then the REM tiles of a last one: constexpr trip counts and no
    # branch in the inner loop, which the software pipeliner needs (a `kb < KB` test
    # there cost 15% to 30% at prefill sizes on the H200).
    for sg_i in range(0, NFULL):
        acc_g, acc_u = _segment(
            sg_i * SEG_TILES, SEG_TILES, acc_g, acc_u, cw2, sw2, xp2, ca2, sa2,
            m_mask, n_mask, N, K, BM, BN, BK, GATED, A_FP4, DECODE_ASM, DOT_DTYPE,
            W_DENSE, ORDER, A_FP8, W_SROW,
        )  # fmt: skip
    if REM > 0:
        acc_g, acc_u = _segment(
            NFULL * SEG_TILES, REM, acc_g, acc_u, cw2, sw2, xp2, ca2, sa2,
            m_mask, n_mask, N, K, BM, BN, BK, GATED, A_FP4, DECODE_ASM, DOT_DTYPE,
            W_DENSE, ORDER, A_FP8, W_SROW,
        )  # fmt: skip
    _epilogue(
        acc_g, acc_u, e64, offs_m, m_mask, route, src, offs_n, n_mask, pid_n,
        a_global_ptr, w_global_ptr, topk_w_ptr, out_ptr, out_scales_ptr, out_global_ptr,
        out_table_ptr, N, TOPK, GATED, A_FP4 or A_FP8, FUSED, OUT_FP4, OUT_SCALE, BM, BN,
        INTERPRET,
    )  # fmt: skip


@triton.jit
def _epilogue(
    acc_g, acc_u, e64, offs_m, m_mask, route, src, offs_n, n_mask, pid_n,
    a_global_ptr, w_global_ptr, topk_w_ptr, out_ptr, out_scales_ptr, out_global_ptr,
    out_table_ptr,
    N: tl.constexpr, TOPK: tl.constexpr, GATED: tl.constexpr, A_FP4: tl.constexpr,
    FUSED: tl.constexpr, OUT_FP4: tl.constexpr, OUT_SCALE: tl.constexpr, BM: tl.constexpr,
    BN: tl.constexpr, INTERPRET: tl.constexpr,
):  # fmt: skip
    """The output of one tile [BN, BM] from its fp32 sums: global scales, SwiGLU (FC1),
    then bf16 rows, NVFP4 rows (OUT_FP4) or the router-weighted atomic add (FUSED)."""
    # h = acc * g_x * g_w (docs/numerics.md), after undoing the decodes' powers of two
    h = acc_g * OUT_SCALE
    if A_FP4:
        gx = tl.load(a_global_ptr + src, mask=m_mask, other=1.0)
        h = h * gx[None, :]
    if GATED:
        h = h * tl.load(w_global_ptr + e64 * 2)
        hu = acc_u * OUT_SCALE
        if A_FP4:
            hu = hu * gx[None, :]
        hu = hu * tl.load(w_global_ptr + e64 * 2 + 1)
        res = (h / (1.0 + tl.exp(-h))) * hu
    else:
        res = h * tl.load(w_global_ptr + e64)
    y = to_bf16(res, INTERPRET)
    mask = n_mask[:, None] & m_mask[None, :]
    if FUSED:
        tok = (route // TOPK).to(tl.int64)
        wt = tl.load(topk_w_ptr + route, mask=m_mask, other=0.0)
        contrib = y.to(tl.float32) * wt[None, :]
        tl.atomic_add(
            out_ptr + tok[None, :] * N + offs_n[:, None], contrib, mask=mask, sem="relaxed"
        )
    elif OUT_FP4:
        # FC1 for static W4A4: quantize the bf16 activation tile straight to NVFP4 with the
        # expert's calibrated global (the float operations of quantize.py): blocks of 16
        # along N, so a tile of BN columns holds BN // 16 whole blocks.
        g = tl.load(out_table_ptr + e64)
        blk = tl.reshape(y.to(tl.float32), (BN // 16, 16, BM))
        amax = tl.max(tl.abs(blk), axis=1)  # [BN // 16, BM]
        s = tl.minimum(tl.math.div_rn(amax, tl.zeros_like(amax) + 6.0 * g), 448.0)
        s8 = to_e4m3(s, INTERPRET)
        denom = s8.to(tl.float32) * g
        safe = tl.where(denom == 0.0, 1.0, denom)
        v = tl.math.div_rn(blk, tl.broadcast_to(safe[:, None, :], (BN // 16, 16, BM)))
        code = tl.where((denom == 0.0)[:, None, :], 0, encode_e2m1(v)).to(tl.uint8)
        pairs = tl.permute(tl.reshape(code, (BN // 2, 2, BM)), (0, 2, 1))  # [BN/2, BM, 2]
        lo, hi = tl.split(pairs)
        rows64 = offs_m.to(tl.int64)[None, :]
        pc = pid_n * (BN // 2) + tl.arange(0, BN // 2)
        tl.store(out_ptr + rows64 * (N // 2) + pc[:, None], lo | (hi << 4),
                 mask=(pc < N // 2)[:, None] & m_mask[None, :])  # fmt: skip
        ps = pid_n * (BN // 16) + tl.arange(0, BN // 16)
        tl.store(out_scales_ptr + rows64 * (N // 16) + ps[:, None], s8,
                 mask=(ps < N // 16)[:, None] & m_mask[None, :])  # fmt: skip
        if pid_n == 0:
            tl.store(out_global_ptr + offs_m, tl.zeros_like(offs_m).to(tl.float32) + g, mask=m_mask)
    else:
        tl.store(out_ptr + offs_m.to(tl.int64)[None, :] * N + offs_n[:, None], y, mask=mask)


def _segment_tiles(bk: int, a_fp8: bool) -> int:
    """K tiles of a segment (each summed from zero, then added to the running sums):
    ``SEGMENT`` K, or W4A8's ``FP8_GROUP`` K (its FP8 dot chains) with at least one tile."""
    return max(FP8_GROUP // bk, 1) if a_fp8 else SEGMENT // bk


def portable_gemm(
    a, a_scales, a_global, sorted_routes, topk_w, w_codes, w_scales, w_global, out,
    block_expert, block_start, block_end, *,
    n: int, k: int, topk: int, gated: bool, a_gather: bool, fused: bool, pdl: bool,
    tile: tuple[int, int, int, int, int], split: bool = False, dense: bool = False,
    reduce_only: bool = False, part=None, counters=None, ws_rows: int = 0, out_fp4=None,
    interpret: bool = False,
) -> None:  # fmt: skip
    """Launch ``moe_gemm_kernel`` on the schedule of ``sort_routes`` (``block_*``).

    ``tile`` = (block_m, block_n, block_k, num_warps, num_stages); block_m is the
    schedule's rows a block. ``a``: bf16 [rows, K] (gathered by route // topk with
    ``a_gather``, else sorted rows), or W4A4 NVFP4 codes with ``a_scales`` e4m3 and
    ``a_global`` fp32 per row; with ``dense`` the activation rows and the weights
    (``w_codes``) are the decoded operands of ``operands.dense_rows`` / ``dense_weights``
    in the loop's order. ``out``: bf16 route rows [rows, n] in sorted order, fp32 [T, n]
    with ``fused`` (router weight ``topk_w`` times y added atomically), or with
    ``out_fp4`` = (scales, globals, static table) NVFP4 codes. ``split``: one program a K
    segment with fp32 ``part`` [segments, ws_rows, (2 if gated) * n] and int32 zero
    ``counters`` (one a tile, left at zero); ``reduce_only`` (with ``split``): the
    partials are written already and this launch sums them and runs the epilogue."""
    bm, bn, bk, warps, stages = tile
    a_fp4 = a_scales is not None
    a_fp8 = a.dtype == torch.float8_e4m3fn
    if not scale_rows_2d(w_scales):  # rows any number of bytes apart, else a copy
        w_scales = w_scales.contiguous()
    order = k_order(k, bk)
    decode_asm = not interpret
    dot = tl.float32 if interpret else tl.float8e4nv if a_fp8 else tl.bfloat16
    # each decoded NVFP4 operand carries 2^-8; W4A8's weights carry 1/8
    out_scale = 8.0 if a_fp8 else 2.0**16 if a_fp4 else 2.0**8
    blocks = block_expert.numel()
    grid = (triton.cdiv(n, bn), blocks)
    group_m = 8 if dense else 0  # dense tiles: grouped raster for L2 reuse
    if group_m:
        grid = (grid[0] * grid[1], 1)
    seg_tiles = _segment_tiles(bk, a_fp8)
    nseg = -(-(k // bk) // seg_tiles)
    dummy = w_global
    blocks_last = split and not reduce_only and not group_m
    if split and not reduce_only:  # blocks last: every valid unit before the empty blocks
        grid = (grid[0], nseg, grid[1]) if blocks_last else (*grid, nseg)
    args = (
        a, a_scales if a_fp4 else dummy, a_global if a_fp4 or a_fp8 else dummy, sorted_routes,
        topk_w,
        w_codes, w_scales, w_global, out,
        *(out_fp4 if out_fp4 is not None else (dummy, dummy, dummy)),
        block_expert, block_start, block_end,
        part if part is not None else dummy, counters if counters is not None else dummy,
        ws_rows, n, k,
    )  # fmt: skip
    kw = dict(
        TOPK=topk, GATED=gated, A_FP4=a_fp4, A_GATHER=a_gather, FUSED=fused,
        OUT_SCALE=out_scale, BM=bm, BN=bn, BK=bk, DOT_DTYPE=dot, INTERPRET=interpret,
        DECODE_ASM=decode_asm, OUT_FP4=out_fp4 is not None, SEG_TILES=seg_tiles, SPLIT=split,
        W_DENSE=dense, GROUP_M=group_m, REDUCE_ONLY=reduce_only, ORDER=order,
        BLOCKS_LAST=blocks_last, W_SROW=w_scales.stride(1), A_FP8=a_fp8,
        num_warps=warps, num_stages=stages,
    )  # fmt: skip
    if pdl:
        kw["launch_pdl"] = True
    moe_gemm_kernel[grid](*args, USE_PDL=pdl, **kw)


def compile_sm90(
    *, n: int, k: int, gated: bool, tile: tuple[int, int, int, int, int], a_fp4: bool = False,
    a_gather: bool = True, fused: bool = False, split: bool = False, dense: bool = False,
    reduce_only: bool = False, out_fp4: bool = False, pdl: bool = True, a_fp8: bool = False,
):  # fmt: skip
    """Compile the ``moe_gemm_kernel`` specialization ``portable_gemm`` launches for these
    arguments, for sm_90 without a GPU (``common.compile_sm90``)."""
    from ..common import compile_sm90 as common_compile_sm90

    bm, bn, bk, warps, stages = tile
    ptrs = {
        "a_ptr": "*fp8e4nv" if a_fp8 else "*u8" if a_fp4 and not dense else "*bf16",
        "a_scales_ptr": "*fp8e4nv",
        "a_global_ptr": "*fp32", "sorted_routes_ptr": "*i32", "topk_w_ptr": "*fp32",
        "w_codes_ptr": "*bf16" if dense else "*u8", "w_scales_ptr": "*fp8e4nv",
        "w_global_ptr": "*fp32",
        "out_ptr": "*fp32" if fused else "*u8" if out_fp4 else "*bf16",
        "out_scales_ptr": "*fp8e4nv", "out_global_ptr": "*fp32", "out_table_ptr": "*fp32",
        "block_expert_ptr": "*i32", "block_start_ptr": "*i32", "block_end_ptr": "*i32",
        "part_ptr": "*fp32", "cnt_ptr": "*i32",
    }  # fmt: skip
    const = dict(
        N=n, K=k, TOPK=8, GATED=gated, A_FP4=a_fp4, A_GATHER=a_gather, FUSED=fused,
        OUT_SCALE=8.0 if a_fp8 else 2.0**16 if a_fp4 else 2.0**8, BM=bm, BN=bn, BK=bk,
        DOT_DTYPE=tl.float8e4nv if a_fp8 else tl.bfloat16,
        USE_PDL=pdl, INTERPRET=False, DECODE_ASM=True, OUT_FP4=out_fp4,
        SEG_TILES=_segment_tiles(bk, a_fp8), SPLIT=split, W_DENSE=dense, GROUP_M=8 if dense else 0,
        REDUCE_ONLY=reduce_only, ORDER=k_order(k, bk),
        BLOCKS_LAST=split and not reduce_only and not dense, W_SROW=k // 16, A_FP8=a_fp8,
    )  # fmt: skip
    return common_compile_sm90(moe_gemm_kernel, ptrs, const, ints=("ws_rows",),
                               num_warps=warps, num_stages=stages)  # fmt: skip
