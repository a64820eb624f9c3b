"""Deterministic finalize (numerics section 6): out[t] = bf16(sum over valid k ascending of
fma(w[t, k], y[t, k], acc)), reading route rows stored in expert-sorted order.

One program covers one token and BLOCK_H columns. Routing metadata (ids, weights, the
rows' positions) are loaded before the wait on the FC2 kernel (programmatic dependent
launch), so they overlap FC2's tail; a masked route's row is never loaded. (Several
tokens a program measured no faster at prefill sizes: the finalize runs at 1.6 TB/s
there, not held by its programs' count.)

``cast_kernel``: the fused finalize's last step, its fp32 [T, H] sums to bf16, as a launch
in the call's programmatic-dependent-launch chain (torch's cast is not).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .common import empty, fma_f32, interpreting, launch, to_bf16

__all__ = ["cast_kernel", "cast_rows", "finalize_block_h", "finalize_kernel", "finalize_rows"]


def finalize_block_h(num_tokens: int, hidden: int) -> tuple[int, int]:
    """(BLOCK_H, num_warps): wide blocks (16-byte loads, 8 bf16 a thread) when there are
    enough tokens to fill the GPU, narrower ones at decode sizes so more programs run."""
    if num_tokens >= 256:
        block, warps = 1024, 4
    elif num_tokens >= 32:
        block, warps = 512, 2
    else:
        block, warps = 256, 1
    while block > 16 and block // 2 >= hidden:
        block //= 2
    return block, warps


@triton.jit
def finalize_kernel(
    y_ptr,  # bf16 [rows, H] route rows, sorted order
    route_pos_ptr,  # int32 [T*TOPK]: position of route t*TOPK+k among the rows
    ids_ptr,  # int32 [T*TOPK]
    w_ptr,  # fp32 [T*TOPK]
    out_ptr,  # bf16 [T, H]
    H,
    T,
    TOPK: tl.constexpr,
    KP: tl.constexpr,  # next power of two >= TOPK
    BLOCK_H: tl.constexpr,
    USE_PDL: tl.constexpr,
    INTERPRET: tl.constexpr,
):
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    cmask = cols < H
    ks = tl.arange(0, KP)
    kmask = ks < TOPK
    # the token's metadata before the wait (under PDL it overlaps FC2's tail)
    t = tl.program_id(0).to(tl.int64)
    tok = t < T
    ids = tl.load(ids_ptr + t * TOPK + ks, mask=kmask & tok, other=-1)
    ws = tl.load(w_ptr + t * TOPK + ks, mask=kmask & tok, other=0.0)
    pos = tl.load(route_pos_ptr + t * TOPK + ks, mask=kmask & tok, other=0).to(tl.int64)
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
    acc = tl.zeros((BLOCK_H,), dtype=tl.float32)
    for k in tl.static_range(TOPK):
        sel = ks == k
        valid = tl.sum(tl.where(sel, ids, 0), axis=0) >= 0
        wk = tl.sum(tl.where(sel, ws, 0.0), axis=0)
        pk = tl.sum(tl.where(sel, pos, 0), axis=0)
        y = tl.load(y_ptr + pk * H + cols, mask=cmask & valid, other=0.0).to(tl.float32)
        acc = tl.where(valid, fma_f32(tl.zeros_like(acc) + wk, y, acc, INTERPRET), acc)
    tl.store(out_ptr + t * H + cols, to_bf16(acc, INTERPRET), mask=cmask & tok)


@triton.jit
def cast_kernel(
    src_ptr,  # fp32 [n]
    out_ptr,  # bf16 [n]
    n,
    BLOCK: tl.constexpr,
    USE_PDL: tl.constexpr,
    INTERPRET: tl.constexpr,
):
    """out = bf16(src), round to nearest even, BLOCK elements a program; under PDL it
    waits for the kernel before it (whose atomics wrote ``src``) before loading."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
    v = tl.load(src_ptr + offs, mask=m, other=0.0)
    tl.store(out_ptr + offs, to_bf16(v, INTERPRET), mask=m)


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
    out = empty(tuple(src.shape), torch.bfloat16, src.device, poison)
    n = src.numel()
    if n == 0:
        return out
    block = 64 if interpreting() else 2048
    launch(cast_kernel, (triton.cdiv(n, block),), pdl, src, out, n, BLOCK=block,
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
    """Deterministic finalize on the device (docs/numerics.md): out[t] = sum over k
    ascending of weights[t, k] * y_rows[route_pos[t * K + k]], fp32 fma, one bf16 rounding;
    masked routes (id < 0) skipped, all-masked tokens 0.

    Args:
        y_rows: bf16 [R, H] route rows (R >= 1).
        route_pos: int32 [T * K] row of each route in ``y_rows``.
        topk_ids: int32 [T, K]; weights: fp32 [T * K] (or [T, K]).

    Returns:
        bf16 [T, H].
    """
    t, k = topk_ids.shape
    h = y_rows.shape[1]
    out = empty((t, h), torch.bfloat16, y_rows.device, poison)
    if t == 0:
        return out
    block_h, warps = finalize_block_h(t, h)
    launch(
        finalize_kernel, (t, triton.cdiv(h, block_h)), pdl,
        y_rows, route_pos, topk_ids, weights.reshape(-1), out, h, t,
        TOPK=k, KP=triton.next_power_of_2(k), BLOCK_H=block_h,
        INTERPRET=interpreting(), num_warps=warps,
    )  # fmt: skip
    return out
