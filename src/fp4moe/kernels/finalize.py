"""Deterministic finalize (SPEC section 6): out[t] = bf16(sum over valid k ascending of
fma(w[t, k], y[t, k], acc)), reading route rows stored in expert-sorted order.

One program covers one token and BLOCK_H columns. Routing metadata (ids, weights, the
rows' positions) are loaded before the wait on the FC2 kernel (programmatic dependent
launch), so they overlap FC2's tail; a masked route's row is never loaded.

``cast_kernel``: the fused finalize's last step, its fp32 [T, H] sums to bf16, as a launch
in the call's programmatic-dependent-launch chain (torch's cast is not).
"""

from __future__ import annotations

import triton
import triton.language as tl

from .common import fma_f32, to_bf16

__all__ = ["cast_kernel", "finalize_block_h", "finalize_kernel", "finalize_tokens_per_program"]


# Tokens a program of ``finalize_kernel`` from TOKENS_FROM tokens on (1 below): fewer,
# longer programs at prefill, each with the loads of several tokens in flight. The bits
# do not depend on it (each element's fma chain is the same). Measured (session 17,
# ``benchmarks/finalize_tpp.py``, DeepSeek-V3 EP8 routes): 1 / 2 / 4 / 8 tokens a program
# 147.5 / 148.6 / 150.1 / 166.7 us at 8192 tokens, 288.5 / 289.9 / 290.4 / 318.8 at
# 16384: the programs' count is not what holds the finalize (1.6 TB/s), so 1.
TOKENS_PER_PROGRAM = 1
TOKENS_FROM = 2048


def finalize_tokens_per_program(num_tokens: int) -> int:
    """Tokens a program of ``finalize_kernel`` (``TOKENS_PER_PROGRAM`` from
    ``TOKENS_FROM`` tokens on, else 1)."""
    return TOKENS_PER_PROGRAM if num_tokens >= TOKENS_FROM else 1


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
    TPP: tl.constexpr = 1,  # tokens a program (``finalize_tokens_per_program``)
):
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    cmask = cols < H
    ks = tl.arange(0, KP)
    kmask = ks < TOPK
    # the first token's metadata before the wait (under PDL it overlaps FC2's tail)
    t0 = tl.program_id(0).to(tl.int64) * TPP
    m0 = kmask & (t0 < T)
    ids0 = tl.load(ids_ptr + t0 * TOPK + ks, mask=m0, other=-1)
    ws0 = tl.load(w_ptr + t0 * TOPK + ks, mask=m0, other=0.0)
    pos0 = tl.load(route_pos_ptr + t0 * TOPK + ks, mask=m0, other=0).to(tl.int64)
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
    for i in tl.static_range(TPP):
        t = t0 + i
        tok = t < T
        if i == 0:
            ids, ws, pos = ids0, ws0, pos0
        else:
            ids = tl.load(ids_ptr + t * TOPK + ks, mask=kmask & tok, other=-1)
            ws = tl.load(w_ptr + t * TOPK + ks, mask=kmask & tok, other=0.0)
            pos = tl.load(route_pos_ptr + t * TOPK + ks, mask=kmask & tok, other=0).to(tl.int64)
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
