"""Tests of fp4moe.routing: route() against a plain-Python reference and against the routing
code of Hugging Face transformers (skipped when it is not installed), and the invariants of
the expert-parallel id mapping."""

from __future__ import annotations

import itertools
import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from fp4moe.routing import ROUTING_METHODS, expert_range, local_expert_ids, route

# (T, E, K, n_group, topk_group): odd sizes, K = 1, K = E, one group, one kept group.
SIZES = [
    pytest.param(1, 8, 2, 1, 1, id="T1-E8-K2"),
    pytest.param(7, 16, 4, 4, 2, id="T7-E16-K4-g4-tg2"),
    pytest.param(33, 64, 6, 8, 3, id="T33-E64-K6-g8-tg3"),
    pytest.param(5, 12, 1, 3, 1, id="T5-E12-K1-g3-tg1"),
    pytest.param(4, 6, 6, 1, 1, id="T4-E6-K6"),
    pytest.param(9, 32, 8, 8, 4, id="T9-E32-K8-g8-tg4"),
]


def _randn(*shape: int, seed: int, scale: float = 1.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g) * scale


# ---------------------------------------------------------------------------------------
# The reference: one token at a time, in Python floats (double precision), sorted().


def _ref_route(
    logits: torch.Tensor,
    top_k: int,
    method: str,
    renormalize: bool = True,
    bias: torch.Tensor | None = None,
    n_group: int = 1,
    topk_group: int = 1,
    scaling_factor: float = 1.0,
) -> tuple[list[list[int]], list[list[float]]]:
    num_experts = logits.shape[1]
    bias_list = [0.0] * num_experts if bias is None else bias.double().tolist()
    all_ids, all_weights = [], []
    for row in logits.double().tolist():
        if method == "softmax":
            m = max(row)
            e = [math.exp(v - m) for v in row]
            probs = [v / sum(e) for v in e]
            ids = sorted(range(num_experts), key=lambda i: -probs[i])[:top_k]
            w = [probs[i] for i in ids]
            if renormalize:
                w = [v / sum(w) for v in w]
        elif method == "topk_softmax":
            ids = sorted(range(num_experts), key=lambda i: -row[i])[:top_k]
            m = row[ids[0]]
            e = [math.exp(row[i] - m) for i in ids]
            w = [v / sum(e) for v in e]
        else:
            scores = [1.0 / (1.0 + math.exp(-v)) for v in row]
            choice = [s + b for s, b in zip(scores, bias_list)]
            size = num_experts // n_group
            groups = [list(range(g * size, (g + 1) * size)) for g in range(n_group)]
            group_score = [
                sum(sorted((choice[i] for i in grp), reverse=True)[:2]) for grp in groups
            ]
            kept = sorted(range(n_group), key=lambda g: -group_score[g])[:topk_group]
            candidates = [i for g in kept for i in groups[g]]
            ids = sorted(candidates, key=lambda i: -choice[i])[:top_k]
            w = [scores[i] for i in ids]
            if renormalize:
                w = [v / (sum(w) + 1e-20) for v in w]
            w = [v * scaling_factor for v in w]
        all_ids.append(ids)
        all_weights.append(w)
    return all_ids, all_weights


def _assert_matches_ref(ids, weights, ref_ids, ref_weights, atol=1e-6):
    assert ids.tolist() == ref_ids
    torch.testing.assert_close(
        weights.double(), torch.tensor(ref_weights, dtype=torch.float64).reshape(weights.shape),
        atol=atol, rtol=1e-6,
    )  # fmt: skip


def _check_output(ids, weights, tokens, top_k, logits):
    assert ids.dtype == torch.int32 and weights.dtype == torch.float32
    assert ids.shape == (tokens, top_k) and weights.shape == (tokens, top_k)
    assert ids.device == logits.device and weights.device == logits.device


@pytest.mark.parametrize(("T", "E", "K", "n_group", "topk_group"), SIZES)
@pytest.mark.parametrize("renormalize", [True, False], ids=["renorm", "no-renorm"])
def test_softmax_matches_reference(T, E, K, n_group, topk_group, renormalize):
    logits = _randn(T, E, seed=T * 1000 + E, scale=2.0)
    ids, weights = route(logits, K, method="softmax", renormalize=renormalize)
    _check_output(ids, weights, T, K, logits)
    _assert_matches_ref(ids, weights, *_ref_route(logits, K, "softmax", renormalize))
    if renormalize:
        torch.testing.assert_close(weights.sum(-1), torch.ones(T), atol=1e-6, rtol=0)
    else:
        full = torch.softmax(logits, dim=-1).gather(1, ids.long())
        assert torch.equal(weights, full)


@pytest.mark.parametrize(("T", "E", "K", "n_group", "topk_group"), SIZES)
def test_topk_softmax_matches_reference(T, E, K, n_group, topk_group):
    logits = _randn(T, E, seed=T * 1000 + E + 1, scale=2.0)
    ids, weights = route(logits, K, method="topk_softmax")
    _check_output(ids, weights, T, K, logits)
    _assert_matches_ref(ids, weights, *_ref_route(logits, K, "topk_softmax"))


@pytest.mark.parametrize(("T", "E", "K", "n_group", "topk_group"), SIZES)
def test_topk_softmax_equals_mixtral_formulation(T, E, K, n_group, topk_group):
    """Mixtral: softmax over all, top-k, renormalize; the same experts, weights to fp32 rounding."""
    logits = _randn(T, E, seed=T * 1000 + E + 2, scale=3.0)
    ids, weights = route(logits, K, method="topk_softmax")
    probs = torch.softmax(logits, dim=-1)
    mix_w, mix_ids = torch.topk(probs, K, dim=-1)
    mix_w = mix_w / mix_w.sum(-1, keepdim=True)
    assert torch.equal(ids, mix_ids.int())
    torch.testing.assert_close(weights, mix_w, atol=1e-6, rtol=0)


@pytest.mark.parametrize(("T", "E", "K", "n_group", "topk_group"), SIZES)
@pytest.mark.parametrize("renormalize", [True, False], ids=["renorm", "no-renorm"])
@pytest.mark.parametrize("with_bias", [True, False], ids=["bias", "no-bias"])
def test_sigmoid_grouped_matches_reference(T, E, K, n_group, topk_group, renormalize, with_bias):
    logits = _randn(T, E, seed=T * 1000 + E + 3, scale=2.0)
    bias = _randn(E, seed=E, scale=0.3) if with_bias else None
    kwargs = dict(n_group=n_group, topk_group=topk_group, scaling_factor=2.5)
    ids, weights = route(
        logits, K, method="sigmoid_grouped", renormalize=renormalize, correction_bias=bias,
        **kwargs,
    )  # fmt: skip
    _check_output(ids, weights, T, K, logits)
    ref = _ref_route(logits, K, "sigmoid_grouped", renormalize, bias, **kwargs)
    _assert_matches_ref(ids, weights, *ref)


# ---------------------------------------------------------------------------------------
# Grouped selection, bias and scaling


def test_grouped_drops_group_of_best_expert():
    # Group 0 holds the single best expert but its second best is poor: group score about
    # 1.0 against about 1.7 for groups 1 and 2, so group 0 is dropped.
    logits = torch.tensor([[10.0, -10.0, 2.0, 1.9, 1.8, 1.7, 0.0, 0.0]])
    ids, _ = route(logits, 2, method="sigmoid_grouped", n_group=4, topk_group=2)
    assert ids.tolist() == [[2, 3]]
    # One group per expert pair, all groups kept: expert 0 is back.
    ids, _ = route(logits, 2, method="sigmoid_grouped", n_group=4, topk_group=4)
    assert ids.tolist() == [[0, 2]]


@given(
    seed=st.integers(0, 2**31 - 1),
    shape=st.sampled_from([(16, 4, 2, 3), (32, 8, 3, 5), (12, 6, 1, 2), (64, 8, 4, 8)]),
)
@settings(max_examples=40, deadline=None)
def test_grouped_never_picks_a_dropped_group(seed, shape):
    num_experts, n_group, topk_group, top_k = shape
    logits = _randn(6, num_experts, seed=seed, scale=3.0)
    bias = _randn(num_experts, seed=seed + 1, scale=0.5)
    ids, _ = route(
        logits, top_k, method="sigmoid_grouped", correction_bias=bias, n_group=n_group,
        topk_group=topk_group,
    )  # fmt: skip
    choice = torch.sigmoid(logits) + bias
    group_scores = choice.view(6, n_group, -1).topk(2, dim=-1).values.sum(-1)
    kept = group_scores.topk(topk_group, dim=-1).indices
    size = num_experts // n_group
    for t in range(6):
        groups = set((ids[t].long() // size).tolist())
        assert groups <= set(kept[t].tolist())
        assert len(set(ids[t].tolist())) == top_k


def test_bias_changes_selection_not_weights():
    logits = torch.tensor([[3.0, 2.0, 1.0, 0.0]])
    bias = torch.tensor([0.0, 0.0, 0.0, 10.0])
    ids, weights = route(logits, 2, method="sigmoid_grouped", correction_bias=bias)
    assert ids.tolist() == [[3, 0]]  # expert 3 only through its bias; ordered by biased score
    s = torch.sigmoid(logits[0])
    expected = torch.stack([s[3], s[0]]) / (s[3] + s[0] + 1e-20)
    torch.testing.assert_close(weights[0], expected, atol=0, rtol=0)
    ids0, _ = route(logits, 2, method="sigmoid_grouped")
    assert ids0.tolist() == [[0, 1]]


@pytest.mark.parametrize("renormalize", [True, False], ids=["renorm", "no-renorm"])
def test_grouped_weights_are_unbiased_scores(renormalize):
    logits = _randn(20, 32, seed=5, scale=2.0)
    bias = _randn(32, seed=6, scale=1.0)
    ids, weights = route(
        logits, 4, method="sigmoid_grouped", renormalize=renormalize, correction_bias=bias,
        n_group=4, topk_group=2, scaling_factor=1.5,
    )  # fmt: skip
    w = torch.sigmoid(logits).gather(1, ids.long())
    if renormalize:
        w = w / (w.sum(-1, keepdim=True) + 1e-20)
    assert torch.equal(weights, w * 1.5)


def test_scaling_factor():
    logits = _randn(10, 16, seed=7)
    kw = dict(method="sigmoid_grouped", n_group=4, topk_group=2)
    ids1, w1 = route(logits, 4, **kw)
    ids2, w2 = route(logits, 4, scaling_factor=2.5, **kw)
    assert torch.equal(ids1, ids2)
    assert torch.equal(w2, w1 * 2.5)
    torch.testing.assert_close(w2.sum(-1), torch.full((10,), 2.5), atol=1e-6, rtol=0)


# ---------------------------------------------------------------------------------------
# Dtypes, shapes, empty input, general properties


@pytest.mark.parametrize("method", ROUTING_METHODS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float64])
def test_any_float_dtype_computes_in_fp32(method, dtype):
    logits = _randn(13, 16, seed=8, scale=2.0).to(dtype)
    ids, weights = route(logits, 3, method=method)
    _check_output(ids, weights, 13, 3, logits)
    ids32, w32 = route(logits.float(), 3, method=method)
    assert torch.equal(ids, ids32) and torch.equal(weights, w32)


@pytest.mark.parametrize("method", ROUTING_METHODS)
def test_empty_batch(method):
    logits = torch.empty(0, 16, dtype=torch.bfloat16)
    kw = dict(n_group=4, topk_group=2) if method == "sigmoid_grouped" else {}
    ids, weights = route(logits, 3, method=method, **kw)
    _check_output(ids, weights, 0, 3, logits)


@pytest.mark.parametrize("method", ROUTING_METHODS)
def test_non_contiguous_logits(method):
    base = _randn(16, 10, seed=9)
    logits = base.t()  # [10, 16], strided
    ids, weights = route(logits, 4, method=method)
    ids_c, weights_c = route(logits.contiguous(), 4, method=method)
    assert torch.equal(ids, ids_c) and torch.equal(weights, weights_c)


@given(
    seed=st.integers(0, 2**31 - 1),
    tokens=st.integers(1, 9),
    num_experts=st.sampled_from([1, 2, 5, 8, 16]),
    data=st.data(),
)
@settings(max_examples=60, deadline=None)
def test_route_properties(seed, tokens, num_experts, data):
    top_k = data.draw(st.integers(1, num_experts))
    method = data.draw(st.sampled_from(ROUTING_METHODS))
    logits = _randn(tokens, num_experts, seed=seed, scale=4.0)
    ids, weights = route(logits, top_k, method=method)
    _check_output(ids, weights, tokens, top_k, logits)
    assert ((ids >= 0) & (ids < num_experts)).all()
    for row in ids.tolist():
        assert len(set(row)) == top_k
    assert (weights >= 0).all()
    torch.testing.assert_close(weights.sum(-1), torch.ones(tokens), atol=1e-5, rtol=0)
    if method != "sigmoid_grouped":
        assert (weights[:, :-1] >= weights[:, 1:]).all()


def test_nan_logits_are_not_checked():
    logits = torch.tensor([[float("nan"), 1.0, 0.0, -1.0]])
    for method in ROUTING_METHODS:
        route(logits, 2, method=method)  # no error: no check on the hot path


# ---------------------------------------------------------------------------------------
# Validation


def _bad_route_cases():
    x = torch.zeros(4, 8)
    cases = [
        ("not-tensor", ([[0.0] * 8], 2, {"method": "softmax"}), TypeError, "logits"),
        ("1-D", (torch.zeros(8), 2, {"method": "softmax"}), ValueError, "logits"),
        ("3-D", (torch.zeros(1, 4, 8), 2, {"method": "softmax"}), ValueError, "logits"),
        ("int-logits", (torch.zeros(4, 8, dtype=torch.int32), 2, {"method": "softmax"}),
         TypeError, "logits"),
        ("top_k-0", (x, 0, {"method": "softmax"}), ValueError, "top_k"),
        ("top_k>E", (x, 9, {"method": "topk_softmax"}), ValueError, "top_k"),
        ("top_k-float", (x, 2.0, {"method": "softmax"}), TypeError, "top_k"),
        ("top_k-bool", (x, True, {"method": "softmax"}), TypeError, "top_k"),
        ("method", (x, 2, {"method": "sigmoid"}), ValueError, "method"),
        ("bias-shape", (x, 2, {"method": "sigmoid_grouped", "correction_bias": torch.zeros(4)}),
         ValueError, "correction_bias"),
        ("bias-2d", (x, 2, {"method": "sigmoid_grouped",
                            "correction_bias": torch.zeros(1, 8)}), ValueError, "correction_bias"),
        ("bias-int", (x, 2, {"method": "sigmoid_grouped",
                             "correction_bias": torch.zeros(8, dtype=torch.int64)}),
         TypeError, "correction_bias"),
        ("bias-list", (x, 2, {"method": "sigmoid_grouped", "correction_bias": [0.0] * 8}),
         TypeError, "correction_bias"),
        ("n_group-divisor", (x, 2, {"method": "sigmoid_grouped", "n_group": 3}),
         ValueError, "n_group"),
        ("n_group-0", (x, 2, {"method": "sigmoid_grouped", "n_group": 0}), ValueError, "n_group"),
        ("topk_group>n_group", (x, 2, {"method": "sigmoid_grouped", "n_group": 2,
                                       "topk_group": 3}), ValueError, "topk_group"),
        ("topk_group-0", (x, 2, {"method": "sigmoid_grouped", "n_group": 2, "topk_group": 0}),
         ValueError, "topk_group"),
        ("top_k>kept", (x, 3, {"method": "sigmoid_grouped", "n_group": 4, "topk_group": 1}),
         ValueError, "top_k"),
        ("scaling-str", (x, 2, {"method": "sigmoid_grouped", "scaling_factor": "2"}),
         TypeError, "scaling_factor"),
        ("topk_softmax-no-renorm", (x, 2, {"method": "topk_softmax", "renormalize": False}),
         ValueError, "renormalize"),
    ]  # fmt: skip
    for method in ("softmax", "topk_softmax"):
        for name, value in [
            ("correction_bias", torch.zeros(8)),
            ("n_group", 2),
            ("topk_group", 2),
            ("scaling_factor", 2.5),
        ]:
            cases.append(
                (f"{method}-{name}", (x, 2, {"method": method, name: value}), ValueError, name)
            )
    return [pytest.param(*c[1:], id=c[0]) for c in cases]


@pytest.mark.parametrize(("args", "error", "name"), _bad_route_cases())
def test_route_rejects_bad_input(args, error, name):
    logits, top_k, kwargs = args
    with pytest.raises(error, match=name):
        route(logits, top_k, **kwargs)


@pytest.mark.skipif(not torch.backends.mps.is_available() and not torch.cuda.is_available(),
                    reason="needs a second device")  # fmt: skip
def test_bias_on_other_device():
    device = "cuda" if torch.cuda.is_available() else "mps"
    with pytest.raises(ValueError, match="correction_bias"):
        route(
            torch.zeros(2, 8, device=device), 2, method="sigmoid_grouped",
            correction_bias=torch.zeros(8),
        )  # fmt: skip


# ---------------------------------------------------------------------------------------
# Expert-parallel mapping


@given(
    world_size=st.sampled_from([1, 2, 4, 8]),
    per_rank=st.integers(1, 6),
    seed=st.integers(0, 2**31 - 1),
    dtype=st.sampled_from([torch.int32, torch.int64]),
)
@settings(max_examples=60, deadline=None)
def test_local_expert_ids_partition(world_size, per_rank, seed, dtype):
    num_experts = world_size * per_rank
    g = torch.Generator().manual_seed(seed)
    # Valid ids plus already-masked (negative) ones.
    ids = torch.randint(-3, num_experts, (7, 3), generator=g).to(dtype)
    owners = torch.zeros_like(ids, dtype=torch.int64)
    rebuilt = torch.full_like(ids, -1, dtype=torch.int64)
    for rank in range(world_size):
        start, stop = expert_range(rank, world_size, num_experts)
        assert stop - start == per_rank
        local = local_expert_ids(ids, start, stop)
        assert local.dtype == torch.int32 and local.shape == ids.shape
        held = (ids >= start) & (ids < stop)
        assert torch.equal(local[~held], torch.full_like(local[~held], -1))
        assert ((local[held] >= 0) & (local[held] < per_rank)).all()
        assert torch.equal(local[held].long() + start, ids[held].long())
        owners += held.long()
        rebuilt = torch.where(local >= 0, local.long() + start, rebuilt)
    valid = ids >= 0
    assert torch.equal(owners, valid.long())  # each valid route on exactly one rank
    assert torch.equal(rebuilt[valid], ids[valid].long())
    assert (rebuilt[~valid] == -1).all()


def test_local_expert_ids_examples():
    ids = torch.tensor([[0, 5, 7, -1], [8, 3, 4, 12]], dtype=torch.int32)
    assert local_expert_ids(ids, 4, 8).tolist() == [[-1, 1, 3, -1], [-1, -1, 0, -1]]
    assert local_expert_ids(ids, 0, 4).tolist() == [[0, -1, -1, -1], [-1, 3, -1, -1]]
    assert local_expert_ids(ids, 3, 3).tolist() == [[-1] * 4] * 2
    empty = local_expert_ids(torch.empty(0, 4, dtype=torch.int32), 0, 4)
    assert empty.shape == (0, 4) and empty.dtype == torch.int32


def test_local_expert_ids_does_not_modify_input():
    ids = torch.tensor([[0, 5], [9, 2]], dtype=torch.int32)
    before = ids.clone()
    local_expert_ids(ids, 2, 6)
    assert torch.equal(ids, before)


@pytest.mark.parametrize(
    ("args", "error", "name"),
    [
        pytest.param(([[0, 1]], 0, 2), TypeError, "topk_ids", id="not-tensor"),
        pytest.param((torch.zeros(2, 2), 0, 2), TypeError, "topk_ids", id="float-ids"),
        pytest.param((torch.zeros(4, dtype=torch.int32), 0, 2), ValueError, "topk_ids", id="1-D"),
        pytest.param((torch.zeros(2, 2, dtype=torch.int32), 3, 2), ValueError, "expert_start",
                     id="start>stop"),
        pytest.param((torch.zeros(2, 2, dtype=torch.int32), -1, 2), ValueError, "expert_start",
                     id="negative-start"),
        pytest.param((torch.zeros(2, 2, dtype=torch.int32), 0.0, 2), TypeError, "expert_start",
                     id="float-start"),
    ],
)  # fmt: skip
def test_local_expert_ids_rejects_bad_input(args, error, name):
    with pytest.raises(error, match=name):
        local_expert_ids(*args)


def test_expert_range_covers_all_experts():
    ranges = [expert_range(r, 8, 256) for r in range(8)]
    assert ranges[0] == (0, 32) and ranges[-1] == (224, 256)
    assert all(a[1] == b[0] for a, b in itertools.pairwise(ranges))
    assert expert_range(0, 1, 5) == (0, 5)


@pytest.mark.parametrize(
    ("args", "error", "match"),
    [
        pytest.param((0, 3, 8), ValueError, "num_experts, world_size", id="not-multiple"),
        pytest.param((2, 2, 8), ValueError, "rank", id="rank-too-big"),
        pytest.param((-1, 2, 8), ValueError, "rank", id="rank-negative"),
        pytest.param((0, 0, 8), ValueError, "world_size", id="world-0"),
        pytest.param((0, 2, 0), ValueError, "num_experts", id="no-experts"),
        pytest.param((0, 2.0, 8), TypeError, "world_size", id="float-world"),
    ],
)
def test_expert_range_rejects_bad_input(args, error, match):
    with pytest.raises(error, match=match):
        expert_range(*args)


# ---------------------------------------------------------------------------------------
# Hugging Face transformers: the routing code of the models themselves


def _hf_router(gate: torch.nn.Module, hidden: torch.Tensor):
    """(logits, weights, ids) from a transformers >= 5 router module, else skip."""
    with torch.no_grad():
        out = gate(hidden)
    if not (isinstance(out, tuple) and len(out) == 3):
        transformers = pytest.importorskip("transformers")
        pytest.skip(
            f"transformers {transformers.__version__}: {type(gate).__name__} does not return "
            "(logits, weights, ids)"
        )
    return out


def _assert_same_routes(ids, weights, hf_ids, hf_weights):
    """Same experts a token (as sets) and the same weight for each, to 1e-6."""
    hf_ids = hf_ids.long()
    assert hf_ids.shape == ids.shape
    ours_sorted, order = ids.long().sort(dim=-1)
    hf_sorted, hf_order = hf_ids.sort(dim=-1)
    assert torch.equal(ours_sorted, hf_sorted)
    torch.testing.assert_close(
        weights.gather(1, order), hf_weights.float().gather(1, hf_order), atol=1e-6, rtol=0
    )


def _fill_(param: torch.Tensor, seed: int, scale: float = 1.0) -> None:
    with torch.no_grad():
        param.copy_(_randn(*param.shape, seed=seed, scale=scale))


_TINY = dict(num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2, vocab_size=64)


@pytest.mark.parametrize("norm_topk_prob", [True, False], ids=["norm", "no-norm"])
def test_hf_qwen3_moe(norm_topk_prob):
    pytest.importorskip("transformers")
    qwen = pytest.importorskip("transformers.models.qwen3_moe.modeling_qwen3_moe")
    from transformers import Qwen3MoeConfig

    config = Qwen3MoeConfig(
        hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_experts=16,
        num_experts_per_tok=4, norm_topk_prob=norm_topk_prob, **_TINY,
    )  # fmt: skip
    block = qwen.Qwen3MoeSparseMoeBlock(config)
    _fill_(block.gate.weight, seed=10)
    hidden = _randn(37, 32, seed=11)
    hf_logits, hf_weights, hf_ids = _hf_router(block.gate, hidden)
    logits = F.linear(hidden, block.gate.weight.detach().clone())
    assert torch.equal(logits, hf_logits)
    ids, weights = route(logits, 4, method="softmax", renormalize=norm_topk_prob)
    _assert_same_routes(ids, weights, hf_ids, hf_weights)


def test_hf_mixtral():
    pytest.importorskip("transformers")
    mixtral = pytest.importorskip("transformers.models.mixtral.modeling_mixtral")
    from transformers import MixtralConfig

    config = MixtralConfig(
        hidden_size=32, intermediate_size=16, num_local_experts=8, num_experts_per_tok=2,
        **_TINY,
    )  # fmt: skip
    block = mixtral.MixtralSparseMoeBlock(config).eval()
    _fill_(block.gate.weight, seed=12)
    hidden = _randn(41, 32, seed=13)
    hf_logits, hf_weights, hf_ids = _hf_router(block.gate, hidden)
    logits = F.linear(hidden, block.gate.weight.detach().clone())
    assert torch.equal(logits, hf_logits)
    ids, weights = route(logits, 2, method="topk_softmax")
    _assert_same_routes(ids, weights, hf_ids, hf_weights)


def test_hf_gpt_oss():
    pytest.importorskip("transformers")
    gpt_oss = pytest.importorskip("transformers.models.gpt_oss.modeling_gpt_oss")
    from transformers import GptOssConfig

    config = GptOssConfig(
        hidden_size=32, intermediate_size=16, num_local_experts=8, num_experts_per_tok=4,
        head_dim=16, **_TINY,
    )  # fmt: skip
    router = gpt_oss.GptOssTopKRouter(config)
    _fill_(router.weight, seed=14)
    _fill_(router.bias, seed=15, scale=0.5)
    hidden = _randn(29, 32, seed=16)
    hf_logits, hf_weights, hf_ids = _hf_router(router, hidden)
    logits = F.linear(hidden, router.weight.detach().clone(), router.bias.detach().clone())
    assert torch.equal(logits, hf_logits)
    ids, weights = route(logits, 4, method="topk_softmax")
    _assert_same_routes(ids, weights, hf_ids, hf_weights)


@pytest.mark.parametrize(
    ("n_group", "topk_group", "norm_topk_prob"),
    [(4, 2, True), (8, 3, True), (4, 2, False), (1, 1, True)],
    ids=["g4-tg2-norm", "g8-tg3-norm", "g4-tg2-no-norm", "g1-tg1-norm"],
)
def test_hf_deepseek_v3(n_group, topk_group, norm_topk_prob):
    pytest.importorskip("transformers")
    deepseek = pytest.importorskip("transformers.models.deepseek_v3.modeling_deepseek_v3")
    from transformers import DeepseekV3Config

    config = DeepseekV3Config(
        hidden_size=32, intermediate_size=64, moe_intermediate_size=16, n_routed_experts=32,
        num_experts_per_tok=6, n_group=n_group, topk_group=topk_group, n_shared_experts=1,
        routed_scaling_factor=2.5, norm_topk_prob=norm_topk_prob, **_TINY,
    )  # fmt: skip
    block = deepseek.DeepseekV3MoE(config)
    gate = block.gate
    _fill_(gate.weight, seed=17, scale=0.5)
    _fill_(gate.e_score_correction_bias, seed=18, scale=0.3)
    hidden = _randn(53, 32, seed=19)
    hf_logits, hf_weights, hf_ids = _hf_router(gate, hidden)
    logits = F.linear(hidden, gate.weight.detach().clone())
    assert torch.equal(logits, hf_logits)
    ids, weights = route(
        logits, 6, method="sigmoid_grouped", renormalize=norm_topk_prob,
        correction_bias=gate.e_score_correction_bias.detach().clone(), n_group=n_group,
        topk_group=topk_group, scaling_factor=2.5,
    )  # fmt: skip
    _assert_same_routes(ids, weights, hf_ids, hf_weights)
    # The bias really moved some choices in this case (so the test tests it).
    unbiased, _ = route(logits, 6, method="sigmoid_grouped", n_group=n_group, topk_group=topk_group)
    assert not torch.equal(unbiased.sort(-1).values, ids.sort(-1).values)
