"""The expert side of expert parallelism and its wire format: the bytes a dispatched row
takes, packing rows into them and reading them back, and the route rows y of rows
dispatched to this rank's experts (each row one route; W4A4 and W4A8 rows quantized by
their sender), on the reference or the Triton backend."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .experts import PreparedExperts
from .nvfp4 import NVFP4Tensor, dequantize_blocks, global_from_amax
from .reference import accumulate, apply_global, e4m3_rows, e4m3_weights, quantized_input

__all__ = ["E4M3Rows", "compute_route_rows", "pack_rows", "unpack_rows", "wire_row_bytes"]


@dataclass(frozen=True)
class E4M3Rows:
    """W4A8 activation rows as they travel (numerics section 5a): ``values`` float8_e4m3fn
    [N, C] and ``scales`` fp32 [N], one a row (the row is ``values * scales``), as
    ``reference.e4m3_rows`` computes them."""

    values: torch.Tensor
    scales: torch.Tensor

    @classmethod
    def quantize(cls, v: torch.Tensor) -> E4M3Rows:
        """The rows of bf16 ``v`` [N, C] (``reference.e4m3_rows``)."""
        return cls(*e4m3_rows(v))


def wire_row_bytes(hidden: int, mode: str, act_scale: str = "per_token") -> int:
    """Bytes of one dispatched row (one route) on the wire.

    W4A16: H bf16 values (2H). W4A8: H e4m3 values and the row's fp32 scale (H + 4). W4A4:
    H/2 bytes of e2m1 codes, H/16 e4m3 block scales, and for per-token scales the row's fp32
    global (4 bytes); static and per-tensor globals are known on the receiving rank and not
    sent. A combined (returned) row is always 2H.
    """
    if mode == "w4a16":
        return 2 * hidden
    if mode == "w4a8":
        return hidden + 4
    return hidden // 2 + hidden // 16 + (4 if act_scale == "per_token" else 0)


def pack_rows(parts: list[torch.Tensor]) -> torch.Tensor:
    """Concatenate [N, ...] tensors of any dtype, row by row, into one uint8 [N, bytes]
    buffer (views of their bytes, no conversion)."""
    n = parts[0].shape[0]
    cols = [math.prod(p.shape[1:]) for p in parts]
    return torch.cat(
        [p.contiguous().reshape(n, c).view(torch.uint8) for p, c in zip(parts, cols)], dim=1
    ).contiguous()


def unpack_rows(
    recv: torch.Tensor,
    hidden: int,
    mode: str,
    act_scale: str = "per_token",
    row_global: torch.Tensor | None = None,
) -> torch.Tensor | NVFP4Tensor | E4M3Rows:
    """The rows of uint8 ``recv`` [N, ``wire_row_bytes``] as ``compute_route_rows`` takes
    them: W4A16 bf16 [N, H]; W4A8 ``E4M3Rows``; W4A4 an NVFP4Tensor whose per-row global is
    read from the row (per-token) or is ``row_global`` fp32 [N] (static, per-tensor: known
    on the receiver)."""
    h, n = hidden, recv.shape[0]
    if mode == "w4a16":
        return recv.view(torch.bfloat16)
    if mode == "w4a8":
        values = recv[:, :h].contiguous().view(torch.float8_e4m3fn)
        return E4M3Rows(values, recv[:, h : h + 4].contiguous().view(torch.float32).reshape(n))
    codes = recv[:, : h // 2].contiguous()
    scales = recv[:, h // 2 : h // 2 + h // 16].contiguous().view(torch.float8_e4m3fn)
    if act_scale == "per_token":
        o = h // 2 + h // 16
        row_global = recv[:, o : o + 4].contiguous().view(torch.float32).reshape(n)
    return NVFP4Tensor(codes, scales, row_global)


# ------------------------------------------------------------------------ expert side


def compute_route_rows(
    rows: torch.Tensor | NVFP4Tensor | E4M3Rows,
    row_expert: torch.Tensor,
    experts: PreparedExperts,
    *,
    mode: str,
    act_scale: str = "per_token",
    backend: str = "reference",
    amax_reduce: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> torch.Tensor:
    """Route rows y (numerics sections 5, 5a) for rows already gathered (and, for W4A4 and
    W4A8, quantized).

    Each row is one route: its FC1 input and the local expert ``row_expert[n]`` it goes to.
    The result equals, row for row and bit for bit, what ``route_rows_reference`` (or the
    Triton backend's FC2 output before finalize) gives for the same routes in any batch,
    for the row-local modes (W4A16, W4A8, W4A4 per-token and static).

    Args:
        rows: W4A16: bf16 [N, H]. W4A8: ``E4M3Rows`` (e4m3 [N, H] and fp32 [N]: each FC1
            input row as ``reference.e4m3_rows`` quantizes it). W4A4: an NVFP4Tensor with
            codes uint8 [N, H/2], block scales e4m3 [N, H/16] and a per-row fp32 global [N]
            (the FC1 input quantized as numerics section 2 says: per-token, the expert's
            static a13 scale, or the batch's per-tensor global).
        row_expert: int [N] local expert ids; a negative id marks a padding row (its output
            row is unspecified and must not be read).
        experts: the local experts (E of them).
        mode: "w4a16", "w4a8" or "w4a4"; act_scale: the W4A4 activation scale of the FC2 input
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


def _fc_e4m3(q: torch.Tensor, s: torch.Tensor, codes, scales) -> torch.Tensor:
    """W4A8's FC of rows already quantized (q e4m3 [n, K], s fp32 [n]): acc(q * w8) * s * 8
    in fp32 [n, N], the weights' global not applied (numerics section 5a)."""
    acc = accumulate(q.float(), e4m3_weights(codes, scales).float())
    return acc * s[:, None] * 8.0


def _route_rows_reference(rows, row_expert, experts, mode, act_scale, amax_reduce):
    """The math of ``reference.route_rows_reference`` with the FC1 input given per row."""
    w4a4, w4a8 = mode == "w4a4", mode == "w4a8"
    n = row_expert.shape[0]
    dev = experts.device
    act = torch.zeros(n, experts.intermediate_size, dtype=torch.bfloat16, device=dev)
    groups = []
    for e in range(experts.num_experts):
        idx = (row_expert == e).nonzero(as_tuple=True)[0]
        if idx.numel():
            groups.append((e, idx))
    for e, idx in groups:
        gate, up = experts.w13_nvfp4(e)
        if w4a8:
            q, s = rows.values[idx], rows.scales[idx]
            h_gate = _fc_e4m3(q, s, gate.codes, gate.scales)
            h_up = _fc_e4m3(q, s, up.codes, up.scales)
        else:
            if w4a4:
                xin = dequantize_blocks(rows.codes[idx], rows.scales[idx])
                gx = rows.global_scale[idx]
            else:
                xin, gx = rows[idx].float(), None
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
        w2 = experts.w2_nvfp4(e)
        if w4a8:
            acc = _fc_e4m3(*e4m3_rows(act[idx]), w2.codes, w2.scales)
        else:
            a2 = experts.a2_scale[e] if experts.a2_scale is not None else None
            ain, ga = quantized_input(act[idx], mode, act_scale, a2, a_global)
            acc = apply_global(accumulate(ain, dequantize_blocks(w2.codes, w2.scales)), ga)
        y[idx] = (acc * w2.global_scale).to(torch.bfloat16)
    return y


def _route_rows_triton(rows, row_expert, experts, mode, act_scale, amax_reduce):
    """The Triton backend's expert work (``backend.launch.expert_gemms``) with top-k 1, on
    the plan of dispatched rows (``plan_call(dispatched=True)``).

    Every received row is a one-route token; FC1 gathers it (bf16, or pre-quantized NVFP4
    codes, scales and per-row global). W4A8 rows (e4m3 values in natural order, one fp32
    scale a row) are put in the sort's order and in the FP8 GEMMs' unit order
    (``kernels.quantize_e4m3.unit_order``) first, and FC1 reads them without a gather.
    Rows come back in the order they came in."""
    from .backend import Options
    from .backend.launch import expert_gemms, plan_for, zero_buffer
    from .kernels.quantize_e4m3 import unit_order
    from .kernels.sort import sort_routes

    w4a4, w4a8 = mode == "w4a4", mode == "w4a8"
    a_src = rows.codes if w4a4 else rows.values if w4a8 else rows
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
                       zero=zero, mixed=plan.mixed_sort)  # fmt: skip
    ones = torch.ones(n, dtype=torch.float32, device=dev)
    if w4a8:
        order = sort.sorted_routes.long()
        y = expert_gemms(
            plan, sort, unit_order(rows.values[order]).contiguous(),
            None, rows.scales[order].contiguous(),
            experts, a_gather=False, route_weights=ones, slots=slots,
        )  # fmt: skip
        return y[sort.route_pos.long()]
    y = expert_gemms(
        plan, sort, a_src.contiguous(),
        rows.scales.contiguous() if w4a4 else None,
        rows.global_scale.contiguous() if w4a4 else None,
        experts, a_gather=True, route_weights=ones, slots=slots, amax_reduce=amax_reduce,
    )  # fmt: skip
    return y[sort.route_pos.long()]
