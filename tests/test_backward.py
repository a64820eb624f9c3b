"""Gradients through fp4moe.moe: never silently wrong.

The backward (fp4moe.backward, run by the custom op's autograd) is compared with torch
autograd of the reference computation on the dequantized weights, written out here with
every rounding and activation quantization as a straight-through estimator (value of the
forward, gradient of the identity): W4A16, W4A8 (on the e4m3 weights its forward
multiplies) and each W4A4 activation scale, masked routes, fp32 and bf16 upstream
gradients.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import fp4moe
from fp4moe.nvfp4 import dequantize_nvfp4, global_from_amax, quantize_nvfp4
from fp4moe.reference import e4m3_rows, e4m3_weights
from testing import random_moe_weights, random_routes, random_x, rel_err

E, H, I, K, T = 4, 64, 32, 2, 9  # noqa: E741 (the contract's names)
MODES = ("w4a16", "w4a8", "w4a4-token", "w4a4-tensor", "w4a4-static")


@pytest.fixture(scope="module")
def experts():
    w13, w2 = random_moe_weights(E, H, I, seed=3)
    return fp4moe.prepare_experts(w13, w2, a13_scale=0.04, a2_scale=torch.full((E,), 0.3))


def _ste(v: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """value in the forward, the identity in the backward."""
    return v + (value - v).detach()


def _quantized(v: torch.Tensor, mode: str, static, batch_global) -> torch.Tensor:
    """The W4A8 or W4A4 FC input as fp32 values (numerics sections 5a and 2), of a detached
    bf16 copy of v."""
    b = v.detach().to(torch.bfloat16)
    if mode == "w4a8":
        q, s = e4m3_rows(b)
        return q.float() * s[:, None]
    if mode == "w4a4-token":
        q = quantize_nvfp4(b, per_row=True)
    elif mode == "w4a4-static":
        q = quantize_nvfp4(b, global_scale=static)
    else:
        q = quantize_nvfp4(b, global_scale=batch_global)
    return dequantize_nvfp4(q)


def _weights(m, mode: str) -> torch.Tensor:
    """The fp32 weights the forward multiplies: decoded, or W4A8's e4m3(u / 8) x 8 x g."""
    if mode == "w4a8":
        return e4m3_weights(m.codes, m.scales).float() * 8.0 * m.global_scale
    return dequantize_nvfp4(m)


def autograd_reference(x, ids, w, ex, mode):
    """out fp32 [T, H] with autograd through x and w: the forward's weights, STE roundings."""
    xf = x.float()
    w4a4 = mode != "w4a16"  # W4A8 or W4A4: quantized activations
    x_global = global_from_amax(x.abs().amax())
    acts: dict[tuple[int, int], torch.Tensor] = {}
    for e in range(E):
        gate, up = (_weights(m, mode) for m in ex.w13_nvfp4(e))
        for t, k in (ids == e).nonzero().tolist():
            xin = xf[t : t + 1]
            if w4a4:
                xin = _ste(xin, _quantized(xin, mode, ex.a13_scale[e], x_global))
            a = F.silu(xin @ gate.t()) * (xin @ up.t())
            acts[(t, k)] = _ste(a, a.detach().to(torch.bfloat16).float())
    a_global = global_from_amax(torch.cat(list(acts.values())).detach().abs().amax())
    out = torch.zeros(T, H)
    for (t, k), a in acts.items():
        e = int(ids[t, k])
        if w4a4:
            a = _ste(a, _quantized(a, mode, ex.a2_scale[e], a_global))
        y = a @ _weights(ex.w2_nvfp4(e), mode).t()
        y = _ste(y, y.detach().to(torch.bfloat16).float())
        out = out.index_add(0, torch.tensor([t]), w[t, k] * y)
    return out


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_gradients_match_autograd_of_the_dequantized_reference(experts, mode, grad_dtype):
    x0 = random_x(T, H, seed=4)
    ids, w0 = random_routes(T, K, E, seed=5, masked_frac=0.2)
    g = torch.randn(T, H, generator=torch.Generator().manual_seed(6)).to(grad_dtype)

    x, w = x0.clone().requires_grad_(), w0.clone().requires_grad_()
    out = fp4moe.moe(x, ids, w, experts, mode=mode)
    assert out.requires_grad and out.dtype == torch.bfloat16
    out.backward(g.to(out.dtype))

    xr, wr = x0.clone().float().requires_grad_(), w0.clone().requires_grad_()
    ref = autograd_reference(xr, ids, wr, experts, mode)
    # the STE reference reproduces the forward: bit-level check of the setup itself
    assert rel_err(ref.to(torch.bfloat16), out.detach()) < 1e-2
    ref.backward(g.to(torch.bfloat16).float())

    assert x.grad.dtype == torch.bfloat16 and w.grad.dtype == torch.float32
    assert rel_err(x.grad, xr.grad) < 1e-2, rel_err(x.grad, xr.grad)
    assert rel_err(w.grad, wr.grad) < 1e-2, rel_err(w.grad, wr.grad)
    masked = ids < 0
    assert masked.any() and bool((w.grad[masked] == 0).all())


def test_only_the_inputs_that_need_it_get_a_gradient(experts):
    x = random_x(T, H, seed=7)
    ids, w = random_routes(T, K, E, seed=8)
    with torch.no_grad():
        assert not fp4moe.moe(x.requires_grad_(), ids, w, experts).requires_grad
    x = x.detach()
    assert fp4moe.moe(x, ids, w, experts).grad_fn is None  # nothing requires grad
    wq = w.clone().requires_grad_()
    fp4moe.moe(x, ids, wq, experts, mode="w4a4-token").sum().backward()
    assert wq.grad is not None and x.grad is None


def test_backward_into_the_frozen_experts_is_an_error(experts):
    """A gradient that would have to reach the NVFP4 weights is refused, never dropped."""
    x = random_x(T, H, seed=9).requires_grad_()
    ids, w = random_routes(T, K, E, seed=10)
    g13 = experts.w13_global.clone().requires_grad_()
    ex = fp4moe.PreparedExperts(**{**experts.tensors(), "w13_global": g13})
    out = fp4moe.moe(x, ids, w, ex)
    with pytest.raises(RuntimeError, match=r"w13_global.*frozen"):
        out.sum().backward()


def test_layer_gradients_flow_to_the_router(experts):
    """Through MoELayer (router logits -> routes -> moe): the gate weight gets a gradient."""
    gate = (torch.randn(E, H, generator=torch.Generator().manual_seed(11)) / 8).requires_grad_()
    x = random_x(T, H, seed=12)
    logits = x.float() @ gate.t()
    layer = fp4moe.MoELayer(experts, fp4moe.RouterConfig(top_k=K), policy="w4a16")
    out = layer(x, router_logits=logits)
    out.float().pow(2).sum().backward()
    assert gate.grad is not None and bool(torch.isfinite(gate.grad).all())
    assert gate.grad.abs().sum() > 0
