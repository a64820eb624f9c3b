"""The whole MoE forward of docs/numerics.md (sections 5, 5a and 6) in plain PyTorch: the
contract in code.

Short, obvious and slow, on any device. Every fast path is tested against these functions.
Products of decoded values are exact; the reference accumulates them in float64 and
rounds once to fp32, which is at least as accurate as any fp32 accumulation order.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .experts import PreparedExperts
from .nvfp4 import dequantize_blocks, global_from_amax, quantize_nvfp4

__all__ = [
    "E4M3_MAX",
    "accumulate",
    "apply_global",
    "e4m3_rows",
    "e4m3_weights",
    "finalize_reference",
    "fma_f32",
    "moe_reference",
    "quantized_input",
    "route_rows_reference",
]


def accumulate(a: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """acc(a * w) over the reduction axis: a [n, K] and w [N, K] (fp32, exact decoded values)."""
    return (a.double() @ w.double().t()).float()


E4M3_MAX = 448.0  # the largest finite float8_e4m3fn


def e4m3_rows(v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """W4A8's activation rows (numerics section 5a): s = amax(|row|) / 448 in fp32 (1 for a
    row of zeros), q = e4m3(row / s), round to nearest even, saturating at 448.

    v: bf16 [n, C]. Returns (q float8_e4m3fn [n, C], s fp32 [n])."""
    f = v.float()
    amax = f.abs().amax(dim=1) if f.shape[1] else f.new_zeros(f.shape[0])
    s = torch.where(amax > 0, amax / torch.full_like(amax, E4M3_MAX), torch.ones_like(amax))
    q = (f / s[:, None]).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return q, s


def e4m3_weights(codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """W4A8's weights (numerics section 5a): e4m3(code value x block scale / 8), round to
    nearest even (exact up to that rounding; at most 336 in magnitude, so never saturating).

    codes uint8 [..., C/2], scales e4m3 [..., C/16]. Returns float8_e4m3fn [..., C]."""
    return (dequantize_blocks(codes, scales) / 8.0).to(torch.float8_e4m3fn)


def _w4a8_fc(v: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """acc(q_v * w8) * s_v * 8 in fp32 [n, N] (the weights' global not yet applied)."""
    q, s = e4m3_rows(v)
    acc = accumulate(q.float(), e4m3_weights(codes, scales).float())
    return acc * s[:, None] * 8.0


def quantized_input(
    v: torch.Tensor, mode: str, act_scale: str, static: torch.Tensor | None, tensor_global
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The FC input as exact fp32 values and its global scale (None for W4A16).

    v: bf16 [n, C]. Returns (deq [n, C] fp32, g_x: fp32 [n] or scalar or None).
    """
    if mode == "w4a16":
        return v.float(), None
    if act_scale == "per_token":
        q = quantize_nvfp4(v, per_row=True)
    elif act_scale == "static":
        q = quantize_nvfp4(v, global_scale=static)
    else:
        q = quantize_nvfp4(v, global_scale=tensor_global)
    return dequantize_blocks(q.codes, q.scales), q.global_scale


def apply_global(h: torch.Tensor, gx: torch.Tensor | None) -> torch.Tensor:
    if gx is None:
        return h
    return h * (gx.unsqueeze(-1) if gx.dim() > 0 else gx)


def route_rows_reference(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    experts: PreparedExperts,
    *,
    mode: str = "w4a16",
    act_scale: str = "per_token",
) -> torch.Tensor:
    """Every valid route's expert output y (numerics section 5).

    Args:
        x: bf16 [T, H]. topk_ids: int32 [T, K], negative = masked.
        mode: "w4a16", "w4a8" or "w4a4"; act_scale: "per_token", "static" or "per_tensor"
            (W4A4 only).

    Returns:
        bf16 [T, K, H]; rows of masked routes are 0 (the finalize never reads them).
    """
    t, h = x.shape
    k = topk_ids.shape[1]
    i = experts.intermediate_size
    ids = topk_ids.long()
    act_rows = torch.zeros(t, k, i, dtype=torch.bfloat16, device=x.device)
    x_global = global_from_amax(x.abs().amax()) if t else None

    # FC1 and SwiGLU, expert by expert.
    for e in range(experts.num_experts):
        tok, slot = (ids == e).nonzero(as_tuple=True)
        if tok.numel() == 0:
            continue
        gate, up = experts.w13_nvfp4(e)
        if mode == "w4a8":
            h_gate = _w4a8_fc(x[tok], gate.codes, gate.scales)
            h_up = _w4a8_fc(x[tok], up.codes, up.scales)
        else:
            a13 = experts.a13_scale[e] if experts.a13_scale is not None else None
            xin, gx = quantized_input(x[tok], mode, act_scale, a13, x_global)
            h_gate = apply_global(accumulate(xin, dequantize_blocks(gate.codes, gate.scales)), gx)
            h_up = apply_global(accumulate(xin, dequantize_blocks(up.codes, up.scales)), gx)
        h_gate = h_gate * gate.global_scale
        h_up = h_up * up.global_scale
        act_rows[tok, slot] = (F.silu(h_gate) * h_up).to(torch.bfloat16)

    # FC2. Dynamic per-tensor W4A4 takes one global over all valid activation rows.
    valid = ids >= 0
    a_global = global_from_amax(act_rows[valid].abs().amax()) if bool(valid.any()) else None
    y = torch.zeros(t, k, h, dtype=torch.bfloat16, device=x.device)
    for e in range(experts.num_experts):
        tok, slot = (ids == e).nonzero(as_tuple=True)
        if tok.numel() == 0:
            continue
        w2 = experts.w2_nvfp4(e)
        if mode == "w4a8":
            acc = _w4a8_fc(act_rows[tok, slot], w2.codes, w2.scales)
        else:
            a2 = experts.a2_scale[e] if experts.a2_scale is not None else None
            ain, ga = quantized_input(act_rows[tok, slot], mode, act_scale, a2, a_global)
            acc = apply_global(accumulate(ain, dequantize_blocks(w2.codes, w2.scales)), ga)
        y[tok, slot] = (acc * w2.global_scale).to(torch.bfloat16)
    return y


def fma_f32(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """fp32 fused multiply-add a * b + c with one rounding, as the GPU's FFMA computes it.

    a * b is exact in float64 (when a or b has at most 29 significant bits, as bf16 values do);
    the sum is rounded to float64 with round-to-odd (exact error term by TwoSum), and
    round-to-odd at 53 bits followed by round-to-nearest at 24 bits is correctly rounded.
    """
    p = a.double() * b.double()
    c = c.double()
    s = p + c
    bb = s - p
    err = (p - (s - bb)) + (c - bb)
    even = (s.view(torch.int64) & 1) == 0
    bump = (err != 0) & even
    toward = torch.where(
        err > 0, torch.full_like(s, float("inf")), torch.full_like(s, float("-inf"))
    )
    s = torch.where(bump, torch.nextafter(s, toward), s)
    return s.float()


def finalize_reference(
    y: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor
) -> torch.Tensor:
    """Deterministic finalize (numerics section 6).

    Args:
        y: bf16 [T, K, H] route rows in expanded order. topk_ids int32 [T, K] (negative = masked).
        topk_weights: fp32 [T, K].

    Returns:
        bf16 [T, H]: acc = fma(w[t, k], fp32(y[t, k]), acc) for k ascending over valid routes,
        from 0.0, rounded once to bf16.
    """
    t, k, h = y.shape
    acc = torch.zeros(t, h, dtype=torch.float32, device=y.device)
    for j in range(k):
        valid = (topk_ids[:, j] >= 0).unsqueeze(-1)
        w = topk_weights[:, j].float().unsqueeze(-1).expand(t, h)
        nxt = fma_f32(w, y[:, j].float(), acc)
        acc = torch.where(valid, nxt, acc)
    return acc.to(torch.bfloat16)


def moe_reference(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    experts: PreparedExperts,
    *,
    mode: str = "w4a16",
    act_scale: str = "per_token",
) -> torch.Tensor:
    """The MoE layer of numerics sections 5, 5a and 6 (deterministic finalize), bf16 [T, H].

    Inputs are assumed valid (``fp4moe.moe`` validates them).
    """
    y = route_rows_reference(x, topk_ids, experts, mode=mode, act_scale=act_scale)
    return finalize_reference(y, topk_ids, topk_weights)
