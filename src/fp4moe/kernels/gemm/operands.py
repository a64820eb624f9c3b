"""GEMM operands prepared once a call: NVFP4 rows decoded to the very operand values the
GEMM main loops decode in registers, or bf16 rows put in the loop's K order, so that a
kernel can load them instead of decoding or permuting them and give the same bits.

Used by the decoded-weights path (``portable_gemm(dense=True)``: the weights and the
activation rows), by the Gluon kernels' W4A4 rows (decoded once, not per program) and by
the prefill kernel's rows (gathered into sorted order).

Values: e2m1 code times its e4m3 block scale times 2^-8 (``decode``), exact in bf16. Weight
codes come in the fields layout of the prepared experts (``fields``), activation codes
linear. Order (``order``, as the GEMM's ``ORDER``): 64, the unit order, or 32, the chunk
order (``decode``). ``dense_weights_reference`` is the reference twin in plain PyTorch.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ...nvfp4 import dequantize_blocks
from ..common import empty, interpreting, order_rows
from .decode import decode_permuted
from .fields import from_fields

__all__ = [
    "chunk_order",
    "decode_tile",
    "dense_rows",
    "dense_rows_kernel",
    "dense_weights",
    "dense_weights_reference",
]


def decode_tile(k: int, interpret: bool = False) -> tuple[int, int, int]:
    """(rows, K elements, warps) a program of the decode kernels for rows of K elements:
    the widest K tile up to 512 that divides K, 8192 elements a program (at most 64 rows).
    Any tile gives the same values (each element is decoded on its own). Measured on the
    H200 (benchmarks/sweep_prep.py, DeepSeek-V3 w13, 0.94e9 weights): (64, 128) 896 us,
    (32, 256) 745 us, (16, 512) 680 us, 3.5 TB/s of bytes read and written."""
    widest = 128 if interpret else 512
    bk = 32
    while bk < widest and k % (bk * 2) == 0:
        bk *= 2
    return (16 if interpret else min(64, 8192 // bk)), bk, 4


def dense_weights(
    codes: torch.Tensor,
    scales: torch.Tensor,
    *,
    order: int = 32,
    out: torch.Tensor | None = None,
):
    """The decoded GEMM operand of NVFP4 weight rows (see the module docstring):
    ``dense_rows`` over any leading dimensions.

    Args:
        codes: uint8 [..., K/2], e2m1 codes in the fields layout (``fields.to_fields``).
        scales: float8_e4m3fn [..., K/16]. K a multiple of 32.
        order: the K order, 32 or 64 (K a multiple of it), as the GEMM's ``ORDER``.
        out: [..., K] of the returned dtype to write into (contiguous), or None.

    Returns:
        [..., K] bf16 on a GPU, fp32 in the interpreter (the GEMM's operand dtype).
    """
    if codes.dtype != torch.uint8:
        raise TypeError(f"codes: expected torch.uint8, got {codes.dtype}")
    if scales.dtype != torch.float8_e4m3fn:
        raise TypeError(f"scales: expected torch.float8_e4m3fn, got {scales.dtype}")
    k = codes.shape[-1] * 2
    if k % 32 or tuple(scales.shape) != (*codes.shape[:-1], k // 16):
        raise ValueError(
            f"scales: expected {[*codes.shape[:-1], k // 16]} for codes {list(codes.shape)} "
            f"(K = {k}, a multiple of 32), got {list(scales.shape)}"
        )
    if out is not None:
        if tuple(out.shape) != (*codes.shape[:-1], k) or not out.is_contiguous():
            raise ValueError(f"out: expected a contiguous {[*codes.shape[:-1], k]}, got "
                             f"{list(out.shape)}")  # fmt: skip
        out = out.view(-1, k)
    rows = dense_rows(codes.reshape(-1, k // 2), scales.reshape(-1, k // 16), order=order,
                      out=out, fields=True)  # fmt: skip
    return rows.reshape(*codes.shape[:-1], k)


def chunk_order(x: torch.Tensor, dtype: torch.dtype, order: int = 32) -> torch.Tensor:
    """[..., K] -> [..., K] of ``dtype`` in the K order the GEMM loops multiply in; values
    unchanged. ``order`` 32: each chunk of 32 elements as its 16 even, then its 16 odd
    elements; 64: in each unit of 64, position 16 s + 8 b + 2 q + a holds element
    16 q + 4 s + 2 a + b (``gemm.decode_permuted``)."""
    k = x.shape[-1]
    lead = x.shape[:-1]
    if order == 64:
        n = len(lead)
        v = x.reshape(*lead, k // 64, 4, 4, 2, 2)  # [..., u, q, s, a, b]
        v = v.permute(*range(n + 1), n + 2, n + 4, n + 1, n + 3)  # [..., u, s, b, q, a]
    else:
        v = x.reshape(*lead, k // 32, 16, 2).transpose(-1, -2)
    return v.reshape(*lead, k).to(dtype)


def dense_weights_reference(
    codes: torch.Tensor, scales: torch.Tensor, order: int = 32
) -> torch.Tensor:
    """fp32 [..., K]: ``dense_weights`` in plain PyTorch (value * 2^-8, K in ``order``;
    ``codes`` in the fields layout)."""
    v = dequantize_blocks(from_fields(codes), scales)
    return chunk_order(v * 2.0**-8, torch.float32, order)


@triton.jit
def dense_rows_kernel(
    src_ptr,  # uint8 [R, K/2] (FP4; FIELDS: the fields layout) or bf16 [R, K]
    scales_ptr,  # float8_e4m3fn [R, K/16] (FP4), rows S_ROW bytes apart
    count_ptr,  # int32 [1]: rows past it are left unwritten (HAS_COUNT)
    out_ptr,  # DOT_DTYPE [R, K], chunk order
    index_ptr,  # int32 [R]: output row r is source row index[r] // DIV (GATHER)
    R,
    K: tl.constexpr,
    BR: tl.constexpr,
    BK: tl.constexpr,
    FP4: tl.constexpr,
    HAS_COUNT: tl.constexpr,
    DECODE_ASM: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    S_ROW: tl.constexpr,  # bytes between scale rows (FP4)
    ORDER: tl.constexpr = 32,
    GATHER: tl.constexpr = False,
    DIV: tl.constexpr = 1,
    FIELDS: tl.constexpr = False,
):
    rows = tl.program_id(0) * BR + tl.arange(0, BR)
    rmask = rows < R
    if HAS_COUNT:  # a block past the count loads and stores nothing
        rmask = rmask & (rows < tl.load(count_ptr))
    o64 = rows.to(tl.int64)
    if GATHER:
        r64 = (tl.load(index_ptr + rows, mask=rmask, other=0) // DIV).to(tl.int64)
    else:
        r64 = o64
    kb = tl.program_id(1)
    kk = kb * BK + tl.arange(0, BK)
    if FP4:
        cs = kb * (BK // 16) + tl.arange(0, BK // 16)
        if FIELDS:  # code words, each decoded on its own
            cq = kb * (BK // 8) + tl.arange(0, BK // 8)
            words = src_ptr.to(tl.pointer_type(tl.int32), bitcast=True)
            codes = tl.load(words + r64[:, None] * (K // 8) + cq[None, :], mask=rmask[:, None],
                            other=0)  # fmt: skip
        else:
            cq = kb * (BK // 2) + tl.arange(0, BK // 2)
            codes = tl.load(src_ptr + r64[:, None] * (K // 2) + cq[None, :],
                            mask=rmask[:, None], other=0)  # fmt: skip
        scales = tl.load(
            scales_ptr + r64[:, None] * S_ROW + cs[None, :], mask=rmask[:, None], other=0.0
        )
        v = decode_permuted(codes, scales, BR, BK, DECODE_ASM, DOT_DTYPE, ORDER, FIELDS)
    else:  # bf16 values, only reordered: the GEMM's register permutation, done once
        x = tl.load(src_ptr + r64[:, None] * K + kk[None, :], mask=rmask[:, None], other=0.0)
        v = order_rows(x.to(DOT_DTYPE), BR, BK, ORDER)
    tl.store(out_ptr + o64[:, None] * K + kk[None, :], v, mask=rmask[:, None])


def dense_rows(
    src: torch.Tensor,
    scales: torch.Tensor | None = None,
    *,
    count: torch.Tensor | None = None,
    poison: bool = False,
    order: int = 32,
    index: torch.Tensor | None = None,
    div: int = 1,
    out: torch.Tensor | None = None,
    fields: bool = False,
) -> torch.Tensor:
    """Activation rows as the dense GEMM loads them: NVFP4 rows decoded like
    ``dense_weights``, or bf16 rows put in chunk order (``chunk_order``), values unchanged.

    Args:
        src: uint8 [R, K/2] NVFP4 codes (with ``scales`` float8_e4m3fn [R, K/16], rows any
            number of bytes apart) or bf16 [R, K]. K a multiple of 32.
        count: int32 device tensor of one element, or None: only the first ``count`` rows
            are written (routes in sorted order: the rest are masked routes, which the GEMM
            never loads); read on the device, so no host synchronization.
        poison: fill the unwritten rows with NaN (tests).
        order: the K order, 32 or 64 (K a multiple of it), as the GEMM's ``ORDER``.
        index: int32 [R'], or None: output row r is source row ``index[r] // div`` (e.g.
            the sorted routes and top-k: each route's token row in sorted order); R'
            rows out, ``count`` applying to them.
        div: the divisor of ``index`` (>= 1).
        out: the [R, K] (R' with ``index``) result tensor to write into (contiguous, on
            ``src``'s device, of the returned dtype), or None: a new one.
        fields: the codes are weights in the fields layout (``fields``), not linear.

    Returns:
        [R, K] (R' with ``index``) bf16 on a GPU, fp32 in the interpreter.
    """
    fp4 = scales is not None
    if fp4 and src.dtype != torch.uint8:
        raise TypeError(f"src: expected torch.uint8 codes with scales, got {src.dtype}")
    if not fp4 and src.dtype != torch.bfloat16:
        raise TypeError(f"src: expected torch.bfloat16 rows without scales, got {src.dtype}")
    if src.dim() != 2:
        raise ValueError(f"src: expected 2 dimensions [R, K], got {list(src.shape)}")
    r = src.shape[0]
    k = src.shape[1] * 2 if fp4 else src.shape[1]
    if order not in (32, 64):
        raise ValueError(f"order: expected 32 or 64, got {order!r}")
    if k % order:
        raise ValueError(f"src: K = {k} is not a multiple of {order} (order)")
    if fp4 and tuple(scales.shape) != (r, k // 16):
        raise ValueError(f"scales: expected {[r, k // 16]}, got {list(scales.shape)}")
    if count is not None and (count.dtype != torch.int32 or count.numel() != 1):
        raise ValueError(
            f"count: expected one int32 element, got {count.dtype} {list(count.shape)}"
        )
    if index is not None:
        if index.dtype != torch.int32 or index.dim() != 1:
            raise ValueError(
                f"index: expected one dimension of int32, got {index.dtype} {list(index.shape)}"
            )
        if isinstance(div, bool) or not isinstance(div, int) or div < 1:
            raise ValueError(f"div: expected an int >= 1, got {div!r}")
        if index.device != src.device:
            raise ValueError(f"index: on {index.device}, src on {src.device}")
        r_out = index.shape[0]
    else:
        r_out = r
    interp = interpreting()
    odt = torch.float32 if interp else torch.bfloat16
    if out is None:
        out = empty((r_out, k), odt, src.device, poison)
    elif (tuple(out.shape) != (r_out, k) or out.dtype != odt or out.device != src.device
          or not out.is_contiguous()):  # fmt: skip
        raise ValueError(f"out: expected a contiguous {odt} [{r_out}, {k}] on {src.device}, "
                         f"got {out.dtype} {list(out.shape)} on {out.device}")  # fmt: skip
    if r_out and r:
        br, bk, warps = decode_tile(k, interp)
        src = src.contiguous()
        if fp4 and scales.stride(1) != 1:
            scales = scales.contiguous()
        dense_rows_kernel[(triton.cdiv(r_out, br), k // bk)](
            src, scales if fp4 else src, count if count is not None else src, out,
            index if index is not None else src, r_out, K=k, BR=br, BK=bk, FP4=fp4,
            HAS_COUNT=count is not None, DECODE_ASM=fp4 and not interp,
            DOT_DTYPE=tl.float32 if interp else tl.bfloat16, ORDER=order,
            GATHER=index is not None, DIV=div, S_ROW=scales.stride(0) if fp4 else 0,
            FIELDS=fp4 and fields, num_warps=warps,
        )  # fmt: skip
    return out
