"""Grouped NVFP4 GEMMs for the MoE: FC1 (gather + SwiGLU epilogue) and FC2 (route rows or
fused finalize), one Triton kernel with constexpr switches.

Orientation: every tile computes acc[BN, BM] = W[BN, BK] @ X^T[BK, BM] ("swap A and B"):
the weight tile, decoded in registers, is the MMA's register-side operand, and tokens
are the narrow dimension, so decode sizes (a handful of rows per expert) still fill a
tile of 64+ weight rows. The same orientation serves prefill with BM = 128.

Main loops (``CHUNKED``; docs/numerics.md says how each accumulates):

- 3 (default): K in fixed segments summed in segment order; at small sizes one program a
  segment (``SPLIT``) and the last program of a tile sums the fp32 partials, with the
  same bits as the in-register sums. Within a segment K is in the unit order (``ORDER``
  64, ``launch.k_order``: what one thread's decode of 8 consecutive code bytes leaves in
  the wgmma register fragment), or the chunk order below where 64 does not divide K.
- 2: the chunk order, for every 32 elements the 16 even (low-nibble) ones, then the 16
  odd ones, one dot a K tile (``decode_permuted``), in one chain over K.
- 1: the order of 2 as two K=16 dots a chunk (slow; kept for comparison, same bits as 2).
- 0: the first loop: natural K order, the decode through fp16 bit placement
  (e2m1 * 2^-14, times the scale in fp16: exact), W4A4 in fp16; other bits.

The inline-PTX decode (``_CHUNK_DECODE_ASM``) turns two nibbles into two bf16 values with
three instructions and one fma by the block scale; decoded values carry a factor 2^-8
that the epilogue undoes. A loop's order is the same for every config (batch invariance).
"""

from __future__ import annotations

from dataclasses import dataclass

import triton
import triton.language as tl

from .common import nibble_to_f16 as _nibble_to_f16
from .common import order_rows, to_bf16, to_e4m3
from .quantize import encode_e2m1

__all__ = ["GemmConfig", "choose_gemm_config"]


@dataclass(frozen=True)
class GemmConfig:
    """Launch choice for one grouped GEMM (tests can pin one)."""

    block_m: int
    block_n: int
    block_k: int
    num_warps: int = 4
    num_stages: int = 3
    prefetch: bool = False  # load the next K tile's weight bytes before decoding this one
    # Cap on registers a thread (ptxas): more programs resident an SM. The same bits (the
    # arithmetic does not change). None: the compiler's choice.
    maxnreg: int | None = None


def _largest_pow2_dividing(k: int, cap: int) -> int:
    b = cap
    while k % b:
        b //= 2
    return b


def choose_gemm_config(
    rows_per_expert: float,
    n: int,
    k: int,
    *,
    gated: bool,
    interpret: bool = False,
    a_fp4: bool = False,
    loop: int = 3,
    valid_rows: float | None = None,
) -> GemmConfig:
    """Tile shapes from the average rows an expert receives (no autotuning).

    Small row counts: 16 token columns and narrow weight tiles, so weight rows are split
    over many programs (bytes in flight on every SM). Large: 64 to 128 token columns.
    ``loop`` is the main loop (``TritonOptions.chunked``) the config is for.
    ``rows_per_expert`` counts every route of the call; ``valid_rows`` (loop 3) is the
    expected valid (unmasked) routes an expert, None when not known.
    """
    if interpret:
        return GemmConfig(16, 32, _largest_pow2_dividing(k, 64), num_warps=4, num_stages=1)
    if loop == 3:
        # Measured on the H200 with the segmented loop after its pipelining fix
        # (docs/perf-notes.md, benchmarks/sweep_decode.py --variants c3configs, DeepSeek-V3
        # EP8, W4A16): 1 / 16 / 64 tokens split K (16, 64, 128, 3 stages) 71 / 96 / 385 us;
        # 256 tokens (same, not split) 589 us; 1024 and 4096 tokens (64, 128, 64, 3 stages)
        # 1043 and 2269 us; 8192 tokens 4138 us (W4A16) and, for W4A4, (128, 64, 64)
        # 3995 us against 4404 us.
        # In the unit order (session 7, `sweep_decode.py --variants c3configs c3pairs`;
        # docs/bench/decode-session7-*.json, prefill-w4a4-session7.json): FC2 (not gated)
        # with 128-row weight tiles from 16 rows an expert, 64 tokens 284.7 -> 268.4 us
        # and 256 tokens 498.0 -> 474.6 (W4A16; W4A4 per-token at 64 tokens 309.4 ->
        # 293.9), but not at 1 and 16 tokens (55.7 -> 57.4, 76.6 -> 77.7). W4A4 at 4096
        # tokens (1024 rows an expert, below the dense path) (64, 128, 64) 1959.8 us
        # against (128, 64, 64) 2119.3.
        # 64 valid rows an expert take 64-row tiles (each weight decoded once), measured
        # with every route valid (session 7, docs/bench/configs-session7-*.json): Mixtral-
        # 8x7B at 256 tokens (64, 128, 64) 1020 us against 1430 for (16, 64, 128), Qwen3-
        # 30B-A3B at 1024 tokens 614 against 780 (both with K split).
        if rows_per_expert <= 64 and (valid_rows is None or valid_rows < 64):
            bn = 128 if rows_per_expert > 8 and not gated else 64
            return GemmConfig(16, bn, _largest_pow2_dividing(k, 128), 4, 3)
        if rows_per_expert > 1024 and a_fp4:
            return GemmConfig(128, 64, _largest_pow2_dividing(k, 64), 4, 3)
        return GemmConfig(64, 128, _largest_pow2_dividing(k, 64), 4, 3)
    if loop:
        # Measured on the H200 with the chunk-ordered loop (docs/perf-notes.md,
        # benchmarks/sweep_decode.py, DeepSeek-V3 EP8): 16 tokens (4 rows an expert)
        # (16, 64, 256, 2 stages) 136 us; 64 and 256 tokens (16, 128, 128, 2 stages) 403 and
        # 613 us; 1024 tokens (64, 128, 32, 4 stages) 1280 us; 8192 tokens (W4A4)
        # (128, 64, 64, 3 stages) 3552 us.
        if rows_per_expert <= 8:
            return GemmConfig(16, 64, _largest_pow2_dividing(k, 256), 4, 2)
        if rows_per_expert <= 64:
            return GemmConfig(16, 128, _largest_pow2_dividing(k, 128), 4, 2)
        if rows_per_expert <= 512:
            return GemmConfig(64, 128, 32, 4, 4)
        return GemmConfig(128, 64, _largest_pow2_dividing(k, 64), 4, 3)
    # The earlier loop, measured on the H200 (docs/perf-notes.md, benchmarks/sweep_configs.py):
    # at 16 tokens (16, 64, 128, prefetch) 309 us against 328 us for (16, 64, 256, 4 stages);
    # at 8192 tokens (128, 128, 32, 8 warps, 4 stages) 3.68 ms against 5.3 ms for (128, 64, 64).
    # W4A4 at 16 tokens: (16, 64, 256, 4 stages) 338 us against 410 us with prefetch.
    if rows_per_expert <= 16 and a_fp4:
        return GemmConfig(16, 64, _largest_pow2_dividing(k, 256), 4, 4)
    if rows_per_expert <= 16:
        return GemmConfig(16, 64, _largest_pow2_dividing(k, 128), 4, 1, prefetch=True)
    if rows_per_expert <= 48:
        return GemmConfig(32, 64, _largest_pow2_dividing(k, 256), num_warps=4, num_stages=4)
    if rows_per_expert <= 160:
        return GemmConfig(64, 128 if not gated else 64, _largest_pow2_dividing(k, 128), 4, 4)
    return GemmConfig(128, 128, _largest_pow2_dividing(k, 32), 8, 4)


@triton.jit
def decode_nvfp4_tile(codes, scales, R: tl.constexpr, C: tl.constexpr, OUT: tl.constexpr):
    """codes uint8 [R, C/2] and e4m3 scales [R, C/16] to [R, C] of OUT, scaled by 2^-14."""
    lo = _nibble_to_f16(codes & 0xF)
    hi = _nibble_to_f16(codes >> 4)
    v = tl.join(lo, hi).reshape(R, C)
    s = scales.to(tl.float16)
    v = (v.reshape(R, C // 16, 16) * s[:, :, None]).reshape(R, C)
    return v.to(OUT)


# Inline-PTX decode for W4A16 weights (GPU only): 4 packed bytes (the low or the high
# nibbles) to 4 bf16 values times their block scales, with two byte lookups (prmt) for the
# bf16 magnitude bytes, the sign bits moved by shifts, and one mul.rn.bf16x2 per pair.
# bf16 magnitude of e2m1 index 0..7: 0, 0.5, 1, 1.5, 2, 3, 4, 6 = 0x0000, 0x3F00, 0x3F80,
# 0x3FC0, 0x4000, 0x4040, 0x4080, 0x40C0: high bytes 00 3F 3F 3F 40 40 40 40, low bytes
# 00 00 80 C0 00 40 80 C0. Exact: e2m1 times an e4m3 value fits bf16.
_DECODE_BODY = """
    prmt.b32 sel, t, t, 0x0020;
    mov.b32 ta, 0x3F3F3F00;
    mov.b32 tb, 0x40404040;
    prmt.b32 hb, ta, tb, sel;
    mov.b32 ta, 0xC0800000;
    mov.b32 tb, 0xC0804000;
    prmt.b32 lb, ta, tb, sel;
    prmt.b32 d0, lb, hb, 0x5140;
    prmt.b32 d1, lb, hb, 0x7362;
"""
_DECODE_LO_ASM = tl.constexpr(
    "{\n.reg .b32 m, t, sel, hb, lb, ta, tb, sg, d0, d1;\n"
    "and.b32 m, $2, 0x07070707;\nshr.b32 t, m, 4;\nor.b32 t, t, m;\n"
    + _DECODE_BODY
    + "shl.b32 sg, $2, 12;\nand.b32 sg, sg, 0x8000;\nor.b32 d0, d0, sg;\n"
    "shl.b32 sg, $2, 20;\nand.b32 sg, sg, 0x80000000;\nor.b32 d0, d0, sg;\n"
    "shr.b32 sg, $2, 4;\nand.b32 sg, sg, 0x8000;\nor.b32 d1, d1, sg;\n"
    "shl.b32 sg, $2, 4;\nand.b32 sg, sg, 0x80000000;\nor.b32 d1, d1, sg;\n"
    "mul.rn.bf16x2 $0, d0, $3;\nmul.rn.bf16x2 $1, d1, $4;\n}"
)
_DECODE_HI_ASM = tl.constexpr(
    "{\n.reg .b32 m, t, sel, hb, lb, ta, tb, sg, d0, d1;\n"
    "shr.b32 m, $2, 4;\nand.b32 m, m, 0x07070707;\nshr.b32 t, m, 4;\nor.b32 t, t, m;\n"
    + _DECODE_BODY
    + "shl.b32 sg, $2, 8;\nand.b32 sg, sg, 0x8000;\nor.b32 d0, d0, sg;\n"
    "shl.b32 sg, $2, 16;\nand.b32 sg, sg, 0x80000000;\nor.b32 d0, d0, sg;\n"
    "shr.b32 sg, $2, 8;\nand.b32 sg, sg, 0x8000;\nor.b32 d1, d1, sg;\n"
    "and.b32 sg, $2, 0x80000000;\nor.b32 d1, d1, sg;\n"
    "mul.rn.bf16x2 $0, d0, $3;\nmul.rn.bf16x2 $1, d1, $4;\n}"
)


@triton.jit
def decode_nvfp4_tile_bf16_asm(codes, scales, R: tl.constexpr, C: tl.constexpr):
    """codes uint8 [R, C/2], e4m3 scales [R, C/16] to bf16 [R, C] (exact, no 2^-14 factor)."""
    s = scales.to(tl.bfloat16)
    s = tl.broadcast_to(s[:, :, None], (R, C // 16, 8)).reshape(R, C // 2)
    lo = tl.inline_asm_elementwise(
        _DECODE_LO_ASM, "=r,=r,r,r,r", [codes, s], dtype=tl.bfloat16, is_pure=True, pack=4
    )
    hi = tl.inline_asm_elementwise(
        _DECODE_HI_ASM, "=r,=r,r,r,r", [codes, s], dtype=tl.bfloat16, is_pure=True, pack=4
    )
    return tl.join(lo, hi).reshape(R, C)


# Chunked decode (layout linear-v1, no change to the stored bytes): a chunk is 32 elements
# of K, i.e. 16 code bytes and 2 block scales a row. Byte q holds element 2q (low nibble)
# and 2q + 1 (high nibble), so the low nibbles of a chunk are its 16 even elements and the
# high nibbles its 16 odd ones. Each chunk is multiplied as two K=16 dots, evens then
# odds, against the matching even and odd columns of the activations: no interleaving of
# decoded values in registers, and a fixed summation order whatever BK is (so decode-size
# and prefill-size configs give the same bits: batch invariance, SPEC 7).
#
# Inline-PTX decode (GPU), 8 code bytes a call, to bf16 two per register: the two low (or
# high) nibbles of adjacent bytes go to the halves of t, and one multiply places each
# nibble's 3 magnitude bits at bf16 bits 8..6 and its sign at bit 15:
# ((t & 0x000F000F) * 0x1040) & 0x81C081C0 (shifts by 6 and 12 whose fields do not overlap;
# 0x00F000F0 and 0x104 for high nibbles). That bf16 is e2m1 * 2^-126 exactly (its exponent
# field is the e2m1 exponent, so the subnormal 0.5 is right too). One fma by the block
# scale times 2^118 (in bf16, exact) gives e2m1 * scale * 2^-8, exact (<= 6 significant
# bits, >= 2^-18). The kernel multiplies the fp32 accumulator back by 2^8 per decoded
# operand.
_CHUNK_DECODE_ASM = tl.constexpr(
    "{\n.reg .b32 t, u, z;\nmov.b32 z, 0x80008000;\n"
    + "".join(
        f"prmt.b32 t, ${8 + j // 2}, 0, {'0x4342' if j % 2 else '0x4140'};\n"
        f"and.b32 u, t, 0x000F000F;\nmul.lo.u32 u, u, 0x1040;\nand.b32 u, u, 0x81C081C0;\n"
        f"fma.rn.bf16x2 ${j}, u, ${10 + j}, z;\n"
        f"and.b32 u, t, 0x00F000F0;\nmul.lo.u32 u, u, 0x104;\nand.b32 u, u, 0x81C081C0;\n"
        f"fma.rn.bf16x2 ${4 + j}, u, ${10 + j}, z;\n"
        for j in range(4)
    )
    + "}"
)


# The same eight registers from the codes in the rotated layout (``cuda_decode.ROT_PERM``,
# ``rotated_codes``; the experiment ``gluon_ws.ROT_LAYOUT``): each code word's four in 15
# instructions instead of 18 (docs/perf-notes.md session 23): step 2 i's low-nibble
# register is the word masked, its high one two rotations (1, 3) merged; step 2 i + 1's
# low one two rotations (2, 12) merged, its high one a rotation (6) masked.
_CHUNK_DECODE_ROT_ASM = tl.constexpr(
    "{\n.reg .b32 r1, r2, r3, r6, r12, t, z;\nmov.b32 z, 0x80008000;\n"
    + "".join(
        f"and.b32 t, ${8 + i}, 0x81C081C0;\nfma.rn.bf16x2 ${2 * i}, t, ${10 + 2 * i}, z;\n"
        f"shf.l.wrap.b32 r1, ${8 + i}, ${8 + i}, 1;\nshf.l.wrap.b32 r3, ${8 + i}, ${8 + i}, 3;\n"
        f"and.b32 t, r1, 0x80008000;\nlop3.b32 t, r3, 0x01C001C0, t, 0xEA;\n"
        f"fma.rn.bf16x2 ${4 + 2 * i}, t, ${10 + 2 * i}, z;\n"
        f"shf.l.wrap.b32 r2, ${8 + i}, ${8 + i}, 2;\nshf.l.wrap.b32 r12, ${8 + i}, ${8 + i}, 12;\n"
        f"and.b32 t, r2, 0x80008000;\nlop3.b32 t, r12, 0x01C001C0, t, 0xEA;\n"
        f"fma.rn.bf16x2 ${2 * i + 1}, t, ${11 + 2 * i}, z;\n"
        f"shf.l.wrap.b32 r6, ${8 + i}, ${8 + i}, 6;\nand.b32 t, r6, 0x81C081C0;\n"
        f"fma.rn.bf16x2 ${5 + 2 * i}, t, ${11 + 2 * i}, z;\n"
        for i in range(2)
    )
    + "}"
)


@triton.jit
def decode_lohi(
    codes, scales, R: tl.constexpr, C: tl.constexpr, ASM: tl.constexpr, OUT: tl.constexpr
):
    """codes uint8 [R, C/2] and e4m3 scales [R, C/16] to the low-nibble (even) and the
    high-nibble (odd) elements, two [R, C/2] tiles of OUT, each value times 2^-8 (exact)."""
    if ASM:
        # Per element: the scale as bf16 times 2^118 (exact), so each register pair of
        # elements (2j, 2j + 1), adjacent code bytes of one block, carries its own scale
        # whatever layout the compiler gives the operand.
        sc = (scales.to(tl.float32) * 3.32306998946229e35).to(tl.bfloat16)
        sb = tl.reshape(tl.broadcast_to(sc[:, :, None], (R, C // 16, 8)), (R, C // 2))
        lo, hi = tl.inline_asm_elementwise(
            _CHUNK_DECODE_ASM, "=r,=r,=r,=r,=r,=r,=r,=r,r,r,r,r,r,r", [codes, sb],
            dtype=(tl.bfloat16, tl.bfloat16), is_pure=True, pack=8,
        )  # fmt: skip
        return lo.to(OUT), hi.to(OUT)
    else:
        s = scales.to(tl.float32) * 0.00390625
        s = tl.reshape(tl.broadcast_to(s[:, :, None], (R, C // 16, 8)), (R, C // 2))
        lo = _nibble_to_f16(codes & 0xF).to(tl.float32) * 16384.0
        hi = _nibble_to_f16(codes >> 4).to(tl.float32) * 16384.0
        return (lo * s).to(OUT), (hi * s).to(OUT)


@triton.jit
def decode_chunk(codes, scales, R: tl.constexpr, ASM: tl.constexpr, OUT: tl.constexpr):
    """One 32-element chunk: codes [R, 16], scales [R, 2] to (even, odd) tiles [R, 16]."""
    return decode_lohi(codes, scales, R, 32, ASM, OUT)


@triton.jit
def decode_permuted(
    codes,
    scales,
    R: tl.constexpr,
    C: tl.constexpr,
    ASM: tl.constexpr,
    OUT: tl.constexpr,
    ORDER: tl.constexpr = 32,
):
    """codes [R, C/2] and scales [R, C/16] to [R, C] in the loop's K order (``ORDER``):

    - 32, the chunk order: for each chunk of 32 elements its 16 even elements, then its
      16 odd ones: position p holds element (p // 32) * 32 + 2 * (p % 16) + (p // 16) % 2;
    - 64, the unit order: in each unit of 64 elements, position 16 s + 8 b + 2 q + a holds
      element 16 q + 4 s + 2 a + b (s, q < 4; a, b < 2): what the decode asm's output
      registers hold when one thread decodes 8 consecutive code bytes, so the move into
      the wgmma fragment is almost free (5.6 -> 3.7 SASS instructions a weight, FC1)."""
    lo, hi = decode_lohi(codes, scales, R, C, ASM, OUT)
    if ORDER == 64:  # join(lo, hi) is the tile in natural order
        return order_rows(tl.reshape(tl.join(lo, hi), (R, C)), R, C, ORDER)
    else:
        v = tl.join(tl.reshape(lo, (R, C // 32, 16)), tl.reshape(hi, (R, C // 32, 16)))
        return tl.reshape(tl.permute(v, (0, 1, 3, 2)), (R, C))


@triton.jit
def _chunk_ptrs(a_ptr, a_scales_ptr, w_codes_ptr, w_scales_ptr, row_g, src,
                K: tl.constexpr, BK: tl.constexpr, A_FP4: tl.constexpr,
                W_DENSE: tl.constexpr = False):  # fmt: skip
    """Pointers of the first K tile for ``_chunk_tile``: weight codes and scales of the
    rows ``row_g`` (W_DENSE: rows of decoded weights, ``dequant.dense_weights``);
    activation codes and scales (W4A4) or bf16 rows (W4A16) of ``src`` (W_DENSE: rows of
    the activation operand already in chunk order, decoded for W4A4)."""
    if W_DENSE:
        cw2 = w_codes_ptr + row_g[:, None] * K + tl.arange(0, BK)[None, :]
    else:
        cw2 = w_codes_ptr + row_g[:, None] * (K // 2) + tl.arange(0, BK // 2)[None, :]
    sw2 = w_scales_ptr + row_g[:, None] * (K // 16) + tl.arange(0, BK // 16)[None, :]
    if A_FP4 and not W_DENSE:
        ca2 = a_ptr + src[:, None] * (K // 2) + tl.arange(0, BK // 2)[None, :]
        sa2 = a_scales_ptr + src[:, None] * (K // 16) + tl.arange(0, BK // 16)[None, :]
        xp2 = ca2
    else:
        xp2 = a_ptr + src[:, None] * K + tl.arange(0, BK)[None, :]
        ca2 = xp2
        sa2 = xp2
    return cw2, sw2, xp2, ca2, sa2


@triton.jit
def _chunk_tile(
    kb, acc_g, acc_u, cw2, sw2, xp2, ca2, sa2, m_mask, n_mask,
    N: tl.constexpr, K: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
    GATED: tl.constexpr, A_FP4: tl.constexpr, DECODE_ASM: tl.constexpr, DOT_DTYPE: tl.constexpr,
    W_DENSE: tl.constexpr = False, ORDER: tl.constexpr = 32, A_ORDERED: tl.constexpr = False,
):  # fmt: skip
    """One K tile of the chunk-ordered loop (``CHUNKED`` 2 and 3): load, decode, dot.
    W_DENSE: both operand tiles are loaded already decoded and in chunk order (the values
    ``decode_permuted`` and the register permutation give), so the dots see the same
    operands: the same bits. A_ORDERED: only the bf16 activation rows are (W4A16)."""
    KH: tl.constexpr = K // 2
    KS: tl.constexpr = K // 16
    if W_DENSE:  # the activation operand, already in chunk order (and decoded)
        x = tl.trans(tl.load(xp2 + kb * BK, mask=m_mask[:, None], other=0.0))
    elif A_ORDERED:  # bf16 rows already in the loop's order
        x = tl.trans(tl.load(xp2 + kb * BK, mask=m_mask[:, None], other=0.0).to(DOT_DTYPE))
    elif A_FP4:
        ac = tl.load(ca2 + kb * (BK // 2), mask=m_mask[:, None], other=0)
        asc = tl.load(sa2 + kb * (BK // 16), mask=m_mask[:, None], other=0.0)
        x = tl.trans(decode_permuted(ac, asc, BM, BK, DECODE_ASM, DOT_DTYPE, ORDER))
    else:  # contiguous rows, put in the loop's order in registers
        x = tl.load(xp2 + kb * BK, mask=m_mask[:, None], other=0.0).to(DOT_DTYPE)
        x = tl.trans(order_rows(x, BM, BK, ORDER))
    if W_DENSE:
        wg = tl.load(cw2 + kb * BK, mask=n_mask[:, None], other=0.0)
        acc_g = tl.dot(wg, x, acc_g)
        if GATED:
            wu = tl.load(cw2 + N * K + kb * BK, mask=n_mask[:, None], other=0.0)
            acc_u = tl.dot(wu, x, acc_u)
    else:
        cg = tl.load(cw2 + kb * (BK // 2), mask=n_mask[:, None], other=0)
        sg = tl.load(sw2 + kb * (BK // 16), mask=n_mask[:, None], other=0.0)
        acc_g = tl.dot(decode_permuted(cg, sg, BN, BK, DECODE_ASM, DOT_DTYPE, ORDER), x, acc_g)
        if GATED:
            cu = tl.load(cw2 + N * KH + kb * (BK // 2), mask=n_mask[:, None], other=0)
            su = tl.load(sw2 + N * KS + kb * (BK // 16), mask=n_mask[:, None], other=0.0)
            acc_u = tl.dot(decode_permuted(cu, su, BN, BK, DECODE_ASM, DOT_DTYPE, ORDER), x, acc_u)
    return acc_g, acc_u


@triton.jit
def _segment(
    first, NT: tl.constexpr, acc_g, acc_u, cw2, sw2, xp2, ca2, sa2, m_mask, n_mask,
    N: tl.constexpr, K: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
    GATED: tl.constexpr, A_FP4: tl.constexpr, DECODE_ASM: tl.constexpr, DOT_DTYPE: tl.constexpr,
    W_DENSE: tl.constexpr, ORDER: tl.constexpr, A_ORDERED: tl.constexpr = False,
):  # fmt: skip
    """One K segment of loop 3 in registers: NT tiles from tile ``first`` summed from
    zero (a constexpr trip count and no branch, which the software pipeliner needs),
    then added to the running sums."""
    pg = tl.zeros((BN, BM), dtype=tl.float32)
    pu = tl.zeros((BN, BM), dtype=tl.float32)
    for j in range(0, NT):
        pg, pu = _chunk_tile(
            first + j, pg, pu, cw2, sw2, xp2, ca2, sa2, m_mask, n_mask,
            N, K, BM, BN, BK, GATED, A_FP4, DECODE_ASM, DOT_DTYPE, W_DENSE, ORDER, A_ORDERED,
        )  # fmt: skip
    acc_g = acc_g + pg
    if GATED:
        acc_u = acc_u + pu
    return acc_g, acc_u


@triton.jit
def _block_rows(
    pid_m, block_start_ptr, block_end_ptr, sorted_routes_ptr, BM: tl.constexpr,
    TOPK: tl.constexpr, A_GATHER: tl.constexpr, FUSED: tl.constexpr,
):  # fmt: skip
    """Rows of row block ``pid_m``: sorted positions, their mask, their flat routes (read
    when gathered or fused; else the positions) and the activation rows they read."""
    start = tl.load(block_start_ptr + pid_m)
    end = tl.load(block_end_ptr + pid_m)
    offs_m = start + tl.arange(0, BM)
    m_mask = offs_m < end
    if A_GATHER or FUSED:
        route = tl.load(sorted_routes_ptr + offs_m, mask=m_mask, other=0)
    else:
        route = offs_m
    if A_GATHER:
        src = route // TOPK
    else:
        src = offs_m
    src = tl.where(m_mask, src, 0).to(tl.int64)
    return offs_m, m_mask, route, src


@triton.jit
def _split_unit(
    pid_m, pid_n, s_id, a_ptr, a_scales_ptr, a_global_ptr, sorted_routes_ptr, topk_w_ptr,
    w_codes_ptr, w_scales_ptr, w_global_ptr, out_ptr, out_scales_ptr, out_global_ptr,
    out_table_ptr, block_expert_ptr, block_start_ptr, block_end_ptr, part_ptr, cnt_ptr,
    ws_rows, amax_ptr,
    N: tl.constexpr, K: tl.constexpr, TOPK: tl.constexpr, GATED: tl.constexpr,
    A_FP4: tl.constexpr, A_GATHER: tl.constexpr, FUSED: tl.constexpr,
    OUT_SCALE: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
    DOT_DTYPE: tl.constexpr, INTERPRET: tl.constexpr, DECODE_ASM: tl.constexpr,
    OUT_FP4: tl.constexpr, SEG_TILES: tl.constexpr, W_DENSE: tl.constexpr,
    REDUCE_ONLY: tl.constexpr, ORDER: tl.constexpr, OUT_AMAX: tl.constexpr,
    A_ORDERED: tl.constexpr = False, OUT_ORDERED: tl.constexpr = False,
):  # fmt: skip
    """Loop 3 with split K, one unit: K segment ``s_id`` of the tile (row block ``pid_m``,
    weight rows ``pid_n``), a dot chain from zero written as the fp32 partial P_s; the
    last unit of a tile to finish sums the partials in segment order and runs the
    epilogue: the same operations, so the same bits, as the in-register loop's
    ((0 + P_0) + P_1) + .... REDUCE_ONLY: another kernel wrote every P_s (gluon_decode)."""
    e64 = tl.load(block_expert_ptr + pid_m).to(tl.int64)
    offs_m, m_mask, route, src = _block_rows(
        pid_m, block_start_ptr, block_end_ptr, sorted_routes_ptr, BM, TOPK, A_GATHER, FUSED
    )
    offs_n = pid_n * BN + tl.arange(0, BN)
    n_mask = offs_n < N
    if GATED:
        gn: tl.constexpr = 2 * N
    else:
        gn: tl.constexpr = N
    KB: tl.constexpr = K // BK
    REM: tl.constexpr = KB % SEG_TILES
    NSEG: tl.constexpr = KB // SEG_TILES + (REM > 0)
    pmask = n_mask[:, None] & m_mask[None, :]
    prow = part_ptr + offs_m.to(tl.int64)[None, :] * gn + offs_n[:, None]
    stride = ws_rows.to(tl.int64) * gn
    last = True
    if not REDUCE_ONLY:
        cw2, sw2, xp2, ca2, sa2 = _chunk_ptrs(
            a_ptr, a_scales_ptr, w_codes_ptr, w_scales_ptr, e64 * gn + offs_n, src, K, BK,
            A_FP4, W_DENSE,
        )  # fmt: skip
        acc_g = tl.zeros((BN, BM), dtype=tl.float32)
        acc_u = tl.zeros((BN, BM), dtype=tl.float32)
        for j in range(0, SEG_TILES):
            kb = s_id * SEG_TILES + j
            if REM == 0:  # noqa: SIM114 (a constexpr: no runtime bound check when full)
                acc_g, acc_u = _chunk_tile(
                    kb, acc_g, acc_u, cw2, sw2, xp2, ca2, sa2, m_mask, n_mask,
                    N, K, BM, BN, BK, GATED, A_FP4, DECODE_ASM, DOT_DTYPE, W_DENSE, ORDER,
                    A_ORDERED,
                )  # fmt: skip
            elif kb < KB:
                acc_g, acc_u = _chunk_tile(
                    kb, acc_g, acc_u, cw2, sw2, xp2, ca2, sa2, m_mask, n_mask,
                    N, K, BM, BN, BK, GATED, A_FP4, DECODE_ASM, DOT_DTYPE, W_DENSE, ORDER,
                    A_ORDERED,
                )  # fmt: skip
        tl.store(prow + s_id * stride, acc_g, mask=pmask)
        if GATED:
            tl.store(prow + s_id * stride + N, acc_u, mask=pmask)
        tile = pid_m * tl.cdiv(N, BN) + pid_n
        done = tl.atomic_add(cnt_ptr + tile, 1, sem="acq_rel")
        last = done == NSEG - 1
        if last:
            tl.store(cnt_ptr + tile, 0)  # ready for the next call (and graph replay)
    if last:
        acc_g = tl.zeros((BN, BM), dtype=tl.float32)
        acc_u = tl.zeros((BN, BM), dtype=tl.float32)
        for sg_i in range(0, NSEG):  # .cg: other SMs wrote them; read from L2, not L1
            acc_g = acc_g + tl.load(
                prow + sg_i * stride, mask=pmask, other=0.0, cache_modifier=".cg"
            )
            if GATED:
                acc_u = acc_u + tl.load(
                    prow + sg_i * stride + N, mask=pmask, other=0.0, cache_modifier=".cg"
                )
        _epilogue(
            acc_g, acc_u, e64, offs_m, m_mask, route, src, offs_n, n_mask, pid_n,
            a_global_ptr, w_global_ptr, topk_w_ptr, out_ptr, out_scales_ptr, out_global_ptr,
            out_table_ptr, amax_ptr, N, TOPK, GATED, A_FP4, FUSED, OUT_FP4, OUT_AMAX,
            OUT_SCALE, BM, BN, INTERPRET, OUT_ORDERED,
        )  # fmt: skip


@triton.jit
def moe_gemm_kernel(
    a_ptr,  # bf16 [rows, K] or NVFP4 codes uint8 [rows, K/2]; W_DENSE: [rows, K] chunk order
    a_scales_ptr,  # e4m3 [rows, K/16] (A_FP4)
    a_global_ptr,  # fp32 [rows] (A_FP4)
    sorted_routes_ptr,  # int32 [T*K]: sorted position -> flat route t*TOPK + k
    topk_w_ptr,  # fp32 [T*TOPK] (FUSED)
    w_codes_ptr,  # uint8 [E, W_ROWS, K/2]; W_DENSE: decoded [E, W_ROWS, K] (DOT_DTYPE)
    w_scales_ptr,  # e4m3 [E, W_ROWS, K/16]
    w_global_ptr,  # fp32 [E, W_GLOBALS]
    out_ptr,  # bf16 [rows, N] (sorted order), fp32 [T, N] (FUSED) or codes [rows, N/2] (OUT_FP4)
    out_scales_ptr,  # e4m3 [rows, N/16] (OUT_FP4)
    out_global_ptr,  # fp32 [rows] (OUT_FP4)
    out_table_ptr,  # fp32 [E]: the static global of the output per expert (OUT_FP4)
    block_expert_ptr,
    block_start_ptr,
    block_end_ptr,
    part_ptr,  # fp32 [segments, ws_rows, (2 if GATED) * N] segment partials (SPLIT)
    cnt_ptr,  # int32 [tiles]: segments finished per output tile, reset by the last (SPLIT)
    ws_rows,
    amax_ptr,  # fp32 [1], zeroed before the call: max |out| over the valid rows (OUT_AMAX)
    N: tl.constexpr,
    K: tl.constexpr,
    TOPK: tl.constexpr,
    GATED: tl.constexpr,
    A_FP4: tl.constexpr,
    A_GATHER: tl.constexpr,
    FUSED: tl.constexpr,
    OUT_SCALE: tl.constexpr,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    W_DTYPE: tl.constexpr,
    USE_PDL: tl.constexpr,
    INTERPRET: tl.constexpr,
    DECODE_ASM: tl.constexpr = False,
    PREFETCH: tl.constexpr = False,
    OUT_FP4: tl.constexpr = False,
    CHUNKED: tl.constexpr = 0,
    SEG_TILES: tl.constexpr = 0,
    SPLIT: tl.constexpr = False,
    W_DENSE: tl.constexpr = False,
    GROUP_M: tl.constexpr = 0,
    REDUCE_ONLY: tl.constexpr = False,
    ORDER: tl.constexpr = 32,
    OUT_AMAX: tl.constexpr = False,
    A_ORDERED: tl.constexpr = False,
    OUT_ORDERED: tl.constexpr = False,
    BLOCKS_LAST: tl.constexpr = False,
):
    if GROUP_M:
        # One grid axis in groups of GROUP_M tile rows: consecutive programs sweep the
        # weight tiles of GROUP_M row blocks, so both the (dense) weight tiles and the
        # activation rows are reused from L2 instead of read again from HBM.
        NT: tl.constexpr = (N + BN - 1) // BN
        p = tl.program_id(0)
        num_m = tl.num_programs(0) // NT
        first_m = (p // (GROUP_M * NT)) * GROUP_M
        size_m = tl.minimum(num_m - first_m, GROUP_M)
        pid_m = first_m + (p % (GROUP_M * NT)) % size_m
        pid_n = (p % (GROUP_M * NT)) // size_m
    else:
        pid_n = tl.program_id(0)
        if BLOCKS_LAST:  # split K on a (tiles, segments, blocks) grid
            pid_m = tl.program_id(2)
        else:
            pid_m = tl.program_id(1)
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    e = tl.load(block_expert_ptr + pid_m)
    if e < 0:
        return
    if SPLIT and CHUNKED == 3:  # one K segment of one tile (program_id 2; 0 if REDUCE_ONLY)
        if BLOCKS_LAST:
            s_id = tl.program_id(1)
        else:
            s_id = tl.program_id(2)
        _split_unit(
            pid_m, pid_n, s_id, a_ptr, a_scales_ptr, a_global_ptr,
            sorted_routes_ptr, topk_w_ptr, w_codes_ptr, w_scales_ptr, w_global_ptr, out_ptr,
            out_scales_ptr, out_global_ptr, out_table_ptr, block_expert_ptr, block_start_ptr,
            block_end_ptr, part_ptr, cnt_ptr, ws_rows, amax_ptr, N, K, TOPK, GATED, A_FP4,
            A_GATHER, FUSED, OUT_SCALE, BM, BN, BK, DOT_DTYPE, INTERPRET, DECODE_ASM, OUT_FP4,
            SEG_TILES, W_DENSE, REDUCE_ONLY, ORDER, OUT_AMAX, A_ORDERED, OUT_ORDERED,
        )  # fmt: skip
        return
    e64 = e.to(tl.int64)
    offs_m, m_mask, route, src = _block_rows(
        pid_m, block_start_ptr, block_end_ptr, sorted_routes_ptr, BM, TOPK, A_GATHER, FUSED
    )

    offs_n = pid_n * BN + tl.arange(0, BN)
    n_mask = offs_n < N
    if GATED:
        w_rows_total = 2 * N
    else:
        w_rows_total = N
    KH = K // 2
    KS = K // 16
    row_g = e64 * w_rows_total + offs_n
    wc_g = w_codes_ptr + row_g[:, None] * KH + tl.arange(0, BK // 2)[None, :]
    ws_g = w_scales_ptr + row_g[:, None] * KS + tl.arange(0, BK // 16)[None, :]
    if GATED:
        wc_u = wc_g + N * KH
        ws_u = ws_g + N * KS
    if A_FP4:
        ac_ptrs = a_ptr + src[:, None] * KH + tl.arange(0, BK // 2)[None, :]
        as_ptrs = a_scales_ptr + src[:, None] * KS + tl.arange(0, BK // 16)[None, :]
    else:
        x_ptrs = a_ptr + src[None, :] * K + tl.arange(0, BK)[:, None]

    acc_g = tl.zeros((BN, BM), dtype=tl.float32)
    acc_u = tl.zeros((BN, BM), dtype=tl.float32)  # (not GATED: unused)
    if CHUNKED == 1:
        q16 = tl.arange(0, 16)
        q2 = tl.arange(0, 2)
        cw_g = w_codes_ptr + row_g[:, None] * KH + q16[None, :]
        sw_g = w_scales_ptr + row_g[:, None] * KS + q2[None, :]
        if A_FP4:
            ca_p = a_ptr + src[:, None] * KH + q16[None, :]
            sa_p = a_scales_ptr + src[:, None] * KS + q2[None, :]
        else:
            xa_p = a_ptr + src[:, None] * K + tl.arange(0, 32)[None, :]
        for kb in range(0, K // BK):
            for c in tl.static_range(BK // 32):
                kq = kb * (BK // 2) + c * 16
                ksc = kb * (BK // 16) + c * 2
                if A_FP4:
                    ac = tl.load(ca_p + kq, mask=m_mask[:, None], other=0)
                    asc = tl.load(sa_p + ksc, mask=m_mask[:, None], other=0.0)
                    xe, xo = decode_chunk(ac, asc, BM, DECODE_ASM, DOT_DTYPE)
                else:
                    xx = tl.load(xa_p + (kb * BK + c * 32), mask=m_mask[:, None], other=0.0)
                    xe, xo = tl.split(tl.reshape(xx.to(DOT_DTYPE), (BM, 16, 2)))
                xe = tl.trans(xe)
                xo = tl.trans(xo)
                cg = tl.load(cw_g + kq, mask=n_mask[:, None], other=0)
                sg = tl.load(sw_g + ksc, mask=n_mask[:, None], other=0.0)
                we, wo = decode_chunk(cg, sg, BN, DECODE_ASM, DOT_DTYPE)
                acc_g = tl.dot(we, xe, acc_g)
                acc_g = tl.dot(wo, xo, acc_g)
                if GATED:
                    cu = tl.load(cw_g + N * KH + kq, mask=n_mask[:, None], other=0)
                    su = tl.load(sw_g + N * KS + ksc, mask=n_mask[:, None], other=0.0)
                    ue, uo = decode_chunk(cu, su, BN, DECODE_ASM, DOT_DTYPE)
                    acc_u = tl.dot(ue, xe, acc_u)
                    acc_u = tl.dot(uo, xo, acc_u)
    elif CHUNKED == 2:
        cw2, sw2, xp2, ca2, sa2 = _chunk_ptrs(
            a_ptr, a_scales_ptr, w_codes_ptr, w_scales_ptr, row_g, src, K, BK, A_FP4, W_DENSE
        )
        if not GATED:
            acc_u = acc_g
        for kb in range(0, K // BK):
            acc_g, acc_u = _chunk_tile(
                kb, acc_g, acc_u, cw2, sw2, xp2, ca2, sa2, m_mask, n_mask,
                N, K, BM, BN, BK, GATED, A_FP4, DECODE_ASM, DOT_DTYPE, W_DENSE,
            )  # fmt: skip
    elif CHUNKED == 3:
        # Chunk order (as 2) in fixed K segments of SEG_TILES tiles (1024 elements):
        # acc = ((0 + P_0) + P_1) + ..., each P_s a dot chain from zero over its segment.
        # SPLIT: one program a segment writes P_s, and the last to finish a tile sums the
        # partials in segment order: the same operations, so the same bits, as the
        # in-register sums of a program that runs every segment.
        cw2, sw2, xp2, ca2, sa2 = _chunk_ptrs(
            a_ptr, a_scales_ptr, w_codes_ptr, w_scales_ptr, row_g, src, K, BK, A_FP4, W_DENSE
        )
        KB: tl.constexpr = K // BK
        NFULL: tl.constexpr = KB // SEG_TILES  # full segments, then REM tiles in a last one
        REM: tl.constexpr = KB % SEG_TILES
        if not GATED:
            acc_u = acc_g
        # Full segments, then the REM tiles of a last one: constexpr trip counts and no
        # branch in the inner loop, which the software pipeliner needs (a `kb < KB` test
        # there cost 15% to 30% at prefill sizes on the H200).
        for sg_i in range(0, NFULL):
            acc_g, acc_u = _segment(
                sg_i * SEG_TILES, SEG_TILES, acc_g, acc_u, cw2, sw2, xp2, ca2, sa2,
                m_mask, n_mask, N, K, BM, BN, BK, GATED, A_FP4, DECODE_ASM, DOT_DTYPE,
                W_DENSE, ORDER, A_ORDERED,
            )  # fmt: skip
        if REM > 0:
            acc_g, acc_u = _segment(
                NFULL * SEG_TILES, REM, acc_g, acc_u, cw2, sw2, xp2, ca2, sa2,
                m_mask, n_mask, N, K, BM, BN, BK, GATED, A_FP4, DECODE_ASM, DOT_DTYPE,
                W_DENSE, ORDER, A_ORDERED,
            )  # fmt: skip
    else:
        # Register double buffering (PREFETCH): the next tile's weight bytes are in flight while
        # this tile is decoded and multiplied.
        cg_nxt = tl.load(wc_g, mask=n_mask[:, None], other=0)
        sg_nxt = tl.load(ws_g, mask=n_mask[:, None], other=0.0)
        if GATED:
            cu_nxt = tl.load(wc_u, mask=n_mask[:, None], other=0)
            su_nxt = tl.load(ws_u, mask=n_mask[:, None], other=0.0)
        for k0 in range(0, K, BK):
            if PREFETCH:
                cg_cur = cg_nxt
                sg_cur = sg_nxt
                pm = n_mask[:, None] & (k0 + BK < K)
                cg_nxt = tl.load(wc_g + (k0 + BK) // 2, mask=pm, other=0)
                sg_nxt = tl.load(ws_g + (k0 + BK) // 16, mask=pm, other=0.0)
                if GATED:
                    cu_cur = cu_nxt
                    su_cur = su_nxt
                    cu_nxt = tl.load(wc_u + (k0 + BK) // 2, mask=pm, other=0)
                    su_nxt = tl.load(ws_u + (k0 + BK) // 16, mask=pm, other=0.0)
            else:
                cg_cur = tl.load(wc_g + k0 // 2, mask=n_mask[:, None], other=0)
                sg_cur = tl.load(ws_g + k0 // 16, mask=n_mask[:, None], other=0.0)
                if GATED:
                    cu_cur = tl.load(wc_u + k0 // 2, mask=n_mask[:, None], other=0)
                    su_cur = tl.load(ws_u + k0 // 16, mask=n_mask[:, None], other=0.0)
            if A_FP4:
                ac = tl.load(ac_ptrs + k0 // 2, mask=m_mask[:, None], other=0)
                asc = tl.load(as_ptrs + k0 // 16, mask=m_mask[:, None], other=0.0)
                x = tl.trans(decode_nvfp4_tile(ac, asc, BM, BK, DOT_DTYPE))
            else:
                x = tl.load(x_ptrs + k0, mask=m_mask[None, :], other=0.0).to(DOT_DTYPE)
            if DECODE_ASM:
                wg = decode_nvfp4_tile_bf16_asm(cg_cur, sg_cur, BN, BK)
            else:
                wg = decode_nvfp4_tile(cg_cur, sg_cur, BN, BK, W_DTYPE).to(DOT_DTYPE)
            acc_g = tl.dot(wg, x, acc_g)
            if GATED:
                if DECODE_ASM:
                    wu = decode_nvfp4_tile_bf16_asm(cu_cur, su_cur, BN, BK)
                else:
                    wu = decode_nvfp4_tile(cu_cur, su_cur, BN, BK, W_DTYPE).to(DOT_DTYPE)
                acc_u = tl.dot(wu, x, acc_u)
    _epilogue(
        acc_g, acc_u, e64, offs_m, m_mask, route, src, offs_n, n_mask, pid_n,
        a_global_ptr, w_global_ptr, topk_w_ptr, out_ptr, out_scales_ptr, out_global_ptr,
        out_table_ptr, amax_ptr, N, TOPK, GATED, A_FP4, FUSED, OUT_FP4, OUT_AMAX, OUT_SCALE,
        BM, BN, INTERPRET, OUT_ORDERED,
    )  # fmt: skip


@triton.jit
def _epilogue(
    acc_g, acc_u, e64, offs_m, m_mask, route, src, offs_n, n_mask, pid_n,
    a_global_ptr, w_global_ptr, topk_w_ptr, out_ptr, out_scales_ptr, out_global_ptr,
    out_table_ptr, amax_ptr,
    N: tl.constexpr, TOPK: tl.constexpr, GATED: tl.constexpr, A_FP4: tl.constexpr,
    FUSED: tl.constexpr, OUT_FP4: tl.constexpr, OUT_AMAX: tl.constexpr,
    OUT_SCALE: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, INTERPRET: tl.constexpr,
    OUT_ORDERED: tl.constexpr = False,
):  # fmt: skip
    """The output of one tile [BN, BM] from its fp32 sums: global scales, SwiGLU (FC1),
    then bf16 rows, NVFP4 rows (OUT_FP4) or the router-weighted atomic add (FUSED).
    OUT_ORDERED: bf16 rows with each 64 columns in the unit order (``order_rows``), as
    the next GEMM's A_ORDERED loads them."""
    # Epilogue: h = acc * g_x * g_w (SPEC section 5), after undoing the decode's 2^-14s.
    h = acc_g * OUT_SCALE
    if A_FP4:
        gx = tl.load(a_global_ptr + src, mask=m_mask, other=1.0)
        h = h * gx[None, :]
    if GATED:
        h = h * tl.load(w_global_ptr + e64 * 2)
        hu = acc_u * OUT_SCALE
        if A_FP4:
            hu = hu * gx[None, :]
        hu = hu * tl.load(w_global_ptr + e64 * 2 + 1)
        res = (h / (1.0 + tl.exp(-h))) * hu
    else:
        res = h * tl.load(w_global_ptr + e64)
    y = to_bf16(res, INTERPRET)
    mask = n_mask[:, None] & m_mask[None, :]
    if FUSED:
        tok = (route // TOPK).to(tl.int64)
        wt = tl.load(topk_w_ptr + route, mask=m_mask, other=0.0)
        contrib = y.to(tl.float32) * wt[None, :]
        tl.atomic_add(
            out_ptr + tok[None, :] * N + offs_n[:, None], contrib, mask=mask, sem="relaxed"
        )
    elif OUT_FP4:
        # FC1 for static W4A4: quantize the bf16 activation tile straight to NVFP4 with the
        # expert's calibrated global (SPEC 2, the same float operations as quantize.py):
        # blocks of 16 along N, so a tile of BN columns holds BN // 16 whole blocks.
        g = tl.load(out_table_ptr + e64)
        blk = tl.reshape(y.to(tl.float32), (BN // 16, 16, BM))
        amax = tl.max(tl.abs(blk), axis=1)  # [BN // 16, BM]
        s = tl.minimum(tl.math.div_rn(amax, tl.zeros_like(amax) + 6.0 * g), 448.0)
        s8 = to_e4m3(s, INTERPRET)
        denom = s8.to(tl.float32) * g
        safe = tl.where(denom == 0.0, 1.0, denom)
        v = tl.math.div_rn(blk, tl.broadcast_to(safe[:, None, :], (BN // 16, 16, BM)))
        code = tl.where((denom == 0.0)[:, None, :], 0, encode_e2m1(v)).to(tl.uint8)
        pairs = tl.permute(tl.reshape(code, (BN // 2, 2, BM)), (0, 2, 1))  # [BN/2, BM, 2]
        lo, hi = tl.split(pairs)
        rows64 = offs_m.to(tl.int64)[None, :]
        pc = pid_n * (BN // 2) + tl.arange(0, BN // 2)
        tl.store(out_ptr + rows64 * (N // 2) + pc[:, None], lo | (hi << 4),
                 mask=(pc < N // 2)[:, None] & m_mask[None, :])  # fmt: skip
        ps = pid_n * (BN // 16) + tl.arange(0, BN // 16)
        tl.store(out_scales_ptr + rows64 * (N // 16) + ps[:, None], s8,
                 mask=(ps < N // 16)[:, None] & m_mask[None, :])  # fmt: skip
        if pid_n == 0:
            tl.store(out_global_ptr + offs_m, tl.zeros_like(offs_m).to(tl.float32) + g, mask=m_mask)
    else:
        cols = offs_n
        if OUT_ORDERED:  # element 16 q + 4 s + 2 a + b of 64 to position 16 s + 8 b + 2 q + a
            c = offs_n % 64
            cols = offs_n - c + 16 * ((c >> 2) & 3) + 8 * (c & 1) + 2 * (c >> 4) + ((c >> 1) & 1)
        tl.store(out_ptr + offs_m.to(tl.int64)[None, :] * N + cols[:, None], y, mask=mask)
        if OUT_AMAX:  # the per-tensor amax of this output for W4A4 (exact in any order)
            tile_max = tl.max(tl.max(tl.where(mask, tl.abs(y.to(tl.float32)), 0.0), axis=1))
            tl.atomic_max(amax_ptr, tile_max, sem="relaxed")
