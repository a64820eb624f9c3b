"""The fields layout of prepared weight codes: where each e2m1 code's four bits lie in its
32-bit word, so that the decode (``decode``) is one or two instructions a bf16 pair.

A word is four code bytes of a row, read little-endian: elements 8 w .. 8 w + 7 of the row
(in the linear form of numerics section 1, nibble n of the word holds element 8 w + n).
The decode makes four bf16x2 registers of a word: (e0, e2), (e4, e6), (e1, e3) and (e5,
e7), element e's magnitude bits at bf16 bits 8..6 of its half and its sign at bit 15, all
other bits zero: that bf16 is e2m1 * 2^-126 exactly. In the fields layout each register is

    (e0, e2) = rotl(w, 4) & FIELD_MASK
    (e4, e6) = rotl(w, 10) & FIELD_MASK
    (e1, e3) = rotl(w, 14) & FIELD_MASK
    (e5, e7) = (w & 0x80C080C0) + ((w & 0x00010001) << 8)

(rotl: rotate left), so a word's bits are a permutation of the linear word's: the same
bytes, rows and block scales, only the bits within each word moved. The linear layout needs
a byte permute, two masks and a multiply a register instead (``decode.LINEAR_DECODE_ASM``,
kept for activation codes, which the quantize kernels write linear).
"""

from __future__ import annotations

import functools

import torch

__all__ = [
    "FIELD_MASK",
    "FIELD_ROTATIONS",
    "LAST_KEEP",
    "LAST_MOVE",
    "LAST_SHIFT",
    "REGISTERS",
    "field_bit",
    "from_fields",
    "to_fields",
]

FIELD_MASK = 0x81C081C0  # a bf16 pair's magnitude bits 8..6 and sign bit 15, both halves
FIELD_ROTATIONS = (4, 10, 14)  # registers (e0, e2), (e4, e6), (e1, e3)
LAST_KEEP = 0x80C080C0  # register (e5, e7): these bits in place,
LAST_MOVE = 0x00010001  # these moved up by LAST_SHIFT (each half's magnitude bit 2)
LAST_SHIFT = 8

# the elements of the four registers, (low half, high half), in decode order
REGISTERS = ((0, 2), (4, 6), (1, 3), (5, 7))
_BF16_BIT = (6, 7, 8, 15)  # nibble bit (magnitude 0..2, sign) -> bit of its bf16 half


def field_bit(linear_bit: int) -> int:
    """The bit of a fields-layout word that holds bit ``linear_bit`` (0..31) of the linear
    word (nibble ``linear_bit // 4``, its bit ``linear_bit % 4``)."""
    element, b = divmod(linear_bit, 4)
    reg = next(i for i, pair in enumerate(REGISTERS) if element in pair)
    target = _BF16_BIT[b] + 16 * REGISTERS[reg].index(element)
    if reg < 3:
        return (target - FIELD_ROTATIONS[reg]) % 32
    return target - LAST_SHIFT if b == 2 else target


@functools.cache
def _moves(inverse: bool) -> tuple[tuple[int, int], ...]:
    """The permutation as (shift, mask) pairs: the bits that move by the same shift (left
    where positive), masked at their destination; 13 of them."""
    moves: dict[int, int] = {}
    for i in range(32):
        src, dst = (field_bit(i), i) if inverse else (i, field_bit(i))
        moves[dst - src] = moves.get(dst - src, 0) | (1 << dst)
    # as int32 masks (a right shift's sign bits fall outside its mask)
    return tuple((sh, m - (1 << 32) if m >> 31 else m) for sh, m in sorted(moves.items()))


def _permute(codes: torch.Tensor, inverse: bool) -> torch.Tensor:
    if codes.dtype != torch.uint8:
        raise TypeError(f"codes: expected torch.uint8 codes, got {codes.dtype}")
    if codes.dim() == 0 or codes.shape[-1] % 4:
        raise ValueError(
            f"codes: the last dimension (K/2 code bytes) must be a multiple of 4, got shape "
            f"{list(codes.shape)}"
        )
    out = torch.empty_like(codes, memory_format=torch.contiguous_format)
    if codes.numel() == 0:
        return out
    k = codes.shape[-1]
    src, dst = codes.reshape(-1, k), out.view(-1, k)
    # rows a chunk: about 1 MB of codes on the CPU, where a chunk's 13 passes then run in
    # the cache (2.7x the rate of 16 MB chunks on two cores), 16 MB elsewhere
    rows = max(1, (1 << (20 if codes.device.type == "cpu" else 24)) // k)
    tmp = torch.empty((min(rows, src.shape[0]), k // 4), dtype=torch.int32, device=codes.device)
    for r0 in range(0, src.shape[0], rows):
        w = src[r0 : r0 + rows].contiguous().view(torch.int32)
        acc, t = dst[r0 : r0 + rows].view(torch.int32), tmp[: w.shape[0]]
        for i, (sh, mask) in enumerate(_moves(inverse)):  # the bits moved by shift groups
            if sh > 0:
                torch.bitwise_left_shift(w, sh, out=t)
            elif sh < 0:
                torch.bitwise_right_shift(w, -sh, out=t)
            else:
                t.copy_(w)
            if i == 0:
                acc.copy_(t.bitwise_and_(mask))
            else:
                acc.bitwise_or_(t.bitwise_and_(mask))
    return out


def to_fields(codes: torch.Tensor) -> torch.Tensor:
    """Linear codes uint8 [..., K/2] (numerics section 1) to the fields layout: a new
    contiguous tensor of the same shape, dtype and device, each 32-bit word's bits permuted."""
    return _permute(codes, False)


def from_fields(codes: torch.Tensor) -> torch.Tensor:
    """The inverse of :func:`to_fields`: fields-layout codes back to the linear form."""
    return _permute(codes, True)
