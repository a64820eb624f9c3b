"""The planner's named thresholds and tile rules, each with why (measured on one H200;
docs/performance.md has the tables). The same bits on either side of every threshold:
they move time only.

Rows are *expected valid rows an expert*: a call's routes times the expected valid
fraction (``Options.valid_fraction``) over the local experts, spread evenly.
"""

from __future__ import annotations

import math

from .options import Tile

__all__ = [
    "DENSE_ABOVE_ROWS",
    "DENSE_TILE",
    "GLUON_PDL_MAX_ROUTES",
    "GLUON_SPLIT_MAX_ROWS",
    "PREFILL_ABOVE_ROWS",
    "PREFILL_ABOVE_ROWS_SCALE_LOADS",
    "PREFILL_NARROW_MAX_ROWS_SCALE_LOADS",
    "QUANTIZE_AMAX_SELF_MAX_ELEMENTS",
    "SORT_KERNEL_MAX_ROUTES",
    "SPLIT_BELOW_PROGRAMS",
    "SPLIT_MAX_ROUTES_PER_EXPERT",
    "UNKNOWN_VALID_FRACTION",
    "W4A8_PREFILL_32_MAX_ROWS",
    "W4A8_PREFILL_ABOVE_ROWS",
    "W4A8_PREFILL_NARROW_MAX_ROWS",
    "WHOLE_K_FROM_ROWS",
    "WHOLE_K_MAX_ROWS",
    "WHOLE_K_WIDE_ROWS",
    "portable_tile",
    "prefill_rows",
    "split_programs",
    "touched_experts",
    "w4a8_block_k",
    "w4a8_tile",
]

# Options.valid_fraction when not given: a call masking 7 of 8 routes (expert parallelism
# over 8 ranks) must not switch to a regime where it would lose.
UNKNOWN_VALID_FRACTION = 1 / 6

# The route sort runs as the Triton kernel up to this many routes (T * top-k), instead
# of the ~35 torch launches: in a CUDA graph on the H200 (as
# ``benchmarks/sort_bench.py`` times), 5 against 72 us at 8 routes, 7.5 against 154 at
# 8192, 14.5 / 19.8 against 164 / 156 at 32768, 77 / 98 against 339 / 247 at 262144
# (DeepSeek-V3 EP8 / Qwen3-30B-A3B). Above 8192 routes it takes two launches
# (``sort.ONE_PASS_MAX_ROUTES``) and grows about linearly; past the largest size
# measured, the torch sort.
SORT_KERNEL_MAX_ROUTES = 262144

# Split K of both GEMMs while the call's routes (all of them, masked or not) an expert are
# at most this: at 4 rows an expert splitting took DeepSeek-V3 EP8 at 16 tokens from 94 to
# 77 us; at 16 rows (64 tokens) not splitting won (285 against 293 us).
SPLIT_MAX_ROUTES_PER_EXPERT = 8
# Above that, split K of a GEMM of more than one segment whose expected programs (weight
# tiles x experts touched x row blocks an expert) are fewer than this: Mixtral-8x7B's FC2
# at 256 tokens (256 programs of K 14336 on 132 SMs) 1158 -> 1020 us split, while
# DeepSeek-V3 EP8 (512 to 1557 programs) and Qwen3-30B-A3B (1536) lose 3% to 7% to it.
SPLIT_BELOW_PROGRAMS = 384

# Split-K GEMMs run as the Gluon split kernel with 8-row tiles up to this many rows: it
# wins at 1 to 4 rows (DeepSeek-V3 EP8 64 tokens 275 -> 222 us, Mixtral-8x7B 16 tokens
# 351 -> 283) and loses from 5.3 (Kimi-K2 EP8 256 tokens 547 -> 624).
GLUON_SPLIT_MAX_ROWS = 4.0
# Above this, a call whose two GEMMs can both run whole-K takes the whole-K Gluon kernels
# at 16-row tiles instead of the split ones at 8: whole-K's cost is flat in the rows up to
# its 16, the split kernels' grows, and they cross near 3.3 rows (DeepSeek-V3 EP8 at 128
# tokens 323 -> 301 us, Kimi-K2 EP8 at 192 tokens 396 -> 370).
WHOLE_K_FROM_ROWS = 3.5
# GEMMs the portable loop would run unsplit take the whole-K Gluon kernel up to this many
# rows (DeepSeek-V3 EP8 256 / 512 / 768 tokens 475 / 794 / 844 -> 435 / 581 / 806 us;
# Mixtral-8x7B 64 tokens 545 -> 492); at 32 rows many experts hold two 32-row blocks and
# it loses. Where the prefill kernel takes the call it runs from PREFILL_ABOVE_ROWS.
WHOLE_K_MAX_ROWS = 28.0
# Above this, the whole-K tiles are 32 rows instead of 16 (each weight decoded once for up
# to 32 rows): DeepSeek-V3 EP8 896 tokens 847 -> 766 us, Mixtral-8x7B 112 tokens 724 ->
# 577; at 19 to 21 rows Kimi-K2 EP8 loses (up to 6%), at 22 every preset measured gains.
WHOLE_K_WIDE_ROWS = 21.5

# The Gluon prefill kernel (where both GEMMs fit it) from above this many rows. Against
# the whole-K kernels and the portable loop (Mixtral-8x7B: 64-row tiles) at 16 rows, on
# 32-row tiles: DeepSeek-V3 EP8 451 -> 363 us, Qwen3-30B-A3B 198 -> 187, Mixtral-8x7B 414
# -> 335, the gpt-oss-120b shape 1074 -> 781; at 12 rows DeepSeek-V3 gains (371 -> 357),
# Mixtral ties and Qwen3 loses (165 -> 187); at 8 rows every preset but gpt-oss loses (3%
# to 14%).
PREFILL_ABOVE_ROWS = 12
# There it runs each expert's rows in tiles of their own size (``sort_routes(mixed=True)``,
# one launch a tile rows): blocks of 128 rows first (one program an SM, each weight decoded
# once for 128 rows), the rest in blocks of 64 or of 32 (two programs an SM), whichever
# costs the expert least by ``sort.MIXED_COST``. One tile rows a call, pinned: 32-row tiles
# gain 18% to 24% over 64-row ones at 20 rows (DeepSeek-V3 EP8 640 tokens 451 -> 369 us),
# tie or gain up to 19% at 24, lose 6% to 34% at 32 (Mixtral-8x7B 128 tokens 417 -> 558);
# 128-row tiles against 64-row ones cost 1.74 of them (fit to 40 points of five presets
# at 48 to 272 rows). Against one tile rows a call (64 or 128, the fewer by that cost,
# chosen on the device), the mixed schedules take DeepSeek-V3 EP8 at 1024 / 2048 / 4096
# tokens from 466 / 699 / 1126 to 428 / 643 / 1007 us (at 512 tokens, 16 rows, within 1%),
# Qwen3-30B-A3B and Mixtral-8x7B at 512 to 4096 tokens 2% to 6% less.
#
# Where the scales come by pointer loads the prefill kernel starts above this many rows
# instead, on one tile rows a call: at 16 rows DeepSeek-V3 EP8 ties (461 -> 456 us),
# Qwen3-30B-A3B (197 -> 230) and gpt-oss (1173 -> 1206) lose.
PREFILL_ABOVE_ROWS_SCALE_LOADS = 16
# There (scale rows of K / 16 bytes no multiple of 16, which TMA cannot copy) the tiles are
# 64 rows up to this many rows, else 128: the gpt-oss-120b shape at 64 rows ties (1941 ->
# 1913 us), at 128 rows loses (2772 -> 2962).
PREFILL_NARROW_MAX_ROWS_SCALE_LOADS = 64
# W4A8's tiles (the FP8 path, no half units, one tile rows a call) are 32 rows up to this
# many rows: at 16 rows DeepSeek-V3 EP8, Mixtral-8x7B and Qwen3-30B-A3B 612 / 581 / 296 ->
# 518 / 492 / 252 us against 64-row tiles; at 24 rows DeepSeek-V3 and Mixtral lose 3% to 4%,
# Qwen3 gains 12%; at 32 rows all lose 17% to 41%.
W4A8_PREFILL_32_MAX_ROWS = 16
# ... and 64 rows up to this many: DeepSeek-V3 EP8 at 16 / 32 rows 798 / 973 -> 600 / 782
# us, at 64 rows 1030 -> 1076.
W4A8_PREFILL_NARROW_MAX_ROWS = 32


def prefill_rows(rows: float, *, w4a8: bool, scale_loads: bool) -> int:
    """The prefill kernel's tile rows at ``rows`` expected valid rows an expert, where it
    runs one tile rows a call (W4A8's FP8 path with ``w4a8``; ``scale_loads``: some GEMM's
    scales come by pointer loads); elsewhere its tiles follow each expert's rows (the
    mixed schedules) and this is the sort's ``block_m`` beside them, 64."""
    if w4a8:
        if rows <= W4A8_PREFILL_32_MAX_ROWS:
            return 32
        return 64 if rows <= W4A8_PREFILL_NARROW_MAX_ROWS else 128
    if scale_loads:
        return 64 if rows <= PREFILL_NARROW_MAX_ROWS_SCALE_LOADS else 128
    return 64


# Elsewhere (a shape the prefill kernel does not take, or no Hopper GPU) the weights are
# decoded to bf16 once a call above this many rows: decoding every expert (1.0 ms for
# 1.4e9 weights) pays from about 256 rows (Qwen3-30B-A3B at 8192 tokens 3.14 -> 2.14 ms,
# Mixtral-8x7B 26.0 -> 12.2 ms) and loses at 128 (DeepSeek-V3 EP8 4096 tokens 2.28 ->
# 2.98 ms).
DENSE_ABOVE_ROWS = 192

# The Gluon kernels join the call's PDL chain (FC2 issuing its first weight copies before
# its wait) up to this many expected valid routes a call: DeepSeek-V3 EP8 1 / 8 / 16
# tokens 47.4 / 100.2 / 62.9 -> 46.4 / 95.6 / 59.7 us, but 64 / 128 tokens 218 / 345 ->
# 225 / 358.
GLUON_PDL_MAX_ROUTES = 32

# W4A8 runs on the Gluon prefill kernel's FP8 path (where both GEMMs fit it) above this
# many rows, else on the portable kernel's FP8 loop (the same bits): DeepSeek-V3 EP8 at 16
# rows 756 us portable against 600 prefill (64-row tiles), at 8 rows 510 against 581.
W4A8_PREFILL_ABOVE_ROWS = 12

# Per-tensor W4A4: where the rows to quantize hold at most this many elements, each
# quantize program takes the amax itself instead of an amax kernel before it (one launch
# less; DeepSeek-V3 EP8 at 1 token 56.0 -> 52.2 us).
QUANTIZE_AMAX_SELF_MAX_ELEMENTS = 16384


def touched_experts(valid_routes: float, num_experts: int) -> float:
    """The experts that ``valid_routes`` routes spread evenly at random over
    ``num_experts`` are expected to touch."""
    return num_experts * (1.0 - (1.0 - 1.0 / max(num_experts, 1)) ** valid_routes)


def _pow2_dividing(k: int, cap: int) -> int:
    b = cap
    while k % b:
        b //= 2
    return b


def portable_tile(
    routes_per_expert: float, n: int, k: int, *, gated: bool, a_fp4: bool,
    valid_rows: float, interpret: bool,
) -> Tile:  # fmt: skip
    """The portable GEMM's tile from the routes an expert receives (no autotuning).

    Few rows: 16 token rows and 64-row weight tiles, so weight rows spread over many
    programs (DeepSeek-V3 EP8 W4A16 at 1 / 16 / 64 tokens); FC2 takes 128-row weight tiles
    above 8 routes an expert (64 tokens 285 -> 268 us). From 64 valid rows, 64-row tiles
    (each weight decoded once for 64 rows: Mixtral-8x7B at 256 tokens 1430 -> 1020 us);
    W4A4 above 1024 routes an expert 128 x 64 (1960 against 2119 us at 4096 tokens). The
    interpreter takes small tiles (its time grows with the tile)."""
    if interpret:
        return Tile(16, 32, _pow2_dividing(k, 64), 4, 1)
    if routes_per_expert <= 64 and valid_rows < 64:
        bn = 128 if routes_per_expert > 8 and not gated else 64
        return Tile(16, bn, _pow2_dividing(k, 128), 4, 3)
    if routes_per_expert > 1024 and a_fp4:
        return Tile(128, 64, _pow2_dividing(k, 64), 4, 3)
    return Tile(64, 128, _pow2_dividing(k, 64), 4, 3)


# The decoded-weights path's tile: the fastest at 8192 tokens on Mixtral-8x7B (13.5 ms
# against 15.1 to 18.4 for the others) and within 1.5% of the fastest on DeepSeek-V3 EP8.
DENSE_TILE = Tile(128, 128, 64, 8, 3)


def split_programs(n: int, block_n: int, touched: float, rows: float, block_m: int) -> float:
    """The expected programs of a GEMM with ``n`` outputs: weight tiles x experts touched x
    row blocks an expert (``rows`` an expert; 16.000001 rows: one 16-row block)."""
    blocks = math.ceil(rows / block_m - 1e-6)
    return -(-n // block_n) * touched * blocks


def w4a8_block_k(k: int, interpret: bool) -> int:
    """W4A8's K tile: 128 (64 in the interpreter), or the largest power of two dividing K;
    a multiple of 64 wherever 64 divides K (the rows' unit order)."""
    return _pow2_dividing(k, 64 if interpret else 128)


def w4a8_tile(valid_rows: float, k: int, *, gated: bool, interpret: bool) -> Tile:
    """W4A8's tile (the portable kernel's FP8 main loop). Its K tile is fixed by the shape
    (128, or the largest power of two dividing K; 64 in the interpreter), never by the
    token count, and the FP8 sums are chained over ``shapes.FP8_GROUP`` K whatever the
    tile, so the bits of a token do not depend on the batch. FP8 dots take at least 16
    token rows. The token rows grow with the expected rows an expert: 16 up to 16 rows,
    64 up to 64, then 128."""
    bk = w4a8_block_k(k, interpret)
    if interpret:
        return Tile(16, 32, bk, 4, 1)
    if valid_rows <= 16:
        return Tile(16, 64, bk, 4, 3)
    if valid_rows <= 64:
        return Tile(64, 64 if gated else 128, bk, 4 if gated else 8, 3)
    return Tile(128, 64 if gated else 128, bk, 8, 3)
