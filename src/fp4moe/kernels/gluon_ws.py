"""The decode-size grouped GEMMs in Gluon, fed by TMA: loop 3's split-K units (64 weight
rows, one 1024-element K segment, 8 or 16 token rows) with the same operands, order and
sums, so the same bits (``TritonOptions.gluon_decode``, on by default on a Hopper GPU
where loop 3 splits K).

Session 8's stall counts (docs/perf-notes.md) put the decode-size GEMMs' time in waits on
global loads and barriers: each program was a chain of (load a K tile, decode, wgmma,
wait) with two or three tiles in flight. Here one elected thread of the program issues
TMA copies of the segment's weights (codes as [64 rows, 32 bytes] boxes, one a 64-element
unit, so a warp's shared loads read 256 contiguous bytes; scales as [64, 16] boxes, one a
stage of four units) into a ring of ``BUFFERS`` stages, each with its own mbarrier; the
activation tile is staged while they fly; the codes go from shared memory straight into
the wgmma register fragment's layout (``gluon_decode._CL``) and are decoded there. With
``EPILOGUE`` the last unit of a tile (a counter, as loop 3's split programs) sums the
partials in segment order and writes the W4A16 or W4A4 output itself (``gemm._epilogue``'s
operations). W4A4 reads its activation rows already decoded (``A_UNIT_ORDER``).

Measured on the H200 (docs/perf-notes.md, session 9): one buffer, asynchronous wgmma and
the epilogue in the kernel are the fastest; DeepSeek-V3 EP8 W4A16 whole calls 10% to 16%
faster than loop 3 at 1 to 32 tokens. Session 11: the codes of a stage as one [64, 128]
box with a 128-byte swizzle (``CODE_WIDE``: 128-byte rows in the TMA requests, 2% to 7%
off whole calls), the kernels in the call's PDL chain up to 32 expected valid routes
(``TritonOptions.gluon_pdl_upto``; FC2 issues its first copies before its wait,
``EARLY_WEIGHTS``); ring stages of 64 or 128 K (``STAGE_K``) measured no faster.
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
    warpgroup_mma_wait,
)

from .common import compile_sm90 as common_compile_sm90
from .gluon_decode import (
    UNIT,
    _decode_unit,
    _row_globals,
    _stage_x,
    _store_partials,
    _tile_index,
    _x_rows,
    _x_stage,
    code_layout,
    code_layout3,
)

# split_partials_tma's defaults: the ring's stages of 256 K in shared memory (1: 18 KB a
# program for FC1, so more programs an SM; the fastest of 1, 2, 4 on the H200, session 9),
# and the asynchronous main loop (the next unit's decode overlaps this unit's wgmma)
BUFFERS = 1
ASYNC_WGMMA = True
# A stage's codes of one weight as one 3-D TMA box [4 units, 64 rows, 32 bytes] (the codes
# viewed as [K/64, rows, 32], strides 32 and K/2 bytes) instead of four [64, 32] boxes: a
# quarter of the copies, and of the bar.sync Triton puts between them (FC1: 49 -> 25 a
# program). The default since session 10: the same bits, whole W4A16 calls (DeepSeek-V3
# EP8, two rounds each) 1 / 8 / 16 / 32 tokens 48.8 / 99.7 / 59.9 / 168.3 -> 47.0 / 96.4 /
# 58.8 / 161.6 us (gluon_experiment.py --whole-only [--four-boxes]). Used where CODE_WIDE
# is off or does not apply (stages below 256 K).
CODE_BOX3 = True
# K elements a stage of the code ring (64, 128 or 256: one, two or four units). The scales
# come in groups of 256 K (their TMA box is 16 bytes wide), loaded with the first stage of
# each group into a ring of their own (``scale_slots``), so stages below 256 K let the
# next stage's copies fly while this one is decoded at the shared memory of one 256 K stage.
STAGE_K = 256
STAGE = 256  # K elements a scale group; a segment is a multiple of it
# With PDL, FC2's programs (whose schedule the sort wrote two kernels back) issue their
# first weight copies before they wait for FC1's rows: those bytes fly during FC1's tail
EARLY_WEIGHTS = True
PDL = True  # the Gluon kernels join the call's PDL chain (off: plain launches, as before)
# Experiment (session 13, off, not yet timed): without A_TMA, the activation rows go into
# shared memory a ring stage at a time (two buffers of SK / 64 * BM rows, the next stage's
# rows loaded into registers while this stage is decoded) instead of the whole segment
# before the loop: 8 KB less shared memory at 8-row tiles (FC1 34.8 -> 26.6 KB), so two
# ring buffers of weights (BUFFERS 2) fit 5 FC1 and 8 FC2 programs an SM, without the
# gather launch that gluon_a_tma needs. The same operands and order: the same bits.
X_RING = False
# X_RING applies to these (GEMM, tile height) only, under this register cap (without a
# stack; uncapped FC1 / FC2 need 86 / 70): two ring buffers fit 5 FC1 programs an SM
# (45.1 KB; without X_RING 53.3 KB, 4) and 8 FC2 programs (26.6 KB; without, 34.8 KB, 6).
# The 16-row tiles keep the segment's rows (FC1 needs 111 registers with X_RING).
X_RING_MAXNREG = {(True, 8): 72, (False, 8): 64}
# Experiment (session 14, off until measured): L2_AHEAD stages of each program's segment
# beyond its shared-memory ring are prefetched into L2 (``cp.async.bulk.prefetch.L2``, one
# row's bytes a thread: about two instructions a thread a stage), the first of them with
# the ring's first copies and then one stage each time a stage lands. Session 13 found the
# call's time close to the sum of the copies' time and the decode's issue: with one ring
# buffer a program's next copy leaves only after this stage's decode, and every program
# of a wave is in the same phase. The prefetch keeps HBM streaming while the programs
# decode, at no shared memory and almost no instructions; the TMA copies then read L2.
# A hint only: the same bits.
L2_AHEAD = 0
# Timing diagnostics, WRONG RESULTS (gluon_experiment.py --diag): 1 the weights not decoded
# (zeros: the copies, shared loads of the scales' layout aside, and wgmmas alone), 2 no
# copies and no waits (the decode of whatever shared memory holds: issue alone), 3 neither
# (the skeleton: schedule reads, the rows' staging, the wgmmas on zeros, the epilogue), 4
# the skeleton without its wgmmas (schedule reads, the rows' staging, the epilogue on zero
# partials; session 17's next step: how much of DIAG 3 the wgmma chain is)
DIAG = 0
# Per-program timeline (benchmarks/gluon_timeline.py; the results stay right): with TRACE
# each launch records, a program, TRACE_FIELDS int64 stamps into a buffer appended to
# TRACES as (launch facts, buffer): %globaltimer at the start and end, %clock64 at each
# phase boundary, the SM and the block's expert (-1: an empty program). Eager calls only
# (the buffer is allocated a launch); not with grid_blocks.
TRACE = False
TRACES: list = []
# Experiment (session 15, 64 = off; refuted in session 16): weight tiles of TILE_ROWS = 128 rows
# with 8 warps (two warpgroups, one wgmma each on its 64 rows) instead of 64 rows with 4,
# in the one-block body with CODE_WIDE boxes. Two 64-row tiles then share one staged
# activation tile (16 KB of FC1's 34.8 KB a program at 8-row tiles, mostly zeros at
# decode sizes) and one program's schedule reads, barrier waits and epilogue: FC1 52 KB a
# program of 8 warps, so 4 programs (32 warps) an SM at 64 registers, against 6 programs
# of 4 warps (24) now, and half the programs (16 tokens: 448 FC1 programs, one wave).
# Session 15's ncu data found the kernels latency-bound at 24 warps an SM (perf-notes,
# session 15, item 4). Each row's operands and order are those of the 64-row tile: the
# same bits. Used where N % 128 == 0; else 64. Measured (session 16, item 1): the same
# bits, more warps and issue an SM, no faster at 16 tokens and 5 to 7 us slower at 1 and
# 8 (DeepSeek-V3 EP8 W4A16 whole calls 44.4 / 90.7 / 60.0 -> 51.2 / 96.0 / 58.3 us).
TILE_ROWS = 64
# TILE_ROWS 128's register cap by (gated, block_m): FC1's 8-row tiles need 67 uncapped,
# 64 fit 4 programs of 8 warps an SM (52 KB each) with no stack (compiled on the CPU);
# FC1's 16-row tiles need 79 (68 KB: 3 programs), spill at 64; FC2 needs 62 / 54.
TILE_ROWS_MAXNREG = {(True, 8): 64}
# Experiment (session 15, off): half the programs (a hash of the program's slot) sleep
# SKEW_NS nanoseconds (``nanosleep``) before their first copies, so that the programs of an
# SM are not all in the same phase (copies, then decode). Session 14 found each decode
# GEMM's span the sum of its issue time and its bytes' time at 1 and 16 tokens; if the
# programs' common phase is why, a skew moves the span toward the larger of the two. The
# results stay right (the same bits).
SKEW_NS = 0
TRACE_FIELDS = 16
# the stamps' columns
T_GSTART, T_GEND, T_START, T_WAIT, T_SCHED, T_ISSUE, T_X, T_W0, T_LOOP, T_PART, T_END = range(11)
T_SM, T_EXPERT = 11, 12
# TMA destinations, unswizzled: a [64, 32] code box is 64 rows of 32 bytes
CODE_SMEM = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=8, rank=2)
SCALE_SMEM = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=8, rank=2)
CODE_SMEM3 = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=8, rank=3)
# A stage's codes of one weight as one 2-D box [64 rows, 128 bytes] with a 128-byte swizzle
# (the unit reads stay free of bank conflicts) instead of CODE_BOX3's box of 32-byte rows:
# the TMA requests read 128 contiguous bytes a row instead of 32. The default since session
# 11: the same bits, whole W4A16 calls (gluon_experiment.py --codes box3 wide, two rounds)
# DeepSeek-V3 EP8 1 / 8 / 16 / 32 tokens 48.7 / 96.6 / 60.4 / 164.7 -> 47.2 / 92.8 / 58.3 /
# 156.8 us, 64 / 128 tokens 222.4 / 345.0 -> 207.3 / 326.8, Mixtral-8x7B 16 tokens 287.0 ->
# 268.8. Needs STAGE_K 256.
CODE_WIDE = True
# Experiment (session 13, off): the Gluon kernels read a tiled copy of the weights
# (``tiled_weights``: each 64-row tile's 256-K stage as 8 KB of contiguous codes and 1 KB
# of scales) instead of 64 rows of 128 bytes (and 16 bytes of scales) K/2 bytes apart, to
# measure what the weights' row-major layout costs the copies. Timing only (a second
# copy of the weights, made once a tensor and kept in TILED_CACHE); the same bits.
# Measured (session 13, ``sweep_decode.py --variants c3 c3-tiled``, W4A16 1 / 16 / 64
# tokens 45.2 / 61.6 / 212.8 -> 45.1 / 60.1 / 209.3 us): within noise, so the layout stays.
TILED = False
TILED_CACHE: dict = {}
CODE_SMEM_W = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=8, rank=2)
# A_TMA (TritonOptions.gluon_a_tma): x's rows, already sorted and in the unit order, come by
# TMA with each stage as one [SK / 64, BM, 64] box of the view [K/64, rows, 64]: 128-byte
# rows with the 128-byte swizzle of the wgmma B tiles _stage_x writes
X_SMEM3 = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=3)
# LOOP (grid_blocks): registers capped at what the shared memory's programs an SM allow
# (65536 / (128 threads x programs), multiples of 8; FC1 / FC2, 8-row tiles: 6 / 8
# programs, 16-row: 4 / 5), keyed (gated, block_m). Uncapped the loop needs 79 / 56 (8-row
# tiles) against 66 / 51 without it; before the rows' buffer was indexed by an opaque zero
# it needed 211 / 168 (hoisted wgmma descriptors), and the cap spilled.
LOOP_MAXNREG = {(True, 8): 80, (False, 8): 64, (True, 16): 128, (False, 16): 96}


# PERSIST's programs an SM, keyed (gated, block_m): the slots of the compiled kernel (FC1 /
# FC2 with CODE_WIDE, the epilogue and PDL: 8-row tiles 72 / 56 registers, 34.9 / 25.7 KB
# of shared memory, so 6 / 8 programs an SM; 16-row 92 / 86 and 51.3 / 42.1 KB, so 4 / 5).
# PERSIST is off (TritonOptions.gluon_persist): slower than the worst-case grid (session 13,
# measured with LOOP_MAXNREG's caps, which gave FC2's 8-row tiles a 16-byte stack; the
# launch no longer caps PERSIST)
# The ring's 256-K stages of the whole-K programs (``split_partials_tma(whole=True)``; 1:
# FC1 at 16-row tiles 51 KB and 121 registers, four programs an SM; 2: 69 KB, three, within
# 3% in session 18). They take no register cap.
WHOLE_BUFFERS = 1
# Session 19's WS_PRODUCER (the one-block body under gl.warp_specialize: a TMA producer
# warp and a ring of four 64-K stages the consumer warpgroup released) was removed in
# session 20: slower at 8 to 64 tokens and wrong bits in two cases (docs/perf-notes.md,
# session 20 item 1; the code is in git before that session's removal commit).
# The whole-K programs an SM holds, by gated (FC1: 16-row tiles 121 registers and 51 KB,
# four; FC2: 96 and 42 KB, five; compiled for sm_90), for TritonOptions.gluon_whole_fill
WHOLE_PER_SM = {True: 4, False: 5}
# Experiment (session 19, off: refuted): a valid program's block start and end loaded
# beside its expert (before the branch on it) instead of after: one dependent L2 round trip
# the less before its first copies and its rows' staging, in the one-block body. The same
# bits. Measured (``sweep_decode.py --variants c3 c3-sched``, two processes, DeepSeek-V3
# EP8 W4A16 1 / 8 / 16 / 32 / 64 tokens, us): 44.9, 46.5 / 93.6, 92.8 / 57.5, 57.7 /
# 160.2, 156.4 / 206.4, 206.0 -> 44.6, 45.3 / 90.6, 93.7 / 58.1, 58.1 / 159.7, 155.8 /
# 210.1, 206.1: within run noise; a round trip is not what a program's chain waits on.
SCHED_AHEAD = False
# Experiment (built in session 23, not yet run on a GPU; off): these kernels and
# gluon_prefill's read a copy of the codes in the rotated layout
# (``cuda_decode.rotated_codes``, made once a codes tensor and kept) and decode each code
# word in 15 instructions instead of 18 (``gemm._CHUNK_DECODE_ROT_ASM``), into the same
# registers: the same bits. The measure of whether that layout is worth a new format
# (docs/perf-notes.md session 23).
ROT_LAYOUT = False
PERSIST_PER_SM = {(True, 8): 6, (False, 8): 8, (True, 16): 4, (False, 16): 5}
# The ring buffers of PERSIST's launches (None: BUFFERS, as every launch). Session 15: with
# two, a program's next stage flies while it decodes, across its units as well.
PERSIST_BUFFERS: int | None = None


def scale_slots(buffers: int, stage_k: int) -> int:
    """Scale-group buffers a ring of ``buffers`` code stages of ``stage_k`` needs: every
    group any ``buffers`` consecutive stages touch (groups of 256 K, ``256 // stage_k``
    stages each), so a group's buffer is refilled only after all its stages are read."""
    r = 256 // stage_k
    return (buffers + r - 2) // r + 1


@gluon.jit
def _issue_stage(c_desc, s_desc, cdst, sbuf, bar, row, k0, st: gl.constexpr, w: gl.constexpr,
                 NB: gl.constexpr, BOX3: gl.constexpr, UPS: gl.constexpr = 4,
                 NBS: gl.constexpr = 1, KS: gl.constexpr = 0):  # fmt: skip
    """TMA copies of stage ``st`` (``UPS`` units: that many code boxes, or one 3-D box)
    of weight ``w`` (0 gate, 1 up) into ring buffer ``st % NB``, completing on ``bar``,
    and when the stage starts a scale group of 256 K (``4 // UPS`` stages), the group's
    scale box into scale buffer ``group % NBS``. ``cdst``: [2 * NB * UPS, 64, 32], or with
    BOX3 the same bytes as [2 * NB, UPS, 64, 32]; ``sbuf``: [2 * NBS, 64, 16]."""
    b: gl.constexpr = st % NB
    SK: gl.constexpr = UPS * UNIT
    if BOX3 == 3:  # TILED: the same box from the tiled copy ([64-row tile, K / 256] blocks
        # of [64, 128] bytes, KS = K / 256 blocks a tile; scales the same with [64, 16])
        tma.async_copy_global_to_shared(c_desc, [(row // 64 * KS + (k0 + st * SK) // 256) * 64,
                                                 0], bar, cdst.index(w * NB + b))  # fmt: skip
    elif BOX3 == 2:  # one 2-D box [64 rows, SK / 2 bytes], 128-byte swizzle (CODE_WIDE)
        tma.async_copy_global_to_shared(c_desc, [row, (k0 + st * SK) // 2], bar,
                                        cdst.index(w * NB + b))  # fmt: skip
    elif BOX3:
        tma.async_copy_global_to_shared(c_desc, [(k0 + st * SK) // UNIT, row, 0], bar,
                                        cdst.index(w * NB + b))  # fmt: skip
    else:
        for j in gl.static_range(UPS):
            kk = k0 + st * SK + j * UNIT
            tma.async_copy_global_to_shared(c_desc, [row, kk // 2], bar,
                                            cdst.index((w * NB + b) * UPS + j))  # fmt: skip
    R: gl.constexpr = 4 // UPS
    if st % R == 0:
        g: gl.constexpr = st // R
        if BOX3 == 3:
            tma.async_copy_global_to_shared(s_desc, [(row // 64 * KS + (k0 + g * 256) // 256)
                                                     * 64, 0], bar,
                                            sbuf.index(w * NBS + g % NBS))  # fmt: skip
        else:
            tma.async_copy_global_to_shared(s_desc, [row, (k0 + g * 256) // 16], bar,
                                            sbuf.index(w * NBS + g % NBS))  # fmt: skip


@gluon.jit
def _smem_unit(cbuf, sbuf, kb: gl.constexpr, w: gl.constexpr, NB: gl.constexpr,
               UPS: gl.constexpr = 4, NBS: gl.constexpr = 1,
               WIDE: gl.constexpr = False, TR: gl.constexpr = 64):  # fmt: skip
    """Unit ``kb`` of the segment of weight ``w`` from shared memory (its stage's ring
    buffer, its scale group's buffer): codes [TR, 4, 8] in ``code_layout3(TR)`` and e4m3
    scales [TR, 4] in its slice, as the kernel's decode takes."""
    CL: gl.constexpr = code_layout(TR)
    L3: gl.constexpr = code_layout3(TR)
    b: gl.constexpr = (kb // UPS) % NB
    if WIDE:  # [TR, SK / 2] swizzled stage buffers: the unit's 32 bytes of each row
        codes = cbuf.index(w * NB + b).slice(32 * (kb % UPS), 32, dim=1).load(CL)
    else:
        codes = cbuf.index((w * NB + b) * UPS + kb % UPS).load(CL)
    codes = gl.convert_layout(gl.reshape(codes, [TR, 4, 8]), L3, assert_trivial=True)
    SL: gl.constexpr = gl.SliceLayout(2, L3)
    sc = sbuf.index(w * NBS + (kb // 4) % NBS).slice(4 * (kb % 4), 4, dim=1).load(SL)
    return codes, sc.to(gl.float8e4nv, bitcast=True)


@gluon.jit
def _stage_buffers(GATED: gl.constexpr, NB: gl.constexpr, NBS: gl.constexpr,
                   UPS: gl.constexpr, BOX3: gl.constexpr, TR: gl.constexpr = 64):  # fmt: skip
    """A program's shared buffers for the weights of ``NB`` ring stages of ``UPS`` units
    (codes: [NW * NB, TR, SK / 2] swizzled with BOX3 2, else [NW * NB * UPS, 64, 32];
    scales [NW * NBS, TR, 16]; NW 2 when GATED) and the stages' ``NB`` mbarriers,
    initialized."""
    if GATED:
        NW: gl.constexpr = 2
    else:
        NW: gl.constexpr = 1
    gl.static_assert(TR == 64 or BOX3 >= 2, "128-row tiles: CODE_WIDE boxes")
    if BOX3 >= 2:
        cbuf = gl.allocate_shared_memory(gl.uint8, [NW * NB, TR, UPS * UNIT // 2], CODE_SMEM_W)
    else:
        cbuf = gl.allocate_shared_memory(gl.uint8, [NW * NB * UPS, 64, 32], CODE_SMEM)
    sbuf = gl.allocate_shared_memory(gl.uint8, [NW * NBS, TR, 16], SCALE_SMEM)
    bars = gl.allocate_shared_memory(gl.int64, [NB, 1], mbarrier.MBarrierLayout())
    for b in gl.static_range(NB):
        mbarrier.init(bars.index(b), count=1)
    return cbuf, sbuf, bars


@gluon.jit
def _mma_drain(acc_g, acc_u, GATED: gl.constexpr):
    """Wait for every asynchronous wgmma in flight into ``acc_g`` (and ``acc_u`` when
    GATED); the accumulators to read afterwards."""
    if GATED:
        acc_g, acc_u = warpgroup_mma_wait(num_outstanding=0, deps=(acc_g, acc_u))
    else:
        acc_g = warpgroup_mma_wait(num_outstanding=0, deps=(acc_g,))
    return acc_g, acc_u


@gluon.jit
def _gdc_wait_release():
    """Programmatic dependent launch: wait for the preceding kernel's writes, then let the
    next kernel's programs start (``tl.extra.cuda.gdc_wait`` / ``gdc_launch_dependents``;
    both are no-ops when the kernel was launched without PDL)."""
    gl.inline_asm_elementwise("griddepcontrol.wait; // dummy $0", "=r", [], dtype=gl.int32,
                              is_pure=False, pack=1)  # fmt: skip
    gl.inline_asm_elementwise("griddepcontrol.launch_dependents; // dummy $0", "=r", [],
                              dtype=gl.int32, is_pure=False, pack=1)  # fmt: skip


@gluon.jit
def _prefetch_l2(c_ptr, s_ptr, row, N: gl.constexpr, k0, st, NST: gl.constexpr,
                 K: gl.constexpr, SK: gl.constexpr, GATED: gl.constexpr):  # fmt: skip
    """Prefetch stages ``st`` .. ``st + NST - 1`` of the program's weight rows into L2
    (``cp.async.bulk.prefetch.L2``: a hint, no completion to wait for). Thread i takes one
    row: GATED, gate row ``row + i`` (i < 64) or up row ``row + N + i - 64``, its codes and
    its scales; else row ``row + i % 64``, its codes (i < 64) or its scales (i >= 64).
    The codes of a row's stages are contiguous (SK / 2 bytes a stage), and so are its
    scales (SK / 16 bytes a stage; both multiples of 16, as the instruction needs)."""
    PL: gl.constexpr = gl.BlockedLayout([1], [32], [4], [0])
    i = gl.arange(0, 128, layout=PL)
    kc = k0 + st * SK
    CB: gl.constexpr = NST * SK // 2
    SB: gl.constexpr = NST * SK // 16
    if GATED:
        r = (row + i % 64 + (i // 64) * N).to(gl.int64)
        ca = c_ptr + r * (K // 2) + kc // 2
        sa = s_ptr + r * (K // 16) + kc // 16
        on = gl.full([128], 1, gl.int32, layout=PL)
        _bulk_prefetch(ca, gl.full([128], CB, gl.int32, layout=PL), on)
        _bulk_prefetch(sa, gl.full([128], SB, gl.int32, layout=PL), on)
    else:
        r = (row + i % 64).to(gl.int64)
        codes = i < 64
        # one prefetch a thread: its row's codes or its row's scales
        a = c_ptr + r * (K // 2) + kc // 2
        a_s = s_ptr + r * (K // 16) + kc // 16
        _bulk_prefetch(a, gl.full([128], CB, gl.int32, layout=PL), codes.to(gl.int32))
        _bulk_prefetch(a_s, gl.full([128], SB, gl.int32, layout=PL), (i >= 64).to(gl.int32))


@gluon.jit
def _bulk_prefetch(ptrs, size, on):
    """``cp.async.bulk.prefetch.L2.global [ptr], size`` where ``on`` is not 0, an element
    a thread."""
    gl.inline_asm_elementwise(
        "{ .reg .pred p; setp.ne.b32 p, $3, 0; "
        "@p cp.async.bulk.prefetch.L2.global [$1], $2; mov.u32 $0, 0; }",
        "=r,l,r,r", [ptrs, size, on], dtype=gl.int32, is_pure=False, pack=1,
    )  # fmt: skip


@gluon.jit
def _last_unit_epilogue(
    pid_m, pid_n, e, start, end, part_ptr, cnt_ptr, w_global_ptr, topk_w_ptr,
    sorted_routes_ptr, out_ptr, a_global_ptr, stride, N: gl.constexpr, K: gl.constexpr,
    TOPK: gl.constexpr, GATED: gl.constexpr, BM: gl.constexpr, SEG: gl.constexpr,
    FUSED: gl.constexpr, OUT_SCALE: gl.constexpr, MMA: gl.constexpr,
    A_GATHER: gl.constexpr, A_FP4: gl.constexpr, OUT_UNIT: gl.constexpr = False,
    TR: gl.constexpr = 64,
):  # fmt: skip
    """After a unit wrote its partial: the tile's last unit to finish sums the partials
    in segment order from zero, ((0 + P_0) + P_1) + ..., and writes the W4A16 output with
    the operations of ``gemm._epilogue`` (global scales, SwiGLU when GATED, one bf16
    rounding; bf16 rows, or the router-weighted atomic add when FUSED)."""
    NSEG: gl.constexpr = K // SEG
    if GATED:
        gn: gl.constexpr = 2 * N
    else:
        gn: gl.constexpr = N
    gl.static_assert(TR == 64 or not OUT_UNIT, "OUT_UNIT: 64-row tiles")
    tile = pid_m * gl.cdiv(N, TR) + pid_n
    gl.thread_barrier()  # every thread's partial stores before the release below
    done = gl.atomic_add(cnt_ptr + tile, 1, sem="acq_rel")
    if done == NSEG - 1:
        gl.store(cnt_ptr + tile, 0)  # ready for the next call (and graph replay)
        on, om, _, mask = _tile_index(pid_n, start, end, N, BM, MMA, TR)
        prow = part_ptr + om.to(gl.int64)[None, :] * gn + on[:, None]
        acc_g = gl.zeros([TR, BM], gl.float32, layout=MMA)
        acc_u = gl.zeros([TR, BM], gl.float32, layout=MMA)
        for sg in gl.static_range(NSEG):  # .cg: other SMs wrote them; read from L2
            acc_g = acc_g + gl.load(prow + sg * stride, mask=mask, other=0.0,
                                    cache_modifier=".cg")  # fmt: skip
            if GATED:
                acc_u = acc_u + gl.load(prow + sg * stride + N, mask=mask, other=0.0,
                                        cache_modifier=".cg")  # fmt: skip
        _tile_out(acc_g, acc_u, pid_n, e, start, end, w_global_ptr, topk_w_ptr,
                  sorted_routes_ptr, out_ptr, a_global_ptr, N, TOPK, GATED, BM, FUSED,
                  OUT_SCALE, MMA, A_GATHER, A_FP4, OUT_UNIT, TR)  # fmt: skip


@gluon.jit
def _tile_out(
    acc_g, acc_u, pid_n, e, start, end, w_global_ptr, topk_w_ptr, sorted_routes_ptr,
    out_ptr, a_global_ptr, N: gl.constexpr, TOPK: gl.constexpr, GATED: gl.constexpr,
    BM: gl.constexpr, FUSED: gl.constexpr, OUT_SCALE: gl.constexpr, MMA: gl.constexpr,
    A_GATHER: gl.constexpr, A_FP4: gl.constexpr, OUT_UNIT: gl.constexpr = False,
    TR: gl.constexpr = 64,
):  # fmt: skip
    """A tile's output from its sums over K (``acc_g``, and ``acc_u`` when GATED; [TR, BM]
    fp32 in the ``MMA`` layout) with the operations of ``gemm._epilogue``: global scales,
    SwiGLU when GATED, one bf16 rounding; bf16 rows, or the router-weighted atomic add
    when FUSED."""
    on, om, m_ok, mask = _tile_index(pid_n, start, end, N, BM, MMA, TR)
    e64 = e.to(gl.int64)
    h = acc_g * OUT_SCALE
    if A_FP4:  # the activation row's global (W4A4)
        gx = _row_globals(a_global_ptr, sorted_routes_ptr, om, m_ok, TOPK, A_GATHER)
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
        if OUT_UNIT:  # each 64 columns in the unit order (FC2's TMA rows, A_TMA)
            j = gl.arange(0, 64, layout=gl.SliceLayout(1, MMA))
            pos = 16 * ((j // 4) % 4) + 8 * (j % 2) + 2 * (j // 16) + (j // 2) % 2
            col = pid_n * 64 + pos
        else:
            col = on
        gl.store(out_ptr + om.to(gl.int64)[None, :] * N + col[:, None], y, mask=mask)


@gluon.jit
def _skew_sleep(slot, ns: gl.constexpr):
    """SKEW_NS: sleep ``ns`` nanoseconds when a hash of ``slot`` is odd (about half the
    programs of each SM, whatever the block scheduler's order)."""
    odd = ((slot * -1640531535) >> 15) & 1
    d = gl.where(odd != 0, ns, 0)
    gl.inline_asm_elementwise("nanosleep.u32 $1; mov.u32 $0, 0;", "=r,r", [d],
                              dtype=gl.int32, is_pure=False, pack=1)  # fmt: skip


@gluon.jit
def _stamp(ptr, which: gl.constexpr):
    """TRACE: the SM's cycle counter (``which`` 0), the global nanosecond timer (1) or the
    SM's id (2) stored at ``ptr``."""
    if which == 0:
        v = gl.inline_asm_elementwise("mov.u64 $0, %clock64;", "=l", [], dtype=gl.int64,
                                      is_pure=False, pack=1)  # fmt: skip
    elif which == 1:
        v = gl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=gl.int64,
                                      is_pure=False, pack=1)  # fmt: skip
    else:
        v = gl.inline_asm_elementwise("mov.u32 $0, %smid;", "=r", [], dtype=gl.int32,
                                      is_pure=False, pack=1).to(gl.int64)  # fmt: skip
    gl.store(ptr, v)


@gluon.jit
def tma_split_kernel(
    x_ptr,  # bf16 [rows, K]: FC1 the tokens (gathered by route // TOPK), FC2 sorted rows
    sorted_routes_ptr,  # int32 [T*TOPK]
    c_desc,  # TMA descriptor of the uint8 [E * W_ROWS, K/2] codes (its box: BOX3)
    s_desc,  # TMA descriptor: uint8 [E * W_ROWS, K/16] e4m3 scale bits, box [64, 16]
    x_desc,  # A_TMA: TMA descriptor of x (rows in sorted and unit order) as [K/64, rows, 64]
    # with [SK / 64, BM, 64] boxes (else any descriptor, unused)
    block_expert_ptr,
    block_start_ptr,
    block_end_ptr,
    valid_blocks_ptr,  # int32 [1]: the schedule's valid blocks (they come first; LOOP)
    part_ptr,  # fp32 [segments, ws_rows, (2 if GATED) * N]
    cnt_ptr,  # int32 [tiles * blocks] zeros: units done a tile (EPILOGUE; left at zero)
    w_global_ptr,  # fp32 [E] or [E, 2] (GATED): the weights' global scales (EPILOGUE)
    topk_w_ptr,  # fp32 [T*TOPK] router weights (FUSED)
    out_ptr,  # EPILOGUE: bf16 [ws_rows, N] rows in sorted order, or fp32 [T, N] (FUSED)
    a_global_ptr,  # fp32 [rows of x]: W4A4's activation global scales (A_FP4, EPILOGUE)
    trace_ptr,  # TRACE: int64 [programs, TRACE_FIELDS] stamps
    c_ptr,  # uint8 [E * W_ROWS, K/2]: the codes c_desc reads (L2 prefetch)
    s_ptr,  # uint8 [E * W_ROWS, K/16]: the scale bytes s_desc reads (L2 prefetch)
    ws_rows,
    loop_step,  # LOOP: the grid's row blocks (program m takes blocks m, m + loop_step, ...)
    N: gl.constexpr,
    K: gl.constexpr,
    TOPK: gl.constexpr,
    GATED: gl.constexpr,
    A_GATHER: gl.constexpr,
    BM: gl.constexpr,  # rows (tokens) a tile: the wgmma N (8 or 16; 32 with WHOLE)
    SEG: gl.constexpr,  # K elements a segment (1024)
    ASYNC: gl.constexpr = False,  # asynchronous wgmma
    BLOCKS_LAST: gl.constexpr = True,  # grid (tiles, segments, blocks)
    NBUF: gl.constexpr = 4,  # stages in shared memory (a ring when fewer than SEG / SK)
    EPILOGUE: gl.constexpr = False,  # the tile's last unit sums the partials, W4A16 output
    FUSED: gl.constexpr = False,  # EPILOGUE: router weight times y added into out (atomic)
    OUT_SCALE: gl.constexpr = 1.0,  # EPILOGUE: undoes the decodes' powers of two
    A_UNIT_ORDER: gl.constexpr = False,  # x's rows already in the unit order (W4A4's
    # decoded rows, ``dequant.dense_rows(order=64)``)
    A_FP4: gl.constexpr = False,  # EPILOGUE: times the activation global (W4A4)
    BOX3: gl.constexpr = 0,  # c_desc: 3 TILED (``tiled_weights``) with [64, 128] boxes; 1
    # [K/64, rows, 32] with [SK / 64, 64, 32] boxes; 2
    # [rows, K/2] with [64, SK / 2] boxes, 128-byte swizzle (CODE_WIDE); 0 [64, 32] boxes
    SK: gl.constexpr = 256,  # K elements a ring stage (64, 128 or 256)
    USE_PDL: gl.constexpr = False,  # programmatic dependent launch (launch_pdl=True)
    EARLY_W: gl.constexpr = False,  # USE_PDL: the first stages' copies before the wait
    A_TMA: gl.constexpr = False,  # x's rows (sorted, unit order) by TMA with each stage
    OUT_UNIT: gl.constexpr = False,  # EPILOGUE: bf16 rows with each 64 columns in unit order
    DIAG: gl.constexpr = 0,  # timing only, wrong results: 1 no decode (zero weights), 2 no
    # copies and no waits (decodes whatever shared memory holds), 3 neither, 4 neither and
    # no wgmma; see DIAG below
    LOOP: gl.constexpr = False,  # the grid has loop_step row blocks, not the worst case;
    # program m takes the valid blocks m, m + loop_step, ... (grid_blocks)
    TRACE: gl.constexpr = False,  # stamps into trace_ptr (gluon_ws.TRACE)
    XRING: gl.constexpr = False,  # the rows a ring stage at a time (gluon_ws.X_RING)
    PERSIST: gl.constexpr = False,  # a 1-D grid of loop_step programs, each taking the
    # units u = program, program + loop_step, ... of the valid blocks (tile fastest, then
    # segment, then block) and issuing the next unit's first stages in its last ones
    L2: gl.constexpr = 0,  # stages prefetched into L2 ahead of the ring (gluon_ws.L2_AHEAD)
    SKEW: gl.constexpr = 0,  # ns half the programs sleep before their copies (SKEW_NS)
    TR: gl.constexpr = 64,  # weight rows a tile (128: 8 warps, gluon_ws.TILE_ROWS)
    WHOLE: gl.constexpr = False,  # a program takes every K segment of its tile in turn and
    # writes its output (EPILOGUE): no partials, no counter (the grid's segments: 1)
    SA: gl.constexpr = False,  # the block's start and end read with its expert, not after
    # it (gluon_ws.SCHED_AHEAD; the one-block body)
    ROT: gl.constexpr = False,  # the codes in the rotated layout (gluon_ws.ROT_LAYOUT)
):
    pid_n = gl.program_id(0)
    if BLOCKS_LAST:
        s_id = gl.program_id(1)
        pid_m = gl.program_id(2)
    else:
        pid_m = gl.program_id(1)
        s_id = gl.program_id(2)
    gl.static_assert(not (TRACE and (LOOP or PERSIST)), "TRACE needs the worst-case grid")
    gl.static_assert(not (LOOP and PERSIST), "LOOP or PERSIST, not both")
    gl.static_assert(not (XRING and (LOOP or PERSIST or A_TMA)), "XRING: the one-block body")
    gl.static_assert(L2 == 0 or not (LOOP or PERSIST or BOX3 == 3),
                     "L2: the one-block body on the row-major weights")  # fmt: skip
    gl.static_assert(TR == 64 or (TR == 128 and not (LOOP or PERSIST or XRING or A_TMA or TRACE
                                                     or OUT_UNIT) and L2 == 0 and BOX3 == 2
                                  and SK == 256),
                     "TR 128: the one-block body, CODE_WIDE boxes, 256-K stages")  # fmt: skip
    gl.static_assert(not WHOLE or (EPILOGUE and not (LOOP or PERSIST or XRING or A_TMA or TRACE)
                                   and L2 == 0 and TR == 64 and SK == 256),
                     "WHOLE: the one-block body with its epilogue, 64-row tiles, 256-K "
                     "stages")  # fmt: skip
    gl.static_assert(BM != 32 or WHOLE, "32-row tiles: WHOLE only")
    slot = pid_n + gl.num_programs(0) * (gl.program_id(1) + gl.num_programs(1) * gl.program_id(2))
    tb = trace_ptr + slot.to(gl.int64) * 16
    if TRACE:
        _stamp(tb + 2, 0)  # T_START
        _stamp(tb + 0, 1)  # T_GSTART
        _stamp(tb + 11, 2)  # T_SM
    if USE_PDL and not EARLY_W:
        _gdc_wait_release()
    if TRACE:
        _stamp(tb + 3, 0)  # T_WAIT
    if SKEW > 0:
        _skew_sleep(slot, SKEW)
    # EARLY_W: the schedule was written two kernels back (the kernel before this one waited
    # for it before it released this one), so it is read before the wait, from L2
    if PERSIST:
        _persistent(
            x_ptr, sorted_routes_ptr, c_desc, s_desc, x_desc, block_expert_ptr,
            block_start_ptr, block_end_ptr, valid_blocks_ptr, part_ptr, cnt_ptr, w_global_ptr,
            topk_w_ptr, out_ptr, a_global_ptr, ws_rows, loop_step, N, K, TOPK, GATED,
            A_GATHER, BM, SEG, ASYNC, NBUF, EPILOGUE, FUSED, OUT_SCALE, A_UNIT_ORDER, A_FP4,
            BOX3, SK, USE_PDL, EARLY_W, A_TMA, OUT_UNIT, DIAG, ROT=ROT,
        )  # fmt: skip
    elif LOOP:
        nvalid = gl.load(valid_blocks_ptr, cache_modifier=".cg")
        NS: gl.constexpr = SEG // SK
        NB: gl.constexpr = min(NBUF, NS)
        cbuf, sbuf, bars, xbuf = _loop_buffers(GATED, BM, SEG, NBUF, BOX3, SK, A_TMA)
        ph = 0
        for pm in range(pid_m, nvalid, loop_step):
            if pm != pid_m:  # the last block's shared loads done before new copies land
                gl.thread_barrier()
                fence_async_shared()
            _block_work(
                x_ptr, sorted_routes_ptr, c_desc, s_desc, x_desc, block_expert_ptr,
                block_start_ptr, block_end_ptr, part_ptr, cnt_ptr, w_global_ptr, topk_w_ptr,
                out_ptr, a_global_ptr, ws_rows, pm, pid_n, s_id, pm == pid_m, N, K, TOPK,
                GATED, A_GATHER, BM, SEG, ASYNC, NBUF, EPILOGUE, FUSED, OUT_SCALE,
                A_UNIT_ORDER, A_FP4, BOX3, SK, USE_PDL, EARLY_W, A_TMA, OUT_UNIT, DIAG,
                True, cbuf, sbuf, bars, xbuf.index(_opaque_zero()), ph, ROT=ROT,
            )  # fmt: skip
            ph = (ph + NS // NB) % 2  # each buffer's barrier completes NS / NB times a block
    else:
        _block_work(
            x_ptr, sorted_routes_ptr, c_desc, s_desc, x_desc, block_expert_ptr,
            block_start_ptr, block_end_ptr, part_ptr, cnt_ptr, w_global_ptr, topk_w_ptr,
            out_ptr, a_global_ptr, ws_rows, pid_m, pid_n, s_id, True, N, K, TOPK, GATED,
            A_GATHER, BM, SEG, ASYNC, NBUF, EPILOGUE, FUSED, OUT_SCALE, A_UNIT_ORDER, A_FP4,
            BOX3, SK, USE_PDL, EARLY_W, A_TMA, OUT_UNIT, DIAG, TRACE=TRACE, tb=tb, XRING=XRING,
            L2=L2, c_ptr=c_ptr, s_ptr=s_ptr, TR=TR, WHOLE=WHOLE, SA=SA, ROT=ROT,
        )  # fmt: skip
        if TRACE:
            _stamp(tb + 10, 0)  # T_END
            _stamp(tb + 1, 1)  # T_GEND


@gluon.jit
def _loop_buffers(GATED: gl.constexpr, BM: gl.constexpr, SEG: gl.constexpr,
                  NBUF: gl.constexpr, BOX3: gl.constexpr, SK: gl.constexpr,
                  A_TMA: gl.constexpr):  # fmt: skip
    """LOOP's and PERSIST's shared buffers, set up once before their loop (the barriers
    initialized once, their phase carried by the caller): ``_stage_buffers``' weights and
    barriers, and the rows' buffer as [1, rows, 64] (NB stages' rows with A_TMA, else the
    segment's), to be indexed by ``_opaque_zero``."""
    UPS: gl.constexpr = SK // UNIT
    NS: gl.constexpr = SEG // SK
    R: gl.constexpr = 4 // UPS
    NB: gl.constexpr = min(NBUF, NS)
    gl.static_assert(NS % NB == 0, "a loop needs the ring's buffers to divide the stages")
    cbuf, sbuf, bars = _stage_buffers(GATED, NB, (NB + R - 2) // R + 1, UPS, BOX3)
    XS: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BM, UNIT], gl.bfloat16)
    if A_TMA:
        xbuf = gl.allocate_shared_memory(gl.bfloat16, [1, NB * UPS * BM, UNIT], XS)
    else:
        xbuf = gl.allocate_shared_memory(gl.bfloat16, [1, SEG // UNIT * BM, UNIT], XS)
    return cbuf, sbuf, bars, xbuf


@gluon.jit
def _opaque_zero():
    """An int32 zero the compiler cannot see through, indexing the rows' buffer of LOOP and
    PERSIST: through a constant index the wgmma descriptors of its 16 unit slices are
    computed once before the loop and held in vector registers (FC1 211 registers instead
    of 66, 260 R2UR, session 12)."""
    return gl.inline_asm_elementwise("mov.u32 $0, 0;", "=r", [], dtype=gl.int32,
                                     is_pure=False, pack=1)  # fmt: skip


@gluon.jit
def _persistent(
    x_ptr, sorted_routes_ptr, c_desc, s_desc, x_desc, block_expert_ptr, block_start_ptr,
    block_end_ptr, valid_blocks_ptr, part_ptr, cnt_ptr, w_global_ptr, topk_w_ptr, out_ptr,
    a_global_ptr, ws_rows, step, N: gl.constexpr, K: gl.constexpr, TOPK: gl.constexpr,
    GATED: gl.constexpr, A_GATHER: gl.constexpr, BM: gl.constexpr, SEG: gl.constexpr,
    ASYNC: gl.constexpr, NBUF: gl.constexpr, EPILOGUE: gl.constexpr, FUSED: gl.constexpr,
    OUT_SCALE: gl.constexpr, A_UNIT_ORDER: gl.constexpr, A_FP4: gl.constexpr,
    BOX3: gl.constexpr, SK: gl.constexpr, USE_PDL: gl.constexpr, EARLY_W: gl.constexpr,
    A_TMA: gl.constexpr, OUT_UNIT: gl.constexpr, DIAG: gl.constexpr, ROT: gl.constexpr = False,
):  # fmt: skip
    """``tma_split_kernel`` with PERSIST: program p of ``step`` takes the units u = p,
    p + step, ... below (valid blocks) x tiles x segments, u = tile + tiles * (segment +
    segments * block) (the worst-case grid's order). The buffers and barriers are set up
    once; each unit's last ring stages are refilled with the next unit's first ones, so
    the weight copies never stop between a program's units (its partials, epilogue, next
    schedule reads and activation staging run while they fly)."""
    NS: gl.constexpr = SEG // SK
    NB: gl.constexpr = min(NBUF, NS)
    R: gl.constexpr = 256 // SK
    gl.static_assert((NS // R) % ((NB + R - 2) // R + 1) == 0,
                     "PERSIST: a segment's scale groups fill the slots")  # fmt: skip
    gl.static_assert(not A_TMA, "PERSIST stages its rows (no A_TMA)")
    TILES: gl.constexpr = (N + 63) // 64
    SEGS: gl.constexpr = K // SEG
    if GATED:
        W_ROWS: gl.constexpr = 2 * N
    else:
        W_ROWS: gl.constexpr = N
    cbuf, sbuf, bars, xbuf = _loop_buffers(GATED, BM, SEG, NBUF, BOX3, SK, A_TMA)
    nunits = gl.load(valid_blocks_ptr, cache_modifier=".cg") * (TILES * SEGS)
    pid = gl.program_id(0)
    ph = 0
    for u in range(pid, nunits, step):
        if u != pid:  # the last unit's shared loads (rows) done before this one's staging
            gl.thread_barrier()
            fence_async_shared()
        pid_n = u % TILES
        s_id = (u // TILES) % SEGS
        pm = u // (TILES * SEGS)
        # the next unit's weight rows, for its first stages issued in this unit's last ones
        un = u + step
        has_next = un < nunits
        e_n = gl.load(block_expert_ptr + gl.where(has_next, un // (TILES * SEGS), pm),
                      cache_modifier=".cg")  # fmt: skip
        n_row = e_n * W_ROWS + (un % TILES) * 64
        n_k0 = ((un // TILES) % SEGS) * SEG
        _block_work(
            x_ptr, sorted_routes_ptr, c_desc, s_desc, x_desc, block_expert_ptr,
            block_start_ptr, block_end_ptr, part_ptr, cnt_ptr, w_global_ptr, topk_w_ptr,
            out_ptr, a_global_ptr, ws_rows, pm, pid_n, s_id, u == pid, N, K, TOPK,
            GATED, A_GATHER, BM, SEG, ASYNC, NBUF, EPILOGUE, FUSED, OUT_SCALE,
            A_UNIT_ORDER, A_FP4, BOX3, SK, USE_PDL, EARLY_W, A_TMA, OUT_UNIT, DIAG,
            True, cbuf, sbuf, bars, xbuf.index(_opaque_zero()), ph,
            NEXT=True, has_next=has_next, n_row=n_row, n_k0=n_k0, ROT=ROT,
        )  # fmt: skip
        ph = (ph + NS // NB) % 2


@gluon.jit
def _block_work(
    x_ptr, sorted_routes_ptr, c_desc, s_desc, x_desc, block_expert_ptr, block_start_ptr,
    block_end_ptr, part_ptr, cnt_ptr, w_global_ptr, topk_w_ptr, out_ptr, a_global_ptr,
    ws_rows, pid_m, pid_n, s_id, first, N: gl.constexpr, K: gl.constexpr,
    TOPK: gl.constexpr, GATED: gl.constexpr, A_GATHER: gl.constexpr, BM: gl.constexpr,
    SEG: gl.constexpr, ASYNC: gl.constexpr, NBUF: gl.constexpr, EPILOGUE: gl.constexpr,
    FUSED: gl.constexpr, OUT_SCALE: gl.constexpr, A_UNIT_ORDER: gl.constexpr,
    A_FP4: gl.constexpr, BOX3: gl.constexpr, SK: gl.constexpr, USE_PDL: gl.constexpr,
    EARLY_W: gl.constexpr, A_TMA: gl.constexpr, OUT_UNIT: gl.constexpr, DIAG: gl.constexpr,
    PRE: gl.constexpr = False, pre_c=0, pre_s=0, pre_bars=0, pre_x=0, ph=0,
    TRACE: gl.constexpr = False, tb=0,
    NEXT: gl.constexpr = False, has_next=False, n_row=0, n_k0=0,
    XRING: gl.constexpr = False,
    L2: gl.constexpr = 0, c_ptr=0, s_ptr=0,
    TR: gl.constexpr = 64,
    WHOLE: gl.constexpr = False,
    SA: gl.constexpr = False,
    ROT: gl.constexpr = False,
):  # fmt: skip
    """One (weight tile ``pid_n``, K segment ``s_id``, row block ``pid_m``) unit of
    ``tma_split_kernel`` (its arguments). ``first``: the program's first block, which
    waits for the preceding kernel under PDL with ``EARLY_W``. ``PRE``: the shared
    buffers and initialized barriers come from the caller (``pre_*``, the loop over
    blocks allocates them once), ``ph`` the barriers' phase at this block's start.
    ``TRACE``: phase stamps at ``tb`` (``gluon_ws.TRACE``). ``NEXT`` (PERSIST): the
    ring's first stages were issued by the program's last unit unless ``first``, and with
    ``has_next`` this unit's last stages are refilled with the first ones of the next
    unit (weight rows from ``n_row``, K from ``n_k0``). ``XRING``: the rows go into two
    shared buffers a ring stage at a time (``X_RING``). ``L2``: that many stages beyond the
    ring are prefetched into L2 from ``c_ptr`` / ``s_ptr`` (``L2_AHEAD``). ``SA``: the
    block's start and end are loaded beside its expert, before the branch on it (one
    dependent load the less for a valid block, two loads more for an empty one)."""
    e = gl.load(block_expert_ptr + pid_m, cache_modifier=".cg")
    if SA:
        start_a = gl.load(block_start_ptr + pid_m, cache_modifier=".cg")
        end_a = gl.load(block_end_ptr + pid_m, cache_modifier=".cg")
    if TRACE:
        gl.store(tb + 12, e.to(gl.int64))  # T_EXPERT
        _stamp(tb + 4, 0)  # T_SCHED
    if e >= 0:
        if SA:
            start = start_a
            end = end_a
        else:
            start = gl.load(block_start_ptr + pid_m, cache_modifier=".cg")
            end = gl.load(block_end_ptr + pid_m, cache_modifier=".cg")
        NU: gl.constexpr = SEG // UNIT
        UPS: gl.constexpr = SK // UNIT  # units a stage
        NS: gl.constexpr = SEG // SK  # stages a segment
        R: gl.constexpr = 4 // UPS  # stages a scale group (256 K)
        NB: gl.constexpr = min(NBUF, NS)  # ring buffers (NS: the whole segment up front)
        NBS: gl.constexpr = (NB + R - 2) // R + 1  # scale-group buffers (scale_slots)
        if GATED:
            NW: gl.constexpr = 2
            w_rows = 2 * N
        else:
            NW: gl.constexpr = 1
            w_rows = N
        k0 = s_id * SEG

        # ---- the ring's first stages, first (one elected thread issues the copies)
        if PRE:
            cbuf = pre_c
            sbuf = pre_s
            bars = pre_bars
        else:
            cbuf, sbuf, bars = _stage_buffers(GATED, NB, NBS, UPS, BOX3, TR)
        if BOX3 == 1:  # the same bytes (unswizzled) as [stage buffers, UPS, 64, 32] for the copies
            cdst = cbuf._reinterpret(gl.uint8, [NW * NB, UPS, 64, 32], CODE_SMEM3)
        else:
            cdst = cbuf
        row = e * w_rows + pid_n * TR
        if A_TMA:  # x's ring: [stage buffers * UPS * BM, 64], each unit's rows a wgmma B
            XS: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BM, UNIT], gl.bfloat16)
            if PRE:
                xr = pre_x
            else:
                xr = gl.allocate_shared_memory(gl.bfloat16, [NB * UPS * BM, UNIT], XS)
            xdst = xr._reinterpret(gl.bfloat16, [NB, UPS, BM, UNIT], X_SMEM3)
            ACT_BYTES: gl.constexpr = UPS * BM * UNIT * 2
        else:
            ACT_BYTES: gl.constexpr = 0
        CODE_BYTES: gl.constexpr = NW * UPS * TR * 32 + ACT_BYTES
        SCALE_BYTES: gl.constexpr = NW * TR * 16
        if (not NEXT) or first:
            for st in gl.static_range(NB if DIAG < 2 else 0):
                bar = bars.index(st)
                if st % R == 0:
                    mbarrier.expect(bar, CODE_BYTES + SCALE_BYTES)
                else:
                    mbarrier.expect(bar, CODE_BYTES)
                _issue_stage(c_desc, s_desc, cdst, sbuf, bar, row, k0, st, 0, NB, BOX3, UPS,
                             NBS, K // 256)  # fmt: skip
                if GATED:
                    _issue_stage(c_desc, s_desc, cdst, sbuf, bar, row + N, k0, st, 1, NB,
                                 BOX3, UPS, NBS, K // 256)  # fmt: skip
                if A_TMA and not EARLY_W:
                    tma.async_copy_global_to_shared(x_desc, [(k0 + st * SK) // UNIT, start, 0],
                                                    bar, xdst.index(st))  # fmt: skip

        if L2 > 0 and DIAG < 2 and NB < NS:  # stages NB .. NB + L2 - 1 into L2
            _prefetch_l2(c_ptr, s_ptr, row, N, k0, NB, min(L2, NS - NB), K, SK, GATED)
        if USE_PDL and EARLY_W:  # the weights' first stages fly while the last kernel ends
            if first:
                _gdc_wait_release()
            if A_TMA:  # x comes from the kernel just waited for
                for st in gl.static_range(NB if DIAG < 2 else 0):
                    tma.async_copy_global_to_shared(x_desc, [(k0 + st * SK) // UNIT, start, 0],
                                                    bars.index(st), xdst.index(st))  # fmt: skip

        if TRACE:
            _stamp(tb + 5, 0)  # T_ISSUE
        # ---- decode and multiply, stage by stage as the copies land: one K segment, or
        # with WHOLE each of K's segments in turn, the ring running on from one to the next
        # and the segment sums added in order from zero, ((0 + P_0) + P_1) + ..., in
        # registers (the sums _last_unit_epilogue makes from the partials: the same bits)
        MMA: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[TR // 16, 1], instr_shape=[16, BM, 16]
        )
        A_L: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=MMA, k_width=2)
        if WHOLE:
            NJ: gl.constexpr = K // SEG
            XW: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BM, UNIT], gl.bfloat16)
            xw = gl.allocate_shared_memory(gl.bfloat16, [1, NU * BM, UNIT], XW)
        else:
            NJ: gl.constexpr = 1
            xd = pre_x
        tot_g = gl.zeros([TR, BM], gl.float32, layout=MMA)
        tot_u = gl.zeros([TR, BM], gl.float32, layout=MMA)
        for j in range(NJ):
            if WHOLE:
                kj = k0 + j * SEG
                phj = (ph + j * (NS // NB)) % 2
                hn = j + 1 < NJ  # the last stages refilled with the next segment's first
                nr = row
                nk = kj + SEG
                if j > 0:
                    gl.thread_barrier()  # every warp's reads of the last segment's rows done
                # through an opaque zero, as LOOP's rows: else the wgmma descriptors of its
                # 16 unit slices are computed before the loop and held in registers
                xd = xw.index(_opaque_zero())
            else:
                kj = k0
                phj = ph
                hn = has_next
                nr = n_row
                nk = n_k0
            # ---- activations of the segment, in unit order, into shared memory [NU * BM, 64]
            if XRING:  # or a stage at a time: two buffers [UPS * BM, 64], the first stage's now
                XSL: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BM, UNIT], gl.bfloat16)
                xs_all = gl.allocate_shared_memory(gl.bfloat16, [1, 2 * UPS * BM, UNIT], XSL)
                x_src, x_ok = _x_rows(sorted_routes_ptr, start, end, TOPK, A_GATHER, BM)
                xv = _x_stage(x_ptr, x_src, x_ok, kj, K, BM, SK, A_UNIT_ORDER)
            elif not A_TMA:  # (32-row tiles, WHOLE only: a stage's K at a time)
                xs = _stage_x(x_ptr, sorted_routes_ptr, start, end, kj, K, TOPK, A_GATHER, BM,
                              SEG, A_UNIT_ORDER, PRE or WHOLE, xd, TR // 16,
                              SK if BM == 32 else 0)  # fmt: skip

            # ---- decode and multiply, stage by stage as the copies land
            acc_g = gl.zeros([TR, BM], gl.float32, layout=MMA)
            acc_u = gl.zeros([TR, BM], gl.float32, layout=MMA)
            for kb in gl.static_range(NU):
                if XRING and kb % UPS == 0:  # this stage's rows into their buffer (the one the
                    # stage before last read: its wgmmas were waited for), the next stage's loaded
                    # through an opaque zero, as LOOP's rows: else the wgmma descriptors of both
                    # buffers' unit slices are computed up front and held (FC1 106 registers)
                    xs = xs_all.index(_opaque_zero())
                    xs.slice((kb // UPS) % 2 * UPS * BM, UPS * BM).store(xv)
                    fence_async_shared()
                    gl.thread_barrier()
                    if kb // UPS + 1 < NS:
                        xv = _x_stage(x_ptr, x_src, x_ok, kj + (kb // UPS + 1) * SK, K, BM, SK,
                                      A_UNIT_ORDER)  # fmt: skip
                if kb == 0 and TRACE:
                    _stamp(tb + 6, 0)  # T_X
                if kb % UPS == 0 and DIAG < 2:
                    mbarrier.wait(bars.index((kb // UPS) % NB), (kb // UPS // NB + phj) % 2)
                    if L2 > 0 and kb // UPS + NB + L2 < NS:  # one more stage into L2
                        _prefetch_l2(c_ptr, s_ptr, row, N, kj, kb // UPS + NB + L2, 1, K, SK,
                                     GATED)  # fmt: skip
                if kb == 0 and TRACE:
                    _stamp(tb + 7, 0)  # T_W0
                if A_TMA:
                    xb = xr.slice(((kb // UPS) % NB * UPS + kb % UPS) * BM, BM).permute((1, 0))
                elif XRING:
                    xb = xs.slice(((kb // UPS) % 2 * UPS + kb % UPS) * BM, BM).permute((1, 0))
                else:
                    xb = xs.slice(kb * BM, BM).permute((1, 0))
                if DIAG != 4:  # DIAG 4: no unit loads, no decode, no wgmma
                    gc, gs = _smem_unit(cbuf, sbuf, kb, 0, NB, UPS, NBS, BOX3 >= 2, TR)
                    wg = _decode_unit(gc, gs, A_L, DIAG, TR, ROT)
                    if ASYNC:
                        if kb > 0:
                            if GATED:
                                acc_g, acc_u, _, _ = warpgroup_mma_wait(
                                    num_outstanding=0,
                                    deps=(acc_g, acc_u, pg, pu),  # noqa: F821 (last unit's)
                                )
                            else:
                                acc_g, _ = warpgroup_mma_wait(num_outstanding=0, deps=(acc_g, pg))  # noqa: F821
                        acc_g = warpgroup_mma(wg, xb, acc_g, is_async=True)
                        pg = wg  # noqa: F841 (read by the next unrolled unit)
                        if GATED:
                            uc, us = _smem_unit(cbuf, sbuf, kb, 1, NB, UPS, NBS, BOX3 >= 2, TR)
                            wu = _decode_unit(uc, us, A_L, DIAG, TR, ROT)
                            acc_u = warpgroup_mma(wu, xb, acc_u, is_async=True)
                            pu = wu  # noqa: F841
                    else:
                        acc_g = warpgroup_mma(wg, xb, acc_g)
                        if GATED:
                            uc, us = _smem_unit(cbuf, sbuf, kb, 1, NB, UPS, NBS, BOX3 >= 2, TR)
                            acc_u = warpgroup_mma(_decode_unit(uc, us, A_L, DIAG, TR, ROT),
                                                  xb, acc_u)  # fmt: skip
                # the stage's buffer is read: refill it with stage + NB (ring only)
                if kb % UPS == UPS - 1 and kb // UPS + NB < NS and DIAG < 2:
                    if A_TMA and ASYNC:  # the stage's x rows are read by the wgmma in flight
                        acc_g, acc_u = _mma_drain(acc_g, acc_u, GATED)
                    gl.thread_barrier()  # every warp's shared loads of the buffer done
                    fence_async_shared()  # ordered before the TMA writes (async proxy)
                    rb = bars.index((kb // UPS) % NB)
                    if (kb // UPS + NB) % R == 0:
                        mbarrier.expect(rb, CODE_BYTES + SCALE_BYTES)
                    else:
                        mbarrier.expect(rb, CODE_BYTES)
                    _issue_stage(c_desc, s_desc, cdst, sbuf, rb, row, kj, kb // UPS + NB, 0, NB,
                                 BOX3, UPS, NBS, K // 256)  # fmt: skip
                    if GATED:
                        _issue_stage(c_desc, s_desc, cdst, sbuf, rb, row + N, kj, kb // UPS + NB, 1,
                                     NB, BOX3, UPS, NBS, K // 256)  # fmt: skip
                    if A_TMA:
                        tma.async_copy_global_to_shared(
                            x_desc, [(kj + (kb // UPS + NB) * SK) // UNIT, start, 0], rb,
                            xdst.index((kb // UPS) % NB),
                        )  # fmt: skip
                elif (NEXT or WHOLE) and kb % UPS == UPS - 1 and DIAG < 2:  # noqa: SIM102 (compile time)
                    # the last stages: refill with the next unit's first (stage kb // UPS + NB
                    # - NS of it, which maps to this very buffer as NS % NB == 0); at run time
                    if hn:
                        gl.thread_barrier()
                        fence_async_shared()
                        rb = bars.index((kb // UPS) % NB)
                        st2: gl.constexpr = kb // UPS + NB - NS
                        if st2 % R == 0:
                            mbarrier.expect(rb, CODE_BYTES + SCALE_BYTES)
                        else:
                            mbarrier.expect(rb, CODE_BYTES)
                        _issue_stage(c_desc, s_desc, cdst, sbuf, rb, nr, nk, st2, 0, NB,
                                     BOX3, UPS, NBS, K // 256)  # fmt: skip
                        if GATED:
                            _issue_stage(c_desc, s_desc, cdst, sbuf, rb, nr + N, nk, st2,
                                         1, NB, BOX3, UPS, NBS, K // 256)  # fmt: skip
            if ASYNC:
                acc_g, acc_u = _mma_drain(acc_g, acc_u, GATED)
            if WHOLE:
                tot_g = tot_g + acc_g
                tot_u = tot_u + acc_u
            else:
                tot_g = acc_g
                tot_u = acc_u
        if not PRE:
            for b in gl.static_range(NB):
                mbarrier.invalidate(bars.index(b))

        if TRACE:
            _stamp(tb + 8, 0)  # T_LOOP
        if WHOLE:  # the tile's sums over K: its output (no partials, no counter)
            _tile_out(tot_g, tot_u, pid_n, e, start, end, w_global_ptr, topk_w_ptr,
                      sorted_routes_ptr, out_ptr, a_global_ptr, N, TOPK, GATED, BM, FUSED,
                      OUT_SCALE, MMA, A_GATHER, A_FP4, OUT_UNIT, TR)  # fmt: skip
        else:
            # ---- partials, as loop 3's split programs write them
            stride = _store_partials(tot_g, tot_u, part_ptr, pid_n, start, end, s_id,
                                     ws_rows, N, GATED, BM, MMA, TR)  # fmt: skip
            if TRACE:
                _stamp(tb + 9, 0)  # T_PART
            if EPILOGUE:  # loop 3's split epilogue (gemm._split_unit, _epilogue): same bits
                _last_unit_epilogue(
                    pid_m, pid_n, e, start, end, part_ptr, cnt_ptr, w_global_ptr,
                    topk_w_ptr, sorted_routes_ptr, out_ptr, a_global_ptr, stride, N, K,
                    TOPK, GATED, BM, SEG, FUSED, OUT_SCALE, MMA, A_GATHER, A_FP4, OUT_UNIT,
                    TR,
                )  # fmt: skip


def tiled_weights(codes: torch.Tensor, scales: torch.Tensor):
    """The tiled copy of one GEMM's weights (``TILED``): codes uint8 [E, W_ROWS, K/2] as
    [E * W_ROWS / 64 * K / 256 * 64, 128] (tile-major, then 256-K stage, then row) and
    e4m3 scales [E, W_ROWS, K/16] as uint8 [same rows, 16]; W_ROWS % 64 == 0, K % 256 ==
    0. Made once per tensor (``TILED_CACHE``)."""
    key = (codes.data_ptr(), tuple(codes.shape), scales.data_ptr())
    hit = TILED_CACHE.get(key)
    if hit is None or hit[0] is not codes or hit[1] is not scales:  # (a reused address)
        e, r, kh = codes.shape
        ks = kh * 2 // 256
        c = codes.reshape(e * r // 64, 64, ks, 128).permute(0, 2, 1, 3).contiguous()
        sc = scales.view(torch.uint8).reshape(e * r // 64, 64, ks, 16)
        sc = sc.permute(0, 2, 1, 3).contiguous()
        hit = TILED_CACHE[key] = (codes, scales, c.reshape(-1, 128), sc.reshape(-1, 16))
    return hit[2], hit[3]


def descriptors(codes: torch.Tensor, scales: torch.Tensor, box3: int = 0,
                stage_k: int = 256, rows: int = 64):  # fmt: skip
    """TMA descriptors of one GEMM's weights: codes uint8 [E, W_ROWS, K/2] as [E * W_ROWS,
    K/2] with [64, 32] boxes (``box3`` 1: as [K/64, E * W_ROWS, 32], strides 32 and K/2
    bytes, with [stage_k / 64, 64, 32] boxes; 2: [rows, stage_k / 2] boxes, 128-byte
    swizzle, ``CODE_WIDE``), scales e4m3 [E, W_ROWS, K/16] (as bytes) with [rows, 16]
    boxes (``rows`` 128: ``TILE_ROWS``, with box3 2 only)."""
    if rows != 64 and box3 != 2:
        raise ValueError(f"descriptors: {rows}-row boxes need box3 2 (CODE_WIDE)")
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    if box3 == 3:  # TILED
        c2, s2 = tiled_weights(codes, scales)
        return (TensorDescriptor.from_tensor(c2, [64, 128], CODE_SMEM_W),
                TensorDescriptor.from_tensor(s2, [64, 16], SCALE_SMEM))  # fmt: skip
    c2 = codes.reshape(-1, codes.shape[-1])
    s2 = scales.view(torch.uint8).reshape(-1, scales.shape[-1])
    if box3 == 2:
        cd = TensorDescriptor.from_tensor(c2, [rows, stage_k // 2], CODE_SMEM_W)
    elif box3:
        rows, kh = c2.shape
        cd = TensorDescriptor(c2, [kh // 32, rows, 32], [32, kh, 1], [stage_k // 64, 64, 32],
                              CODE_SMEM3)  # fmt: skip
    else:
        cd = TensorDescriptor.from_tensor(c2, [64, 32], CODE_SMEM)
    return cd, TensorDescriptor.from_tensor(s2, [rows, 16], SCALE_SMEM)


def split_partials_tma(
    x, sorted_routes, codes, scales, block_expert, block_start, block_end, part, *,
    n: int, topk: int, gated: bool, gather: bool, block_m: int, ws_rows: int,
    seg: int = 1024, asynchronous: bool | None = None, blocks_last: bool = True,
    buffers: int | None = None, out: torch.Tensor | None = None,
    counters: torch.Tensor | None = None, w_global: torch.Tensor | None = None,
    topk_w: torch.Tensor | None = None, fused: bool = False, out_scale: float = 1.0,
    a_unit_order: bool = False, a_global: torch.Tensor | None = None,
    stage_k: int | None = None, pdl: bool = False, early_weights: bool = False,
    a_tma: bool = False, out_unit_order: bool = False,
    valid_blocks: torch.Tensor | None = None, grid_blocks: int = 0, persist: int = 0,
    whole: bool = False,
) -> None:  # fmt: skip
    """Launch ``tma_split_kernel``: fp32 ``part`` [K / seg, ws_rows, (2 if gated) * n]
    receives loop 3's segment partials P_s of every valid row. ``x``: bf16 [., K], the
    tokens (``gather``: row route // topk) or rows in sorted order; ``codes``, ``scales``:
    one GEMM's weights, uint8 [E, W_ROWS, K/2] and e4m3 [E, W_ROWS, K/16];
    ``block_expert``, ``block_start``, ``block_end``: the tile schedule of ``sort_routes``
    with ``block_m`` (8 or 16; 32 with ``whole``) rows a tile. Needs K % seg == 0 and
    seg % 256 == 0.

    With ``out`` the kernel also runs the split epilogue: the last unit of each
    tile sums its partials and writes bf16 rows [ws_rows, n] in sorted order into ``out``,
    or with ``fused`` adds router weight (``topk_w`` fp32 [T*topk]) times y into fp32
    ``out`` [T, n]. ``counters``: int32 zeros, at least cdiv(n, 64) * blocks (left at
    zero); ``w_global``: fp32 [E] or [E, 2] (gated) global scales; ``out_scale``: the
    decode's power of two (``gemm`` OUT_SCALE). ``a_unit_order``: ``x``'s rows are
    already in the unit order (W4A4's rows decoded by ``dense_rows(order=64)``);
    ``a_global``: fp32 per row of ``x``, the activation globals the epilogue multiplies by
    (W4A4). ``stage_k``: K elements a ring stage, 64, 128 or 256 (``STAGE_K``).

    ``pdl``: launched with programmatic dependent launch (each program waits for the
    preceding kernel, then releases the next). ``early_weights`` (with ``pdl``): the
    schedule (``block_*``) was complete before the preceding kernel started, as for FC2,
    so each program issues its first weight copies before it waits (``EARLY_WEIGHTS``).

    ``a_tma``: ``x``'s rows are in sorted order (not ``gather``) and in the unit order, and
    come by TMA with each stage (``A_TMA``) instead of the program's staging of its
    segment. ``out_unit_order``: the epilogue writes bf16 rows with each 64 columns in the
    unit order (for a next GEMM with ``a_tma``).

    ``grid_blocks`` > 0 (with ``valid_blocks``, the sort's int32 [1] count of valid row
    blocks): the grid has that many row blocks instead of the schedule's worst case, and
    program m takes the valid blocks m, m + grid_blocks, ... in turn, so the worst case's
    empty programs (each holds a slot for a load's latency) are not launched; any count
    of valid blocks is served (``TritonOptions.gluon_grid_blocks``). The same units: the
    same bits.

    ``persist`` > 0 (with ``valid_blocks``; not with ``a_tma`` or ``grid_blocks``): a 1-D
    grid of at most that many programs, each taking every ``persist``-th unit of the valid
    blocks and issuing the next unit's first weight copies while it finishes this one
    (``TritonOptions.gluon_persist``). The same units: the same bits.

    ``whole`` (with ``out``; not with ``a_tma``, ``grid_blocks`` or ``persist``): each
    program takes every K segment of its tile in turn, its ring running on from one
    segment to the next, adds the segment sums in registers in the order the split
    epilogue adds the partials, and writes its output: no partials (``part`` may be
    None), no counters, a grid of one segment (``TritonOptions.gluon_whole_upto``). The
    same sums: the same bits."""
    k = x.shape[1]
    if asynchronous is None:
        asynchronous = ASYNC_WGMMA
    if stage_k is None:
        stage_k = STAGE_K
    if stage_k not in (64, 128, 256):
        raise ValueError(f"split_partials_tma: stage_k must be 64, 128 or 256, got {stage_k}")
    if k % seg or seg % STAGE or block_m not in ((8, 16, 32) if whole else (8, 16)):
        raise ValueError(f"split_partials_tma: needs K % {seg} == 0, seg % 256 == 0 and "
                         "block_m 8 or 16 (or 32 with whole)")  # fmt: skip
    tiles, blocks, segs = triton.cdiv(n, 64), block_expert.numel(), k // seg
    epilogue = out is not None
    short = not whole and (counters is None or counters.numel() < tiles * blocks)
    if epilogue and (short or w_global is None or (fused and topk_w is None)):
        raise ValueError("split_partials_tma: out needs counters (cdiv(n, 64) * blocks "
                         "int32 zeros), w_global, and topk_w when fused")  # fmt: skip
    if a_tma and (gather or x.dtype != torch.bfloat16 or x.dim() != 2):
        raise ValueError("split_partials_tma: a_tma needs x as bf16 [rows, K] in sorted order "
                         "(gather False)")  # fmt: skip
    if out_unit_order and (not epilogue or fused):
        raise ValueError("split_partials_tma: out_unit_order needs out as bf16 rows")
    if isinstance(grid_blocks, bool) or not isinstance(grid_blocks, int) or grid_blocks < 0:
        raise ValueError(f"split_partials_tma: grid_blocks must be an int >= 0, got "
                         f"{grid_blocks!r}")  # fmt: skip
    if grid_blocks and valid_blocks is None:
        raise ValueError("split_partials_tma: grid_blocks needs valid_blocks (the sort's)")
    if isinstance(persist, bool) or not isinstance(persist, int) or persist < 0:
        raise ValueError(f"split_partials_tma: persist must be an int >= 0, got {persist!r}")
    if persist and (valid_blocks is None or a_tma or grid_blocks):
        raise ValueError("split_partials_tma: persist needs valid_blocks, and neither a_tma "
                         "nor grid_blocks")  # fmt: skip
    if whole and (out is None or a_tma or grid_blocks or persist or (stage_k or 256) != 256):
        raise ValueError("split_partials_tma: whole needs out, 256-K stages, and neither "
                         "a_tma, grid_blocks nor persist")  # fmt: skip
    if whole:  # no partials and no counters: any fp32 tensor fills their (unread) slots
        segs = 1
        part = w_global
        counters = counters if counters is not None else w_global
    elif part is None:
        raise ValueError("split_partials_tma: part (the fp32 partials) is needed unless whole")
    grid_blocks = min(grid_blocks, blocks)
    box = 2 if CODE_WIDE and stage_k == 256 else int(CODE_BOX3)
    if TILED and box == 2 and codes.shape[1] % 64 == 0:
        box = 3
    l2 = 0 if whole else _l2_ahead(box, grid_blocks, persist, stage_k, seg, buffers)
    x_ring = not whole and _x_ring(gated, block_m, grid_blocks, persist, a_tma)
    tr = 64 if whole else _tile_rows(n, box, stage_k, grid_blocks, persist, a_tma,
                                     out_unit_order, l2, x_ring)  # fmt: skip
    tiles = triton.cdiv(n, tr)
    if ROT_LAYOUT:  # the experiment's rotated copy of the codes (kept, made once)
        from .cuda_decode import _rotated

        codes = _rotated(codes)
    c_desc, s_desc = descriptors(codes, scales, box, stage_k, tr)
    x_desc = c_desc
    if a_tma:
        from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

        x = x.contiguous()
        x_desc = TensorDescriptor(x, [k // 64, x.shape[0], 64], [64, k, 1],
                                  [stage_k // 64, block_m, 64], X_SMEM3)  # fmt: skip
    pdl = pdl and PDL
    gb = grid_blocks or blocks
    grid = (tiles, segs, gb) if blocks_last else (tiles, gb, segs)
    if persist:
        gb = min(persist, tiles * segs * blocks)  # the loop's step
        grid = (gb,)
    dummy = part
    trace = dummy
    if TRACE and not grid_blocks and not persist and not whole:
        trace = torch.full((tiles * segs * gb, TRACE_FIELDS), -1, dtype=torch.int64,
                           device=x.device)  # fmt: skip
        TRACES.append((dict(n=n, k=k, gated=gated, block_m=block_m, grid=grid), trace))
    tma_split_kernel[grid](
        x, sorted_routes, c_desc, s_desc, x_desc, block_expert, block_start, block_end,
        valid_blocks if grid_blocks or persist else block_end, part,
        counters if epilogue else dummy, w_global if epilogue else dummy,
        topk_w if fused else dummy, out if epilogue else dummy,
        a_global if a_global is not None else dummy, trace, codes, scales.view(torch.uint8),
        ws_rows, gb,
        N=n, K=k, TOPK=topk, GATED=gated, A_GATHER=gather, BM=block_m,
        SEG=seg, ASYNC=asynchronous, BLOCKS_LAST=blocks_last,
        NBUF=_buffers(buffers, persist, whole),
        EPILOGUE=epilogue,
        FUSED=fused and epilogue, OUT_SCALE=out_scale, A_UNIT_ORDER=a_unit_order,
        A_FP4=a_global is not None and epilogue, BOX3=box, SK=stage_k, USE_PDL=pdl,
        EARLY_W=pdl and early_weights and EARLY_WEIGHTS, A_TMA=a_tma,
        OUT_UNIT=out_unit_order, DIAG=DIAG, LOOP=grid_blocks > 0, TRACE=trace is not dummy,
        PERSIST=persist > 0, XRING=x_ring, L2=l2, SKEW=SKEW_NS, TR=tr, WHOLE=whole,
        SA=SCHED_AHEAD and not (grid_blocks or persist), ROT=ROT_LAYOUT, num_warps=tr // 16,
        launch_pdl=pdl,
        **({} if whole else _maxnreg(gated, block_m, grid_blocks, persist, a_tma, tr)),
    )  # fmt: skip


def _buffers(buffers: int | None, persist: int, whole: bool = False) -> int:
    """A launch's ring buffers: ``buffers``, else ``WHOLE_BUFFERS`` for a whole-K launch,
    ``PERSIST_BUFFERS`` for a PERSIST launch when set, else ``BUFFERS``."""
    if buffers is not None:
        return buffers
    if whole:
        return WHOLE_BUFFERS
    if persist and PERSIST_BUFFERS is not None:
        return PERSIST_BUFFERS
    return BUFFERS


def _l2_ahead(
    box: int, grid_blocks: int, persist: int, stage_k: int, seg: int, buffers: int | None
) -> int:
    """Stages a launch prefetches into L2 ahead of its ring: ``L2_AHEAD`` where it applies
    (the one-block body on the row-major weights), at most the stages beyond the ring."""
    nb = min(BUFFERS if buffers is None else buffers, seg // stage_k)
    if box == 3 or grid_blocks or persist:
        return 0
    return max(0, min(L2_AHEAD, seg // stage_k - nb))


def _x_ring(gated: bool, block_m: int, grid_blocks: int, persist: int, a_tma: bool) -> bool:
    """Whether a launch stages its rows a ring stage at a time: ``X_RING`` on, a GEMM and
    tile height of ``X_RING_MAXNREG`` (8-row tiles), the one-block body, rows not by TMA."""
    return X_RING and (gated, block_m) in X_RING_MAXNREG and not (a_tma or grid_blocks or persist)


def _tile_rows(n: int, box: int, stage_k: int, grid_blocks: int, persist: int, a_tma: bool,
               out_unit_order: bool, l2: int, x_ring: bool) -> int:  # fmt: skip
    """A launch's weight rows a tile: ``TILE_ROWS`` where it applies (the one-block body
    with CODE_WIDE boxes of 256-K stages, N a multiple of it, no trace, no L2 prefetch,
    no X_RING, no rows by TMA), else 64."""
    tr = TILE_ROWS
    if tr not in (64, 128):
        raise ValueError(f"gluon_ws.TILE_ROWS: expected 64 or 128, got {tr!r}")
    if tr == 64 or n % tr or box != 2 or stage_k != 256 or grid_blocks or persist or a_tma:
        return 64
    if out_unit_order or l2 or x_ring or TRACE:
        return 64
    return tr


def _maxnreg(gated: bool, block_m: int, grid_blocks: int, persist: int, a_tma: bool,
             tile_rows: int = 64) -> dict:  # fmt: skip
    """The launch's register cap: LOOP's (``LOOP_MAXNREG``), X_RING's (``X_RING_MAXNREG``),
    128-row tiles' (``TILE_ROWS_MAXNREG``), or none (PERSIST and the one-block body need
    none)."""
    if tile_rows == 128:
        cap = TILE_ROWS_MAXNREG.get((gated, block_m))
        return {"maxnreg": cap} if cap else {}
    if grid_blocks:
        return {"maxnreg": LOOP_MAXNREG[gated, block_m]}
    if _x_ring(gated, block_m, grid_blocks, persist, a_tma):
        return {"maxnreg": X_RING_MAXNREG[gated, block_m]}
    return {}


def compile_sm90(
    *,
    n: int,
    k: int,
    gated: bool,
    block_m: int,
    asynchronous: bool = False,
    buffers: int = 4,
    epilogue: bool = False,
    fused: bool = False,
    a_fp4: bool = False,
    box3: int = 0,
    stage_k: int = 256,
    pdl: bool = False,
    early_weights: bool = False,
    a_tma: bool = False,
    out_unit_order: bool = False,
    diag: int = 0,
    loop_blocks: int = 0,
    maxnreg: int | None = None,
    trace: bool = False,
    seg: int = 1024,
    persist: bool = False,
    x_ring: bool = False,
    l2: int = 0,
    skew: int = 0,
    tile_rows: int = 64,
    whole: bool = False,
    sched_ahead: bool = False,
    rot: bool = False,
):
    """Compile one specialization for sm_90 without a GPU (``common.compile_sm90``); the
    layout conversions are asserted trivial at compile time. ``box3``: the code copies
    (0 four 2-D boxes a stage, 1 one 3-D box, 2 one wide swizzled box, 3 the same from
    ``tiled_weights``). Returns the compiled kernel."""
    ptrs = {
        "x_ptr": "*bf16", "sorted_routes_ptr": "*i32", "block_expert_ptr": "*i32",
        "block_start_ptr": "*i32", "block_end_ptr": "*i32", "valid_blocks_ptr": "*i32",
        "part_ptr": "*fp32",
        "cnt_ptr": "*i32", "w_global_ptr": "*fp32", "topk_w_ptr": "*fp32",
        "out_ptr": "*fp32" if fused else "*bf16", "a_global_ptr": "*fp32",
        "trace_ptr": "*i64", "c_ptr": "*u8", "s_ptr": "*u8",
    }  # fmt: skip
    descs = {
        "c_desc": f"tensordesc<u8[{tile_rows}, {stage_k // 2}],{CODE_SMEM_W!r}>"
        if box3 >= 2
        else f"tensordesc<u8[{stage_k // 64}, 64, 32],{CODE_SMEM3!r}>"
        if box3
        else f"tensordesc<u8[64, 32],{CODE_SMEM!r}>",
        "s_desc": f"tensordesc<u8[{tile_rows}, 16],{SCALE_SMEM!r}>",
    }
    descs["x_desc"] = (
        f"tensordesc<bf16[{stage_k // 64}, {block_m}, 64],{X_SMEM3!r}>"
        if a_tma
        else descs["c_desc"]
    )
    const = dict(N=n, K=k, TOPK=8, GATED=gated, A_GATHER=gated and not a_tma, BM=block_m,
                 SEG=seg,
                 ASYNC=asynchronous, BLOCKS_LAST=True, NBUF=buffers, EPILOGUE=epilogue,
                 FUSED=fused, OUT_SCALE=2.0**16 if a_fp4 else 2.0**8, A_UNIT_ORDER=a_fp4,
                 A_FP4=a_fp4, BOX3=int(box3), SK=stage_k, USE_PDL=pdl,
                 EARLY_W=pdl and early_weights, A_TMA=a_tma, OUT_UNIT=out_unit_order,
                 DIAG=diag, LOOP=loop_blocks > 0, TRACE=trace, PERSIST=persist,
                 XRING=x_ring, L2=l2, SKEW=skew, TR=tile_rows, WHOLE=whole,
                 SA=sched_ahead, ROT=rot)  # fmt: skip
    opts = {} if maxnreg is None else {"maxnreg": maxnreg}
    return common_compile_sm90(tma_split_kernel, ptrs, const, ints=("ws_rows", "loop_step"),
                               gluon=True, descs=descs, num_warps=tile_rows // 16,
                               launch_pdl=pdl, **opts)  # fmt: skip
