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

Built from sort, scatter-add and cumsum (no ``nonzero``/``bincount``/``.item()``), so the
whole step is capturable in a CUDA graph. An expert with no rows gets no block.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["RouteSort", "max_blocks", "sort_routes", "sort_routes_reference"]


@dataclass(frozen=True)
class RouteSort:
    sorted_routes: torch.Tensor
    route_pos: torch.Tensor
    expert_counts: torch.Tensor
    expert_offsets: torch.Tensor
    block_expert: torch.Tensor
    block_start: torch.Tensor
    block_end: torch.Tensor
    block_m: int

    @property
    def num_blocks(self) -> int:
        return self.block_expert.numel()


def max_blocks(num_routes: int, num_experts: int, block_m: int) -> int:
    return -(-num_routes // block_m) + min(num_experts, num_routes)


def sort_routes(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> RouteSort:
    """Sort routes by expert and build the tile schedule (see module docstring).

    Args:
        topk_ids: int32 [T, K], ids in [-inf, E); ids >= E are the caller's to reject.
        num_experts: E. block_m: rows per GEMM tile.
    """
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

    nb = max_blocks(n, num_experts, block_m)
    blocks_e = (counts + block_m - 1) // block_m
    cum = torch.cumsum(blocks_e, 0)
    b = torch.arange(nb, device=dev)
    e_of_b = torch.searchsorted(cum, b, right=True)  # E where b is past the last block
    valid = e_of_b < num_experts
    e_c = e_of_b.clamp(max=num_experts - 1)
    local = b - (cum - blocks_e)[e_c]
    start = offsets[e_c] + local * block_m
    end = torch.minimum(start + block_m, offsets[e_c + 1])
    i32 = torch.int32
    return RouteSort(
        sorted_routes=perm.to(i32),
        route_pos=route_pos.to(i32),
        expert_counts=counts.to(i32),
        expert_offsets=offsets.to(i32),
        block_expert=torch.where(valid, e_of_b, -1).to(i32),
        block_start=torch.where(valid, start, 0).to(i32),
        block_end=torch.where(valid, end, 0).to(i32),
        block_m=block_m,
    )


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
