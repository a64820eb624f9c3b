"""The split-K ring of two 128-K half stages (``gluon_decode``'s split form with the
scales by TMA, a last, partial segment included): in the shared memory of one 256-K ring stage,
the next half stage's copy flies while the other is decoded. Codes come as [64 rows, 64
bytes] boxes with a 64-byte swizzle; each 256-K pair's scales are copied with its even
half into one of two scale buffers. The units, order and sums are those of
``gluon_decode``'s ring of 256-K stages, so the bits are the same.
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
)

from .gluon_common import (
    CODE_SMEM3_64,
    CODE_SMEM_64,
    SCALE_SMEM,
    SCALE_SMEM3,
    TILE_ROWS,
    UNIT,
    decode_unit,
    last_unit_done,
    mma_drain,
    smem_unit,
    stage_x,
)

__all__ = ["HALF_K", "half_buffers", "issue_half", "segment_half", "uses_half_ring"]

HALF_K = gl.constexpr(128)  # K a half stage
_TR = TILE_ROWS


def uses_half_ring(whole: bool, k: int, scale_tma: bool) -> bool:
    """Split K on the ring of two half stages: the scales by TMA (else ``gluon_decode``'s
    ring of ``RING_STAGES`` 256-K stages); a last, partial segment (K in whole units)
    takes it too. In the shared memory of one 256-K stage the next half stage's copy
    flies while one is decoded, and FC1's 8-row programs keep 6 an SM (sm_90: 72
    registers, 36880 bytes)."""
    return not whole and k % UNIT.value == 0 and scale_tma


@gluon.jit
def half_buffers(GATED: gl.constexpr):
    """Two half-stage code buffers [NW, 64, 64] (64-byte swizzle), two scale buffers [NW,
    64, 16] (one a 256-K pair of half stages), the two stages' mbarriers, initialized."""
    NW: gl.constexpr = 2 if GATED else 1  # weight row blocks a copy (gate and up)
    cb0 = gl.allocate_shared_memory(gl.uint8, [NW, _TR, HALF_K // 2], CODE_SMEM_64)
    cb1 = gl.allocate_shared_memory(gl.uint8, [NW, _TR, HALF_K // 2], CODE_SMEM_64)
    sb0 = gl.allocate_shared_memory(gl.uint8, [NW, _TR, 16], SCALE_SMEM)
    sb1 = gl.allocate_shared_memory(gl.uint8, [NW, _TR, 16], SCALE_SMEM)
    bars = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    mbarrier.init(bars.index(0), count=1)
    mbarrier.init(bars.index(1), count=1)
    return cb0, cb1, sb0, sb1, bars


@gluon.jit
def issue_half(c_desc, s_desc, cb, sb, bar, row, k0, st: gl.constexpr,
               GATED: gl.constexpr):  # fmt: skip
    """Half stage ``st`` of the segment at ``k0`` into code buffer ``cb``; an even one also
    copies the scales of its 256-K pair into ``sb``."""
    NW: gl.constexpr = 2 if GATED else 1  # weight row blocks a copy (gate and up)
    if st % 2 == 0:
        BYTES: gl.constexpr = NW * _TR * (HALF_K // 2 + 16)
    else:
        BYTES: gl.constexpr = NW * _TR * (HALF_K // 2)
    mbarrier.expect(bar, BYTES)
    k = k0 + st * HALF_K
    if GATED:
        cdst = cb._reinterpret(gl.uint8, [2, _TR, HALF_K // 2], CODE_SMEM3_64)
        tma.async_copy_global_to_shared(c_desc, [0, row, k // 2], bar, cdst)
        if st % 2 == 0:
            sdst = sb._reinterpret(gl.uint8, [2, _TR, 16], SCALE_SMEM3)
            tma.async_copy_global_to_shared(s_desc, [0, row, k // 16], bar, sdst)
    else:
        tma.async_copy_global_to_shared(c_desc, [row, k // 2], bar, cb.index(0))
        if st % 2 == 0:
            tma.async_copy_global_to_shared(s_desc, [row, k // 16], bar, sb.index(0))


@gluon.jit
def segment_half(
    x_ptr, sorted_routes_ptr, c_desc, s_desc, cb0, cb1, sb0, sb1, bars, xd, row, start, end,
    kj, K: gl.constexpr, TOPK: gl.constexpr, A_GATHER: gl.constexpr, BM: gl.constexpr,
    SEG: gl.constexpr, NU: gl.constexpr, GATED: gl.constexpr, A_UNIT_ORDER: gl.constexpr,
    MMA: gl.constexpr, A_L: gl.constexpr,
):  # fmt: skip
    """``gluon_decode``'s sums of one K segment of ``NU`` units (SEG / 64, or fewer in a
    last, partial segment) on the ring of two half stages (the first two issued before,
    only the first where the segment has one): the same units, order and sums, so the
    same bits. Past K the copies read zeros and the rows are staged as zeros, into ``xd``
    (``stage_x``'s buffer)."""
    NS: gl.constexpr = (NU + 1) // 2  # half stages (a partial segment's last: one unit)
    xs = stage_x(x_ptr, sorted_routes_ptr, start, end, kj, K, TOPK, A_GATHER, BM, SEG,
                 A_UNIT_ORDER, xd)  # fmt: skip
    acc_g = gl.zeros([_TR, BM], gl.float32, layout=MMA)
    acc_u = gl.zeros([_TR, BM], gl.float32, layout=MMA)
    for kb in gl.static_range(NU):
        st = kb // 2
        if kb % 2 == 0:
            mbarrier.wait(bars.index(st % 2), (st // 2) % 2)
        if st % 2 == 0:
            cb = cb0
        else:
            cb = cb1
        if (kb // 4) % 2 == 0:
            sb = sb0
        else:
            sb = sb1
        xb = xs.slice(kb * BM, BM).permute((1, 0))
        gc, gs = smem_unit(cb, sb, kb, 0, 1, 2, _TR)
        wg = decode_unit(gc, gs, A_L, _TR)
        if kb > 0:
            acc_g, acc_u = last_unit_done(acc_g, acc_u, pg, pu, GATED)  # noqa: F821
        acc_g = warpgroup_mma(wg, xb, acc_g, is_async=True)
        pg = wg  # noqa: F841
        pu = wg  # the ungated wait's argument, not read
        if GATED:
            uc, us = smem_unit(cb, sb, kb, 1, 1, 2, _TR)
            wu = decode_unit(uc, us, A_L, _TR)
            acc_u = warpgroup_mma(wu, xb, acc_u, is_async=True)
            pu = wu  # noqa: F841
        if kb % 2 == 1 and st + 2 < NS:  # the stage read: refill its buffer with st + 2
            if ((st + 2) // 2) % 2 == 0:
                nsb = sb0
            else:
                nsb = sb1
            gl.thread_barrier()
            fence_async_shared()
            issue_half(c_desc, s_desc, cb, nsb, bars.index((kb // 2) % 2), row, kj, kb // 2 + 2,
                       GATED)  # fmt: skip
    return mma_drain(acc_g, acc_u, GATED)
