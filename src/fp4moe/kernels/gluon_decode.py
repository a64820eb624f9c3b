"""Loop 3's split-K segment partials in Gluon (explicit layouts): the layouts, decode and
staging that ``gluon_ws`` (the default Gluon GEMMs) shares, and the older partials kernel
(``KERNEL = "pointer"``, codes loaded from global memory; slower than ``gluon_ws``).

With ``KERNEL = "pointer"``, ``TritonOptions.gluon_decode`` (W4A16 calls that split K)
computes the fp32 partials P_s here; the split kernel (``moe_gemm_kernel(REDUCE_ONLY=True)``)
then sums them and runs the epilogue. Same operands, order and sums as loop 3's split
programs: the same bits (``test_gluon_decode_gpu``, on the H200).

The codes are loaded straight into the wgmma register fragment's own layout (``_CL``);
every layout conversion is asserted trivial when compiling:

- the weights are the wgmma A operand (64 rows a warpgroup, from registers); lane
  ``4 i + q`` of warp ``w`` holds rows ``16 w + i`` and ``16 w + i + 8``;
- loop 3's unit order (``launch.k_order``): thread ``q`` loads the 8 code bytes
  ``8 q .. 8 q + 7`` of a row's 32-byte unit (one 8-byte load: elements ``16 q ..
  16 q + 15``, one scale block); the decode asm's 8 output registers are its fragment
  registers of the unit's four k16 steps;
- the activations (wgmma B) go through shared memory in the same order, staged by each
  program.

Measured (docs/perf-notes.md, session 6): with 8-row tiles its partials were 12% to 25%
faster than loop 3's split GEMM in the chunk order; loop 3 itself in the unit order
compiles to 3.7 instructions a weight (5.6 before), which this kernel must now beat.
"""

from __future__ import annotations

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from .common import compile_sm90 as common_compile_sm90
from .gemm import _CHUNK_DECODE_ASM

ASYNC_WGMMA = False  # split_partials' default for the asynchronous main loop
# split_partials' kernel: "pointer" (gluon_split_kernel: the codes loaded from global memory
# two units ahead) or "tma" (gluon_ws.tma_split_kernel: the segment's weights fetched by TMA
# at the program's start); the same bits
KERNEL = "tma"
UNIT = gl.constexpr(64)  # K elements a main-loop step (two chunks, four k16 wgmma steps)


# The codes of one unit ([64 rows, 32 bytes]): registers hold 8 consecutive bytes of a
# row (bytes 8 q .. 8 q + 7: elements 16 q .. 16 q + 15, one scale block) and of the row 8
# below; lane 4 i + q holds row i; warps 16 rows each.
_CL = gl.constexpr(
    gl.DistributedLinearLayout(
        reg_bases=[[0, 1], [0, 2], [0, 4], [8, 0]],
        lane_bases=[[0, 8], [0, 16], [1, 0], [2, 0], [4, 0]],
        warp_bases=[[16, 0], [32, 0]],
        block_bases=[],
        shape=[64, 32],
    )
)
# The same as [64 rows, 4 blocks (q), 8 bytes], whose slice along the bytes is the layout
# of the unit's [64, 4] scales (one scale a thread and row).
_L3 = gl.constexpr(
    gl.DistributedLinearLayout(
        reg_bases=[[0, 0, 1], [0, 0, 2], [0, 0, 4], [8, 0, 0]],
        lane_bases=[[0, 1, 0], [0, 2, 0], [1, 0, 0], [2, 0, 0], [4, 0, 0]],
        warp_bases=[[16, 0, 0], [32, 0, 0]],
        block_bases=[],
        shape=[64, 4, 8],
    )
)


@gluon.jit
def _load_unit(cw, sw, kb, n_mask, s_mask):
    """The codes [64, 4, 8] and e4m3 scales [64, 4] of unit ``kb``."""
    codes = gl.load(cw + kb * (UNIT // 2), mask=n_mask, other=0)
    sc = gl.load(sw + kb * (UNIT // 16), mask=s_mask, other=0.0)
    return codes, sc


@gluon.jit
def _decode_unit(codes, sc, A_L: gl.constexpr):
    """Decode one unit ([64 rows, 64 K]) of weights into the wgmma A fragment."""
    sb = (sc.to(gl.float32) * 3.32306998946229e35).to(gl.bfloat16)
    sb, codes = gl.broadcast(gl.expand_dims(sb, 2), codes)
    codes = gl.convert_layout(gl.reshape(codes, [64, 32]), _CL, assert_trivial=True)
    sb = gl.convert_layout(gl.reshape(sb, [64, 32]), _CL, assert_trivial=True)
    # loop 3's decode (the same operations and bits): 8 code bytes and their scales (bf16
    # times 2^118) to 8 low-nibble and 8 high-nibble values times 2^-8, bf16 pairs
    lo, hi = gl.inline_asm_elementwise(
        _CHUNK_DECODE_ASM, "=r,=r,=r,=r,=r,=r,=r,=r,r,r,r,r,r,r", [codes, sb],
        dtype=(gl.bfloat16, gl.bfloat16), is_pure=True, pack=8,
    )  # fmt: skip
    # byte 8 q + 2 s + a, nibble b holds element 16 q + 4 s + 2 a + b, at position
    # 16 s + 8 b + 2 q + a of the unit order
    w = gl.join(lo, hi)  # [64, 32 bytes (q, s, a), 2 (b)]
    w = gl.reshape(w, [64, 4, 4, 2, 2])  # [row, q, s, a, b]
    w = gl.permute(w, [0, 2, 4, 1, 3])  # [row, s, b, q, a]
    w = gl.reshape(w, [64, UNIT])
    return gl.convert_layout(w, A_L, assert_trivial=True)


@gluon.jit
def _stage_x(x_ptr, sorted_routes_ptr, start, end, k0, K: gl.constexpr, TOPK: gl.constexpr,
             A_GATHER: gl.constexpr, BM: gl.constexpr, SEG: gl.constexpr,
             A_UNIT_ORDER: gl.constexpr = False):  # fmt: skip
    """The row block's activations of one K segment in the unit order, in shared memory
    [SEG / 64 * BM, 64] (unit-major), fenced and synchronized for the wgmma: rows
    ``start`` .. ``end`` (A_GATHER: tokens route // TOPK of the sorted routes), zeros past
    ``end``; A_UNIT_ORDER: the rows are in the unit order already (only unit-major)."""
    NU: gl.constexpr = SEG // UNIT
    XM: gl.constexpr = gl.BlockedLayout([1, 8], [2, 16], [4, 1], [1, 0])
    offs_m = start + gl.arange(0, BM, layout=gl.SliceLayout(1, XM))
    m_ok = offs_m < end
    if A_GATHER:
        route = gl.load(sorted_routes_ptr + offs_m, mask=m_ok, other=0)
        src = route // TOPK
    else:
        src = offs_m
    src = gl.where(m_ok, src, 0).to(gl.int64)
    kk = gl.arange(0, SEG, layout=gl.SliceLayout(0, XM))
    x = gl.load(x_ptr + src[:, None] * K + k0 + kk[None, :], mask=m_ok[:, None], other=0.0)
    if A_UNIT_ORDER:  # [m, unit, 64] -> [unit, m, 64]
        x = gl.permute(gl.reshape(x, [BM, NU, UNIT]), [1, 0, 2])
    else:
        x = gl.reshape(x, [BM, NU, 4, 4, 2, 2])  # [m, unit, q, s, a, b]
        x = gl.permute(x, [1, 0, 3, 5, 2, 4])  # [unit, m, s, b, q, a]
    x = gl.reshape(x, [NU * BM, UNIT])
    XS: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BM, UNIT], gl.bfloat16)
    xs = gl.allocate_shared_memory(gl.bfloat16, [NU * BM, UNIT], XS)
    xs.store(x)
    fence_async_shared()
    gl.thread_barrier()
    return xs


@gluon.jit
def _store_partials(acc_g, acc_u, part_ptr, pid_n, start, end, s_id, ws_rows,
                    N: gl.constexpr, GATED: gl.constexpr, BM: gl.constexpr,
                    MMA: gl.constexpr):  # fmt: skip
    """Write a unit's fp32 partials [64, BM] (and up's, GATED) as loop 3's split programs
    do: segment ``s_id`` of ``part`` [segments, ws_rows, (2 if GATED) * N], valid rows
    only. Returns the segment stride (elements)."""
    if GATED:
        gn: gl.constexpr = 2 * N
    else:
        gn: gl.constexpr = N
    on = pid_n * 64 + gl.arange(0, 64, layout=gl.SliceLayout(1, MMA))
    om = start + gl.arange(0, BM, layout=gl.SliceLayout(0, MMA))
    pmask = (on < N)[:, None] & (om < end)[None, :]
    stride = ws_rows.to(gl.int64) * gn
    prow = part_ptr + s_id * stride + om.to(gl.int64)[None, :] * gn + on[:, None]
    gl.store(prow, acc_g, mask=pmask)
    if GATED:
        gl.store(prow + N, acc_u, mask=pmask)
    return stride


@gluon.jit
def gluon_split_kernel(
    x_ptr,  # bf16 [rows, K]: FC1 the tokens (gathered by route // TOPK), FC2 sorted rows
    sorted_routes_ptr,  # int32 [T*TOPK]
    w_codes_ptr,  # uint8 [E, W_ROWS, K/2]
    w_scales_ptr,  # e4m3 [E, W_ROWS, K/16]
    block_expert_ptr,
    block_start_ptr,
    block_end_ptr,
    part_ptr,  # fp32 [segments, ws_rows, (2 if GATED) * N]
    ws_rows,
    N: gl.constexpr,
    K: gl.constexpr,
    TOPK: gl.constexpr,
    GATED: gl.constexpr,
    A_GATHER: gl.constexpr,
    BM: gl.constexpr,  # rows (tokens) a tile: the wgmma N (8 or 16)
    SEG: gl.constexpr,  # K elements a segment (1024)
    ASYNC: gl.constexpr = False,  # asynchronous wgmma (see the main loop)
):
    pid_n = gl.program_id(0)
    pid_m = gl.program_id(1)
    s_id = gl.program_id(2)
    e = gl.load(block_expert_ptr + pid_m)
    if e >= 0:
        start = gl.load(block_start_ptr + pid_m)
        end = gl.load(block_end_ptr + pid_m)
        e64 = e.to(gl.int64)
        NU: gl.constexpr = SEG // UNIT
        k0 = s_id * SEG

        # ---- activations of the segment, in unit order, into shared memory [NU * BM, 64]
        xs = _stage_x(x_ptr, sorted_routes_ptr, start, end, k0, K, TOPK, A_GATHER, BM, SEG)

        # ---- weights: rows pid_n * 64 .. + 64 of the expert (gate, and up if GATED)
        MMA: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BM, 16]
        )
        A_L: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=MMA, k_width=2)
        L3: gl.constexpr = _L3
        r1 = gl.arange(0, 64, layout=gl.SliceLayout(1, gl.SliceLayout(2, L3)))
        b1 = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(2, L3)))  # q
        j1 = gl.arange(0, 8, layout=gl.SliceLayout(0, gl.SliceLayout(1, L3)))
        n = pid_n * 64 + r1
        if GATED:
            w_rows = 2 * N
        else:
            w_rows = N
        row2 = gl.expand_dims((e64 * w_rows + n).to(gl.int64), 1)  # [64, 1]
        b2 = gl.expand_dims(b1, 0)  # [1, 4]: the scale block (16 elements) in the unit
        s_mask = gl.expand_dims(n < N, 1) & (b2 >= 0)  # [64, 4]
        sw = w_scales_ptr + row2 * (K // 16) + k0 // 16 + b2  # [64, 4]
        j3 = gl.expand_dims(gl.expand_dims(j1, 0), 1)  # [1, 1, 8]
        cw = w_codes_ptr + gl.expand_dims(row2 * (K // 2) + k0 // 2 + b2 * 8, 2) + j3
        n_mask = gl.expand_dims(s_mask, 2) & (j3 >= 0)  # [64, 4, 8]
        acc_g = gl.zeros([64, BM], gl.float32, layout=MMA)
        acc_u = gl.zeros([64, BM], gl.float32, layout=MMA)
        # Register prefetch two units ahead (the loop is unrolled): the loads of units
        # kb + 1 and kb + 2 are in flight while unit kb is decoded and multiplied.
        cu_ = cw + N * (K // 2)
        su_ = sw + N * (K // 16)
        g0c, g0s = _load_unit(cw, sw, 0, n_mask, s_mask)
        g1c, g1s = _load_unit(cw, sw, 1, n_mask, s_mask)
        if GATED:
            u0c, u0s = _load_unit(cu_, su_, 0, n_mask, s_mask)
            u1c, u1s = _load_unit(cu_, su_, 1, n_mask, s_mask)
        for kb in gl.static_range(NU):
            gc, gs = g0c, g0s
            g0c, g0s = g1c, g1s
            if kb + 2 < NU:
                g1c, g1s = _load_unit(cw, sw, kb + 2, n_mask, s_mask)
            if GATED:
                uc, us = u0c, u0s
                u0c, u0s = u1c, u1s
                if kb + 2 < NU:
                    u1c, u1s = _load_unit(cu_, su_, kb + 2, n_mask, s_mask)
            xb = xs.slice(kb * BM, BM).permute((1, 0))
            # Asynchronous wgmma: the next unit's decode overlaps this unit's MMAs; the
            # wait keeps at most one unit's MMAs (and their A registers) in flight.
            wg = _decode_unit(gc, gs, A_L)
            if ASYNC:
                if kb > 0:
                    if GATED:
                        acc_g, acc_u, _, _ = warpgroup_mma_wait(
                            num_outstanding=0,
                            deps=(acc_g, acc_u, pg, pu),  # noqa: F821 (set last unit)
                        )
                    else:
                        acc_g, _ = warpgroup_mma_wait(num_outstanding=0, deps=(acc_g, pg))  # noqa: F821
                acc_g = warpgroup_mma(wg, xb, acc_g, is_async=True)
                pg = wg  # noqa: F841 (read by the next unrolled unit)
                if GATED:
                    wu = _decode_unit(uc, us, A_L)
                    acc_u = warpgroup_mma(wu, xb, acc_u, is_async=True)
                    pu = wu  # noqa: F841
            else:
                acc_g = warpgroup_mma(wg, xb, acc_g)
                if GATED:
                    acc_u = warpgroup_mma(_decode_unit(uc, us, A_L), xb, acc_u)
        if ASYNC:
            if GATED:
                acc_g, acc_u = warpgroup_mma_wait(num_outstanding=0, deps=(acc_g, acc_u))
            else:
                acc_g = warpgroup_mma_wait(num_outstanding=0, deps=(acc_g,))

        # ---- partials, as loop 3's split programs write them
        _store_partials(acc_g, acc_u, part_ptr, pid_n, start, end, s_id, ws_rows, N, GATED,
                        BM, MMA)  # fmt: skip


def split_partials(
    x: torch.Tensor,
    sorted_routes: torch.Tensor,
    codes: torch.Tensor,
    scales: torch.Tensor,
    block_expert: torch.Tensor,
    block_start: torch.Tensor,
    block_end: torch.Tensor,
    part: torch.Tensor,
    *,
    n: int,
    topk: int,
    gated: bool,
    gather: bool,
    block_m: int,
    ws_rows: int,
    seg: int = 1024,
    asynchronous: bool | None = None,
) -> None:
    """Launch ``gluon_split_kernel``: fp32 ``part`` [K / seg, ws_rows, (2 if gated) * n]
    (or flat) receives loop 3's segment partials P_s of every valid row.

    Args:
        x: bf16 [., K]: the tokens (``gather``: row route // topk) or rows in sorted order.
        codes, scales: one GEMM's weights, uint8 [E, W_ROWS, K/2] and e4m3 [E, W_ROWS, K/16].
        block_expert, block_start, block_end: the tile schedule of ``sort_routes`` with
            ``block_m`` (8 or 16) rows a tile.
    """
    k = x.shape[1]
    if KERNEL == "tma":  # (its own default main loop: gluon_ws.ASYNC_WGMMA)
        from .gluon_ws import split_partials_tma

        split_partials_tma(
            x, sorted_routes, codes, scales, block_expert, block_start, block_end, part,
            n=n, topk=topk, gated=gated, gather=gather, block_m=block_m, ws_rows=ws_rows,
            seg=seg, asynchronous=asynchronous,
        )  # fmt: skip
        return
    if KERNEL != "pointer":
        raise ValueError(f"gluon_decode.KERNEL: expected 'pointer' or 'tma', got {KERNEL!r}")
    if asynchronous is None:
        asynchronous = ASYNC_WGMMA
    if k % seg or block_m not in (8, 16):
        raise ValueError(f"split_partials: needs K % {seg} == 0 and block_m 8 or 16")
    grid = (triton.cdiv(n, 64), block_expert.numel(), k // seg)
    gluon_split_kernel[grid](
        x, sorted_routes, codes, scales, block_expert, block_start, block_end, part,
        ws_rows, N=n, K=k, TOPK=topk, GATED=gated, A_GATHER=gather, BM=block_m,
        SEG=seg, ASYNC=asynchronous, num_warps=4,
    )  # fmt: skip


def compile_sm90(*, n: int, k: int, gated: bool, block_m: int, asynchronous: bool = False):
    """Compile one specialization for sm_90 without a GPU (``common.compile_sm90``): the
    layout conversions are asserted trivial at compile time. Returns the compiled kernel."""
    ptrs = {
        "x_ptr": "*bf16", "sorted_routes_ptr": "*i32", "w_codes_ptr": "*u8",
        "w_scales_ptr": "*fp8e4nv", "block_expert_ptr": "*i32", "block_start_ptr": "*i32",
        "block_end_ptr": "*i32", "part_ptr": "*fp32",
    }  # fmt: skip
    const = dict(N=n, K=k, TOPK=8, GATED=gated, A_GATHER=gated, BM=block_m, SEG=1024,
                 ASYNC=asynchronous)  # fmt: skip
    return common_compile_sm90(
        gluon_split_kernel, ptrs, const, ints=("ws_rows",), gluon=True, num_warps=4
    )
