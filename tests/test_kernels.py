"""The Triton backend against the reference: every kernel family the planner can choose, in
the interpreter on CPU (small shapes, PDL off) and on the GPU (marked ``gpu``: model
shapes, PDL on), on fresh random inputs and edge sizes, with NaN-poisoned workspaces and
outputs. Kernel families give the same bits (one summation order), so the tests also
compare them with each other bitwise."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

import fp4moe
from fp4moe import InapplicableOverride, Options, Tile
from fp4moe.backend import experts_scales_tma
from fp4moe.backend.launch import moe_triton
from fp4moe.kernels import sort as sort_module
from fp4moe.kernels.finalize import finalize_rows
from fp4moe.kernels.gemm.fields import from_fields
from fp4moe.kernels.gemm.operands import (
    chunk_order,
    dense_rows,
    dense_weights,
    dense_weights_reference,
)
from fp4moe.kernels.sort import TileSchedule, sort_routes, sort_routes_reference
from fp4moe.reference import finalize_reference, moe_reference, route_rows_reference
from testing import TOL, rel_err, tma_box

MODES = [
    ("w4a16", "per_token"),
    ("w4a4", "per_token"),
    ("w4a4", "static"),
    ("w4a4", "per_tensor"),
    ("w4a8", "per_token"),
]
PORTABLE = ["triton", "triton-split", "triton-dense"]  # the families the interpreter runs
GLUON = ["gluon-split", "gluon-whole", "gluon-prefill"]


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


def _check(out, ids, x, w, experts, mode):
    """``out`` within the tolerance of the reference (all-masked tokens exactly 0), no NaN."""
    m, sc = mode
    assert out.dtype == torch.bfloat16 and out.shape == x.shape
    assert not torch.isnan(out).any(), "an element no kernel wrote"
    if bool((ids >= 0).any()):
        ref = moe_reference(x, ids, w, experts, mode=m, act_scale=sc)
        assert rel_err(out, ref) <= TOL[m], f"rel err {rel_err(out, ref):.2e}"
    dead = (ids < 0).all(dim=1)
    assert torch.equal(out[dead], torch.zeros_like(out[dead]))


# ----------------------------------------------------------------------------- sort


@pytest.mark.parametrize(
    "t,k,e,bm",
    [
        (0, 2, 4, 16), (1, 1, 3, 16), (37, 3, 5, 16), (50, 4, 8, 32), (150, 2, 40, 16),
        (200, 8, 32, 16),  # 1600 routes: 8 a sort program
    ],
)  # fmt: skip
@pytest.mark.parametrize("masked", [0.0, 0.3, 1.0], ids=["none", "some", "all"])
@pytest.mark.parametrize("use_kernel", [False, True], ids=["torch", "triton"])
def test_sort_invariants(interpret, device, t, k, e, bm, masked, use_kernel):
    _sort_invariants(device, t, k, e, bm, masked, use_kernel)


@pytest.mark.kernel
@pytest.mark.parametrize("t,k,e,bm", [(263, 8, 32, 8), (1200, 8, 200, 16)])
@pytest.mark.parametrize("passes", [1, 2])
def test_sort_invariants_many_routes(interpret, device, monkeypatch, t, k, e, bm, passes):
    """2104 routes (17 sort programs, one histogram step each) and 9600 (two steps of
    8192 routes, 200 experts), in one launch and in two (the steps' histograms first)."""
    if passes == 2:
        monkeypatch.setattr(sort_module, "ONE_PASS_MAX_ROUTES", 0)
    _sort_invariants(device, t, k, e, bm, 0.3, True)


def _mixed_rows(c: int) -> tuple[int, int, int]:
    """Brute force: an expert's ``c`` rows in blocks of 128 first, then the rest in blocks
    of 64 or of 32, the least summed cost (sort.MIXED_COST; ties to the earlier option)."""
    (b0, b1, b2), (c0, c1, c2) = sort_module.MIXED_ROWS, sort_module.MIXED_COST
    best = None
    for q in (0, c // b0, c // b0 + 1):
        big = min(c, q * b0)
        rem = c - big
        for cost, split in ((q * c0 + -(-rem // b1) * c1, (big, rem, 0)),
                            (q * c0 + -(-rem // b2) * c2, (big, 0, rem))):  # fmt: skip
            if best is None or cost < best[0]:
                best = (cost, split)
    return best[1]


@pytest.mark.kernel
@pytest.mark.parametrize("t,k,e,masked", [(1, 8, 32, 0.0), (40, 8, 32, 0.5), (300, 8, 16, 0.3),
                                          (600, 2, 8, 0.0), (2000, 4, 8, 0.1)])  # fmt: skip
@pytest.mark.parametrize("use_kernel", [True, False])
def test_sort_mixed(interpret, device, t, k, e, masked, use_kernel):
    """``sort_routes(mixed=True)``: each expert's rows once over the three schedules, in
    order, its 128-row blocks first, split by the least block cost; the kernel's and the
    torch sort's schedules equal."""
    ids, _ = _routes(t, k, e, seed=t + k, device=device, masked=masked)
    if t == 2000:  # one expert with many rows
        ids[:, 0] = 3
    s = _cpu(sort_routes(ids, e, 32, use_kernel=use_kernel, mixed=True))
    if use_kernel:
        ref = _cpu(sort_routes(ids, e, 32, use_kernel=False, mixed=True))
        for a, b in zip(s.mixed, ref.mixed):
            nv = int(b.valid_blocks)
            assert int(a.valid_blocks) == nv
            for f in ("block_expert", "block_start", "block_end"):
                assert torch.equal(getattr(a, f)[:nv], getattr(b, f)[:nv]), f
    counts, offs = s.expert_counts.tolist(), s.expert_offsets.tolist()
    rows = {x: [] for x in range(e)}
    assert [m.block_m for m in s.mixed] == list(sort_module.MIXED_ROWS)
    for j, m in enumerate(s.mixed):
        nv = int(m.valid_blocks)
        assert bool((m.block_expert[nv:] == -1).all())
        for x, a, b in zip(m.block_expert[:nv].tolist(), m.block_start[:nv].tolist(),
                           m.block_end[:nv].tolist()):  # fmt: skip
            assert 0 < b - a <= m.block_m
            rows[x].append((a, b, j))
    for x in range(e):
        spans = sorted(rows[x])
        per = [sum(b - a for a, b, j in spans if j == i) for i in range(3)]
        assert tuple(per) == _mixed_rows(counts[x]), (x, counts[x], per)
        assert [j for _, _, j in spans] == sorted(j for _, _, j in spans)  # 128-row first
        if spans:
            assert spans[0][0] == offs[x] and spans[-1][1] == offs[x + 1]
            assert all(spans[i][1] == spans[i + 1][0] for i in range(len(spans) - 1))


def _cpu(obj):
    """A copy of a RouteSort or TileSchedule with its tensors on the CPU."""

    def cpu(v):
        if isinstance(v, torch.Tensor):
            return v.cpu()
        if isinstance(v, tuple):
            return tuple(cpu(x) for x in v)
        return _cpu(v) if isinstance(v, TileSchedule) else v

    return type(obj)(**{f: cpu(v) for f, v in vars(obj).items()})


def _schedule_is(sched, ids, e, bm):
    """``sched`` (a TileSchedule) holds the reference's tiles of ``bm`` rows."""
    ref = sort_routes_reference(ids, e, bm)["tiles"]
    tiles = [
        (int(a), int(b), int(c))
        for a, b, c in zip(sched.block_expert, sched.block_start, sched.block_end)
        if int(a) >= 0
    ]
    assert tiles == ref
    assert all(int(a) == -1 for a in sched.block_expert[len(tiles) :])
    assert sched.valid_blocks.tolist() == [len(tiles)]
    assert sched.block_m == bm


def _sort_invariants(device, t, k, e, bm, masked, use_kernel):
    ids, _ = _routes(t, k, e, seed=t + k, device=device, masked=masked)
    zero = torch.full((1000,), 7, dtype=torch.int32, device=device)  # split-K counters
    s = sort_routes(ids, e, bm, use_kernel=use_kernel, zero=zero)
    assert bool((zero == 0).all())
    s = _cpu(s)
    ids = ids.cpu()
    ref = sort_routes_reference(ids, e, bm)
    n_valid = ref["n_valid"]
    assert int(s.expert_offsets[e]) == n_valid
    for ex in range(e):
        lo, hi = int(s.expert_offsets[ex]), int(s.expert_offsets[ex + 1])
        assert s.sorted_routes[lo:hi].tolist() == ref["rows"][ex]
        assert int(s.expert_counts[ex]) == len(ref["rows"][ex])
    flat = torch.arange(t * k, dtype=torch.int32)  # the inverse permutation
    assert torch.equal(s.sorted_routes[s.route_pos.long()], flat)
    _schedule_is(s.schedule, ids, e, bm)
    assert s.mixed is None
    sorted_ids = ids.reshape(-1)[s.sorted_routes.long()]
    assert torch.equal(s.sorted_expert[:n_valid], sorted_ids[:n_valid])
    assert bool((s.sorted_expert[n_valid:] == 0).all())
    if use_kernel:  # both implementations agree field by field
        other = sort_routes(ids, e, bm, use_kernel=False)
        for f, v in vars(other).items():
            if isinstance(v, torch.Tensor):
                assert torch.equal(v, getattr(s, f)), f


def test_sort_bench_tool_needs_a_gpu():
    """benchmarks/sort_bench.py (the sort thresholds' measurement) imports and parses its
    arguments here; it times on a GPU only."""
    if torch.cuda.is_available():
        pytest.skip("a GPU machine runs the tool itself")
    tool = Path(__file__).resolve().parents[1] / "benchmarks" / "sort_bench.py"
    run = subprocess.run([sys.executable, str(tool), "--routes", "64"], capture_output=True,
                         text=True, timeout=120)  # fmt: skip
    assert run.returncode == 1 and "needs a CUDA GPU" in run.stderr, run.stderr[-2000:]


def test_prefill_gemm_chain_bad_input():
    """``chain`` is 0 (alone), 1 (the first of overlapping launches) or 2 (a later one);
    anything else is refused before anything runs."""
    from fp4moe.kernels.gemm.gluon_prefill import prefill_gemm

    i32 = torch.int32
    xs = torch.zeros(64, 128, dtype=torch.bfloat16)
    codes = torch.zeros(1, 64, 64, dtype=torch.uint8)
    scales = torch.zeros(1, 64, 8, dtype=torch.uint8).view(torch.float8_e4m3fn)
    one = torch.zeros(1, dtype=i32)
    with pytest.raises(ValueError, match="chain must be 0, 1 or 2, got 3"):
        prefill_gemm(xs, codes, scales, torch.ones(1), one, one, one, one,
                     torch.zeros(64, 64, dtype=torch.bfloat16), n=64, topk=1, gated=False,
                     out_scale=256.0, sm_count=1, block_m=64, chain=3)  # fmt: skip


def test_decode_row_programs():
    """The decode kernels' row programs: DECODE_ROW_WAVES waves of 8 programs an SM over
    the (weight tile, K segment) pairs, never more than the schedule's blocks, at least one,
    and enough that no program takes more than DECODE_ROW_TURNS blocks (its turns)."""
    from fp4moe.kernels.gemm.shapes import (
        DECODE_ROW_TURNS,
        DECODE_ROW_WAVES,
        decode_row_programs,
    )

    # DeepSeek-V3 EP8 FC1 at 16 tokens: 48 worst-case blocks, 32 tiles x 7 segments
    want = -(-DECODE_ROW_WAVES * 8 * 132 // 224)
    rows, turns = decode_row_programs(48, 224, 132)
    assert rows == min(48, want) < 48 and turns == -(-48 // rows)
    assert decode_row_programs(9, 224, 132) == (9, 1)  # 1 token: the worst case fits
    assert decode_row_programs(0, 224, 132) == (1, 1)
    assert decode_row_programs(10**6, 1, 132) == (-(-(10**6) // DECODE_ROW_TURNS), 4)
    for blocks in (1, 7, 48, 96, 160, 1000):
        for units in (1, 45, 224, 4096):
            rows, turns = decode_row_programs(blocks, units, 132)
            assert 1 <= rows <= blocks and 1 <= turns <= DECODE_ROW_TURNS
            assert rows * turns >= blocks  # every block has a program


def test_sort_zero_bad_input():
    ids = torch.zeros(2, 2, dtype=torch.int32)
    for bad in (torch.zeros(4, dtype=torch.int64), torch.zeros(8, dtype=torch.int32)[::2]):
        with pytest.raises(ValueError, match="zero"):
            sort_routes(ids, 4, 16, use_kernel=False, zero=bad)


# ----------------------------------------------------------------------------- whole MoE

CPU_CASES = [
    # (T, K, E, H, I, masked, one_expert)
    pytest.param(0, 2, 4, 64, 32, 0.0, None, id="T0"),
    pytest.param(1, 2, 4, 64, 32, 0.0, None, id="T1"),
    pytest.param(9, 3, 4, 64, 64, 0.2, None, id="T9-masked"),
    pytest.param(20, 2, 6, 96, 32, 0.0, None, id="T20-emptyexperts"),
    pytest.param(17, 2, 4, 64, 32, 0.0, 2, id="T17-oneexpert"),
    pytest.param(5, 2, 4, 64, 32, 1.0, None, id="allmasked"),
]


def _case(t, k, e, h, i, masked, one, device):
    experts = _experts(e, h, i, seed=e + h, device=device)
    x = _x(t, h, seed=t, device=device)
    ids, w = _routes(t, k, e, seed=t * 7, device=device, masked=masked, one_expert=one)
    if t > 12 and e == 6:  # T20: experts 4 and 5 get nothing
        ids = torch.where(ids >= 4, -1, ids)
    return experts, x, ids, w


@pytest.mark.kernel
@pytest.mark.parametrize("mode", MODES, ids=_mode_id)
@pytest.mark.parametrize("fused", [False, True], ids=["deterministic", "fused"])
@pytest.mark.parametrize("t,k,e,h,i,masked,one", CPU_CASES)
def test_moe_triton_matches_reference(interpret, device, mode, fused, t, k, e, h, i, masked, one):
    """The planner's choice (here the portable kernel) against the reference at the edge
    sizes; the prepared experts are not modified."""
    if device != "cpu":
        pytest.skip("interpreter case; the GPU runs test_moe_gpu_shapes")
    experts, x, ids, w = _case(t, k, e, h, i, masked, one, device)
    before = [v.clone() for v in experts.to_linear().values()]
    m, sc = mode
    out = moe_triton(x, ids, w, experts, mode=m, act_scale=sc, fused_finalize=fused,
                     options=Options(poison=True))  # fmt: skip
    _check(out, ids, x, w, experts, mode)
    for a, b in zip(before, experts.to_linear().values()):
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def _contiguous_scales(experts):
    """``experts`` with contiguous block scales (rows K/16 bytes apart, as the linear form
    holds them), rebuilt without ``align_scale_rows`` (``validate=False``)."""
    t = experts.tensors()
    for f in ("w13_scales", "w2_scales"):
        t[f] = t[f].contiguous()
    return fp4moe.PreparedExperts(**t, validate=False)


# K = 1088: two 1024-element segments of FC1, the second a 64-element tail
SPLIT_CASES = [
    pytest.param(1, 2, 0.0, None, id="T1"),
    pytest.param(6, 2, 0.3, None, id="T6-masked"),
]


@pytest.mark.kernel
@pytest.mark.parametrize("mode", MODES[:3], ids=_mode_id)
@pytest.mark.parametrize("t,k,masked,one", SPLIT_CASES)
def test_portable_families_same_bits(interpret, device, mode, t, k, masked, one):
    """The portable kernel unsplit, with split K (a segment a program, the partials summed
    by the last program of a tile) and with decoded weights: the same bits, within the
    reference's tolerance, every output element written; fused finalize within
    tolerance."""
    if device != "cpu":
        pytest.skip("interpreter case; the GPU runs test_families_same_bits_gpu")
    experts, x, ids, w = _case(t, k, 2, 1088, 32, masked, one, device)
    m, sc = mode
    outs = {}
    for g in PORTABLE:
        opt = Options(gemm=g, poison=True)
        outs[g] = moe_triton(x, ids, w, experts, mode=m, act_scale=sc, options=opt)
    _check(outs["triton"], ids, x, w, experts, mode)
    for name, out in outs.items():
        assert torch.equal(out, outs["triton"]), name
    fused = moe_triton(x, ids, w, experts, mode=m, act_scale=sc, fused_finalize=True,
                       options=Options(gemm="triton-split", poison=True))  # fmt: skip
    _check(fused, ids, x, w, experts, mode)
    if t == 6 and m == "w4a16":  # block scales contiguous, not aligned: the same bits
        flat = _contiguous_scales(experts)  # (the unsplit loop: test_scale_row_layouts_...)
        assert experts.w13_scales.stride(1) == 80 and flat.w13_scales.stride(1) == 68
        for g in PORTABLE[1:]:
            out = moe_triton(x, ids, w, flat, mode=m, act_scale=sc,
                             options=Options(gemm=g, poison=True))  # fmt: skip
            assert torch.equal(out, outs["triton"]), g


@pytest.mark.kernel
def test_scale_row_layouts_same_bits(interpret, device):
    """W4A8's e4m3 decode with block scales aligned in memory (rows of H/16 = 10 and I/16 = 2
    bytes 16 apart) and contiguous: the same bits (W4A16's families:
    ``test_portable_families_same_bits``)."""
    if device != "cpu":
        pytest.skip("interpreter case; the GPU runs test_scale_row_layouts_same_bits_gpu")
    experts, x, ids, w = _case(6, 2, 2, 160, 32, 0.3, None, device)
    flat = _contiguous_scales(experts)
    assert experts.w13_scales.stride(1) == 16 and flat.w13_scales.stride(1) == 10
    opt = Options(gemm="triton", poison=True)
    out = moe_triton(x, ids, w, experts, mode="w4a8", options=opt)
    assert torch.equal(moe_triton(x, ids, w, flat, mode="w4a8", options=opt), out)


@pytest.mark.kernel
def test_pinned_tiles_same_bits(interpret, device):
    """Pinned tiles (other weight rows, K steps, token rows a block) give the planner's
    bits."""
    if device != "cpu":
        pytest.skip("interpreter case")
    experts, x, ids, w = _case(9, 3, 4, 128, 64, 0.2, None, device)
    base = moe_triton(x, ids, w, experts, mode="w4a4", options=Options(poison=True))
    for tile in (Tile(16, 64, 32, num_stages=1), Tile(32, 16, 64, 2, 2)):
        opt = Options(fc1_tile=tile, fc2_tile=tile, poison=True)
        assert torch.equal(moe_triton(x, ids, w, experts, mode="w4a4", options=opt), base)
    # W4A8: other token rows and weight rows, its own K tile (the accumulation order)
    base = moe_triton(x, ids, w, experts, mode="w4a8", options=Options(poison=True))
    for tile in (Tile(16, 64, 64, num_stages=1), Tile(32, 16, 64, 2, 2)):
        opt = Options(fc1_tile=tile, fc2_tile=tile, poison=True)
        assert torch.equal(moe_triton(x, ids, w, experts, mode="w4a8", options=opt), base)


@pytest.mark.kernel
def test_finalize_kernel_bitwise(interpret, device):
    """The deterministic finalize gives the reference's bits (masked and all-masked
    tokens included), through the whole call and on its own."""
    if device != "cpu":
        pytest.skip("interpreter case")
    t, k, e, h, i = 7, 4, 5, 64, 32
    experts = _experts(e, h, i, seed=1, device=device)
    x = _x(t, h, seed=2, device=device)
    ids, w = _routes(t, k, e, seed=3, device=device, masked=0.3)
    ids[2] = -1  # a token with every route masked
    y = route_rows_reference(x, ids, experts)
    ref = finalize_reference(y, ids, w)
    assert torch.equal(moe_triton(x, ids, w, experts, options=Options(pdl=False)), ref)
    pos = torch.arange(t * k, dtype=torch.int32)
    out = finalize_rows(y.reshape(t * k, h), pos, ids, w, poison=True)
    assert torch.equal(out, ref)


def test_triton_backend_needs_cuda_or_interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    experts = _experts(2, 64, 32, seed=0, device="cpu")
    x = _x(2, 64, seed=0, device="cpu")
    ids, w = _routes(2, 1, 2, seed=0, device="cpu")
    with pytest.raises(RuntimeError, match="backend"):
        moe_triton(x, ids, w, experts)


@pytest.mark.kernel
def test_pinned_kernel_refused_where_it_cannot_run(interpret, device):
    """A pinned Gluon kernel in the interpreter, or split K where K is one segment, raises
    ``InapplicableOverride`` naming the pin, before anything runs."""
    experts = _experts(2, 64, 32, seed=0, device=device)
    x = _x(2, 64, seed=0, device=device)
    ids, w = _routes(2, 1, 2, seed=0, device=device)
    for g in [*GLUON, "triton-split"]:
        with pytest.raises(InapplicableOverride, match=g):
            moe_triton(x, ids, w, experts, options=Options(gemm=g))


# ----------------------------------------------------------------------------- operands


@pytest.mark.kernel
@pytest.mark.parametrize("order", [32, 64])
def test_dense_weights_match_reference(interpret, device, order):
    """``dense_weights`` writes the GEMM's decoded operand (value * 2^-8, K in the chunk
    or the unit order) as its plain-PyTorch twin, every value: every code byte, every
    finite e4m3 scale."""
    if device != "cpu":
        pytest.skip("interpreter case; the GPU runs the decoded-weights path end to end")
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
@pytest.mark.parametrize("order,h", [(32, 96), (64, 128)])
def test_dense_rows_match_reference(interpret, device, order, h):
    """``dense_rows``: NVFP4 rows (linear codes, as activation rows come; or weights in
    the fields layout) decoded as ``dense_weights``, bf16 rows in the chunk or unit order
    (values unchanged); with a device count only the rows below it are written; gathered
    rows (``index`` // ``div``)."""
    if device != "cpu":
        pytest.skip("interpreter case")
    ex = _experts(1, h, 32, seed=5, device=device)
    scales = ex.w13_scales[0]  # [64, h / 16]
    ref = dense_weights_reference(ex.w13_codes[0], scales, order)
    assert torch.equal(dense_rows(ex.w13_codes[0], scales, order=order, fields=True).float(), ref)
    codes = from_fields(ex.w13_codes[0])  # the same rows, linear: [64, h / 2]
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
    for bad in (0, -2, True, 1.5):
        with pytest.raises(ValueError, match="div"):
            dense_rows(codes, scales, index=i32, div=bad)


def test_dense_weights_bad_input():
    codes = torch.zeros(2, 4, 16, dtype=torch.uint8)
    with pytest.raises(TypeError, match="codes"):
        dense_weights(codes.float(), torch.zeros(2, 4, 2, dtype=torch.float8_e4m3fn))
    with pytest.raises(TypeError, match="scales"):
        dense_weights(codes, torch.zeros(2, 4, 2))
    with pytest.raises(ValueError, match="scales"):
        dense_weights(codes, torch.zeros(2, 4, 3, dtype=torch.float8_e4m3fn))


@pytest.mark.parametrize("padded", [False, True])
def test_weight_descriptors_pair_reads_both_blocks(padded):
    """``weight_descriptors(pair=n)``: one [2, 64, bytes] box at (0, row, byte) reads the
    rows [row, row + 64) and [row + n, row + n + 64) that two [64, bytes] boxes read (the
    gate and up rows of a gated GEMM), codes and scales (rows padded in memory or not),
    with zeros past K."""
    from fp4moe.kernels.gemm.gluon_common import weight_descriptors

    e, n, k = 3, 128, 320  # scale rows of 20 bytes: TMA copies them only padded
    g = torch.Generator().manual_seed(0)
    codes = torch.randint(0, 256, (e, 2 * n, k // 2), dtype=torch.uint8, generator=g)
    sb = torch.randint(0, 127, (e, 2 * n, 32 if padded else k // 16), dtype=torch.uint8,
                       generator=g)  # fmt: skip
    scales = sb[..., : k // 16].view(torch.float8_e4m3fn)
    c1, s1, _, tma1 = weight_descriptors(codes, scales)
    c2, s2, _, tma2 = weight_descriptors(codes, scales, pair=n)
    assert tma1 == tma2 == padded
    assert c2.block_shape == [2, 64, 128] and c2.shape == [2, e * 2 * n - n, k // 2]
    for row in (0, n - 64, 2 * n + 64, (e - 1) * 2 * n + n - 64):
        for kb in (0, 128):  # the second stage passes K / 2 = 160 bytes
            both = tma_box(c2, [0, row, kb])
            assert torch.equal(both[0], tma_box(c1, [row, kb]))
            assert torch.equal(both[1], tma_box(c1, [row + n, kb]))
            assert not both[:, :, 160 - kb :].any()
            if padded:
                sboth = tma_box(s2, [0, row, kb // 8])
                assert torch.equal(sboth[0], tma_box(s1, [row, kb // 8]))
                assert torch.equal(sboth[1], tma_box(s1, [row + n, kb // 8]))


# ----------------------------------------------------------------------------- Gluon on CPU


_COMPILE = """
from fp4moe.kernels.gemm import gluon_decode, gluon_prefill
from fp4moe.kernels.common import resource_usage
# the stack bytes each kernel may spill: none, but a few at the 32 and 64-row prefill
# tiles' 128 registers (two programs an SM; measured faster than one spill-free program an
# SM), and
# more at K 2880 (a partial stage; most where the scales come by pointer loads)
for spill, c in (
    *((0, c) for c in (
    # a program's two turns (row blocks), unrolled
    gluon_decode.compile_sm90(n=2048, k=7168, gated=True, block_m=8, turns=2),
    gluon_decode.compile_sm90(n=7168, k=2048, gated=False, block_m=32, whole=True,
                              early_weights=True),
    gluon_decode.compile_sm90(n=2048, k=7168, gated=True, block_m=8, epilogue=False,
                              a_fp4=True),
    # K 2880: a partial last segment, the scales by pointer loads; K 768: one partial
    # segment
    gluon_decode.compile_sm90(n=2880, k=2880, gated=True, block_m=16),
    gluon_decode.compile_sm90(n=2880, k=2880, gated=False, block_m=32, whole=True),
    gluon_decode.compile_sm90(n=2048, k=768, gated=False, block_m=8, whole=True),
    # the same scale rows padded in memory (TMA: the ring of half stages, the last
    # segment's too), K 1088: a last segment of one half stage, and K 128: less than
    # one stage
    gluon_decode.compile_sm90(n=2880, k=2880, gated=True, block_m=8, scale_tma=True,
                              turns=2),
    gluon_decode.compile_sm90(n=1024, k=1088, gated=False, block_m=8, early_weights=True,
                              scale_tma=True),
    gluon_decode.compile_sm90(n=256, k=128, gated=False, block_m=8, whole=True,
                              scale_tma=True),
    gluon_prefill.compile_sm90(n=2048, k=7168, gated=True, chain=1),
    gluon_prefill.compile_sm90(n=7168, k=2048, gated=False, fused=True, a_fp4=True),
    gluon_prefill.compile_sm90(n=2880, k=2880, gated=False, scale_tma=False),
    )),
    # 64-row tiles, two programs an SM (128 registers); K 768: one partial segment;
    # K 2880: a partial stage and the scales by pointer loads
    (32, gluon_prefill.compile_sm90(n=7168, k=2048, gated=False, block_m=64, chain=2)),
    (32, gluon_prefill.compile_sm90(n=2048, k=768, gated=False, block_m=64, a_e4m3=True)),
    (256, gluon_prefill.compile_sm90(n=2880, k=2880, gated=True, block_m=64)),
    (104, gluon_prefill.compile_sm90(n=2880, k=2880, gated=True, block_m=64, scale_tma=True)),
    # 32-row tiles, two programs an SM (as the 64-row ones)
    (8, gluon_prefill.compile_sm90(n=7168, k=2048, gated=False, block_m=32, fused=True,
                                   a_fp4=True)),
    (8, gluon_prefill.compile_sm90(n=2048, k=768, gated=False, block_m=32)),
    (96, gluon_prefill.compile_sm90(n=2880, k=2880, gated=True, block_m=32, scale_tma=True)),
):
    ptx = c.asm["ptx"]
    assert "wgmma.mma_async" in ptx and "cp.async.bulk.tensor" in ptx
    res = resource_usage(c)
    assert ".local" not in ptx and res["STACK"] <= spill and res["REG"] <= 255, res
    if spill:  # two programs an SM fit: 128 registers, half the shared memory
        assert res["REG"] <= 128 and c.metadata.shared <= 113 * 1024, res
    elif c.name == "prefill_kernel":
        # the 128-row bf16 tiles: half units, one wgmma group in flight while the next
        # decodes
        assert "wgmma.wait_group.sync.aligned 1;" in ptx
# the split FC1 on 8-row tiles (the ring of half stages) keeps 6 programs an SM (one wave
# of DeepSeek-V3 EP8's 672 at 1 token): shared memory plus the 1 KB a program reserves, and
# registers
c = gluon_decode.compile_sm90(n=2048, k=7168, gated=True, block_m=8)
assert "cp.async.bulk.tensor.3d" in c.asm["ptx"] and (c.metadata.shared + 1024) * 6 <= 228 * 1024
assert resource_usage(c)["REG"] <= 80
# the route sort lets the next kernel of a PDL chain start as it starts, only with RELEASE
from fp4moe.kernels import sort
from fp4moe.kernels.common import compile_sm90
ptrs = {a: "*i32" for a in sort.sort_routes_kernel.arg_names if a.endswith("_ptr")}
for release in (True, False):
    c = compile_sm90(sort.sort_routes_kernel, ptrs, dict(
        E=32, EP=64, BM=8, CHUNK=16, PIECE=16, PIECES=1, ZB=1, TWO_PASS=False, MIXED=False,
        R0=128, R1=64, R2=32, C0=1.74, C1=1.0, C2=0.85, RELEASE=release),
        ints=("N", "NB", "NBM", "NZ", "ZPER"))
    assert ("griddepcontrol.launch_dependents" in c.asm["ptx"]) == release
print("ok")
"""


@pytest.mark.kernel
def test_gluon_kernels_compile_for_sm90():
    """The Gluon kernels (which the interpreter cannot run) compile for sm_90 here, with
    their layout conversions asserted trivial and no spill past each kernel's bound (the
    two-programs-an-SM prefill tiles' 128 registers), CI's guard against a Gluon
    API change. Their numerics run on the GPU (test_families_same_bits_gpu). In a process
    of its own: the kernels must be defined without the interpreter."""
    import os
    import subprocess
    import sys

    pytest.importorskip("triton.experimental.gluon")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    src = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "src")
    env["PYTHONPATH"] = src + os.pathsep + env.get("PYTHONPATH", "")
    run = subprocess.run([sys.executable, "-c", _COMPILE], env=env, capture_output=True,
                         text=True, timeout=600)  # fmt: skip
    assert run.returncode == 0 and run.stdout.strip().endswith("ok"), run.stderr[-3000:]


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


def test_edge_routes():
    """The GPU tests' route edge cases (``_edge_routes``), checked here on the CPU."""
    ids = torch.tensor([[5, -1, 2], [0, 7, -1]], dtype=torch.int32)
    one = _edge_routes(ids, "one-expert", expert=4)
    assert one.tolist() == [[4, -1, 4], [4, 4, -1]] and one.dtype == torch.int32
    assert _edge_routes(ids, "all-masked").eq(-1).all()
    assert _edge_routes(ids, "masked") is ids
    assert ids.tolist() == [[5, -1, 2], [0, 7, -1]]  # the input is not changed


@pytest.mark.gpu
@pytest.mark.parametrize("shape", list(GPU_SHAPES))
@pytest.mark.parametrize("t", [0, 1, 3, 64, 512, 1000, 8192])
@pytest.mark.parametrize("mode", MODES, ids=_mode_id)
@pytest.mark.parametrize("fused", [False, True], ids=["deterministic", "fused"])
def test_moe_gpu_shapes(gpu_experts, shape, t, mode, fused):
    """The planner's choice at every regime of the model shapes against the reference."""
    e, h, _i, k, e_total = GPU_SHAPES[shape]
    if t == 8192 and shape != "deepseek-v3-ep8" and mode[1] != "per_token":
        pytest.skip("8192 tokens: one mode set per shape keeps the run short")
    experts = gpu_experts(shape)
    x = _x(t, h, seed=t, device="cuda")
    ids, w = _gpu_routes(t, k, e, e_total, seed=t + 1)
    m, sc = mode
    opt = Options(poison=True, valid_fraction=e / e_total)
    out = fp4moe.moe(x, ids, w, experts, mode=m, act_scale=sc, fused_finalize=fused,
                     options=opt)  # fmt: skip
    if t == 0:
        assert out.shape == (0, h)
        return
    _check(out, ids, x, w, experts, mode)


@pytest.mark.gpu
@pytest.mark.parametrize("shape,t", [("deepseek-v3-ep8", 64), ("qwen3-30b-a3b", 16),
                                     ("gpt-oss-like", 64)])  # fmt: skip
@pytest.mark.parametrize("mode", MODES[:2], ids=_mode_id)
def test_decode_row_turns_gpu(gpu_experts, monkeypatch, shape, t, mode):
    """Decode-kernel programs that take several row blocks in turn (the grid forced to a
    quarter of the schedule's worst-case blocks; every route valid, planned as masked, so
    that valid blocks outnumber the programs) give the bits of the default grid,
    deterministic finalize."""
    from fp4moe.kernels.gemm import gluon_decode, shapes

    e, h, _i, k, e_total = GPU_SHAPES[shape]
    experts = gpu_experts(shape)
    x = _x(t, h, seed=t + 11, device="cuda")
    ids, w = _gpu_routes(t, k, e, e, seed=t + 11)
    m, sc = mode
    opt = Options(poison=True, valid_fraction=e / e_total)
    base = fp4moe.moe(x, ids, w, experts, mode=m, act_scale=sc, options=opt)
    _check(base, ids, x, w, experts, mode)
    launches = []
    launch = gluon_decode.split_partials_tma

    def record(*args, **kw):
        launches.append((args[7], args[4].numel()))  # (valid blocks, worst-case blocks)
        return launch(*args, **kw)

    monkeypatch.setattr(gluon_decode, "split_partials_tma", record)
    monkeypatch.setattr(shapes, "decode_row_programs",
                        lambda b, u, sm: (max(1, -(-b // 4)), 4))  # fmt: skip
    out = fp4moe.moe(x, ids, w, experts, mode=m, act_scale=sc, options=opt)
    turns = [int(v.item()) > -(-b // 4) for v, b in launches]
    assert launches and any(turns), "no program took a second row block"
    assert torch.equal(out, base)


@pytest.mark.gpu
@pytest.mark.parametrize("shape", list(GPU_SHAPES))
@pytest.mark.parametrize("t", [1, 40, 300])
@pytest.mark.parametrize("mode", MODES, ids=_mode_id)
@pytest.mark.parametrize("case", ["masked", "one-expert", "all-masked"])
def test_families_same_bits_gpu(gpu_experts, shape, t, mode, case):
    """Every kernel family that can serve the shape (pinned with ``Options.gemm``, the
    prefill kernel at each of its tile rows) gives the bits of the portable kernel,
    deterministic finalize, at decode (1), middle (40) and prefill-like (300) sizes and the
    edge routes; fused finalize within tolerance."""
    e, h, _i, k, e_total = GPU_SHAPES[shape]
    experts = gpu_experts(shape)
    x = _x(t, h, seed=t + 7, device="cuda")
    ids, w = _gpu_routes(t, k, e, e_total, seed=t + 7)
    ids = _edge_routes(ids, case)
    m, sc = mode
    base = moe_triton(x, ids, w, experts, mode=m, act_scale=sc,
                      options=Options(gemm="triton", poison=True))  # fmt: skip
    _check(base, ids, x, w, experts, mode)
    ran = []
    # the prefill kernel's 32-row, 64-row and 128-row tiles (half units)
    pins = [("gluon-prefill", Tile(bm, 128, 64, 8, 3)) for bm in (32, 64, 128)]
    for g, tile in [*((g, None) for g in [*PORTABLE[1:], *GLUON, None]), *pins]:
        opt = Options(gemm=g, poison=True, fc1_tile=tile, fc2_tile=tile)
        try:
            out = moe_triton(x, ids, w, experts, mode=m, act_scale=sc, options=opt)
        except InapplicableOverride:
            continue
        ran.append(g if tile is None else f"{g}@{tile.block_m}")
        assert torch.equal(out, base), ran[-1]
        fused = moe_triton(x, ids, w, experts, mode=m, act_scale=sc, fused_finalize=True,
                           options=opt)  # fmt: skip
        _check(fused, ids, x, w, experts, mode)
    prefill = ["gluon-prefill@32", "gluon-prefill@64", "gluon-prefill@128"]
    assert {"gluon-prefill", *prefill} <= set(ran), ran
    if m == "w4a8":  # the portable kernel's FP8 loop and the prefill kernel's FP8 path
        assert ran == ["gluon-prefill", None, *prefill], ran
    else:
        assert "gluon-split" in ran and ("gluon-whole" in ran or sc == "static"), ran


@pytest.mark.gpu
@pytest.mark.parametrize("shape", list(GPU_SHAPES))
@pytest.mark.parametrize("mode", MODES, ids=_mode_id)
@pytest.mark.parametrize("rows", [20, 80])
@pytest.mark.parametrize("case", ["even", "uneven", "one-expert", "all-masked"])
def test_prefill_mixed_gpu(gpu_experts, shape, mode, rows, case):
    """At 20 and 80 expected rows an expert the planner runs the prefill kernel over each
    expert's own tile rows (``sort_routes(mixed=True)``: three launches, 128, 64 and
    32-row tiles; W4A8 one tile rows): its output has the bits of each tile rows pinned and
    of the portable kernel, on even routes, uneven ones (half the experts at about a third
    of the rows), one expert's and all masked; its fused finalize is within tolerance of
    the reference (a block run twice would double it)."""
    e, h, _i, k, e_total = GPU_SHAPES[shape]
    t = rows * e_total // k
    experts = gpu_experts(shape)
    x = _x(t, h, seed=t, device="cuda")
    ids, w = _gpu_routes(t, k, e, e_total, seed=t + 5)
    if case == "uneven":  # the first half of the experts keep a third of their routes
        g = torch.Generator(device="cuda").manual_seed(1)
        drop = (ids < e // 2) & (torch.rand(ids.shape, device="cuda", generator=g) < 2 / 3)
        ids = torch.where(drop, -1, ids).to(torch.int32)
    ids = _edge_routes(ids, case)
    m, sc = mode
    opt = Options(poison=True, valid_fraction=e / e_total)
    plan = fp4moe.plan(experts, t, k, mode=m, act_scale=sc, options=opt)
    assert plan.fc1.kernel == "gluon-prefill" and plan.fc1.mixed == (m != "w4a8"), plan
    out = moe_triton(x, ids, w, experts, mode=m, act_scale=sc, options=opt)
    _check(out, ids, x, w, experts, mode)
    for g, bm in (("triton", None), ("gluon-prefill", 32), ("gluon-prefill", 64),
                  ("gluon-prefill", 128)):  # fmt: skip
        tile = None if bm is None else Tile(bm, 128, 64, 8, 3)
        pin = Options(gemm=g, poison=True, fc1_tile=tile, fc2_tile=tile)
        assert torch.equal(out, moe_triton(x, ids, w, experts, mode=m, act_scale=sc,
                                           options=pin)), (g, bm)  # fmt: skip
    fused = moe_triton(x, ids, w, experts, mode=m, act_scale=sc, fused_finalize=True,
                       options=opt)  # fmt: skip
    _check(fused, ids, x, w, experts, mode)


@pytest.mark.gpu
@pytest.mark.parametrize("shape", ["gpt-oss-like", "readme"])
@pytest.mark.parametrize("t", [1, 40, 300])
@pytest.mark.parametrize("mode", MODES, ids=_mode_id)
def test_scale_row_layouts_same_bits_gpu(gpu_experts, shape, t, mode):
    """Scale rows of 180 bytes (K 2880) or of 8 and 16 (the README's H 256, I 128), aligned in
    memory (TMA copies them) and contiguous (pointer loads): every kernel family and the
    planner give the portable kernel's bits on both."""
    if shape == "readme":
        e, h, k, e_total = 8, 256, 2, 8
        experts = _experts(e, h, 128, seed=5, device="cuda")
    else:
        e, h, _i, k, e_total = GPU_SHAPES[shape]
        experts = gpu_experts(shape)
    flat = _contiguous_scales(experts)
    assert experts_scales_tma(experts) and not experts_scales_tma(flat)
    x = _x(t, h, seed=t + 3, device="cuda")
    ids, w = _gpu_routes(t, k, e, e_total, seed=t + 3)
    m, sc = mode
    base = moe_triton(x, ids, w, experts, mode=m, act_scale=sc,
                      options=Options(gemm="triton", poison=True))  # fmt: skip
    _check(base, ids, x, w, experts, mode)
    ran = set()
    for g in [*PORTABLE, *GLUON, None]:
        for name, ex in (("aligned", experts), ("contiguous", flat)):
            opt = Options(gemm=g, poison=True)
            try:
                out = moe_triton(x, ids, w, ex, mode=m, act_scale=sc, options=opt)
            except InapplicableOverride:
                continue
            ran.add(g)
            assert torch.equal(out, base), (g, name)
    assert "gluon-whole" in ran or m == "w4a8" or sc == "static", ran


@pytest.mark.gpu
@pytest.mark.parametrize("mode", [m for m in MODES if m[1] != "per_tensor"], ids=_mode_id)
@pytest.mark.parametrize("fused_other", [False, True])
def test_batch_invariance_gpu(gpu_experts, mode, fused_other):
    """A token's output is bitwise the same alone and in batches of every regime (decode,
    whole-K, portable, prefill kernels)."""
    e, h, _i, k, e_total = GPU_SHAPES["deepseek-v3-ep8"]
    experts = gpu_experts("deepseek-v3-ep8")
    opt = Options(valid_fraction=e / e_total)
    m, sc = mode
    x0 = _x(1, h, seed=100, device="cuda")
    ids0, w0 = _gpu_routes(1, k, e, 32, seed=100)  # a token with local routes
    alone = fp4moe.moe(x0, ids0, w0, experts, mode=m, act_scale=sc, options=opt)
    for t in (7, 64, 384, 1024, 4096):
        x = _x(t, h, seed=t, device="cuda")
        ids, w = _gpu_routes(t, k, e, e_total, seed=t)
        pos = t // 2
        x[pos], ids[pos], w[pos] = x0[0], ids0[0], w0[0]
        out = fp4moe.moe(x, ids, w, experts, mode=m, act_scale=sc, options=opt)
        assert torch.equal(out[pos], alone[0]), f"T={t}"


@pytest.mark.gpu
def test_finalize_gpu_bitwise(gpu_experts):
    """Deterministic finalize on the GPU is bit-identical to the reference given the same
    rows."""
    e, h, _i, k, e_total = GPU_SHAPES["deepseek-v3-ep8"]
    for t in (1, 300, 4097):
        ids, w = _gpu_routes(t, k, e, e_total, seed=t)
        y = (torch.randn(t * k, h, device="cuda")).to(torch.bfloat16)
        pos = torch.arange(t * k, dtype=torch.int32, device="cuda")
        out = finalize_rows(y, pos, ids, w, pdl=False, poison=True)
        ref = finalize_reference(y.view(t, k, h), ids, w)
        assert torch.equal(out, ref), t


@pytest.mark.gpu
def test_workspace_bytes_bounds_the_peak(gpu_experts):
    """``workspace_bytes`` of a call's plan is at least the device memory the call holds
    beyond its inputs and output, at every regime (within a few KB of counters)."""
    from fp4moe.backend import workspace_bytes

    e, h, _i, k, e_total = GPU_SHAPES["deepseek-v3-ep8"]
    experts = gpu_experts("deepseek-v3-ep8")
    opt = Options(valid_fraction=e / e_total)
    for t in (1, 64, 384, 1024, 4096):
        for m, sc in MODES:
            x = _x(t, h, seed=t, device="cuda")
            ids, w = _gpu_routes(t, k, e, e_total, seed=t)
            fp4moe.moe(x, ids, w, experts, mode=m, act_scale=sc, options=opt)  # warm
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            out = fp4moe.moe(x, ids, w, experts, mode=m, act_scale=sc, options=opt)
            torch.cuda.synchronize()
            held = torch.cuda.max_memory_allocated() - base - out.numel() * 2
            plan = fp4moe.plan(experts, t, k, mode=m, act_scale=sc, options=opt)
            assert held <= workspace_bytes(plan) + 65536, (t, m, sc, held)
