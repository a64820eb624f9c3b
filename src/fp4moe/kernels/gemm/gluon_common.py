"""The pieces the Gluon GEMMs (``gluon_decode``, ``gluon_prefill``) share: the codes'
register layouts, the decode into the wgmma register fragment, the weights' TMA
descriptors and shared-memory reads, the staging of a segment's activation rows, and the
partial stores, all in the portable loop's unit order, so that the Gluon kernels give
its bits.

The codes are held in the wgmma register fragment's own layout (``code_layout``); every
layout conversion is asserted trivial when compiling:

- the weights are the wgmma A operand (64 rows a warpgroup, from registers); lane
  ``4 i + q`` of warp ``w`` holds rows ``16 w + i`` and ``16 w + i + 8``;
- the unit order (``decode``): thread ``q`` holds the 8 code bytes ``8 q .. 8 q + 7`` of a
  row's 32-byte unit (elements ``16 q .. 16 q + 15``, one scale block); the decode asm's 8
  output registers are its fragment registers of the unit's four k16 steps;
- the activations (wgmma B) go through shared memory in the same order.

A ring stage is 256 K: a [rows, 128-byte] box of codes a weight with a 128-byte swizzle
(the TMA requests read 128 contiguous bytes a row, the unit reads stay free of bank
conflicts) and a [rows, 16-byte] box of scales.
"""

from __future__ import annotations

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    warpgroup_mma_wait,
)

from .decode import CHUNK_DECODE_ASM, HALF_DECODE_ASM
from .shapes import scale_rows_tma

__all__ = [
    "CODE_SMEM",
    "CODE_SMEM3",
    "CODE_SMEM3_64",
    "CODE_SMEM_64",
    "SCALE_SMEM",
    "SCALE_SMEM3",
    "STAGE_K",
    "TILE_ROWS",
    "UNIT",
    "X_SMEM3",
    "code_layout",
    "code_layout3",
    "decode_half",
    "decode_unit",
    "decode_unit_e4m3",
    "last_unit_done",
    "mma_drain",
    "pick_unit",
    "row_globals",
    "smem_stage",
    "smem_unit",
    "split_unit",
    "stage_scales",
    "stage_x",
    "store_partials",
    "tile_index",
    "weight_descriptors",
]

UNIT = gl.constexpr(64)  # K elements a main-loop step (two chunks, four k16 wgmma steps)
STAGE_K = gl.constexpr(256)  # K elements a ring stage (four units; one 16-byte scale box)
TILE_ROWS = gl.constexpr(64)  # weight rows a decode tile (one warpgroup)
# TMA destinations: a stage's codes of one weight [rows, 128 bytes], 128-byte swizzle;
# its scales [rows, 16 bytes] unswizzled
CODE_SMEM = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=8, rank=2)
SCALE_SMEM = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=8, rank=2)
# the same for two blocks of rows in one copy (``weight_descriptors(pair=...)``): [2, rows,
# bytes], laid out as [2 * rows, bytes]
CODE_SMEM3 = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=8, rank=3)
# the split-K ring's 128-K half stages: [rows, 64 bytes] code boxes with a 64-byte swizzle
CODE_SMEM_64 = gl.NVMMASharedLayout(swizzle_byte_width=64, element_bitwidth=8, rank=2)
CODE_SMEM3_64 = gl.NVMMASharedLayout(swizzle_byte_width=64, element_bitwidth=8, rank=3)
SCALE_SMEM3 = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=8, rank=3)
# activation rows already in sorted and unit order, by TMA as [4 units, BM rows, 64]
# boxes of the view [K/64, rows, 64], with the 128-byte swizzle of the wgmma B tiles
X_SMEM3 = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=3)


@gluon.constexpr_function
def code_layout(rows, nbytes=8):
    """The codes of one unit ([rows, 32 bytes], rows 64 with 4 warps or 128 with 8):
    registers hold 8 consecutive bytes of a row (bytes 8 q .. 8 q + 7: elements 16 q ..
    16 q + 15, one scale block) and of the row 8 below; lane 4 i + q holds row i; warp w
    rows 16 w .. 16 w + 15, as the wgmma fragment of the program's warpgroups. With
    ``nbytes`` 4, half a unit ([rows, 16 bytes]): 4 bytes of each block, the same threads."""
    bits = nbytes.bit_length() - 1
    return gl.DistributedLinearLayout(
        reg_bases=[[0, 1 << b] for b in range(bits)] + [[8, 0]],
        lane_bases=[[0, nbytes], [0, 2 * nbytes], [1, 0], [2, 0], [4, 0]],
        warp_bases=[[16 << w, 0] for w in range(rows.bit_length() - 5)],
        block_bases=[],
        shape=[rows, 4 * nbytes],
    )


@gluon.constexpr_function
def code_layout3(rows, nbytes=8):
    """``code_layout(rows, nbytes)`` as [rows, 4 blocks (q), nbytes], whose slice along
    the bytes is the layout of the unit's [rows, 4] scales (one scale a thread and row)."""
    bits = nbytes.bit_length() - 1
    return gl.DistributedLinearLayout(
        reg_bases=[[0, 0, 1 << b] for b in range(bits)] + [[8, 0, 0]],
        lane_bases=[[0, 1, 0], [0, 2, 0], [1, 0, 0], [2, 0, 0], [4, 0, 0]],
        warp_bases=[[16 << w, 0, 0] for w in range(rows.bit_length() - 5)],
        block_bases=[],
        shape=[rows, 4, nbytes],
    )


def weight_descriptors(codes: torch.Tensor, scales: torch.Tensor, rows: int = 64,
                       pair: int = 0, code_bytes: int = 0):  # fmt: skip
    """TMA descriptors of one GEMM's weights: codes uint8 [E, W_ROWS, K/2] as [E * W_ROWS,
    K/2] with [rows, 128-byte] boxes (one 256-K stage, ``CODE_SMEM``), scales e4m3
    [E, W_ROWS, K/16] as bytes with [rows, 16] boxes. With ``pair`` > 0 a box is two
    blocks of ``rows`` rows, the second ``pair`` rows below the first (the up rows of a
    gated GEMM: ``pair`` = n): the weights as [2, E * W_ROWS - pair, bytes] with [2, rows,
    bytes] boxes at (0, first row, byte), ``CODE_SMEM3`` and ``SCALE_SMEM3``.

    Returns (code descriptor, scale descriptor, scale bytes, scales by TMA). Where TMA
    cannot copy the scale rows (``shapes.scale_rows_tma``; the kernels load them by
    pointer, ``stage_scales``) the scale descriptor is one of the codes, never read, and
    the scale bytes are contiguous [E, W_ROWS, K/16] (a copy if ``scales`` was not)."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    c2 = codes.reshape(-1, codes.shape[-1])
    tma = scale_rows_tma(scales)
    s8 = scales.view(torch.uint8)
    if tma:
        s2 = s8.reshape(-1, s8.shape[-1])
    else:
        s2, s8 = c2, s8.contiguous()
    cb = code_bytes or STAGE_K.value // 2
    cl2, cl3 = (CODE_SMEM_64, CODE_SMEM3_64) if cb == 64 else (CODE_SMEM, CODE_SMEM3)
    if not pair:
        return (TensorDescriptor.from_tensor(c2, [rows, cb], cl2),
                TensorDescriptor.from_tensor(s2, [rows, 16], SCALE_SMEM), s8, tma)  # fmt: skip

    def paired(t: torch.Tensor, nbytes: int, layout) -> TensorDescriptor:
        r, sr = t.shape[0], t.stride(0)
        return TensorDescriptor(t, [2, r - pair, t.shape[1]], [pair * sr, sr, 1],
                                [2, rows, nbytes], layout)  # fmt: skip

    return (paired(c2, cb, cl3), paired(s2, 16, SCALE_SMEM3), s8,
            tma)  # fmt: skip


@gluon.jit
def smem_unit(cbuf, sbuf, kb: gl.constexpr, w: gl.constexpr, NB: gl.constexpr,
              UPS: gl.constexpr, TR: gl.constexpr):  # fmt: skip
    """Unit ``kb`` of weight ``w`` from shared memory (its stage's ring buffer of
    [TR, UPS * 32] swizzled bytes, its scale buffer [TR, 16]): codes [TR, 4, 8] in
    ``code_layout3(TR)`` and e4m3 scales [TR, 4] in its slice, as ``decode_unit`` takes."""
    CL: gl.constexpr = code_layout(TR)
    L3: gl.constexpr = code_layout3(TR)
    b: gl.constexpr = (kb // UPS) % NB
    codes = cbuf.index(w * NB + b).slice(32 * (kb % UPS), 32, dim=1).load(CL)
    codes = gl.convert_layout(gl.reshape(codes, [TR, 4, 8]), L3, assert_trivial=True)
    SL: gl.constexpr = gl.SliceLayout(2, L3)
    sc = sbuf.index(w * NB + (kb // 4) % NB).slice(4 * (kb % 4), 4, dim=1).load(SL)
    return codes, sc.to(gl.float8e4nv, bitcast=True)


@gluon.jit
def smem_stage(cbuf, sbuf, kb: gl.constexpr, w: gl.constexpr, NU: gl.constexpr,
               NB: gl.constexpr, UPS: gl.constexpr, TR: gl.constexpr):  # fmt: skip
    """Units ``kb`` .. ``kb + 3`` of weight ``w`` (a stage of four, ``kb`` its first) from
    shared memory, as ``smem_unit`` reads each: (codes, scales) of the four, flattened;
    a unit past the segment's ``NU`` repeats unit ``kb`` (never used)."""
    c0, s0 = smem_unit(cbuf, sbuf, kb, w, NB, UPS, TR)
    c1, s1, c2, s2, c3, s3 = c0, s0, c0, s0, c0, s0
    if kb + 1 < NU:
        c1, s1 = smem_unit(cbuf, sbuf, kb + 1, w, NB, UPS, TR)
    if kb + 2 < NU:
        c2, s2 = smem_unit(cbuf, sbuf, kb + 2, w, NB, UPS, TR)
    if kb + 3 < NU:
        c3, s3 = smem_unit(cbuf, sbuf, kb + 3, w, NB, UPS, TR)
    return c0, s0, c1, s1, c2, s2, c3, s3


@gluon.jit
def stage_scales(s_ptr, row0, row1, rows_total, t, K: gl.constexpr, TR: gl.constexpr):
    """The e4m3 scales of ring stage ``t``'s four units for a tile of ``TR`` weight rows
    (64: from ``row0``; 128: rows 0-63 from ``row0``, 64-127 from ``row1``) by pointer
    loads, each [TR, 4] in ``smem_unit``'s scale layout; zeros past K and past
    ``rows_total``. For scales TMA cannot copy (``shapes.scale_rows_tma``), contiguous:
    rows K / 16 bytes apart (``weight_descriptors`` hands them so)."""
    SL: gl.constexpr = gl.SliceLayout(2, code_layout3(TR))
    r = gl.arange(0, TR, layout=gl.SliceLayout(1, SL))
    q = gl.arange(0, 4, layout=gl.SliceLayout(0, SL))
    wrow = gl.where(r < 64, row0 + r, row1 + r - 64)
    base = s_ptr + wrow.to(gl.int64)[:, None] * (K // 16)
    r_ok = (wrow < rows_total)[:, None]
    out0 = _unit_scales(base, r_ok, t * 16 + q, K)
    out1 = _unit_scales(base, r_ok, t * 16 + 4 + q, K)
    out2 = _unit_scales(base, r_ok, t * 16 + 8 + q, K)
    out3 = _unit_scales(base, r_ok, t * 16 + 12 + q, K)
    return out0, out1, out2, out3


@gluon.jit
def _unit_scales(base, r_ok, col, K: gl.constexpr):
    """One unit's scales (columns ``col`` of the rows at ``base``), zeros where masked."""
    ok = r_ok & (col < K // 16)[None, :]
    sc = gl.load(base + col[None, :], mask=ok, other=0)
    return sc.to(gl.float8e4nv, bitcast=True)


@gluon.jit
def pick_unit(c0, c1, c2, c3, u: gl.constexpr):
    """Unit ``u``'s scales of a stage's four (``stage_scales``)."""
    if u == 0:  # noqa: SIM116 (constexpr branches of a jit function)
        return c0
    elif u == 1:
        return c1
    elif u == 2:
        return c2
    else:
        return c3


@gluon.jit
def _scales_bf16(sc):
    """e4m3 block scales as bf16 times 2^118 (exact), as the decode asm multiplies."""
    return (sc.to(gl.float32) * 3.32306998946229e35).to(gl.bfloat16)


@gluon.jit
def _decode_nibbles(codes, sb, TR: gl.constexpr):
    """B code bytes a thread, block and row ([TR, 4 blocks, B]: B 8, a unit in
    ``code_layout3(TR)``, or 4, half a unit in ``code_layout3(TR, 4)``; whole 32-bit words
    of the fields layout, ``fields``) with their scales (``_scales_bf16``, [TR, 4]) to the
    values of the B even and the B odd elements (the low and high nibbles of the linear
    form's bytes) times 2^-8, bf16, joined: [TR, 4 B bytes (q, s, a), 2 (b)]."""
    B: gl.constexpr = codes.shape[2]
    CL: gl.constexpr = code_layout(TR, B)
    sb, codes = gl.broadcast(gl.expand_dims(sb, 2), codes)
    codes = gl.convert_layout(gl.reshape(codes, [TR, 4 * B]), CL, assert_trivial=True)
    sb = gl.convert_layout(gl.reshape(sb, [TR, 4 * B]), CL, assert_trivial=True)
    if B == 8:
        lo, hi = gl.inline_asm_elementwise(
            CHUNK_DECODE_ASM, "=r,=r,=r,=r,=r,=r,=r,=r,r,r,r,r,r,r",
            [codes, sb], dtype=(gl.bfloat16, gl.bfloat16), is_pure=True, pack=8,
        )  # fmt: skip
    else:
        lo, hi = gl.inline_asm_elementwise(
            HALF_DECODE_ASM, "=r,=r,=r,=r,r,r,r",
            [codes, sb], dtype=(gl.bfloat16, gl.bfloat16), is_pure=True, pack=4,
        )  # fmt: skip
    return gl.join(lo, hi)


@gluon.jit
def _unit_order(w, A_L: gl.constexpr, TR: gl.constexpr):
    """``_decode_nibbles``' values [TR, 4 B, 2] to the A fragment ``A_L`` of [TR, 8 B] in
    the unit order: byte 8 q + 2 s + a, nibble b holds element 16 q + 4 s + 2 a + b, at
    position 16 s + 8 b + 2 q + a (s < B / 2: the k16 steps of a unit, or of a half)."""
    S: gl.constexpr = w.shape[1] // 8
    w = gl.reshape(w, [TR, 4, S, 2, 2])  # [row, q, s, a, b]
    w = gl.permute(w, [0, 2, 4, 1, 3])  # [row, s, b, q, a]
    w = gl.reshape(w, [TR, 16 * S])
    return gl.convert_layout(w, A_L, assert_trivial=True)


@gluon.jit
def decode_unit(codes, sc, A_L: gl.constexpr, TR: gl.constexpr = 64):
    """Decode one unit ([TR rows, 64 K]; TR 64, or 128 with 8 warps) of weights into the
    wgmma A fragment ``A_L``: the portable loop's decode (the same operations and bits)."""
    return _unit_order(_decode_nibbles(codes, _scales_bf16(sc), TR), A_L, TR)


@gluon.jit
def split_unit(codes, sc):
    """A unit's codes ([TR, 4, 8], ``smem_unit``) as its two halves [TR, 4, 4] (bytes 0-3
    and 4-7 of each block: k16 steps 0-1 and 2-3 of the unit order), and its scales as
    ``decode_half`` takes them ([TR, 4])."""
    TR: gl.constexpr = codes.shape[0]
    H3: gl.constexpr = code_layout3(TR, 4)
    c = gl.permute(gl.reshape(codes, [TR, 4, 2, 4]), [0, 1, 3, 2])
    c0, c1 = gl.split(c)
    c0 = gl.convert_layout(c0, H3, assert_trivial=True)
    c1 = gl.convert_layout(c1, H3, assert_trivial=True)
    sb = gl.convert_layout(_scales_bf16(sc), gl.SliceLayout(2, H3), assert_trivial=True)
    return c0, c1, sb


@gluon.jit
def decode_half(codes, sb, A_L: gl.constexpr, TR: gl.constexpr = 64):
    """Decode half a unit ([TR rows, 32 K]: k16 steps 0-1 or 2-3 of the unit order, from
    ``split_unit``) into the wgmma A fragment ``A_L``: ``decode_unit``'s operations and
    values for those steps."""
    return _unit_order(_decode_nibbles(codes, sb, TR), A_L, TR)


@gluon.jit
def decode_unit_e4m3(codes, sc, A_L: gl.constexpr, TR: gl.constexpr = 64):
    """Decode one unit ([TR rows, 64 K]) of weights to W4A8's e4m3(code x scale / 8) in
    the FP8 wgmma A fragment ``A_L`` (k_width 4, two k32 steps): ``decode_unit``'s values
    times 32 (exact), rounded to nearest even by the hardware's conversion, in W4A8's unit
    order (position 16 s + 4 q + 2 a + b holds element 16 q + 4 s + 2 a + b), where each
    thread's 16 decoded values of a row are its fragment bytes."""
    w = _decode_nibbles(codes, _scales_bf16(sc), TR)  # [TR, 32 bytes (q, s, a), 2 (b)]
    w = (w.to(gl.float32) * 32.0).to(gl.float8e4nv)
    w = gl.reshape(w, [TR, 4, 4, 2, 2])  # [row, q, s, a, b]
    w = gl.permute(w, [0, 2, 1, 3, 4])  # [row, s, q, a, b]
    w = gl.reshape(w, [TR, UNIT])
    return gl.convert_layout(w, A_L, assert_trivial=True)


@gluon.jit
def stage_x(x_ptr, sorted_routes_ptr, start, end, k0, K: gl.constexpr, TOPK: gl.constexpr,
            A_GATHER: gl.constexpr, BM: gl.constexpr, SEG: gl.constexpr,
            A_UNIT_ORDER: gl.constexpr, xs, NWARPS: gl.constexpr = 4,
            CH: gl.constexpr = 0):  # fmt: skip
    """The row block's activations of one K segment in the unit order, into the caller's
    shared buffer ``xs`` [SEG / 64 * BM, 64] (unit-major, ``NVMMASharedLayout`` of [BM,
    64]), fenced and synchronized for the wgmma: rows ``start`` .. ``end`` (A_GATHER:
    tokens route // TOPK of the sorted routes), zeros past ``end``; A_UNIT_ORDER: the rows
    are in the unit order already (only unit-major); NWARPS: the program's warps; CH (0:
    the whole segment): loaded and stored CH K elements at a time, which holds CH / SEG of
    the registers (32-row tiles: a segment's rows are 128 registers a thread)."""
    src, m_ok = _x_rows(sorted_routes_ptr, start, end, TOPK, A_GATHER, BM, NWARPS)
    if CH == 0 or CH == SEG:
        x = _x_stage(x_ptr, src, m_ok, k0, K, BM, SEG, A_UNIT_ORDER, NWARPS)
        xs.store(x)
    else:  # unit-major: chunk c is units c * CH / 64 .., rows of xs from c * CH / 64 * BM
        CU: gl.constexpr = CH // UNIT
        for c in gl.static_range(SEG // CH):
            x = _x_stage(x_ptr, src, m_ok, k0 + c * CH, K, BM, CH, A_UNIT_ORDER, NWARPS)
            xs.slice(c * CU * BM, CU * BM).store(x)
    fence_async_shared()
    gl.thread_barrier()
    return xs


@gluon.jit
def _x_rows(sorted_routes_ptr, start, end, TOPK: gl.constexpr, A_GATHER: gl.constexpr,
            BM: gl.constexpr, NWARPS: gl.constexpr = 4):  # fmt: skip
    """The row block's source rows of x (A_GATHER: token route // TOPK of the sorted routes,
    else the sorted row) as int64, and which of the BM rows are valid (``_x_stage``'s
    layout)."""
    XM: gl.constexpr = gl.BlockedLayout([1, 8], [2, 16], [4, NWARPS // 4], [1, 0])
    offs_m = start + gl.arange(0, BM, layout=gl.SliceLayout(1, XM))
    m_ok = offs_m < end
    if A_GATHER:
        route = gl.load(sorted_routes_ptr + offs_m, mask=m_ok, other=0)
        src = route // TOPK
    else:
        src = offs_m
    return gl.where(m_ok, src, 0).to(gl.int64), m_ok


@gluon.jit
def _x_stage(x_ptr, src, m_ok, kbase, K: gl.constexpr, BM: gl.constexpr,
             SK: gl.constexpr, A_UNIT_ORDER: gl.constexpr = False,
             NWARPS: gl.constexpr = 4):  # fmt: skip
    """Registers of x's rows ``src`` (zeros where not ``m_ok`` and past K) at K ``kbase``
    .. + SK in the unit order, [SK / 64 * BM, 64] (unit-major); A_UNIT_ORDER: the rows are
    in the unit order already. NWARPS: the program's warps (the layout's second
    dimension)."""
    XM: gl.constexpr = gl.BlockedLayout([1, 8], [2, 16], [4, NWARPS // 4], [1, 0])
    NU: gl.constexpr = SK // UNIT
    kk = gl.arange(0, SK, layout=gl.SliceLayout(0, XM))
    if K % SK == 0:
        mask = m_ok[:, None]
    else:  # the last, partial segment: zeros past K
        mask = m_ok[:, None] & (kbase + kk < K)[None, :]
    x = gl.load(x_ptr + src[:, None] * K + kbase + kk[None, :], mask=mask, other=0.0)
    if A_UNIT_ORDER:  # [m, unit, 64] -> [unit, m, 64]
        x = gl.permute(gl.reshape(x, [BM, NU, UNIT]), [1, 0, 2])
    else:
        x = gl.reshape(x, [BM, NU, 4, 4, 2, 2])  # [m, unit, q, s, a, b]
        x = gl.permute(x, [1, 0, 3, 5, 2, 4])  # [unit, m, s, b, q, a]
    return gl.reshape(x, [NU * BM, UNIT])


@gluon.jit
def tile_index(pid_n, start, end, N: gl.constexpr, BM: gl.constexpr, MMA: gl.constexpr,
               TR: gl.constexpr = 64):  # fmt: skip
    """A [TR weight rows, BM token rows] tile's indices in the ``MMA`` layout: its output
    columns ``on`` (weight tile ``pid_n``), its sorted rows ``om`` (from ``start``), which
    rows are valid (``m_ok``: below ``end``) and the [TR, BM] mask of valid elements."""
    on = pid_n * TR + gl.arange(0, TR, layout=gl.SliceLayout(1, MMA))
    om = start + gl.arange(0, BM, layout=gl.SliceLayout(0, MMA))
    n_ok = on < N
    m_ok = om < end
    return on, om, m_ok, n_ok[:, None] & m_ok[None, :]


@gluon.jit
def store_partials(acc_g, acc_u, part_ptr, pid_n, start, end, s_id, ws_rows,
                   N: gl.constexpr, GATED: gl.constexpr, BM: gl.constexpr,
                   MMA: gl.constexpr, TR: gl.constexpr = 64):  # fmt: skip
    """Write a unit's fp32 partials [TR, BM] (and up's, GATED) as the portable loop's split
    programs do: segment ``s_id`` of ``part`` [segments, ws_rows, (2 if GATED) * N], valid
    rows only. Returns the segment stride (elements)."""
    if GATED:
        gn: gl.constexpr = 2 * N
    else:
        gn: gl.constexpr = N
    on, om, _, pmask = tile_index(pid_n, start, end, N, BM, MMA, TR)
    stride = ws_rows.to(gl.int64) * gn
    prow = part_ptr + s_id * stride + om.to(gl.int64)[None, :] * gn + on[:, None]
    gl.store(prow, acc_g, mask=pmask)
    if GATED:
        gl.store(prow + N, acc_u, mask=pmask)
    return stride


@gluon.jit
def row_globals(a_global_ptr, sorted_routes_ptr, om, m_ok, TOPK: gl.constexpr,
                A_GATHER: gl.constexpr):  # fmt: skip
    """W4A4's activation global of each output row ``om`` (``m_ok`` the valid ones, 1.0
    elsewhere): by token (the sorted route // TOPK) when A_GATHER, else by sorted row."""
    if A_GATHER:
        r = gl.load(sorted_routes_ptr + om, mask=m_ok, other=0) // TOPK
    else:
        r = om
    return gl.load(a_global_ptr + gl.where(m_ok, r, 0).to(gl.int64), mask=m_ok, other=1.0)


@gluon.jit
def last_unit_done(acc_g, acc_u, pg, pu, GATED: gl.constexpr):
    """Wait for the last unit's wgmmas (its decoded operands ``pg``, ``pu``: their
    registers free after it); the sums."""
    if GATED:
        acc_g, acc_u, _, _ = warpgroup_mma_wait(num_outstanding=0, deps=(acc_g, acc_u, pg, pu))
    else:
        acc_g, _ = warpgroup_mma_wait(num_outstanding=0, deps=(acc_g, pg))
    return acc_g, acc_u


@gluon.jit
def mma_drain(acc_g, acc_u, GATED: gl.constexpr):
    """Wait for every asynchronous wgmma in flight into ``acc_g`` (and ``acc_u`` when
    GATED); the accumulators to read afterwards."""
    if GATED:
        acc_g, acc_u = warpgroup_mma_wait(num_outstanding=0, deps=(acc_g, acc_u))
    else:
        acc_g = warpgroup_mma_wait(num_outstanding=0, deps=(acc_g,))
    return acc_g, acc_u
