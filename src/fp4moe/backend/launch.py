"""The Triton backend of ``fp4moe.moe``: a call's ``Plan`` carried out, kernel by kernel:
sort, (quantize), FC1, (quantize), FC2, finalize.

Every step is on the device with no host synchronization, so the sequence can be
captured in a CUDA graph (``fp4moe.runner``). Consecutive kernels use programmatic
dependent launch where the plan says so: each waits on its predecessor's output and
releases its dependents right after; the finalize kernel reads routing metadata before
its wait.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ..experts import PreparedExperts
from ..kernels.common import empty
from ..kernels.finalize import cast_rows, finalize_rows
from ..kernels.gemm.operands import dense_rows, dense_weights
from ..kernels.gemm.portable import portable_gemm
from ..kernels.gemm.shapes import k_order
from ..kernels.quantize import (
    MODE_AMAX_SELF,
    MODE_FROM_AMAX,
    MODE_PER_ROW,
    MODE_STATIC,
    amax_rows,
    decoded_rows_dtype,
    quantize_rows,
)
from ..kernels.quantize_e4m3 import e4m3_rows
from ..kernels.sort import RouteSort, sort_routes
from .device import target_for
from .options import Options
from .plan import GemmPlan, Plan, experts_scales_tma, plan_call

__all__ = ["expert_gemms", "moe_triton", "plan_for", "zero_buffer"]


def plan_for(
    x: torch.Tensor, top_k: int, experts: PreparedExperts, *, mode: str, act_scale: str,
    fused_finalize: bool, options: Options | None, dispatched: bool = False,
    amax_all_reduce: bool = False,
) -> Plan:  # fmt: skip
    """The plan of a call on ``x`` ([T, H]) over ``experts``, on x's device
    (``plan_call``)."""
    return plan_call(
        x.shape[0], top_k, experts.num_experts, experts.hidden_size,
        experts.intermediate_size, mode=mode, act_scale=act_scale,
        fused_finalize=fused_finalize, options=options or Options(),
        target=target_for(x.device), dispatched=dispatched, amax_all_reduce=amax_all_reduce,
        scales_tma=experts_scales_tma(experts),
    )  # fmt: skip


def zero_buffer(plan: Plan, device) -> tuple[torch.Tensor | None, dict]:
    """The int32 words a call needs zeroed, in one buffer for the sort kernel to clear (no
    memset node in a CUDA graph of the call): FC1's and FC2's tile counters, then the
    per-tensor amax slots (fp32 zeros, FC2's input first). Returns (buffer or None, the
    views: "fc1", "fc2" counters, "fc2_amax", "fc1_amax" slots or None)."""
    n = plan.zero_words
    if n == 0:
        return None, dict(fc1=None, fc2=None, fc2_amax=None, fc1_amax=None)
    zero = torch.empty(n, dtype=torch.int32, device=device)
    c1, c2 = plan.fc1.counters, plan.fc2.counters
    slots = zero[c1 + c2 :].view(torch.float32)
    return zero, dict(
        fc1=zero[:c1] if c1 else None,
        fc2=zero[c1 : c1 + c2] if c2 else None,
        fc2_amax=slots[:1] if plan.fc2_amax_slot else None,
        fc1_amax=slots[int(plan.fc2_amax_slot) :][:1] if plan.fc1_amax_slot else None,
    )


def _gemm(
    g: GemmPlan, plan: Plan, sort: RouteSort, a, a_scales, a_global, w_codes, w_scales,
    w_global, out, topk_w, *, n: int, k: int, gated: bool, a_gather: bool, poison: bool,
    counters: torch.Tensor | None = None, a_decoded: torch.Tensor | None = None,
    out_fp4=None,
) -> None:  # fmt: skip
    """One grouped GEMM on the kernel ``g`` names. ``a``: bf16 rows, or W4A4 NVFP4 codes
    with ``a_scales`` and ``a_global`` (``a_decoded``: the same rows decoded by the
    quantize kernel); ``out``: bf16 route rows, fp32 [T, n] (atomic), or with ``out_fp4``
    = (scales, globals, static table) NVFP4 codes."""
    topk = plan.top_k
    a_fp4 = a_scales is not None
    fused = g.epilogue == "atomic"
    t = g.tile
    tile = (t.block_m, t.block_n, t.block_k, t.num_warps, t.num_stages)
    n_valid = sort.expert_offsets[-1:]
    out_scale = 2.0**16 if a_fp4 else 2.0**8  # each decoded operand carries 2^-8
    if g.kernel == "gluon-prefill":
        from ..kernels.gemm.gluon_prefill import prefill_gemm

        e4m3 = a.dtype == torch.float8_e4m3fn
        if e4m3:  # W4A8: e4m3 rows in sorted order already, their scales in a_global
            xs = a
        else:
            xs = dense_rows(a, a_scales, count=n_valid, poison=poison, order=64,
                            index=sort.sorted_routes if a_gather else None,
                            div=topk if a_gather else 1)  # fmt: skip
        runs, chains = [sort.schedule], [0]
        if g.mixed:  # each expert's rows in tiles of its own size: one launch a tile rows,
            runs = list(sort.mixed)  # the later ones starting as the one before leaves SMs
            chains = [1] + [2] * (len(runs) - 1)
        for s, chain in zip(runs, chains):
            prefill_gemm(
                xs, w_codes, w_scales, w_global, s.block_expert, s.block_start, s.block_end,
                s.valid_blocks, out, n=n, topk=topk, gated=gated,
                out_scale=8.0 if e4m3 else out_scale, sm_count=plan.target.sm_count,
                sorted_routes=sort.sorted_routes, topk_w=topk_w, fused=fused,
                a_global=a_global if a_fp4 or e4m3 else None, a_gather=a_gather,
                block_m=s.block_m, chain=chain,
            )  # fmt: skip
        return
    ws_rows = sort.sorted_routes.shape[0] if g.split or g.kernel == "gluon-whole" else 0
    common = dict(n=n, k=k, topk=topk, gated=gated, fused=fused, pdl=plan.pdl, tile=tile,
                  interpret=plan.target.interpret, out_fp4=out_fp4, ws_rows=ws_rows)  # fmt: skip
    schedule = (sort.block_expert, sort.block_start, sort.block_end)
    part = None
    if g.split:  # fp32 partials of every K segment, summed by the last program of a tile
        part = torch.empty(g.segments * ws_rows * (2 * n if gated else n),
                           dtype=torch.float32, device=a.device)  # fmt: skip
    if g.kernel in ("triton", "triton-split", "triton-dense"):
        dense = g.kernel == "triton-dense"
        if dense:  # the weights and the rows decoded (or reordered) once, in the loop's order
            order = k_order(k, t.block_k)
            w_codes = dense_weights(w_codes, w_scales, order=order)
            # rows in sorted order (not gathered) stop at the valid count: masked routes
            # are never loaded
            a = dense_rows(a, a_scales, count=None if a_gather else n_valid, poison=poison,
                           order=order)  # fmt: skip
        portable_gemm(a, a_scales, a_global, sort.sorted_routes, topk_w, w_codes, w_scales,
                      w_global, out, *schedule, a_gather=a_gather, split=g.split, dense=dense,
                      part=part, counters=counters, **common)  # fmt: skip
        return
    from ..kernels.gemm.gluon_decode import split_partials_tma

    a_src = a
    if g.operand == "decoded":  # by the quantize kernel
        a_src = a_decoded
    elif g.operand == "decode":  # W4A4 rows decoded once a call, in the unit order
        a_src = dense_rows(a, a_scales, count=None if a_gather else n_valid, poison=poison,
                           order=64)  # fmt: skip
    whole = g.kernel == "gluon-whole"
    kw = {}
    if g.epilogue != "nvfp4":  # the kernel writes the output itself
        kw = dict(out=out, counters=counters, w_global=w_global, topk_w=topk_w, fused=fused,
                  out_scale=out_scale, a_global=a_global if a_fp4 else None)  # fmt: skip
    split_partials_tma(
        a_src, sort.sorted_routes, w_codes, w_scales, *schedule, sort.valid_blocks, part,
        n=n, topk=topk, gated=gated, gather=a_gather, block_m=t.block_m, ws_rows=ws_rows,
        a_unit_order=a_fp4, pdl=g.pdl, early_weights=g.early_weights, whole=whole,
        sm_count=plan.target.sm_count, **kw,
    )  # fmt: skip
    if g.epilogue == "nvfp4":  # the portable kernel sums the partials, writes NVFP4
        portable_gemm(a, a_scales, a_global, sort.sorted_routes, topk_w, w_codes, w_scales,
                      w_global, out, *schedule, a_gather=a_gather, split=True,
                      reduce_only=True, part=part, **common)  # fmt: skip


def _per_tensor(src, rows, count, slot, pdl, amax_reduce, self_amax: bool):
    """Quantize mode and table for a per-tensor global over the first ``rows`` rows of
    ``src`` (``count``, a device scalar, limits them): taken by the quantize kernel itself
    (``self_amax``), or an amax kernel into ``slot`` (then ``amax_reduce``: expert
    parallelism's all-reduce max)."""
    if self_amax:
        return MODE_AMAX_SELF, None
    amax = amax_rows(src, rows, count=count, pdl=pdl, out=slot)
    if amax_reduce is not None:
        amax = amax_reduce(amax.reshape(())).reshape(1)
    return MODE_FROM_AMAX, amax


def expert_gemms(
    plan: Plan,
    sort: RouteSort,
    a: torch.Tensor,
    a_scales: torch.Tensor | None,
    a_global: torch.Tensor | None,
    experts: PreparedExperts,
    *,
    a_gather: bool,
    route_weights: torch.Tensor,
    slots: dict,
    fused_into: torch.Tensor | None = None,
    amax_reduce: Callable[[torch.Tensor], torch.Tensor] | None = None,
    a_decoded: torch.Tensor | None = None,
    poison: bool = False,
) -> torch.Tensor:
    """The expert work of a call on routes already sorted (``sort``): FC1 with SwiGLU, for
    W4A4 the quantization of FC1's output, and FC2, as ``plan`` says.

    Args:
        plan: the call's plan. sort: ``sort_routes`` of its [T, top_k] expert ids.
        a: FC1 input. bf16 [T, H] gathered by route (``a_gather``), or for W4A4 NVFP4 codes
            uint8 [T, H/2] (gathered) or [T * top_k, H/2] in sorted order (not gathered),
            with ``a_scales`` e4m3 [..., H/16] and ``a_global`` fp32 [...] per row, or for
            W4A8 float8_e4m3fn rows [T, H] (gathered) or [T * top_k, H] (sorted order;
            dispatched) with ``a_scales`` None and their scales ``a_global`` fp32 [...].
        route_weights: fp32 [T * top_k] router weights (read by the fused epilogue only).
        slots: ``zero_buffer``'s views (tile counters and amax slots, zeroed by the sort).
        fused_into: fp32 [T, H] zeros: FC2 adds weight * y of each route into it with
            atomics (fused finalize). None: FC2 writes route rows.
        amax_reduce: W4A4 per-tensor: maps the fp32 amax of FC1's valid output rows to the
            amax its global scale is taken from (expert parallelism: an all-reduce max).
        a_decoded: W4A4's FC1 input rows decoded by the quantize kernel (operand
            "decoded").

    Returns:
        bf16 [T * top_k, H] route rows in sorted order (rows past the valid count
        unspecified), or ``fused_into``.
    """
    n_routes = sort.sorted_routes.shape[0]
    e = experts.num_experts
    h, inter = experts.hidden_size, experts.intermediate_size
    dev = a.device
    n_valid = sort.expert_offsets[e:]
    pdl = plan.pdl
    out_fp4 = None
    if plan.fc1.epilogue == "nvfp4":  # FC1 writes NVFP4 codes, scales and globals itself
        act = empty((n_routes, inter // 2), torch.uint8, dev, poison)
        out_fp4 = (
            empty((n_routes, inter // 16), torch.float8_e4m3fn, dev, poison),
            empty((n_routes,), torch.float32, dev, poison),
            experts.a2_scale,
        )
    else:
        act = empty((n_routes, inter), torch.bfloat16, dev, poison)
    _gemm(
        plan.fc1, plan, sort, a, a_scales, a_global, experts.w13_codes, experts.w13_scales,
        experts.w13_global, act, route_weights, n=inter, k=h, gated=True, a_gather=a_gather,
        poison=poison, counters=slots["fc1"], a_decoded=a_decoded, out_fp4=out_fp4,
    )  # fmt: skip

    # FC2 input
    b_src, b_scales, b_global, b_dec = act, None, None, None
    if plan.fc2.operand == "decoded":  # the quantize kernel decodes FC2's rows too
        b_dec = empty((n_routes, inter), decoded_rows_dtype(), dev, poison)
    src = plan.fc2_input
    if src == "e4m3-row":  # W4A8
        b_src, b_global = e4m3_rows(act, n_routes, count=n_valid, pdl=pdl, poison=poison)
    elif src == "per-row":
        b_src, b_scales, b_global = quantize_rows(
            act, n_routes, mode=MODE_PER_ROW, count=n_valid, pdl=pdl, poison=poison,
            decoded=b_dec,
        )  # fmt: skip
    elif src in ("per-tensor", "per-tensor+amax"):
        qmode, table = _per_tensor(act, n_routes, n_valid, slots["fc2_amax"], pdl, amax_reduce,
                                   src == "per-tensor")  # fmt: skip
        b_src, b_scales, b_global = quantize_rows(
            act, n_routes, mode=qmode, count=n_valid, table=table, pdl=pdl, poison=poison,
            decoded=b_dec,
        )  # fmt: skip
    elif src == "fc1-epilogue":
        b_src, b_scales, b_global = act, out_fp4[0], out_fp4[1]
    elif src == "static":
        b_src, b_scales, b_global = quantize_rows(
            act, n_routes, mode=MODE_STATIC, count=n_valid, table=experts.a2_scale,
            row_expert=sort.sorted_expert, pdl=pdl, poison=poison, decoded=b_dec,
        )  # fmt: skip

    if fused_into is not None:
        dest = fused_into
    else:
        dest = empty((n_routes, h), torch.bfloat16, dev, poison)
    _gemm(
        plan.fc2, plan, sort, b_src, b_scales, b_global, experts.w2_codes, experts.w2_scales,
        experts.w2_global, dest, route_weights, n=h, k=inter, gated=False, a_gather=False,
        poison=poison, counters=slots["fc2"], a_decoded=b_dec,
    )  # fmt: skip
    return dest


def moe_triton(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    experts: PreparedExperts,
    *,
    mode: str = "w4a16",
    act_scale: str = "per_token",
    fused_finalize: bool = False,
    options: Options | None = None,
) -> torch.Tensor:
    """The MoE forward on the Triton backend; inputs validated by ``fp4moe.moe``. bf16 [T, H]."""
    opt = options or Options()
    t, h = x.shape
    topk = topk_ids.shape[1]
    plan = plan_for(x, topk, experts, mode=mode, act_scale=act_scale,
                    fused_finalize=fused_finalize, options=opt)  # fmt: skip
    pdl, poison = plan.pdl, opt.poison
    e = experts.num_experts
    n_routes = t * topk
    dev = x.device
    x = x.contiguous()
    ids = topk_ids.contiguous()
    w_flat = topk_weights.contiguous().reshape(-1)

    zero, slots = zero_buffer(plan, dev)
    # The fused finalize's fp32 accumulator is zeroed before the sort, so that no memset
    # sits between two PDL launches.
    fused = torch.zeros(t, h, dtype=torch.float32, device=dev) if plan.fused_finalize else None
    sort = sort_routes(ids, e, plan.block_m, use_kernel=plan.sort == "triton", zero=zero,
                       mixed=plan.mixed_sort, release=pdl)  # fmt: skip
    n_valid = sort.expert_offsets[e:]  # device scalar: rows in sorted order

    # FC1 input
    a_scales = a_global = a_dec = None
    a_src, a_gather = x, True
    if plan.fc1.operand == "decoded":  # the quantize kernel decodes FC1's rows too
        rows = n_routes if plan.fc1_input == "static" else t
        a_dec = empty((rows, h), decoded_rows_dtype(), dev, poison)
    if plan.fc1_input == "e4m3-row":  # W4A8: e4m3 rows by token, gathered by the GEMM
        a_src, a_global = e4m3_rows(x, t, pdl=pdl, poison=poison)
    elif plan.fc1_input == "e4m3-gather":  # W4A8: e4m3 rows of the routes, sorted order
        a_src, a_global = e4m3_rows(x, n_routes, index=sort.sorted_routes, div=topk,
                                    count=n_valid, pdl=pdl, poison=poison)  # fmt: skip
        a_gather = False
    elif plan.fc1_input == "per-row":
        a_src, a_scales, a_global = quantize_rows(x, t, mode=MODE_PER_ROW, pdl=pdl,
                                                  poison=poison, decoded=a_dec)  # fmt: skip
    elif plan.fc1_input in ("per-tensor", "per-tensor+amax"):
        qmode, table = _per_tensor(x, t, None, slots["fc1_amax"], pdl, None,
                                   plan.fc1_input == "per-tensor")  # fmt: skip
        a_src, a_scales, a_global = quantize_rows(x, t, mode=qmode, table=table, pdl=pdl,
                                                  poison=poison, decoded=a_dec)  # fmt: skip
    elif plan.fc1_input == "static":  # the route's expert's global: each sorted row
        a_src, a_scales, a_global = quantize_rows(
            x, n_routes, mode=MODE_STATIC, index=sort.sorted_routes, div=topk, count=n_valid,
            table=experts.a13_scale, row_expert=sort.sorted_expert, pdl=pdl, poison=poison,
            decoded=a_dec,
        )  # fmt: skip
        a_gather = False

    dest = expert_gemms(
        plan, sort, a_src, a_scales, a_global, experts, a_gather=a_gather,
        route_weights=w_flat, slots=slots, fused_into=fused, a_decoded=a_dec, poison=poison,
    )  # fmt: skip
    if plan.fused_finalize:
        return cast_rows(dest, pdl=pdl, poison=poison)
    return finalize_rows(dest, sort.route_pos, ids, w_flat, pdl=pdl, poison=poison)
