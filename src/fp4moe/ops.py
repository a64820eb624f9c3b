"""``torch.ops.fp4moe.moe``: the MoE call as a torch custom op, so that it sits inside
``torch.compile`` graphs (``fullgraph=True``, CUDA graphs) as one opaque node.

Registered with ``torch.library.custom_op`` when this module is imported (``fp4moe.moe``
imports it):

``fp4moe::moe(x, topk_ids, topk_weights, w13_codes, w13_scales, w13_global, w2_codes,
w2_scales, w2_global, a13_scale?, a2_scale?, mode, act_scale, fused_finalize, backend,
check_ids, pdl?, valid_fraction?) -> Tensor``

- The expert tensors go in one by one (``PreparedExperts`` is rebuilt inside, unchecked).
- ``mode`` / ``act_scale`` are the kernel family ("w4a16", "w4a8", "w4a4") and the W4A4
  activation scale ("per_token", "static", "per_tensor"); ``backend`` "reference" or
  "triton".
- Of ``fp4moe.Options`` only ``pdl`` and ``valid_fraction`` are passed through; pinned tiles,
  a pinned kernel family and NaN poisoning are for tests and benchmarks: ``fp4moe.moe``
  runs a call with them eagerly, outside the op, and refuses them while compiling.
- The fake (meta) implementation gives the output's shape and dtype: bf16 [T, H] like x.
- Autograd: the backward is a second op, ``fp4moe::moe_backward``
  (:func:`fp4moe.backward.moe_backward_reference`, straight-through activation
  quantization), giving gradients for ``x`` and ``topk_weights``; the NVFP4 expert tensors
  get none (a backward that would need one raises).
"""

import torch

from .backend.options import Options
from .experts import PreparedExperts
from .routing import check_expert_ids

__all__ = ["EXPERT_FIELDS", "expert_tensors", "run_moe"]

# The order in which the op takes a PreparedExperts' tensors.
EXPERT_FIELDS = (
    "w13_codes",
    "w13_scales",
    "w13_global",
    "w2_codes",
    "w2_scales",
    "w2_global",
    "a13_scale",
    "a2_scale",
)


def expert_tensors(experts: PreparedExperts) -> list[torch.Tensor | None]:
    """The experts' tensors in the op's argument order (``EXPERT_FIELDS``)."""
    return [getattr(experts, f) for f in EXPERT_FIELDS]


def _experts(tensors) -> PreparedExperts:
    return PreparedExperts(**dict(zip(EXPERT_FIELDS, tensors)), validate=False)


def run_moe(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    experts: PreparedExperts,
    *,
    mode: str,
    act_scale: str,
    fused_finalize: bool,
    backend: str,
    check_ids: bool,
    options: Options | None,
) -> torch.Tensor:
    """One MoE call on validated inputs (the body of the op): bf16 [T, H]."""
    if check_ids:
        check_expert_ids(topk_ids, experts.num_experts)
    if x.shape[0] == 0:
        return torch.empty(0, x.shape[1], dtype=torch.bfloat16, device=x.device)
    if backend == "reference":
        from .reference import moe_reference

        return moe_reference(x, topk_ids, topk_weights, experts, mode=mode, act_scale=act_scale)
    from .backend.launch import moe_triton

    return moe_triton(
        x, topk_ids, topk_weights, experts, mode=mode, act_scale=act_scale,
        fused_finalize=fused_finalize, options=options,
    )  # fmt: skip


@torch.library.custom_op("fp4moe::moe", mutates_args=())
def moe_op(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    w13_codes: torch.Tensor,
    w13_scales: torch.Tensor,
    w13_global: torch.Tensor,
    w2_codes: torch.Tensor,
    w2_scales: torch.Tensor,
    w2_global: torch.Tensor,
    a13_scale: torch.Tensor | None,
    a2_scale: torch.Tensor | None,
    mode: str,
    act_scale: str,
    fused_finalize: bool,
    backend: str,
    check_ids: bool,
    pdl: bool | None,
    valid_fraction: float | None,
) -> torch.Tensor:
    experts = _experts(
        (w13_codes, w13_scales, w13_global, w2_codes, w2_scales, w2_global, a13_scale, a2_scale)
    )
    options = None
    if pdl is not None or valid_fraction is not None:
        options = Options(pdl=pdl, valid_fraction=valid_fraction)
    return run_moe(
        x, topk_ids, topk_weights, experts, mode=mode, act_scale=act_scale,
        fused_finalize=fused_finalize, backend=backend, check_ids=check_ids, options=options,
    )  # fmt: skip


@moe_op.register_fake
def _moe_fake(x, topk_ids, topk_weights, *args):
    return torch.empty_like(x)


@torch.library.custom_op("fp4moe::moe_backward", mutates_args=())
def moe_backward_op(
    grad_out: torch.Tensor,
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    w13_codes: torch.Tensor,
    w13_scales: torch.Tensor,
    w13_global: torch.Tensor,
    w2_codes: torch.Tensor,
    w2_scales: torch.Tensor,
    w2_global: torch.Tensor,
    a13_scale: torch.Tensor | None,
    a2_scale: torch.Tensor | None,
    mode: str,
    act_scale: str,
) -> tuple[torch.Tensor, torch.Tensor]:
    from .backward import moe_backward_reference

    experts = _experts(
        (w13_codes, w13_scales, w13_global, w2_codes, w2_scales, w2_global, a13_scale, a2_scale)
    )
    return moe_backward_reference(
        grad_out, x, topk_ids, topk_weights, experts, mode=mode, act_scale=act_scale
    )


@moe_backward_op.register_fake
def _moe_backward_fake(grad_out, x, topk_ids, topk_weights, *args):
    return torch.empty_like(x), torch.empty_like(topk_weights)


_N_EXPERT = len(EXPERT_FIELDS)


def _setup_context(ctx, inputs, output) -> None:
    x, topk_ids, topk_weights = inputs[:3]
    tensors = inputs[3 : 3 + _N_EXPERT]
    mode, act_scale = inputs[3 + _N_EXPERT : 5 + _N_EXPERT]
    ctx.save_for_backward(x, topk_ids, topk_weights, *tensors)
    ctx.mode, ctx.act_scale = mode, act_scale


def _backward(ctx, grad_out):
    needs = ctx.needs_input_grad
    frozen = [f for f, n in zip(EXPERT_FIELDS, needs[3 : 3 + _N_EXPERT]) if n]
    if frozen:
        raise RuntimeError(
            f"fp4moe.moe: {frozen} require grad, but the NVFP4 expert tensors are frozen "
            "weights and get no gradient; only x and topk_weights do"
        )
    x, topk_ids, topk_weights, *tensors = ctx.saved_tensors
    grad_x = grad_w = None
    if needs[0] or needs[2]:
        grad_x, grad_w = torch.ops.fp4moe.moe_backward(
            grad_out, x, topk_ids, topk_weights, *tensors, ctx.mode, ctx.act_scale
        )
    n_rest = len(needs) - 3
    return (grad_x if needs[0] else None, None, grad_w if needs[2] else None) + (None,) * n_rest


moe_op.register_autograd(_backward, setup_context=_setup_context)
