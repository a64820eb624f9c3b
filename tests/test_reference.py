"""The reference MoE against numerics sections 4 to 9, evaluated independently in float64.

The done-criterion test: ``moe_reference`` (and ``moe(..., backend="reference")``) agrees
with a direct evaluation of numerics sections 5 and 6 written here from the text: every weight
decoded with this file's own e2m1 and e4m3 tables, activations quantized by
``quantize_nvfp4`` (the specification of quantizing, tested bitwise in test_nvfp4.py),
products accumulated in float64 and rounded where the numerics contract says.
"""

from __future__ import annotations

from fractions import Fraction

import numpy as np
import pytest
import torch

import fp4moe
from fp4moe.experts import PreparedExperts, prepare_experts
from fp4moe.nvfp4 import quantize_nvfp4
from fp4moe.reference import finalize_reference, fma_f32, moe_reference, route_rows_reference
from testing import (
    TOL,
    assert_close_moe,
    nan_empty,
    poison_like,
    random_moe_weights,
    random_routes,
    random_x,
    rel_err,
)

BF16, F32 = torch.bfloat16, torch.float32

# --------------------------------------------------------------------- the contract in float64

_E2M1 = torch.tensor(
    [0, 0.5, 1, 1.5, 2, 3, 4, 6, 0, -0.5, -1, -1.5, -2, -3, -4, -6], dtype=torch.float64
)


def _e4m3_to_f64(s: torch.Tensor) -> torch.Tensor:
    """float8_e4m3fn bits to float64: 4 exponent bits (bias 7), 3 mantissa bits, no Inf."""
    b = s.contiguous().view(torch.uint8).long()
    sign = torch.where(b & 0x80 != 0, -1.0, 1.0).double()
    ex, man = (b >> 3) & 0xF, (b & 7).double()
    assert not ((ex == 15) & (man == 7)).any(), "NaN block scale"
    normal = (1 + man / 8) * torch.pow(2.0, (ex - 7).double())
    return sign * torch.where(ex == 0, man / 8 * 2.0**-6, normal)


def _decode64(codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """deq() of numerics section 5 in float64: e2m1(code) * scale, no global scale."""
    nib = torch.stack((codes & 0xF, codes >> 4), dim=-1).flatten(-2)  # 2j low, 2j+1 high
    return _E2M1[nib.long()] * _e4m3_to_f64(scales).repeat_interleave(16, dim=-1)


def _f32(v: torch.Tensor) -> torch.Tensor:
    return v.to(F32)


def _fc_inputs(rows: torch.Tensor, mode: str, act_scale: str, static: list):
    """The FC inputs of numerics section 5 as (float64 values [n, C], fp32 globals [n] or None).

    rows: bf16 [n, C]; static: each row's calibrated global (W4A4 static only).
    """
    if mode == "w4a16":
        return rows.double(), None
    if act_scale == "static":
        qs = [quantize_nvfp4(r[None], global_scale=g) for r, g in zip(rows, static)]
        vals = torch.cat([_decode64(q.codes, q.scales) for q in qs])
        return vals, torch.stack([q.global_scale for q in qs])
    # per_token: one global per row; per_tensor: one for all the rows given
    q = quantize_nvfp4(rows, per_row=act_scale == "per_token")
    return _decode64(q.codes, q.scales), q.global_scale.expand(rows.shape[0])


def spec_moe(x, ids, weights, ex: PreparedExperts, mode: str, act_scale: str):
    """numerics sections 5 and 6, route by route.

    Returns (out bf16 [T, H], y bf16 [T, K, H] with masked rows 0, a bf16 [routes, I]).
    Dynamic per-tensor W4A4 takes its FC1 global over all of x and its FC2 global over
    the activations of all valid routes.
    """
    t_count, h = x.shape
    k_count = ids.shape[1]
    i = ex.intermediate_size
    lin = ex.to_linear()  # the logical form of numerics section 3
    w13 = _decode64(lin["w13_codes"], lin["w13_scales"])  # [E, 2I, H]
    w2 = _decode64(lin["w2_codes"], lin["w2_scales"])  # [E, H, I]
    routes = [
        (t, k, int(ids[t, k])) for t in range(t_count) for k in range(k_count) if ids[t, k] >= 0
    ]
    if not routes:
        return (
            torch.zeros(t_count, h, dtype=BF16),
            torch.zeros(t_count, k_count, h, dtype=BF16),
            None,
        )
    tok = [t for t, _, _ in routes]
    exp = [e for _, _, e in routes]

    # FC1 input, route by route (per_token and per_tensor quantize x as a whole).
    if mode == "w4a4" and act_scale != "static":
        xv, xg = _fc_inputs(x, mode, act_scale, [])
        xin, gx = xv[tok], xg[tok]
    else:
        a13 = [ex.a13_scale[e] for e in exp] if act_scale == "static" else []
        xin, gx = _fc_inputs(x[tok], mode, act_scale, a13)

    # FC1 and SwiGLU
    act = torch.empty(len(routes), i, dtype=BF16)
    for n, e in enumerate(exp):
        acc_gate = _f32(w13[e, :i] @ xin[n])  # acc: exact products, rounded once to fp32
        acc_up = _f32(w13[e, i:] @ xin[n])
        if gx is not None:
            acc_gate, acc_up = acc_gate * gx[n], acc_up * gx[n]
        h_gate = acc_gate * ex.w13_global[e, 0]  # fp32 products, gate and up globals apart
        h_up = acc_up * ex.w13_global[e, 1]
        silu = _f32(h_gate.double() / (1 + torch.exp(-h_gate.double())))
        act[n] = (silu * h_up).to(BF16)

    # FC2
    a2 = [ex.a2_scale[e] for e in exp] if act_scale == "static" else []
    ain, ga = _fc_inputs(act, mode, act_scale, a2)
    y = torch.zeros(t_count, k_count, h, dtype=BF16)
    for n, (t, k, e) in enumerate(routes):
        acc = _f32(w2[e] @ ain[n])
        if ga is not None:
            acc = acc * ga[n]
        y[t, k] = (acc * ex.w2_global[e]).to(BF16)

    # Deterministic finalize: ascending k, fp32 accumulator (float64 sum rounded each step).
    out = torch.zeros(t_count, h, dtype=BF16)
    for t in range(t_count):
        acc = torch.zeros(h, dtype=F32)
        for k in range(k_count):
            if ids[t, k] >= 0:
                acc = _f32(weights[t, k].double() * y[t, k].double() + acc.double())
        out[t] = acc.to(BF16)
    return out, y, act


# --------------------------------------------------------------------------- fixtures

MODES = [("w4a16", "per_token"), ("w4a4", "per_token"), ("w4a4", "static"), ("w4a4", "per_tensor")]
MODE_IDS = ["w4a16", "w4a4-per_token", "w4a4-static", "w4a4-per_tensor"]
INVARIANT_MODES = MODES[:3]  # numerics section 7: activation scales independent of other tokens
# with W4A8 (numerics section 5a), for the tests that need no spec_moe
ALL_MODES, ALL_IDS = [*MODES, ("w4a8", "per_token")], [*MODE_IDS, "w4a8"]


def _with_static(ex: PreparedExperts, seed: int) -> PreparedExperts:
    """The same weights with calibrated static activation scales.

    Calibrated on a separate batch (W4A16 pass), times factors 0.6 to 1.6 per expert, so
    that some tokens of the test batch saturate and others use less than the full range.
    """
    h = ex.hidden_size
    x = random_x(32, h, seed + 1000)
    ids, w = random_routes(32, 2, ex.num_experts, seed=seed + 1001)
    _, _, act = spec_moe(x, ids, w, ex, "w4a16", "per_token")
    g = torch.Generator().manual_seed(seed)
    e_count = ex.num_experts
    a13 = (float(x.abs().max()) / 2688) * (0.6 + torch.rand(e_count, generator=g))
    a2 = (float(act.abs().max()) / 2688) * (0.6 + torch.rand(e_count, generator=g))
    return PreparedExperts.from_linear({**ex.to_linear(), "a13_scale": a13, "a2_scale": a2})


_EXPERTS_CACHE: dict = {}


def make_experts(E: int, H: int, I: int, seed: int = 0) -> PreparedExperts:  # noqa: E741
    key = (E, H, I, seed)
    if key not in _EXPERTS_CACHE:
        _EXPERTS_CACHE[key] = prepare_experts(*random_moe_weights(E, H, I, seed=seed))
    return _EXPERTS_CACHE[key]


def make_case(
    T,
    K,
    E,
    H,
    I,  # noqa: E741
    *,
    seed,
    masked_frac=0.0,
    all_on_one=None,
    skip_expert=None,
    mode_act=None,
):
    ex = make_experts(E, H, I)
    x = random_x(T, H, seed)
    if skip_expert is not None:  # route over the other E - 1 experts only
        ids, w = random_routes(T, K, E - 1, seed=seed + 1, masked_frac=masked_frac)
        ids = torch.where(ids >= skip_expert, ids + 1, ids)
    else:
        ids, w = random_routes(
            T, K, E, seed=seed + 1, masked_frac=masked_frac, all_on_one=all_on_one
        )
    if mode_act is not None and mode_act[1] == "static":
        ex = _with_static(ex, seed)
    return x, ids, w, ex


# --------------------------------------------------------------------------- the done criterion

SHAPES = [
    # (T, K, E, H, I, masked_frac)
    pytest.param(40, 4, 8, 128, 64, 0.0, id="T40-K4-E8-H128-I64"),
    pytest.param(23, 2, 4, 64, 32, 0.3, id="T23-K2-E4-H64-I32-masked"),
    pytest.param(1, 3, 6, 96, 64, 0.0, id="T1-K3-E6-H96-I64"),
    pytest.param(9, 1, 5, 64, 96, 0.0, id="T9-K1-E5-H64-I96"),
]


@pytest.mark.parametrize("mode,act_scale", MODES, ids=MODE_IDS)
@pytest.mark.parametrize("T,K,E,H,I,masked", SHAPES)
def test_reference_matches_spec(mode, act_scale, T, K, E, H, I, masked):  # noqa: E741
    x, ids, w, ex = make_case(
        T, K, E, H, I, seed=T * 7 + K, masked_frac=masked, mode_act=(mode, act_scale)
    )
    want_out, want_y, _ = spec_moe(x, ids, w, ex, mode, act_scale)
    y = route_rows_reference(x, ids, ex, mode=mode, act_scale=act_scale)
    out = moe_reference(x, ids, w, ex, mode=mode, act_scale=act_scale)
    api = fp4moe.moe(x, ids, w, ex, mode=mode, act_scale=act_scale, backend="reference")
    assert torch.equal(out, api), "moe(backend='reference') differs from moe_reference"
    valid = ids >= 0
    assert (y[~valid] == 0).all(), "masked route rows must stay 0"
    assert_close_moe(y[valid], want_y[valid], mode, what="route rows y")
    assert_close_moe(out, want_out, mode)
    # Both accumulate exact products and round once to fp32; only the last bit of silu may
    # differ (fp32 there, float64 here), rarely moving a bf16 rounding of `a`. So nearly
    # every element agrees bit for bit, and the rest are far inside the kernel tolerance.
    assert rel_err(y[valid], want_y[valid]) <= TOL[mode] / 4
    assert rel_err(out, want_out) <= TOL[mode] / 4
    same = (y[valid] == want_y[valid]).double().mean().item()
    assert same >= 0.99, f"only {same:.2%} of route-row elements bit-identical to the contract"
    # Given identical route rows, the finalize is exact.
    assert torch.equal(finalize_reference(want_y, ids, w), want_out)


# --------------------------------------------------------------------------- edge sizes


@pytest.mark.parametrize("mode,act_scale", ALL_MODES, ids=ALL_IDS)
def test_T0_empty_output(mode, act_scale):
    x, ids, w, ex = make_case(0, 2, 4, 64, 32, seed=1, mode_act=(mode, act_scale))
    out = fp4moe.moe(x, ids, w, ex, mode=mode, act_scale=act_scale, backend="reference")
    assert out.shape == (0, 64) and out.dtype == BF16
    ref = moe_reference(x, ids, w, ex, mode=mode, act_scale=act_scale)
    assert ref.shape == (0, 64) and ref.dtype == BF16


@pytest.mark.parametrize("mode,act_scale", MODES, ids=MODE_IDS)
@pytest.mark.parametrize(
    "case",
    [
        {"T": 1, "K": 2, "E": 4},
        {"T": 12, "K": 2, "E": 4, "skip_expert": 0},
        {"T": 12, "K": 3, "E": 5, "skip_expert": 4},
        {"T": 17, "K": 2, "E": 4, "all_on_one": 2},
        {"T": 17, "K": 1, "E": 4, "all_on_one": 0},
        {"T": 19, "K": 4, "E": 6, "masked_frac": 0.5},
    ],
    ids=["T1", "expert0-empty", "expert4-empty", "all-on-2", "all-on-0-K1", "half-masked"],
)
def test_edge_cases_match_spec(mode, act_scale, case):
    case = dict(case)
    T, K, E = case.pop("T"), case.pop("K"), case.pop("E")
    x, ids, w, ex = make_case(T, K, E, 64, 32, seed=5, mode_act=(mode, act_scale), **case)
    want, _, _ = spec_moe(x, ids, w, ex, mode, act_scale)
    out = fp4moe.moe(x, ids, w, ex, mode=mode, act_scale=act_scale, backend="reference")
    assert_close_moe(out, want, mode)
    if "skip_expert" in case:
        assert not (ids == case["skip_expert"]).any()
    if "all_on_one" in case:
        assert set(ids[ids >= 0].tolist()) == {case["all_on_one"]}


@pytest.mark.parametrize("mode,act_scale", ALL_MODES, ids=ALL_IDS)
def test_all_routes_masked_gives_exact_zero(mode, act_scale):
    x, ids, w, ex = make_case(6, 3, 4, 64, 32, seed=9, mode_act=(mode, act_scale))
    ids = torch.full_like(ids, -1)
    out = fp4moe.moe(x, ids, w, ex, mode=mode, act_scale=act_scale, backend="reference")
    assert out.shape == (6, 64) and torch.equal(out, torch.zeros_like(out))


def test_tokens_with_all_routes_masked_are_zero_in_a_mixed_batch():
    x, ids, w, ex = make_case(8, 2, 4, 64, 32, seed=10)
    ids[[1, 5]] = -1
    out = fp4moe.moe(x, ids, w, ex, backend="reference")
    assert (out[[1, 5]] == 0).all() and (out[[0, 2, 3, 4, 6, 7]] != 0).any(dim=1).all()


@pytest.mark.parametrize("mode,act_scale", ALL_MODES, ids=ALL_IDS)
def test_any_negative_id_is_masked(mode, act_scale):
    x, ids, w, ex = make_case(
        10, 3, 4, 64, 32, seed=12, masked_frac=0.4, mode_act=(mode, act_scale)
    )
    other = torch.where(ids < 0, torch.randint(-1000, -1, ids.shape, dtype=torch.int32), ids)
    base = fp4moe.moe(x, ids, w, ex, mode=mode, act_scale=act_scale, backend="reference")
    assert torch.equal(
        fp4moe.moe(x, other, w, ex, mode=mode, act_scale=act_scale, backend="reference"), base
    )
    # a masked route's weight is never read
    w2 = torch.where(ids < 0, torch.full_like(w, 123.0), w)
    assert torch.equal(
        fp4moe.moe(x, ids, w2, ex, mode=mode, act_scale=act_scale, backend="reference"), base
    )


def test_auto_backend_on_cpu_is_reference():
    x, ids, w, ex = make_case(5, 2, 4, 64, 32, seed=13)
    assert torch.equal(fp4moe.moe(x, ids, w, ex), moe_reference(x, ids, w, ex))


# --------------------------------------------------------------------------- finalize


def _round_f32(q: Fraction) -> float:
    """Round an exact rational to fp32, nearest, ties to even."""
    if q == 0:
        return 0.0
    cand = np.float32(float(q))  # within one fp32 step of the answer
    best = None
    for c in (
        np.nextafter(cand, np.float32(-np.inf)),
        cand,
        np.nextafter(cand, np.float32(np.inf)),
    ):
        d = abs(Fraction(float(c)) - q)
        even = int(np.array(c, dtype=np.float32).view(np.int32)) & 1 == 0
        if best is None or d < best[0] or (d == best[0] and even):
            best = (d, float(c))
    return best[1]


def _exact_fma(a: float, b: float, c: float) -> float:
    return _round_f32(Fraction(a) * Fraction(b) + Fraction(c))


def _hard_fma_cases() -> list[tuple[float, float, float]]:
    """a * b + c within 2^-29 of an fp32 tie (invisible to a float64 sum), both parities."""
    base = []
    for j in range(1, 128):
        b = 1 + j / 128  # a bf16 value
        a0 = np.float32(1 / b)
        for step in range(-2, 3):
            a = a0
            for _ in range(abs(step)):
                a = np.nextafter(a, np.float32(np.inf if step > 0 else -np.inf))
            delta = Fraction(float(a)) * Fraction(b) - 1
            if delta != 0 and abs(delta) <= Fraction(1, 2**29):
                base.append((float(a), b))
    assert len(base) >= 4, "search for hard cases found too few"
    cases = []
    for a, b in base:
        for c in (1.0, 1.0 + 2.0**-23, 1.5, 1.75 + 2.0**-22 + 2.0**-23, 2.0**10 + 2.0**-13):
            ulp = float(np.spacing(np.float32(c)))
            for sgn in (1.0, -1.0):
                # p = (ulp / 2) * (1 + delta): c + p sits just off the tie c + ulp / 2
                cases.append((sgn * a * ulp / 2, b, sgn * c))
    return cases


def test_fma_f32_is_correctly_rounded():
    g = torch.Generator().manual_seed(0)
    n = 300
    a = torch.randn(n, generator=g) * torch.pow(10.0, torch.empty(n).uniform_(-3, 3, generator=g))
    b = torch.randn(n, generator=g).to(BF16).float()
    c = torch.randn(n, generator=g) * torch.pow(10.0, torch.empty(n).uniform_(-3, 3, generator=g))
    c[:100] = -(a[:100] * b[:100]) * (1 + torch.randn(100, generator=g) * 1e-6)  # cancellation
    hard = _hard_fma_cases()
    a = torch.cat([a, torch.tensor([h[0] for h in hard])])
    b = torch.cat([b, torch.tensor([h[1] for h in hard])])
    c = torch.cat([c, torch.tensor([h[2] for h in hard])])
    assert torch.equal(b.to(BF16).float(), b)
    got = fma_f32(a, b, c)
    assert got.dtype == F32
    want = torch.tensor([_exact_fma(*map(float, abc)) for abc in zip(a, b, c)], dtype=F32)
    assert torch.equal(got, want), f"{int((got != want).sum())} of {len(got)} not correctly rounded"
    # the hard cases are hard: a float64 sum rounded to fp32 gets some of them wrong
    naive = (a.double() * b.double() + c.double()).float()
    assert (naive != want).sum() >= 10


def _hand_finalize(y, ids, w):
    t_count, k_count, h = y.shape
    out = torch.empty(t_count, h, dtype=BF16)
    for t in range(t_count):
        acc = torch.zeros(h, dtype=F32)
        for k in range(k_count):
            if ids[t, k] >= 0:
                acc = fma_f32(w[t, k].expand(h), y[t, k].float(), acc)
        out[t] = acc.to(BF16)
    return out


def test_finalize_matches_hand_loop():
    g = torch.Generator().manual_seed(1)
    T, K, H = 13, 4, 64
    y = (
        torch.randn(T, K, H, generator=g) * 10.0 ** torch.randint(-3, 4, (T, K, 1), generator=g)
    ).to(BF16)
    ids, w = random_routes(T, K, 6, seed=2, masked_frac=0.3)
    ids[0] = -1  # one token fully masked
    y = torch.where((ids < 0)[..., None], torch.full_like(y, float("nan")), y)  # never read
    out = finalize_reference(y, ids, w)
    assert out.dtype == BF16 and out.shape == (T, H)
    assert torch.equal(out, _hand_finalize(y, ids, w))
    assert (out[0] == 0).all() and not torch.isnan(out).any()


def test_finalize_exact_rationals_small():
    """Independent of fma_f32: each step rounded from the exact rational value."""
    g = torch.Generator().manual_seed(3)
    T, K, H = 3, 4, 6
    y = torch.randn(T, K, H, generator=g).to(BF16)
    y[0, :, 0] = torch.tensor([1.0, 2.0**-9, 2.0**-9, -1.0]).to(BF16)  # order-sensitive
    ids = torch.tensor([[0, 1, 2, 3], [2, -1, 0, 1], [-1, -1, 3, -1]], dtype=torch.int32)
    w = torch.rand(T, K, generator=g)
    w[0] = torch.tensor([1.0, 1.0 / 2**15, 1.0 / 2**15, 1.0])
    out = finalize_reference(y, ids, w)
    for t in range(T):
        for j in range(H):
            acc = 0.0
            for k in range(K):
                if ids[t, k] >= 0:
                    acc = _exact_fma(float(w[t, k]), float(y[t, k, j]), acc)
            assert out[t, j].item() == float(torch.tensor(acc, dtype=F32).to(BF16)), (t, j)
    # 1 + 2^-24 + 2^-24 rounds to 1 twice in ascending order; then - 1 leaves exactly 0
    assert out[0, 0].item() == 0.0


# --------------------------------------------------------------------------- batch invariance


@pytest.mark.parametrize(
    "mode,act_scale", [*INVARIANT_MODES, ALL_MODES[-1]], ids=[*MODE_IDS[:3], "w4a8"]
)
def test_batch_invariance_bitwise(mode, act_scale):
    T = 24
    x, ids, w, ex = make_case(T, 3, 6, 64, 32, seed=21, masked_frac=0.2, mode_act=(mode, act_scale))
    kw = {"mode": mode, "act_scale": act_scale, "backend": "reference"}
    full = fp4moe.moe(x, ids, w, ex, **kw)
    for t in (0, 7, T - 1):
        alone = fp4moe.moe(x[t : t + 1], ids[t : t + 1], w[t : t + 1], ex, **kw)
        assert torch.equal(alone[0], full[t]), f"token {t} alone differs from the batch"
    # other company: a shuffled subset plus unrelated tokens with large values
    perm = torch.randperm(T, generator=torch.Generator().manual_seed(0))[:10]
    extra_x = random_x(5, 64, 99) * 50
    extra_ids, extra_w = random_routes(5, 3, 6, seed=98)
    mixed = fp4moe.moe(
        torch.cat([extra_x, x[perm]]),
        torch.cat([extra_ids, ids[perm]]),
        torch.cat([extra_w, w[perm]]),
        ex,
        **kw,
    )
    assert torch.equal(mixed[5:], full[perm])
    assert torch.equal(fp4moe.moe(x, ids, w, ex, **kw), full)  # repeated runs


def test_per_tensor_depends_on_batch():
    x, ids, w, ex = make_case(4, 2, 4, 64, 32, seed=22)
    kw = {"mode": "w4a4", "act_scale": "per_tensor", "backend": "reference"}
    alone = fp4moe.moe(x[:1], ids[:1], w[:1], ex, **kw)
    big = torch.cat([x[:1], x[1:] * 1000])  # another token dominates the per-tensor amax
    batched = fp4moe.moe(big, ids, w, ex, **kw)
    assert not torch.equal(alone[0], batched[0])
    per_token = fp4moe.moe(big, ids, w, ex, mode="w4a4", act_scale="per_token", backend="reference")
    assert torch.equal(
        per_token[0], fp4moe.moe(x[:1], ids[:1], w[:1], ex, mode="w4a4", backend="reference")[0]
    )


# --------------------------------------------------------------------------- validation


@pytest.fixture(scope="module")
def small():
    x, ids, w, ex = make_case(3, 2, 4, 64, 32, seed=30)
    return x, ids, w, ex


def _validation_cases():
    def c(name, exc, pattern, **change):
        return pytest.param(change, exc, pattern, id=name)

    return [
        c("x-fp16", TypeError, "x.*bfloat16", x=lambda x: x.half()),
        c("x-fp32", TypeError, "x.*bfloat16", x=lambda x: x.float()),
        c("x-not-tensor", TypeError, "x", x=lambda x: x.tolist()),
        c("x-1d", ValueError, "x.*2 dimensions", x=lambda x: x[0]),
        c("x-3d", ValueError, "x.*2 dimensions", x=lambda x: x[None]),
        c("x-hidden-96", ValueError, "x.*hidden size", x=lambda x: torch.zeros(3, 96, dtype=BF16)),
        c("ids-int64", TypeError, "topk_ids.*int32", ids=lambda i: i.long()),
        c("ids-float", TypeError, "topk_ids.*int32", ids=lambda i: i.float()),
        c("ids-1d", ValueError, "topk_ids", ids=lambda i: i[:, 0]),
        c("weights-bf16", TypeError, "topk_weights.*float32", w=lambda w: w.bfloat16()),
        c("weights-fp64", TypeError, "topk_weights.*float32", w=lambda w: w.double()),
        c("K-mismatch", ValueError, "topk_weights.*shape", w=lambda w: torch.cat([w, w[:, :1]], 1)),
        c("T-mismatch-ids", ValueError, "topk_ids.*rows", ids=lambda i: i[:2], w=lambda w: w[:2]),
        c("T-mismatch-weights", ValueError, "topk_weights", w=lambda w: w[:2]),
        c("K-zero", ValueError, "topk_ids", ids=lambda i: i[:, :0], w=lambda w: w[:, :0]),
        c(
            "id-equals-E",
            ValueError,
            "topk_ids.*out of range",
            ids=lambda i: torch.where(i == i[0, 0], 4, i),
        ),
        c("id-huge", ValueError, "topk_ids.*out of range", ids=lambda i: i.clone().fill_(1000)),
        c("mode-unknown", ValueError, "mode", mode="w8a8"),
        c("act_scale-unknown", ValueError, "act_scale", mode="w4a4", act_scale="per_block"),
        c("backend-unknown", ValueError, "backend", backend="cutlass"),
        c(
            "static-without-scales",
            ValueError,
            "act_scale.*static",
            mode="w4a4",
            act_scale="static",
        ),
        c("experts-dict", TypeError, "experts", ex=lambda e: e.to_linear()),
        c("experts-none", TypeError, "experts", ex=lambda e: None),
        c("experts-on-meta", ValueError, "x.*on cpu.*meta", ex=lambda e: e.to("meta")),
        c("x-on-meta", ValueError, "x.*on meta", x=lambda x: x.to("meta")),
    ]


@pytest.mark.parametrize("change,exc,pattern", _validation_cases())
def test_moe_validation(small, change, exc, pattern):
    x, ids, w, ex = small
    args = {"x": x, "ids": ids, "w": w, "ex": ex}
    kwargs = {"backend": "reference"}
    for k, v in change.items():
        if k in args:
            args[k] = v(args[k])
        else:
            kwargs[k] = v
    with pytest.raises(exc, match=pattern):
        fp4moe.moe(args["x"], args["ids"], args["w"], args["ex"], **kwargs)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_moe_validation_cuda_device_mismatch(small):
    x, ids, w, ex = small
    with pytest.raises(ValueError, match="x"):
        fp4moe.moe(x.cuda(), ids, w, ex)


def _bits(t):
    return t.contiguous().view(torch.uint8).clone()


@pytest.mark.parametrize("mode,act_scale", MODES, ids=MODE_IDS)
def test_moe_modifies_nothing(mode, act_scale):
    x, ids, w, ex = make_case(9, 3, 4, 64, 32, seed=31, masked_frac=0.2, mode_act=(mode, act_scale))
    before = {k: _bits(v) for k, v in ex.tensors().items()}
    inputs = [x.clone(), ids.clone(), w.clone()]
    fp4moe.moe(x, ids, w, ex, mode=mode, act_scale=act_scale, backend="reference")
    for name, got, want in zip(("x", "ids", "w"), (x, ids, w), inputs):
        assert torch.equal(_bits(got), _bits(want)), name
    after = ex.tensors()
    assert sorted(after) == sorted(before)
    for k, v in before.items():
        assert torch.equal(_bits(after[k]), v), k


def test_triton_backend_on_cpu_raises_clear_error(small, monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    x, ids, w, ex = small
    with pytest.raises((NotImplementedError, RuntimeError, ValueError)) as info:
        fp4moe.moe(x, ids, w, ex, backend="triton")
    msg = str(info.value).lower()
    assert "cuda" in msg or "triton_interpret" in msg or "gpu" in msg, msg


# --------------------------------------------------------------------------- test helpers


def test_random_routes_invariants():
    ids, w = random_routes(50, 4, 8, seed=0, masked_frac=0.25)
    assert ids.dtype == torch.int32 and w.dtype == F32 and ids.shape == w.shape == (50, 4)
    assert (ids < 8).all() and (ids < 0).any() and (ids >= 0).any()
    for row in ids.tolist():
        valid = [i for i in row if i >= 0]
        assert len(valid) == len(set(valid)), row
    assert torch.isfinite(w).all() and (w > 0).all()
    one, _ = random_routes(20, 3, 5, seed=1, all_on_one=3)
    assert ((one == 3).sum(1) == 1).all() and ((one == 3) | (one < 0)).all()
    empty, we = random_routes(0, 2, 4, seed=2)
    assert empty.shape == we.shape == (0, 2) and empty.dtype == torch.int32


def test_assert_close_moe_catches_nan_and_error():
    ref = random_x(4, 64, 0)
    assert_close_moe(ref.clone(), ref, "w4a16")
    zeros = torch.zeros(2, 64, dtype=BF16)
    assert_close_moe(zeros.clone(), zeros, "w4a4")
    poisoned = ref.clone()
    poisoned[2, 5] = float("nan")  # as if never written into a NaN-filled buffer
    with pytest.raises(AssertionError, match="NaN"):
        assert_close_moe(poisoned, ref, "w4a4")
    with pytest.raises(AssertionError, match="relative error"):
        assert_close_moe(ref * 1.01, ref, "w4a16")  # 1e-2 > 2e-3
    assert_close_moe((ref.float() * 1.001).to(BF16), ref, "w4a4")
    with pytest.raises(AssertionError, match="shape"):
        assert_close_moe(ref[:2], ref, "w4a4")
    buf = nan_empty((3, 64), BF16, "cpu")
    assert buf.dtype == BF16 and buf.shape == (3, 64) and torch.isnan(buf).all()
    assert torch.isnan(poison_like(ref)).all() and (poison_like(ref[:, :1].int()) == -1).all()
