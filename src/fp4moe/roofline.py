"""The roofline model of a MoE call (docs/performance.md): the larger of its byte floor
(the touched NVFP4 expert bytes at the card's copy bandwidth) and its FLOPs at the card's
matmul rate (FP8 for W4A8, bf16 otherwise), with the ceilings ``bench.card_ceilings``
measures."""

from __future__ import annotations

from .presets import MODES

__all__ = ["bound", "compute_roof", "compute_us", "roofline_us"]


def compute_roof(mode: str) -> str:
    """The ceiling whose matmul rate bounds a mode name's compute: "fp8" for W4A8 (FP8
    tensor cores), else "bf16" (W4A16, and W4A4, which multiplies in bf16 on Hopper)."""
    return "fp8" if MODES[mode][0] == "w4a8" else "bf16"


def roofline_us(mode: str, floor_us: float, flops: float, ceilings: dict) -> float:
    """The roofline of one call of mode name ``mode``: the larger of the byte floor
    ``floor_us`` and ``flops`` at the card's matmul rate of ``compute_roof(mode)``
    (``ceilings`` as ``card_ceilings`` gives them), in microseconds."""
    return max(floor_us, compute_us(mode, flops, ceilings))


def compute_us(mode: str, flops: float, ceilings: dict) -> float:
    """``flops`` at the card's matmul rate of ``compute_roof(mode)``, in microseconds."""
    return flops / ceilings[f"{compute_roof(mode)}_matmul_flops"] * 1e6


def bound(mode: str, floor_us: float, flops: float, ceilings: dict) -> str:
    """Which floor sets a call's roofline: "bytes" (the touched weights at the copy rate)
    or "compute" (the FLOPs at the mode's matmul rate)."""
    return "bytes" if floor_us >= compute_us(mode, flops, ceilings) else "compute"
