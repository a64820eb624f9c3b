"""The NVFP4 decode shared by every GEMM family: two e2m1 nibbles and their e4m3 block
scale to bf16 operand values, in the K order the GEMMs multiply in.

Decoded values carry a factor 2^-8 (each GEMM's epilogue undoes it on the fp32
accumulator), so that e2m1 times an e4m3 scale is exact in bf16 (at most 6 significant
bits, 2^-18 to 10.5).

Weight codes come in the fields layout of the prepared experts (``fields``): the decode of
a 32-bit word of codes (8 elements) is four bf16 pair registers, each one rotate and one
mask of the word (the fourth two masks and a shift-add), holding each element's magnitude
bits at bf16 bits 8..6 and its sign at bit 15: that bf16 is e2m1 * 2^-126 exactly (its
exponent field is the e2m1 exponent, so the subnormal 0.5 is right too). One fma by the
block scale times 2^118 (in bf16, exact) gives e2m1 * scale * 2^-8, exact. Activation
codes (W4A4 rows, which the quantize kernels write linear) take the linear decode, the
same registers from a byte permute, two masks and one multiply a register:
((t & 0x000F000F) * 0x1040) & 0x81C081C0 (0x00F000F0 and 0x104 for high nibbles). The
interpreter runs plain Triton with the same values.

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
from .fields import FIELD_MASK, FIELD_ROTATIONS, LAST_KEEP, LAST_MOVE, LAST_SHIFT, REGISTERS

__all__ = [
    "CHUNK_DECODE_ASM",
    "HALF_DECODE_ASM",
    "LINEAR_DECODE_ASM",
    "WORD_DECODE_ASM",
    "decode_e4m3",
    "decode_lohi",
    "decode_permuted",
    "decode_words",
]

_MASK = tl.constexpr(FIELD_MASK)
_KEEP = tl.constexpr(LAST_KEEP)
_MOVE = tl.constexpr(LAST_MOVE)
_SHIFT = tl.constexpr(LAST_SHIFT)
_ROT0 = tl.constexpr(FIELD_ROTATIONS[0])
_ROT1 = tl.constexpr(FIELD_ROTATIONS[1])
_ROT2 = tl.constexpr(FIELD_ROTATIONS[2])


def _register(out: str, word: str, reg: int, scale: str) -> str:
    """PTX of one bf16 pair register of a fields-layout ``word`` (``fields``' register
    ``reg``: 0 (e0, e2), 1 (e4, e6), 2 (e1, e3), 3 (e5, e7)), times ``scale``, into ``out``."""
    if reg < 3:
        bits = (f"shf.l.wrap.b32 t, {word}, {word}, {FIELD_ROTATIONS[reg]};\n"
                f"and.b32 t, t, {FIELD_MASK:#x};\n")  # fmt: skip
    else:
        bits = (f"and.b32 t, {word}, {LAST_MOVE:#x};\nand.b32 u, {word}, {LAST_KEEP:#x};\n"
                f"mad.lo.u32 t, t, {1 << LAST_SHIFT}, u;\n")  # fmt: skip
    return bits + f"fma.rn.bf16x2 {out}, t, {scale}, z;\n"


def _decode_asm(words: int, fields: bool = True) -> str:
    """The inline-PTX decode of ``words`` 32-bit words of codes (4 bytes each): outputs
    the low-nibble registers, then the high-nibble ones (each bf16 pair: the nibbles of two
    adjacent bytes, as the linear form places the elements), then the inputs: the code
    words and one bf16x2 scale register a byte pair. ``fields``: the words are in the
    fields layout (weights), else linear (activations)."""
    n = 2 * words  # byte pairs: output registers a nibble half
    head = "{\n.reg .b32 t, u, z;\nmov.b32 z, 0x80008000;\n"
    if fields:  # word w: low (e0, e2), (e4, e6) to j = 2w, 2w + 1; high (e1, e3), (e5, e7)
        return (
            head
            + "".join(
                _register(f"${j}", f"${2 * n + w}", reg, f"${2 * n + words + j % n}")
                for w in range(words)
                for reg, j in enumerate((2 * w, 2 * w + 1, n + 2 * w, n + 2 * w + 1))
            )
            + "}"
        )
    return (
        head
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


def _word_asm() -> str:
    """The decode of one fields-layout word ($8) with its block's bf16 scale ($9) into its
    8 elements in order, one bf16 an output ($0-$7)."""
    return (
        "{\n.reg .b32 t, u, z, s, v;\nmov.b32 z, 0x80008000;\nmov.b32 s, {$9, $9};\n"
        + "".join(
            _register("v", "$8", reg, "s") + f"mov.b32 {{${a}, ${b}}}, v;\n"
            for reg, (a, b) in enumerate(REGISTERS)
        )
        + "}"
    )


# Weights (fields layout), 8 code bytes a call (outputs lo $0-$3, hi $4-$7; codes $8-$9;
# scales $10-$13), and 4 (half a unit's k16 steps: lo $0-$1, hi $2-$3; codes $4; scales
# $5-$6); one word a call to its elements in order (``decode_words``). Activations
# (linear), 8 code bytes a call.
CHUNK_DECODE_ASM = tl.constexpr(_decode_asm(2))
HALF_DECODE_ASM = tl.constexpr(_decode_asm(1))
WORD_DECODE_ASM = tl.constexpr(_word_asm())
LINEAR_DECODE_ASM = tl.constexpr(_decode_asm(2, fields=False))


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
            LINEAR_DECODE_ASM, "=r,=r,=r,=r,=r,=r,=r,=r,r,r,r,r,r,r", [codes, sb],
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
def _quads(a0, a1, a2, a3, R: tl.constexpr, C: tl.constexpr):
    """Four [R, C/8] tiles to one [R, C/2]: ``a{k}`` at position 4 w + k of word w."""
    return tl.reshape(tl.join(tl.join(a0, a2), tl.join(a1, a3)), (R, C // 2))


@triton.jit
def decode_words(words, scales, R: tl.constexpr, C: tl.constexpr, ASM: tl.constexpr,
                 OUT: tl.constexpr):  # fmt: skip
    """Weight code words int32 [R, C/8] in the fields layout (``fields``) and e4m3 scales
    [R, C/16] to ``decode_lohi``'s two [R, C/2] tiles of OUT: the even elements, then the
    odd ones, each value times 2^-8 (exact). Each word is decoded on its own, so the
    values do not depend on the layout the compiler gives the tiles."""
    if ASM:
        sc = (scales.to(tl.float32) * 3.32306998946229e35).to(tl.bfloat16)
        sw = tl.reshape(tl.broadcast_to(sc[:, :, None], (R, C // 16, 2)), (R, C // 8))
        e0, e1, e2, e3, e4, e5, e6, e7 = tl.inline_asm_elementwise(
            WORD_DECODE_ASM, "=h,=h,=h,=h,=h,=h,=h,=h,r,h", [words, sw],
            dtype=(tl.bfloat16,) * 8, is_pure=True, pack=1,
        )  # fmt: skip
        lo = _quads(e0.to(OUT), e2.to(OUT), e4.to(OUT), e6.to(OUT), R, C)
        hi = _quads(e1.to(OUT), e3.to(OUT), e5.to(OUT), e7.to(OUT), R, C)
        return lo, hi
    else:
        # the asm's registers, all four at once (few operations: the interpreter's cost),
        # read back into linear code bytes for decode_lohi
        x = (words.to(tl.int64) & 0xFFFFFFFF)[:, :, None]
        k = tl.arange(0, 4)[None, None, :]
        d = tl.where(k == 0, _ROT0, tl.where(k == 1, _ROT1, _ROT2)).to(tl.int64)
        rot = ((x << d) | (x >> (32 - d))) & _MASK
        regs = tl.where(k == 3, (x & _KEEP) + ((x & _MOVE) << _SHIFT), rot)  # [R, C/8, 4]
        r = regs[:, :, :, None]
        h = (tl.arange(0, 2) * 16)[None, None, None, :].to(tl.int64)
        nib = ((r >> (6 + h)) & 7) | ((r >> (12 + h)) & 8)  # [R, C/8, 4 registers, 2 halves]
        # registers 0, 1 hold the even elements (e0, e2, e4, e6), 2 and 3 the odd ones
        even, odd = tl.split(tl.permute(tl.reshape(nib, (R, C // 8, 2, 4)), (0, 1, 3, 2)))
        codes = tl.reshape(even | (odd << 4), (R, C // 2)).to(tl.uint8)
        return decode_lohi(codes, scales, R, C, ASM, OUT)


@triton.jit
def decode_permuted(
    codes,
    scales,
    R: tl.constexpr,
    C: tl.constexpr,
    ASM: tl.constexpr,
    OUT: tl.constexpr,
    ORDER: tl.constexpr = 32,
    FIELDS: tl.constexpr = False,
):
    """codes [R, C/2] (linear: activation rows) or, with ``FIELDS``, code words int32
    [R, C/8] in the fields layout (weights), and scales [R, C/16] to [R, C] in the K order
    ``ORDER`` (64 or 32, see the module docstring)."""
    if FIELDS:
        lo, hi = decode_words(codes, scales, R, C, ASM, OUT)
    else:
        lo, hi = decode_lohi(codes, scales, R, C, ASM, OUT)
    if ORDER == 64:  # join(lo, hi) is the tile in natural order
        return order_rows(tl.reshape(tl.join(lo, hi), (R, C)), R, C, ORDER)
    else:
        v = tl.join(tl.reshape(lo, (R, C // 32, 16)), tl.reshape(hi, (R, C // 32, 16)))
        return tl.reshape(tl.permute(v, (0, 1, 3, 2)), (R, C))


@triton.jit
def decode_e4m3(words, scales, R: tl.constexpr, C: tl.constexpr, ASM: tl.constexpr,
                ORDER: tl.constexpr):  # fmt: skip
    """Weight code words int32 [R, C/8] (fields layout) and scales [R, C/16] to W4A8's
    weights e4m3(code x scale / 8), [R, C] in the unit order (``ORDER`` 64) or natural
    order: float8e4nv (``ASM``, the GPU), or in the interpreter fp32 holding the same
    values."""
    if ASM:
        lo, hi = decode_words(words, scales, R, C, ASM, tl.bfloat16)
        v = (tl.join(lo, hi).to(tl.float32) * 32.0).to(tl.float8e4nv)
    else:
        lo, hi = decode_words(words, scales, R, C, ASM, tl.float32)
        v = round_e4m3(tl.join(lo, hi) * 32.0)
    if ORDER == 64:  # [r, unit, q, s, a, b] -> [r, unit, s, q, a, b]
        v = tl.reshape(v, (R, C // 64, 4, 4, 2, 2))
        return tl.reshape(tl.permute(v, (0, 1, 3, 2, 4, 5)), (R, C))
    else:
        return tl.reshape(v, (R, C))
