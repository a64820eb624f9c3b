"""The decode-size and middle-size grouped GEMMs in Gluon (Hopper), fed by TMA: the
portable loop's units (64 weight rows, one 1024-element K segment, 8 or 16 token rows)
with the same operands, order and sums, so the same bits.

One elected thread of a program issues TMA copies of its segment's weights (a 256-K ring
stage a copy: codes as [64 rows, 128 bytes] with a 128-byte swizzle, scales as [64, 16]; a
gated GEMM's gate and up rows in one copy, [2, 64, 128] and [2, 64, 16]) into a ring of
``RING_STAGES`` stages, each with its own mbarrier; the activation tile is staged while
they fly; the codes go from shared memory straight into the wgmma register fragment's
layout (``gluon_common.code_layout``) and are decoded there, each unit's decode
overlapping the last unit's asynchronous wgmma (but for the gated 8-row tiles: under
their register cap ptxas serializes the wgmmas). K is a multiple of 64: the last segment
may be partial (its copies read zeros past K, its missing units are skipped at compile
time); scales TMA cannot copy (``shapes.scale_rows_tma``: contiguous rows of K / 16 bytes,
no multiple of 16, which ``PreparedExperts`` pads in memory) come by pointer loads a stage
ahead (``gluon_common.stage_scales``). Split K with TMA scales runs the ring of two
128-K half stages of ``gluon_half_ring`` instead, in the shared memory of one 256-K
stage, at the same programs an SM.

Two forms (``split_partials_tma``):

- split K (``gluon-split``): one program a (weight tile, K segment, row block) unit writes
  its fp32 partial; with ``EPILOGUE`` the last unit of a tile (a counter) sums the
  partials in segment order and writes the output itself (bf16 rows, or the fused
  atomic add); without it (static W4A4's NVFP4 output) the portable kernel reduces them;
- whole K (``gluon-whole``): a program takes every K segment of its tile in turn, its
  ring running on from one segment to the next, and adds the segment sums in registers
  in the same order: no partials, no counters. Tiles of 16 or 32 token rows.

The grid has ``shapes.decode_row_programs`` programs a (weight tile, K segment), which
take the schedule's valid row blocks in turn (at most ``shapes.DECODE_ROW_TURNS``, the
turns unrolled): the worst case's blocks, mostly empty at decode sizes, get no program
each.

Under programmatic dependent launch FC2's programs (whose schedule the sort wrote two
kernels back) issue their first weight copies before they wait for FC1 (``EARLY_W``).
W4A4 reads its activation rows already decoded (``A_UNIT_ORDER``).
"""

from __future__ import annotations

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
)

from ..common import compile_sm90 as common_compile_sm90
from . import shapes
from .gluon_common import (
    CODE_SMEM,
    CODE_SMEM3,
    CODE_SMEM3_64,
    CODE_SMEM_64,
    SCALE_SMEM,
    SCALE_SMEM3,
    STAGE_K,
    TILE_ROWS,
    UNIT,
    decode_unit,
    last_unit_done,
    mma_drain,
    pick_unit,
    row_globals,
    smem_stage,
    smem_unit,
    stage_scales,
    stage_x,
    store_partials,
    tile_index,
    weight_descriptors,
)
from .gluon_half_ring import HALF_K, half_buffers, issue_half, segment_half, uses_half_ring
from .shapes import SEGMENT, gluon_decode_fits

__all__ = ["RING_STAGES", "compile_sm90", "split_partials_tma"]

# Ring stages of 256 K in shared memory (1: 18 KB a program for FC1's 8-row tiles, so more
# programs an SM): the fastest of 1, 2 and 4 on the H200 for both forms.
RING_STAGES = 1
_TR = TILE_ROWS
# Registers a thread of the gated (FC1) kernels on 8-row tiles: at most 80 keep 6 programs
# of 128 threads an SM (the shared memory's count), so DeepSeek-V3 EP8's 672 FC1 programs
# at 1 token run in one wave; uncapped, ptxas takes 87 (5 an SM). 16-row tiles spill at 80.
GATED_MAXNREG = 80


def _regs(gated: bool, block_m: int) -> dict:
    """The launch's register cap (``GATED_MAXNREG``), as keyword arguments."""
    return {"maxnreg": GATED_MAXNREG} if gated and block_m == 8 else {}


def _code_bytes(half: bool) -> int:
    """A TMA box's bytes of a code row: a half stage's on the ring of half stages, else a
    256-K stage's."""
    return (HALF_K.value if half else STAGE_K.value) // 2


@gluon.jit
def _issue(c_desc, s_desc, cbuf, sbuf, bar, row, N: gl.constexpr, k0, st: gl.constexpr,
           NB: gl.constexpr, GATED: gl.constexpr, SCALE_TMA: gl.constexpr):  # fmt: skip
    """Ring stage ``st`` of the segment at ``k0``: the expected bytes on ``bar``, then the
    copies of the gate weight's stage (rows from ``row``), or GATED one copy of the gate
    weight's and the up weight's (from ``row + N``; ``weight_descriptors(pair=N)``, a ring
    of one stage). Past K the copies read zeros."""
    NW: gl.constexpr = 2 if GATED else 1  # weight row blocks a copy (gate and up)
    if SCALE_TMA:
        STAGE_BYTES: gl.constexpr = NW * _TR * (STAGE_K // 2 + 16)
    else:
        STAGE_BYTES: gl.constexpr = NW * _TR * (STAGE_K // 2)
    mbarrier.expect(bar, STAGE_BYTES)
    k = k0 + st * STAGE_K
    if GATED:  # buffers 0 (gate) and 1 (up) as one [2, 64, bytes] destination
        gl.static_assert(NB == 1, "the gate and up buffers of one stage are consecutive")
        cdst = cbuf._reinterpret(gl.uint8, [2, _TR, STAGE_K // 2], CODE_SMEM3)
        tma.async_copy_global_to_shared(c_desc, [0, row, k // 2], bar, cdst)
        if SCALE_TMA:
            sdst = sbuf._reinterpret(gl.uint8, [2, _TR, 16], SCALE_SMEM3)
            tma.async_copy_global_to_shared(s_desc, [0, row, k // 16], bar, sdst)
    else:  # ring buffer st % NB: codes [64, 128 bytes], scales [64, 16]
        b: gl.constexpr = st % NB
        tma.async_copy_global_to_shared(c_desc, [row, k // 2], bar, cbuf.index(b))
        if SCALE_TMA:
            tma.async_copy_global_to_shared(s_desc, [row, k // 16], bar, sbuf.index(b))


@gluon.jit
def _stage_buffers(GATED: gl.constexpr, NB: gl.constexpr):
    """A program's shared buffers for the weights of ``NB`` ring stages (codes [NW * NB,
    64, 128] swizzled, scales [NW * NB, 64, 16]; NW 2 when GATED) and the stages' ``NB``
    mbarriers, initialized."""
    NW: gl.constexpr = 2 if GATED else 1  # weight row blocks a copy (gate and up)
    cbuf = gl.allocate_shared_memory(gl.uint8, [NW * NB, _TR, STAGE_K // 2], CODE_SMEM)
    sbuf = gl.allocate_shared_memory(gl.uint8, [NW * NB, _TR, 16], SCALE_SMEM)
    bars = gl.allocate_shared_memory(gl.int64, [NB, 1], mbarrier.MBarrierLayout())
    for b in gl.static_range(NB):
        mbarrier.init(bars.index(b), count=1)
    return cbuf, sbuf, bars


@gluon.jit
def _gdc_wait_release():
    """Programmatic dependent launch: wait for the preceding kernel's writes, then let the
    next kernel's programs start (both are no-ops when the kernel was launched without
    PDL)."""
    gl.inline_asm_elementwise("griddepcontrol.wait; // dummy $0", "=r", [], dtype=gl.int32,
                              is_pure=False, pack=1)  # fmt: skip
    gl.inline_asm_elementwise("griddepcontrol.launch_dependents; // dummy $0", "=r", [],
                              dtype=gl.int32, is_pure=False, pack=1)  # fmt: skip


@gluon.jit
def _opaque_zero():
    """An int32 zero the compiler cannot see through, indexing a program's activation
    buffer: through a constant index the wgmma descriptors of its unit slices are computed
    ahead (before the whole-K segment loop, or across a program's turns) and held in
    registers."""
    return gl.inline_asm_elementwise("mov.u32 $0, 0;", "=r", [], dtype=gl.int32,
                                     is_pure=False, pack=1)  # fmt: skip


@gluon.jit
def _block_ids():
    """(pid_n, s_id): the program's weight tile and K segment, read afresh in each of its
    turns (row blocks): what the compiler derives from them is not computed once and held
    in registers across the turns."""
    pid_n = gl.inline_asm_elementwise("mov.u32 $0, %ctaid.x;", "=r", [], dtype=gl.int32,
                                      is_pure=False, pack=1)  # fmt: skip
    s_id = gl.inline_asm_elementwise("mov.u32 $0, %ctaid.y;", "=r", [], dtype=gl.int32,
                                     is_pure=False, pack=1)  # fmt: skip
    return pid_n, s_id


@gluon.jit
def _last_unit_epilogue(
    pid_m, pid_n, e, start, end, part_ptr, cnt_ptr, w_global_ptr, topk_w_ptr,
    sorted_routes_ptr, out_ptr, a_global_ptr, stride, N: gl.constexpr, K: gl.constexpr,
    TOPK: gl.constexpr, GATED: gl.constexpr, BM: gl.constexpr, SEG: gl.constexpr,
    FUSED: gl.constexpr, OUT_SCALE: gl.constexpr, MMA: gl.constexpr,
    A_GATHER: gl.constexpr, A_FP4: gl.constexpr,
):  # fmt: skip
    """After a unit wrote its partial: the tile's last unit to finish sums the partials
    in segment order from zero, ((0 + P_0) + P_1) + ..., and writes the output (``_tile_out``)."""
    NSEG: gl.constexpr = (K + SEG - 1) // SEG
    if GATED:
        gn: gl.constexpr = 2 * N
    else:
        gn: gl.constexpr = N
    tile = pid_m * gl.cdiv(N, _TR) + pid_n
    gl.thread_barrier()  # every thread's partial stores before the release below
    done = gl.atomic_add(cnt_ptr + tile, 1, sem="acq_rel")
    if done == NSEG - 1:
        gl.store(cnt_ptr + tile, 0)  # ready for the next call (and graph replay)
        on, om, _, mask = tile_index(pid_n, start, end, N, BM, MMA, _TR)
        prow = part_ptr + om.to(gl.int64)[None, :] * gn + on[:, None]
        acc_g = gl.zeros([_TR, BM], gl.float32, layout=MMA)
        acc_u = gl.zeros([_TR, BM], gl.float32, layout=MMA)
        for sg in gl.static_range(NSEG):  # .cg: other SMs wrote them; read from L2
            acc_g = acc_g + gl.load(prow + sg * stride, mask=mask, other=0.0,
                                    cache_modifier=".cg")  # fmt: skip
            if GATED:
                acc_u = acc_u + gl.load(prow + sg * stride + N, mask=mask, other=0.0,
                                        cache_modifier=".cg")  # fmt: skip
        _tile_out(acc_g, acc_u, pid_n, e, start, end, w_global_ptr, topk_w_ptr,
                  sorted_routes_ptr, out_ptr, a_global_ptr, N, TOPK, GATED, BM, FUSED,
                  OUT_SCALE, MMA, A_GATHER, A_FP4)  # fmt: skip


@gluon.jit
def _tile_out(
    acc_g, acc_u, pid_n, e, start, end, w_global_ptr, topk_w_ptr, sorted_routes_ptr,
    out_ptr, a_global_ptr, N: gl.constexpr, TOPK: gl.constexpr, GATED: gl.constexpr,
    BM: gl.constexpr, FUSED: gl.constexpr, OUT_SCALE: gl.constexpr, MMA: gl.constexpr,
    A_GATHER: gl.constexpr, A_FP4: gl.constexpr,
):  # fmt: skip
    """A tile's output from its sums over K (``acc_g``, and ``acc_u`` when GATED; [64, BM]
    fp32 in the ``MMA`` layout) with the portable epilogue's operations: global scales,
    SwiGLU when GATED, one bf16 rounding; bf16 rows, or the router-weighted atomic add
    when FUSED."""
    on, om, m_ok, mask = tile_index(pid_n, start, end, N, BM, MMA, _TR)
    e64 = e.to(gl.int64)
    h = acc_g * OUT_SCALE
    if A_FP4:  # the activation row's global (W4A4)
        gx = row_globals(a_global_ptr, sorted_routes_ptr, om, m_ok, TOPK, A_GATHER)
        h = h * gx[None, :]
    if GATED:
        h = h * gl.load(w_global_ptr + e64 * 2)
        hu = acc_u * OUT_SCALE
        if A_FP4:
            hu = hu * gx[None, :]
        hu = hu * gl.load(w_global_ptr + e64 * 2 + 1)
        res = (h / (1.0 + gl.exp(-h))) * hu
    else:
        res = h * gl.load(w_global_ptr + e64)
    y = res.to(gl.bfloat16)
    if FUSED:
        route = gl.load(sorted_routes_ptr + om, mask=m_ok, other=0)
        tok = (route // TOPK).to(gl.int64)
        wt = gl.load(topk_w_ptr + route, mask=m_ok, other=0.0)
        contrib = y.to(gl.float32) * wt[None, :]
        gl.atomic_add(out_ptr + tok[None, :] * N + on[:, None], contrib, mask=mask,
                      sem="relaxed")  # fmt: skip
    else:
        gl.store(out_ptr + om.to(gl.int64)[None, :] * N + on[:, None], y, mask=mask)


@gluon.jit
def _segment(
    x_ptr, sorted_routes_ptr, c_desc, s_desc, s_ptr, rows_total, cbuf, sbuf, bars, xd, row,
    start, end, kj, nk, hn, phj, NU_S: gl.constexpr, N: gl.constexpr, K: gl.constexpr,
    TOPK: gl.constexpr, A_GATHER: gl.constexpr, BM: gl.constexpr, SEG: gl.constexpr,
    NB: gl.constexpr, GATED: gl.constexpr, WHOLE: gl.constexpr, A_UNIT_ORDER: gl.constexpr,
    SCALE_TMA: gl.constexpr, MMA: gl.constexpr, A_L: gl.constexpr,
):  # fmt: skip
    """The sums of one K segment of a tile (from ``kj``, ``NU_S`` units: a last, partial
    segment holds fewer than SEG / 64) from zero, stage by stage as the copies land, each
    unit's decode overlapping the last unit's asynchronous wgmma; returns (gate, up) sums
    [64, BM] in the ``MMA`` layout. The ring's first ``NB`` stages were issued before;
    ``phj`` is the ring's phase at the segment's start. With WHOLE and ``hn`` the buffers
    freed last are refilled with the next segment's (at ``nk``) first stages. Without
    SCALE_TMA the scales come by pointer loads a stage ahead (``stage_scales``)."""
    UPS: gl.constexpr = STAGE_K // UNIT  # units a stage
    NS_S: gl.constexpr = (NU_S + UPS - 1) // UPS  # stages of this segment
    # (32-row tiles: a stage's K at a time)
    xs = stage_x(x_ptr, sorted_routes_ptr, start, end, kj, K, TOPK, A_GATHER, BM, SEG,
                 A_UNIT_ORDER, xd, _TR // 16, STAGE_K if BM == 32 else 0)  # fmt: skip
    if not SCALE_TMA:  # the segment's first stage's scales
        t0 = kj // STAGE_K
        ng0, ng1, ng2, ng3 = stage_scales(s_ptr, row, row, rows_total, t0, K, _TR)
        if GATED:
            nu0, nu1, nu2, nu3 = stage_scales(s_ptr, row + N, row + N, rows_total, t0, K, _TR)
    acc_g = gl.zeros([_TR, BM], gl.float32, layout=MMA)
    acc_u = gl.zeros([_TR, BM], gl.float32, layout=MMA)
    for kb in gl.static_range(NU_S):
        if kb % UPS == 0:
            mbarrier.wait(bars.index((kb // UPS) % NB), ((kb // UPS) // NB + phj) % 2)
            if WHOLE:  # the stage's units into registers, then its buffer refilled at once:
                # with stage + NB, or past the segment's last stages (and ``hn``) with the
                # next segment's first (stage + NB - NS_S of it, which maps to this buffer)
                hc0, hs0, hc1, hs1, hc2, hs2, hc3, hs3 = smem_stage(cbuf, sbuf, kb, 0, NU_S,
                                                                    NB, UPS, _TR)  # fmt: skip
                if GATED:
                    uc0, us0, uc1, us1, uc2, us2, uc3, us3 = smem_stage(cbuf, sbuf, kb, 1, NU_S,
                                                                        NB, UPS, _TR)  # fmt: skip
                if (kb // UPS) + NB < NS_S:
                    gl.thread_barrier()
                    fence_async_shared()
                    _issue(c_desc, s_desc, cbuf, sbuf, bars.index((kb // UPS) % NB), row, N,
                           kj, kb // UPS + NB, NB, GATED, SCALE_TMA)  # fmt: skip
                else:  # (compile time, then run time)
                    if hn:  # the next segment's first stages
                        gl.thread_barrier()
                        fence_async_shared()
                        _issue(c_desc, s_desc, cbuf, sbuf, bars.index((kb // UPS) % NB), row,
                               N, nk, (kb // UPS) + NB - NS_S, NB, GATED, SCALE_TMA)  # fmt: skip
            if not SCALE_TMA:  # this stage's scales, and the next stage's loads in flight
                cg0, cg1, cg2, cg3 = ng0, ng1, ng2, ng3
                if GATED:
                    cu0, cu1, cu2, cu3 = nu0, nu1, nu2, nu3
                if (kb // UPS) + 1 < NS_S:
                    tn = kj // STAGE_K + (kb // UPS) + 1
                    ng0, ng1, ng2, ng3 = stage_scales(s_ptr, row, row, rows_total, tn, K, _TR)
                    if GATED:
                        nu0, nu1, nu2, nu3 = stage_scales(s_ptr, row + N, row + N, rows_total,
                                                          tn, K, _TR)  # fmt: skip
        xb = xs.slice(kb * BM, BM).permute((1, 0))
        if WHOLE:
            gc = pick_unit(hc0, hc1, hc2, hc3, kb % UPS)
            gs = pick_unit(hs0, hs1, hs2, hs3, kb % UPS)
        else:
            gc, gs = smem_unit(cbuf, sbuf, kb, 0, NB, UPS, _TR)
        if not SCALE_TMA:
            gs = pick_unit(cg0, cg1, cg2, cg3, kb % UPS)
        wg = decode_unit(gc, gs, A_L, _TR)
        if kb > 0:  # the last unit's wgmma done: its operand registers are free
            acc_g, acc_u = last_unit_done(acc_g, acc_u, pg, pu, GATED)  # noqa: F821
        acc_g = warpgroup_mma(wg, xb, acc_g, is_async=True)
        pg = wg  # noqa: F841 (read by the next unrolled unit)
        pu = wg  # the ungated wait's argument, not read
        if GATED:
            if WHOLE:
                uc = pick_unit(uc0, uc1, uc2, uc3, kb % UPS)
                us = pick_unit(us0, us1, us2, us3, kb % UPS)
            else:
                uc, us = smem_unit(cbuf, sbuf, kb, 1, NB, UPS, _TR)
            if not SCALE_TMA:
                us = pick_unit(cu0, cu1, cu2, cu3, kb % UPS)
            wu = decode_unit(uc, us, A_L, _TR)
            acc_u = warpgroup_mma(wu, xb, acc_u, is_async=True)
            pu = wu  # noqa: F841
        # the stage's buffer is read: refill it with stage + NB (split K; whole K refilled
        # it at the stage's wait)
        if not WHOLE and kb % UPS == UPS - 1 and (kb // UPS) + NB < NS_S:
            gl.thread_barrier()  # every warp's shared loads of the buffer done
            fence_async_shared()  # ordered before the TMA writes (async proxy)
            _issue(c_desc, s_desc, cbuf, sbuf, bars.index((kb // UPS) % NB), row, N, kj,
                   kb // UPS + NB, NB, GATED, SCALE_TMA)  # fmt: skip
    return mma_drain(acc_g, acc_u, GATED)


@gluon.jit
def _row_block(
    pid_m, pid_n, s_id,
    xw,  # bf16 [1, SEG / 64 * BM, 64] shared: the row block's activations of a K segment
    x_ptr, sorted_routes_ptr, c_desc, s_desc, s_ptr, block_expert_ptr, block_start_ptr,
    block_end_ptr, part_ptr, cnt_ptr, w_global_ptr, topk_w_ptr, out_ptr, a_global_ptr,
    ws_rows, N: gl.constexpr, K: gl.constexpr, TOPK: gl.constexpr, GATED: gl.constexpr,
    A_GATHER: gl.constexpr, BM: gl.constexpr, SEG: gl.constexpr, NBUF: gl.constexpr,
    EPILOGUE: gl.constexpr, FUSED: gl.constexpr, OUT_SCALE: gl.constexpr,
    A_UNIT_ORDER: gl.constexpr, A_FP4: gl.constexpr, USE_PDL: gl.constexpr,
    EARLY_W: gl.constexpr, WHOLE: gl.constexpr, E: gl.constexpr, SCALE_TMA: gl.constexpr,
    HALF: gl.constexpr,
):  # fmt: skip
    """Row block ``pid_m``'s unit (weight tile ``pid_n``, K segment ``s_id``; with WHOLE
    every segment): its partial, or its output. The other arguments are
    ``tma_split_kernel``'s."""
    gl.static_assert(not WHOLE or EPILOGUE, "WHOLE writes its own output")
    gl.static_assert(BM != 32 or WHOLE, "32-row tiles: WHOLE only")
    NU: gl.constexpr = SEG // UNIT  # units a whole segment
    NS: gl.constexpr = SEG // STAGE_K  # stages a whole segment
    NB: gl.constexpr = min(NBUF, NS)  # ring buffers (NS: the whole segment up front)
    NJF: gl.constexpr = K // SEG  # whole segments
    TAIL_U: gl.constexpr = (K % SEG) // UNIT  # units of a last, partial segment
    gl.static_assert(K % UNIT == 0, "K is a multiple of a unit")
    gl.static_assert(TAIL_U == 0 or NB == 1, "a partial segment needs a ring of one stage")
    e = gl.load(block_expert_ptr + pid_m, cache_modifier=".cg")
    if e >= 0:
        start = gl.load(block_start_ptr + pid_m, cache_modifier=".cg")
        end = gl.load(block_end_ptr + pid_m, cache_modifier=".cg")
        if GATED:
            w_rows = 2 * N
        else:
            w_rows = N
        rows_total = E * w_rows
        k0 = s_id * SEG

        # ---- the ring's first stages, first (one elected thread issues the copies)
        row = e * w_rows + pid_n * _TR
        if HALF:
            gl.static_assert(not WHOLE and SCALE_TMA, "HALF: split K, the scales by TMA")
            cb0, cb1, sb0, sb1, bars = half_buffers(GATED)
            issue_half(c_desc, s_desc, cb0, sb0, bars.index(0), row, k0, 0, GATED)
            # (a last, partial segment of one half stage has no second)
            if TAIL_U == 0 or TAIL_U > 2 or s_id < NJF:
                issue_half(c_desc, s_desc, cb1, sb0, bars.index(1), row, k0, 1, GATED)
        else:
            cbuf, sbuf, bars = _stage_buffers(GATED, NB)
            for st in gl.static_range(NB):
                _issue(c_desc, s_desc, cbuf, sbuf, bars.index(st), row, N, k0, st, NB, GATED,
                       SCALE_TMA)  # fmt: skip
        if USE_PDL and EARLY_W:  # the weights' first stages fly while the last kernel ends
            _gdc_wait_release()

        # ---- decode and multiply: one K segment, or with WHOLE each of K's segments in
        # turn, the ring running on from one to the next and the segment sums added in
        # order from zero, ((0 + P_0) + P_1) + ..., in registers (the sums
        # _last_unit_epilogue makes from the partials: the same bits)
        MMA: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[_TR // 16, 1], instr_shape=[16, BM, 16]
        )
        A_L: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=MMA, k_width=2)
        if not WHOLE:  # split K: the rows' buffer through an opaque zero, as WHOLE's below
            xd = xw.index(_opaque_zero())
        if WHOLE:
            tot_g = gl.zeros([_TR, BM], gl.float32, layout=MMA)
            tot_u = gl.zeros([_TR, BM], gl.float32, layout=MMA)
            for j in range(NJF):
                kj = k0 + j * SEG
                if j > 0:
                    gl.thread_barrier()  # every warp's reads of the last segment's rows done
                # through an opaque zero: else the wgmma descriptors of its 16 unit slices
                # are computed before the loop and held in registers
                acc_g, acc_u = _segment(
                    x_ptr, sorted_routes_ptr, c_desc, s_desc, s_ptr, rows_total, cbuf, sbuf,
                    bars, xw.index(_opaque_zero()), row, start, end, kj, kj + SEG,
                    (j + 1 < NJF) or (TAIL_U > 0), (j * (NS // NB)) % 2, NU, N, K, TOPK,
                    A_GATHER, BM, SEG, NB, GATED, WHOLE, A_UNIT_ORDER, SCALE_TMA, MMA, A_L,
                )  # fmt: skip
                tot_g = tot_g + acc_g
                tot_u = tot_u + acc_u
            if TAIL_U > 0:  # the last, partial segment
                if NJF > 0:
                    gl.thread_barrier()
                acc_g, acc_u = _segment(
                    x_ptr, sorted_routes_ptr, c_desc, s_desc, s_ptr, rows_total, cbuf, sbuf,
                    bars, xw.index(_opaque_zero()), row, start, end, k0 + NJF * SEG, 0, False,
                    (NJF * (NS // NB)) % 2, TAIL_U, N, K, TOPK, A_GATHER, BM, SEG, NB, GATED,
                    WHOLE, A_UNIT_ORDER, SCALE_TMA, MMA, A_L,
                )  # fmt: skip
                tot_g = tot_g + acc_g
                tot_u = tot_u + acc_u
        elif HALF:  # split K on the ring of two half stages: a whole or the last segment
            if TAIL_U > 0 and s_id == NJF:
                tot_g, tot_u = segment_half(
                    x_ptr, sorted_routes_ptr, c_desc, s_desc, cb0, cb1, sb0, sb1, bars, xd, row,
                    start, end, k0, K, TOPK, A_GATHER, BM, SEG, TAIL_U, GATED, A_UNIT_ORDER,
                    MMA, A_L,
                )  # fmt: skip
            else:
                tot_g, tot_u = segment_half(
                    x_ptr, sorted_routes_ptr, c_desc, s_desc, cb0, cb1, sb0, sb1, bars, xd, row,
                    start, end, k0, K, TOPK, A_GATHER, BM, SEG, NU, GATED, A_UNIT_ORDER, MMA,
                    A_L,
                )  # fmt: skip
        elif TAIL_U > 0 and s_id == NJF:  # split K: the last, partial segment
            tot_g, tot_u = _segment(
                x_ptr, sorted_routes_ptr, c_desc, s_desc, s_ptr, rows_total, cbuf, sbuf, bars,
                xd, row, start, end, k0, k0, False, 0, TAIL_U, N, K, TOPK, A_GATHER, BM, SEG, NB,
                GATED, WHOLE, A_UNIT_ORDER, SCALE_TMA, MMA, A_L,
            )  # fmt: skip
        else:  # split K: a whole segment
            tot_g, tot_u = _segment(
                x_ptr, sorted_routes_ptr, c_desc, s_desc, s_ptr, rows_total, cbuf, sbuf, bars,
                xd, row, start, end, k0, k0, False, 0, NU, N, K, TOPK, A_GATHER, BM, SEG, NB,
                GATED, WHOLE, A_UNIT_ORDER, SCALE_TMA, MMA, A_L,
            )  # fmt: skip
        if HALF:
            mbarrier.invalidate(bars.index(0))
            mbarrier.invalidate(bars.index(1))
        else:
            for b in gl.static_range(NB):
                mbarrier.invalidate(bars.index(b))

        if WHOLE:  # the tile's sums over K: its output (no partials, no counter)
            _tile_out(tot_g, tot_u, pid_n, e, start, end, w_global_ptr, topk_w_ptr,
                      sorted_routes_ptr, out_ptr, a_global_ptr, N, TOPK, GATED, BM, FUSED,
                      OUT_SCALE, MMA, A_GATHER, A_FP4)  # fmt: skip
        else:
            # ---- partials, as the portable loop's split programs write them
            stride = store_partials(tot_g, tot_u, part_ptr, pid_n, start, end, s_id,
                                    ws_rows, N, GATED, BM, MMA, _TR)  # fmt: skip
            if EPILOGUE:  # the portable split epilogue's operations: the same bits
                _last_unit_epilogue(
                    pid_m, pid_n, e, start, end, part_ptr, cnt_ptr, w_global_ptr,
                    topk_w_ptr, sorted_routes_ptr, out_ptr, a_global_ptr, stride, N, K,
                    TOPK, GATED, BM, SEG, FUSED, OUT_SCALE, MMA, A_GATHER, A_FP4,
                )  # fmt: skip


@gluon.jit
def tma_split_kernel(
    x_ptr,  # bf16 [rows, K]: FC1 the tokens (gathered by route // TOPK), FC2 sorted rows
    sorted_routes_ptr,  # int32 [T*TOPK]
    c_desc,  # TMA descriptor of the uint8 [E * W_ROWS, K/2] codes, [64, 128] boxes
    s_desc,  # TMA descriptor: uint8 [E * W_ROWS, K/16] e4m3 scale bits, [64, 16] boxes
    s_ptr,  # the same scale bits by pointer (without SCALE_TMA)
    block_expert_ptr,
    block_start_ptr,
    block_end_ptr,
    valid_blocks_ptr,  # int32 [1]: the schedule's valid blocks (its first)
    part_ptr,  # fp32 [segments, ws_rows, (2 if GATED) * N] (split K)
    cnt_ptr,  # int32 [tiles * blocks] zeros: units done a tile (EPILOGUE; left at zero)
    w_global_ptr,  # fp32 [E] or [E, 2] (GATED): the weights' global scales (EPILOGUE)
    topk_w_ptr,  # fp32 [T*TOPK] router weights (FUSED)
    out_ptr,  # EPILOGUE: bf16 [ws_rows, N] rows in sorted order, or fp32 [T, N] (FUSED)
    a_global_ptr,  # fp32 [rows of x]: W4A4's activation global scales (A_FP4, EPILOGUE)
    ws_rows,
    N: gl.constexpr,
    K: gl.constexpr,
    TOPK: gl.constexpr,
    GATED: gl.constexpr,
    A_GATHER: gl.constexpr,
    BM: gl.constexpr,  # rows (tokens) a tile: the wgmma N (8 or 16; 32 with WHOLE)
    SEG: gl.constexpr,  # K elements a segment (1024)
    NBUF: gl.constexpr,  # ring stages in shared memory
    EPILOGUE: gl.constexpr,  # the tile's last unit (or WHOLE's program) writes the output
    FUSED: gl.constexpr,  # EPILOGUE: router weight times y added into out (atomic)
    OUT_SCALE: gl.constexpr,  # EPILOGUE: undoes the decodes' powers of two
    A_UNIT_ORDER: gl.constexpr,  # x's rows already in the unit order (W4A4's decoded rows)
    A_FP4: gl.constexpr,  # EPILOGUE: times the activation global (W4A4)
    USE_PDL: gl.constexpr,  # programmatic dependent launch (launch_pdl=True)
    EARLY_W: gl.constexpr,  # USE_PDL: the first stages' copies before the wait
    WHOLE: gl.constexpr,  # a program takes every K segment of its tile in turn and
    # writes its output (EPILOGUE): no partials, no counter (the grid's segments: 1)
    E: gl.constexpr,  # experts (the weight rows' bound)
    SCALE_TMA: gl.constexpr,  # the scales by TMA, else by pointer (``shapes.scale_rows_tma``)
    HALF: gl.constexpr = False,  # split K on the ring of two half stages (``uses_half_ring``)
    TURNS: gl.constexpr = 1,  # the most row blocks a program takes (its turns, unrolled)
):
    # EARLY_W: the schedule was written two kernels back (the kernel before this one waited
    # for it before it released this one), so it is read before the wait, from L2. The
    # grid's row programs take the valid blocks (the schedule's first) in turn: a grid of
    # the worst case's blocks would start a program for each empty one.
    if USE_PDL and not EARLY_W:
        _gdc_wait_release()
    valid = gl.load(valid_blocks_ptr, cache_modifier=".cg")
    # the activation rows' buffer, allocated once (indexed in each turn through an opaque
    # zero, so that its wgmma descriptors are not computed ahead and held in registers).
    # The turns are unrolled: compiled as a runtime loop (``range``) by Triton 3.6, the
    # gated GEMM on the ring with a partial last segment (K 2880) writes wrong tiles.
    XW: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BM, UNIT], gl.bfloat16)
    xw = gl.allocate_shared_memory(gl.bfloat16, [1, SEG // UNIT * BM, UNIT], XW)
    for turn in gl.static_range(TURNS):
        pid_m = gl.program_id(2) + turn * gl.num_programs(2)
        if pid_m < valid:
            if turn > 0:
                gl.thread_barrier()  # the last block's shared loads and barrier waits done
                fence_async_shared()  # ordered before this block's TMA writes (async proxy)
            pid_n, s_id = _block_ids()
            _row_block(
                pid_m, pid_n, s_id, xw, x_ptr, sorted_routes_ptr, c_desc, s_desc, s_ptr,
                block_expert_ptr, block_start_ptr, block_end_ptr, part_ptr, cnt_ptr, w_global_ptr,
                topk_w_ptr, out_ptr, a_global_ptr, ws_rows, N, K, TOPK, GATED, A_GATHER, BM, SEG,
                NBUF, EPILOGUE, FUSED, OUT_SCALE, A_UNIT_ORDER, A_FP4, USE_PDL, EARLY_W, WHOLE, E,
                SCALE_TMA, HALF
            )  # fmt: skip


def split_partials_tma(
    x, sorted_routes, codes, scales, block_expert, block_start, block_end, valid_blocks, part, *,
    n: int, topk: int, gated: bool, gather: bool, block_m: int, ws_rows: int,
    out: torch.Tensor | None = None,
    counters: torch.Tensor | None = None, w_global: torch.Tensor | None = None,
    topk_w: torch.Tensor | None = None, fused: bool = False, out_scale: float = 1.0,
    a_unit_order: bool = False, a_global: torch.Tensor | None = None, pdl: bool = False,
    early_weights: bool = False, whole: bool = False, sm_count: int,
) -> None:  # fmt: skip
    """Launch ``tma_split_kernel``.

    Args:
        x: bf16 [., K], the tokens (``gather``: row route // topk) or rows in sorted order;
            with ``a_unit_order`` already in the unit order (W4A4's decoded rows).
        codes, scales: one GEMM's weights, uint8 [E, W_ROWS, K/2] and e4m3 [E, W_ROWS,
            K/16] (W_ROWS = 2 n gated, else n).
        block_expert, block_start, block_end, valid_blocks: the tile schedule of
            ``sort_routes`` with ``block_m`` rows a tile (8 or 16; 32 with ``whole``).
        part: fp32 [cdiv(K, 1024), ws_rows, (2 if gated) * n], every valid row's segment
            partials (split K); None with ``whole``.
        out: the output, written by the kernel (the last unit of each tile, or each whole-K
            program): bf16 rows [ws_rows, n] in sorted order, or with ``fused`` fp32
            [T, n] that router weight (``topk_w`` fp32 [T * topk]) times y is added into.
            None: the partials only (the portable kernel reduces them).
        counters: int32 zeros, cdiv(n, 64) * blocks (left at zero); split K with ``out``.
        w_global: fp32 [E] or [E, 2] (gated). out_scale: the decodes' powers of two.
        a_global: fp32 per row of ``x``, W4A4's activation globals.
        pdl: launched with programmatic dependent launch; ``early_weights``: the schedule
            was complete before the preceding kernel started (as for FC2), so each program
            issues its first weight copies before it waits.
        whole: each program takes every K segment of its tile in turn (``gluon-whole``).
        sm_count: the GPU's SMs: the programs of each (weight tile, K segment) take the
            valid row blocks in turn (``shapes.decode_row_programs``).
    """
    k = x.shape[1]
    if not gluon_decode_fits(k, block_m, UNIT.value, whole):
        raise ValueError(f"split_partials_tma: needs K a multiple of {UNIT.value} and "
                         "block_m 8 or 16 (or 32 with whole)")  # fmt: skip
    tiles, blocks = triton.cdiv(n, _TR.value), block_expert.numel()
    segs = triton.cdiv(k, SEGMENT)
    epilogue = out is not None
    short = not whole and (counters is None or counters.numel() < tiles * blocks)
    if epilogue and (short or w_global is None or (fused and topk_w is None)):
        raise ValueError("split_partials_tma: out needs counters (cdiv(n, 64) * blocks "
                         "int32 zeros), w_global, and topk_w when fused")  # fmt: skip
    if whole and out is None:
        raise ValueError("split_partials_tma: whole needs out")
    if whole:  # no partials and no counters: any fp32 tensor fills their (unread) slots
        segs = 1
        part = w_global
        counters = counters if counters is not None else w_global
    elif part is None:
        raise ValueError("split_partials_tma: part (the fp32 partials) is needed unless whole")
    half = uses_half_ring(whole, k, shapes.scale_rows_tma(scales))
    c_desc, s_desc, s_bytes, s_tma = weight_descriptors(codes, scales, pair=n if gated else 0,
                                                        code_bytes=_code_bytes(half))  # fmt: skip
    dummy = part
    rows, turns = shapes.decode_row_programs(blocks, tiles * segs, sm_count)
    tma_split_kernel[(tiles, segs, rows)](
        x, sorted_routes, c_desc, s_desc, s_bytes, block_expert, block_start,
        block_end, valid_blocks, part,
        counters if epilogue else dummy, w_global if epilogue else dummy,
        topk_w if fused else dummy, out if epilogue else dummy,
        a_global if a_global is not None else dummy, ws_rows,
        N=n, K=k, TOPK=topk, GATED=gated, A_GATHER=gather, BM=block_m, SEG=SEGMENT,
        NBUF=RING_STAGES, EPILOGUE=epilogue, FUSED=fused and epilogue, OUT_SCALE=out_scale,
        A_UNIT_ORDER=a_unit_order, A_FP4=a_global is not None and epilogue, USE_PDL=pdl,
        EARLY_W=pdl and early_weights, WHOLE=whole, E=codes.shape[0], SCALE_TMA=s_tma,
        HALF=half, TURNS=turns, num_warps=4, launch_pdl=pdl, **_regs(gated, block_m),
    )  # fmt: skip


def compile_sm90(*, n: int, k: int, gated: bool, block_m: int, epilogue: bool = True,
                 fused: bool = False, a_fp4: bool = False, pdl: bool = True,
                 early_weights: bool = False, whole: bool = False,
                 experts: int = 32, scale_tma: bool | None = None,
                 turns: int = 1):  # fmt: skip
    """Compile one specialization for sm_90 without a GPU (``common.compile_sm90``); the
    layout conversions are asserted trivial at compile time. ``scale_tma``: the scales by
    TMA (None: as contiguous rows of K / 16 bytes allow, ``shapes.scale_tma``). Returns
    the compiled kernel."""
    ptrs = {
        "x_ptr": "*bf16", "sorted_routes_ptr": "*i32", "block_expert_ptr": "*i32",
        "s_ptr": "*u8", "block_start_ptr": "*i32", "block_end_ptr": "*i32",
        "valid_blocks_ptr": "*i32", "part_ptr": "*fp32",
        "cnt_ptr": "*i32", "w_global_ptr": "*fp32", "topk_w_ptr": "*fp32",
        "out_ptr": "*fp32" if fused else "*bf16", "a_global_ptr": "*fp32",
    }  # fmt: skip
    tr = _TR.value
    stma = shapes.scale_tma(k) if scale_tma is None else scale_tma
    half = uses_half_ring(whole, k, stma)
    cb = _code_bytes(half)
    cs3, cs2 = (CODE_SMEM3_64, CODE_SMEM_64) if half else (CODE_SMEM3, CODE_SMEM)
    if gated:  # the gate and up rows in one copy (``weight_descriptors(pair=n)``)
        descs = {"c_desc": f"tensordesc<u8[2, {tr}, {cb}],{cs3!r}>",
                 "s_desc": f"tensordesc<u8[2, {tr}, 16],{SCALE_SMEM3!r}>"}  # fmt: skip
    else:
        descs = {"c_desc": f"tensordesc<u8[{tr}, {cb}],{cs2!r}>",
                 "s_desc": f"tensordesc<u8[{tr}, 16],{SCALE_SMEM!r}>"}  # fmt: skip
    const = dict(N=n, K=k, TOPK=8, GATED=gated, A_GATHER=gated, BM=block_m, SEG=SEGMENT,
                 NBUF=RING_STAGES, EPILOGUE=epilogue or whole, FUSED=fused,
                 OUT_SCALE=2.0**16 if a_fp4 else 2.0**8, A_UNIT_ORDER=a_fp4, A_FP4=a_fp4,
                 USE_PDL=pdl, EARLY_W=pdl and early_weights, WHOLE=whole, E=experts,
                 SCALE_TMA=stma, HALF=half, TURNS=turns)  # fmt: skip
    return common_compile_sm90(tma_split_kernel, ptrs, const, ints=("ws_rows",), gluon=True,
                               descs=descs, num_warps=4, launch_pdl=pdl,
                               **_regs(gated, block_m))  # fmt: skip
