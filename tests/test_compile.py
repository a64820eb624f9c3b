"""torch.compile and the fp4moe::moe custom op: the op's schema, fake and autograd pass
torch.library.opcheck; fullgraph compiles of moe() and MoELayer have no graph break and give
the eager bits; the serving phase reaches a compiled layer; eager-only options are refused
while compiling. GPU: the Triton backend inside CUDA graphs (mode="reduce-overhead")."""

from __future__ import annotations

import dataclasses
import shutil

import pytest
import torch

import fp4moe
from fp4moe.moe import EAGER_OPTIONS, OP_OPTIONS
from fp4moe.ops import expert_tensors
from testing import random_moe_weights, random_routes, random_x

E, H, I, K = 8, 64, 32, 2  # noqa: E741 (the contract's names)


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _experts(device="cpu"):
    w13, w2 = random_moe_weights(E, H, I, seed=0)
    return fp4moe.prepare_experts(w13.to(device), w2.to(device), a13_scale=0.05, a2_scale=0.4)


def _layer(device="cpu", backend="reference", **kw):
    gate = torch.randn(E, H, generator=torch.Generator().manual_seed(1)) / 8
    policy = fp4moe.PhasePolicy(prefill="w4a4-token", decode="w4a16", backend=backend, **kw)
    return fp4moe.MoELayer(
        _experts(device), fp4moe.RouterConfig(top_k=K), gate_weight=gate.to(device), policy=policy
    )


def test_op_schema_and_opcheck():
    ex = _experts()
    x = random_x(6, H, seed=2)
    ids, w = random_routes(6, K, E, seed=3, masked_frac=0.2)
    schema = str(torch.ops.fp4moe.moe.default._schema)
    assert schema.startswith("fp4moe::moe(Tensor x, Tensor topk_ids, Tensor topk_weights")
    assert "bool? pdl, float? valid_fraction) -> Tensor" in schema
    args = (x, ids, w.requires_grad_(), *expert_tensors(ex), "w4a4", "per_token", False,
            "reference", True, None, None)  # fmt: skip
    # (opcheck's schema test multiplies the inputs, which float8 scales do not support)
    utils = ("test_faketensor", "test_autograd_registration", "test_aot_dispatch_dynamic")
    torch.library.opcheck(torch.ops.fp4moe.moe.default, args, test_utils=utils)
    # T = 0 through the op and its fake
    empty = (x[:0], ids[:0], w.detach()[:0], *args[3:])
    torch.library.opcheck(torch.ops.fp4moe.moe.default, empty, test_utils=utils)


def test_eager_calls_and_the_op_give_the_same_bits():
    """An eager call that needs no gradient runs the op's body without the dispatcher;
    fake tensors (what the compiler traces with) go through the op and its fake."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    ex = _experts()
    x = random_x(7, H, seed=2)
    ids, w = random_routes(7, K, E, seed=3)
    eager = fp4moe.moe(x, ids, w, ex, mode="w4a4-static")
    op = torch.ops.fp4moe.moe(x, ids, w, *expert_tensors(ex), "w4a4", "static", False,
                              "reference", True, None, None)  # fmt: skip
    assert torch.equal(eager, op)
    with FakeTensorMode() as mode:
        fake = fp4moe.PreparedExperts(
            **{k: mode.from_tensor(v) for k, v in ex.tensors().items()}, validate=False
        )
        out = fp4moe.moe(mode.from_tensor(x), mode.from_tensor(ids), mode.from_tensor(w), fake)
        assert out.shape == (7, H) and out.dtype == torch.bfloat16


def test_every_option_is_passed_through_or_eager_only():
    names = {f.name for f in dataclasses.fields(fp4moe.Options)}
    assert names == set(OP_OPTIONS) | set(EAGER_OPTIONS)
    assert not set(OP_OPTIONS) & set(EAGER_OPTIONS)


@pytest.mark.parametrize("mode", ["w4a4-static", "w4a8"])
def test_compiled_moe_fullgraph_is_bitwise_eager(mode):
    ex = _experts()
    x = random_x(11, H, seed=4)
    ids, w = random_routes(11, K, E, seed=5, masked_frac=0.1)

    def f(x, ids, w):
        return fp4moe.moe(x, ids, w, ex, mode=mode)

    explained = torch._dynamo.explain(f)(x, ids, w)
    assert explained.graph_break_count == 0 and explained.graph_count == 1
    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    assert torch.equal(compiled(x, ids, w), f(x, ids, w))
    assert compiled(x[:0], ids[:0], w[:0]).shape == (0, H)  # T = 0 compiles too


def test_compiled_layer_fullgraph_phases_and_stats():
    from torch._dynamo.utils import counters

    counters.clear()
    layer = _layer(decode_max_tokens=8)
    xs = {t: random_x(t, H, seed=10 + t) for t in (3, 20)}
    eager = {t: layer(x) for t, x in xs.items()}
    layer.stats = type(layer.stats)()
    compiled = torch.compile(layer, fullgraph=True, backend="aot_eager")
    for t, x in xs.items():  # 3 tokens: decode (W4A16); 20: prefill (W4A4)
        assert torch.equal(compiled(x), eager[t])
    assert layer.stats.calls == {"prefill": 1, "decode": 1}
    # the serving phase is read (and guarded) inside the compiled graph
    with fp4moe.serving_phase("prefill"):
        assert torch.equal(compiled(xs[3]), layer(xs[3], "prefill"))
    with fp4moe.serving_phase("decode"):
        assert torch.equal(compiled(xs[20]), layer(xs[20], "decode"))
    assert not torch.equal(layer(xs[20], "decode"), eager[20])  # the phases really differ
    assert torch.equal(compiled(xs[20]), eager[20])  # back to the threshold
    assert sum(counters["graph_break"].values()) == 0


def test_eager_only_options_are_refused_while_compiling():
    ex = _experts()
    x = random_x(4, H, seed=6)
    ids, w = random_routes(4, K, E, seed=7)
    poison = fp4moe.Options(poison=True)
    eager = fp4moe.moe(x, ids, w, ex, options=poison)  # eager: runs (the reference ignores it)
    assert torch.equal(eager, fp4moe.moe(x, ids, w, ex))

    def f(x, ids, w):
        return fp4moe.moe(x, ids, w, ex, options=poison)

    with pytest.raises(Exception, match=r"poison.*eager-only"):
        torch.compile(f, fullgraph=True, backend="eager")(x, ids, w)


def test_compiled_layer_backward_matches_eager():
    layer = _layer()
    x0 = random_x(12, H, seed=8)

    def run(fn):
        x = x0.clone().requires_grad_()
        fn(x).float().square().sum().backward()
        return x.grad

    eager = run(layer)
    compiled = run(torch.compile(layer, fullgraph=True, backend="aot_eager"))
    assert torch.equal(compiled, eager)


@pytest.mark.skipif(shutil.which("g++") is None, reason="inductor on the CPU needs a C++ compiler")
def test_inductor_keeps_the_op_bitwise():
    """Inductor compiles what surrounds the op; given routes, the layer is the op alone."""
    layer = _layer()
    x = random_x(9, H, seed=9)
    routes = random_routes(9, K, E, seed=10)
    compiled = torch.compile(layer, fullgraph=True)
    assert torch.equal(compiled(x, "prefill", routes=routes), layer(x, "prefill", routes=routes))


# ------------------------------------------------------------------------------ GPU


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["w4a16", "w4a8", "w4a4-token", "w4a4-static"])
def test_cuda_graphs_reduce_overhead_bitwise(mode):
    """Triton backend inside torch.compile(mode="reduce-overhead") (CUDA graphs): replays
    give the eager bits, for two token counts and a phase change."""
    layer = _layer("cuda", backend="triton")
    layer.policy = fp4moe.PhasePolicy.single(mode, backend="triton")
    compiled = torch.compile(layer, mode="reduce-overhead", fullgraph=True)
    for t in (1, 7, 7, 64, 1):
        x = random_x(t, H, seed=t).cuda()
        routes = tuple(r.cuda() for r in random_routes(t, K, E, seed=t + 1))
        want = layer(x, routes=routes)
        got = compiled(x, routes=routes).clone()
        torch.cuda.synchronize()
        assert torch.equal(got, want), t


@pytest.mark.gpu
def test_cuda_graphs_backend_router_and_phases():
    """backend="cudagraphs": the whole layer (router included) replays bitwise."""
    layer = _layer("cuda", backend="triton", decode_max_tokens=4)
    compiled = torch.compile(layer, backend="cudagraphs", fullgraph=True)
    for t in (2, 2, 16, 16, 2):
        x = random_x(t, H, seed=20 + t).cuda()
        assert torch.equal(compiled(x).clone(), layer(x)), t
