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
- with ``wide``, the same rows also in blocks of ``2 * block_m`` (``RouteSort.wide``): the
  prefill kernel's wide tiles, launched beside the narrow ones, run whichever schedule
  has the fewer tiles by their cost (``gluon_prefill``).

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
- torch ops (stable sort, scatter-add, cumsum, searchsorted; no ``nonzero``, ``bincount``
  or ``.item()``): off CUDA and above the largest batch the kernel was measured at.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .gemm.shapes import max_blocks

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
    wide: TileSchedule | None = None  # the same rows in blocks of 2 * block_m (``wide``)

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
    wide: bool = False,
) -> RouteSort:
    """Sort routes by expert and build the tile schedule (see module docstring).

    Args:
        topk_ids: int32 [T, K], ids in [-inf, E); ids >= E are the caller's to reject.
        num_experts: E. block_m: rows per GEMM tile. wide: also the schedule of
            ``2 * block_m`` rows a block (``RouteSort.wide``).
        use_kernel: the Triton kernel (on CUDA or in the interpreter; needs at least one
            route) or torch ops (any device); the planner chooses (``Plan.sort``).
        zero: int32 [.] set to 0 on the way (the split GEMMs' tile counters, amax slots):
            the sort kernel zeroes it, so a CUDA graph of the call has no memset node
            between kernels (which would stand between programmatic dependent launches).
    """
    if zero is not None and (
        zero.dtype != torch.int32 or zero.device != topk_ids.device or not zero.is_contiguous()
    ):
        raise ValueError(
            f"zero: expected a contiguous torch.int32 tensor on {topk_ids.device}, got "
            f"{zero.dtype} on {zero.device}"
        )
    if use_kernel and topk_ids.numel():
        return _sort_routes_triton(topk_ids, num_experts, block_m, zero, wide)
    if zero is not None:
        zero.zero_()
    return _sort_routes_torch(topk_ids, num_experts, block_m, wide)


def _schedule_torch(counts: torch.Tensor, offsets: torch.Tensor, nb: int,
                    block_m: int) -> TileSchedule:  # fmt: skip
    """The tile schedule of ``block_m`` rows a block (``nb`` entries) from the experts'
    row counts and offsets (int64)."""
    num_experts = counts.numel()
    blocks_e = (counts + block_m - 1) // block_m
    cum = torch.cumsum(blocks_e, 0)
    b = torch.arange(nb, device=counts.device)
    e_of_b = torch.searchsorted(cum, b, right=True)  # E where b is past the last block
    valid = e_of_b < num_experts
    e_c = e_of_b.clamp(max=num_experts - 1)
    local = b - (cum - blocks_e)[e_c]
    start = offsets[e_c] + local * block_m
    end = torch.minimum(start + block_m, offsets[e_c + 1])
    i32 = torch.int32
    return TileSchedule(
        block_expert=torch.where(valid, e_of_b, -1).to(i32),
        block_start=torch.where(valid, start, 0).to(i32),
        block_end=torch.where(valid, end, 0).to(i32),
        valid_blocks=cum[-1:].to(i32),
        block_m=block_m,
    )


def _sort_routes_torch(topk_ids: torch.Tensor, num_experts: int, block_m: int,
                       wide: bool) -> RouteSort:  # fmt: skip
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

    sched = _schedule_torch(counts, offsets, max_blocks(n, num_experts, block_m), block_m)
    w = 2 * block_m
    i32 = torch.int32
    sorted_key = key[perm]
    return RouteSort(
        sorted_routes=perm.to(i32),
        route_pos=route_pos.to(i32),
        expert_counts=counts.to(i32),
        expert_offsets=offsets.to(i32),
        sorted_expert=torch.where(sorted_key < num_experts, sorted_key, 0).to(i32),
        wide=_schedule_torch(counts, offsets, max_blocks(n, num_experts, w), w) if wide else None,
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
    block_expert2_ptr,  # the schedule of BM2 rows a block (BM2 > 0)
    block_start2_ptr,
    block_end2_ptr,  # int32 [NB2]
    valid_blocks2_ptr,  # int32 [1]
    zero_ptr,  # int32 [NZ]: set to 0
    piece_counts_ptr,  # int32 [PIECES, EP]: each step's histogram (TWO_PASS)
    N,
    NB,
    NB2,
    NZ,
    ZPER,  # elements of zero_ptr each program clears
    E: tl.constexpr,
    EP: tl.constexpr,  # power of two > E (bin E collects masked routes)
    BM: tl.constexpr,
    BM2: tl.constexpr,  # a second schedule's rows a block (0: none)
    CHUNK: tl.constexpr,
    PIECE: tl.constexpr,  # routes histogrammed at a time
    PIECES: tl.constexpr,  # cdiv(N, PIECE)
    ZB: tl.constexpr,  # power of two >= ZPER
    TWO_PASS: tl.constexpr,  # the steps' histograms in piece_counts_ptr already
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
    if BM2 > 0:
        _schedule(counts, offs, first, pid, block_expert2_ptr, block_start2_ptr,
                  block_end2_ptr, valid_blocks2_ptr, NB2, E, EP, BM2, CHUNK, SELECT)  # fmt: skip


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
    zero: torch.Tensor | None = None,
    wide: bool = False,
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
    bm2 = 2 * block_m if wide else 0
    nb2 = max_blocks(n, num_experts, bm2) if wide else 0
    w = [out["block_end"]] * 4  # the wide schedule's outputs: never written with BM2 0
    if wide:
        w = [torch.empty(size, dtype=i32, device=dev) for size in (nb2, nb2, nb2, 1)]
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
    grid = triton.cdiv(max(n, nb), chunk)
    nz = 0 if zero is None else zero.numel()
    zper = triton.cdiv(nz, grid)
    sort_routes_kernel[(grid,)](
        ids, out["sorted_routes"], out["route_pos"], out["sorted_expert"],
        out["expert_counts"], out["expert_offsets"],
        out["block_expert"], out["block_start"], out["block_end"], out["valid_blocks"], *w,
        zero if zero is not None else out["block_end"], piece_counts, n, nb, nb2, nz, zper,
        E=num_experts, EP=ep, BM=block_m, BM2=bm2, CHUNK=chunk, PIECE=piece, PIECES=pieces,
        ZB=triton.next_power_of_2(max(zper, 1)), TWO_PASS=two_pass, num_warps=warps,
    )  # fmt: skip
    return RouteSort(block_m=block_m, wide=TileSchedule(*w, bm2) if wide else None, **out)


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
