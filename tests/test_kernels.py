"""The Triton backend against the reference: in the interpreter on CPU (tiny shapes, PDL
off) and on the GPU (marked ``gpu``: model shapes, PDL on, batch invariance)."""

from __future__ import annotations

import pytest
import torch

import fp4moe
from fp4moe.kernels.launch import TritonOptions, moe_triton
from fp4moe.kernels.sort import sort_routes, sort_routes_reference
from fp4moe.reference import finalize_reference, moe_reference, route_rows_reference
from testing import TOL, rel_err

MODES = [
    ("w4a16", "per_token"),
    ("w4a4", "per_token"),
    ("w4a4", "static"),
    ("w4a4", "per_tensor"),
]


def _mode_id(m):
    return f"{m[0]}-{m[1]}" if m[0] == "w4a4" else m[0]


def _routes(t, k, e, *, seed, device, masked=0.0, one_expert=None):
    g = torch.Generator().manual_seed(seed)
    ids = (
        torch.stack([torch.randperm(max(e, k), generator=g)[:k] for _ in range(t)])
        if t
        else (torch.zeros(0, k, dtype=torch.int64))
    )
    ids = torch.where(ids < e, ids, -1)
    if one_expert is not None:
        ids = torch.full((t, k), -1, dtype=torch.int64)
        ids[:, 0] = one_expert
    if masked:
        ids = torch.where(torch.rand(ids.shape, generator=g) < masked, -1, ids)
    w = torch.rand(t, k, generator=g)
    return ids.to(torch.int32).to(device), w.to(device)


def _experts(e, h, i, *, seed, device):
    g = torch.Generator().manual_seed(seed)
    w13 = torch.randn(e, 2 * i, h, generator=g) * (1 + 4 * (torch.rand(h, generator=g) > 0.97))
    w2 = torch.randn(e, h, i, generator=g)
    ex = fp4moe.prepare_experts(
        (w13 * 0.05).to(device), (w2 * 0.05).to(device),
        a13_scale=torch.full((e,), 5.0 / 2688), a2_scale=torch.full((e,), 0.3 / 2688),
    )  # fmt: skip
    return ex


def _x(t, h, *, seed, device):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, h, generator=g) * (1 + 3 * (torch.rand(h, generator=g) > 0.95))
    return x.to(torch.bfloat16).to(device)


# ----------------------------------------------------------------------------- sort


@pytest.mark.parametrize(
    "t,k,e,bm",
    [
        (0, 2, 4, 16), (1, 1, 3, 16), (37, 3, 5, 16), (50, 4, 8, 32), (150, 2, 40, 16),
        (200, 8, 32, 16), (500, 8, 32, 8),  # 1600 and 4000 routes: 8 and 4 a sort program
    ],
)  # fmt: skip
@pytest.mark.parametrize("masked", [0.0, 0.3, 1.0], ids=["none", "some", "all"])
@pytest.mark.parametrize("use_kernel", [False, True], ids=["torch", "triton"])
def test_sort_invariants(interpret, device, t, k, e, bm, masked, use_kernel):
    if use_kernel and t == 0:
        pytest.skip("T = 0 never reaches the sort")
    ids, _ = _routes(t, k, e, seed=t + k, device=device, masked=masked)
    zero = torch.full((1000,), 7, dtype=torch.int32, device=device)  # split-K counters
    s = sort_routes(ids, e, bm, use_kernel=use_kernel, zero=zero)
    assert bool((zero == 0).all())
    s = type(s)(**{f: (v.cpu() if isinstance(v, torch.Tensor) else v) for f, v in vars(s).items()})
    ids = ids.cpu()
    ref = sort_routes_reference(ids, e, bm)
    n_valid = ref["n_valid"]
    assert int(s.expert_offsets[e]) == n_valid
    for ex in range(e):
        lo, hi = int(s.expert_offsets[ex]), int(s.expert_offsets[ex + 1])
        assert s.sorted_routes[lo:hi].tolist() == ref["rows"][ex]
        assert int(s.expert_counts[ex]) == len(ref["rows"][ex])
    # inverse permutation
    flat = torch.arange(t * k, dtype=torch.int32)
    assert torch.equal(s.sorted_routes[s.route_pos.long()], flat)
    tiles = [
        (int(a), int(b), int(c))
        for a, b, c in zip(s.block_expert, s.block_start, s.block_end)
        if int(a) >= 0
    ]
    assert tiles == ref["tiles"]
    assert all(int(a) == -1 for a in s.block_expert[len(tiles) :])
    assert s.valid_blocks.tolist() == [len(tiles)]
    sorted_ids = ids.reshape(-1)[s.sorted_routes.long()]
    assert torch.equal(s.sorted_expert[:n_valid], sorted_ids[:n_valid])
    assert bool((s.sorted_expert[n_valid:] == 0).all())
    if use_kernel:  # both implementations agree field by field
        other = sort_routes(ids, e, bm, use_kernel=False)
        for f, v in vars(other).items():
            if isinstance(v, torch.Tensor):
                assert torch.equal(v, getattr(s, f)), f


# ----------------------------------------------------------------------------- whole MoE

CPU_CASES = [
    # (T, K, E, H, I, masked, one_expert)
    pytest.param(1, 2, 4, 64, 32, 0.0, None, id="T1"),
    pytest.param(9, 3, 4, 64, 64, 0.2, None, id="T9-masked"),
    pytest.param(20, 2, 6, 96, 32, 0.0, None, id="T20-emptyexperts"),
    pytest.param(17, 2, 4, 64, 32, 0.0, 2, id="T17-oneexpert"),
    pytest.param(5, 2, 4, 64, 32, 1.0, None, id="allmasked"),
]


@pytest.mark.kernel
@pytest.mark.parametrize("mode", MODES, ids=_mode_id)
@pytest.mark.parametrize("fused", [False, True], ids=["deterministic", "fused"])
@pytest.mark.parametrize("t,k,e,h,i,masked,one", CPU_CASES)
def test_moe_triton_matches_reference(interpret, device, mode, fused, t, k, e, h, i, masked, one):
    if device != "cpu":
        pytest.skip("interpreter case; the GPU runs test_moe_gpu_shapes")
    experts = _experts(e, h, i, seed=e + h, device=device)
    x = _x(t, h, seed=t, device=device)
    ids, w = _routes(t, k, e, seed=t * 7, device=device, masked=masked, one_expert=one)
    if t > 12:  # T20: experts 4 and 5 get nothing
        ids = torch.where(ids >= 4, -1, ids) if e == 6 else ids
    m, sc = mode
    before = [v.clone() for v in experts.to_linear().values()]
    ref = moe_reference(x, ids, w, experts, mode=m, act_scale=sc)
    # Workspaces and output are NaN-poisoned, so an element no kernel wrote shows up.
    out = moe_triton(
        x, ids, w, experts, mode=m, act_scale=sc, fused_finalize=fused,
        options=TritonOptions(poison=True),
    )  # fmt: skip
    assert out.dtype == torch.bfloat16 and out.shape == (t, h)
    assert not torch.isnan(out).any()
    # Accumulation order differs (fp32 in K chunks against the reference's exact sum), so
    # route rows agree to rounding; bit-identity of finalize is tested separately below.
    if bool((ids >= 0).any()):
        assert rel_err(out, ref) <= TOL[m], f"rel err {rel_err(out, ref):.2e}"
    else:
        assert torch.equal(out, torch.zeros_like(out))
    for a, b in zip(before, experts.to_linear().values()):
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))


@pytest.mark.kernel
def test_finalize_kernel_bitwise(interpret, device):
    if device != "cpu":
        pytest.skip("interpreter case")
    t, k, e, h, i = 7, 4, 5, 64, 32
    experts = _experts(e, h, i, seed=1, device=device)
    x = _x(t, h, seed=2, device=device)
    ids, w = _routes(t, k, e, seed=3, device=device, masked=0.3)
    y = route_rows_reference(x, ids, experts)
    ref = finalize_reference(y, ids, w)
    out = moe_triton(x, ids, w, experts, options=TritonOptions(pdl=False))
    assert torch.equal(out, ref)


def test_finalize_tokens_per_program_bitwise(interpret, device, monkeypatch):
    """Several tokens a finalize program (``finalize.TOKENS_PER_PROGRAM``, a partial last
    program, masked and all-masked tokens) give the reference's bits."""
    if device != "cpu":
        pytest.skip("interpreter case")
    from fp4moe.kernels import finalize

    monkeypatch.setattr(finalize, "TOKENS_PER_PROGRAM", 3)
    monkeypatch.setattr(finalize, "TOKENS_FROM", 1)
    assert finalize.finalize_tokens_per_program(7) == 3
    t, k, e, h, i = 7, 4, 5, 64, 32
    experts = _experts(e, h, i, seed=4, device=device)
    x = _x(t, h, seed=5, device=device)
    ids, w = _routes(t, k, e, seed=6, device=device, masked=0.3)
    ids[2] = -1  # a token with every route masked
    ref = finalize_reference(route_rows_reference(x, ids, experts), ids, w)
    out = moe_triton(x, ids, w, experts, options=TritonOptions(pdl=False))
    assert torch.equal(out, ref)


def test_triton_backend_needs_cuda_or_interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    experts = _experts(2, 64, 32, seed=0, device="cpu")
    x = _x(2, 64, seed=0, device="cpu")
    ids, w = _routes(2, 1, 2, seed=0, device="cpu")
    with pytest.raises(RuntimeError, match="backend"):
        moe_triton(x, ids, w, experts)


# ----------------------------------------------------------------------------- GPU

GPU_SHAPES = {
    # name: (E, H, I, K, E_total)
    "deepseek-v3-ep8": (32, 7168, 2048, 8, 256),
    "qwen3-30b-a3b": (128, 2048, 768, 8, 128),
    "gpt-oss-like": (16, 2880, 2880, 4, 128),
}


def _gpu_routes(t, k, e_local, e_total, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    _, ids = torch.rand(t, e_total, device="cuda", generator=g).topk(k, dim=1)
    ids = torch.where(ids < e_local, ids, -1).to(torch.int32)
    w = torch.rand(t, k, device="cuda", generator=g)
    return ids, w


def _edge_routes(ids, case, expert=3):
    """The GPU tests' edge cases of routes ``ids`` [T, K]: "one-expert" puts every valid
    route and each token's first on ``expert`` (many row blocks of one expert),
    "all-masked" masks every route; any other case returns ``ids``."""
    if case == "one-expert":
        ids = torch.where(ids >= 0, expert, -1).to(torch.int32)
        ids[:, 0] = expert
    elif case == "all-masked":
        ids = torch.full_like(ids, -1)
    return ids


def _edge_inputs(t_rows, case, h, k, e, e_total, seed):
    """The GPU tests' inputs: x bf16 [t_rows, h] and routes (``_gpu_routes``) on the GPU,
    with ``case``'s edge routes (``_edge_routes``)."""
    x = _x(t_rows, h, seed=seed, device="cuda")
    ids, w = _gpu_routes(t_rows, k, e, e_total, seed=seed)
    return x, _edge_routes(ids, case), w


def test_edge_routes():
    """The GPU tests' route edge cases (``_edge_routes``), checked here on the CPU."""
    ids = torch.tensor([[5, -1, 2], [0, 7, -1]], dtype=torch.int32)
    one = _edge_routes(ids, "one-expert", expert=4)
    assert one.tolist() == [[4, -1, 4], [4, 4, -1]] and one.dtype == torch.int32
    assert _edge_routes(ids, "all-masked").eq(-1).all()
    assert _edge_routes(ids, 16) is ids
    assert ids.tolist() == [[5, -1, 2], [0, 7, -1]]  # the input is not changed


@pytest.mark.gpu
@pytest.mark.parametrize("shape", list(GPU_SHAPES))
@pytest.mark.parametrize("t", [0, 1, 3, 64, 1000, 8192])
@pytest.mark.parametrize("mode", MODES, ids=_mode_id)
@pytest.mark.parametrize("fused", [False, True], ids=["deterministic", "fused"])
def test_moe_gpu_shapes(gpu_experts, shape, t, mode, fused):
    e, h, _i, k, e_total = GPU_SHAPES[shape]
    if t == 8192 and shape != "deepseek-v3-ep8" and mode[1] != "per_token":
        pytest.skip("8192 tokens: one mode set per shape keeps the run short")
    experts = gpu_experts(shape)
    x = _x(t, h, seed=t, device="cuda")
    ids, w = _gpu_routes(t, k, e, e_total, seed=t + 1)
    m, sc = mode
    if t == 0:
        out = fp4moe.moe(x, ids, w, experts, mode=m, act_scale=sc, fused_finalize=fused)
        assert out.shape == (0, h)
        return
    out = moe_triton(
        x, ids, w, experts, mode=m, act_scale=sc, fused_finalize=fused,
        options=TritonOptions(poison=True),
    )  # fmt: skip
    assert out.shape == (t, h)
    ref = moe_reference(x, ids, w, experts, mode=m, act_scale=sc)
    assert not torch.isnan(out).any()
    assert rel_err(out, ref) <= TOL[m], f"rel err {rel_err(out, ref):.2e}"


@pytest.mark.gpu
@pytest.mark.parametrize("mode", MODES, ids=_mode_id)
@pytest.mark.parametrize("case", ["masked", "one-expert", "all-masked"])
def test_moe_gpu_edges(gpu_experts, mode, case):
    e, h, _i, k, _e_total = GPU_SHAPES["qwen3-30b-a3b"]
    experts = gpu_experts("qwen3-30b-a3b")
    t = 77
    x = _x(t, h, seed=5, device="cuda")
    ids, w = _routes(
        t,
        k,
        e,
        seed=6,
        device="cuda",
        masked={"masked": 0.4, "all-masked": 1.0}.get(case, 0.0),
        one_expert=3 if case == "one-expert" else None,
    )
    m, sc = mode
    ref = moe_reference(x, ids, w, experts, mode=m, act_scale=sc)
    for fused in (False, True):
        out = fp4moe.moe(x, ids, w, experts, mode=m, act_scale=sc, fused_finalize=fused)
        if case == "all-masked":
            assert torch.equal(out, torch.zeros_like(out))
        else:
            assert rel_err(out, ref) <= TOL[m]


@pytest.mark.gpu
def test_finalize_gpu_bitwise(gpu_experts):
    """Deterministic finalize on the GPU is bit-identical to the reference given the same rows."""
    from fp4moe.kernels.finalize import finalize_block_h, finalize_kernel

    e, h, _i, k, e_total = GPU_SHAPES["deepseek-v3-ep8"]
    for t, tpp in ((1, 1), (300, 1), (300, 8), (301, 3)):  # tokens a program, a partial last
        ids, w = _gpu_routes(t, k, e, e_total, seed=t)
        y = (torch.randn(t * k, h, device="cuda")).to(torch.bfloat16)
        pos = torch.arange(t * k, dtype=torch.int32, device="cuda")
        out = torch.full((t, h), float("nan"), dtype=torch.bfloat16, device="cuda")
        bh, warps = finalize_block_h(t, h)
        finalize_kernel[(-(-t // tpp), -(-h // bh))](
            y, pos, ids, w.reshape(-1), out, h, t, TOPK=k, KP=8, BLOCK_H=bh, USE_PDL=False,
            INTERPRET=False, TPP=tpp, num_warps=warps,
        )  # fmt: skip
        ref = finalize_reference(y.view(t, k, h), ids, w)
        assert torch.equal(out, ref), (t, tpp)


@pytest.mark.gpu
@pytest.mark.parametrize("mode", [m for m in MODES if m[1] != "per_tensor"], ids=_mode_id)
def test_batch_invariance_gpu(gpu_experts, mode):
    e, h, _i, k, e_total = GPU_SHAPES["deepseek-v3-ep8"]
    experts = gpu_experts("deepseek-v3-ep8")
    m, sc = mode
    x0 = _x(1, h, seed=100, device="cuda")
    ids0, w0 = _gpu_routes(1, k, e, 32, seed=100)  # a token with local routes
    alone = fp4moe.moe(x0, ids0, w0, experts, mode=m, act_scale=sc)
    for t in (7, 64, 384, 4096):  # 384: the whole-K Gluon kernels (gluon_whole_upto)
        x = _x(t, h, seed=t, device="cuda")
        ids, w = _gpu_routes(t, k, e, e_total, seed=t)
        pos = t // 2
        x[pos], ids[pos], w[pos] = x0[0], ids0[0], w0[0]
        out = fp4moe.moe(x, ids, w, experts, mode=m, act_scale=sc)
        assert torch.equal(out[pos], alone[0]), f"T={t}"


@pytest.mark.gpu
@pytest.mark.parametrize("t", [1, 16, 300])
@pytest.mark.parametrize("fused", [False, True], ids=["deterministic", "fused"])
def test_decode_asm_matches_plain_decode(gpu_experts, t, fused):
    """The inline-PTX decode gives the same bits as the plain Triton decode."""
    e, h, _, k, e_total = GPU_SHAPES["deepseek-v3-ep8"]
    experts = gpu_experts("deepseek-v3-ep8")
    x = _x(t, h, seed=t, device="cuda")
    ids, w = _gpu_routes(t, k, e, e_total, seed=t)
    plain = moe_triton(
        x, ids, w, experts, fused_finalize=fused, options=TritonOptions(decode_asm=False)
    )
    asm = moe_triton(
        x, ids, w, experts, fused_finalize=fused, options=TritonOptions(decode_asm=True)
    )
    ref = moe_reference(x, ids, w, experts)
    assert rel_err(asm, ref) <= TOL["w4a16"]
    if not fused:
        assert torch.equal(asm, plain)


@pytest.mark.kernel
def test_backend_triton_through_moe(interpret, device):
    """The public entry point reaches the Triton backend (interpreter on CPU)."""
    experts = _experts(4, 64, 32, seed=3, device=device)
    x = _x(6, 64, seed=3, device=device)
    ids, w = _routes(6, 2, 4, seed=3, device=device)
    out = fp4moe.moe(x, ids, w, experts, mode="w4a4", backend="triton")
    ref = moe_reference(x, ids, w, experts, mode="w4a4", act_scale="per_token")
    assert rel_err(out, ref) <= TOL["w4a4"]
    # options reach the kernels: the dense path with poisoned workspaces, the same bits
    assert fp4moe.TritonOptions is TritonOptions
    opt = fp4moe.TritonOptions(dense_above=0, valid_fraction=0.5, poison=True)
    dense = fp4moe.moe(x, ids, w, experts, mode="w4a4", backend="triton", options=opt)
    assert torch.equal(dense, out)
    assert torch.equal(fp4moe.moe(x, ids, w, experts, mode="w4a4", backend="reference",
                                  options=opt), ref)  # fmt: skip
    with pytest.raises(TypeError, match="options"):
        fp4moe.moe(x, ids, w, experts, backend="triton", options={"dense_above": 0})


@pytest.mark.kernel
@pytest.mark.parametrize("mode", MODES, ids=_mode_id)
def test_prefetch_config_matches_plain(interpret, device, mode):
    """Register double buffering of the weight tiles changes no bits."""
    if device != "cpu":
        pytest.skip("interpreter case; the GPU sweep runs prefetch configs")
    from fp4moe.kernels.gemm import GemmConfig

    experts = _experts(4, 128, 64, seed=11, device=device)
    x = _x(10, 128, seed=11, device=device)
    ids, w = _routes(10, 2, 4, seed=11, device=device, masked=0.2)
    m, sc = mode
    plain = GemmConfig(16, 32, 32, num_stages=1)
    pre = GemmConfig(16, 32, 32, num_stages=1, prefetch=True)
    a = moe_triton(x, ids, w, experts, mode=m, act_scale=sc,
                   options=TritonOptions(fc1=plain, fc2=plain, chunked=0))  # fmt: skip
    b = moe_triton(x, ids, w, experts, mode=m, act_scale=sc,
                   options=TritonOptions(fc1=pre, fc2=pre, chunked=0))  # fmt: skip
    assert torch.equal(a, b)


@pytest.mark.kernel
@pytest.mark.parametrize("fused", [False, True], ids=["deterministic", "fused"])
@pytest.mark.parametrize("t", [1, 13])
def test_fc1_nvfp4_out_matches_two_step(interpret, device, fused, t):
    """Static W4A4: FC1 quantizing its own output gives the bits of FC1 + quantize kernel."""
    if device != "cpu":
        pytest.skip("interpreter case")
    from fp4moe.kernels.gemm import GemmConfig

    experts = _experts(4, 64, 64, seed=21, device=device)
    x = _x(t, 64, seed=21, device=device)
    ids, w = _routes(t, 2, 4, seed=21, device=device, masked=0.2)
    cfg = GemmConfig(16, 32, 32, num_stages=1)
    two = moe_triton(x, ids, w, experts, mode="w4a4", act_scale="static", fused_finalize=fused,
                     options=TritonOptions(fc1=cfg, fc2=cfg, poison=True,
                                           fc1_nvfp4_out=False))  # fmt: skip
    one = moe_triton(
        x, ids, w, experts, mode="w4a4", act_scale="static", fused_finalize=fused,
        options=TritonOptions(fc1=cfg, fc2=cfg, poison=True, fc1_nvfp4_out=True),
    )  # fmt: skip
    ref = moe_reference(x, ids, w, experts, mode="w4a4", act_scale="static")
    if not fused:
        assert torch.equal(one, two)
    assert rel_err(one, ref) <= TOL["w4a4"]


@pytest.mark.gpu
@pytest.mark.parametrize("t", [1, 64, 1000])
def test_fc1_nvfp4_out_gpu(gpu_experts, t):
    """On the GPU, FC1's own NVFP4 output gives the bits of the two-step static path."""
    e, h, _, k, e_total = GPU_SHAPES["deepseek-v3-ep8"]
    experts = gpu_experts("deepseek-v3-ep8")
    x = _x(t, h, seed=t, device="cuda")
    ids, w = _gpu_routes(t, k, e, e_total, seed=t)
    two = moe_triton(x, ids, w, experts, mode="w4a4", act_scale="static",
                     options=TritonOptions(poison=True, fc1_nvfp4_out=False))  # fmt: skip
    one = moe_triton(x, ids, w, experts, mode="w4a4", act_scale="static",
                     options=TritonOptions(poison=True, fc1_nvfp4_out=True))  # fmt: skip
    assert torch.equal(one, two)


@pytest.mark.kernel
@pytest.mark.parametrize("mode", MODES, ids=_mode_id)
def test_chunked_loop_matches_reference_and_is_config_invariant(interpret, device, mode):
    """The chunk-ordered main loops (TritonOptions.chunked 1 and 2): within tolerance of
    the reference; loop 1 (K=16 dots) gives one summation order for every config (BK 32
    and 64, BN 32 and 64): the same bits, which batch invariance needs when the config
    follows the size. (Loop 2 does one dot a K tile; the interpreter sums a dot in one
    numpy call, so its bits match loop 1 only on the GPU, where benchmarks/sweep_decode.py
    checks them.)"""
    if device != "cpu":
        pytest.skip("interpreter case; benchmarks/sweep_decode.py checks it on the GPU")
    from fp4moe.kernels.gemm import GemmConfig

    experts = _experts(4, 128, 64, seed=31, device=device)
    x = _x(9, 128, seed=31, device=device)
    ids, w = _routes(9, 2, 4, seed=31, device=device, masked=0.2)
    m, sc = mode
    outs = []
    for cfg in (GemmConfig(16, 32, 32, num_stages=1), GemmConfig(16, 64, 64, num_stages=1)):
        opt = TritonOptions(fc1=cfg, fc2=cfg, chunked=True, poison=True)
        outs.append(moe_triton(x, ids, w, experts, mode=m, act_scale=sc, options=opt))
    ref = moe_reference(x, ids, w, experts, mode=m, act_scale=sc)
    assert rel_err(outs[0], ref) <= TOL[m]
    assert torch.equal(outs[0], outs[1])
    opt = TritonOptions(chunked=2, poison=True)
    two = moe_triton(x, ids, w, experts, mode=m, act_scale=sc, options=opt)
    assert rel_err(two, ref) <= TOL[m]


@pytest.mark.kernel
@pytest.mark.parametrize("mode", MODES, ids=_mode_id)
def test_segmented_loop_split_and_in_register_same_bits(interpret, device, mode, monkeypatch):
    """Loop 3 (fixed K segments): one program a segment with partials summed by the last
    program of a tile (split_k) gives the bits of the in-register segment sums, for every
    config; a tail segment shorter than the others included (K = 5 tiles of 32, segments
    of 2 tiles); within tolerance of the reference, fused finalize too."""
    if device != "cpu":
        pytest.skip("interpreter case; test_segmented_loop_gpu runs it on the GPU")
    from fp4moe.kernels import launch
    from fp4moe.kernels.gemm import GemmConfig

    monkeypatch.setattr(launch, "SEGMENT", 64)
    experts = _experts(4, 160, 96, seed=41, device=device)
    x = _x(7, 160, seed=41, device=device)
    ids, w = _routes(7, 2, 4, seed=41, device=device, masked=0.2)
    m, sc = mode
    ref = moe_reference(x, ids, w, experts, mode=m, act_scale=sc)
    outs = []
    a, b = GemmConfig(16, 32, 32, num_stages=1), GemmConfig(16, 64, 32, num_stages=1)
    # in registers; split K on the worst-case 3-D grid with the row blocks after the
    # segments (blocks_last, the default) and before them
    for split, cfg, last in ((False, a, True), (True, a, True), (True, b, True),
                             (True, b, False)):  # fmt: skip
        opt = TritonOptions(fc1=cfg, fc2=cfg, chunked=3, split_k=split, poison=True,
                            blocks_last=last)  # fmt: skip
        outs.append(moe_triton(x, ids, w, experts, mode=m, act_scale=sc, options=opt))
    fused = moe_triton(x, ids, w, experts, mode=m, act_scale=sc, options=opt,
                       fused_finalize=True)  # fmt: skip
    assert rel_err(fused, ref) <= TOL[m]
    assert rel_err(outs[0], ref) <= TOL[m]
    for o in outs[1:]:
        assert torch.equal(o, outs[0])


@pytest.mark.gpu
@pytest.mark.parametrize(
    "mode", [("w4a16", "per_token"), ("w4a4", "per_token"), ("w4a4", "static")], ids=_mode_id
)
def test_segmented_loop_gpu(gpu_experts, mode):
    """Loop 3 on the GPU: split and in-register segment sums give the same bits, and a
    token's output is the same alone (split) and inside 4096 tokens (in registers)."""
    e, h, _, k, e_total = GPU_SHAPES["deepseek-v3-ep8"]
    experts = gpu_experts("deepseek-v3-ep8")
    m, sc = mode
    x = _x(16, h, seed=5, device="cuda")
    ids, w = _gpu_routes(16, k, e, e_total, seed=5)
    a = moe_triton(x, ids, w, experts, mode=m, act_scale=sc,
                   options=TritonOptions(chunked=3, split_k=True, poison=True))  # fmt: skip
    b = moe_triton(x, ids, w, experts, mode=m, act_scale=sc,
                   options=TritonOptions(chunked=3, split_k=False, poison=True))  # fmt: skip
    assert torch.equal(a, b)
    assert rel_err(a, moe_reference(x, ids, w, experts, mode=m, act_scale=sc)) <= TOL[m]
    big = _x(4096, h, seed=6, device="cuda")
    bids, bw = _gpu_routes(4096, k, e, e_total, seed=6)
    big[100], bids[100], bw[100] = x[3], ids[3], w[3]
    out = moe_triton(big, bids, bw, experts, mode=m, act_scale=sc,
                     options=TritonOptions(chunked=3))  # fmt: skip
    assert torch.equal(out[100], a[3])


@pytest.mark.gpu
@pytest.mark.parametrize("shape", ["deepseek-v3-ep8", "qwen3-30b-a3b"])
@pytest.mark.parametrize("t", [1, 16, 64, 1000])
def test_ordered_x_gpu(gpu_experts, shape, t):
    """W4A16 with ordered activation rows (``TritonOptions.ordered_x``) on the H200: the
    bits of the default path (split K at decode sizes, in registers above), fused
    finalize within tolerance, a poisoned call with no NaN; the split grid with the row
    blocks before the segments (``blocks_last`` off) too."""
    e, h, _, k, e_total = GPU_SHAPES[shape]
    experts = gpu_experts(shape)
    x = _x(t, h, seed=t + 3, device="cuda")
    ids, w = _gpu_routes(t, k, e, e_total, seed=t + 3)
    base = moe_triton(x, ids, w, experts, options=TritonOptions(poison=True))
    for opt in (TritonOptions(ordered_x=True, poison=True),
                TritonOptions(blocks_last=False, poison=True)):  # fmt: skip
        assert torch.equal(moe_triton(x, ids, w, experts, options=opt), base)
    fused = moe_triton(x, ids, w, experts, options=TritonOptions(ordered_x=True),
                       fused_finalize=True)  # fmt: skip
    assert rel_err(fused, moe_reference(x, ids, w, experts)) <= TOL["w4a16"]


@pytest.mark.kernel
@pytest.mark.parametrize("split", [False, True], ids=["row", "split"])
@pytest.mark.parametrize("rows,count", [(6, None), (6, 4), (3, 0)])
def test_per_tensor_quantize_on_device_bit_identical(
    interpret, device, monkeypatch, rows, count, split
):
    """Per-tensor W4A4 on the device (amax_rows: atomic max, then the quantize kernel takes
    the global from it; or MODE_AMAX_SELF, the quantize kernel's programs taking the amax
    of the counted rows themselves): codes, scales and global bit-identical to
    quantize_nvfp4 on the counted rows; no rows (or all zero) gives amax 0 and global 1."""
    from fp4moe.kernels import launch
    from fp4moe.kernels.launch import amax_rows, quantize_rows
    from fp4moe.kernels.quantize import MODE_AMAX_SELF, MODE_FROM_AMAX
    from fp4moe.nvfp4 import quantize_nvfp4

    # split: few rows, each row's amax in one wide load and a chunk of a row a program
    monkeypatch.setattr(launch, "QUANTIZE_SPLIT_ROWS", 1024 if split else 0)

    x = _x(rows, 96, seed=rows, device=device)
    x[1, 5] = -7.25
    n = rows if count is None else count
    cnt = None if count is None else torch.tensor([count], dtype=torch.int32, device=device)
    amax = amax_rows(x, rows, count=cnt)
    assert amax.item() == (x[:n].abs().amax().float().item() if n else 0.0)
    codes, scales, glob = quantize_rows(x, rows, mode=MODE_FROM_AMAX, table=amax, count=cnt)
    # MODE_AMAX_SELF: every program takes the amax of the counted rows itself
    own = quantize_rows(x, rows, mode=MODE_AMAX_SELF, count=cnt, poison=True)
    if n == 0:
        assert amax.item() == 0.0
        return
    q = quantize_nvfp4(x[:n])
    for c_, s_, g_ in ((codes, scales, glob), own):
        assert torch.equal(c_[:n], q.codes)
        assert torch.equal(s_[:n].view(torch.uint8), q.scales.view(torch.uint8))
        assert torch.equal(g_[:n], q.global_scale.expand(n))


def _quantize_split_cases(device, rows, c, seed):
    """(x, kwargs) cases of ``quantize_rows`` for every mode, gathered or not, with and
    without a device count; x has a zero row and saturating and tiny blocks."""
    from fp4moe.kernels.quantize import (
        MODE_AMAX_SELF,
        MODE_FROM_AMAX,
        MODE_PER_ROW,
        MODE_SCALAR,
        MODE_STATIC,
    )

    x = _x(2 * rows + 1, c, seed=seed, device=device)
    x[min(2, rows - 1)] = 0.0
    x[0, :16] = 3.0e4
    x[0, 16:32] = 1.0e-6
    index = torch.randperm(2 * rows, generator=torch.Generator().manual_seed(seed))[:rows]
    index = index.to(torch.int32).to(device)
    table = torch.tensor([0.01, 0.02, 0.5], device=device)
    row_expert = torch.tensor([i % 3 for i in range(rows)], dtype=torch.int32, device=device)
    modes = [
        (MODE_PER_ROW, {}),
        (MODE_STATIC, dict(table=table, row_expert=row_expert)),
        (MODE_SCALAR, dict(table=table[1:2])),
        (MODE_FROM_AMAX, dict(table=torch.tensor([7.5], device=device))),
        (MODE_AMAX_SELF, {}),
    ]
    for gather in (False, True):
        for count in (None, max(rows // 2, 1)):
            cnt = None if count is None else torch.tensor([count], dtype=torch.int32,
                                                          device=device)  # fmt: skip
            for mode, extra in modes:
                kw = dict(mode=mode, count=cnt, poison=True, **extra)
                if gather:
                    kw.update(index=index, div=2)
                yield x, rows if count is None else count, kw


def _same_quantized(a, b, n):
    return all(torch.equal(p[:n].view(torch.uint8), q[:n].view(torch.uint8)) for p, q in zip(a, b))


@pytest.mark.kernel
def test_encode_e2m1_fast_same_codes(interpret, device):
    """``encode_e2m1_fast`` (the quantize kernel's encoding, session 14) gives
    ``encode_e2m1``'s code for fp32 values sampled over all bit patterns of [0, 16), every
    tie and its neighbours one ulp away, both signs, large values and infinity."""
    import triton
    import triton.language as tl

    from fp4moe.kernels.quantize import encode_e2m1, encode_e2m1_fast

    @triton.jit
    def both(v_ptr, a_ptr, b_ptr, n, BLOCK: tl.constexpr, OLD: tl.constexpr,
             FAST: tl.constexpr):  # fmt: skip
        o = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        v = tl.load(v_ptr + o, mask=o < n, other=0.0)
        tl.store(a_ptr + o, OLD(v).to(tl.int32), mask=o < n)
        tl.store(b_ptr + o, FAST(v, v < 0.0), mask=o < n)

    top = int(torch.tensor(16.0).view(torch.int32))
    pat = torch.arange(0, top, 4099, dtype=torch.int64).to(torch.int32).view(torch.float32)
    ties = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0,
                         6.0, 0.0])  # fmt: skip
    near = torch.cat([torch.nextafter(ties, torch.tensor(-1.0)), ties,
                      torch.nextafter(ties, torch.tensor(99.0))])  # fmt: skip
    big = torch.tensor([16.0, 1e3, 1e20, 3e38, float("inf")])
    v = torch.cat([pat, near, big])
    v = torch.cat([v, -v]).to(device)
    a = torch.empty(v.numel(), dtype=torch.int32, device=device)
    b = torch.empty_like(a)
    n = v.numel()
    both[(triton.cdiv(n, 1024),)](v, a, b, n, BLOCK=1024, OLD=encode_e2m1, FAST=encode_e2m1_fast)
    assert torch.equal(a, b)


def _quantize_reference_cases(device, c):
    """(x, rows, kwargs, global) cases for ``quantize_rows`` against ``quantize_blocks``:
    random rows in every mode, and rows built so that a global of 1 (an amax of 2688) or
    2^30 puts values on every e2m1 tie, on -0, on a block of scale 0, on tiny values
    whose quotient rounds to -0 or to the smallest negative subnormal (the sign bit of
    the code then differs), and a saturating block."""
    from fp4moe.kernels.quantize import MODE_FROM_AMAX, MODE_PER_ROW, MODE_SCALAR

    x = _x(6, c, seed=c, device=device)
    ties = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0]
    blk = torch.tensor([6.0, -0.0] + ties + [-t for t in ties])
    t = torch.zeros(4, c)
    t[:, :16] = blk
    t[:, 16:32] = blk / 2  # scale 0.5
    t[:, 32:48] = 1e-30  # scale 0 with a global of 1
    t[:, 48:64] = torch.tensor([2688.0, -1.0] + [0.5] * 14)  # saturating at 448
    t[2:, :] *= 2.0**30
    t[2:, 64] = 6.0 * 2.0**30  # a block of scale 1 under a global of 2^30 (d = 2^30)
    t[2:, 65] = -(2.0**-120)  # quotient -2^-150: a tie, rounds to -0: code 0
    t[2:, 66] = -1.5 * 2.0**-120  # quotient -1.5 2^-150: rounds to -2^-149: code 8
    t[2:, 67] = -(2.0**-133)
    t[1:4:2, 80:96] = x[:2, 80:96].float()
    t = t.to(torch.bfloat16).to(device)
    one = torch.tensor([2688.0], device=device)
    for name, (src, kw, glob) in {
        "per_row": (x, dict(mode=MODE_PER_ROW), None),
        "from_amax": (x, dict(mode=MODE_FROM_AMAX, table=one / 7), torch.tensor(384.0) / 2688),
        "ties_g1": (t[:2], dict(mode=MODE_FROM_AMAX, table=one), torch.tensor(1.0)),
        "ties_scalar": (t[:2], dict(mode=MODE_SCALAR, table=one / 2688), torch.tensor(1.0)),
        "ties_g2^30": (t[2:], dict(mode=MODE_FROM_AMAX, table=one * 2.0**30),
                       torch.tensor(2.0**30)),
        "ties_per_row": (t[:2], dict(mode=MODE_PER_ROW), None),
    }.items():  # fmt: skip
        yield name, src, kw, glob


@pytest.mark.kernel
@pytest.mark.parametrize("c", [96, 160])
def test_quantize_rows_matches_reference(interpret, device, c):
    """``quantize_rows`` against the reference's ``quantize_blocks``, bitwise (codes,
    scales, globals), on random rows and on rows that hit every tie and the sign of tiny
    quotients (``_quantize_reference_cases``). On the GPU this covers the fast division
    of the modes whose global comes from an amax."""
    from fp4moe.kernels.launch import quantize_rows
    from fp4moe.nvfp4 import global_from_amax, quantize_blocks

    for name, src, kw, glob in _quantize_reference_cases(device, c):
        rows = src.shape[0]
        codes, scales, g = quantize_rows(src, rows, poison=True, **kw)
        if glob is None:
            want_g = global_from_amax(src.float().abs().amax(dim=-1))
        else:
            want_g = torch.full((rows,), float(glob), device=device)
        want_c, want_s = quantize_blocks(src, want_g)
        assert torch.equal(g, want_g), name
        assert torch.equal(scales.view(torch.uint8), want_s.view(torch.uint8)), name
        assert torch.equal(codes, want_c), name


@pytest.mark.gpu
def test_quantize_rows_matches_reference_gpu(device):
    """The same at the DeepSeek-V3 widths on the GPU (C 7168 and 2048, 64 rows: the
    unrolled chunks, the fast division)."""
    if device != "cuda":
        pytest.skip("GPU test")
    for c in (7168, 2048):
        test_quantize_rows_matches_reference(False, "cuda", c)


@pytest.mark.kernel
def test_amax_rows_many_rows_a_program(interpret, device, monkeypatch):
    """``amax_rows`` with several rows a program (``AMAX_ROWS``; a partial last program,
    a device count that ends inside a program) gives the exact amax."""
    from fp4moe.kernels import launch

    monkeypatch.setattr(launch, "QUANTIZE_SPLIT_ROWS", 0)
    monkeypatch.setattr(launch, "AMAX_ROWS", 3)
    x = _x(10, 96, seed=5, device=device)
    x[9, 7] = -50.0
    x[6, 3] = 40.0
    assert launch.amax_rows(x, 10).item() == 50.0
    cnt = torch.tensor([7], dtype=torch.int32, device=device)
    assert launch.amax_rows(x, 10, count=cnt).item() == 40.0
    assert launch.amax_rows(x, 10, count=cnt * 0).item() == 0.0


@pytest.mark.kernel
def test_quantize_split_rows_same_bits(interpret, device, monkeypatch):
    """``quantize_rows`` with one chunk of a row a program (``QUANTIZE_SPLIT_ROWS``) gives
    the codes, scales and globals of one row a program, in every mode."""
    if device != "cpu":
        pytest.skip("interpreter case; test_quantize_split_rows_gpu runs it on the GPU")
    from fp4moe.kernels import launch

    for x, n, kw in _quantize_split_cases(device, 5, 160, seed=9):
        monkeypatch.setattr(launch, "QUANTIZE_SPLIT_ROWS", 0)
        one = launch.quantize_rows(x, 5, **kw)
        monkeypatch.setattr(launch, "QUANTIZE_SPLIT_ROWS", 64)
        split = launch.quantize_rows(x, 5, **kw)
        assert _same_quantized(one, split, n)


@pytest.mark.kernel
def test_quantize_row_first_same_bits(interpret, device, monkeypatch):
    """``QUANTIZE_ROW_FIRST`` (the first chunk loaded before the global) gives the same
    codes, scales and globals in every mode, one row a program and one chunk a program,
    and the reference's on its tie cases."""
    if device != "cpu":
        pytest.skip("interpreter case; test_quantize_row_first_gpu runs it on the GPU")
    from fp4moe.kernels import launch

    _row_first_same(device, monkeypatch, 5, 160)
    monkeypatch.setattr(launch, "QUANTIZE_ROW_FIRST", True)
    test_quantize_rows_matches_reference(interpret, device, 96)


def _row_first_same(device, monkeypatch, rows, c):
    """``quantize_rows`` with and without ``QUANTIZE_ROW_FIRST``: the same outputs, for
    ``_quantize_split_cases`` one row a program and one chunk a program."""
    from fp4moe.kernels import launch

    for split_rows in (0, 1024):
        monkeypatch.setattr(launch, "QUANTIZE_SPLIT_ROWS", split_rows)
        for x, n, kw in _quantize_split_cases(device, rows, c, seed=rows + c + 1):
            monkeypatch.setattr(launch, "QUANTIZE_ROW_FIRST", False)
            base = launch.quantize_rows(x, rows, **kw)
            monkeypatch.setattr(launch, "QUANTIZE_ROW_FIRST", True)
            first = launch.quantize_rows(x, rows, **kw)
            assert _same_quantized(base, first, n), (split_rows, kw.get("mode"))


@pytest.mark.gpu
@pytest.mark.parametrize("rows,c", [(1, 7168), (8, 2048), (64, 768), (600, 7168)])
def test_quantize_row_first_gpu(device, monkeypatch, rows, c):
    """On the GPU: ``QUANTIZE_ROW_FIRST`` gives the bits without it, every mode."""
    if device != "cuda":
        pytest.skip("GPU test")
    _row_first_same("cuda", monkeypatch, rows, c)


@pytest.mark.gpu
@pytest.mark.parametrize("rows,c", [(1, 7168), (8, 7168), (8, 2048), (64, 768)])
def test_quantize_split_rows_gpu(device, monkeypatch, rows, c):
    """On the GPU: the chunk-a-program quantize gives the bits of the row-a-program one."""
    if device != "cuda":
        pytest.skip("GPU test")
    from fp4moe.kernels import launch

    for x, n, kw in _quantize_split_cases("cuda", rows, c, seed=rows + c):
        monkeypatch.setattr(launch, "QUANTIZE_SPLIT_ROWS", 0)
        one = launch.quantize_rows(x, rows, **kw)
        monkeypatch.setattr(launch, "QUANTIZE_SPLIT_ROWS", 1024)
        split = launch.quantize_rows(x, rows, **kw)
        assert _same_quantized(one, split, n)


def test_workspace_bytes_counts_segment_partials(monkeypatch):
    """The estimate is the largest phase of a call: FC1 with its fp32 segment partials
    (loop 3, split K) or its decoded weights (dense path), FC2 with the route rows, or
    the finalize; each GEMM's temporaries are freed before the next phase."""
    from fp4moe.kernels.launch import SEGMENT, workspace_bytes

    base = workspace_bytes(16, 8, 7168, 2048, 32, options=TritonOptions(chunked=2))
    seg = workspace_bytes(16, 8, 7168, 2048, 32, options=TritonOptions(chunked=3))
    assert workspace_bytes(16, 8, 7168, 2048, 32) == seg  # loop 3 is the default
    opt = TritonOptions(ordered_x=True, gluon_decode=False)  # (ordered_x is not Gluon's)
    ordered = workspace_bytes(16, 8, 7168, 2048, 32, options=opt)
    assert ordered == seg + 16 * 7168 * 2  # FC1's input rows reordered (FC1 phase is the peak)
    n = 16 * 8
    # base: its FC2 phase (FC1 output, route rows); seg: its FC1 phase (FC1 output, FC1's
    # partials, larger than FC2's plus the route rows)
    assert seg - base == (7168 // SEGMENT) * n * 4096 * 4 - n * 7168 * 2
    off = workspace_bytes(16, 8, 7168, 2048, 32, options=TritonOptions(chunked=3, split_k=False))
    assert off == base
    # the dense path holds FC1's decoded weights (bf16) and x's rows in FC1's phase only,
    # and with dense_overlap FC2's decoded weights as well
    big = workspace_bytes(4096, 8, 7168, 2048, 32)
    dense = workspace_bytes(
        4096, 8, 7168, 2048, 32,
        options=TritonOptions(dense_above=512, valid_fraction=1.0, dense_overlap=False),
    )  # fmt: skip
    assert dense - big == 32 * 2 * 2048 * 7168 * 2 + 4096 * 7168 * 2 - 4096 * 8 * 7168 * 2
    over = workspace_bytes(
        4096, 8, 7168, 2048, 32,
        options=TritonOptions(dense_above=512, valid_fraction=1.0, dense_overlap=True),
    )  # fmt: skip
    assert over - dense == 32 * 7168 * 2048 * 2
    assert workspace_bytes(16, 8, 7168, 2048, 32, options=TritonOptions(dense_above=512)) == seg
    # by default above 192 valid routes an expert, 1/6 of the routes taken as valid when
    # unknown: DeepSeek-V3 EP8 at 8192 tokens (341 "valid"), not at 4096 (171)
    off = TritonOptions(dense_above=None)
    assert workspace_bytes(4096, 8, 7168, 2048, 32) == workspace_bytes(
        4096, 8, 7168, 2048, 32, options=off
    )
    # (there the dense FC2 phase is the largest: FC2's decoded weights and its input
    # rows in the loop's order next to the route rows)
    assert (
        workspace_bytes(8192, 8, 7168, 2048, 32, options=TritonOptions(dense_overlap=False))
        - workspace_bytes(8192, 8, 7168, 2048, 32, options=off)
        == 32 * 7168 * 2048 * 2 + 8192 * 8 * 2048 * 2
    )
    # one GEMM split: its partials only (FC1 of the shape test_phases measures on the GPU;
    # 37.8 MB there at commit a4d2655, the FC1 phase below)
    from fp4moe.kernels import launch

    monkeypatch.setattr(launch, "interpreting", lambda: False)  # the GPU's configs
    one = workspace_bytes(1024, 4, 2048, 512, 8)
    no = workspace_bytes(1024, 4, 2048, 512, 8, options=TritonOptions(split_k=False))
    assert one - no == 2 * 4096 * 1024 * 4 - 4096 * 2048 * 2
    # W4A4 on the Gluon kernels (a Hopper GPU): FC1's decoded input rows (one a token per
    # token scales) in FC1's phase, the peak here (FC2's would be the 128 routes' rows);
    # none without a Hopper GPU, or for W4A16 (its rows are read as they are)
    monkeypatch.setattr(launch, "hopper_device", lambda: True)
    w4a4 = dict(mode="w4a4", act_scale="per_token")
    on = workspace_bytes(16, 8, 7168, 2048, 32, **w4a4)
    gl_off = workspace_bytes(16, 8, 7168, 2048, 32, options=TritonOptions(gluon_decode=False),
                             **w4a4)  # fmt: skip
    assert on - gl_off == 16 * 7168 * 2
    assert workspace_bytes(16, 8, 7168, 2048, 32) == workspace_bytes(
        16, 8, 7168, 2048, 32, options=TritonOptions(gluon_decode=False)
    )
    # gluon_a_tma: W4A16's FC1 input rows gathered in sorted order, in FC1's phase
    atma = workspace_bytes(16, 8, 7168, 2048, 32, options=TritonOptions(gluon_a_tma=True))
    assert atma - workspace_bytes(16, 8, 7168, 2048, 32) == 16 * 8 * 7168 * 2
    monkeypatch.setattr(launch, "hopper_device", lambda: False)
    assert workspace_bytes(16, 8, 7168, 2048, 32, **w4a4) == gl_off


def test_gemm_splits_by_expected_programs(monkeypatch):
    """Loop 3 splits both GEMMs at decode sizes (at most 8 routes an expert), above that
    only a GEMM whose expected programs are too few (Mixtral-8x7B's FC2: 32 row tiles x 8
    experts); 64 valid rows an expert take 64-row tiles; split_k pins both."""
    from types import SimpleNamespace

    from fp4moe.kernels import launch
    from fp4moe.kernels.launch import gemm_configs_for, split_counters

    monkeypatch.setattr(launch, "interpreting", lambda: False)  # the GPU's table

    def splits(t, k, e, h, i, frac, **kw):
        opt = TritonOptions(valid_fraction=frac, **kw)
        c1, c2 = gemm_configs_for(t * k, e, h, i, "w4a16", opt)
        return opt.gemm_splits(t * k, e, h, i, c1, c2), c1

    deepseek, mixtral, qwen3 = (8, 32, 7168, 2048, 1 / 8), (2, 8, 4096, 14336, 1.0), (
        8, 128, 2048, 768, 1.0)  # fmt: skip
    for t, want in ((1, (True, True)), (32, (True, True)), (64, (False, False)),
                    (256, (False, False)), (1024, (False, False))):  # fmt: skip
        assert splits(t, *deepseek)[0] == want, t
    for t, want in ((16, (True, True)), (64, (False, True)), (256, (False, True))):
        assert splits(t, *mixtral)[0] == want, t
    for t in (256, 1024):
        assert splits(t, *qwen3)[0] == (False, False)
    assert splits(256, *mixtral)[1].block_m == 64  # 64 valid rows an expert
    assert splits(1024, *qwen3)[1].block_m == 64
    assert splits(256, *deepseek)[1].block_m == 16  # 64 routes, 8 valid
    assert splits(64, *mixtral, split_k=False)[0] == (False, False)
    assert splits(1024, *deepseek, split_k=True)[0] == (True, True)
    # the counters of the split GEMM only
    ex = SimpleNamespace(num_experts=8, hidden_size=4096, intermediate_size=14336)
    opt = TritonOptions(valid_fraction=1.0)
    c1, c2 = gemm_configs_for(128, 8, 4096, 14336, "w4a16", opt)
    zero, (n1, n2), slot = split_counters(128, ex, c1, c2, opt, torch.device("cpu"))
    assert slot is None
    assert n1.numel() == 0 and n2.numel() == zero.numel() == 4096 // c2.block_n * (128 // 16 + 8)
    ex = SimpleNamespace(num_experts=32, hidden_size=7168, intermediate_size=2048)
    opt = TritonOptions(valid_fraction=1 / 8)  # DeepSeek-V3 EP8 at 1024 tokens: neither
    c1, c2 = gemm_configs_for(8192, 32, 7168, 2048, "w4a16", opt)
    assert split_counters(8192, ex, c1, c2, opt, torch.device("cpu")) == (None, None, None)
    # the per-tensor amax slot alone (fused_amax): one int32 zero, seen as fp32
    zero, counters, slot = split_counters(8192, ex, c1, c2, opt, torch.device("cpu"), amax=True)
    assert counters is None and zero.numel() == 1 and slot.dtype == torch.float32
    assert slot.data_ptr() == zero.data_ptr()


@pytest.mark.kernel
@pytest.mark.parametrize("mode", [("w4a16", "per_token"), ("w4a4", "static")], ids=_mode_id)
def test_split_one_gemm_same_bits(interpret, device, monkeypatch, mode):
    """One GEMM split and the other not (``TritonOptions.gemm_splits``: here FC2, whose
    expected programs are fewer): the bits of neither split and of both, poisoned
    workspaces, fused finalize within tolerance."""
    if device != "cpu":
        pytest.skip("interpreter case; test_moe_gpu_shapes runs the default splits on the GPU")
    from fp4moe.kernels import launch
    from fp4moe.kernels.launch import gemm_configs_for

    monkeypatch.setattr(launch, "SEGMENT", 64)
    monkeypatch.setattr(launch, "SPLIT_BELOW_PROGRAMS", 12)  # FC1 16 programs, FC2 8
    t, k, e, h, i = 24, 2, 4, 64, 128
    experts = _experts(e, h, i, seed=61, device=device)
    x = _x(t, h, seed=61, device=device)
    ids, w = _routes(t, k, e, seed=61, device=device)
    m, sc = mode
    opt = TritonOptions(valid_fraction=1.0, poison=True)
    assert opt.gemm_splits(t * k, e, h, i, *gemm_configs_for(t * k, e, h, i, m, opt)) == (
        False, True)  # fmt: skip
    outs = [
        moe_triton(x, ids, w, experts, mode=m, act_scale=sc,
                   options=TritonOptions(valid_fraction=1.0, split_k=s, poison=True))
        for s in (None, False, True)
    ]  # fmt: skip
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])
    ref = moe_reference(x, ids, w, experts, mode=m, act_scale=sc)
    assert rel_err(outs[0], ref) <= TOL[m]
    fused = moe_triton(x, ids, w, experts, mode=m, act_scale=sc, options=opt,
                       fused_finalize=True)  # fmt: skip
    assert rel_err(fused, ref) <= TOL[m]


@pytest.mark.kernel
@pytest.mark.parametrize("last", [True, False], ids=["blocks-last", "blocks-first"])
def test_split_leaves_counters_zero(interpret, device, monkeypatch, last):
    """The split GEMMs leave their tile counters at zero (on either grid,
    ``TritonOptions.blocks_last``), so a second call on the same counters, not zeroed
    again (a caller's own buffer, a CUDA-graph replay), gives the same bits; and so does
    a call with counters of its own."""
    if device != "cpu":
        pytest.skip("interpreter case; the GPU tests replay CUDA graphs of split calls")
    from fp4moe.kernels import launch
    from fp4moe.kernels.launch import expert_gemms, gemm_configs, split_counters

    monkeypatch.setattr(launch, "SEGMENT", 64)
    t, k, e, h, i = 5, 2, 4, 128, 128
    experts = _experts(e, h, i, seed=71, device=device)
    x = _x(t, h, seed=71, device=device)
    ids, w = _routes(t, k, e, seed=71, device=device, masked=0.3)
    opt = TritonOptions(split_k=True, poison=True, blocks_last=last)
    cfg1, cfg2 = gemm_configs(t * k, experts, "w4a16", opt)
    zero, counters, _ = split_counters(t * k, experts, cfg1, cfg2, opt, x.device)
    s = sort_routes(ids, e, cfg1.block_m, zero=zero)
    n_valid = int(s.expert_offsets[-1])

    def rows(c):
        return expert_gemms(
            s, x, None, None, experts, cfg1=cfg1, cfg2=cfg2, mode="w4a16",
            act_scale="per_token", topk=k, a_gather=True, route_weights=w.reshape(-1),
            options=opt, counters=c,
        )[:n_valid].clone()  # fmt: skip

    first = rows(counters)
    assert bool((zero == 0).all())
    assert torch.equal(rows(counters), first)
    assert torch.equal(rows(None), first)


@pytest.mark.kernel
@pytest.mark.parametrize("split", [True, False], ids=["split", "in-register"])
@pytest.mark.parametrize("fused", [False, True], ids=["rows", "fused"])
@pytest.mark.parametrize("t,masked,one", [(9, 0.3, None), (1, 0.0, None), (4, 1.0, None),
                                          (0, 0.0, None), (6, 0.0, 2)])  # fmt: skip
def test_ordered_x_same_bits(interpret, device, monkeypatch, split, fused, t, masked, one):
    """W4A16 with the activation rows in the unit order (``TritonOptions.ordered_x``: FC1's
    input reordered once, FC2's written so by FC1's epilogue) gives the bits of the
    register permutation, split K or not, fused finalize or not, with poisoned
    workspaces, at T 0 and 1, all routes masked and all on one expert (the others
    empty); and the option applies only where it can."""
    if device != "cpu":
        pytest.skip("interpreter case; test_ordered_x_gpu runs it on the GPU")
    from fp4moe.kernels import launch
    from fp4moe.kernels.gemm import GemmConfig

    monkeypatch.setattr(launch, "SEGMENT", 64)
    e, h, i, k = 4, 128, 192, 2
    experts = _experts(e, h, i, seed=81, device=device)
    x = _x(t, h, seed=81 + t, device=device)
    ids, w = _routes(t, k, e, seed=81 + t, device=device, masked=masked, one_expert=one)
    cfg = GemmConfig(16, 64, 64, num_stages=1)
    opts = [TritonOptions(fc1=cfg, fc2=cfg, split_k=split, poison=True, ordered_x=o,
                          ordered_in_sort=in_sort)
            for o, in_sort in ((False, True), (True, True), (True, False))]  # fmt: skip
    assert opts[1].ordered_for("w4a16", t * k, e, h, i, cfg, cfg)
    outs = [moe_triton(x, ids, w, experts, options=o, fused_finalize=fused) for o in opts]
    assert torch.equal(outs[0], outs[1])
    assert torch.equal(outs[0], outs[2])  # the reorder kernel instead of the sort kernel
    if not fused:
        assert not torch.isnan(outs[1]).any()
    on, nr = opts[1], 18  # where the option applies (routes > 0, so the dense path can)
    assert on.ordered_for("w4a16", nr, e, h, i, cfg, cfg)
    assert not on.ordered_for("w4a4", nr, e, h, i, cfg, cfg)  # decoded activations
    assert not on.ordered_for("w4a16", nr, e, h, 160, cfg, cfg)  # 64 does not divide I
    c32 = GemmConfig(16, 64, 32, num_stages=1)
    assert not on.ordered_for("w4a16", nr, e, h, i, c32, cfg)  # the chunk order
    dense = TritonOptions(fc1=cfg, fc2=cfg, ordered_x=True, dense_above=0)
    assert not dense.ordered_for("w4a16", nr, e, h, i, cfg, cfg)


@pytest.mark.parametrize("loop", [0, 2, 3])
def test_gemm_configs_valid_for_every_preset(loop, monkeypatch):
    """Every preset and token count gets GPU FC1/FC2 configs sharing block_m, with BK a
    multiple of 32 (the chunk) that divides K, and (loop 3) divides the segment."""
    from fp4moe.bench import PRESETS
    from fp4moe.kernels import launch
    from fp4moe.kernels.launch import SEGMENT, gemm_configs

    monkeypatch.setattr(launch, "interpreting", lambda: False)  # the GPU's table

    class _E:  # the fields gemm_configs reads
        def __init__(self, p):
            self.num_experts = p.local_experts
            self.hidden_size = p.hidden
            self.intermediate_size = p.inter

    for p in PRESETS.values():
        for t in (1, 16, 64, 256, 1024, 8192, 16384):
            for mode in ("w4a16", "w4a4"):
                for dense in (None, 256) if loop else (None,):
                    opt = TritonOptions(chunked=loop, dense_above=dense, valid_fraction=1.0)
                    c1, c2 = gemm_configs(t * p.top_k, _E(p), mode, opt)
                    assert c1.block_m == c2.block_m
                    for cfg, k in ((c1, p.hidden), (c2, p.inter)):
                        assert k % cfg.block_k == 0
                        if loop:
                            assert cfg.block_k % 32 == 0 and SEGMENT % cfg.block_k == 0
                    if dense and t * p.top_k / p.local_experts > dense:  # the dense tiles
                        assert (c1.block_m, c1.block_n, c1.block_k) == (128, 128, 64)


@pytest.mark.kernel
@pytest.mark.parametrize("mode", [("w4a16", "per_token"), ("w4a4", "static")], ids=_mode_id)
@pytest.mark.parametrize("t,k,e,h,i,masked,one", CPU_CASES)
def test_segmented_split_edges(interpret, device, monkeypatch, mode, t, k, e, h, i, masked, one):
    """Loop 3 with split K at the edge sizes (T 1, masked, empty experts, one expert, all
    masked): poisoned workspaces, within tolerance of the reference, all-masked tokens 0,
    and the same bits as without the split and as the dense path (``dense_above``)."""
    if device != "cpu":
        pytest.skip("interpreter case; test_segmented_loop_gpu runs on the GPU")
    from fp4moe.kernels import launch
    from fp4moe.kernels.gemm import GemmConfig

    monkeypatch.setattr(launch, "SEGMENT", 32)  # every 32 elements of K its own segment
    experts = _experts(e, h, i, seed=e + h, device=device)
    x = _x(t, h, seed=t, device=device)
    ids, w = _routes(t, k, e, seed=t * 7, device=device, masked=masked, one_expert=one)
    if t > 12 and e == 6:
        ids = torch.where(ids >= 4, -1, ids)
    m, sc = mode
    cfg = GemmConfig(16, 32, 32, num_stages=1)
    outs = [
        moe_triton(x, ids, w, experts, mode=m, act_scale=sc,
                   options=TritonOptions(fc1=cfg, fc2=cfg, chunked=3, split_k=s,
                                         dense_above=d, poison=True))
        for s, d in ((True, None), (False, None), (False, 0))
    ]  # fmt: skip
    outs.append(moe_triton(x, ids, w, experts, mode=m, act_scale=sc,
                           options=TritonOptions(fc1=cfg, fc2=cfg, chunked=3, split_k=True,
                                                 blocks_last=False, poison=True)))  # fmt: skip
    assert torch.equal(outs[0], outs[1])
    assert torch.equal(outs[0], outs[2])
    assert torch.equal(outs[0], outs[3])  # row blocks before the segments (blocks_last off)
    assert not torch.isnan(outs[0]).any()
    if bool((ids >= 0).any()):
        ref = moe_reference(x, ids, w, experts, mode=m, act_scale=sc)
        assert rel_err(outs[0], ref) <= TOL[m]
    else:
        assert torch.equal(outs[0], torch.zeros_like(outs[0]))


@pytest.mark.kernel
def test_split_grid_blocks_last_by_default(interpret, device, monkeypatch):
    """The split GEMMs launch on (weight tiles, K segments, row blocks) by default
    (``TritonOptions.blocks_last``) and on (weight tiles, row blocks, K segments) with it
    off; the same bits either way."""
    from fp4moe.kernels import launch
    from fp4moe.kernels.gemm import GemmConfig
    from fp4moe.kernels.sort import max_blocks

    monkeypatch.setattr(launch, "SEGMENT", 64)
    real, grids = launch._launch, []

    def spy(kernel, grid, *args, **kw):
        if kernel is launch.moe_gemm_kernel:
            grids.append(tuple(grid))
        return real(kernel, grid, *args, **kw)

    monkeypatch.setattr(launch, "_launch", spy)
    t, k, e, h, i = 3, 2, 4, 128, 192
    experts = _experts(e, h, i, seed=91, device=device)
    x = _x(t, h, seed=91, device=device)
    ids, w = _routes(t, k, e, seed=91, device=device, masked=0.2)
    cfg = GemmConfig(16, 64, 64, num_stages=1)
    outs, shapes = [], []
    for kw in ({}, {"blocks_last": False}):
        grids.clear()
        opt = TritonOptions(fc1=cfg, fc2=cfg, split_k=True, poison=True, **kw)
        outs.append(moe_triton(x, ids, w, experts, options=opt))
        shapes.append(list(grids))
    nb = max_blocks(t * k, e, 16)
    # FC1: 192 / 64 = 3 weight tiles, 128 / 64 = 2 segments; FC2: 2 tiles, 3 segments
    assert shapes[0] == [(3, 2, nb), (2, 3, nb)]
    assert shapes[1] == [(3, nb, 2), (2, nb, 3)]
    assert torch.equal(outs[0], outs[1])


@pytest.mark.kernel
@pytest.mark.parametrize("t,masked", [(1, 0.0), (9, 0.3), (5, 1.0)])
def test_device_amax_same_bits(interpret, device, t, masked):
    """Per-tensor W4A4 with its amaxes on the device (TritonOptions.device_amax) gives the
    bits of the torch-op path, masked routes and all-masked batches included."""
    if device != "cpu":
        pytest.skip("interpreter case; test_device_amax_gpu runs on the GPU")
    experts = _experts(4, 64, 64, seed=51, device=device)
    x = _x(t, 64, seed=51, device=device)
    ids, w = _routes(t, 2, 4, seed=51, device=device, masked=masked)
    outs = [
        moe_triton(x, ids, w, experts, mode="w4a4", act_scale="per_tensor",
                   options=TritonOptions(device_amax=d, poison=True))
        for d in (False, True)
    ]  # fmt: skip
    assert torch.equal(outs[0], outs[1])


@pytest.mark.kernel
@pytest.mark.parametrize(
    "t,masked,split,dense", [(1, 0.0, None, None), (9, 0.3, True, None),
                             (9, 0.3, False, 0), (5, 1.0, None, None), (0, 0.0, None, None)]
)  # fmt: skip
def test_fused_amax_same_bits(interpret, device, t, masked, split, dense):
    """Per-tensor W4A4 with FC1's epilogue taking the amax of its output
    (TritonOptions.fused_amax, its zero from the sort kernel) gives the bits of the
    separate amax kernel: split K, the dense path, masked routes, all-masked and empty
    batches, fused finalize."""
    if device != "cpu":
        pytest.skip("interpreter case; test_device_amax_gpu runs it on the GPU")
    experts = _experts(4, 64, 64, seed=53, device=device)
    x = _x(t, 64, seed=53, device=device)
    ids, w = _routes(t, 2, 4, seed=53, device=device, masked=masked)
    for fused in (False, True):
        outs = [
            moe_triton(x, ids, w, experts, mode="w4a4", act_scale="per_tensor",
                       fused_finalize=fused,
                       options=TritonOptions(fused_amax=f, split_k=split, dense_above=dense,
                                             poison=True))
            for f in (False, True)
        ]  # fmt: skip
        assert torch.equal(outs[0], outs[1])
        assert not torch.isnan(outs[0]).any()


@pytest.mark.gpu
@pytest.mark.parametrize("option", ["device_amax", "fused_amax"])
@pytest.mark.parametrize("t", [1, 16, 300, 4096])
def test_device_amax_gpu(gpu_experts, t, option):
    """On the GPU, per-tensor W4A4 gives the same bits with the option off and on:
    device amaxes (``device_amax``) against torch ops, and the second amax fused into
    FC1's epilogue (``fused_amax``) against its own kernel."""
    e, h, _, k, e_total = GPU_SHAPES["deepseek-v3-ep8"]
    experts = gpu_experts("deepseek-v3-ep8")
    x = _x(t, h, seed=t, device="cuda")
    ids, w = _gpu_routes(t, k, e, e_total, seed=t)
    outs = [
        moe_triton(x, ids, w, experts, mode="w4a4", act_scale="per_tensor",
                   options=TritonOptions(poison=True, **{option: on}))
        for on in (False, True)
    ]  # fmt: skip
    assert torch.equal(outs[0], outs[1])


# ----------------------------------------------------------------- dense prefill path


@pytest.mark.kernel
@pytest.mark.parametrize("order", [32, 64])
def test_dense_weights_match_reference(interpret, device, order):
    """``dense_weights`` writes the GEMM's decoded operand (value * 2^-8, K in the chunk
    or the unit order) as its plain-PyTorch twin, every value: every code byte, every
    finite e4m3 scale."""
    if device != "cpu":
        pytest.skip("interpreter case; the GPU decode is covered by test_dense_path_gpu")
    from fp4moe.kernels.dequant import dense_weights, dense_weights_reference

    codes = torch.arange(256, dtype=torch.uint8).repeat(8).reshape(16, 128)
    allv = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn)
    finite = allv[~torch.isnan(allv.float())]
    scales = finite[torch.arange(16 * 16) % finite.numel()].reshape(16, 16)
    out = dense_weights(codes, scales, order=order)
    ref = dense_weights_reference(codes, scales, order)
    assert out.shape == (16, 256)
    assert torch.equal(out.float(), ref)  # values; code 8 (-0) may keep its sign here
    ex = _experts(3, 64, 32, seed=3, device=device)
    assert torch.equal(
        dense_weights(ex.w13_codes, ex.w13_scales, order=order).float(),
        dense_weights_reference(ex.w13_codes, ex.w13_scales, order),
    )


@pytest.mark.kernel
@pytest.mark.parametrize("t,h", [(1, 128), (5, 320), (3, 2048)])
def test_sort_writes_x_in_unit_order(interpret, device, t, h):
    """``sort_routes(x=...)``: the sort kernel also writes x with each 64 elements in the
    GEMMs' unit order, the values of ``dense_rows(order=64)``; the routes and schedule as
    without x; the torch path leaves it None."""
    from fp4moe.kernels.dequant import dense_rows

    ids, _ = _routes(t, 2, 4, seed=t, device=device, masked=0.2)
    x = _x(t, h, seed=t, device=device)
    s = sort_routes(ids, 4, 16, use_kernel=True, x=x)
    assert s.x_ordered.dtype == torch.bfloat16
    assert torch.equal(s.x_ordered.float(), dense_rows(x, order=64).float())
    plain = sort_routes(ids, 4, 16, use_kernel=True)
    for f in ("sorted_routes", "block_expert", "block_start", "block_end", "valid_blocks"):
        assert torch.equal(getattr(s, f), getattr(plain, f))
    assert sort_routes(ids, 4, 16, use_kernel=False, x=x).x_ordered is None


def test_sort_x_bad_input():
    ids = torch.zeros(3, 2, dtype=torch.int32)
    for bad in (torch.zeros(3, 96, dtype=torch.bfloat16), torch.zeros(2, 128, dtype=torch.bfloat16),
                torch.zeros(3, 128), torch.zeros(3, 2, 64, dtype=torch.bfloat16)):  # fmt: skip
        with pytest.raises(ValueError, match="x:"):
            sort_routes(ids, 4, 16, x=bad)


def test_sort_zero_bad_input():
    """``sort_routes(zero=...)`` rejects a buffer it could not zero as int32 counters,
    without touching it."""
    ids = torch.zeros(2, 2, dtype=torch.int32)
    for bad in (
        torch.full((8,), 3, dtype=torch.int64),
        torch.full((8, 2), 3, dtype=torch.int32).t(),
    ):
        before = bad.clone()
        with pytest.raises(ValueError, match="zero"):
            sort_routes(ids, 4, 16, zero=bad)
        assert torch.equal(bad, before)


def test_k_orders_are_the_documented_permutations():
    """``chunk_order``: the chunk order (32) and the unit order (64) place element
    e(p) at position p as documented (gemm.decode_permuted); ``k_order`` picks the unit
    order for loop 3 when K and the K tile allow it."""
    from fp4moe.kernels.dequant import chunk_order
    from fp4moe.kernels.launch import k_order

    p = torch.arange(256)
    e32 = (p // 32) * 32 + 2 * (p % 16) + (p // 16) % 2
    r = p % 64
    e64 = (p // 64) * 64 + 16 * ((r // 2) % 4) + 4 * (r // 16) + 2 * (r % 2) + (r // 8) % 2
    x = torch.arange(256.0).reshape(1, 256)
    assert torch.equal(chunk_order(x, torch.float32, 32)[0].long(), e32)
    assert torch.equal(chunk_order(x, torch.float32, 64)[0].long(), e64)
    assert sorted(e64.tolist()) == list(range(256))
    assert k_order(3, 7168, 128) == 64 and k_order(3, 2880, 64) == 64
    assert k_order(3, 96, 32) == 32 and k_order(3, 7168, 32) == 32 and k_order(2, 7168, 64) == 32


def test_decode_tile_divides_k():
    from fp4moe.kernels.dequant import decode_tile

    assert decode_tile(7168) == (16, 512, 4)  # the H200's fastest (sweep_prep.py)
    assert decode_tile(768) == (32, 256, 4)
    for k in (32, 96, 768, 2048, 2880, 7168, 14336):
        for interp in (False, True):
            br, bk, _ = decode_tile(k, interp)
            assert k % bk == 0 and bk % 32 == 0 and br * bk <= 8192


def test_dense_weights_bad_input():
    from fp4moe.kernels.dequant import dense_weights

    codes = torch.zeros(4, 16, dtype=torch.uint8)
    scales = torch.zeros(4, 2, dtype=torch.float8_e4m3fn)
    with pytest.raises(TypeError, match="codes"):
        dense_weights(codes.float(), scales)
    with pytest.raises(TypeError, match="scales"):
        dense_weights(codes, scales.float())
    with pytest.raises(ValueError, match="scales"):
        dense_weights(codes, scales[:, :1])
    with pytest.raises(ValueError, match="multiple of 32"):
        dense_weights(codes[:, :8], scales[:, :1])


@pytest.mark.kernel
@pytest.mark.parametrize(
    "loop, mode",
    [(3, m) for m in MODES] + [(2, ("w4a16", "per_token")), (2, ("w4a4", "per_token"))],
    ids=lambda v: str(v) if isinstance(v, int) else _mode_id(v),
)
def test_dense_path_same_bits(interpret, device, mode, loop, monkeypatch):
    """``dense_above``: GEMMs that load the decoded weights give the bits of the GEMMs that
    decode them, fused and deterministic, split K included (loop 3, short tail segment);
    so the dense path keeps batch invariance across its threshold."""
    if device != "cpu":
        pytest.skip("interpreter case; test_dense_path_gpu runs it on the GPU")
    from fp4moe.kernels import launch

    monkeypatch.setattr(launch, "SEGMENT", 64)
    experts = _experts(4, 96, 64, seed=43, device=device)
    x = _x(9, 96, seed=43, device=device)
    ids, w = _routes(9, 2, 4, seed=43, device=device, masked=0.2)
    m, sc = mode
    ref = moe_reference(x, ids, w, experts, mode=m, act_scale=sc)
    for fused in (False, True):
        kw = dict(mode=m, act_scale=sc, fused_finalize=fused)
        base = moe_triton(x, ids, w, experts, options=TritonOptions(chunked=loop), **kw)
        splits = (False, True) if loop == 3 and not fused else (None,)
        for split in splits:
            opt = TritonOptions(chunked=loop, dense_above=0, split_k=split, poison=True)
            assert torch.equal(moe_triton(x, ids, w, experts, options=opt, **kw), base)
        assert rel_err(base, ref) <= TOL[m]


@pytest.mark.kernel
def test_dense_path_only_for_chunked_loops(interpret, device):
    """Loops 0 and 1 ignore ``dense_above`` (they have no dense variant): same output."""
    experts = _experts(2, 64, 32, seed=1, device=device)
    x = _x(3, 64, seed=1, device=device)
    ids, w = _routes(3, 2, 2, seed=1, device=device, masked=0.0)
    for loop in (0, 1):
        assert not TritonOptions(chunked=loop, dense_above=0).dense_for(6, 2)
        outs = [
            moe_triton(x, ids, w, experts, options=TritonOptions(chunked=loop, dense_above=d))
            for d in (0, None)
        ]
        assert torch.equal(outs[0], outs[1])
    assert TritonOptions(dense_above=0).dense_for(6, 2)
    # the default: above 192 valid routes an expert; unknown validity counts 1/6 of them
    assert not TritonOptions().dense_for(1152 * 2, 2)
    assert TritonOptions().dense_for(1158 * 2, 2)
    assert not TritonOptions(valid_fraction=1.0).dense_for(192 * 2, 2)
    assert TritonOptions(valid_fraction=1.0).dense_for(193 * 2, 2)
    assert not TritonOptions(valid_fraction=1 / 8).dense_for(1536 * 2, 2)
    assert TritonOptions(valid_fraction=1 / 8).dense_for(2048 * 2, 2)


@pytest.mark.parametrize(
    "kw",
    [dict(dense_above=-1), dict(dense_above=1.5), dict(dense_above=True),
     dict(valid_fraction=0), dict(valid_fraction=1.5), dict(valid_fraction="1")],
    ids=str,
)  # fmt: skip
def test_triton_options_bad_dense_arguments(kw):
    with pytest.raises(ValueError, match=next(iter(kw))):
        TritonOptions(**kw)


@pytest.mark.kernel
@pytest.mark.parametrize("order,h", [(32, 96), (64, 128)])
def test_dense_rows_match_reference(interpret, device, order, h):
    """``dense_rows``: NVFP4 rows decoded as ``dense_weights``, bf16 rows in the chunk or
    unit order (values unchanged); with a device count only the rows below it are
    written."""
    if device != "cpu":
        pytest.skip("interpreter case; test_dense_path_gpu runs it on the GPU")
    from fp4moe.kernels.dequant import chunk_order, dense_rows, dense_weights_reference

    ex = _experts(1, h, 32, seed=5, device=device)
    codes, scales = ex.w13_codes[0], ex.w13_scales[0]  # [64, h / 2], [64, h / 16]
    ref = dense_weights_reference(codes, scales, order)
    assert torch.equal(dense_rows(codes, scales, order=order).float(), ref)
    x = _x(37, h, seed=5, device=device)
    assert torch.equal(dense_rows(x, order=order).float(), chunk_order(x, torch.float32, order))
    for n in (0, 1, 17, 37):
        count = torch.tensor([n], dtype=torch.int32)
        out = dense_rows(x, count=count, poison=True, order=order).float()
        assert torch.equal(out[:n], chunk_order(x[:n], torch.float32, order))
        assert torch.isnan(out[n:]).all()
        out = dense_rows(codes, scales, count=count, poison=True, order=order).float()
        assert torch.equal(out[:n], ref[:n]) and torch.isnan(out[n:]).all()
    # gathered: output row r is source row index[r] // div (sorted routes -> token rows)
    g = torch.Generator().manual_seed(h)
    index = torch.randint(0, 37 * 3, (50,), generator=g, dtype=torch.int32)
    want = chunk_order(x[(index // 3).long()], torch.float32, order)
    assert torch.equal(dense_rows(x, order=order, index=index, div=3).float(), want)
    count = torch.tensor([20], dtype=torch.int32)
    out = dense_rows(x, order=order, index=index, div=3, count=count, poison=True).float()
    assert torch.equal(out[:20], want[:20]) and torch.isnan(out[20:]).all()
    idx = torch.randint(0, 64, (9,), generator=g, dtype=torch.int32)
    got = dense_rows(codes, scales, order=order, index=idx).float()
    assert torch.equal(got, ref[idx.long()])


def test_dense_rows_bad_input():
    from fp4moe.kernels.dequant import dense_rows

    codes = torch.zeros(4, 16, dtype=torch.uint8)
    scales = torch.zeros(4, 2, dtype=torch.float8_e4m3fn)
    with pytest.raises(TypeError, match="src"):
        dense_rows(codes.float(), scales)
    with pytest.raises(TypeError, match="src"):
        dense_rows(codes)  # codes need their scales
    with pytest.raises(ValueError, match="scales"):
        dense_rows(codes, scales[:, :1])
    with pytest.raises(ValueError, match="src"):
        dense_rows(torch.zeros(4, 48, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="count"):
        dense_rows(codes, scales, count=torch.tensor([1, 2], dtype=torch.int32))
    with pytest.raises(ValueError, match="order"):
        dense_rows(codes, scales, order=48)
    with pytest.raises(ValueError, match="src"):
        dense_rows(codes, scales, order=64)  # K = 32
    i32 = torch.zeros(3, dtype=torch.int32)
    with pytest.raises(ValueError, match="index"):
        dense_rows(codes, scales, index=i32.long())
    with pytest.raises(ValueError, match="index"):
        dense_rows(codes, scales, index=i32.reshape(3, 1))
    for bad in (0, -2, True, 1.5):
        with pytest.raises(ValueError, match="div"):
            dense_rows(codes, scales, index=i32, div=bad)


@pytest.mark.gpu
@pytest.mark.parametrize(
    "mode", [("w4a16", "per_token"), ("w4a4", "per_token"), ("w4a4", "static")], ids=_mode_id
)
@pytest.mark.parametrize("t", [64, 2048])
def test_dense_path_gpu(gpu_experts, mode, t):
    """On the GPU, GEMMs on the decoded weights (``dense_above``) give the bits of the
    decoding GEMMs (loop 3, the default), and stay within tolerance of the reference."""
    e, h, _, k, e_total = GPU_SHAPES["deepseek-v3-ep8"]
    experts = gpu_experts("deepseek-v3-ep8")
    m, sc = mode
    x = _x(t, h, seed=t, device="cuda")
    ids, w = _gpu_routes(t, k, e, e_total, seed=t)
    a = moe_triton(x, ids, w, experts, mode=m, act_scale=sc,
                   options=TritonOptions(dense_above=None, poison=True))  # fmt: skip
    b = moe_triton(x, ids, w, experts, mode=m, act_scale=sc,
                   options=TritonOptions(dense_above=0, poison=True))  # fmt: skip
    assert torch.equal(a, b)
    assert rel_err(b, moe_reference(x, ids, w, experts, mode=m, act_scale=sc)) <= TOL[m]


@pytest.mark.gpu
@pytest.mark.parametrize(
    "mode", [("w4a16", "per_token"), ("w4a4", "per_tensor"), ("w4a4", "static")], ids=_mode_id
)
@pytest.mark.parametrize("fused", [False, True], ids=["deterministic", "fused"])
def test_dense_overlap_gpu(gpu_experts, mode, fused):
    """``dense_overlap``: FC2's weights decoded on a side stream during FC1 give the
    bits of the decode in the call's stream, eagerly and in a CUDA graph replayed
    (the fork and join captured); the outputs poisoned first."""
    e, h, _, k, e_total = GPU_SHAPES["deepseek-v3-ep8"]
    experts = gpu_experts("deepseek-v3-ep8")
    m, sc = mode
    t = 2048
    x = _x(t, h, seed=5, device="cuda")
    ids, w = _gpu_routes(t, k, e, e_total, seed=5)
    outs = {}
    for on in (False, True):
        opt = TritonOptions(dense_above=0, dense_overlap=on, poison=True)
        outs[on] = moe_triton(x, ids, w, experts, mode=m, act_scale=sc,
                              fused_finalize=fused, options=opt)  # fmt: skip
    if not fused:
        assert torch.equal(outs[False], outs[True])
    ref = moe_reference(x, ids, w, experts, mode=m, act_scale=sc)
    assert rel_err(outs[True], ref) <= TOL[m]
    opt = TritonOptions(dense_above=0, dense_overlap=True)

    def call():
        return moe_triton(x, ids, w, experts, mode=m, act_scale=sc, fused_finalize=fused,
                          options=opt)  # fmt: skip

    from fp4moe.bench import warm_up

    warm_up(call, 1)  # one call on a side stream before the capture
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        y = call()
    y.fill_(float("nan"))
    g.replay()
    torch.cuda.synchronize()
    if fused:
        assert rel_err(y, ref) <= TOL[m]
    else:
        assert torch.equal(y, outs[True])


@pytest.mark.kernel
def test_dense_rows_out_argument(interpret, device):
    """``dense_rows`` / ``dense_weights`` with ``out``: the same values written into the
    given tensor (FC2's weights decoded on a side stream, ``dense_overlap``); a tensor of
    the wrong shape, dtype or layout is refused, naming ``out``."""
    from fp4moe.kernels.dequant import dense_rows, dense_weights

    ex = _experts(3, 64, 64, seed=8, device=device)
    want = dense_weights(ex.w2_codes, ex.w2_scales, order=64)
    out = torch.empty_like(want)
    got = dense_weights(ex.w2_codes, ex.w2_scales, order=64, out=out)
    assert got.data_ptr() == out.data_ptr() and torch.equal(out, want)
    codes, scales = ex.w2_codes[0], ex.w2_scales[0]
    rows = dense_rows(codes, scales, order=64)
    out = torch.empty_like(rows)
    assert dense_rows(codes, scales, order=64, out=out).data_ptr() == out.data_ptr()
    assert torch.equal(out, rows)
    for bad in (torch.empty(rows.shape[0] + 1, rows.shape[1], dtype=rows.dtype),
                torch.empty(rows.shape, dtype=torch.float16),
                torch.empty(rows.shape[1], rows.shape[0], dtype=rows.dtype).t()):  # fmt: skip
        with pytest.raises(ValueError, match="out"):
            dense_rows(codes, scales, order=64, out=bad.to(device))
    with pytest.raises(ValueError, match="out"):
        dense_weights(ex.w2_codes, ex.w2_scales, order=64, out=torch.empty_like(want)[:1])


def test_workspace_bytes_counts_the_overlap():
    """``workspace_bytes`` holds FC2's decoded weights during FC1 with ``dense_overlap``."""
    from fp4moe.kernels.launch import workspace_bytes

    kw = dict(num_tokens=8192, top_k=8, hidden=7168, inter=2048, num_experts=32)
    on = workspace_bytes(**kw, options=TritonOptions(valid_fraction=1.0, dense_overlap=True))
    off = workspace_bytes(**kw, options=TritonOptions(valid_fraction=1.0))
    assert off < on <= off + 32 * 7168 * 2048 * 2  # FC1's phase grows (the peak may move)
    small = dict(kw, num_tokens=16)  # not dense: nothing to overlap
    assert workspace_bytes(**small) == workspace_bytes(
        **small, options=TritonOptions(dense_overlap=True)
    )


@pytest.mark.kernel
def test_dense_grouped_raster_many_blocks(interpret, device):
    """The dense path's grouped raster (GROUP_M = 8 row blocks) covers every tile once
    when the row blocks are not a multiple of 8 (15 blocks: one full group, one of 7),
    split K included."""
    if device != "cpu":
        pytest.skip("interpreter case")
    from fp4moe.kernels.gemm import GemmConfig

    experts = _experts(3, 128, 96, seed=44, device=device)
    x = _x(90, 128, seed=44, device=device)
    ids, w = _routes(90, 2, 3, seed=44, device=device, masked=0.0)
    g = GemmConfig(16, 32, 32, num_stages=1)
    base = moe_triton(x, ids, w, experts, options=TritonOptions(fc1=g, fc2=g))
    for split in (False, True):
        opt = TritonOptions(fc1=g, fc2=g, dense_above=0, split_k=split, poison=True)
        assert torch.equal(moe_triton(x, ids, w, experts, options=opt), base)


@pytest.mark.parametrize("mode", ["w4a16", "w4a4"])
def test_k_order_does_not_depend_on_the_token_count(monkeypatch, mode):
    """Loop 3's K order (``k_order``) follows the K tile of the config, and the config
    follows the token count: every default GPU config of a preset shape must give the same
    order at every token count, or a token's bits would change with the batch (SPEC 7)."""
    from types import SimpleNamespace

    from fp4moe.kernels.launch import TritonOptions, gemm_configs, k_order

    monkeypatch.setenv("TRITON_INTERPRET", "0")  # the GPU's configs
    shapes = [(7168, 2048, 32), (2048, 768, 128), (4096, 14336, 8), (2880, 2880, 128)]
    for h, inter, e in shapes:
        ex = SimpleNamespace(hidden_size=h, intermediate_size=inter, num_experts=e)
        for frac in (None, 1.0, 1 / 8):
            opt = TritonOptions(valid_fraction=frac)
            orders = set()
            for t in (1, 2, 3, 8, 16, 64, 100, 256, 1000, 4096, 8192, 16384, 65536):
                cfg1, cfg2 = gemm_configs(t * 8, ex, mode, opt)
                orders.add((k_order(3, h, cfg1.block_k), k_order(3, inter, cfg2.block_k)))
            assert orders == {(64, 64)}, (h, inter, frac, orders)


def _gpu_configs(monkeypatch):
    """Launch decisions as on an H200 (not the interpreter, a Hopper device). The Gluon
    module is imported first, under the interpreter setting Triton was imported with:
    Triton 3.6's Gluon package asserts at import that knobs and the JIT agree, so importing
    it after TRITON_INTERPRET flips fails (``gluon_available`` would then say no)."""
    from fp4moe.kernels import gluon_ws, launch  # noqa: F401

    monkeypatch.setenv("TRITON_INTERPRET", "0")
    monkeypatch.setattr(launch, "hopper_device", lambda: True)


def test_ordered_x_not_where_gluon_runs(monkeypatch):
    """``ordered_x`` stays off wherever either GEMM runs as the Gluon kernel, which neither
    reads nor writes rows in the unit order: both GEMMs (DeepSeek-V3 at 16 tokens) or
    FC1 only (I = 768: FC2 stays on loop 3); on when the Gluon kernels are off."""
    from types import SimpleNamespace

    from fp4moe.kernels.launch import gemm_configs

    _gpu_configs(monkeypatch)
    opt = TritonOptions(ordered_x=True)
    off = TritonOptions(ordered_x=True, gluon_decode=False)
    n = 16 * 8
    for h, i in ((7168, 2048), (2048, 768)):
        ex = SimpleNamespace(hidden_size=h, intermediate_size=i, num_experts=32)
        cfgs = gemm_configs(n, ex, "w4a16", opt)
        s1, s2 = opt.gemm_splits(n, 32, h, i, *cfgs)
        assert opt.gluon_runs(s1, h, False, cfgs[0])
        assert opt.gluon_runs(s2, i, False, cfgs[1]) == (i % 1024 == 0)
        assert not opt.ordered_for("w4a16", n, 32, h, i, *cfgs)
        assert off.ordered_for("w4a16", n, 32, h, i, *gemm_configs(n, ex, "w4a16", off))


def test_gluon_decode_configs(monkeypatch):
    """``gluon_decode`` takes 8-row tiles only when both GEMMs can take the Gluon
    kernels (K a multiple of 1024; W4A4 with the TMA kernel only): a GEMM left on loop 3
    must keep 16-row tiles, whose dots give loop 3's bits. Pinned configs below 16 rows
    are refused."""
    from types import SimpleNamespace

    from fp4moe.kernels import launch
    from fp4moe.kernels.gemm import GemmConfig
    from fp4moe.kernels.launch import TritonOptions, gemm_configs

    _gpu_configs(monkeypatch)
    opt = TritonOptions(gluon_decode=True)
    deepseek = SimpleNamespace(hidden_size=7168, intermediate_size=2048, num_experts=32)
    qwen3 = SimpleNamespace(hidden_size=2048, intermediate_size=768, num_experts=128)
    assert {c.block_m for c in gemm_configs(16 * 8, deepseek, "w4a16", opt)} == {8}
    assert {c.block_m for c in gemm_configs(16 * 8, deepseek, "w4a4", opt)} == {8}  # W4A4 too
    assert {c.block_m for c in gemm_configs(16 * 8, qwen3, "w4a16", opt)} == {16}
    off = TritonOptions(gluon_decode=False)
    assert {c.block_m for c in gemm_configs(16 * 8, deepseek, "w4a16", off)} == {16}
    assert TritonOptions().gluon_decode  # on by default (session 9)
    # gluon_upto (4 expected valid rows an expert since session 10): DeepSeek-V3 EP8 at 96
    # tokens (3 valid rows an expert) on the Gluon kernels, split, 8-row tiles; at 128 (4)
    # above gluon_whole_over (3.5, session 19) on the whole-K ones, 16-row tiles, unsplit
    # (both GEMMs can: loop 3 would not split them), as at 256 (8); Mixtral at 32 tokens
    # (8) loop 3 with 16-row tiles (measured faster there)
    assert TritonOptions().gluon_upto == 4 and TritonOptions().gluon_whole_over == 3.5
    up = TritonOptions(valid_fraction=1 / 8)
    n96, n128 = 96 * 8, 128 * 8
    cfgs = gemm_configs(n96, deepseek, "w4a16", up)
    assert {c.block_m for c in cfgs} == {8}
    assert up.gemm_splits(n96, 32, 7168, 2048, *cfgs) == (True, True)
    cfgs = gemm_configs(n128, deepseek, "w4a16", up)
    assert {c.block_m for c in cfgs} == {16}
    assert up.gemm_splits(n128, 32, 7168, 2048, *cfgs) == (False, False)
    assert up.whole_both(n128, 32, 7168, 2048) and not up.whole_both(n96 // 4, 32, 7168, 2048)
    # W4A4: per-token and per-tensor alike; static W4A4 (FC1 writes NVFP4) and an unknown
    # activation scale keep the split kernels
    for sc, bm in (("per_token", 16), ("per_tensor", 16), ("static", 8), (None, 8)):
        assert {c.block_m for c in gemm_configs(n128, deepseek, "w4a4", up, sc)} == {bm}, sc
    no_over = TritonOptions(valid_fraction=1 / 8, gluon_whole_over=None)
    cfgs = gemm_configs(n128, deepseek, "w4a16", no_over)
    assert {c.block_m for c in cfgs} == {8}
    assert no_over.gemm_splits(n128, 32, 7168, 2048, *cfgs) == (True, True)
    for bad in (-1, True, "3"):
        with pytest.raises(ValueError, match="gluon_whole_over"):
            TritonOptions(gluon_whole_over=bad)
    assert {c.block_m for c in gemm_configs(2 * n128, deepseek, "w4a16", up)} == {16}
    mixtral = SimpleNamespace(hidden_size=4096, intermediate_size=14336, num_experts=8)
    full = TritonOptions(valid_fraction=1.0)
    # 16 tokens: 4 rows, but loop 3 would split K there (4 routes an expert), so no
    # whole-K: the split kernels
    assert {c.block_m for c in gemm_configs(16 * 2, mixtral, "w4a16", full)} == {8}
    assert {c.block_m for c in gemm_configs(32 * 2, mixtral, "w4a16", full)} == {16}
    wide = TritonOptions(valid_fraction=1.0, gluon_upto=8)
    assert {c.block_m for c in gemm_configs(32 * 2, mixtral, "w4a16", wide)} == {8}
    no = TritonOptions(valid_fraction=1 / 8, split_k=False)  # split_k=False: never
    assert {c.block_m for c in gemm_configs(n128, deepseek, "w4a16", no)} == {16}
    for bad in (0, -1.0, True, "16"):
        with pytest.raises(ValueError, match="gluon_upto"):
            TritonOptions(gluon_upto=bad)
    # gluon_pdl_upto (32 expected valid routes since session 11): DeepSeek-V3 EP8 up to 32
    # tokens (32 valid routes) and Mixtral at 16 tokens (32) join the PDL chain, DeepSeek
    # at 64 tokens (64, where PDL measured slower) does not
    assert TritonOptions().gluon_pdl_upto == 32
    assert up.gluon_pdl(32 * 8, 32) and not up.gluon_pdl(64 * 8, 32)
    assert full.gluon_pdl(16 * 2, 8) and not full.gluon_pdl(32 * 2, 8)
    assert not TritonOptions(valid_fraction=1 / 8, gluon_pdl_upto=0).gluon_pdl(8, 32)
    for bad in (-1, True, "16", None):
        with pytest.raises(ValueError, match="gluon_pdl_upto"):
            TritonOptions(gluon_pdl_upto=bad)
    # not on a GPU without TMA and wgmma (A100, Blackwell): loop 3 and its 16-row tiles
    monkeypatch.setattr(launch, "hopper_device", lambda: False)
    for mode in ("w4a16", "w4a4"):
        assert {c.block_m for c in gemm_configs(16 * 8, deepseek, mode, opt)} == {16}
    monkeypatch.setattr(launch, "hopper_device", lambda: True)
    # nor with a Triton whose Gluon API the kernels were not written for
    assert launch.gluon_available()  # (the pinned 3.6.0)
    monkeypatch.setattr(launch, "gluon_available", lambda: False)
    assert {c.block_m for c in gemm_configs(16 * 8, deepseek, "w4a16", opt)} == {16}
    monkeypatch.setattr(launch, "gluon_available", lambda: True)
    small = GemmConfig(8, 64, 128)
    with pytest.raises(ValueError, match=r"options\.fc1"):
        gemm_configs(16, deepseek, "w4a16", TritonOptions(fc1=small, fc2=small))


@pytest.mark.kernel
@pytest.mark.parametrize("mode", MODES, ids=_mode_id)
def test_moe_triton_no_tokens(interpret, device, mode):
    """T = 0 straight into the Triton path (not only through ``fp4moe.moe``): every mode,
    fused or not, split K or not (the split counters of a call with no route), poisoned
    workspaces: an empty [0, H] output."""
    experts = _experts(4, 64, 32, seed=2, device=device)
    x = _x(0, 64, seed=2, device=device)
    ids, w = _routes(0, 2, 4, seed=2, device=device)
    m, sc = mode
    for fused in (False, True):
        for split in (False, True):
            opt = TritonOptions(poison=True, split_k=split)
            out = moe_triton(x, ids, w, experts, mode=m, act_scale=sc, fused_finalize=fused,
                             options=opt)  # fmt: skip
            assert out.shape == (0, 64) and out.dtype == torch.bfloat16


@pytest.mark.kernel
@pytest.mark.parametrize("fused", [False, True], ids=["deterministic", "fused"])
def test_amax_zeros_from_the_sort(interpret, device, monkeypatch, fused):
    """Per-tensor W4A4's amax kernels fold into slots of the buffer the sort kernel
    clears (``amax_zeros_in_sort``), not into zeros of their own: the buffer is filled
    with 3.4e38 before the sort, so an uncleared slot would give a wrong global. The same
    bits as with the option off."""
    from fp4moe.kernels import launch

    experts = _experts(4, 128, 64, seed=3, device=device)
    x = _x(5, 128, seed=3, device=device)
    ids, w = _routes(5, 2, 4, seed=3, device=device, masked=0.2)
    outs, calls, bufs = {}, [], []
    real_amax, real_split = launch.amax_rows, launch.split_counters

    def amax_spy(*a, **kw):
        calls.append(kw.get("out"))
        return real_amax(*a, **kw)

    def split_spy(*a, **kw):
        zero, counters, slots = real_split(*a, **kw)
        if zero is not None:
            zero.fill_(0x7F7F7F7F)  # fp32 3.39e38: only the sort kernel clears it
            bufs.append(zero)
        return zero, counters, slots

    monkeypatch.setattr(launch, "amax_rows", amax_spy)
    monkeypatch.setattr(launch, "split_counters", split_spy)
    for on in (True, False):
        calls.clear()
        bufs.clear()
        opt = TritonOptions(amax_self_upto=0, amax_zeros_in_sort=on)
        outs[on] = moe_triton(x, ids, w, experts, mode="w4a4", act_scale="per_tensor",
                              fused_finalize=fused, options=opt)  # fmt: skip
        assert len(calls) == 2  # x's amax and FC1 output's
        if on:
            base = bufs[0].untyped_storage().data_ptr()
            assert all(c is not None and c.untyped_storage().data_ptr() == base for c in calls)
            assert calls[0].data_ptr() != calls[1].data_ptr()
        else:
            assert calls == [None, None]
    if not fused:
        assert torch.equal(outs[True], outs[False])
    ref = moe_reference(x, ids, w, experts, mode="w4a4", act_scale="per_tensor")
    assert rel_err(outs[True], ref) <= TOL["w4a4"]
    with pytest.raises(ValueError, match="out must be one fp32 zero"):
        real_amax(x, 5, out=torch.zeros(2, device=device))


@pytest.mark.kernel
@pytest.mark.parametrize("fused", [False, True], ids=["deterministic", "fused"])
def test_amax_self_plumbing(interpret, device, monkeypatch, fused):
    """Per-tensor W4A4 with ``amax_self_upto``: inputs up to that many elements skip the
    amax kernel (the quantize kernel takes the amax itself), larger ones and 0 keep it;
    the same bits either way."""
    from fp4moe.kernels import launch

    experts = _experts(4, 128, 64, seed=2, device=device)
    x = _x(5, 128, seed=2, device=device)
    ids, w = _routes(5, 2, 4, seed=2, device=device, masked=0.2)
    calls = []
    real = launch.amax_rows

    def spy(*a, **kw):
        calls.append(a[0].shape)
        return real(*a, **kw)

    monkeypatch.setattr(launch, "amax_rows", spy)
    outs = {}
    # FC1: 5 x 128 = 640 elements, FC2: 10 routes x 64 = 640
    for upto, n_amax in ((0, 2), (639, 2), (640, 0), (16384, 0)):
        calls.clear()
        outs[upto] = moe_triton(x, ids, w, experts, mode="w4a4", act_scale="per_tensor",
                                fused_finalize=fused,
                                options=TritonOptions(amax_self_upto=upto))  # fmt: skip
        assert len(calls) == n_amax, (upto, calls)
    if not fused:
        assert all(torch.equal(outs[0], o) for o in outs.values())
    ref = moe_reference(x, ids, w, experts, mode="w4a4", act_scale="per_tensor")
    assert rel_err(outs[16384], ref) <= TOL["w4a4"]
    for bad in (-1, 1.5, True):
        with pytest.raises(ValueError, match="amax_self_upto"):
            TritonOptions(amax_self_upto=bad)


@pytest.mark.kernel
def test_cast_rows_same_bits_as_torch(interpret, device):
    """``cast_rows`` (the fused finalize's PDL cast) gives torch's fp32 -> bf16 bits:
    round to nearest even at every tie of both parities, signed zeros, subnormals, values
    that round up to infinity, infinities; a size that is not a multiple of a block; an
    empty tensor; a clear error for anything but contiguous fp32. (fp32 subnormals on
    the GPU only.)"""
    _check_cast_rows(interpret, device)


@pytest.mark.gpu
def test_cast_rows_gpu():
    """``test_cast_rows_same_bits_as_torch`` on the GPU (with PDL, and the subnormals)."""
    _check_cast_rows(False, "cuda", pdl=True)


def _check_cast_rows(interpret, device, pdl=False):
    from fp4moe.kernels.launch import cast_rows

    g = torch.Generator().manual_seed(7)
    bits = torch.randint(-(2**31), 2**31 - 1, (3, 700), generator=g, dtype=torch.int64)
    bits = bits.to(torch.int32)
    bits[0, :64] = (bits[0, :64] & ~0xFFFF) | 0x8000  # ties: half of them round up
    bits[0, 64:128] = (bits[0, 64:128] & ~0xFFFF) | 0x7FFF
    src = bits.view(torch.float32)
    src[1, :200] = torch.randn(200, generator=g) * 2.0 ** torch.randint(
        -140, 120, (200,), generator=g
    )
    src[2, :8] = torch.tensor([0.0, -0.0, float("inf"), float("-inf"), 3.4e38, -3.4e38,
                               1e-45, -1e-40])  # fmt: skip
    keep = torch.isfinite(src) | torch.isinf(src)  # NaN payloads aside
    if interpret:  # the interpreter's bf16 conversion of fp32 subnormals is not torch's
        keep &= (src == 0) | (src.abs() >= torch.finfo(torch.float32).tiny)
    src = torch.where(keep, src, torch.zeros_like(src)).to(device)
    out = cast_rows(src, poison=True, pdl=pdl)
    assert out.dtype == torch.bfloat16 and out.shape == src.shape
    assert torch.equal(out.view(torch.int16), src.to(torch.bfloat16).view(torch.int16))
    assert cast_rows(torch.zeros(0, 5, device=device)).shape == (0, 5)
    with pytest.raises(ValueError, match="src"):
        cast_rows(torch.zeros(2, 3, dtype=torch.float64, device=device))
    with pytest.raises(ValueError, match="src"):
        cast_rows(torch.zeros(4, 6, device=device).t())


@pytest.mark.kernel
@pytest.mark.parametrize("mode", MODES, ids=_mode_id)
def test_fused_chain_same_result(interpret, device, monkeypatch, mode):
    """``TritonOptions.fused_chain`` (the fused accumulator zeroed before the sort, the
    cast a PDL launch) against the order before it: the same bits where the atomics'
    order is fixed (the interpreter), the reference's tolerance on a GPU; the cast kernel
    runs only with it on, and a poisoned output leaves no NaN."""
    from fp4moe.kernels import launch

    m, sc = mode
    experts = _experts(4, 128, 64, seed=5, device=device)
    x = _x(6, 128, seed=5, device=device)
    ids, w = _routes(6, 2, 4, seed=5, device=device, masked=0.2)
    casts, outs = [], {}
    real = launch.cast_rows

    def spy(*a, **kw):
        casts.append(a[0].shape)
        return real(*a, **kw)

    monkeypatch.setattr(launch, "cast_rows", spy)
    for on in (True, False):
        casts.clear()
        opt = TritonOptions(poison=True, fused_chain=on)
        outs[on] = moe_triton(x, ids, w, experts, mode=m, act_scale=sc, fused_finalize=True,
                              options=opt)  # fmt: skip
        assert casts == ([(6, 128)] if on else [])
        assert not torch.isnan(outs[on].float()).any()
    ref = moe_reference(x, ids, w, experts, mode=m, act_scale=sc)
    assert rel_err(outs[True], ref) <= TOL[m]
    if interpret:
        assert torch.equal(outs[True], outs[False])
