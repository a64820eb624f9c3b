"""The prefill grouped GEMMs in Gluon (Hopper): the weights decoded in registers straight
into the wgmma A fragment, 32, 64 or 128 token rows a tile, the whole K in one program, with
the portable loop's operands, order and sums (``gluon-prefill``).

Decoding every expert's weights to bf16 in HBM once a call and running a bf16 GEMM on
them (the portable decoded-weights path) costs DeepSeek-V3 EP8 at 8192 tokens 1.07 ms of
a 3.6 ms call on the H200 (0.79 GB read, 2.8 GB written, 2.8 GB read again). Here each
program decodes its weight tile once for 128 rows, in registers: no decoded weight
touches HBM (the call takes 2.3 ms).

A program (8 warps, two warpgroups) owns a weight tile of 128 rows and one block of the
tile schedule (``sort_routes`` with ``block_m`` 32, 64 or 128: the wgmma N; with 32 or 64
two programs share an SM, 128 registers a thread), persistent over the tiles of the valid
blocks in a grouped raster (``GROUP`` blocks sweep the weight tiles together, so
their activation rows stay in L2). With each expert's rows in tiles of its own size
(``sort_routes(mixed=True)``), one launch a tile rows, the three overlapping (``chain``:
programmatic dependent launch). FC1's 128 rows are 64 gate rows and the 64 up rows of
the same outputs (warpgroup 0 and 1), FC2's 128 consecutive rows. A ring of ``STAGES``
stages of 256 K in shared memory holds, per stage, the activation rows (one TMA box [4
units, block rows, 64] of rows already in sorted and unit order,
``dense_rows(order=64)``), the codes (one copy: FC2's [128, 128-byte] box, FC1's gate and
up rows as a [2, 64, 128-byte] box; 128-byte swizzle) and the scales (alike, 16 bytes a
row; pointer loads a stage ahead instead where TMA cannot copy them,
``shapes.scale_rows_tma``). K is a multiple of 64:
the last segment and its last stage may be partial (the copies read zeros past K and the
missing units are skipped), and FC2's last weight tile may pass N (its rows masked).
On 128-row tiles each half of a 64-K unit (two k16 steps, ``gluon_common.decode_half``) is
one wgmma group, and the wait before a half's decode leaves the last group in flight: the
decode runs beside it and the tensor cores' queue never drains (two half fragments live).
On 32 and 64-row tiles each unit is decoded whole (``decode_unit``) and its wgmmas wait
for the last unit's: at 128 registers a thread ptxas places that wait before the decode,
and the SM's other three warpgroups fill the gap. A stage's buffer is refilled once every
wgmma reading it is done, right after the next stage's first wgmma issues (the tensor
cores run while the copies are issued; W4A8 just before it). A 1024-K segment's sum starts
from zero and is added to the tile's running sums in segment order, ((0 + P_0) + P_1) +
...: the same bits as the portable loop. The epilogue (the portable epilogue's operations)
goes through shared memory, where gate and up of one output meet.
"""

from __future__ import annotations

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from ..common import compile_sm90 as common_compile_sm90
from . import shapes
from .gluon_common import (
    CODE_SMEM,
    CODE_SMEM3,
    SCALE_SMEM,
    SCALE_SMEM3,
    UNIT,
    X_SMEM3,
    decode_half,
    decode_unit,
    decode_unit_e4m3,
    pick_unit,
    row_globals,
    smem_unit,
    split_unit,
    stage_scales,
    weight_descriptors,
)
from .shapes import PREFILL_ROWS, SEGMENT, prefill_fits

__all__ = ["BM", "GROUP", "STAGES", "compile_sm90", "prefill_gemm"]

# Token rows a tile (the wgmma N), the schedule's block_m on this path: 128, or 64 or 32
# with two programs an SM (128 registers a thread, 100 or 68 KB of shared memory each),
# whose warpgroups hide each other's decode latency.
BM = PREFILL_ROWS
PROGRAMS_PER_SM = {32: 2, 64: 2, 128: 1}
SK = 256  # K elements a ring stage (four units; one scale box of 16 bytes a row)
SEG = SEGMENT  # K elements a segment
STAGES = 2  # ring stages in shared memory: 2 x 82 KB (rows 64 KB, codes 16, scales 2)
GROUP = 8  # row blocks a raster group (as the decoded-weights path's GROUP_M)
TR = 128  # weight rows a tile (two warpgroups of 64)
_SK, _SEG, _GROUP, _TR = (gl.constexpr(v) for v in (SK, SEG, GROUP, TR))
# the epilogue's fp32 tile in shared memory (the rows' ring, reused): rows of BM
# values, vec-2 groups swizzled by the row so that the wgmma fragment's stores spread
EPI_SMEM = gl.SwizzledSharedLayout(2, 1, 16, order=[1, 0])
# W4A8: e4m3 rows, 64 bytes a unit row (64-byte swizzle)
X8_SMEM = gl.NVMMASharedLayout(swizzle_byte_width=64, element_bitwidth=8, rank=2)
X8_SMEM3 = gl.NVMMASharedLayout(swizzle_byte_width=64, element_bitwidth=8, rank=3)


@gluon.jit
def _issue(x_desc, c_desc, s_desc, xdst, cview, sview, bar, t, b: gl.constexpr, row0,
           start, BM: gl.constexpr, XE: gl.constexpr, GATED: gl.constexpr,
           SCALE_TMA: gl.constexpr):  # fmt: skip
    """TMA copies of ring stage ``t`` (K from ``t * 256``) into buffer ``b``, completing
    on ``bar``: the rows [start, start + BM) of the activation (``XE`` bytes an element)
    and the weight tile's codes, and its scales with SCALE_TMA, one copy each: 128 rows
    from ``row0``, or GATED 64 rows from ``row0`` and the 64 up rows ``N`` below
    (``weight_descriptors(pair=N)``). Past K the copies read zeros."""
    XB: gl.constexpr = _SK // 64 * BM * 64 * XE
    if SCALE_TMA:
        CB: gl.constexpr = 2 * 64 * (_SK // 2) + 2 * 64 * (_SK // 16)
    else:  # the scales come by pointer loads (``stage_scales``)
        CB: gl.constexpr = 2 * 64 * (_SK // 2)
    mbarrier.expect(bar, XB + CB)
    tma.async_copy_global_to_shared(x_desc, [t * (_SK // 64), start, 0], bar, xdst.index(b))
    if GATED:
        cdst = cview._reinterpret(gl.uint8, [cview.shape[0], 2, 64, _SK // 2], CODE_SMEM3)
        tma.async_copy_global_to_shared(c_desc, [0, row0, t * (_SK // 2)], bar, cdst.index(b))
        if SCALE_TMA:
            sdst = sview._reinterpret(gl.uint8, [sview.shape[0], 2, 64, 16], SCALE_SMEM3)
            tma.async_copy_global_to_shared(s_desc, [0, row0, t * (_SK // 16)], bar,
                                            sdst.index(b))  # fmt: skip
    else:
        tma.async_copy_global_to_shared(c_desc, [row0, t * (_SK // 2)], bar, cview.index(b))
        if SCALE_TMA:
            tma.async_copy_global_to_shared(s_desc, [row0, t * (_SK // 16)], bar,
                                            sview.index(b))  # fmt: skip


@gluon.jit
def _refill_last(s, st: gl.constexpr, t, x_desc, c_desc, s_desc, xdst, cview, sview, bars,
                 row0, start, NT: gl.constexpr, NB: gl.constexpr, BM: gl.constexpr,
                 XE: gl.constexpr, GATED: gl.constexpr, SCALE_TMA: gl.constexpr):  # fmt: skip
    """At stage ``t`` (stage ``st`` of segment ``s``), once every wgmma reading the stage
    before it is done: refill that stage's buffer with stage t - 1 + NB, if the tile has
    it (the first stage of segment 0 has no stage before it)."""
    SPS: gl.constexpr = _SEG // _SK
    if st > 0:
        if t - 1 + NB < NT:
            gl.thread_barrier()
            fence_async_shared()
            _issue(x_desc, c_desc, s_desc, xdst, cview, sview, bars.index((st - 1) % NB),
                   t - 1 + NB, (st - 1) % NB, row0, start, BM, XE, GATED,
                   SCALE_TMA)  # fmt: skip
    elif s > 0 and t - 1 + NB < NT:
        gl.thread_barrier()
        fence_async_shared()
        _issue(x_desc, c_desc, s_desc, xdst, cview, sview, bars.index((SPS - 1) % NB),
               t - 1 + NB, (SPS - 1) % NB, row0, start, BM, XE, GATED, SCALE_TMA)  # fmt: skip


@gluon.jit
def _wait(p, pa, A_E4M3: gl.constexpr):
    """The tile's sums once every wgmma is done, keeping the A fragment ``pa`` alive until
    then (W4A8: the wait takes no 8-bit operands; ptxas keeps the registers)."""
    if A_E4M3:
        return warpgroup_mma_wait(num_outstanding=0, deps=[p])
    else:
        p, _ = warpgroup_mma_wait(num_outstanding=0, deps=(p, pa))
        return p


@gluon.jit
def _segment(acc, s, NST: gl.constexpr, NU: gl.constexpr, tdone, x_desc, c_desc, s_desc,
             s_ptr, rows_total, xr, xdst, cview, sview, bars, row0, row1, start,
             K: gl.constexpr, NB: gl.constexpr, BM: gl.constexpr, XE: gl.constexpr,
             GATED: gl.constexpr, A_E4M3: gl.constexpr, SCALE_TMA: gl.constexpr, A_L: gl.constexpr,
             MMA: gl.constexpr, HALF: gl.constexpr):  # fmt: skip
    """Segment ``s`` of a tile: ``NU`` units in ``NST`` ring stages from stage ``s * 4``
    (the last segment may hold fewer): its sum from zero, added to ``acc``, which is
    returned. ``tdone``: the tiles the program finished before (the ring's phases).
    Without SCALE_TMA the scales come by pointer loads a stage ahead
    (``gluon_common.stage_scales``). A stage's buffer is refilled (stage + NB) at the next
    stage's first unit, once the wgmmas reading it are done.

    Each unit's wgmmas wait for the last unit's; with HALF (bf16 rows) each half unit's
    two k16 steps are one wgmma group instead, and before a half is decoded the group
    before the last is waited for: the decode runs while the last group's wgmmas do, two
    half fragments live. The same wgmmas in the same order either way: the same bits."""
    UPS: gl.constexpr = _SK // UNIT  # units a stage
    SPS: gl.constexpr = _SEG // _SK  # stages a whole segment
    NT: gl.constexpr = (K + _SK - 1) // _SK  # stages a tile
    p = gl.zeros([_TR, BM], gl.float32, layout=MMA)
    if not SCALE_TMA:
        n0, n1, n2, n3 = stage_scales(s_ptr, row0, row1, rows_total, s * SPS, K, _TR)
    for st in gl.static_range(NST):
        t = s * SPS + st
        if not SCALE_TMA:  # this stage's scales, and the next stage's loads in flight
            c0, c1, c2, c3 = n0, n1, n2, n3
            if st + 1 < NST:
                n0, n1, n2, n3 = stage_scales(s_ptr, row0, row1, rows_total, t + 1, K, _TR)
        # the buffer's uses: (NT - st % NB + NB - 1) // NB a tile, st // NB before this one
        uses = tdone * ((NT - st % NB + NB - 1) // NB) + s * (SPS // NB) + st // NB
        mbarrier.wait(bars.index(st % NB), uses & 1)
        for u in gl.static_range(UPS):
            if st * UPS + u < NU:
                gc, gs = smem_unit(cview, sview, st * UPS + u, 0, NB, UPS, _TR)
                if not SCALE_TMA:
                    gs = pick_unit(c0, c1, c2, c3, u)
                xb = xr.slice((st % NB * UPS + u) * BM, BM).permute((1, 0))
                if HALF:
                    h0, h1, sb = split_unit(gc, gs)
                    for h in gl.static_range(2):
                        if st + u + h > 0:  # the group before the last is done
                            p, _ = warpgroup_mma_wait(num_outstanding=1, deps=(p, pa))  # noqa: F821
                        if h == 0:
                            a = decode_half(h0, sb, A_L, _TR)
                        else:
                            a = decode_half(h1, sb, A_L, _TR)
                        p = warpgroup_mma(a, xb.slice(32 * h, 32, dim=0), p, is_async=True)
                        pa = a
                        if u == 0 and h == 1:  # every group of the last stage is done
                            _refill_last(s, st, t, x_desc, c_desc, s_desc, xdst, cview,
                                         sview, bars, row0, start, NT, NB, BM, XE, GATED,
                                         SCALE_TMA)  # fmt: skip
                else:
                    if A_E4M3:
                        a = decode_unit_e4m3(gc, gs, A_L, _TR)
                    else:
                        a = decode_unit(gc, gs, A_L, _TR)
                    if st + u > 0:
                        p = _wait(p, pa, A_E4M3)
                        if A_E4M3 and u == 0:
                            # W4A8: each stage's (256 K's) FP8 sum (its first wgmma starts
                            # from zero: use_acc off), added to the fp32 sums
                            acc = acc + p
                    # the last stage's wgmmas are done (waited above, or at the end of
                    # the last segment): its buffer refilled, while this unit's wgmmas run
                    # (W4A8 before they issue: after, its 64-row tiles spill more)
                    if u == 0 and A_E4M3:
                        _refill_last(s, st, t, x_desc, c_desc, s_desc, xdst, cview, sview,
                                     bars, row0, start, NT, NB, BM, XE, GATED,
                                     SCALE_TMA)  # fmt: skip
                    if A_E4M3:
                        p = warpgroup_mma(a, xb, p, use_acc=u > 0, is_async=True)
                    else:
                        p = warpgroup_mma(a, xb, p, is_async=True)
                    pa = a  # read by the next unit's wait
                    if u == 0 and not A_E4M3:
                        _refill_last(s, st, t, x_desc, c_desc, s_desc, xdst, cview, sview,
                                     bars, row0, start, NT, NB, BM, XE, GATED,
                                     SCALE_TMA)  # fmt: skip
    # the segment's sum is complete
    p = _wait(p, pa, A_E4M3)
    return acc + p


@gluon.jit
def prefill_kernel(
    x_desc,  # bf16 [R, K] rows in sorted and unit order as [K/64, R, 64], box [4, BM, 64]
    c_desc,  # uint8 [E * W_ROWS, K/2] codes, box [64, 128] (128-byte swizzle)
    s_desc,  # uint8 [E * W_ROWS, K/16] e4m3 scale bits, box [64, 16] (SCALE_TMA)
    s_ptr,  # the same scale bits by pointer (without SCALE_TMA)
    block_expert_ptr,  # int32 [blocks]: the tile schedule (block_m rows; valid blocks first)
    block_start_ptr,
    block_end_ptr,
    valid_blocks_ptr,  # int32 [1]: the schedule's valid blocks
    sorted_routes_ptr,  # int32 [T*TOPK] (FUSED, or A_FP4 with A_GATHER)
    w_global_ptr,  # fp32 [E] or [E, 2] (GATED): the weights' global scales
    topk_w_ptr,  # fp32 [T*TOPK] router weights (FUSED)
    a_global_ptr,  # fp32 [rows]: the activation globals (A_FP4), by token with A_GATHER
    out_ptr,  # bf16 [R, N] rows in sorted order, or fp32 [T, N] (FUSED)
    N: gl.constexpr,
    K: gl.constexpr,
    TOPK: gl.constexpr,
    GATED: gl.constexpr,
    A_GATHER: gl.constexpr,  # A_FP4's globals by token (route // TOPK): FC1's gathered rows
    FUSED: gl.constexpr,
    OUT_SCALE: gl.constexpr,  # undoes the decodes' powers of two (2^8, 2^16 with A_FP4)
    A_FP4: gl.constexpr,
    NB: gl.constexpr,  # ring stages
    BM: gl.constexpr,  # token rows a tile (the schedule's block_m; the wgmma N)
    A_E4M3: gl.constexpr,  # W4A8: e4m3 rows in the unit order, FP8 wgmma
    E: gl.constexpr,  # experts (the weight rows' bound)
    SCALE_TMA: gl.constexpr,  # the scales by TMA, else by pointer (``shapes.scale_rows_tma``)
    CHAIN: gl.constexpr = 0,  # 1: the first of launches that overlap, 2: a later one (PDL)
):
    UPS: gl.constexpr = _SK // UNIT  # units a stage
    SPS: gl.constexpr = _SEG // _SK  # stages a segment
    NT: gl.constexpr = (K + _SK - 1) // _SK  # stages a tile (the last may be partial)
    # half units where the registers allow two half fragments beside the sums (128-row
    # tiles, one program an SM; bf16 rows)
    HALF_UNITS: gl.constexpr = BM == 128 and not A_E4M3
    NSEG: gl.constexpr = K // _SEG  # whole segments
    TAIL_U: gl.constexpr = (K % _SEG) // UNIT  # units of a last, partial segment
    gl.static_assert(K % UNIT == 0, "K is a multiple of a unit")
    gl.static_assert(SPS % NB == 0, "the ring's buffers divide a segment's stages")
    if GATED:
        TN: gl.constexpr = 64  # outputs a tile: gate rows 0-63, up rows 64-127
        W_ROWS: gl.constexpr = 2 * N
    else:
        TN: gl.constexpr = _TR
        W_ROWS: gl.constexpr = N
    NTILES: gl.constexpr = (N + TN - 1) // TN  # FC2's last tile may pass N (masked)
    rows_total = E * W_ROWS

    ROW_SCALE: gl.constexpr = A_FP4 or A_E4M3  # a scale a row multiplies the sums
    if A_E4M3:
        XT: gl.constexpr = gl.float8e4nv
        XS: gl.constexpr = X8_SMEM
        XS3: gl.constexpr = X8_SMEM3
        XE: gl.constexpr = 1
        KI: gl.constexpr = 32  # the wgmma's K: 32 e4m3
    else:
        XT: gl.constexpr = gl.bfloat16
        XS: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BM, UNIT], gl.bfloat16)
        XS3: gl.constexpr = X_SMEM3
        XE: gl.constexpr = 2
        KI: gl.constexpr = 16
    xr = gl.allocate_shared_memory(XT, [NB * UPS * BM, UNIT], XS)
    xdst = xr._reinterpret(XT, [NB, UPS, BM, UNIT], XS3)
    cview = gl.allocate_shared_memory(gl.uint8, [NB, _TR, _SK // 2], CODE_SMEM)
    sview = gl.allocate_shared_memory(gl.uint8, [NB, _TR, 16], SCALE_SMEM)
    ep = xr._reinterpret(gl.float32, [_TR, BM], EPI_SMEM)
    bars = gl.allocate_shared_memory(gl.int64, [NB, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(NB):
        mbarrier.init(bars.index(i), count=1)

    MMA: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[8, 1], instr_shape=[16, BM, KI]
    )
    A_L: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=MMA, k_width=4 // XE)
    # the epilogue's layout: lanes along the outputs (contiguous bf16 stores), warps along
    # the rows
    EL: gl.constexpr = gl.BlockedLayout([2, 1], [32, 1], [1, 8], [0, 1])

    if CHAIN > 0:  # the next launch's programs may take the SMs this launch's programs leave
        gl.inline_asm_elementwise("griddepcontrol.launch_dependents; // dummy $0", "=r", [],
                                  dtype=gl.int32, is_pure=False, pack=1)  # fmt: skip
    nvalid = gl.load(valid_blocks_ptr)
    total = nvalid * NTILES
    per_group = _GROUP * NTILES
    pid = gl.program_id(0)
    nprog = gl.num_programs(0)
    for w in range(pid, total, nprog):
        first = (w // per_group) * _GROUP
        gsz = gl.minimum(nvalid - first, _GROUP)
        r = w % per_group
        pid_m = first + r % gsz
        pid_n = r // gsz
        e = gl.load(block_expert_ptr + pid_m)
        start = gl.load(block_start_ptr + pid_m)
        end = gl.load(block_end_ptr + pid_m)
        if GATED:
            row0 = e * W_ROWS + pid_n * 64
            row1 = row0 + N
        else:
            row0 = e * W_ROWS + pid_n * _TR
            row1 = row0 + 64
        for st in gl.static_range(min(NB, NT)):
            _issue(x_desc, c_desc, s_desc, xdst, cview, sview, bars.index(st), st, st, row0,
                   start, BM, XE, GATED, SCALE_TMA)  # fmt: skip
        tdone = (w - pid) // nprog  # tiles this program finished before this one
        acc = gl.zeros([_TR, BM], gl.float32, layout=MMA)
        for s in range(NSEG):
            acc = _segment(acc, s, SPS, SPS * UPS, tdone, x_desc, c_desc, s_desc, s_ptr,
                           rows_total, xr, xdst, cview, sview, bars, row0, row1, start, K,
                           NB, BM, XE, GATED, A_E4M3, SCALE_TMA, A_L, MMA,
                           HALF_UNITS)  # fmt: skip
        if TAIL_U > 0:  # the last, partial segment (K not a multiple of 1024)
            acc = _segment(acc, NSEG, (TAIL_U + UPS - 1) // UPS, TAIL_U, tdone, x_desc, c_desc,
                           s_desc, s_ptr, rows_total, xr, xdst, cview, sview, bars, row0,
                           row1, start, K, NB, BM, XE, GATED, A_E4M3, SCALE_TMA, A_L, MMA,
                           HALF_UNITS)  # fmt: skip
        gl.thread_barrier()  # every wgmma reading the ring is done before the epilogue

        # ---- epilogue (the portable epilogue's operations): the tile through shared memory
        ep.store(acc)
        gl.thread_barrier()
        om = start + gl.arange(0, BM, layout=gl.SliceLayout(0, EL))
        m_ok = om < end
        e64 = e.to(gl.int64)
        if ROW_SCALE:  # the activation row's global (W4A4) or scale (W4A8)
            gx = row_globals(a_global_ptr, sorted_routes_ptr, om, m_ok, TOPK, A_GATHER)
        if GATED:
            on = pid_n * TN + gl.arange(0, TN, layout=gl.SliceLayout(1, EL))
            h = ep.slice(0, TN, dim=0).load(EL) * OUT_SCALE
            hu = ep.slice(TN, TN, dim=0).load(EL) * OUT_SCALE
            if ROW_SCALE:
                h = h * gx[None, :]
                hu = hu * gx[None, :]
            h = h * gl.load(w_global_ptr + e64 * 2)
            hu = hu * gl.load(w_global_ptr + e64 * 2 + 1)
            res = (h / (1.0 + gl.exp(-h))) * hu
        else:
            on = pid_n * TN + gl.arange(0, TN, layout=gl.SliceLayout(1, EL))
            h = ep.load(EL) * OUT_SCALE
            if ROW_SCALE:
                h = h * gx[None, :]
            res = h * gl.load(w_global_ptr + e64)
        y = res.to(gl.bfloat16)
        mask = m_ok[None, :] & (on < N)[:, None]
        if FUSED:
            route = gl.load(sorted_routes_ptr + om, mask=m_ok, other=0)
            tok = (route // TOPK).to(gl.int64)
            wt = gl.load(topk_w_ptr + route, mask=m_ok, other=0.0)
            gl.atomic_add(out_ptr + tok[None, :] * N + on[:, None], y.to(gl.float32) * wt[None, :],
                          mask=mask, sem="relaxed")  # fmt: skip
        else:
            gl.store(out_ptr + om.to(gl.int64)[None, :] * N + on[:, None], y, mask=mask)
        gl.thread_barrier()  # every thread's epilogue reads before the next tile's copies
        fence_async_shared()
    for i in gl.static_range(NB):
        mbarrier.invalidate(bars.index(i))
    if CHAIN == 2:  # complete only after the launch before (whose outputs the next kernel reads)
        gl.inline_asm_elementwise("griddepcontrol.wait; // dummy $0", "=r", [], dtype=gl.int32,
                                  is_pure=False, pack=1)  # fmt: skip


def prefill_gemm(
    xs: torch.Tensor,
    codes: torch.Tensor,
    scales: torch.Tensor,
    w_global: torch.Tensor,
    block_expert: torch.Tensor,
    block_start: torch.Tensor,
    block_end: torch.Tensor,
    valid_blocks: torch.Tensor,
    out: torch.Tensor,
    *,
    n: int,
    topk: int,
    gated: bool,
    out_scale: float,
    sm_count: int,
    sorted_routes: torch.Tensor | None = None,
    topk_w: torch.Tensor | None = None,
    fused: bool = False,
    a_global: torch.Tensor | None = None,
    a_gather: bool = False,
    block_m: int = BM,
    chain: int = 0,
) -> None:
    """One grouped GEMM on ``prefill_kernel``.

    Args:
        xs: bf16 [R, K], the activation rows in sorted order with each 64 elements in
            the unit order (``dense_rows(..., order=64)``; W4A4: decoded rows, their 2^-8
            included), or W4A8's float8_e4m3fn rows in sorted order and W4A8's unit order
            (``quantize_e4m3.e4m3_rows``) with their scales in ``a_global``. Rows past a
            block's valid ones are read and not used.
        codes, scales: one GEMM's weights, uint8 [E, W_ROWS, K/2] and float8_e4m3fn
            [E, W_ROWS, K/16] (W_ROWS = 2 * n gated, else n).
        w_global: fp32 [E, 2] (gated) or [E]. block_*: ``sort_routes``' schedule with
            ``block_m`` rows a block (32, 64 or 128), and its ``valid_blocks`` (int32 [1]).
        out: bf16 [R, n] rows in sorted order, or with ``fused`` fp32 [T, n] that
            router weight times y of each valid route is added into (``topk_w`` fp32
            [T * topk], ``sorted_routes`` int32 [T * topk]).
        out_scale: the decodes' powers of two to undo (2^8; 2^16 for W4A4; 8 for W4A8).
        sm_count: the device's SMs (one persistent program each, two with 32 or
            64-row blocks).
        a_global: fp32 per row of the activation (W4A4's globals, W4A8's scales), by
            token when ``a_gather`` (the sorted routes' token rows: ``sorted_routes``
            needed).
        chain: launches over shares of one GEMM's blocks (``sort_routes(mixed=True)``)
            that overlap: 1 the first, 2 a later one (programmatic dependent launch: its
            programs start as the launch before leaves SMs, and it completes after it).
    """
    k = xs.shape[1]
    if not prefill_fits(n, k, gated):
        raise ValueError(f"prefill_gemm: needs K and n multiples of 64, got K {k}, n {n}")
    if block_m not in PROGRAMS_PER_SM:
        raise ValueError(f"prefill_gemm: block_m must be one of {sorted(PROGRAMS_PER_SM)}, "
                         f"got {block_m}")  # fmt: skip
    if chain not in (0, 1, 2):
        raise ValueError(f"prefill_gemm: chain must be 0, 1 or 2, got {chain}")
    e4m3 = xs.dtype == torch.float8_e4m3fn
    if xs.dtype not in (torch.bfloat16, torch.float8_e4m3fn) or not xs.is_contiguous():
        raise ValueError(f"prefill_gemm: xs must be contiguous bf16 or e4m3, got {xs.dtype}")
    if e4m3 and a_global is None:
        raise ValueError("prefill_gemm: e4m3 rows need their scales (a_global)")
    if (fused or (a_global is not None and a_gather)) and sorted_routes is None:
        raise ValueError("prefill_gemm: fused and gathered globals need sorted_routes")
    if fused and topk_w is None:
        raise ValueError("prefill_gemm: fused needs topk_w")
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    c_desc, s_desc, s_bytes, s_tma = weight_descriptors(codes, scales, rows=64 if gated else TR,
                                                        pair=n if gated else 0)  # fmt: skip
    x_desc = TensorDescriptor(xs, [k // 64, xs.shape[0], 64], [64, k, 1],
                              [SK // 64, block_m, 64], X8_SMEM3 if e4m3 else X_SMEM3)  # fmt: skip
    tiles = -(-n // (64 if gated else TR))
    grid = (max(1, min(PROGRAMS_PER_SM[block_m] * sm_count, tiles * block_expert.numel())),)
    dummy = w_global
    prefill_kernel[grid](
        x_desc, c_desc, s_desc, s_bytes, block_expert, block_start, block_end, valid_blocks,
        sorted_routes if sorted_routes is not None else block_end, w_global,
        topk_w if fused else dummy, a_global if a_global is not None else dummy, out,
        N=n, K=k, TOPK=topk, GATED=gated, A_GATHER=a_gather, FUSED=fused,
        OUT_SCALE=out_scale, A_FP4=a_global is not None and not e4m3, NB=STAGES, BM=block_m,
        A_E4M3=e4m3, E=codes.shape[0], SCALE_TMA=s_tma, CHAIN=chain,
        launch_pdl=chain == 2, **_launch_options(block_m),
    )  # fmt: skip


def compile_sm90(*, n: int, k: int, gated: bool, fused: bool = False, a_fp4: bool = False,
                 a_e4m3: bool = False, block_m: int = BM, scale_tma: bool | None = None,
                 chain: int = 0):  # fmt: skip
    """Compile one specialization for sm_90 without a GPU (``common.compile_sm90``);
    ``scale_tma``: the scales by TMA (None: as contiguous rows of K / 16 bytes allow,
    ``shapes.scale_tma``); ``chain``: as ``prefill_gemm``'s."""
    ptrs = {
        "s_ptr": "*u8", "block_expert_ptr": "*i32", "block_start_ptr": "*i32",
        "block_end_ptr": "*i32", "valid_blocks_ptr": "*i32", "sorted_routes_ptr": "*i32",
        "w_global_ptr": "*fp32", "topk_w_ptr": "*fp32", "a_global_ptr": "*fp32",
        "out_ptr": "*fp32" if fused else "*bf16",
    }  # fmt: skip
    descs = {
        "x_desc": f"tensordesc<fp8e4nv[{SK // 64}, {block_m}, 64],{X8_SMEM3!r}>"
        if a_e4m3
        else f"tensordesc<bf16[{SK // 64}, {block_m}, 64],{X_SMEM3!r}>",
        "c_desc": f"tensordesc<u8[2, 64, {SK // 2}],{CODE_SMEM3!r}>"
        if gated
        else f"tensordesc<u8[{TR}, {SK // 2}],{CODE_SMEM!r}>",
        "s_desc": f"tensordesc<u8[2, 64, 16],{SCALE_SMEM3!r}>"
        if gated
        else f"tensordesc<u8[{TR}, 16],{SCALE_SMEM!r}>",
    }
    const = dict(
        N=n,
        K=k,
        TOPK=8,
        GATED=gated,
        A_GATHER=gated and a_fp4,
        FUSED=fused,
        OUT_SCALE=8.0 if a_e4m3 else 2.0**16 if a_fp4 else 2.0**8,
        A_FP4=a_fp4,
        NB=STAGES,
        BM=block_m,
        A_E4M3=a_e4m3,
        E=32,
        SCALE_TMA=shapes.scale_tma(k) if scale_tma is None else scale_tma,
        CHAIN=chain,
    )
    return common_compile_sm90(prefill_kernel, ptrs, const, gluon=True, descs=descs,
                               **_launch_options(block_m))  # fmt: skip


def _launch_options(block_m: int) -> dict:
    """The launch's warps, and its register cap where programs share an SM (65536
    registers an SM over their threads)."""
    per_sm = PROGRAMS_PER_SM[block_m]
    cap = {} if per_sm == 1 else {"maxnreg": 65536 // (per_sm * 256)}
    return {"num_warps": 8, **cap}
