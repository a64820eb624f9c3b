"""The NVFP4 decode shared by every GEMM family: two e2m1 nibbles and their e4m3 block
scale to bf16 operand values, in the K order the GEMMs multiply in.

Decoded values carry a factor 2^-8 (each GEMM's epilogue undoes it on the fp32
accumulator), so that e2m1 times an e4m3 scale is exact in bf16 (at most 6 significant
bits, 2^-18 to 10.5).

Inline-PTX decode (GPU), 8 code bytes a call (4 for half a unit), to bf16 two per
register: the two low (or high) nibbles of adjacent bytes go to the halves of t, and one
multiply places each nibble's 3 magnitude bits at bf16 bits 8..6 and its sign at bit 15:
((t & 0x000F000F) * 0x1040) & 0x81C081C0 (shifts by 6 and 12 whose fields do not overlap;
0x00F000F0 and 0x104 for high nibbles). That bf16 is e2m1 * 2^-126 exactly (its exponent
field is the e2m1 exponent, so the subnormal 0.5 is right too). One fma by the block
scale times 2^118 (in bf16, exact) gives e2m1 * scale * 2^-8, exact. The interpreter runs
the plain Triton decode, which gives the same values.

K orders (``ORDER``):

- 64, the unit order: in each unit of 64 elements, position 16 s + 8 b + 2 q + a holds
  element 16 q + 4 s + 2 a + b (s, q < 4; a, b < 2): what the asm's output registers hold
  when one thread decodes 8 consecutive code bytes, so the move into the wgmma fragment
  is almost free (3.7 instead of 5.6 SASS instructions a weight);
- 32, the chunk order, where 64 does not divide K or the K tile: for each 32 elements the
  16 even (low-nibble) ones, then the 16 odd ones.

W4A8 (``decode_e4m3``) takes the weights to e4m3(code x scale / 8) (numerics section 5a):
the bf16 decode times 32 (exact), then the hardware's round-to-nearest-even conversion,
in W4A8's unit order where 64 divides K (position 16 s + 4 q + 2 a + b holds element
16 q + 4 s + 2 a + b: a thread's 16 decoded values are its bytes of the FP8 wgmma
fragment of two k32 steps), else in natural order.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ..common import nibble_to_f16, order_rows, round_e4m3

__all__ = ["CHUNK_DECODE_ASM", "HALF_DECODE_ASM", "decode_e4m3", "decode_lohi", "decode_permuted"]


def _decode_asm(words: int) -> str:
    """The inline-PTX decode of ``words`` 32-bit words of codes (4 bytes each): outputs
    the low-nibble registers, then the high-nibble ones, then the inputs: the code words
    and one bf16x2 scale register a byte pair."""
    n = 2 * words  # byte pairs: output registers a nibble half
    return (
        "{\n.reg .b32 t, u, z;\nmov.b32 z, 0x80008000;\n"
        + "".join(
            f"prmt.b32 t, ${2 * n + j // 2}, 0, {'0x4342' if j % 2 else '0x4140'};\n"
            f"and.b32 u, t, 0x000F000F;\nmul.lo.u32 u, u, 0x1040;\nand.b32 u, u, 0x81C081C0;\n"
            f"fma.rn.bf16x2 ${j}, u, ${2 * n + words + j}, z;\n"
            f"and.b32 u, t, 0x00F000F0;\nmul.lo.u32 u, u, 0x104;\nand.b32 u, u, 0x81C081C0;\n"
            f"fma.rn.bf16x2 ${n + j}, u, ${2 * n + words + j}, z;\n"
            for j in range(n)
        )
        + "}"
    )


# 8 code bytes a call (outputs lo $0-$3, hi $4-$7; codes $8-$9; scales $10-$13), and 4
# (half a unit's k16 steps: lo $0-$1, hi $2-$3; codes $4; scales $5-$6)
CHUNK_DECODE_ASM = tl.constexpr(_decode_asm(2))
HALF_DECODE_ASM = tl.constexpr(_decode_asm(1))


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
            CHUNK_DECODE_ASM, "=r,=r,=r,=r,=r,=r,=r,=r,r,r,r,r,r,r", [codes, sb],
            dtype=(tl.bfloat16, tl.bfloat16), is_pure=True, pack=8,
        )  # fmt: skip
        return lo.to(OUT), hi.to(OUT)
    else:
        s = scales.to(tl.float32) * 0.00390625
        s = tl.reshape(tl.broadcast_to(s[:, :, None], (R, C // 16, 8)), (R, C // 2))
        lo = nibble_to_f16(codes & 0xF).to(tl.float32) * 16384.0
        hi = nibble_to_f16(codes >> 4).to(tl.float32) * 16384.0
        return (lo * s).to(OUT), (hi * s).to(OUT)


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
    """codes [R, C/2] and scales [R, C/16] to [R, C] in the K order ``ORDER`` (64 or 32,
    see the module docstring)."""
    lo, hi = decode_lohi(codes, scales, R, C, ASM, OUT)
    if ORDER == 64:  # join(lo, hi) is the tile in natural order
        return order_rows(tl.reshape(tl.join(lo, hi), (R, C)), R, C, ORDER)
    else:
        v = tl.join(tl.reshape(lo, (R, C // 32, 16)), tl.reshape(hi, (R, C // 32, 16)))
        return tl.reshape(tl.permute(v, (0, 1, 3, 2)), (R, C))


@triton.jit
def decode_e4m3(codes, scales, R: tl.constexpr, C: tl.constexpr, ASM: tl.constexpr,
                ORDER: tl.constexpr):  # fmt: skip
    """codes [R, C/2] and scales [R, C/16] to W4A8's weights e4m3(code x scale / 8), [R, C]
    in the unit order (``ORDER`` 64) or natural order: float8e4nv (``ASM``, the GPU), or
    in the interpreter fp32 holding the same values."""
    if ASM:
        lo, hi = decode_lohi(codes, scales, R, C, ASM, tl.bfloat16)
        v = (tl.join(lo, hi).to(tl.float32) * 32.0).to(tl.float8e4nv)
    else:
        lo, hi = decode_lohi(codes, scales, R, C, ASM, tl.float32)
        v = round_e4m3(tl.join(lo, hi) * 32.0)
    if ORDER == 64:  # [r, unit, q, s, a, b] -> [r, unit, s, q, a, b]
        v = tl.reshape(v, (R, C // 64, 4, 4, 2, 2))
        return tl.reshape(tl.permute(v, (0, 1, 3, 2, 4, 5)), (R, C))
    else:
        return tl.reshape(v, (R, C))
