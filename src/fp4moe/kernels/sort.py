"""Route sort and tile schedule for the grouped GEMMs, on the device with no host sync.

Given top-k ids [T, K] (negative = masked), produce:

- ``sorted_routes`` int32 [T*K]: flat route indices (t*K + k) in expert order (stable, so
  within an expert routes keep ascending token order); the first ``n_valid`` are the valid
  routes, masked routes come after and are never read.
- ``route_pos`` int32 [T*K]: the inverse, position of route t*K+k in sorted order.
- ``expert_counts`` int32 [E], ``expert_offsets`` int32 [E+1] (exclusive prefix sum).
- the tile schedule: ``block_expert``, ``block_start``, ``block_end`` int32 [max_blocks];
  block b covers sorted rows [start, end) of one expert; unused blocks have expert -1 and
  their programs exit at once. ``max_blocks = cdiv(T*K, block_m) + min(E, T*K)`` bounds
  sum_e cdiv(count_e, block_m), so the grid size is known on the host without a sync.
  The valid blocks come first; ``valid_blocks`` int32 [1] counts them (the prefill
  kernel's persistent programs stop there).
- with ``mixed``, each expert's rows also in tiles of its own size (``RouteSort.mixed``,
  three schedules): blocks of 128 rows first, then the rest in blocks of 64 or of 32,
  whichever costs the expert least by ``MIXED_COST`` (a block's time in 64-row blocks);
  the prefill kernel runs one launch a schedule.

Two implementations with the same outputs, both without a host sync (capturable in a
CUDA graph); an expert with no rows gets no block:

- ``sort_routes_kernel``, one Triton launch (two for large batches), instead of the ~35
  small torch kernels below, which cost about 70 us in a CUDA graph at 1 token and about
  90 us at 2048 routes on the H200. Each program places 16 routes (128 above 1024) and
  writes as many tile-schedule entries. Up to ``ONE_PASS_MAX_ROUTES`` it histograms all
  the routes itself (in steps of 8192 above 4096 routes), so the programs never wait on
  each other; above, a first launch (``sort_counts_kernel``) histograms each step of 8192
  routes once, and each program sums those rows and histograms only the routes of its
  own step before its chunk, so the cost grows about linearly with the routes.
  With ``release`` (a programmatic dependent launch chain) it lets the next kernel start
  as it starts, whose programs then wait for the sort's end before they read its outputs.
- torch ops (stable sort, scatter-add, cumsum, searchsorted; no ``nonzero``, ``bincount``
  or ``.item()``): off CUDA and above the largest batch the kernel was measured at.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .common import interpreting
from .gemm.shapes import PREFILL_BLOCKS, max_blocks

__all__ = [
    "ONE_PASS_MAX_ROUTES",
    "RouteSort",
    "TileSchedule",
    "max_blocks",
    "sort_routes",
    "sort_routes_reference",
]

# Above this many routes the sort takes two launches (``sort_counts_kernel`` first): on
# the H200 (as ``benchmarks/sort_bench.py`` times) at 8192 routes one launch takes 7.5 /
# 11.1 us against two's 10.4 / 14.1, at 16384 10.0 / 17.2 against 10.5 / 14.5, at 32768
# 25.1 / 58.2 against 14.5 / 19.8 (DeepSeek-V3 EP8 / Qwen3-30B-A3B routes).
ONE_PASS_MAX_ROUTES = 8192
# The mixed schedules' block rows and a block's cost in 64-row blocks of the prefill
# kernel (``benchmarks/fit_tile_cost.py`` fits them to sweeps pinning each tile rows).
MIXED_ROWS = tuple(sorted(PREFILL_BLOCKS, reverse=True))  # (128, 64, 32)
MIXED_COST = (1.74, 1.0, 0.85)


def _chunk(n: int) -> int:
    """Routes (and tile-schedule entries) a program of ``sort_routes_kernel`` places (the
    stable rank among them is a [chunk, chunk] compare): 16 up to 1024 routes, so that
    small batches spread over many short programs, 128 above."""
    return 16 if n <= 1024 else 128


def _piece(n: int, chunk: int) -> tuple[int, int]:
    """(routes a program histograms at a time, warps): the whole batch in one step up to
    4096 routes, steps of 8192 over 8 warps above."""
    np2 = triton.next_power_of_2(max(n, 1))
    return (max(np2, chunk), 4) if np2 <= 4096 else (8192, 8)


@dataclass(frozen=True)
class TileSchedule:
    """Blocks of ``block_m`` sorted rows: block b covers rows [start, end) of one expert
    (int32 [max_blocks] each; unused blocks have expert -1), the valid blocks first and
    ``valid_blocks`` (int32 [1]) counting them."""

    block_expert: torch.Tensor
    block_start: torch.Tensor
    block_end: torch.Tensor
    valid_blocks: torch.Tensor
    block_m: int


@dataclass(frozen=True)
class RouteSort:
    sorted_routes: torch.Tensor
    route_pos: torch.Tensor
    expert_counts: torch.Tensor
    expert_offsets: torch.Tensor
    block_expert: torch.Tensor
    block_start: torch.Tensor
    block_end: torch.Tensor
    sorted_expert: torch.Tensor  # int32 [T*K]: expert of each sorted row (0 past n_valid)
    valid_blocks: torch.Tensor  # int32 [1]: blocks with rows (they come first)
    block_m: int
    mixed: tuple[TileSchedule, ...] | None = None  # each expert's rows over MIXED_ROWS

    @property
    def num_blocks(self) -> int:
        return self.block_expert.numel()

    @property
    def schedule(self) -> TileSchedule:
        """The tile schedule of ``block_m`` rows a block (these fields as one)."""
        return TileSchedule(self.block_expert, self.block_start, self.block_end,
                            self.valid_blocks, self.block_m)  # fmt: skip


def sort_routes(
    topk_ids: torch.Tensor,
    num_experts: int,
    block_m: int,
    *,
    use_kernel: bool,
    zero: torch.Tensor | None = None,
    mixed: bool = False,
    release: bool = False,
) -> RouteSort:
    """Sort routes by expert and build the tile schedule (see module docstring).

    Args:
        topk_ids: int32 [T, K], ids in [-inf, E); ids >= E are the caller's to reject.
        num_experts: E. block_m: rows per GEMM tile. mixed: also each expert's rows in
            blocks of MIXED_ROWS (``RouteSort.mixed``: three schedules, 128, 64 and 32
            rows a block).
        use_kernel: the Triton kernel (on CUDA or in the interpreter; needs at least one
            route) or torch ops (any device); the planner chooses (``Plan.sort``).
        zero: int32 [.] set to 0 on the way (the split GEMMs' tile counters, amax slots):
            the sort kernel zeroes it, so a CUDA graph of the call has no memset node
            between kernels (which would stand between programmatic dependent launches).
        release: the kernel lets the next kernel of a programmatic dependent launch chain
            start as it starts (that kernel waits for the sort's end before it reads any
            of its outputs); only where the device has PDL (``Plan.pdl``).
    """
    if zero is not None and (
        zero.dtype != torch.int32 or zero.device != topk_ids.device or not zero.is_contiguous()
    ):
        raise ValueError(
            f"zero: expected a contiguous torch.int32 tensor on {topk_ids.device}, got "
            f"{zero.dtype} on {zero.device}"
        )
    if use_kernel and topk_ids.numel():
        return _sort_routes_triton(topk_ids, num_experts, block_m, zero, mixed, release)
    if zero is not None:
        zero.zero_()
    return _sort_routes_torch(topk_ids, num_experts, block_m, mixed)


def _mixed_split_torch(counts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Each expert's rows in MIXED_ROWS' blocks: (rows in 128-row blocks, rows in 64-row
    blocks, rows in 32-row blocks), int64 [E] each, by the least summed block cost."""
    (b0, b1, b2), (c0, c1, c2) = MIXED_ROWS, MIXED_COST
    best = None
    for q in (torch.zeros_like(counts), counts // b0, counts // b0 + 1):
        big = torch.minimum(counts, q * b0)
        rem = counts - big
        for mid in (True, False):
            cost = q * c0 + (((rem + b1 - 1) // b1) * c1 if mid else ((rem + b2 - 1) // b2) * c2)
            none = torch.zeros_like(rem)
            cand = (cost, big, rem if mid else none, none if mid else rem)
            if best is None:
                best = cand
            else:
                take = cand[0] < best[0]
                best = tuple(torch.where(take, a, b) for a, b in zip(cand, best))
    return best[1], best[2], best[3]


def _schedule_torch(counts: torch.Tensor, starts: torch.Tensor, nb: int,
                    block_m: int) -> TileSchedule:  # fmt: skip
    """The tile schedule of ``block_m`` rows a block (``nb`` entries) over each expert's
    ``counts`` rows from its first sorted row ``starts`` (int64 [E] each; the kernel's
    ``_schedule``)."""
    num_experts = counts.numel()
    blocks_e = (counts + block_m - 1) // block_m
    cum = torch.cumsum(blocks_e, 0)
    b = torch.arange(nb, device=counts.device)
    e_of_b = torch.searchsorted(cum, b, right=True)  # E where b is past the last block
    valid = e_of_b < num_experts
    e_c = e_of_b.clamp(max=num_experts - 1)
    local = b - (cum - blocks_e)[e_c]
    start = starts[e_c] + local * block_m
    end = torch.minimum(start + block_m, starts[e_c] + counts[e_c])
    i32 = torch.int32
    return TileSchedule(
        block_expert=torch.where(valid, e_of_b, -1).to(i32),
        block_start=torch.where(valid, start, 0).to(i32),
        block_end=torch.where(valid, end, 0).to(i32),
        valid_blocks=cum[-1:].to(i32),
        block_m=block_m,
    )


def _sort_routes_torch(topk_ids: torch.Tensor, num_experts: int, block_m: int,
                       mixed: bool) -> RouteSort:  # fmt: skip
    dev = topk_ids.device
    flat = topk_ids.reshape(-1).long()
    n = flat.numel()
    key = torch.where(flat < 0, torch.full_like(flat, num_experts), flat)
    _, perm = torch.sort(key, stable=True)
    counts = torch.zeros(num_experts + 1, dtype=torch.int64, device=dev)
    counts.scatter_add_(0, key, torch.ones_like(key))
    counts = counts[:num_experts]
    offsets = torch.zeros(num_experts + 1, dtype=torch.int64, device=dev)
    offsets[1:] = torch.cumsum(counts, 0)
    route_pos = torch.empty(n, dtype=torch.int64, device=dev)
    route_pos[perm] = torch.arange(n, device=dev)

    sched = _schedule_torch(counts, offsets[:-1], max_blocks(n, num_experts, block_m), block_m)
    i32 = torch.int32
    sorted_key = key[perm]
    mix = None
    if mixed:
        big, mid, small = _mixed_split_torch(counts)
        starts = (offsets[:-1], offsets[:-1] + big, offsets[:-1] + big)
        mix = []
        for rows, c, st in zip(MIXED_ROWS, (big, mid, small), starts):
            mix.append(_schedule_torch(c, st, max_blocks(n, num_experts, rows), rows))
        mix = tuple(mix)
    return RouteSort(
        sorted_routes=perm.to(i32),
        route_pos=route_pos.to(i32),
        expert_counts=counts.to(i32),
        expert_offsets=offsets.to(i32),
        sorted_expert=torch.where(sorted_key < num_experts, sorted_key, 0).to(i32),
        mixed=mix,
        **vars(sched),
    )


@triton.jit
def _take(table, idx, SIZE: tl.constexpr, SELECT: tl.constexpr):
    """table[idx] for a register vector ``table`` [SIZE] and indices idx [M]: by selects
    and a sum where [M, SIZE] is small (no shared-memory round trip), else ``tl.gather``."""
    if SELECT:
        cols = tl.arange(0, SIZE)
        return tl.sum(tl.where(cols[None, :] == idx[:, None], table[None, :], 0), axis=1)
    else:
        return tl.gather(table, idx, 0)


@triton.jit
def sort_counts_kernel(
    ids_ptr,  # int32 [N]
    piece_counts_ptr,  # int32 [cdiv(N, PIECE), EP]
    N,
    E: tl.constexpr,
    EP: tl.constexpr,
    PIECE: tl.constexpr,
):
    """Program p writes the histogram of routes [p*PIECE, (p+1)*PIECE) by expert (bin E:
    the masked routes): the first of the two-pass sort's launches."""
    pid = tl.program_id(0)
    r = pid * PIECE + tl.arange(0, PIECE)
    ids = tl.load(ids_ptr + r, mask=r < N, other=-1)
    key = tl.where(ids < 0, E, ids)
    tl.store(piece_counts_ptr + pid * EP + tl.arange(0, EP), tl.histogram(key, EP, mask=r < N))


@triton.jit
def sort_routes_kernel(
    ids_ptr,  # int32 [N]
    sorted_routes_ptr,
    route_pos_ptr,
    sorted_expert_ptr,  # int32 [N]
    counts_ptr,  # int32 [E]
    offsets_ptr,  # int32 [E + 1]
    block_expert_ptr,
    block_start_ptr,
    block_end_ptr,  # int32 [NB]
    valid_blocks_ptr,  # int32 [1]
    zero_ptr,  # int32 [NZ]: set to 0
    piece_counts_ptr,  # int32 [PIECES, EP]: each step's histogram (TWO_PASS)
    mix_ptr,  # int32 [3, 3, NBM]: the mixed schedules' expert, start, end (MIXED)
    mix_valid_ptr,  # int32 [3]
    N,
    NB,
    NBM,
    NZ,
    ZPER,  # elements of zero_ptr each program clears
    E: tl.constexpr,
    EP: tl.constexpr,  # power of two > E (bin E collects masked routes)
    BM: tl.constexpr,
    CHUNK: tl.constexpr,
    PIECE: tl.constexpr,  # routes histogrammed at a time
    PIECES: tl.constexpr,  # cdiv(N, PIECE)
    ZB: tl.constexpr,  # power of two >= ZPER
    TWO_PASS: tl.constexpr,  # the steps' histograms in piece_counts_ptr already
    MIXED: tl.constexpr,  # also each expert's rows in blocks of R0, then R1 or R2
    R0: tl.constexpr,  # MIXED_ROWS
    R1: tl.constexpr,
    R2: tl.constexpr,
    C0: tl.constexpr,  # MIXED_COST
    C1: tl.constexpr,
    C2: tl.constexpr,
    RELEASE: tl.constexpr,  # the next kernel (PDL) may start at once: it waits for the end
):
    """Program p places routes [p*CHUNK, (p+1)*CHUNK) and writes blocks [p*CHUNK, ...)
    (of each schedule).

    Every program histograms all N keys, and apart the keys before its chunk: itself, so
    the programs never wait on each other, or (TWO_PASS) from the steps' histograms plus
    the keys of its own step before its chunk. Program 0 also writes the counts and
    offsets.
    A route's place: its expert's offset, plus the routes of that expert before the chunk,
    plus those before it within the chunk."""
    pid = tl.program_id(0)
    if RELEASE:
        tl.extra.cuda.gdc_launch_dependents()
    SELECT: tl.constexpr = CHUNK * EP <= 4096
    zr = tl.arange(0, ZB)  # this program's share of zero_ptr
    zmask = (zr < ZPER) & (pid * ZPER + zr < NZ)
    tl.store(zero_ptr + pid * ZPER + zr, tl.zeros_like(zr), mask=zmask)
    first = pid * CHUNK
    ecols = tl.arange(0, EP)
    counts = tl.zeros([EP], dtype=tl.int32)
    before = tl.zeros([EP], dtype=tl.int32)
    if TWO_PASS:
        step = first // PIECE
        for i in range(PIECES):
            row = tl.load(piece_counts_ptr + i * EP + ecols)
            counts += row
            before += tl.where(i < step, row, 0)
        r = step * PIECE + tl.arange(0, PIECE)
        ids = tl.load(ids_ptr + r, mask=(r < N) & (r < first), other=-1)
        key = tl.where(ids < 0, E, ids)
        before += tl.histogram(key, EP, mask=(r < N) & (r < first))
    else:
        for i in range(PIECES):
            r = i * PIECE + tl.arange(0, PIECE)
            ids = tl.load(ids_ptr + r, mask=r < N, other=-1)
            key = tl.where(ids < 0, E, ids)
            counts += tl.histogram(key, EP, mask=r < N)
            before += tl.histogram(key, EP, mask=(r < N) & (r < first))
    offs = tl.cumsum(counts, 0) - counts  # exclusive prefix sum
    tl.store(counts_ptr + ecols, counts, mask=(ecols < E) & (pid == 0))
    tl.store(offsets_ptr + ecols, offs, mask=(ecols <= E) & (pid == 0))

    # Stable rank of each route among the routes of its expert.
    cc = tl.arange(0, CHUNK)
    rc = first + cc
    live = rc < N
    idc = tl.load(ids_ptr + rc, mask=live, other=-1)
    kc = tl.where(idc < 0, E, idc)
    earlier = (kc[None, :] == kc[:, None]) & (cc[None, :] < cc[:, None])
    pos = _take(offs + before, kc, EP, SELECT) + tl.sum(earlier.to(tl.int32), axis=1)
    tl.store(sorted_routes_ptr + pos, rc, mask=live)
    tl.store(route_pos_ptr + rc, pos, mask=live)
    tl.store(sorted_expert_ptr + pos, tl.where(kc < E, kc, 0), mask=live)

    _schedule(counts, offs, first, pid, block_expert_ptr, block_start_ptr, block_end_ptr,
              valid_blocks_ptr, NB, E, EP, BM, CHUNK, SELECT)  # fmt: skip
    if MIXED:
        big, mid, small = _mixed_split(counts, R0, R1, R2, C0, C1, C2)
        _schedule(big, offs, first, pid, mix_ptr, mix_ptr + NBM, mix_ptr + 2 * NBM,
                  mix_valid_ptr, NBM, E, EP, R0, CHUNK, SELECT)  # fmt: skip
        _schedule(mid, offs + big, first, pid, mix_ptr + 3 * NBM, mix_ptr + 4 * NBM,
                  mix_ptr + 5 * NBM, mix_valid_ptr + 1, NBM, E, EP, R1, CHUNK, SELECT)  # fmt: skip
        _schedule(small, offs + big, first, pid, mix_ptr + 6 * NBM, mix_ptr + 7 * NBM,
                  mix_ptr + 8 * NBM, mix_valid_ptr + 2, NBM, E, EP, R2, CHUNK, SELECT)  # fmt: skip


@triton.jit
def _mixed_split(counts, R0: tl.constexpr, R1: tl.constexpr, R2: tl.constexpr,
                 C0: tl.constexpr, C1: tl.constexpr, C2: tl.constexpr):  # fmt: skip
    """Each expert's rows in blocks of R0 (first), then the rest in blocks of R1 or of
    R2: (rows in each), the least summed block cost (``_mixed_split_torch``'s twin)."""
    best_cost = tl.full(counts.shape, 3.0e38, tl.float32)
    big = tl.zeros_like(counts)
    mid = tl.zeros_like(counts)
    small = tl.zeros_like(counts)
    for opt in tl.static_range(3):
        if opt == 0:
            q = tl.zeros_like(counts)
        elif opt == 1:
            q = counts // R0
        else:
            q = counts // R0 + 1
        b = tl.minimum(counts, q * R0)
        rem = counts - b
        for m in tl.static_range(2):
            if m == 0:
                cost = q.to(tl.float32) * C0 + ((rem + R1 - 1) // R1).to(tl.float32) * C1
            else:
                cost = q.to(tl.float32) * C0 + ((rem + R2 - 1) // R2).to(tl.float32) * C2
            take = cost < best_cost
            best_cost = tl.where(take, cost, best_cost)
            big = tl.where(take, b, big)
            mid = tl.where(take, rem if m == 0 else 0, mid)
            small = tl.where(take, rem if m == 1 else 0, small)
    return big, mid, small


@triton.jit
def _schedule(counts, offs, first, pid, block_expert_ptr, block_start_ptr, block_end_ptr,
              valid_blocks_ptr, NB, E: tl.constexpr, EP: tl.constexpr, BM: tl.constexpr,
              CHUNK: tl.constexpr, SELECT: tl.constexpr):  # fmt: skip
    """Tile-schedule entries [first, first + CHUNK) of BM rows a block: expert e owns
    cdiv(count_e, BM) consecutive blocks; block b's expert is the number of experts whose
    blocks all end at or before b. Program 0 writes the valid blocks' count."""
    ecols = tl.arange(0, EP)
    cc = tl.arange(0, CHUNK)
    nblk = tl.where(ecols < E, (counts + BM - 1) // BM, 0)
    bcum = tl.cumsum(nblk, 0)  # inclusive
    if pid == 0:
        tl.store(valid_blocks_ptr, tl.sum(nblk, 0))
    rel = bcum - first  # block ends relative to this program's first block
    ends = tl.histogram(rel, CHUNK, mask=(ecols < E) & (rel >= 0) & (rel < CHUNK))
    e_of_b = tl.sum(((rel < 0) & (ecols < E)).to(tl.int32), 0) + tl.cumsum(ends, 0)
    b = first + cc
    valid = e_of_b < E
    start = _take(offs, e_of_b, EP, SELECT) + (b - _take(bcum - nblk, e_of_b, EP, SELECT)) * BM
    stop = _take(offs + counts, e_of_b, EP, SELECT)
    m = b < NB
    tl.store(block_expert_ptr + b, tl.where(valid, e_of_b, -1), mask=m)
    tl.store(block_start_ptr + b, tl.where(valid, start, 0), mask=m)
    tl.store(block_end_ptr + b, tl.where(valid, tl.minimum(start + BM, stop), 0), mask=m)


def _sort_routes_triton(
    topk_ids: torch.Tensor,
    num_experts: int,
    block_m: int,
    zero: torch.Tensor | None,
    mixed: bool,
    release: bool,
) -> RouteSort:
    dev = topk_ids.device
    n = topk_ids.numel()
    nb = max_blocks(n, num_experts, block_m)
    i32 = torch.int32
    out = {
        name: torch.empty(size, dtype=i32, device=dev)
        for name, size in (
            ("sorted_routes", n), ("route_pos", n), ("sorted_expert", n),
            ("expert_counts", num_experts), ("expert_offsets", num_experts + 1),
            ("block_expert", nb), ("block_start", nb), ("block_end", nb),
            ("valid_blocks", 1),
        )
    }  # fmt: skip
    chunk = _chunk(n)
    piece, warps = _piece(n, chunk)
    pieces = triton.cdiv(n, piece)
    ep = triton.next_power_of_2(num_experts + 1)
    ids = topk_ids.contiguous()
    two_pass = n > ONE_PASS_MAX_ROUTES
    piece_counts = out["block_end"]  # never read in one pass
    if two_pass:
        piece_counts = torch.empty(pieces, ep, dtype=i32, device=dev)
        sort_counts_kernel[(pieces,)](ids, piece_counts, n, E=num_experts, EP=ep, PIECE=piece,
                                      num_warps=warps)  # fmt: skip
    nbm = max_blocks(n, num_experts, MIXED_ROWS[-1]) if mixed else 0
    mix, mix_valid = out["block_end"], out["block_end"]  # never written without mixed
    if mixed:
        mix = torch.empty(9 * nbm, dtype=i32, device=dev)
        mix_valid = torch.empty(3, dtype=i32, device=dev)
    grid = triton.cdiv(max(n, nb, nbm), chunk)
    nz = 0 if zero is None else zero.numel()
    zper = triton.cdiv(nz, grid)
    sort_routes_kernel[(grid,)](
        ids, out["sorted_routes"], out["route_pos"], out["sorted_expert"],
        out["expert_counts"], out["expert_offsets"],
        out["block_expert"], out["block_start"], out["block_end"], out["valid_blocks"],
        zero if zero is not None else out["block_end"], piece_counts, mix, mix_valid, n, nb,
        nbm, nz, zper,
        E=num_experts, EP=ep, BM=block_m, CHUNK=chunk, PIECE=piece, PIECES=pieces,
        ZB=triton.next_power_of_2(max(zper, 1)), TWO_PASS=two_pass, MIXED=mixed,
        R0=MIXED_ROWS[0], R1=MIXED_ROWS[1], R2=MIXED_ROWS[2], C0=MIXED_COST[0],
        C1=MIXED_COST[1], C2=MIXED_COST[2], RELEASE=release and not interpreting(),
        num_warps=warps,
    )  # fmt: skip
    mixed_s = None
    if mixed:
        v = mix.view(3, 3, nbm)
        mixed_s = tuple(TileSchedule(v[i, 0], v[i, 1], v[i, 2], mix_valid[i:i + 1], rows)
                        for i, rows in enumerate(MIXED_ROWS))  # fmt: skip
    return RouteSort(block_m=block_m, mixed=mixed_s, **out)


def sort_routes_reference(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> dict:
    """Plain-Python twin: per expert, its routes in ascending flat order, and its tiles."""
    flat = topk_ids.reshape(-1).tolist()
    rows = {e: [r for r, i in enumerate(flat) if i == e] for e in range(num_experts)}
    tiles = []
    pos = 0
    for e in range(num_experts):
        for s in range(0, len(rows[e]), block_m):
            tiles.append((e, pos + s, pos + min(s + block_m, len(rows[e]))))
        pos += len(rows[e])
    return {"rows": rows, "tiles": tiles, "n_valid": pos}
