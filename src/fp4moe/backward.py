"""The backward of ``fp4moe.moe`` in plain PyTorch: straight-through activation quantization.

The NVFP4 expert weights are frozen (they get no gradient). For a loss L and the forward of
numerics section 5, the gradients of the inputs are those of the same computation on the
dequantized weights with every rounding and activation quantization taken as the identity
(the straight-through convention), evaluated at the forward's own values:

- ``topk_weights``: dL/dw[t, k] = <dL/dout[t], y[t, k]>, y the route row the forward summed
  (bf16, exactly the reference's); 0 for a masked route.
- ``x``: for each valid route (t, k) to expert e, with h = xin @ W13[e].T the FC1 output of
  the forward's own FC1 input xin (``x`` in W4A16; its NVFP4 quantization, decoded, in
  W4A4; its e4m3 rows times their scales in W4A8) and g = w[t, k] * dL/dout[t] @ W2[e]:
  dL/dx[t] += (g * up * silu'(gate)) @ W_gate[e] + (g * silu(gate)) @ W_up[e].

W13 and W2 are the weights the forward multiplies: the decoded NVFP4 weights in W4A16 and
W4A4, and in W4A8 their e4m3 roundings (numerics section 5a: e4m3(u / 8) x 8 x the
global). So W4A8 gets W4A4's treatment: the straight-through gradient of the forward's own
computation, evaluated at its own quantized activations.

Expert by expert, in fp32; the weights of one expert are decoded at a time, so the extra
memory is one expert in fp32 plus the route rows [T, K, H] in bf16. Slow on purpose: it is
for fine-tuning around frozen NVFP4 experts (adapters on attention, the router), not a
training kernel.
"""

from __future__ import annotations

import torch

from .experts import PreparedExperts
from .nvfp4 import NVFP4Tensor, dequantize_nvfp4, global_from_amax
from .reference import e4m3_rows, e4m3_weights, quantized_input, route_rows_reference

__all__ = ["fc1_input_values", "forward_weights", "moe_backward_reference"]


def fc1_input_values(
    x: torch.Tensor,
    mode: str,
    act_scale: str,
    *,
    static: torch.Tensor | None = None,
    batch_global: torch.Tensor | None = None,
) -> torch.Tensor:
    """The FC1 input the forward multiplies, as fp32 values [n, H]: bf16 ``x`` [n, H] itself
    (W4A16), its e4m3 rows times their scales (W4A8), or its NVFP4 quantization decoded
    with its global scale (W4A4: one global a row for "per_token", ``static`` for
    "static", ``batch_global`` for "per_tensor")."""
    if mode == "w4a8":
        q, s = e4m3_rows(x)
        return q.float() * s[:, None]
    values, g = quantized_input(x, mode, act_scale, static, batch_global)
    if g is None:  # W4A16
        return values
    return values * (g.unsqueeze(-1) if g.dim() > 0 else g)  # dequantize_nvfp4's product


def forward_weights(m: NVFP4Tensor, mode: str) -> torch.Tensor:
    """The fp32 weights [N, C] the forward multiplies for one NVFP4 matrix ``m``: decoded
    (W4A16, W4A4), or rounded to e4m3 as W4A8 does, e4m3(u / 8) x 8 x global."""
    if mode != "w4a8":
        return dequantize_nvfp4(m)
    g = m.global_scale.float()
    return e4m3_weights(m.codes, m.scales).float() * 8.0 * (g.unsqueeze(-1) if g.dim() else g)


def moe_backward_reference(
    grad_out: torch.Tensor,
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    experts: PreparedExperts,
    *,
    mode: str,
    act_scale: str,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Gradients of ``moe`` (module docstring) for the upstream gradient ``grad_out``.

    Args:
        grad_out: [T, H] dL/dout (any float dtype).
        x: bf16 [T, H]; topk_ids: int32 [T, K]; topk_weights: fp32 [T, K]: the forward's.
        experts: the forward's experts. mode: "w4a16", "w4a8" or "w4a4"; act_scale: the
            W4A4 activation scale ("per_token", "static", "per_tensor").

    Returns:
        (dL/dx bf16 [T, H], dL/dtopk_weights fp32 [T, K]).
    """
    t, h = x.shape
    ids = topk_ids.long()
    g = grad_out.float()
    y = route_rows_reference(x, topk_ids, experts, mode=mode, act_scale=act_scale)
    grad_w = (g.unsqueeze(1) * y.float()).sum(-1) * (ids >= 0)
    grad_x = torch.zeros(t, h, dtype=torch.float32, device=x.device)
    batch_global = None
    if mode == "w4a4" and act_scale == "per_tensor" and t:
        batch_global = global_from_amax(x.abs().amax())
    for e in range(experts.num_experts):
        tok, slot = (ids == e).nonzero(as_tuple=True)
        if tok.numel() == 0:
            continue
        static = experts.a13_scale[e] if experts.a13_scale is not None else None
        xin = fc1_input_values(x[tok], mode, act_scale, static=static, batch_global=batch_global)
        gate, up = (forward_weights(m, mode) for m in experts.w13_nvfp4(e))  # fp32 [I, H]
        down = forward_weights(experts.w2_nvfp4(e), mode)  # fp32 [H, I]
        h_gate, h_up = xin @ gate.t(), xin @ up.t()
        grad_a = (g[tok] * topk_weights[tok, slot].float().unsqueeze(-1)) @ down  # [n, I]
        sig = torch.sigmoid(h_gate)
        d_gate = grad_a * h_up * sig * (1 + h_gate * (1 - sig))
        d_up = grad_a * h_gate * sig
        grad_x.index_add_(0, tok, d_gate @ gate + d_up @ up)
    return grad_x.to(x.dtype), grad_w
