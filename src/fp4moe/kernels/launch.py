"""The Triton backend of ``fp4moe.moe``: sort, (quantize), FC1, (quantize), FC2, finalize.

Every step is on the device with no host synchronization, so the sequence can be
captured in a CUDA graph (``fp4moe.runner``). Consecutive Triton kernels use
programmatic dependent launch when ``pdl`` is on (the default on a GPU; off in the
interpreter): each waits on its predecessor's output with ``gdc_wait`` and releases its
dependents right after, and the finalize kernel reads routing metadata before its wait.
"""

from __future__ import annotations

import functools
import math
import os
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch
import triton
import triton.language as tl

from ..experts import PreparedExperts
from ..nvfp4 import global_from_amax
from .dequant import dense_rows, dense_weights
from .finalize import (
    cast_kernel,
    finalize_block_h,
    finalize_kernel,
    finalize_tokens_per_program,
)
from .gemm import GemmConfig, choose_gemm_config, moe_gemm_kernel
from .quantize import (
    MODE_AMAX_SELF,
    MODE_FROM_AMAX,
    MODE_PER_ROW,
    MODE_SCALAR,
    MODE_STATIC,
    amax_rows_kernel,
    quantize_rows_kernel,
)
from .sort import RouteSort, max_blocks, sort_routes

SEGMENT = 1024  # K elements a segment of the segmented loop (chunked=3), fixed for all sizes

__all__ = [
    "TritonOptions",
    "expert_gemms",
    "finalize_rows",
    "gemm_configs",
    "gemm_configs_for",
    "interpreting",
    "moe_triton",
    "quantize_rows",
    "use_pdl",
    "workspace_bytes",
]


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


UNKNOWN_VALID_FRACTION = 1 / 6  # TritonOptions.valid_fraction when not given
# Above 8 rows an expert, loop 3 splits K of a GEMM whose expected programs without the
# split are fewer than this (``TritonOptions.gemm_splits``): Mixtral-8x7B's FC2 (32 row
# tiles x 8 experts = 256 programs of K = 14336) on an H200's 132 SMs. Measured there
# (session 7, docs/bench/configs-session7-*.json): Mixtral at 256 tokens split 1020 us
# against 1158 not; DeepSeek-V3 EP8 at 64 to 1024 tokens (512 to 1557 programs a GEMM)
# and Qwen3-30B-A3B at 256 tokens (1536) lose 3% to 7% to the split.
SPLIT_BELOW_PROGRAMS = 384
# quantize_rows: up to QUANTIZE_SPLIT_ROWS rows, one QUANTIZE_SPLIT_C-element chunk of a row
# a program instead of one row a program (the same bits). Up to QUANTIZE_SPLIT_ROWS rows the
# amax passes (per-row in quantize_rows, per-tensor in amax_rows) also read a row in one
# load of up to AMAX_WIDE_C elements, not in a chain of 1024-element loads (max is exact in
# any order: the same bits). Measured on the H200 (benchmarks/sweep_decode.py --variants c3
# c3-qsplit, DeepSeek-V3 EP8, session 6): W4A4 per-token 82.2 -> 77.3 us at 1 token, per-
# tensor 87.5 -> 82.4 (1 token) and 120.8 -> 111.4 (16 tokens), a tie at 64 tokens (x 64
# rows, FC1 output 512). Above 512 rows each of a row's chunk programs re-reads the row
# for its amax, so the split stays off there (unmeasured).
QUANTIZE_SPLIT_ROWS = 512
# amax_rows above QUANTIZE_SPLIT_ROWS rows: rows a program (one atomic max each)
AMAX_ROWS = 16
QUANTIZE_SPLIT_C = 256
# Experiment (session 19, off: refuted in session 20): each quantize program loads its
# first chunk of the row before the loads of its global (the row's amax, or per-tensor
# W4A4's pass over every counted row at few rows), so that the two latencies overlap. The
# same values: the same bits (every sweep row of s20b). Per-tensor W4A4's fused 1-token
# call spends 4.8 us in its second quantize after FC1, per-token 3.2 (perf-notes session
# 19 item 6). Measured (``sweep_decode.py --variants c3 c3-rowfirst``, s20b, DeepSeek-V3
# EP8, us): per-tensor fused 1 / 16 tokens 53.2 / 62.9 -> 53.8 / 63.1, deterministic 50.0 /
# 63.2 -> 49.8 / 63.6; per-token within 1.3 us either way: no gain.
QUANTIZE_ROW_FIRST = False
AMAX_WIDE_C = 8192


@dataclass(frozen=True)
class TritonOptions:
    """Switches of the Triton backend (tests and benchmarks pin them).

    pdl: programmatic dependent launch between consecutive kernels (None: on for CUDA
        devices of compute capability >= 9, off in the interpreter).
    fc1 / fc2: pinned GEMM configs (None: ``choose_gemm_config``).
    decode_asm: decode NVFP4 operands with inline PTX (GPU only; the interpreter always
        uses the plain Triton decode, which gives the same values). On by default: 1.4x
        to 1.6x faster than the plain decode at decode sizes (docs/perf-notes.md).
    chunked: the GEMM main loop. 3 (default): K in the unit order (``k_order``: in each
        64 elements, position 16 s + 8 b + 2 q + a holds element 16 q + 4 s + 2 a + b;
        ``gemm.decode_permuted``; the chunk order below when 64 does not divide K) in
        fixed K segments of ``SEGMENT`` elements summed in segment order, so that K can
        be split over programs at decode sizes (``split_k``) with the same bits as at
        prefill sizes (docs/perf-notes.md). 2: the chunk order (for each 32 elements,
        the 16 even then the 16 odd ones) in one segment, one dot a K tile; 1: loop 2's
        order as two K=16 dots a chunk (slow, kept for comparison); 0: the first loop
        (natural K order). Loops 0, 2 and 3 give different bits; each is batch
        invariant: its summation order does not depend on the config (loop 3: on any
        config whose K tile is a multiple of 64, which every default one is).
    split_k: loop 3 only: one program a K segment, partials summed by the last program
        of a tile (None: ``gemm_splits`` decides each GEMM: both when an expert averages
        at most 8 rows counting every route of the call, else a GEMM whose expected
        programs are too few to fill the GPU). Same bits either way.
    device_amax: per-tensor W4A4 takes its amaxes with one Triton kernel each (an atomic
        max) instead of 8 to 12 torch ops; the same bits (interpreter and H200,
        ``test_device_amax_gpu``), 9% to 21% faster on the H200 (docs/perf-notes.md), so
        on by default; False keeps the torch-op path for comparison.
    fc1_nvfp4_out: static W4A4 only: FC1 writes the activation as NVFP4 directly (no
        bf16 round trip, no second quantize kernel); bit-identical to the two-step path
        (tested in the interpreter and on the H200), so on by default.
    dense_above: when the expected valid routes an expert (below) exceed it (or
        ``prefill_above`` where ``gluon_prefill`` runs both GEMMs), the call takes the
        dense path: each GEMM runs on ``gluon_prefill`` where that applies, else its
        expert weights and W4A4 activations are decoded once a call
        (``dequant.dense_weights`` / ``dense_rows``: the loop's own operand values and
        order, bf16; W4A16 activations are put in that order) and the GEMM loads both
        operands instead of decoding in its main loop. The same operands in the same
        order: the same bits as without it (tested), so batch invariance holds across the
        threshold. Costs a bf16 copy of one GEMM's weights (E * 2I * H * 2 bytes for FC1)
        and of the activations during the call. Loops 2 and 3 only (the others ignore
        it); None: off. Default 192, from the H200 (docs/perf-notes.md): decoding every
        expert's weights (1.0 ms for 1.4e9 weights) pays off from about 256 valid rows an
        expert (W4A16 at 8192 tokens: Qwen3-30B-A3B, 512 rows, 3.14 -> 2.14 ms;
        Mixtral-8x7B 26.0 -> 12.2 ms; DeepSeek-V3 EP8, 256 rows, 4.18 -> 3.81 ms, W4A4
        per-token 3.99 -> 3.94 ms), and loses below (128 rows: DeepSeek-V3 at 4096 tokens
        2.28 -> 2.98 ms, Qwen3 at 2048 tokens 1.08 -> 1.30 ms, before the decode's wider
        tiles).
    valid_fraction: the expected fraction of a call's routes that are valid (not masked),
        for the dense switch: valid routes an expert = T * top-k * valid_fraction / E.
        Expert parallelism by masking over R ranks with balanced routing: 1 / R; every
        route valid (no masking, ``fp4moe.distributed``): 1.0. None (unknown): taken as
        1/6, so that a call masking 7 of 8 routes does not switch where it would lose.
    poison: fill every workspace and the output with NaN (0xFF bytes for codes and
        scales) before the kernels run, so tests see any element no kernel wrote.
    fused_amax: per-tensor W4A4: FC1's epilogue takes the amax of its output (an atomic max
        of each tile's max |a| over the valid rows, exact in any order) instead of a
        separate ``amax_rows`` kernel, its zero from the sort kernel's buffer
        (``split_counters(amax=...)``): the same
        global scale, the same bits, one kernel and one memset fewer a call. Off: no
        gain on the H200 (session 8, ``sweep_decode.py --modes w4a4-tensor --variants c3
        c3-famax``: 65.8 against 66.3 us at 1 token, 87.5 against 84.3 at 16, 287.8
        against 290.3 at 64; the same bits).
    gluon_decode: split-K calls (``gluon_split``) run their GEMMs as the Gluon kernel of
        ``kernels.gluon_ws``, whose programs fetch their segment's weight codes and scales
        with TMA through a shared-memory ring, decode them straight into the wgmma
        register fragment, and whose last unit of a tile sums the partials and runs the
        epilogue. The same operands, order and sums as loop 3's split programs: the same
        bits. W4A16, and W4A4 on its rows decoded once (``dense_rows``, or
        ``quantize_decoded``). Needs K a multiple of 1024 (the others stay on loop 3), a
        Hopper GPU and Triton 3.6 (``hopper_device``, ``gluon_available``; elsewhere loop
        3; Gluon has no interpreter). On by default since session 9: DeepSeek-V3 EP8
        W4A16 whole calls 1 token 54.3 -> 50.4 us, 16 tokens 68.4 -> 61.1, 32 tokens
        200.4 -> 169.7 (docs/perf-notes.md, session 9).
    ordered_x: W4A16 with both GEMMs in loop 3's unit order (``k_order`` 64, not dense,
        not where they run as the Gluon kernels of ``gluon_decode``): the GEMMs load
        activation rows already in that order, so the A operand goes from global to
        shared memory to the wgmma with no register permutation, shared-memory round trip
        or fence each K tile. FC1's input is put in that order once a call (by the sort
        kernel, ``ordered_in_sort``, or else by ``dequant.dense_rows``), FC2's is written
        so by FC1's epilogue (``OUT_ORDERED``). The same operands in the same order: the same bits.
        Off: it loses at 1 and 16 tokens. On the H200 (session 8) the GEMMs gain 2% to
        5% from 16 tokens on but the reordering kernel costs about 3 us a call (1 token:
        DeepSeek-V3 56.0 -> 58.9 us, Qwen3 33.2 -> 38.0). With the rows from the sort
        kernel (``ordered_in_sort``; session 9, W4A16, against the (tiles, blocks,
        segments) grid, ``blocks_last`` off then): DeepSeek-V3 EP8 54.9 -> 56.4 us at 1
        token, 73.2 -> 78.9 at 16, 208.3 -> 215.4 at 32, but 2% to 3% faster at 64 and
        256 tokens (260.7 -> 255.5, 463.5 -> 450.0); Qwen3-30B-A3B 30.6 -> 33.8 at 1
        token, ties at 16 and 64; Mixtral-8x7B 108.1 -> 100.5 at 1 token, 355.5 -> 359.0
        at 16, 536.4 -> 519.3 at 64. The sort kernel's copy of x is likely the loss: few
        programs copy whole rows in series (8 at 16 tokens of DeepSeek-V3, 1 at 1 token;
        docs/perf-notes.md, session 9).
    ordered_in_sort: with ``ordered_x``, the Triton sort kernel (up to ``SMALL_ROUTES``
        routes) writes FC1's reordered input (``sort_routes(x=...)``) instead of a
        reorder kernel of its own; False: the reorder kernel (as measured in session 8).
    blocks_last: split-K GEMMs on the 3-D grid launch (weight tiles, K segments, row
        blocks) instead of (weight tiles, row blocks, K segments): the hardware hands out
        programs in that order, so every valid unit comes before the worst-case grid's
        empty row blocks (the valid blocks come first), which then exit in the tail
        instead of taking slots among the work. The same units: the same bits. On: on the
        H200 (session 9, docs/perf-notes.md; W4A16, ``sweep_decode.py``, this grid against
        the other, now ``--variants c3 c3-noblast``) DeepSeek-V3 EP8 73.2 -> 66.3 us at 16
        tokens, 208.3 -> 198.8 at 32, 54.9 -> 53.5 at 1, a tie at 64 and 256 (260.7 /
        261.0, 463.5 / 464.2); Qwen3-30B-A3B 30.6 -> 29.2 at 1 token, ties at 16 and 64;
        Mixtral-8x7B 108.1 -> 101.9 at 1, 355.5 -> 347.2 at 16, 536.4 -> 534.3 at 64.
        False: the (tiles, blocks, segments) grid.
    gluon_upto: the expected valid rows an expert (``valid_rows``: all routes times
        ``valid_fraction`` over the local experts) up to which a call whose GEMMs can take
        the Gluon kernels (``gluon_decode``) runs them, with split K and 8-row tiles. The
        same bits at any value. 4 since session 10 (``gluon_experiment.py --whole-only
        --gluon-upto 1000 --preset P``, W4A16 whole calls, loop 3 -> Gluon): wins at 1 to 4
        valid rows (DeepSeek-V3 EP8 64 tokens 274.6 -> 221.6 us, 128 tokens 353.1 ->
        341.1; Mixtral-8x7B 16 tokens 350.8 -> 283.3; Kimi-K2 EP8 128 tokens 448.5 ->
        404.4), losses from 5.3 (Kimi-K2 256 tokens 547.3 -> 623.8; DeepSeek-V3 256
        tokens 467.0 -> 581.7; Mixtral 32 tokens 354.0 -> 416.2, where session 9's rule
        of 8 routes an expert had put it).
    quantize_decoded: W4A4 GEMMs on the Gluon kernels take their decoded operand rows
        from the quantize kernels, which write them next to the codes
        (``quantize_rows(decoded=...)``), instead of a ``dense_rows`` launch a GEMM. The
        same values (interpreter: ``test_quantize_writes_decoded_rows``), so the same
        bits. On since session 10: DeepSeek-V3 EP8, 1 / 16 / 32 tokens, per-token
        59.1 / 68.7 / 179.3 -> 55.7 / 65.0 / 175.6 us, per-tensor 61.9 / 72.4 / 182.3 ->
        59.3 / 68.8 / 179.2 (bitwise the same; ``sweep_decode.py --variants c3 c3-qdec``).
    gluon_pdl_upto: the expected valid routes of a call (all routes times
        ``valid_fraction``) up to which the Gluon kernels join the call's PDL chain (with
        ``pdl``): each waits for the kernel before and releases the next, and FC2 issues
        its first weight copies before its wait (``gluon_ws.EARLY_WEIGHTS``). The same
        bits. 32 since session 11 (``gluon_experiment.py --whole-only --pdl off on
        early``, W4A16, plain launches -> PDL with early copies): DeepSeek-V3 EP8 1 / 8 /
        16 / 32 tokens (1 to 32 valid routes) 47.4 / 100.2 / 62.9 / 165.0 -> 46.4 / 95.6 /
        59.7 / 165.0 us, Mixtral-8x7B 1 / 16 tokens (2 / 32 routes) 88.4 / 293.9 -> 84.1 /
        281.8; but DeepSeek-V3 64 and 128 tokens (64, 128 routes) 218.0 / 344.8 -> 224.7
        / 358.0 (PDL with FC2 copying after its wait: 235.0 / 373.6).
    fc1_early: W4A4 through ``moe_triton``: FC1's Gluon programs, too, issue their first
        weight copies before their grid wait (``early_weights``), as FC2's do: a quantize
        kernel that waited for the sort runs between the sort and FC1, so the schedule is
        complete when FC1's programs start. The same bits. On since session 12
        (``sweep_decode.py --modes w4a4-token w4a4-tensor --variants c3 c3-fc1early``,
        DeepSeek-V3 EP8 1 / 16 / 32 tokens): per-token 53.3 / 64.8 / 161.7 -> 51.9 /
        61.1 / 157.5 us, per-tensor 54.1 / 66.9 / 165.9 -> 54.4 / 65.1 / 164.5.
    gluon_a_tma: the Gluon kernels take their activation rows by TMA with each stage of
        weights (``gluon_ws`` ``A_TMA``) instead of staging a segment's rows through
        registers first: 12 KB less shared memory a program (8-row tiles) and no gathered
        loads in the prologue. The rows must be in sorted and unit order: W4A16's FC1
        input is gathered so once a call (``dense_rows(index=...)``), FC1 then writes its
        output rows in the unit order for FC2; W4A4's decoded rows are in that order
        already, except FC1's per-token and per-tensor ones (in token order: staged as
        before). The same bits (GPU: ``test_gluon_a_tma_gpu``). Off: no gain on the H200
        (session 11, ``gluon_experiment.py --whole-only --a-tma off on``, DeepSeek-V3
        EP8 W4A16 1 / 16 / 64 tokens 43.9 / 60.2 / 206.2 -> 50.0 / 60.0 / 206.2 us: the
        gather launch costs 6 us at 1 token, the GEMMs do not gain).
    amax_self_upto: per-tensor W4A4 (``device_amax``, no expert parallelism): where the
        rows to quantize hold at most this many elements (FC1: tokens x H; FC2: all routes x
        I, the host's bound), the quantize kernel takes the amax itself
        (``quantize.MODE_AMAX_SELF``: each program reads every counted row) instead of an
        amax kernel before it: one launch less. The amax is a max, exact in any order: the
        same bits. 16384 since session 12 (DeepSeek-V3 EP8: FC1 and FC2 at 1 token, FC1 at
        2; per-tensor W4A4 at 1 token 56.0 -> 52.2 us, ``sweep_decode.py --variants c3
        c3-noamaxself``); 0 turns it off.
    dense_overlap: on the dense path on a GPU, FC2's weights are decoded on a side
        stream while FC1 runs (the stream joins before FC2), instead of after FC1 in the
        call's stream. The same kernels, the same bits; FC2's decoded weights are held
        during FC1 too (``workspace_bytes``). Off: no gain on the H200 (session 15,
        ``sweep_decode.py --variants c3 c3-nodenseoverlap``, DeepSeek-V3 EP8 W4A16 at
        8192 tokens 3585.7 us off against 3805.4 on; W4A4 and 16384 tokens within 0.5%):
        the side stream's decode takes SMs from FC1's GEMM rather than filling idle
        HBM time.
    amax_zeros_in_sort: per-tensor W4A4's amax kernels (``amax_rows``) fold into fp32
        zeros that the sort kernel clears with the split counters (``split_counters``'
        amax slots) instead of a ``torch.zeros`` each: no memset kernel (which has no
        PDL) before them. The same amax, the same bits.
    fused_chain: the fused finalize keeps the call's kernels one PDL chain: its fp32
        accumulator is zeroed before the route sort (not between the quantize kernel and
        FC1, where the memset kept W4A4's FC1 from issuing its first weight copies during
        the quantize: ``fc1_early``), and its bf16 cast is a PDL launch (``cast_rows``)
        instead of torch's. Off: the zeros after W4A4's quantize and torch's cast (before
        session 16). The same bits.
    gluon_prefill: on the dense path (``dense_for``) on a Hopper GPU, each GEMM whose
        shape fits (``gluon_prefill.applies``: K a multiple of 1024, whole 64- or 128-row
        weight tiles) runs as ``gluon_prefill.prefill_kernel``: the weights decoded in
        registers for each 128-row tile, as the decode-size kernels do, instead of
        ``dense_weights`` writing every expert's weights to HBM in bf16 once a call and a
        bf16 GEMM reading them back. The same operands, order and sums (loop 3's bits);
        static W4A4's FC1 then writes bf16 and quantizes in a second kernel (the
        bit-identical two-step path of ``fc1_nvfp4_out``). On since session 17: the same
        bits, DeepSeek-V3 EP8 at 8192 / 16384 tokens W4A16 3607.6 / 5336.0 -> 2387.4 /
        4300.4 us, W4A4 per-token 3890.2 / 5829.4 -> 2619.5 / 4677.5
        (``sweep_decode.py --variants c3 c3-prefill``).
    prefill_above: where ``gluon_prefill`` runs both GEMMs of a call's shape, the dense
        path (as the prefill kernel) starts above this many expected valid rows an expert
        instead of ``dense_above`` (the kernel has no fixed decode cost to repay). 32
        since session 19 (96 before; ``sweep_decode.py --variants c3 c3-pa32 c3-pa48``,
        W4A16, loop 3 -> prefill kernel, us): DeepSeek-V3 EP8 at 48 / 64 / 96 rows an
        expert (1536 / 2048 / 3072 tokens) 1105.3 / 1146.6 / 1449.5 -> 951.8 / 971.3 /
        1083.3, Mixtral-8x7B at 48 / 64 / 96 rows (192 / 256 / 384 tokens) 1192.9 /
        1061.5 / 1341.1 -> 721.9 / 727.9 / 738.2, W4A4 per-token alike. At 32 rows the
        shapes part: Mixtral-8x7B (128 tokens) 886.7 -> 721.0, DeepSeek-V3 (1024 tokens)
        868.9 -> 938.0; at 24 Mixtral-8x7B (96 tokens, whole-K) 615.7 -> 719.0. None:
        off.
    prefill_above_long: ``prefill_above`` for shapes whose GEMMs both have K of at least
        ``PREFILL_LONG_K`` (4096; both ``hidden`` and ``inter``), where the prefill
        kernel's fixed cost a tile (its prologue, the epilogue through shared memory) is
        spread over more K: 24 since session 19 (Mixtral-8x7B W4A16 at 32 rows an expert,
        128 tokens, 886.7 us on loop 3 against 721.0 on the prefill kernel; at 24 rows, 96
        tokens, 615.7 on the whole-K kernels against 719.0; DeepSeek-V3 EP8, K 2048 in
        FC2, loses at 32 rows: 868.9 against 938.0). 28 since session 20, where
        ``gluon_whole_wide``'s 32-row whole-K kernels take Mixtral's 25 to 28 rows (112
        tokens: 724.4 us on the prefill kernel, 577.4 on them). None: ``prefill_above``
        everywhere.
    gluon_whole_k: experiment (session 17, off until measured): W4A16 GEMMs that would
        run as the decode-size Gluon kernels (``gluon_decode``) run as
        ``gluon_prefill.prefill_kernel`` with the schedule's 8-row blocks instead: one
        program (8 warps) owns 128 weight rows over the whole K, a ring of four 256-K
        stages in flight, two programs an SM, no split-K partials and no second wave of
        programs; the rows gathered into sorted unit order first (``dense_rows``). The
        same bits.
    gluon_whole_upto: the expected valid rows an expert (``valid_rows``) up to which GEMMs
        that loop 3 would run unsplit and not dense (above ``gluon_upto``; DeepSeek-V3 EP8
        at 256 to 768 tokens) run as the Gluon kernels with whole-K programs and 16-row
        tiles instead
        (``gluon_ws.split_partials_tma(whole=True)``): a program owns 64 weight rows of
        one row block over all of K, its ring running from one 1024-K segment to the
        next, and adds the segment sums in registers in the split epilogue's order, so
        no partials, counters or second pass; the TMA copies and the in-register decode
        of the decode-size kernels. Not for FC1 writing NVFP4 (static W4A4) or taking
        the fused amax. The same bits. 0: off. 24 since session 18 (``sweep_decode.py
        --variants c3 c3-whole24``, s18c, loop 3 -> whole-K, us): DeepSeek-V3 EP8 W4A16
        256 / 384 / 512 / 768 tokens 474.8 / 790.2 / 794.3 / 844.1 -> 435.1 / 494.5 /
        580.6 / 805.8 (W4A4 per-token alike), Mixtral-8x7B 64 tokens 545.2 -> 492.4,
        Qwen3-30B-A3B 256 / 384 tokens 332.1 / 414.1 -> 314.8 / 381.2. 28 since session
        20, with ``gluon_whole_wide``'s 32-row tiles above 21.5 rows (28 rows: DeepSeek-V3
        EP8 896 tokens 847.0 -> 765.5 us, Mixtral-8x7B 112 tokens 724.4 -> 577.4; 32 rows
        lose).
    gluon_whole_over: above this many expected valid rows an expert (and up to
        ``gluon_upto``) a call whose two GEMMs would both run whole-K (loop 3 unsplit,
        ``whole_runs``) takes the whole-K Gluon kernels at 16-row tiles instead of the
        split ones at 8-row tiles. None: off (the split kernels up to ``gluon_upto``).
        The same bits. 3.5 since session 19 (DeepSeek-V3 EP8 W4A16, split -> whole-K, us:
        64 / 96 / 128 tokens, 2 / 3 / 4 rows, 212.9 / 262.0 / 324.3 -> 239.6 / 272.3 /
        296.7 in session 18; with the rule, ``sweep_decode.py --variants c3 c3-noover``,
        128 tokens 323.2 -> 300.8, per-token W4A4 341.7 -> 309.7, Kimi-K2 EP8 at 192
        tokens 395.5 -> 369.8): whole-K's cost is flat in the rows up to its 16, the split
        kernels' grows with them, and they cross near 3.3 rows.
    gluon_whole_fill: a GEMM that would run whole-K (``whole_runs``) splits K instead (the
        split Gluon kernel at 16-row tiles) where its expected whole-K programs (touched
        experts x 64-row tiles x 16-row blocks) are fewer than this many times the SMs'
        slots for them (``gluon_ws.WHOLE_PER_SM`` an SM): Mixtral-8x7B's FC2 at 64 tokens
        makes 512 programs of K 14336 for 660 slots. 0: never. The same bits.
    gluon_whole_wide: above this many expected valid rows an expert, a call whose GEMMs
        run whole-K (``whole_runs``, up to ``gluon_whole_upto``) takes 32-row tiles
        instead of 16 (both GEMMs: one tile schedule), so that each weight is decoded
        once for up to 32 rows of an expert instead of once a 16-row block: the wgmma's N
        is 32, the segment's rows 64 KB of shared memory (staged a 256-K stage at a
        time), FC1 159 registers and 84 KB (two programs an SM), FC2 about 105 and 75 KB
        (three). The same operands and sums: the same bits. None: off. 21.5 since session
        20 (``sweep_decode.py --variants c3 c3-wide24 c3-wide32``, s20d, W4A16, us):
        DeepSeek-V3 EP8 at 768 / 896 tokens (24 / 28 rows) 792.9 / 847.0 -> 755.4 /
        765.5, Mixtral-8x7B at 96 / 112 tokens (24 / 28 rows) 609.6 / 724.4 -> 573.3 /
        577.4 (W4A4 per-token 673.2 / 785.6 -> 613.3 / 625.5); at 32 rows it loses
        (DeepSeek-V3 1024 tokens 864.5 -> 868.8, Mixtral 128 tokens 716.7 -> 778.2: many
        experts hold two 32-row blocks), hence ``gluon_whole_upto`` 28; at 18 rows too
        (``--variants c3 c3-nowide`` with 16 here, s20e: DeepSeek-V3 576 tokens 608.9 ->
        650.7, Mixtral 72 tokens 525.6 -> 546.8, Qwen3-30B-A3B 288 tokens 227.8 -> 226.8),
        at 20 even on DeepSeek-V3 and Mixtral (s20d: DeepSeek-V3 640 tokens 671.9 -> 661.3,
        Mixtral 80 tokens 519.2 -> 519.9) and a win on Qwen3 (s20f: 320 tokens 246.0 ->
        223.8), but a loss on Kimi-K2 EP8 at 19 to 21 rows (s20g: 928 / 960 / 1024 tokens
        964.2 / 896.2 / 947.3 -> 999.2 / 953.9 / 962.2; 1056 tokens, 22 rows, 1004.6 ->
        993.2), hence 21.5: 22 rows gain on every preset measured (Mixtral 88 tokens 566.3
        -> 518.3, Qwen3 352 tokens 260.5 -> 227.7), Kimi-K2's 1024 tokens (21.3 rows) keep
        the 16-row tiles.
    gluon_grid_blocks: the row blocks of the Gluon kernels' grid. None: the schedule's
        worst case (``max_blocks``: every route in an expert of its own), whose empty
        programs each hold one of the SM's few slots (shared memory allows 6 to 8) for a
        load's latency before they exit: at 16 tokens of DeepSeek-V3 EP8, 36 of 40 row
        blocks are empty, 8064 programs a GEMM. An int G, or "auto" (the expected valid
        blocks, routes spread evenly: touched experts + valid routes / 8, plus 2): the
        grid has G row blocks and program m takes the valid blocks m, m + G, ... (the
        sort's ``valid_blocks``), so any routing is served and at most G - valid blocks
        are empty. The same units and sums: the same bits. Off: no gain on the H200
        (session 12, ``gluon_experiment.py --whole-only --grid-blocks off auto``, W4A16 1
        / 16 / 64 / 128 tokens 44.3 / 60.2 / 209.7 / 329.7 -> 46.9 / 60.1 / 212.0 / 317.4
        us): the empty programs cost the Gluon kernels nothing measurable.
    gluon_persist: the Gluon kernels as persistent programs (``gluon_ws`` PERSIST): None
        off; "auto" as many programs as the SMs hold (``gluon_ws.PERSIST_PER_SM`` an SM);
        an int, that many programs an SM. Program p takes every P-th unit (weight tile, K
        segment, valid row block) and issues the next unit's first weight copies in its
        last ring stage, so its copies do not stop between units (the worst-case grid's
        programs each pay their schedule reads, row staging and epilogue with no copy in
        flight, and a second wave pays the whole chain again). Not with
        ``gluon_a_tma`` or ``gluon_grid_blocks`` (those win). The same units and sums: the
        same bits. Off: slower on the H200 (session 13, ``sweep_decode.py --variants c3
        c3-persist``, DeepSeek-V3 EP8 W4A16 1 / 8 / 16 / 32 / 64 / 128 tokens 45.1 / 90.7
        / 58.8 / 155.7 / 205.6 / 330.1 -> 46.3 / 97.1 / 56.0 / 175.8 / 224.5 / 374.4 us):
        the hardware hands a freed slot the next program at once, while a fixed stride
        holds a program's later units behind its slow ones (measured under a register cap
        that gave FC2 a 16-byte stack, since removed; ``gpu_session.sh s14a`` re-times it).
    cuda_decode: W4A16's GEMMs that would run on the Gluon kernels at 8- or 16-row tiles
        (split or whole-K) run on the CUDA C++ kernel of ``kernels.cuda_decode`` instead,
        where it is available (nvcc, a Hopper GPU) and the shape fits
        (``cuda_decode.applies``): each weight loaded from HBM into its MMA fragment's
        registers, a tile's K segments the warps of one thread block summed in shared
        memory. The same decode, K order, segment sums and epilogue operations: the same
        bits (``mma.sync`` gives the wgmma's sums). Off: no faster on the H200 (session
        21, ``sweep_decode.py --variants c3 c3-cuda-d2-r1 c3-cuda-d2-r1-fc1``, W4A16
        DeepSeek-V3 EP8 1 / 8 / 16 / 64 tokens 47.1 / 92.0 / 60.5 / 211.2 -> 53.9 / 102.3
        / 59.5 / 229.6 us, FC1 alone on it 52.4 / 96.9 / 56.7 / 230.3; it gains only
        where the split Gluon FC1 runs a second wave).
    """

    pdl: bool | None = None
    fc1: GemmConfig | None = None
    fc2: GemmConfig | None = None
    decode_asm: bool = True
    chunked: int = 3
    split_k: bool | None = None
    device_amax: bool = True
    poison: bool = False
    fc1_nvfp4_out: bool = True
    dense_above: int | None = 192
    valid_fraction: float | None = None
    gluon_decode: bool = True
    fused_amax: bool = False
    ordered_x: bool = False
    ordered_in_sort: bool = True
    blocks_last: bool = True
    gluon_upto: float = 4.0
    quantize_decoded: bool = True
    gluon_pdl_upto: float = 32.0
    fc1_early: bool = True
    gluon_a_tma: bool = False
    gluon_grid_blocks: int | str | None = None
    amax_self_upto: int = 16384
    gluon_persist: int | str | None = None
    amax_zeros_in_sort: bool = True
    dense_overlap: bool = False
    fused_chain: bool = True
    gluon_prefill: bool = True
    prefill_above: int | None = 32
    prefill_above_long: int | None = 28
    gluon_whole_k: bool = False
    gluon_whole_upto: float = 28.0
    gluon_whole_over: float | None = 3.5
    gluon_whole_fill: float = 0.0
    gluon_whole_wide: float | None = 21.5
    cuda_decode: bool = False

    def grid_blocks(self, n_routes: int, num_experts: int, block_m: int, max_b: int) -> int:
        """The Gluon kernels' grid row blocks (``gluon_grid_blocks``; 0: the worst case
        ``max_b``, every row block a program of its own)."""
        g = self.gluon_grid_blocks
        if g is None or max_b <= 0:
            return 0
        if g == "auto":
            g = self.expected_blocks(n_routes, num_experts, block_m) + 2
        return max(1, min(int(g), max_b))

    def expected_blocks(self, n_routes: int, num_experts: int, block_m: int) -> int:
        """The valid row blocks of ``block_m`` rows a call of ``n_routes`` routes is
        expected to have (``valid_rows`` spread evenly over the experts: the experts
        touched plus the valid rows over ``block_m``, rounded up)."""
        valid = self.valid_rows(n_routes, num_experts) * num_experts
        return math.ceil(_touched(valid, num_experts) + valid / block_m)

    def persist_programs(self, gated: bool, block_m: int, device: torch.device) -> int:
        """The Gluon kernel's persistent programs on ``device`` (``gluon_persist``; 0:
        off)."""
        p = self.gluon_persist
        if p is None or device.type != "cuda" or self.gluon_grid_blocks is not None:
            return 0
        if p == "auto":
            from .gluon_ws import PERSIST_PER_SM

            p = PERSIST_PER_SM.get((gated, block_m), 4)
        return int(p) * torch.cuda.get_device_properties(device).multi_processor_count

    def gluon_pdl(self, n_routes: int, num_experts: int) -> bool:
        """Whether a call's Gluon kernels join the PDL chain (``gluon_pdl_upto``)."""
        return self.valid_rows(n_routes, num_experts) * num_experts <= self.gluon_pdl_upto

    def split_for(self, n_routes: int, num_experts: int) -> bool:
        """Whether loop 3 splits K for a call of ``n_routes`` routes over the experts."""
        if self.split_k is not None:
            return self.split_k
        # At 16 rows an expert (DeepSeek-V3 EP8, 64 tokens) not splitting won in the unit
        # order: 284.7 against 292.9 us, 268.4 against 278.0 with FC2's 128-row tiles
        # (session 7); splitting wins by far at 4 rows (16 tokens: 76.6 against 94.0).
        return n_routes / num_experts <= 8

    def gluon_split(self, n_routes: int, num_experts: int,
                    shape: tuple[int, int] | None = None) -> bool:  # fmt: skip
        """Whether a call of ``n_routes`` routes may run its GEMMs as the Gluon kernels
        with split K (``gluon_decode``, at most ``gluon_upto`` expected valid rows an
        expert; never with ``split_k=False``). The GEMMs must also be able to
        (``gluon_applies``). With ``shape`` = (hidden, inter): not above
        ``gluon_whole_over`` rows where both GEMMs run whole-K instead (``whole_both``)."""
        if not self.gluon_decode or self.split_k is False or num_experts <= 0:
            return False
        rows = self.valid_rows(n_routes, num_experts)
        if rows > self.gluon_upto:
            return False
        over = self.gluon_whole_over
        if shape is not None and over is not None and rows > over:
            return not self.whole_both(n_routes, num_experts, *shape)
        return True

    def whole_both(self, n_routes: int, num_experts: int, hidden: int, inter: int) -> bool:
        """Whether both GEMMs of a call would run as whole-K Gluon kernels at 16-row
        tiles: loop 3 would not split them (``split_for``, ``gemm_splits``), the call is
        not dense, and ``whole_runs`` takes each. Whether FC1's epilogue can
        (``fc1_whole_can``) is the caller's to check."""
        if self.split_k is not None or self.split_for(n_routes, num_experts):
            return False
        if self.dense_for(n_routes, num_experts, (hidden, inter)):
            return False
        cfg = GemmConfig(16, 64, 128)
        if any(self.gemm_splits(n_routes, num_experts, hidden, inter, cfg, cfg)):
            return False  # gluon_whole_fill
        return all(
            self.whole_runs(False, False, k, False, cfg, n_routes, num_experts)
            for k in (hidden, inter)
        )

    def whole_runs(self, split: bool, dense: bool, k: int, a_fp4: bool, cfg: GemmConfig,
                   n_routes: int, num_experts: int) -> bool:  # fmt: skip
        """Whether a GEMM of inner size ``k`` of a call of ``n_routes`` routes, which loop 3
        would run unsplit (``split`` False) and not dense, runs as the Gluon kernel with
        whole-K programs (``gluon_whole_upto``; the kernel able to, ``gluon_applies``).
        FC1 also needs an epilogue that writes bf16 (``_gemm`` falls back otherwise)."""
        if split or dense or not self.gluon_whole_upto or num_experts <= 0:
            return False
        if self.valid_rows(n_routes, num_experts) > self.gluon_whole_upto:
            return False
        return _gluon_fits(self.gluon_decode, int(self.chunked), k, a_fp4, cfg, whole=True)

    def fc1_whole_can(self, mode: str, act_scale: str | None) -> bool:
        """Whether a call's FC1 epilogue writes bf16, as the whole-K kernel must: not
        static W4A4's NVFP4 output (``fc1_nvfp4_out``) and not the fused amax; for W4A4
        with ``act_scale`` None, not known: False."""
        if mode != "w4a4":
            return True
        if act_scale is None or (act_scale == "static" and self.fc1_nvfp4_out):
            return False
        return not self.amax_in_fc1(mode, act_scale)

    def fc1_whole_runs(self, mode: str, act_scale: str, split1: bool, dense: bool, h: int,
                       cfg1: GemmConfig, n_routes: int, num_experts: int) -> bool:  # fmt: skip
        """``whole_runs`` for a call's FC1, whose epilogue must write bf16
        (``fc1_whole_can``)."""
        if not self.fc1_whole_can(mode, act_scale):
            return False
        return self.whole_runs(split1, dense, h, mode == "w4a4", cfg1, n_routes, num_experts)

    def ordered_for(
        self, mode: str, n_routes: int, num_experts: int, hidden: int, inter: int,
        cfg1: GemmConfig, cfg2: GemmConfig,
    ) -> bool:  # fmt: skip
        """Whether a call's GEMMs load activation rows in the unit order (``ordered_x``)."""
        return (
            self.ordered_x
            and mode == "w4a16"
            and int(self.chunked) == 3
            and not self.dense_for(n_routes, num_experts, (hidden, inter))
            and k_order(3, hidden, cfg1.block_k) == 64
            and k_order(3, inter, cfg2.block_k) == 64
            # not where either GEMM runs as the Gluon kernel, which neither reads nor
            # writes rows in the unit order
            and not self.whole_runs(False, False, hidden, False, cfg1, n_routes, num_experts)
            and not self.whole_runs(False, False, inter, False, cfg2, n_routes, num_experts)
            and not any(
                self.gluon_runs(s, k, False, cfg)
                for s, k, cfg in zip(
                    self.gemm_splits(n_routes, num_experts, hidden, inter, cfg1, cfg2),
                    (hidden, inter),
                    (cfg1, cfg2),
                )
            )
        )

    def gluon_runs(self, split: bool, k: int, a_fp4: bool, cfg: GemmConfig) -> bool:
        """Whether a GEMM of inner size ``k`` that splits K (``split``, from
        ``gemm_splits``) with ``cfg`` runs as a Gluon kernel (``_gemm`` decides so too)."""
        return _gluon_gemm(self.gluon_decode, split, int(self.chunked), k, a_fp4, cfg)

    def amax_in_fc1(self, mode: str, act_scale: str) -> bool:
        """Whether FC1's epilogue takes the per-tensor amax of its output (``fused_amax``,
        W4A4 per-tensor only)."""
        return self.fused_amax and mode == "w4a4" and act_scale == "per_tensor"

    def valid_rows(self, n_routes: int, num_experts: int) -> float:
        """Expected valid routes an expert (``valid_fraction``, or 1/6 when unknown)."""
        frac = UNKNOWN_VALID_FRACTION if self.valid_fraction is None else self.valid_fraction
        return n_routes * frac / num_experts

    def gemm_splits(
        self,
        n_routes: int,
        num_experts: int,
        hidden: int,
        inter: int,
        cfg1: GemmConfig,
        cfg2: GemmConfig,
    ) -> tuple[bool, bool]:
        """Whether loop 3 splits K of FC1 and of FC2 (``split_k``): both at decode sizes
        (``split_for``), else a GEMM of more than one K segment whose expected programs
        (row tiles x experts touched x row blocks an expert, valid routes spread evenly
        over the experts) are fewer than ``SPLIT_BELOW_PROGRAMS``; a GEMM that runs whole-K
        (``whole_runs``) only where its expected whole-K programs fill fewer than
        ``gluon_whole_fill`` times the SMs' slots for them (``gluon_ws.WHOLE_PER_SM``).
        Same bits either way."""
        if self.split_k is not None or self.split_for(n_routes, num_experts):
            s = self.split_for(n_routes, num_experts)
            return s, s
        if cfg1.block_m == 8 and cfg2.block_m == 8 and self.gluon_split(n_routes, num_experts):
            return True, True  # the Gluon kernels' 8-row tiles (gemm_configs, gluon_upto)
        # a GEMM on the whole-K Gluon kernel is not split (gluon_whole_upto)
        dense = self.dense_for(n_routes, num_experts, (hidden, inter))
        w1 = self.whole_runs(False, dense, hidden, False, cfg1, n_routes, num_experts)
        w2 = self.whole_runs(False, dense, inter, False, cfg2, n_routes, num_experts)
        valid = self.valid_rows(n_routes, num_experts) * num_experts
        if valid <= 0:
            return False, False
        touched = _touched(valid, num_experts)
        rows = valid / max(touched, 1.0)
        out = []
        for n, k, cfg, whole, gated in ((inter, hidden, cfg1, w1, True),
                                        (hidden, inter, cfg2, w2, False)):  # fmt: skip
            blocks = math.ceil(rows / cfg.block_m - 1e-6)  # 16.000001 rows: one 16-row block
            if whole:  # whole-K unless its programs fill too few of the SMs' slots
                out.append(bool(self.gluon_whole_fill) and triton.cdiv(n, 64) * touched * blocks
                           < self.gluon_whole_fill * _whole_slots(gated))  # fmt: skip
            else:
                programs = triton.cdiv(n, cfg.block_n) * touched * blocks
                out.append(k > SEGMENT and programs < SPLIT_BELOW_PROGRAMS)
        return out[0], out[1]

    def prefill_here(self) -> bool:
        """Whether ``gluon_prefill`` can run: the option on, loop 3, and a Hopper GPU with
        the Gluon kernels (never in the interpreter)."""
        return (
            self.gluon_prefill
            and int(self.chunked) == 3
            and not interpreting()
            and hopper_device()
            and gluon_available()
        )

    def prefill_runs(
        self, n_routes: int, num_experts: int, shape: tuple[int, int] | None = None
    ) -> bool:
        """Whether a call's dense-path GEMMs run on ``gluon_prefill`` (those whose shape
        fits: ``gluon_prefill.applies``); ``shape``: (hidden, inter), as ``dense_for``."""
        return self.prefill_here() and self.dense_for(n_routes, num_experts, shape)

    def dense_for(
        self, n_routes: int, num_experts: int, shape: tuple[int, int] | None = None
    ) -> bool:
        """Whether a call of ``n_routes`` routes takes the dense path: above
        ``dense_above`` expected valid rows an expert, or above ``prefill_above`` where
        both GEMMs of ``shape`` = (hidden, inter) run on ``gluon_prefill``."""
        if self.dense_above is None or n_routes == 0 or int(self.chunked) not in (2, 3):
            return False
        rows = self.valid_rows(n_routes, num_experts)
        if rows > self.dense_above:
            return True
        if shape is None or self.prefill_above is None:
            return False
        above = self.prefill_above
        if self.prefill_above_long is not None and min(shape) >= PREFILL_LONG_K:
            above = self.prefill_above_long
        if rows <= above:
            return False
        from . import gluon_prefill

        return gluon_prefill.applies_to_call(*shape) and self.prefill_here()

    def __post_init__(self) -> None:
        d, f = self.dense_above, self.valid_fraction
        if d is not None and (isinstance(d, bool) or not isinstance(d, int) or d < 0):
            raise ValueError(f"dense_above: expected None or an int >= 0, got {d!r}")
        for name in ("prefill_above", "prefill_above_long"):
            pa = getattr(self, name)
            if pa is not None and (isinstance(pa, bool) or not isinstance(pa, int) or pa < 0):
                raise ValueError(f"{name}: expected None or an int >= 0, got {pa!r}")
        if f is not None and (
            isinstance(f, bool) or not isinstance(f, (int, float)) or not 0 < f <= 1
        ):
            raise ValueError(f"valid_fraction: expected None or a number in (0, 1], got {f!r}")
        g = self.gluon_upto
        if isinstance(g, bool) or not isinstance(g, (int, float)) or not g > 0:
            raise ValueError(f"gluon_upto: expected a number > 0, got {g!r}")
        for name, optional in (("gluon_whole_upto", False), ("gluon_whole_over", True),
                               ("gluon_whole_fill", False), ("gluon_whole_wide", True),
                               ("gluon_pdl_upto", False)):  # fmt: skip
            g = getattr(self, name)
            if optional and g is None:
                continue
            if isinstance(g, bool) or not isinstance(g, (int, float)) or not g >= 0:
                what = "None or a number" if optional else "a number"
                raise ValueError(f"{name}: expected {what} >= 0, got {g!r}")
        u = self.amax_self_upto
        if isinstance(u, bool) or not isinstance(u, int) or u < 0:
            raise ValueError(f"amax_self_upto: expected an int >= 0, got {u!r}")
        for name in ("gluon_grid_blocks", "gluon_persist"):
            g = getattr(self, name)
            if g is not None and g != "auto" and (isinstance(g, bool) or not isinstance(g, int)
                                                  or g < 1):  # fmt: skip
                raise ValueError(f"{name}: expected None, 'auto' or an int >= 1, got {g!r}")


def use_pdl(opt: TritonOptions, device: torch.device) -> bool:
    """Whether the kernels of a call on ``device`` use programmatic dependent launch."""
    if interpreting() or device.type != "cuda":
        return False
    if opt.pdl is not None:
        return opt.pdl
    return torch.cuda.get_device_capability(device)[0] >= 9


def _empty(shape: tuple[int, ...], dtype: torch.dtype, device, poison: bool) -> torch.Tensor:
    if not poison:
        return torch.empty(shape, dtype=dtype, device=device)
    if dtype.is_floating_point and dtype.itemsize > 1:
        return torch.full(shape, float("nan"), dtype=dtype, device=device)
    return torch.full(shape, 0xFF, dtype=torch.uint8, device=device).view(dtype)


def _launch(kernel, grid, pdl: bool, *args, **kwargs):
    if pdl:
        kwargs["launch_pdl"] = True
    kernel[grid](*args, USE_PDL=pdl, **kwargs)


def _row_block(c: int, wide: bool = False) -> int:
    """Elements of a C-wide row a quantize or amax program loads at once: 1024 (64 in the
    interpreter), or ``wide`` (few rows: ``QUANTIZE_SPLIT_ROWS``) a whole row up to
    AMAX_WIDE_C."""
    cap = AMAX_WIDE_C if wide else (64 if interpreting() else 1024)
    return min(triton.next_power_of_2(c), cap)


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
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """NVFP4 codes uint8 [rows, C/2], e4m3 scales [rows, C/16] and fp32 globals [rows] of
    rows of ``src`` (bf16 [., C]); ``mode`` (quantize.MODE_*) picks the global: per row,
    the one scalar in ``table``, or (static) ``table[row_expert[r]]``. ``index`` / ``div``
    gather source row ``index[r] // div``; ``count`` (a device scalar) limits the rows.
    ``decoded`` ([rows, C] of ``decoded_rows_dtype()``, C a multiple of 64): also receives
    the rows decoded as ``dequant.dense_rows(codes, scales, order=64)`` gives them (the
    Gluon GEMMs' W4A4 operand, ``TritonOptions.quantize_decoded``)."""
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
    codes = _empty((rows, c // 2), torch.uint8, dev, poison)
    scales = _empty((rows, c // 16), torch.float8_e4m3fn, dev, poison)
    glob = _empty((rows,), torch.float32, dev, poison)
    if rows == 0:
        return codes, scales, glob
    dummy = glob
    block_c = _row_block(c)
    few = rows <= QUANTIZE_SPLIT_ROWS
    grid, split = (rows,), {}
    chunk = QUANTIZE_SPLIT_C if not interpreting() else (64 if dec else 32)
    if few and c > chunk:  # few rows: one chunk of a row a program
        grid, split = (rows, triton.cdiv(c, chunk)), dict(SPLIT_C=True)
        block_c = chunk
    _launch(
        quantize_rows_kernel, grid, pdl,
        src, index if index is not None else dummy, count if count is not None else dummy,
        rows, codes, scales, glob,
        table if table is not None else dummy, row_expert if row_expert is not None else dummy,
        c, MODE=mode, GATHER=index is not None, DIV=div, COUNT_FROM_PTR=count is not None,
        BLOCK_C=block_c, AMAX_C=_row_block(c, few), INTERPRET=interpreting(), num_warps=4,
        ROW_FIRST=QUANTIZE_ROW_FIRST, **split, **dec,
    )  # fmt: skip
    return codes, scales, glob


def decoded_rows_dtype() -> torch.dtype:
    """dtype of decoded operand rows (``dense_rows``, ``quantize_rows(decoded=...)``): bf16,
    fp32 in the interpreter (whose bf16 dot is unreliable)."""
    return torch.float32 if interpreting() else torch.bfloat16


def amax_rows(
    src: torch.Tensor,
    rows: int,
    *,
    count: torch.Tensor | None = None,
    pdl: bool = False,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """fp32 [1]: max |x| over the first ``rows`` rows of bf16 ``src`` [., C] (``count``, a
    device scalar, limits them further), on the device; 0 for no rows. ``out``: an fp32
    [1] zero on ``src``'s device to fold the amax into (e.g. ``split_counters``' slot,
    cleared by the sort kernel before this launch); None: a zeroed tensor of its own."""
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
    per = 1 if rows <= QUANTIZE_SPLIT_ROWS else AMAX_ROWS
    _launch(
        amax_rows_kernel, (triton.cdiv(rows, per),), pdl,
        src, count if count is not None else out, rows, out, c,
        COUNT_FROM_PTR=count is not None, BLOCK_C=_row_block(c, rows <= QUANTIZE_SPLIT_ROWS),
        ROWS=per, num_warps=4,
    )  # fmt: skip
    return out


def k_order(loop: int, k: int, block_k: int) -> int:
    """The K order a GEMM multiplies in (``gemm.decode_permuted``): loop 3 takes the unit
    order (64) whenever K and the K tile are multiples of 64, which every default config
    of a K with 64 | K is, so the order (and the bits) depend on the shape only, not on
    the token count; otherwise (and loop 2) the chunk order (32). Measured on the SASS of
    DeepSeek-V3's FC1 at (16, 64, 128): 3.73 instructions a weight against 5.64."""
    return 64 if loop == 3 and k % 64 == 0 and block_k % 64 == 0 else 32


@functools.cache
def gluon_available() -> bool:
    """Whether this Triton runs the Gluon kernels (``gluon_decode``, ``gluon_ws``): they
    are written for and tested with Triton 3.6's Gluon API, which is experimental and
    changes between releases, so with another Triton every GEMM stays on loop 3."""
    if not triton.__version__.startswith("3.6."):
        return False
    try:
        from . import gluon_ws  # noqa: F401
    except Exception:  # an incompatible Gluon: loop 3
        return False
    return True


def hopper_device() -> bool:
    """Whether the current CUDA device is a Hopper GPU (compute capability 9.x): the
    Gluon kernels' TMA copies and wgmma exist there only (an A100 has neither; a
    Blackwell GPU has TMA but no wgmma), so elsewhere every GEMM stays on loop 3."""
    return torch.cuda.is_available() and _major(torch.cuda.current_device()) == 9


@functools.cache
def _major(index: int) -> int:
    """The compute capability's major number of CUDA device ``index`` (asked once)."""
    return torch.cuda.get_device_capability(index)[0]


def gluon_applies(k: int, a_fp4: bool, cfg: GemmConfig, whole: bool = False) -> bool:
    """Whether a split-K GEMM can run as the Gluon kernel (``gluon_decode``,
    ``gluon_ws``): W4A16 or W4A4 (``a_fp4``: its rows decoded first, either way), whole
    1024-element segments in loop 3's unit order (``k_order``), 8 or 16 rows a tile (or
    32 with ``whole``: the whole-K kernel, ``gluon_whole_wide``), a Hopper GPU
    (``hopper_device``; not the interpreter) and Triton 3.6 (``gluon_available``)."""
    return (
        not interpreting()
        and k % SEGMENT == 0
        and k_order(3, k, cfg.block_k) == 64
        and cfg.block_m in ((8, 16, 32) if whole else (8, 16))
        and hopper_device()
        and gluon_available()
    )


def _tile_counters(counters: torch.Tensor | None, need: int, device) -> torch.Tensor:
    """A split GEMM's int32 tile counters, zero: ``counters`` (zeroed by the sort kernel,
    ``split_counters``) when it holds ``need``, else zeros of its own."""
    if counters is None or counters.numel() < need:
        return torch.zeros(need, dtype=torch.int32, device=device)
    return counters


# prefill_above_long's shapes: both GEMMs' K at least this
PREFILL_LONG_K = 4096


def _touched(valid: float, num_experts: int) -> float:
    """The experts that ``valid`` routes spread evenly at random over ``num_experts``
    are expected to touch."""
    return num_experts * (1.0 - (1.0 - 1.0 / max(num_experts, 1)) ** valid)


@functools.cache
def sm_count() -> int:
    """The SMs of the current CUDA device (132, an H200's, without one: the launch
    decisions made on a CPU are the H200's)."""
    if torch.cuda.is_available():
        return torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count
    return 132


def _whole_slots(gated: bool) -> int:
    """The whole-K Gluon programs the GPU holds at once (``gluon_ws.WHOLE_PER_SM`` an SM
    times ``sm_count``)."""
    from .gluon_ws import WHOLE_PER_SM

    return WHOLE_PER_SM[gated] * sm_count()


def _gluon_fits(gluon: bool, chunked: int, k: int, a_fp4: bool, cfg: GemmConfig,
                whole: bool = False) -> bool:  # fmt: skip
    """Whether a GEMM can run as the Gluon kernel, split or whole-K (``whole``): ``gluon``
    (``gluon_decode``) on, loop 3, more than one K segment and the kernel able to
    (``gluon_applies``)."""
    return gluon and chunked == 3 and k > SEGMENT and gluon_applies(k, a_fp4, cfg, whole)


def _gluon_gemm(
    gluon: bool, split: bool, chunked: int, k: int, a_fp4: bool, cfg: GemmConfig
) -> bool:
    """Whether one GEMM runs as the split Gluon kernel: K split and ``_gluon_fits``."""
    return split and _gluon_fits(gluon, chunked, k, a_fp4, cfg)


def _tma_rows(
    opt: TritonOptions, w4a4: bool, g1: bool, g2: bool, ordered: bool
) -> tuple[bool, bool, bool]:
    """``gluon_a_tma``'s rows of a call whose GEMMs run on the split Gluon kernels (``g1``,
    ``g2``): (FC1 writes its rows in the unit order for FC2, FC1's rows by TMA, FC2's)."""
    mid_unit = opt.gluon_a_tma and g1 and g2 and not w4a4 and not ordered
    return (
        mid_unit,
        opt.gluon_a_tma and g1 and not ordered,
        opt.gluon_a_tma and g2 and (w4a4 or mid_unit),
    )


def _cuda_gemms(
    opt: TritonOptions, w4a4: bool, g1: bool, g2: bool, ordered: bool, h: int, inter: int,
    cfg1: GemmConfig, cfg2: GemmConfig,
) -> tuple[bool, bool]:  # fmt: skip
    """Whether FC1 and FC2 run on ``cuda_decode``'s kernel (``TritonOptions.cuda_decode``),
    as ``expert_gemms`` and ``_gemm`` decide: W4A16 GEMMs of the split Gluon kernels
    (``g1``, ``g2``) with the plain epilogue and rows (``_cuda_runs``)."""
    if not opt.cuda_decode or w4a4:
        return False, False
    mid_unit, atma1, atma2 = _tma_rows(opt, w4a4, g1, g2, ordered)
    c1 = g1 and _cuda_runs(inter, h, True, cfg1, atma1 or ordered or mid_unit)
    c2 = g2 and _cuda_runs(h, inter, False, cfg2, atma2 or ordered or mid_unit)
    return c1, c2


def _cuda_runs(n: int, k: int, gated: bool, cfg: GemmConfig, other: bool) -> bool:
    """Whether a GEMM that would run on the Gluon kernels runs on ``cuda_decode``'s (with
    ``TritonOptions.cuda_decode``): W4A16 rows in token or sorted order with the plain
    epilogue (``other``: anything else, such as W4A4 or NVFP4 output), a shape the kernel
    takes (``cuda_decode.applies``), the kernel available, and ``cuda_decode.ONLY``."""
    if other:
        return False
    from . import cuda_decode

    only = cuda_decode.ONLY
    return (
        (only is None or only == ("fc1" if gated else "fc2"))
        and cuda_decode.applies(n, k, gated, cfg.block_m)
        and cuda_decode.available()
    )


def _gemm(
    cfg: GemmConfig,
    sort: RouteSort,
    a: torch.Tensor,
    a_scales: torch.Tensor | None,
    a_global: torch.Tensor | None,
    w_codes: torch.Tensor,
    w_scales: torch.Tensor,
    w_global: torch.Tensor,
    out: torch.Tensor,
    topk_w: torch.Tensor,
    *,
    n: int,
    k: int,
    topk: int,
    gated: bool,
    a_gather: bool,
    fused: bool,
    pdl: bool,
    decode_asm: bool = True,
    out_fp4: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    chunked: int = 3,
    split: bool = False,
    dense: bool = False,
    poison: bool = False,
    gluon: bool = False,
    counters: torch.Tensor | None = None,
    amax_out: torch.Tensor | None = None,
    a_ordered: bool = False,
    out_ordered: bool = False,
    blocks_last: bool = False,
    a_decoded: torch.Tensor | None = None,
    early_weights: bool = False,
    gluon_pdl: bool = True,
    a_tma: bool = False,
    grid_blocks: int = 0,
    persist: int = 0,
    w_dense: torch.Tensor | None = None,
    prefill: bool = False,
    whole_k: bool = False,
    whole: bool = False,
    cuda: bool = False,
    cuda_blocks: int | None = None,
    cuda_next: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> None:
    """One grouped GEMM. ``out_fp4`` = (scales, globals, static table): ``out`` receives
    NVFP4 codes of the FC1 activation instead of bf16 (static W4A4). ``dense``: decode
    the weights once (``dense_weights``) and load them in the main loop (same bits).
    ``amax_out``: fp32 [1] zeros; the epilogue atomically maxes |out| of the valid rows
    into it (bf16 route rows only). ``a_ordered``: ``a`` holds bf16 rows in the unit
    order; ``out_ordered``: write ``out`` (bf16 rows) in it (``TritonOptions.ordered_x``);
    ``blocks_last``: a split GEMM's 3-D grid is (tiles, segments, blocks), else (tiles,
    blocks, segments) (``TritonOptions.blocks_last``). ``a_decoded``: W4A4's rows
    already decoded for the Gluon kernel (``quantize_rows(decoded=...)``), else decoded
    here by ``dense_rows`` when that kernel runs. ``early_weights``: the sort ran at least
    two kernels before this one (FC2), so with ``pdl`` the Gluon kernel issues its first
    weight copies before it waits (``gluon_ws.split_partials_tma``). ``gluon_pdl``: the
    Gluon kernel too is launched with ``pdl`` (``TritonOptions.gluon_pdl``). ``a_tma``: the
    Gluon kernel loads its activation rows by TMA (``TritonOptions.gluon_a_tma``): W4A16
    rows gathered here into sorted unit order (``a_gather``) or given so (``a_ordered``),
    W4A4 decoded rows in sorted order; with ``out_ordered`` its epilogue writes unit-order
    rows. ``grid_blocks``: the Gluon kernel's grid row blocks (0: the worst case;
    ``TritonOptions.grid_blocks``). ``persist``: the Gluon kernel's persistent programs
    (0: off; ``TritonOptions.persist_programs``), unless its rows come by TMA. ``w_dense``
    (with ``dense``): the weights decoded already (``dense_weights`` in this GEMM's
    order), e.g. on a side stream (``TritonOptions.dense_overlap``). ``prefill`` (with
    ``dense``): the GEMM runs on ``gluon_prefill`` where ``_prefill_fits`` (the same
    bits). ``whole`` (not ``split``; ``TritonOptions.whole_runs``): the Gluon kernel with
    whole-K programs, where its epilogue can write ``out`` (bf16 or fused; not
    ``out_fp4`` or ``amax_out``), else loop 3 (the same bits). ``cuda``: where the Gluon
    kernel would run a W4A16 GEMM with its epilogue at 8- or 16-row tiles, the CUDA kernel
    of ``cuda_decode`` runs it if it can (``TritonOptions.cuda_decode``; the same bits),
    sized for ``cuda_blocks`` valid row blocks (None: the schedule's worst case)."""
    a_fp4 = a_scales is not None
    if dense and prefill and _prefill_fits(cfg, n, k, gated, out_fp4, amax_out):
        _prefill_gemm(sort, a, a_scales, a_global, w_codes, w_scales, w_global, out, topk_w,
                      n=n, k=k, topk=topk, gated=gated, a_gather=a_gather, fused=fused,
                      decode_asm=decode_asm, poison=poison)  # fmt: skip
        return
    order = k_order(int(chunked), k, cfg.block_k)
    if dense:
        assert chunked, "the dense path is a chunk-ordered loop's (TritonOptions.dense_for)"
        if w_dense is not None:  # decoded already (dense_overlap)
            w_codes = w_dense
        else:
            w_codes = dense_weights(w_codes, w_scales, decode_asm=decode_asm, order=order)
        # The activation rows once too: W4A4's decoded, W4A16's bf16 rows put in chunk
        # order (one copy instead of a register shuffle a program). Rows in sorted order
        # (not gathered) stop at the valid count: masked routes are never loaded.
        count = None if a_gather else sort.expert_offsets[-1:]
        a = dense_rows(a, a_scales, count=count, decode_asm=decode_asm, poison=poison,
                       order=order)  # fmt: skip
    if chunked:
        # Both operands decoded (or bf16 activations) as bf16; each decoded operand carries
        # a factor 2^-8 (gemm.decode_chunk), undone on the fp32 accumulator.
        decode_asm = decode_asm and not interpreting()
        dot = wdt = tl.float32 if interpreting() else tl.bfloat16
        out_scale = 2.0**16 if a_fp4 else 2.0**8
    else:
        decode_asm = decode_asm and not a_fp4 and not interpreting()
        if interpreting():
            dot, wdt = tl.float32, tl.float32
        elif a_fp4:
            dot, wdt = tl.float16, tl.float16
        else:
            dot, wdt = tl.bfloat16, tl.bfloat16
        out_scale = 2.0**28 if a_fp4 else (1.0 if decode_asm else 2.0**14)
    grid = (triton.cdiv(n, cfg.block_n), sort.num_blocks)
    group_m = 8 if dense else 0  # dense tiles: grouped raster for L2 reuse (GROUP_M)
    if group_m:
        grid = (grid[0] * grid[1], 1)
    dummy = w_global
    seg_tiles = SEGMENT // cfg.block_k if int(chunked) == 3 else 0
    nseg = -(-(k // cfg.block_k) // seg_tiles) if seg_tiles else 1
    split = split and nseg > 1
    part, cnt, ws_rows = dummy, dummy, 0
    gluon = _gluon_gemm(gluon, split, int(chunked), k, a_fp4, cfg)
    whole = whole and not split and not dense and out_fp4 is None and amax_out is None
    gluon = gluon or whole
    if gluon and whole_k and not a_fp4 and _prefill_fits(cfg, n, k, gated, out_fp4, amax_out,
                                                         cfg.block_m):  # fmt: skip
        # TritonOptions.gluon_whole_k: the decode-size GEMM on the prefill kernel
        _prefill_gemm(sort, a, None, None, w_codes, w_scales, w_global, out, topk_w, n=n,
                      k=k, topk=topk, gated=gated, a_gather=a_gather, fused=fused,
                      decode_asm=decode_asm, poison=poison, block_m=cfg.block_m,
                      stages=4)  # fmt: skip
        return
    if gluon and cuda and _cuda_runs(n, k, gated, cfg, a_fp4 or a_tma or a_ordered or out_ordered
                                     or out_fp4 is not None or amax_out is not None):  # fmt: skip
        from . import cuda_decode  # TritonOptions.cuda_decode: the CUDA decode GEMMs

        cuda_decode.decode_gemm(
            a, sort.sorted_routes, w_codes, w_scales, sort.block_expert, sort.block_start,
            sort.block_end, sort.valid_blocks, w_global, out, n=n, topk=topk, gated=gated,
            gather=a_gather, block_m=cfg.block_m, fused=fused, topk_w=topk_w,
            pdl=pdl and gluon_pdl, expected_blocks=cuda_blocks, l2_next=cuda_next,
        )  # fmt: skip
        return
    # the split grid: blocks last or 3-D
    blocks_last = blocks_last and split and not gluon and not group_m
    if split or whole:  # one program a K segment; fp32 partials, summed by the last one of
        # a tile (whole: one program a tile, no partials)
        ws_rows = sort.sorted_routes.shape[0]
        if not whole:
            part = torch.empty(nseg * ws_rows * (2 * n if gated else n), dtype=torch.float32,
                               device=a.device)  # fmt: skip
        if gluon:  # the Gluon kernel (TritonOptions.gluon_decode, kernels.gluon_ws)
            from . import gluon_ws

            a_src = a
            if a_fp4 and a_decoded is not None:  # by the quantize kernel
                a_src = a_decoded
            elif a_fp4:  # W4A4: the rows decoded once a call, in the unit order, as the
                # dense path decodes them (the same 2^-8, out_scale 2^16; the same bits)
                count = None if a_gather else sort.expert_offsets[-1:]
                a_src = dense_rows(a, a_scales, count=count, decode_asm=decode_asm,
                                   poison=poison, order=64)  # fmt: skip
            gather = a_gather
            if a_tma and a_fp4 and a_gather:
                a_tma = False  # decoded rows in token order: staged by the program
            elif a_tma and a_gather:  # W4A16: x's rows of the sorted routes, unit order
                a_src = dense_rows(a, index=sort.sorted_routes, div=topk,
                                   count=sort.expert_offsets[-1:], poison=poison,
                                   order=64)  # fmt: skip
                gather = False
            elif a_tma and not a_fp4 and not a_ordered:
                a_tma = False  # bf16 rows not in the unit order
            # the last unit of a tile sums and runs the epilogue itself, except for NVFP4
            # output or the fused amax: then the split kernel below does (REDUCE_ONLY)
            epi = out_fp4 is None and amax_out is None
            kw = {}
            if epi:  # 64-row weight tiles (whole: no counters)
                cnt = None
                if not whole:
                    cnt = _tile_counters(counters, triton.cdiv(n, 64) * sort.num_blocks,
                                         a.device)  # fmt: skip
                kw = dict(out=out, counters=cnt, w_global=w_global, topk_w=topk_w,
                          fused=fused, out_scale=out_scale,
                          a_global=a_global if a_fp4 else None)  # fmt: skip
            if epi and out_ordered:  # FC1 for FC2 with a_tma: unit-order rows
                kw["out_unit_order"] = True
            gluon_ws.split_partials_tma(
                a_src, sort.sorted_routes, w_codes, w_scales, sort.block_expert,
                sort.block_start, sort.block_end, None if whole else part, n=n, topk=topk,
                gated=gated, gather=gather, block_m=cfg.block_m, seg=SEGMENT, ws_rows=ws_rows,
                a_unit_order=a_fp4 or a_ordered, pdl=pdl and gluon_pdl,
                early_weights=early_weights, a_tma=a_tma and not whole,
                valid_blocks=sort.valid_blocks, grid_blocks=0 if whole else grid_blocks,
                persist=0 if a_tma or grid_blocks or whole else persist, whole=whole, **kw,
            )  # fmt: skip
            if epi:
                return
        else:
            cnt = _tile_counters(counters, grid[0] * grid[1], a.device)
            if blocks_last:  # empty row blocks after every valid unit
                grid = (grid[0], nseg, grid[1])
            else:
                grid = (*grid, nseg)
    args = (
        a, a_scales if a_fp4 else dummy, a_global if a_fp4 else dummy,
        sort.sorted_routes, topk_w,
        w_codes, w_scales, w_global, out,
        *(out_fp4 if out_fp4 is not None else (dummy, dummy, dummy)),
        sort.block_expert, sort.block_start, sort.block_end, part, cnt, ws_rows,
        amax_out if amax_out is not None else dummy,
        n, k,
    )  # fmt: skip
    kw = dict(
        TOPK=topk, GATED=gated, A_FP4=a_fp4, A_GATHER=a_gather, FUSED=fused,
        OUT_SCALE=out_scale, BM=cfg.block_m, BN=cfg.block_n, BK=cfg.block_k,
        DOT_DTYPE=dot, W_DTYPE=wdt, INTERPRET=interpreting(), DECODE_ASM=decode_asm,
        PREFETCH=cfg.prefetch, OUT_FP4=out_fp4 is not None, CHUNKED=int(chunked),
        SEG_TILES=seg_tiles, SPLIT=split, W_DENSE=dense, GROUP_M=group_m, REDUCE_ONLY=gluon,
        ORDER=order, OUT_AMAX=amax_out is not None,
        A_ORDERED=a_ordered, OUT_ORDERED=out_ordered, BLOCKS_LAST=blocks_last,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )  # fmt: skip
    if not interpreting() and cfg.maxnreg:
        kw["maxnreg"] = cfg.maxnreg
    _launch(moe_gemm_kernel, grid, pdl, *args, **kw)


def _prefill_fits(cfg: GemmConfig, n: int, k: int, gated: bool, out_fp4=None,
                  amax_out=None, block_m: int | None = None) -> bool:  # fmt: skip
    """Whether a GEMM can run on ``gluon_prefill``: its shape (``applies``), the
    schedule's ``block_m``-row blocks (the dense path's 128 unless given), bf16 or fused
    output (no NVFP4 output, no fused amax)."""
    from . import gluon_prefill

    return (
        gluon_prefill.applies(n, k, gated)
        and cfg.block_m == (gluon_prefill.BM if block_m is None else block_m)
        and out_fp4 is None
        and amax_out is None
    )


def _prefill_gemm(sort: RouteSort, a, a_scales, a_global, w_codes, w_scales, w_global, out,
                  topk_w, *, n: int, k: int, topk: int, gated: bool, a_gather: bool,
                  fused: bool, decode_asm: bool, poison: bool, block_m: int = 128,
                  stages: int = 2) -> None:  # fmt: skip
    """A dense-path GEMM on ``gluon_prefill``: its activation rows once in sorted and unit
    order (``dense_rows(order=64)``: gathered by route, W4A4's decoded), then the kernel."""
    from . import gluon_prefill

    count = sort.expert_offsets[-1:]
    index = sort.sorted_routes if a_gather else None
    xs = dense_rows(a, a_scales, count=count, decode_asm=decode_asm, poison=poison, order=64,
                    index=index, div=topk if a_gather else 1)  # fmt: skip
    a_fp4 = a_scales is not None
    gluon_prefill.prefill_gemm(
        xs, w_codes, w_scales, w_global, sort.block_expert, sort.block_start, sort.block_end,
        sort.valid_blocks, out, n=n, topk=topk, gated=gated,
        out_scale=2.0**16 if a_fp4 else 2.0**8, sorted_routes=sort.sorted_routes,
        topk_w=topk_w, fused=fused, a_global=a_global if a_fp4 else None,
        a_gather=a_gather, block_m=block_m, stages=stages,
    )  # fmt: skip


def _amax_self(opt: TritonOptions, elements: int, amax_reduce) -> bool:
    """Whether a per-tensor global over ``elements`` (the host's bound) is taken by the
    quantize kernel itself (``amax_self_upto``; never with an ``amax_reduce``)."""
    return opt.device_amax and amax_reduce is None and elements <= opt.amax_self_upto


def _per_tensor_table(src, rows, count, opt, pdl, amax_reduce, zero=None):
    """Quantize mode and table for a per-tensor global over the first ``rows`` rows of
    ``src`` (``count``: a device scalar limiting them): the amax on the device
    (``device_amax``; small inputs: taken by the quantize kernel itself, ``amax_self_upto``)
    or with torch ops; ``amax_reduce`` maps the amax (expert parallelism: an all-reduce max
    over the ranks). ``zero``: fp32 [1] zero for the amax kernel (``amax_rows(out=...)``)."""
    if _amax_self(opt, rows * src.shape[1], amax_reduce):
        return MODE_AMAX_SELF, None
    if opt.device_amax:
        amax = amax_rows(src, rows, count=count, pdl=pdl, out=zero)
        if amax_reduce is not None:
            amax = amax_reduce(amax.reshape(())).reshape(1)
        return MODE_FROM_AMAX, amax
    vals = src[:rows].abs()
    if count is not None:
        live = (torch.arange(rows, device=src.device) < count)[:, None]
        vals = torch.where(live, vals, 0)
    if rows:
        amax = vals.amax().float()
    else:
        amax = torch.zeros((), dtype=torch.float32, device=src.device)
    if amax_reduce is not None:
        amax = amax_reduce(amax)
    return MODE_SCALAR, global_from_amax(amax).reshape(1)


def gemm_configs(
    n_routes: int, experts: PreparedExperts, mode: str, options: TritonOptions,
    act_scale: str | None = None,
) -> tuple[GemmConfig, GemmConfig]:  # fmt: skip
    """FC1 and FC2 configs for ``n_routes`` rows over ``experts`` (pinned ones from
    ``options`` win; ``act_scale`` as ``gemm_configs_for``). Any config gives the same
    bits (one summation order a loop)."""
    return gemm_configs_for(
        n_routes, experts.num_experts, experts.hidden_size, experts.intermediate_size, mode,
        options, act_scale,
    )  # fmt: skip


def gemm_configs_for(
    n_routes: int, num_experts: int, h: int, inter: int, mode: str, options: TritonOptions,
    act_scale: str | None = None,
) -> tuple[GemmConfig, GemmConfig]:  # fmt: skip
    """``gemm_configs`` from the shape alone: ``num_experts`` experts of hidden size ``h``
    and intermediate size ``inter``. ``act_scale`` (W4A4's): whether FC1 can take the
    whole-K kernel (``gluon_whole_over``); None for W4A4 keeps the split kernels."""
    rows_per_expert = n_routes / num_experts
    valid_rows = options.valid_rows(n_routes, num_experts)
    loop = int(options.chunked)
    a_fp4 = mode == "w4a4"
    if options.dense_for(n_routes, num_experts, (h, inter)):
        # Dense operands, measured on the H200 (docs/perf-notes.md, sweep_decode.py
        # --variants c3dense): (128, 128, 64, 8 warps, 3 stages) is the fastest config at
        # 8192 tokens on Mixtral-8x7B (13.5 ms W4A16 against 15.1 to 18.4 for the others)
        # and within 1.5% of the fastest on DeepSeek-V3 EP8.
        dense = GemmConfig(128, 128, 64, 8, 3)
        if options.prefill_here():
            from . import gluon_prefill  # both GEMMs on it: its block rows (BM)

            if gluon_prefill.applies_to_call(h, inter):
                dense = replace(dense, block_m=gluon_prefill.BM)
        ok = not interpreting() and h % 64 == 0 and inter % 64 == 0
        if ok and options.fc1 is None and options.fc2 is None:
            return dense, dense
    cfg1 = options.fc1 or choose_gemm_config(
        rows_per_expert, inter, h, gated=True, interpret=interpreting(), a_fp4=a_fp4,
        loop=loop, valid_rows=valid_rows,
    )  # fmt: skip
    cfg2 = options.fc2 or choose_gemm_config(
        rows_per_expert, h, inter, gated=False, interpret=interpreting(), a_fp4=a_fp4,
        loop=loop, valid_rows=valid_rows,
    )  # fmt: skip
    if (
        options.gluon_decode
        and options.fc1 is None
        and options.fc2 is None
        and loop == 3
        and options.gluon_split(
            n_routes, num_experts, (h, inter) if options.fc1_whole_can(mode, act_scale) else None
        )
        and gluon_applies(h, a_fp4, cfg1)
        and gluon_applies(inter, a_fp4, cfg2)
    ):
        # The Gluon partials take 8-row tiles (the wgmma N): half the activation staging
        # of 16 (measured: benchmarks/gluon_experiment.py). Any block_m gives the same bits.
        cfg1 = replace(cfg1, block_m=8)
        cfg2 = replace(cfg2, block_m=8)
    elif (
        options.fc1 is None
        and options.fc2 is None
        and any(options.whole_runs(False, False, kk, a_fp4, replace(c, block_m=16), n_routes,
                                   num_experts) for kk, c in ((h, cfg1), (inter, cfg2)))
    ):  # fmt: skip
        # The whole-K Gluon kernels take 16-row tiles (both GEMMs: one tile schedule; a
        # GEMM that cannot run there runs loop 3 at them, the same bits), or 32 above
        # gluon_whole_wide rows
        wide = options.gluon_whole_wide
        bm = 32 if wide is not None and valid_rows > wide else 16
        cfg1 = replace(cfg1, block_m=bm)
        cfg2 = replace(cfg2, block_m=bm)
    for name, cfg in (("fc1", options.fc1), ("fc2", options.fc2)):
        if cfg is not None and cfg.block_m < 16:
            # Triton's dot at 8 token columns is not loop 3's wgmma: other bits.
            raise ValueError(f"options.{name}: block_m must be at least 16, got {cfg.block_m}")
    if cfg1.block_m != cfg2.block_m:
        raise ValueError("options: fc1 and fc2 configs must share block_m (one tile schedule)")
    return cfg1, cfg2


def split_counters(
    n_routes: int,
    experts: PreparedExperts,
    cfg1: GemmConfig,
    cfg2: GemmConfig,
    opt: TritonOptions,
    device: torch.device,
    *,
    amax: bool | int = False,
) -> tuple[torch.Tensor | None, tuple[torch.Tensor, torch.Tensor] | None, torch.Tensor | None]:
    """The zeros a call needs, in one buffer for ``sort_routes(zero=...)`` to clear (no
    memset node in a CUDA graph of the call): the split GEMMs' tile counters (the last
    program of a tile leaves its counter at zero) for ``expert_gemms(counters=...)``, and
    ``amax`` fp32 slots (True: one) for per-tensor amaxes (``amax_slots``: FC1's fused
    amax or the amax kernel of FC2's input, ``expert_gemms(amax_zero=...)``, then x's
    amax kernel; zero bits are 0.0). Returns (buffer, (FC1's, FC2's) counters or None
    when neither GEMM splits K (``TritonOptions.gemm_splits``; a GEMM that does not split
    gets an empty one), the fp32 [amax] slots or None); all None when there is nothing to
    zero."""
    e, h, inter = experts.num_experts, experts.hidden_size, experts.intermediate_size
    s1, s2 = opt.gemm_splits(n_routes, e, h, inter, cfg1, cfg2)
    if not (s1 or s2 or amax):
        return None, None, None
    nb = max_blocks(n_routes, e, cfg1.block_m)
    t1 = triton.cdiv(inter, cfg1.block_n) * nb if s1 else 0
    t2 = triton.cdiv(h, cfg2.block_n) * nb if s2 else 0
    zero = torch.empty(t1 + t2 + int(amax), dtype=torch.int32, device=device)
    counters = (zero[:t1], zero[t1 : t1 + t2]) if s1 or s2 else None
    slot = zero[t1 + t2 :].view(torch.float32) if amax else None
    return zero, counters, slot


def amax_slots(
    opt: TritonOptions,
    mode: str,
    act_scale: str,
    n_rows: int,
    hidden: int,
    n_routes: int,
    inter: int,
    amax_reduce=None,
) -> tuple[bool, bool]:
    """The zeroed fp32 slots a call's per-tensor W4A4 amaxes fold into
    (``split_counters(amax=...)``): (one for FC1's output: ``amax_in_fc1``, or its amax
    kernel; one for the amax kernel of FC1's input of ``n_rows`` x ``hidden``). Both False
    unless per-tensor W4A4 (and, for the kernels, ``amax_zeros_in_sort``)."""
    if mode != "w4a4" or act_scale != "per_tensor":
        return False, False
    if opt.amax_in_fc1(mode, act_scale):
        fc2_in = True
    else:
        fc2_in = (opt.amax_zeros_in_sort and opt.device_amax
                  and not _amax_self(opt, n_routes * inter, amax_reduce))  # fmt: skip
    fc1_in = (opt.amax_zeros_in_sort and opt.device_amax
              and not _amax_self(opt, n_rows * hidden, None))  # fmt: skip
    return fc2_in, fc1_in


def expert_gemms(
    sort: RouteSort,
    a: torch.Tensor,
    a_scales: torch.Tensor | None,
    a_global: torch.Tensor | None,
    experts: PreparedExperts,
    *,
    cfg1: GemmConfig,
    cfg2: GemmConfig,
    mode: str,
    act_scale: str,
    topk: int,
    a_gather: bool,
    route_weights: torch.Tensor,
    fused_into: torch.Tensor | None = None,
    amax_reduce: Callable[[torch.Tensor], torch.Tensor] | None = None,
    options: TritonOptions | None = None,
    pdl: bool = False,
    counters: tuple[torch.Tensor, torch.Tensor] | None = None,
    amax_zero: torch.Tensor | None = None,
    a_unit_order: torch.Tensor | None = None,
    a_decoded: torch.Tensor | None = None,
    fc1_early_weights: bool = False,
) -> torch.Tensor:
    """The expert work of a call, on routes already sorted (``sort``): FC1 with SwiGLU,
    for W4A4 the quantization of FC1's output, and FC2.

    Args:
        sort: ``sort_routes`` of the call's [T, topk] expert ids (T * topk routes).
        a: FC1 input. bf16 [T, H] gathered by route (``a_gather``), or for W4A4 NVFP4 codes
            uint8 [T, H/2] (gathered) or [T * topk, H/2] in sorted order (not gathered),
            with ``a_scales`` e4m3 [..., H/16] and ``a_global`` fp32 [...] per row.
        route_weights: fp32 [T * topk] router weights (read by the fused epilogue only).
        fused_into: fp32 [T, H] zeros: FC2 adds weight * y of each route into it with
            atomics (fused finalize). None: FC2 writes route rows.
        amax_reduce: W4A4 per-tensor: maps the fp32 amax of FC1's valid output rows to the
            amax its global scale is taken from (expert parallelism: an all-reduce max).
        counters: int32 zeros for the split GEMMs' tile counters (FC1's, FC2's), e.g. from
            ``sort_routes(zero=...)``; None: each split GEMM zeroes its own.
        amax_zero: fp32 [1] zero for the per-tensor amax of FC1's output, FC1's fused one
            (``options.amax_in_fc1``) or the amax kernel's (``split_counters(amax=...)``,
            ``amax_slots``); None: a zeroed tensor of its own.
        a_unit_order: ``a`` (bf16) with each 64 elements in the unit order, e.g. the sort
            kernel's ``x_ordered``; used when ``options.ordered_x`` applies (else ``a`` is
            reordered here, one more kernel).
        a_decoded: W4A4's FC1 input rows decoded (``quantize_rows(decoded=...)``), for FC1
            on the Gluon kernel; None: decoded there if needed.
        fc1_early_weights: a kernel that waited for the sort runs between the sort and
            FC1, so FC1's Gluon programs may issue weight copies before their grid wait
            (``TritonOptions.fc1_early``).

    Returns:
        bf16 [T * topk, H] route rows in sorted order (rows past the valid count
        unspecified), or ``fused_into``.
    """
    opt = options or TritonOptions()
    n_routes = sort.sorted_routes.shape[0]
    e_count = experts.num_experts
    h, inter = experts.hidden_size, experts.intermediate_size
    # Segmented loop: split K segments over programs when few rows an expert leave too few
    # programs to fill the GPU (same bits either way).
    split1, split2 = opt.gemm_splits(n_routes, e_count, h, inter, cfg1, cfg2)
    dense = opt.dense_for(n_routes, e_count, (h, inter))
    dev = a.device
    n_valid = sort.expert_offsets[e_count:]
    w4a4 = mode == "w4a4"
    prefill = dense and opt.prefill_here()  # prefill_runs
    # static W4A4's FC1 on gluon_prefill writes bf16 (the two-step path, the same bits)
    pre1 = prefill and _prefill_fits(cfg1, inter, h, True)
    fc1_fp4 = w4a4 and act_scale == "static" and opt.fc1_nvfp4_out and not pre1
    out_fp4 = None
    if fc1_fp4:  # FC1 writes NVFP4 codes, scales and globals of `a` itself
        act = _empty((n_routes, inter // 2), torch.uint8, dev, opt.poison)
        out_fp4 = (
            _empty((n_routes, inter // 16), torch.float8_e4m3fn, dev, opt.poison),
            _empty((n_routes,), torch.float32, dev, opt.poison),
            experts.a2_scale,
        )
    else:
        act = _empty((n_routes, inter), torch.bfloat16, dev, opt.poison)
    ordered = opt.ordered_for(mode, n_routes, e_count, h, inter, cfg1, cfg2)
    if ordered:  # FC1's input rows in the unit order, once (FC2's: FC1 writes them so)
        if a_unit_order is not None:
            a = a_unit_order
        else:
            a = dense_rows(a, None, decode_asm=opt.decode_asm, poison=opt.poison, order=64)
    gpdl = opt.gluon_pdl(n_routes, e_count)
    # gluon_a_tma: the Gluon GEMMs' activation rows by TMA; W4A16's FC1 then writes its
    # rows in the unit order for FC2 (both GEMMs on the Gluon kernels)
    g1 = opt.gluon_runs(split1, h, w4a4, cfg1)
    g2 = opt.gluon_runs(split2, inter, w4a4, cfg2)
    whole1 = opt.fc1_whole_runs(mode, act_scale, split1, dense, h, cfg1, n_routes, e_count)
    whole2 = opt.whole_runs(split2, dense, inter, w4a4, cfg2, n_routes, e_count)
    mid_unit, atma1, atma2 = _tma_rows(opt, w4a4, g1, g2, ordered)
    cuda = opt.cuda_decode and not w4a4  # the CUDA decode GEMMs, sized by the expected blocks
    cuda_blocks = opt.expected_blocks(n_routes, e_count, cfg1.block_m) if cuda else None
    gb1 = opt.grid_blocks(n_routes, e_count, cfg1.block_m, sort.num_blocks)
    gb2 = opt.grid_blocks(n_routes, e_count, cfg2.block_m, sort.num_blocks)
    ps1 = opt.persist_programs(True, cfg1.block_m, dev)
    ps2 = opt.persist_programs(False, cfg2.block_m, dev)
    famax = None
    if opt.amax_in_fc1(mode, act_scale):
        famax = amax_zero if amax_zero is not None else torch.zeros(1, device=dev)
    # dense_overlap: FC2's weights decoded on a side stream while FC1 runs (allocated on
    # this stream, which waits for the side one before FC2 reads them)
    w2_dense, side = None, None
    overlap = dense and opt.dense_overlap and not (prefill and _prefill_fits(cfg2, h, inter, False))
    if overlap and dev.type == "cuda" and not interpreting():
        w2_dense = torch.empty((e_count, h, inter), dtype=torch.bfloat16, device=dev)
        side = _side_stream(dev)
        side.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(side):
            dense_weights(experts.w2_codes, experts.w2_scales, decode_asm=opt.decode_asm,
                          order=k_order(int(opt.chunked), inter, cfg2.block_k),
                          out=w2_dense)  # fmt: skip
    _gemm(
        cfg1, sort, a, a_scales, a_global,
        experts.w13_codes, experts.w13_scales, experts.w13_global, act, route_weights,
        n=inter, k=h, topk=topk, gated=True, a_gather=a_gather, fused=False, pdl=pdl,
        decode_asm=opt.decode_asm, out_fp4=out_fp4, chunked=opt.chunked, split=split1,
        dense=dense, poison=opt.poison, gluon=opt.gluon_decode,
        counters=counters[0] if counters else None, amax_out=famax,
        a_ordered=ordered, out_ordered=ordered or mid_unit, blocks_last=opt.blocks_last,
        a_decoded=a_decoded, gluon_pdl=gpdl, early_weights=fc1_early_weights, a_tma=atma1,
        grid_blocks=gb1, persist=ps1, prefill=prefill, whole_k=opt.gluon_whole_k,
        whole=whole1, cuda=cuda, cuda_blocks=cuda_blocks,
        cuda_next=(experts.w2_codes, experts.w2_scales) if cuda else None,
    )  # fmt: skip

    # FC2 input.
    b_src, b_scales, b_global = act, None, None
    b_dec = None  # W4A4 on the Gluon kernel: the quantize kernel decodes FC2's rows too
    if w4a4 and not fc1_fp4 and opt.quantize_decoded and (g2 or whole2):
        b_dec = _empty((n_routes, inter), decoded_rows_dtype(), dev, opt.poison)
    if w4a4:
        if act_scale == "per_token":
            b_src, b_scales, b_global = quantize_rows(
                act, n_routes, mode=MODE_PER_ROW, count=n_valid, pdl=pdl, poison=opt.poison,
                decoded=b_dec,
            )  # fmt: skip
        elif act_scale == "per_tensor":
            if famax is not None:  # FC1's epilogue took the amax of its valid rows
                table = famax if amax_reduce is None else amax_reduce(famax.reshape(()))
                qmode, table = MODE_FROM_AMAX, table.reshape(1)
            else:
                qmode, table = _per_tensor_table(act, n_routes, n_valid, opt, pdl, amax_reduce,
                                                 zero=amax_zero)  # fmt: skip
            b_src, b_scales, b_global = quantize_rows(
                act, n_routes, mode=qmode, count=n_valid, table=table, pdl=pdl,
                poison=opt.poison, decoded=b_dec,
            )  # fmt: skip
        elif fc1_fp4:
            b_src, b_scales, b_global = act, out_fp4[0], out_fp4[1]
        else:
            b_src, b_scales, b_global = quantize_rows(
                act, n_routes, mode=MODE_STATIC, count=n_valid, table=experts.a2_scale,
                row_expert=sort.sorted_expert, pdl=pdl, poison=opt.poison, decoded=b_dec,
            )  # fmt: skip

    if fused_into is not None:
        dest = fused_into
    else:
        dest = _empty((n_routes, h), torch.bfloat16, dev, opt.poison)
    if side is not None:
        torch.cuda.current_stream(dev).wait_stream(side)
    _gemm(
        cfg2, sort, b_src, b_scales, b_global,
        experts.w2_codes, experts.w2_scales, experts.w2_global, dest, route_weights,
        n=h, k=inter, topk=topk, gated=False, a_gather=False, fused=fused_into is not None,
        pdl=pdl, decode_asm=opt.decode_asm, chunked=opt.chunked, split=split2, dense=dense,
        poison=opt.poison, gluon=opt.gluon_decode,
        counters=counters[1] if counters else None, a_ordered=ordered or mid_unit,
        blocks_last=opt.blocks_last, a_decoded=b_dec, early_weights=True, gluon_pdl=gpdl,
        a_tma=atma2, grid_blocks=gb2, persist=ps2, w_dense=w2_dense, prefill=prefill,
        whole_k=opt.gluon_whole_k, whole=whole2, cuda=cuda, cuda_blocks=cuda_blocks,
    )  # fmt: skip
    return dest


_SIDE_STREAMS: dict = {}


def _side_stream(device: torch.device) -> torch.cuda.Stream:
    """One side stream a device for ``TritonOptions.dense_overlap`` (created once)."""
    key = torch.device(device).index
    if key is None:
        key = torch.cuda.current_device()
    if key not in _SIDE_STREAMS:
        _SIDE_STREAMS[key] = torch.cuda.Stream(device=key)
    return _SIDE_STREAMS[key]


def moe_triton(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    experts: PreparedExperts,
    *,
    mode: str = "w4a16",
    act_scale: str = "per_token",
    fused_finalize: bool = False,
    options: TritonOptions | None = None,
) -> torch.Tensor:
    """The MoE forward on Triton kernels; inputs validated by ``fp4moe.moe``. bf16 [T, H]."""
    if x.device.type != "cuda" and not interpreting():
        raise RuntimeError(
            "backend: 'triton' needs a CUDA device (or TRITON_INTERPRET=1 for the interpreter); "
            f"x is on {x.device}. Use backend='reference' or 'auto' on this machine."
        )
    opt = options or TritonOptions()
    pdl = use_pdl(opt, x.device)
    t, h = x.shape
    topk = topk_ids.shape[1]
    e_count = experts.num_experts
    n_routes = t * topk
    dev = x.device
    x = x.contiguous()
    ids = topk_ids.contiguous()
    w_flat = topk_weights.contiguous().reshape(-1)

    cfg1, cfg2 = gemm_configs(n_routes, experts, mode, opt, act_scale)
    slot_fc2, slot_fc1 = amax_slots(opt, mode, act_scale, t, h, n_routes,
                                    experts.intermediate_size)  # fmt: skip
    zero, counters, slots = split_counters(
        n_routes, experts, cfg1, cfg2, opt, dev, amax=int(slot_fc2) + int(slot_fc1)
    )
    amax_zero = slots[:1] if slot_fc2 else None  # FC1's output
    x_zero = slots[int(slot_fc2) :][:1] if slot_fc1 else None  # x's amax kernel
    # ordered_x: the sort kernel also writes x in the GEMMs' unit order (no launch of its own)
    ordered = (
        opt.ordered_for(mode, n_routes, e_count, h, experts.intermediate_size, cfg1, cfg2)
        and opt.ordered_in_sort
    )
    # Fused: atomics add weight * y into fp32 [T, H]; unfused: route rows in sorted order.
    # With fused_chain its zeros come first, so no memset sits between two PDL launches.
    fused = None
    if fused_finalize and opt.fused_chain:
        fused = torch.zeros(t, h, dtype=torch.float32, device=dev)
    sort = sort_routes(ids, e_count, cfg1.block_m, zero=zero, x=x if ordered else None)
    n_valid = sort.expert_offsets[e_count:]  # device scalar: rows in sorted order

    # FC1 input.
    a_scales = a_global = None
    a_src, a_gather = x, True
    a_dec = None  # W4A4 on the Gluon kernel: the quantize kernel decodes FC1's rows too
    if mode == "w4a4" and opt.quantize_decoded:
        split1 = opt.gemm_splits(n_routes, e_count, h, experts.intermediate_size, cfg1, cfg2)[0]
        dense1 = opt.dense_for(n_routes, e_count, (h, experts.intermediate_size))
        if opt.gluon_runs(split1, h, True, cfg1) or opt.fc1_whole_runs(
            mode, act_scale, split1, dense1, h, cfg1, n_routes, e_count
        ):
            rows = n_routes if act_scale == "static" else t
            a_dec = _empty((rows, h), decoded_rows_dtype(), dev, opt.poison)
    if mode == "w4a4":
        if act_scale == "per_token":
            a_src, a_scales, a_global = quantize_rows(
                x, t, mode=MODE_PER_ROW, pdl=pdl, poison=opt.poison, decoded=a_dec
            )
        elif act_scale == "per_tensor":
            qmode, table = _per_tensor_table(x, t, None, opt, pdl, None, zero=x_zero)
            a_src, a_scales, a_global = quantize_rows(
                x, t, mode=qmode, table=table, pdl=pdl, poison=opt.poison, decoded=a_dec
            )
        else:  # static: global of the route's expert, so quantize each sorted row
            a_src, a_scales, a_global = quantize_rows(
                x, n_routes, mode=MODE_STATIC, index=sort.sorted_routes, div=topk,
                count=n_valid, table=experts.a13_scale, row_expert=sort.sorted_expert,
                pdl=pdl, poison=opt.poison, decoded=a_dec,
            )  # fmt: skip
            a_gather = False

    if fused_finalize and not opt.fused_chain:
        fused = torch.zeros(t, h, dtype=torch.float32, device=dev)
    dest = expert_gemms(
        sort, a_src, a_scales, a_global, experts, cfg1=cfg1, cfg2=cfg2, mode=mode,
        act_scale=act_scale, topk=topk, a_gather=a_gather, route_weights=w_flat,
        fused_into=fused, options=opt, pdl=pdl, counters=counters, amax_zero=amax_zero,
        a_unit_order=sort.x_ordered, a_decoded=a_dec,
        fc1_early_weights=mode == "w4a4" and opt.fc1_early,  # a quantize kernel between
    )  # fmt: skip
    if fused_finalize:
        if opt.fused_chain:
            return cast_rows(dest, pdl=pdl, poison=opt.poison)
        return dest.to(torch.bfloat16)
    return finalize_rows(dest, sort.route_pos, ids, w_flat, pdl=pdl, poison=opt.poison)


def cast_rows(src: torch.Tensor, *, pdl: bool = False, poison: bool = False) -> torch.Tensor:
    """bf16(src), round to nearest even (``torch.Tensor.to``'s bits), by one launch that
    under ``pdl`` waits for the kernel before it: the fused finalize's last step.

    Args:
        src: fp32 [T, H], contiguous.

    Returns:
        bf16 [T, H].
    """
    if src.dtype != torch.float32 or not src.is_contiguous():
        layout = "" if src.is_contiguous() else ", not contiguous"
        raise ValueError(f"src: expected a contiguous torch.float32 tensor, got {src.dtype}"
                         f"{layout}")  # fmt: skip
    out = _empty(tuple(src.shape), torch.bfloat16, src.device, poison)
    n = src.numel()
    if n == 0:
        return out
    block = 64 if interpreting() else 2048
    _launch(cast_kernel, (triton.cdiv(n, block),), pdl, src, out, n, BLOCK=block,
            INTERPRET=interpreting(), num_warps=4)  # fmt: skip
    return out


def finalize_rows(
    y_rows: torch.Tensor,
    route_pos: torch.Tensor,
    topk_ids: torch.Tensor,
    weights: torch.Tensor,
    *,
    pdl: bool = False,
    poison: bool = False,
) -> torch.Tensor:
    """Deterministic finalize (SPEC 6) on the device: out[t] = sum over k ascending of
    weights[t, k] * y_rows[route_pos[t * K + k]], fp32 fma, one bf16 rounding; masked
    routes (id < 0) skipped, all-masked tokens 0.

    Args:
        y_rows: bf16 [R, H] route rows (R >= 1).
        route_pos: int32 [T * K] row of each route in ``y_rows``.
        topk_ids: int32 [T, K]; weights: fp32 [T * K] (or [T, K]).

    Returns:
        bf16 [T, H].
    """
    t, k = topk_ids.shape
    h = y_rows.shape[1]
    out = _empty((t, h), torch.bfloat16, y_rows.device, poison)
    if t == 0:
        return out
    block_h, warps = finalize_block_h(t, h)
    tpp = finalize_tokens_per_program(t)
    _launch(
        finalize_kernel, (triton.cdiv(t, tpp), triton.cdiv(h, block_h)), pdl,
        y_rows, route_pos, topk_ids, weights.reshape(-1), out, h, t,
        TOPK=k, KP=triton.next_power_of_2(k), BLOCK_H=block_h,
        INTERPRET=interpreting(), TPP=tpp, num_warps=warps,
    )  # fmt: skip
    return out


def workspace_bytes(
    num_tokens: int,
    top_k: int,
    hidden: int,
    inter: int,
    num_experts: int,
    *,
    mode: str = "w4a16",
    act_scale: str = "per_token",
    fused_finalize: bool = False,
    block_m: int = 16,
    options: TritonOptions | None = None,
) -> int:
    """Peak bytes ``moe_triton`` holds during one call of ``num_tokens`` tokens (freed
    after the call, or held by a CUDA graph's pool), as the largest of its three phases:

    - FC1: route sort and schedule, W4A4 quantized inputs, the fp32 accumulator (fused
      finalize), FC1's output, and FC1's temporaries: its fp32 segment partials (loop 3
      with split K) or, on the dense path (``dense_above``), its decoded bf16 weights and
      activation rows in the loop's order (with ``dense_overlap`` FC2's decoded weights
      too); with ``ordered_x`` its reordered input rows;
      W4A4 on the Gluon kernels (``gluon_decode``, a Hopper GPU): its decoded input rows;
    - FC2: the same less FC1's temporaries, plus FC2's W4A4 input, the route rows
      (deterministic finalize) and FC2's own temporaries;
    - finalize: the sort, inputs, route rows or accumulator, and the bf16 output.

    Tile counters and the per-tensor amax scalar (a few KB) are left out."""
    opt = options or TritonOptions()
    t, k, h, i = num_tokens, top_k, hidden, inter
    n = t * k
    nb = -(-n // block_m) + min(num_experts, n)
    common = 4 * (3 * n + 2 * num_experts + 1 + 3 * nb)  # sort outputs (int32)
    w4a4 = mode == "w4a4"
    dense = opt.dense_for(n, num_experts, (h, i))
    pre1 = pre2 = False  # the GEMMs on gluon_prefill (no decoded weights)
    if dense and opt.prefill_here():  # prefill_runs
        dcfg = gemm_configs_for(n, num_experts, h, i, mode, opt, act_scale)
        pre1, pre2 = _prefill_fits(dcfg[0], i, h, True), _prefill_fits(dcfg[1], h, i, False)
    fc1_fp4 = w4a4 and act_scale == "static" and opt.fc1_nvfp4_out and not pre1
    act = n * (i // 2 + i // 16 + 4) if fc1_fp4 else n * i * 2  # FC1 output a
    b_in = 0
    if w4a4:
        rows = n if act_scale == "static" else t
        common += rows * (h // 2 + h // 16 + 4)  # x as NVFP4 + globals
        if not fc1_fp4:
            b_in = n * (i // 2 + i // 16 + 4)  # a quantized for FC2
    if fused_finalize:
        common += t * h * 4  # fp32 accumulator, zeroed before FC1
        rows_out = 0
    else:
        rows_out = n * h * 2  # route rows, bf16
    tmp1 = tmp2 = 0
    if dense:
        x_rows = n if w4a4 and act_scale == "static" else t
        tmp1 = num_experts * 2 * i * h * 2 + x_rows * h * 2  # decoded weights, rows
        tmp2 = num_experts * h * i * 2 + n * i * 2
        if pre1:  # gluon_prefill: the rows only, gathered into sorted order
            tmp1 = n * h * 2
        if pre2:
            tmp2 = n * i * 2
        elif opt.dense_overlap:  # FC2's decoded weights, decoded during FC1
            tmp1 += num_experts * h * i * 2
    if int(opt.chunked) == 3 and n:
        # Segment partials of each split GEMM (at least 32-element tiles: SEGMENT is a
        # multiple of any BK), with the configs the call would take (``gemm_configs``).
        cfgs = gemm_configs_for(n, num_experts, h, i, mode, opt, act_scale)
        ordered = opt.ordered_for(mode, n, num_experts, h, i, *cfgs)
        if ordered:
            tmp1 += t * h * 2  # FC1's input rows in the unit order (bf16)
        s1, s2 = opt.gemm_splits(n, num_experts, h, i, *cfgs)
        # the GEMMs on the CUDA decode kernel (TritonOptions.cuda_decode) hold no partials
        g1, g2 = opt.gluon_runs(s1, h, w4a4, cfgs[0]), opt.gluon_runs(s2, i, w4a4, cfgs[1])
        c1, c2 = _cuda_gemms(opt, w4a4, g1, g2, ordered, h, i, *cfgs)
        if s1 and h > SEGMENT and not c1:
            tmp1 += -(-h // SEGMENT) * n * 2 * i * 4
        if s2 and i > SEGMENT and not c2:
            tmp2 += -(-i // SEGMENT) * n * h * 4
        if w4a4:  # the Gluon GEMMs' decoded activation rows (bf16)
            if g1 or opt.fc1_whole_runs(mode, act_scale, s1, dense, h, cfgs[0], n, num_experts):
                rows1 = (n if act_scale == "static" else t) * h * 2
                if opt.quantize_decoded:  # written by the quantize kernel, held by
                    common += rows1  # moe_triton for the whole call
                else:  # dense_rows inside FC1's launch, freed after it
                    tmp1 += rows1
            if g2 or opt.whole_runs(s2, dense, i, True, cfgs[1], n, num_experts):
                tmp2 += n * i * 2
        elif opt.gluon_a_tma and g1:
            tmp1 += n * h * 2  # FC1's input rows gathered in sorted unit order (bf16)
    fc1 = common + act + tmp1
    fc2 = common + act + b_in + rows_out + tmp2
    fin = common + rows_out + t * h * 2  # the bf16 output
    return max(fc1, fc2, fin)
