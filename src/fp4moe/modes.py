"""The one vocabulary of execution modes, shared by ``moe()``, policies, the CLI and the bench.

======================= =========================================================
mode name               what runs (numerics section 5)
======================= =========================================================
``"w4a16"``             bf16 activations
``"w4a8"``              activations to e4m3 with one scale a row, weights to e4m3
                        from the same NVFP4 bytes, FP8 tensor cores (section 5a)
``"w4a4-token"``        activations quantized to NVFP4, one global scale a token
``"w4a4-tensor"``       one dynamic global scale over the whole batch (the output
                        of a token depends on the other tokens: numerics section 7)
``"w4a4-static"``       the experts' calibrated ``a13_scale`` / ``a2_scale``
======================= =========================================================

Policies add an optional ``"+fused"`` suffix for the fused finalize (``PhaseConfig``).

The older spelling of ``moe()`` (and ``MoERunner``), a kernel family plus an activation
scale, is accepted with this one mapping and nothing else:

====================================== ===============
``mode=..., act_scale=...``            is the name
====================================== ===============
``"w4a4"`` (act_scale left out)        ``"w4a4-token"``
``"w4a4", "per_token"``                ``"w4a4-token"``
``"w4a4", "per_tensor"``               ``"w4a4-tensor"``
``"w4a4", "static"``                   ``"w4a4-static"``
``"w4a16", "per_token"``               ``"w4a16"``
====================================== ===============

Any other ``act_scale`` is refused (W4A16 has no activation scale, so ``act_scale="static"``
with ``"w4a16"`` is an error, not ignored); so is an ``act_scale`` that contradicts a mode
name (``mode="w4a4-token", act_scale="static"``).
"""

from __future__ import annotations

import torch

__all__ = [
    "ACT_SCALES",
    "KERNEL_MODES",
    "MODE_NAMES",
    "TOLERANCE",
    "mode_name",
    "relative_error",
    "resolve_mode",
]

MODE_NAMES: tuple[str, ...] = ("w4a16", "w4a8", "w4a4-token", "w4a4-tensor", "w4a4-static")
# The kernel families and W4A4 activation scales the backends take (``moe_reference``,
# ``moe_triton``, ``PhaseConfig.mode`` / ``.act_scale``).
KERNEL_MODES: tuple[str, ...] = ("w4a16", "w4a8", "w4a4")
ACT_SCALES: tuple[str, ...] = ("per_token", "static", "per_tensor")
# A kernel's ||out - ref|| / ||ref|| against the reference, by kernel family (docs/numerics.md
# section 8): where the FC2 input is quantized to a few mantissa bits (e2m1, e4m3), a
# last-bit difference in FC1's output moves a whole quantization step; W4A8's FP8 tensor
# cores also accumulate with fewer bits than fp32.
TOLERANCE: dict[str, float] = {"w4a16": 2e-3, "w4a8": 2e-2, "w4a4": 1e-2}


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref|| / ||ref|| in fp32 (Frobenius; same shapes): what ``TOLERANCE`` bounds.
    0 where both are zero (or empty); where only ``ref`` is zero, a huge value (not NaN)."""
    ref = ref.float()
    return float((out.float() - ref).norm() / ref.norm().clamp_min(1e-30))


_BY_NAME: dict[str, tuple[str, str]] = {
    "w4a16": ("w4a16", "per_token"),
    "w4a8": ("w4a8", "per_token"),
    "w4a4-token": ("w4a4", "per_token"),
    "w4a4-tensor": ("w4a4", "per_tensor"),
    "w4a4-static": ("w4a4", "static"),
}


def mode_name(kernel_mode: str, act_scale: str = "per_token") -> str:
    """The mode name of a (kernel family, activation scale) pair: ``("w4a4", "static")``
    -> ``"w4a4-static"``; W4A16 and W4A8 ignore ``act_scale``."""
    if kernel_mode in ("w4a16", "w4a8"):
        return kernel_mode
    return "w4a4-" + act_scale.removeprefix("per_")


def _hint(mode: str) -> str:
    """' (did you mean ...)' for a near miss of a mode name, else ''."""
    m = mode.strip().lower().replace("_", "-")
    for short in ("token", "tensor", "static"):
        if m in (f"w4a4-per-{short}", f"w4a4{short}", f"w4a4/{short}"):
            return f" (did you mean 'w4a4-{short}'?)"
    if m in MODE_NAMES and m != mode:
        return f" (did you mean {m!r}?)"
    return ""


def resolve_mode(mode: str, act_scale: str | None = None) -> tuple[str, str]:
    """(kernel family, activation scale) of a mode name, or of the older pair (module
    docstring). Raises ValueError naming ``mode`` or ``act_scale`` for anything else."""
    if not isinstance(mode, str):
        raise TypeError(f"mode: expected a str, one of {MODE_NAMES}, got {type(mode).__name__}")
    if act_scale is not None and not isinstance(act_scale, str):
        raise TypeError(f"act_scale: expected a str or None, got {type(act_scale).__name__}")
    if mode in _BY_NAME:
        kernel, implied = _BY_NAME[mode]
        if act_scale is not None and act_scale != implied:
            why = (
                f"{kernel.upper()} has no activation scale choice"
                if kernel != "w4a4"
                else f"the mode name already says {implied!r}"
            )
            raise ValueError(
                f"act_scale: {act_scale!r} with mode={mode!r}: {why}; leave act_scale out "
                f"(modes: {MODE_NAMES})"
            )
        return kernel, implied
    if mode == "w4a4":
        scale = "per_token" if act_scale is None else act_scale
        if scale not in ACT_SCALES:
            raise ValueError(
                f"act_scale: expected one of {ACT_SCALES}, got {act_scale!r} (or pass one mode "
                f"name: {MODE_NAMES})"
            )
        return "w4a4", scale
    raise ValueError(f"mode: expected one of {MODE_NAMES}, got {mode!r}{_hint(mode)}")
