"""Which GEMM shapes each kernel family takes (plain Python, no Triton import), shared by
the launchers' input checks and the planner."""

from __future__ import annotations

__all__ = [
    "FP8_GROUP",
    "PREFILL_BLOCKS",
    "SEGMENT",
    "decode_row_programs",
    "gluon_decode_fits",
    "k_order",
    "max_blocks",
    "prefill_fits",
    "scale_rows_2d",
    "scale_rows_tma",
    "scale_tma",
]

SEGMENT = 1024  # K elements a segment of the main loop, the same for every kernel family
PREFILL_ROWS = 128  # token rows a tile of the prefill kernel (its schedule's block_m)
PREFILL_BLOCKS = (32, 64, PREFILL_ROWS)  # the prefill kernel's tile rows
# W4A8's accumulation: the FP8 products of each FP8_GROUP K are summed in the tensor cores
# from zero, and the group sums added to fp32 sums in K order, in every kernel family (a
# longer chain loses precision in the tensor cores' FP8 accumulator)
FP8_GROUP = 256


def k_order(k: int, block_k: int) -> int:
    """The K order a GEMM of inner size ``k`` multiplies in with K tiles of ``block_k``
    (``decode``): the unit order (64) whenever both are multiples of 64, else the chunk
    order (32). It depends on the shape only, not on the token count (batch invariance)."""
    return 64 if k % 64 == 0 and block_k % 64 == 0 else 32


def gluon_decode_fits(k: int, block_m: int, block_k: int, whole: bool = False) -> bool:
    """Whether the Gluon decode kernel (``gluon_decode``) takes a GEMM of inner size ``k``
    on tiles of ``block_m`` token rows: K in whole 64-element units in the unit order (the
    last 1024-K segment may be partial), and 8 or 16 rows a tile (or 32 whole-K)."""
    return (
        k > 0
        and k % 64 == 0
        and k_order(k, block_k) == 64
        and block_m in ((8, 16, 32) if whole else (8, 16))
    )


def prefill_fits(n: int, k: int, gated: bool) -> bool:
    """Whether the Gluon prefill kernel takes a GEMM of ``n`` outputs and K = ``k``: K in
    whole 64-element units (the last 1024-K segment and 256-K stage may be partial) and
    ``n`` in 64-row weight tiles (a GEMM that is not ``gated`` runs 128-row tiles, the
    last one masked past ``n``)."""
    return k > 0 and k % 64 == 0 and n > 0 and n % 64 == 0


def max_blocks(num_routes: int, num_experts: int, block_m: int) -> int:
    """The row blocks of a call's tile schedule (``sort.sort_routes``): an upper bound of
    sum over experts of cdiv(rows, block_m), known on the host without a sync."""
    return -(-num_routes // block_m) + min(num_experts, num_routes)


# The decode kernels' grid: the programs of each (weight tile, K segment) take the call's
# valid row blocks in turn, as many as this many waves of 8 programs an SM hold, instead of
# a program for each of the worst case's blocks (most empty at decode sizes), and enough
# that none takes more than DECODE_ROW_TURNS blocks (its turns are unrolled).
DECODE_ROW_WAVES = 4
DECODE_ROW_TURNS = 4


def decode_row_programs(blocks: int, units: int, sm_count: int) -> tuple[int, int]:
    """(programs, turns): programs a (weight tile, K segment) of a decode-kernel grid of
    ``units`` such pairs over a schedule of ``blocks`` row blocks, ``DECODE_ROW_WAVES``
    waves of 8 programs on each of ``sm_count`` SMs (at least 1, at most ``blocks``, at
    least blocks / ``DECODE_ROW_TURNS``), and the most blocks a program takes."""
    waves = -(-DECODE_ROW_WAVES * 8 * sm_count // max(units, 1))
    rows = max(1, min(blocks, max(waves, -(-blocks // DECODE_ROW_TURNS))))
    return rows, max(1, -(-blocks // rows))


def scale_tma(k: int) -> bool:
    """Whether TMA can copy contiguous scale rows of a GEMM of inner size ``k`` (K / 16
    bytes, a multiple of 16). ``PreparedExperts`` pads the others in memory
    (``experts.align_scale_rows``); ``scale_rows_tma`` tells of a tensor."""
    return (k // 16) % 16 == 0


def scale_rows_2d(scales) -> bool:
    """Whether weight scales [E, N, K/16] (a torch tensor) are one 2-D view [E * N, K/16]
    with contiguous rows, any number of bytes apart: what the portable kernels read."""
    e, n, _ = scales.shape
    st = scales.stride()
    return st[2] == 1 and (e == 1 or st[0] == n * st[1])


def scale_rows_tma(scales) -> bool:
    """Whether TMA can copy the rows of weight scales [E, N, K/16] (a torch tensor): one 2-D
    view [E * N, K/16] whose rows lie a multiple of 16 bytes apart from a 16-byte aligned
    start (``experts.align_scale_rows``; torch's allocations start aligned, so the view's
    offset into its storage tells). The Gluon kernels load other scales by pointer,
    contiguous."""
    return (scale_rows_2d(scales) and scales.stride(1) % 16 == 0
            and scales.storage_offset() % 16 == 0)  # fmt: skip
