"""The NVFP4 format in plain PyTorch: quantize, dequantize, pack (numerics sections 1 and 2).

This module is the specification in code for the format. It runs on any device and is
written to be read; the Triton kernels are tested bit for bit against it.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

__all__ = [
    "BLOCK",
    "E2M1_VALUES",
    "FP4_MAX",
    "GLOBAL_DIVISOR",
    "SCALE_MAX",
    "NVFP4Tensor",
    "decode_e2m1",
    "dequantize_nvfp4",
    "encode_e2m1",
    "pack_codes",
    "quantize_nvfp4",
    "unpack_codes",
]

BLOCK = 16  # elements per e4m3 block scale
FP4_MAX = 6.0  # largest e2m1 magnitude
SCALE_MAX = 448.0  # largest e4m3 (float8_e4m3fn) value
GLOBAL_DIVISOR = FP4_MAX * SCALE_MAX  # 2688: global = amax / 2688
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)  # magnitude index 0..7


@dataclass(frozen=True)
class NVFP4Tensor:
    """A matrix (or a stack of matrices) in NVFP4, quantized along its last axis.

    Attributes:
        codes: uint8 [..., R, C // 2]; element 2j in the low nibble, 2j+1 in the high one.
        scales: float8_e4m3fn [..., R, C // 16]; one decode scale per 16 elements of a row.
        global_scale: float32, either a scalar tensor (per-tensor) or [..., R] (per row).
    """

    codes: torch.Tensor
    scales: torch.Tensor
    global_scale: torch.Tensor

    @property
    def shape(self) -> torch.Size:
        """Logical shape [..., R, C] of the decoded matrix."""
        return torch.Size((*self.codes.shape[:-1], self.codes.shape[-1] * 2))

    @property
    def per_row(self) -> bool:
        return self.global_scale.dim() > 0

    @property
    def device(self) -> torch.device:
        return self.codes.device

    def nbytes(self) -> int:
        """Bytes held by codes, block scales and global scales."""
        return sum(
            t.numel() * t.element_size() for t in (self.codes, self.scales, self.global_scale)
        )

    def to(self, device: torch.device | str) -> NVFP4Tensor:
        return NVFP4Tensor(
            self.codes.to(device), self.scales.to(device), self.global_scale.to(device)
        )


# --------------------------------------------------------------------------- e2m1 codes


def encode_e2m1(v: torch.Tensor) -> torch.Tensor:
    """Round fp32 values to e2m1 codes (uint8 in 0..15): nearest, ties to even, saturating at 6.

    The sign bit (bit 3) is set for v < 0, also where the magnitude rounds to 0 (code 8).
    Ties fall at 0.25, 0.75, 1.25, 1.75, 2.5, 3.5 and 5; each goes to the even magnitude
    index (0, 2, 2, 4, 4, 6, 6), that is to the candidate whose mantissa bit is 0.
    """
    if v.dtype != torch.float32:
        raise TypeError(f"encode_e2m1: v must be float32, got {v.dtype}")
    m = v.abs()
    # Boundary between index i and i+1: a tie goes down when i is even (strict >), up when odd.
    idx = (
        (m > 0.25).to(torch.uint8)
        + (m >= 0.75).to(torch.uint8)
        + (m > 1.25).to(torch.uint8)
        + (m >= 1.75).to(torch.uint8)
        + (m > 2.5).to(torch.uint8)
        + (m >= 3.5).to(torch.uint8)
        + (m > 5.0).to(torch.uint8)
    )
    sign = (v < 0).to(torch.uint8) << 3
    return sign | idx


def decode_e2m1(codes: torch.Tensor) -> torch.Tensor:
    """e2m1 codes (uint8 0..15, one per element) to fp32 values; code 8 ("-0") gives 0."""
    return _e2m1_table(codes.device)[codes.long()]


@functools.cache
def _e2m1_table(device: torch.device) -> torch.Tensor:
    # Cached per device: a host-to-device copy is not allowed inside CUDA-graph capture, so
    # a first (eager) call puts the table on the device and captured calls reuse it.
    table = torch.tensor(E2M1_VALUES + tuple(-x for x in E2M1_VALUES), dtype=torch.float32)
    table[8] = 0.0
    return table.to(device)


def pack_codes(codes: torch.Tensor) -> torch.Tensor:
    """[..., C] codes (uint8 0..15) to [..., C // 2] bytes: element 2j low nibble, 2j+1 high."""
    if codes.shape[-1] % 2:
        raise ValueError(f"pack_codes: last dimension must be even, got {codes.shape[-1]}")
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def unpack_codes(packed: torch.Tensor) -> torch.Tensor:
    """[..., C // 2] bytes to [..., C] codes (uint8 0..15)."""
    lo = packed & 0x0F
    hi = packed >> 4
    return torch.stack((lo, hi), dim=-1).flatten(-2)


# --------------------------------------------------------------------------- quantize


def _check_matrix(x: torch.Tensor, name: str) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise TypeError(f"{name}: expected bfloat16, float16 or float32, got {x.dtype}")
    if x.dim() < 2:
        raise ValueError(
            f"{name}: expected at least 2 dimensions [..., R, C], got {tuple(x.shape)}"
        )
    if x.shape[-1] % 32:
        raise ValueError(
            f"{name}: the quantized (last) dimension must be a multiple of 32, got {x.shape[-1]}"
        )


def global_from_amax(amax: torch.Tensor) -> torch.Tensor:
    """numerics 2.1: global = amax / 2688 in fp32; amax = 0 gives 1."""
    amax = amax.to(torch.float32)
    # A tensor divisor: PyTorch's CUDA kernels turn division by a Python scalar into a
    # multiplication by its reciprocal, which is not the correctly rounded quotient.
    g = amax / torch.full_like(amax, GLOBAL_DIVISOR)
    return torch.where(amax == 0, torch.ones_like(g), g)


def quantize_blocks(
    x: torch.Tensor, global_scale: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """numerics 2.2 and 2.3 for a given global scale.

    Args:
        x: [..., R, C] float tensor (any float dtype; converted to fp32 exactly).
        global_scale: fp32, broadcastable to [..., R, 1] (scalar or [..., R]).

    Returns:
        (codes uint8 [..., R, C // 2], scales float8_e4m3fn [..., R, C // 16]).
    """
    xf = x.to(torch.float32)
    g = global_scale.to(torch.float32)
    if g.dim() > 0:
        g = g.unsqueeze(-1)  # [..., R, 1]
    blocks = xf.unflatten(-1, (-1, BLOCK))  # [..., R, C/16, 16]
    amax_block = blocks.abs().amax(dim=-1)  # [..., R, C/16]
    s = (amax_block / (FP4_MAX * g)).clamp(max=SCALE_MAX).to(torch.float8_e4m3fn)
    denom = s.to(torch.float32) * g  # [..., R, C/16]
    safe = torch.where(denom == 0, torch.ones_like(denom), denom)
    v = blocks / safe.unsqueeze(-1)
    codes = encode_e2m1(v)
    codes = torch.where((denom == 0).unsqueeze(-1), torch.zeros_like(codes), codes)
    return pack_codes(codes.flatten(-2)), s


def quantize_nvfp4(
    x: torch.Tensor,
    *,
    global_scale: torch.Tensor | float | None = None,
    per_row: bool = False,
) -> NVFP4Tensor:
    """Quantize ``x`` to NVFP4 along its last axis (numerics section 2).

    Args:
        x: bf16, fp16 or fp32 [..., R, C] with C a multiple of 32.
        global_scale: a static (calibrated) decode global scale; a float or fp32 tensor,
            scalar or [..., R]. None computes it from amax.
        per_row: compute one global scale per row (per-token activations) instead of one
            for the whole tensor. Ignored when ``global_scale`` is given.

    Returns:
        NVFP4Tensor with codes uint8 [..., R, C // 2], scales e4m3 [..., R, C // 16] and
        global_scale fp32 (scalar, or [..., R] when per row).
    """
    _check_matrix(x, "x")
    if global_scale is not None:
        g = torch.as_tensor(global_scale, dtype=torch.float32, device=x.device)
        if g.dim() > 0 and tuple(g.shape) != tuple(x.shape[:-1]):
            raise ValueError(
                f"global_scale: expected a scalar or shape {tuple(x.shape[:-1])}, "
                f"got {tuple(g.shape)}"
            )
        if not bool(torch.isfinite(g).all()) or bool((g <= 0).any()):
            raise ValueError("global_scale: must be finite and positive")
    elif per_row:
        g = global_from_amax(x.abs().amax(dim=-1))
    else:
        g = global_from_amax(x.abs().amax())
    codes, scales = quantize_blocks(x, g)
    return NVFP4Tensor(codes, scales, g)


def dequantize_blocks(codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """deq() of numerics section 5: codes times block scales, no global, in fp32 (exact in bf16)."""
    vals = decode_e2m1(unpack_codes(codes))  # [..., R, C]
    s = scales.to(torch.float32).repeat_interleave(BLOCK, dim=-1)
    return vals * s


def dequantize_nvfp4(q: NVFP4Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Decode an NVFP4 matrix: e2m1(code) * fp32(scale) * global, in fp32, cast to ``dtype``.

    Returns:
        [..., R, C] tensor of ``dtype``.
    """
    if not isinstance(q, NVFP4Tensor):
        raise TypeError(f"q: expected an NVFP4Tensor, got {type(q).__name__}")
    v = dequantize_blocks(q.codes, q.scales)
    g = q.global_scale.to(torch.float32)
    if g.dim() > 0:
        g = g.unsqueeze(-1)
    return (v * g).to(dtype)
