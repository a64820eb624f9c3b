"""moe(): validation, mode and finalize selection, dispatch to a backend through the
``fp4moe::moe`` custom op (``fp4moe.ops``)."""

from __future__ import annotations

from typing import Literal

import torch

from .backend.options import Options
from .backend.plan import Plan
from .experts import PreparedExperts
from .modes import ACT_SCALES, KERNEL_MODES, MODE_NAMES, resolve_mode
from .ops import expert_tensors, run_moe
from .routing import check_expert_ids

__all__ = [
    "ACT_SCALES",
    "BACKENDS",
    "MODES",
    "MODE_NAMES",
    "moe",
    "plan",
    "validate_moe_inputs",
]

# The kernel families (what ``PhaseConfig.mode`` and the backends take); the names a user
# passes are ``MODE_NAMES`` (``fp4moe.modes``).
MODES = KERNEL_MODES
BACKENDS = ("auto", "reference", "triton")

ModeName = Literal["w4a16", "w4a8", "w4a4-token", "w4a4-tensor", "w4a4-static", "w4a4"]
ActScale = Literal["per_token", "static", "per_tensor"]
Backend = Literal["auto", "reference", "triton"]

# Options fields the op passes through, and the eager-only test and bench settings (every
# field is in one of the two: tests/test_compile.py checks it).
OP_OPTIONS = ("pdl", "valid_fraction")
EAGER_OPTIONS = ("fc1_tile", "fc2_tile", "gemm", "poison")


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
    """numerics section 9 for one call (``mode`` and ``act_scale`` as the backends take them:
    a kernel family and a W4A4 activation scale). ``check_ids`` reads the ids (a host sync
    on a GPU)."""
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
    if check_ids:
        check_expert_ids(topk_ids, experts.num_experts)


def moe(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    experts: PreparedExperts,
    *,
    mode: ModeName = "w4a16",
    act_scale: ActScale | None = None,
    fused_finalize: bool = False,
    backend: Backend = "auto",
    validate_ids: bool = False,
    options: Options | None = None,
) -> torch.Tensor:
    """One MoE layer over prepared NVFP4 experts (numerics sections 4 to 7).

    Runs as the custom op ``torch.ops.fp4moe.moe`` (``fp4moe.ops``): ``torch.compile``
    keeps it in the graph, and autograd gives straight-through gradients for ``x`` and
    ``topk_weights`` (``fp4moe.backward``). An eager call that needs no gradient, on plain
    tensors, runs the op's body directly: the same function, without the dispatcher's
    cost (about 20 us a call on a CPU host).

    Args:
        x: bf16 [T, H] tokens.
        topk_ids: int32 [T, K] local expert ids; negative ids are masked routes.
        topk_weights: fp32 [T, K] router weights.
        experts: the prepared experts (E experts, hidden size H); never modified.
        mode: "w4a16" (bf16 activations); "w4a8" (activations to float8 e4m3 with one
            scale a row, weights to e4m3 from the same NVFP4 bytes, FP8 tensor cores:
            numerics section 5a); or activations quantized to NVFP4: "w4a4-token",
            "w4a4-tensor" (one dynamic scale over the whole batch, so results depend on the
            other tokens) or "w4a4-static" (the experts' calibrated a13/a2 scales).
        act_scale: leave it out. The older spelling ``mode="w4a4", act_scale="per_token" |
            "per_tensor" | "static"`` is accepted with the one mapping of ``fp4moe.modes``;
            any other value (a typo, or an activation scale with W4A16 or W4A8) is refused.
        fused_finalize: add the weighted expert outputs with atomics in the last GEMM
            (fastest, not bitwise reproducible) instead of the deterministic finalize.
        backend: "reference" (plain PyTorch, any device), "triton" (CUDA kernels) or "auto"
            (triton on a CUDA device, the reference elsewhere).
        validate_ids: also check ids < E where that costs a host sync (CUDA tensors). On
            CPU the ids are always checked.
        options: ``fp4moe.Options`` for the triton backend (PDL, under expert parallelism
            by masking ``valid_fraction`` = 1 / ranks; pinned tiles and NaN poisoning for
            tests, which run eagerly and are refused under ``torch.compile``). Every option
            gives the same bits. Ignored by the reference. Which kernels a call runs:
            ``fp4moe.plan`` / ``fp4moe.explain``.

    Returns:
        bf16 [T, H].
    """
    kernel_mode, scale = resolve_mode(mode, act_scale)
    _choice(backend, BACKENDS, "backend")
    if not isinstance(fused_finalize, bool):
        raise TypeError(f"fused_finalize: expected a bool, got {type(fused_finalize).__name__}")
    if options is not None and not isinstance(options, Options):
        raise TypeError(f"options: expected fp4moe.Options or None, got {type(options).__name__}")
    on_cuda = isinstance(x, torch.Tensor) and x.is_cuda
    check_ids = validate_ids or not on_cuda or backend == "reference"
    validate_moe_inputs(
        x, topk_ids, topk_weights, experts, mode=kernel_mode, act_scale=scale, check_ids=False
    )  # fmt: skip
    if backend == "auto":
        backend = "triton" if on_cuda else "reference"
    eager_only = []
    if options is not None:
        eager_only = [n for n in EAGER_OPTIONS if getattr(options, n) not in (None, False)]
    if eager_only and torch.compiler.is_compiling():
        raise ValueError(
            f"options: {eager_only} are eager-only test and benchmark settings; the "
            f"compiled op takes only {OP_OPTIONS}"
        )
    if eager_only or _eager_call(x, topk_ids, topk_weights, experts):
        return run_moe(
            x, topk_ids, topk_weights, experts, mode=kernel_mode, act_scale=scale,
            fused_finalize=fused_finalize, backend=backend, check_ids=check_ids,
            options=options,
        )  # fmt: skip
    return torch.ops.fp4moe.moe(
        x, topk_ids, topk_weights, *expert_tensors(experts), kernel_mode, scale,
        fused_finalize, backend, check_ids,
        options.pdl if options is not None else None,
        options.valid_fraction if options is not None else None,
    )  # fmt: skip


def _eager_call(
    x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, experts: PreparedExperts
) -> bool:
    """Whether the op's body may run without the dispatcher: not compiling, plain tensors
    (not fake, functional or other subclasses) off the meta device, no gradient needed."""
    if torch.compiler.is_compiling() or x.device.type == "meta":
        return False
    tensors = [x, topk_ids, topk_weights, *(t for t in expert_tensors(experts) if t is not None)]
    if any(type(t) is not torch.Tensor for t in tensors):
        return False
    return not (torch.is_grad_enabled() and any(t.requires_grad for t in tensors))


def plan(
    experts: PreparedExperts,
    num_tokens: int,
    top_k: int,
    *,
    mode: ModeName = "w4a16",
    act_scale: ActScale | None = None,
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
    from .backend import H200, experts_scales_tma, plan_call, target_for

    if not isinstance(experts, PreparedExperts):
        raise TypeError(f"experts: expected PreparedExperts, got {type(experts).__name__}")
    for name, v, low in (("num_tokens", num_tokens, 0), ("top_k", top_k, 1)):
        if isinstance(v, bool) or not isinstance(v, int) or v < low:
            raise ValueError(f"{name}: expected an int >= {low}, got {v!r}")
    mode, act_scale = resolve_mode(mode, act_scale)
    if options is not None and not isinstance(options, Options):
        raise TypeError(f"options: expected fp4moe.Options or None, got {type(options).__name__}")
    target = target_for(experts.device) if experts.device.type == "cuda" else H200
    return plan_call(
        num_tokens, top_k, experts.num_experts, experts.hidden_size,
        experts.intermediate_size, mode=mode, act_scale=act_scale,
        fused_finalize=fused_finalize, options=options or Options(), target=target,
        scales_tma=experts_scales_tma(experts),
    )  # fmt: skip
