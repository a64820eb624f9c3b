"""moe(): validation, mode and finalize selection, dispatch to a backend."""

from __future__ import annotations

from typing import Literal

import torch

from .backend.options import Options
from .backend.plan import Plan
from .experts import PreparedExperts

__all__ = ["ACT_SCALES", "BACKENDS", "MODES", "moe", "plan", "validate_moe_inputs"]

MODES = ("w4a16", "w4a4")
ACT_SCALES = ("per_token", "static", "per_tensor")
BACKENDS = ("auto", "reference", "triton")

Mode = Literal["w4a16", "w4a4"]
ActScale = Literal["per_token", "static", "per_tensor"]
Backend = Literal["auto", "reference", "triton"]


def _choice(value: str, allowed: tuple[str, ...], name: str) -> None:
    if value not in allowed:
        raise ValueError(f"{name}: expected one of {allowed}, got {value!r}")


def validate_moe_inputs(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    experts: PreparedExperts,
    *,
    mode: str,
    act_scale: str,
    check_ids: bool,
) -> None:
    """SPEC section 9 for one call. ``check_ids`` reads the ids (a host sync on a GPU)."""
    if not isinstance(experts, PreparedExperts):
        raise TypeError(f"experts: expected PreparedExperts, got {type(experts).__name__}")
    _choice(mode, MODES, "mode")
    if mode == "w4a4":
        _choice(act_scale, ACT_SCALES, "act_scale")
        if act_scale == "static" and experts.a13_scale is None:
            raise ValueError(
                "act_scale: 'static' needs calibrated activation scales, but these experts "
                "were prepared without a13_scale/a2_scale"
            )
    for name, t in (("x", x), ("topk_ids", topk_ids), ("topk_weights", topk_weights)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 2:
            raise ValueError(f"{name}: expected 2 dimensions, got shape {tuple(t.shape)}")
        if t.device != experts.device:
            raise ValueError(f"{name}: on {t.device}, but the experts are on {experts.device}")
    if x.dtype != torch.bfloat16:
        raise TypeError(f"x: expected torch.bfloat16, got {x.dtype}")
    if topk_ids.dtype != torch.int32:
        raise TypeError(f"topk_ids: expected torch.int32, got {topk_ids.dtype}")
    if topk_weights.dtype != torch.float32:
        raise TypeError(f"topk_weights: expected torch.float32, got {topk_weights.dtype}")
    t, h = x.shape
    if h != experts.hidden_size:
        raise ValueError(f"x: hidden size {h} does not match the experts' {experts.hidden_size}")
    if topk_ids.shape[0] != t:
        raise ValueError(f"topk_ids: expected {t} rows (tokens of x), got {topk_ids.shape[0]}")
    if topk_weights.shape != topk_ids.shape:
        raise ValueError(
            f"topk_weights: expected shape {tuple(topk_ids.shape)} like topk_ids, "
            f"got {tuple(topk_weights.shape)}"
        )
    if topk_ids.shape[1] < 1:
        raise ValueError("topk_ids: K (routes per token) must be at least 1")
    if check_ids and topk_ids.numel():
        hi = int(topk_ids.max())
        if hi >= experts.num_experts:
            raise ValueError(
                f"topk_ids: expert id {hi} out of range; these experts hold "
                f"{experts.num_experts} (ids 0..{experts.num_experts - 1}, negative = masked)"
            )


def moe(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    experts: PreparedExperts,
    *,
    mode: Mode = "w4a16",
    act_scale: ActScale = "per_token",
    fused_finalize: bool = False,
    backend: Backend = "auto",
    validate_ids: bool = False,
    options: Options | None = None,
) -> torch.Tensor:
    """One MoE layer over prepared NVFP4 experts (SPEC sections 4 to 7).

    Args:
        x: bf16 [T, H] tokens.
        topk_ids: int32 [T, K] local expert ids; negative ids are masked routes.
        topk_weights: fp32 [T, K] router weights.
        experts: the prepared experts (E experts, hidden size H); never modified.
        mode: "w4a16" (bf16 activations) or "w4a4" (activations quantized to NVFP4).
        act_scale: W4A4 activation global scale: "per_token", "static" (calibrated
            a13/a2 scales of the experts) or "per_tensor" (dynamic over the whole batch, so
            results depend on the other tokens). Ignored for W4A16.
        fused_finalize: add the weighted expert outputs with atomics in the last GEMM
            (fastest, not bitwise reproducible) instead of the deterministic finalize.
        backend: "reference" (plain PyTorch, any device), "triton" (CUDA kernels) or "auto"
            (triton on a CUDA device, the reference elsewhere).
        validate_ids: also check ids < E where that costs a host sync (CUDA tensors). On
            CPU the ids are always checked.
        options: ``fp4moe.Options`` for the triton backend (PDL, pinned tiles, under
            expert parallelism by masking ``valid_fraction`` = 1 / ranks, NaN poisoning for
            tests). Every option gives the same bits. Ignored by the reference. Which
            kernels a call runs: ``fp4moe.plan`` / ``fp4moe.explain``.

    Returns:
        bf16 [T, H].
    """
    _choice(backend, BACKENDS, "backend")
    if options is not None and not isinstance(options, Options):
        raise TypeError(f"options: expected fp4moe.Options or None, got {type(options).__name__}")
    on_cuda = isinstance(x, torch.Tensor) and x.is_cuda
    validate_moe_inputs(
        x,
        topk_ids,
        topk_weights,
        experts,
        mode=mode,
        act_scale=act_scale,
        check_ids=validate_ids or not on_cuda or backend == "reference",
    )
    if x.shape[0] == 0:
        return torch.empty(0, x.shape[1], dtype=torch.bfloat16, device=x.device)
    if backend == "auto":
        backend = "triton" if on_cuda else "reference"
    if backend == "reference":
        from .reference import moe_reference

        return moe_reference(x, topk_ids, topk_weights, experts, mode=mode, act_scale=act_scale)
    from .backend.launch import moe_triton

    return moe_triton(
        x,
        topk_ids,
        topk_weights,
        experts,
        mode=mode,
        act_scale=act_scale,
        fused_finalize=fused_finalize,
        options=options,
    )


def plan(
    experts: PreparedExperts,
    num_tokens: int,
    top_k: int,
    *,
    mode: Mode = "w4a16",
    act_scale: ActScale = "per_token",
    fused_finalize: bool = False,
    options: Options | None = None,
) -> Plan:
    """Which kernels ``moe(..., backend="triton")`` runs for ``num_tokens`` tokens of
    ``top_k`` routes over ``experts`` (the plan of the experts' CUDA device; an H200's
    where the experts are on the CPU). ``fp4moe.explain(plan)`` says it in words.

    Returns:
        the frozen ``fp4moe.Plan`` (per GEMM: kernel family, tile, K split; the sort,
        quantize and finalize choices).
    """
    from .backend import H200, plan_call, target_for

    if not isinstance(experts, PreparedExperts):
        raise TypeError(f"experts: expected PreparedExperts, got {type(experts).__name__}")
    for name, v, low in (("num_tokens", num_tokens, 0), ("top_k", top_k, 1)):
        if isinstance(v, bool) or not isinstance(v, int) or v < low:
            raise ValueError(f"{name}: expected an int >= {low}, got {v!r}")
    _choice(mode, MODES, "mode")
    _choice(act_scale, ACT_SCALES, "act_scale")
    if options is not None and not isinstance(options, Options):
        raise TypeError(f"options: expected fp4moe.Options or None, got {type(options).__name__}")
    target = target_for(experts.device) if experts.device.type == "cuda" else H200
    return plan_call(
        num_tokens, top_k, experts.num_experts, experts.hidden_size,
        experts.intermediate_size, mode=mode, act_scale=act_scale,
        fused_finalize=fused_finalize, options=options or Options(), target=target,
    )  # fmt: skip
