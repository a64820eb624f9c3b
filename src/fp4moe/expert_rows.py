"""The expert side of expert parallelism: the route rows y of rows dispatched to this
rank's experts (each row one route, W4A4 rows quantized by their sender), on the reference
or the Triton backend, and the bytes a dispatched row takes on the wire."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from .experts import PreparedExperts
from .nvfp4 import NVFP4Tensor, dequantize_blocks, global_from_amax
from .reference import accumulate, apply_global, quantized_input

__all__ = ["compute_route_rows", "wire_row_bytes"]


def wire_row_bytes(hidden: int, mode: str, act_scale: str = "per_token") -> int:
    """Bytes of one dispatched row (one route) on the wire.

    W4A16: H bf16 values (2H). W4A4: H/2 bytes of e2m1 codes, H/16 e4m3 block scales, and
    for per-token scales the row's fp32 global (4 bytes); static and per-tensor globals
    are known on the receiving rank and not sent. A combined (returned) row is always 2H.
    """
    if mode == "w4a16":
        return 2 * hidden
    return hidden // 2 + hidden // 16 + (4 if act_scale == "per_token" else 0)


# ------------------------------------------------------------------------ expert side


def compute_route_rows(
    rows: torch.Tensor | NVFP4Tensor,
    row_expert: torch.Tensor,
    experts: PreparedExperts,
    *,
    mode: str,
    act_scale: str = "per_token",
    backend: str = "reference",
    amax_reduce: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> torch.Tensor:
    """Route rows y (numerics section 5) for rows already gathered (and, for W4A4, quantized).

    Each row is one route: its FC1 input and the local expert ``row_expert[n]`` it goes to.
    The result equals, row for row and bit for bit, what ``route_rows_reference`` (or the
    Triton backend's FC2 output before finalize) gives for the same routes in any batch,
    for the row-local modes (W4A16, W4A4 per-token and static).

    Args:
        rows: W4A16: bf16 [N, H]. W4A4: an NVFP4Tensor with codes uint8 [N, H/2], block
            scales e4m3 [N, H/16] and a per-row fp32 global [N] (the FC1 input quantized as
            numerics section 2 says: per-token, the expert's static a13 scale, or the batch's
            per-tensor global).
        row_expert: int [N] local expert ids; a negative id marks a padding row (its output
            row is unspecified and must not be read).
        experts: the local experts (E of them).
        mode: "w4a16" or "w4a4"; act_scale: the W4A4 activation scale of the FC2 input
            ("per_token", "static" or "per_tensor").
        backend: "reference" (plain PyTorch) or "triton" (the Triton kernels' pieces).
        amax_reduce: W4A4 per-tensor only: called with this rank's fp32 amax of the FC2
            input (0 when it has no rows) and returns the amax the global scale is taken
            from (expert parallelism passes an ``all_reduce(max)`` over the group). It is
            called whatever N is, so every rank takes part in the collective.

    Returns:
        bf16 [N, H].
    """
    if backend == "triton":
        return _route_rows_triton(rows, row_expert, experts, mode, act_scale, amax_reduce)
    return _route_rows_reference(rows, row_expert, experts, mode, act_scale, amax_reduce)


def _fc2_amax(act: torch.Tensor, live: torch.Tensor) -> torch.Tensor:
    vals = torch.where(
        live[:, None], act.abs(), torch.zeros((), dtype=act.dtype, device=act.device)
    )
    if vals.numel() == 0:
        return torch.zeros((), dtype=torch.float32, device=act.device)
    return vals.amax().float()


def _route_rows_reference(rows, row_expert, experts, mode, act_scale, amax_reduce):
    """The math of ``reference.route_rows_reference`` with the FC1 input given per row."""
    w4a4 = mode == "w4a4"
    n = rows.codes.shape[0] if w4a4 else rows.shape[0]
    dev = experts.device
    act = torch.zeros(n, experts.intermediate_size, dtype=torch.bfloat16, device=dev)
    groups = []
    for e in range(experts.num_experts):
        idx = (row_expert == e).nonzero(as_tuple=True)[0]
        if idx.numel():
            groups.append((e, idx))
    for e, idx in groups:
        if w4a4:
            xin = dequantize_blocks(rows.codes[idx], rows.scales[idx])
            gx = rows.global_scale[idx]
        else:
            xin, gx = rows[idx].float(), None
        gate, up = experts.w13_nvfp4(e)
        h_gate = apply_global(accumulate(xin, dequantize_blocks(gate.codes, gate.scales)), gx)
        h_up = apply_global(accumulate(xin, dequantize_blocks(up.codes, up.scales)), gx)
        h_gate = h_gate * gate.global_scale
        h_up = h_up * up.global_scale
        act[idx] = (F.silu(h_gate) * h_up).to(torch.bfloat16)

    a_global = None
    if w4a4 and act_scale == "per_tensor":
        amax = _fc2_amax(act, row_expert >= 0)
        if amax_reduce is not None:
            amax = amax_reduce(amax)
        a_global = global_from_amax(amax)
    y = torch.zeros(n, experts.hidden_size, dtype=torch.bfloat16, device=dev)
    for e, idx in groups:
        a2 = experts.a2_scale[e] if experts.a2_scale is not None else None
        ain, ga = quantized_input(act[idx], mode, act_scale, a2, a_global)
        w2 = experts.w2_nvfp4(e)
        acc = apply_global(accumulate(ain, dequantize_blocks(w2.codes, w2.scales)), ga)
        y[idx] = (acc * w2.global_scale).to(torch.bfloat16)
    return y


def _route_rows_triton(rows, row_expert, experts, mode, act_scale, amax_reduce):
    """The Triton backend's expert work (``backend.launch.expert_gemms``) with top-k 1, on
    the plan of dispatched rows (``plan_call(dispatched=True)``).

    Every received row is a one-route token; FC1 gathers it (bf16, or pre-quantized NVFP4
    codes, scales and per-row global). Rows come back in the order they came in."""
    from .backend import Options
    from .backend.launch import expert_gemms, plan_for, zero_buffer
    from .kernels.sort import sort_routes

    w4a4 = mode == "w4a4"
    a_src = rows.codes if w4a4 else rows
    n = a_src.shape[0]
    dev = a_src.device
    if n == 0:
        if w4a4 and act_scale == "per_tensor" and amax_reduce is not None:
            amax_reduce(torch.zeros((), dtype=torch.float32, device=dev))
        return torch.empty(0, experts.hidden_size, dtype=torch.bfloat16, device=dev)
    plan = plan_for(a_src, 1, experts, mode=mode, act_scale=act_scale, fused_finalize=False,
                    options=Options(valid_fraction=1.0), dispatched=True,
                    amax_all_reduce=amax_reduce is not None)  # fmt: skip
    zero, slots = zero_buffer(plan, dev)
    sort = sort_routes(row_expert.to(torch.int32).reshape(n, 1).contiguous(),
                       experts.num_experts, plan.block_m, use_kernel=plan.sort == "triton",
                       zero=zero)  # fmt: skip
    y = expert_gemms(
        plan, sort, a_src.contiguous(),
        rows.scales.contiguous() if w4a4 else None,
        rows.global_scale.contiguous() if w4a4 else None,
        experts, a_gather=True, route_weights=torch.ones(n, dtype=torch.float32, device=dev),
        slots=slots, amax_reduce=amax_reduce,
    )  # fmt: skip
    return y[sort.route_pos.long()]
