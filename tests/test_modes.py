"""One mode vocabulary (fp4moe.modes) across moe(), policies, the runner and the tools: the
names, the one mapping of the older spelling, and refusals that name the right spelling."""

from __future__ import annotations

import pytest
import torch

import fp4moe
from fp4moe import PhaseConfig, PhasePolicy
from fp4moe.backend.launch import moe_triton
from fp4moe.modes import ACT_SCALES, MODE_NAMES, mode_name, relative_error, resolve_mode
from fp4moe.presets import MODES as TOOL_MODES
from fp4moe.reference import moe_reference
from testing import assert_close_moe, random_moe_weights, random_routes, random_x

OLD_SPELLINGS = {
    ("w4a4", None): "w4a4-token",
    ("w4a4", "per_token"): "w4a4-token",
    ("w4a4", "per_tensor"): "w4a4-tensor",
    ("w4a4", "static"): "w4a4-static",
    ("w4a16", "per_token"): "w4a16",
}


@pytest.fixture(scope="module")
def case():
    w13, w2 = random_moe_weights(4, 64, 32, seed=0)
    ex = fp4moe.prepare_experts(w13, w2, a13_scale=0.05, a2_scale=0.5)
    x = random_x(5, 64, seed=1)
    ids, w = random_routes(5, 2, 4, seed=2)
    return x, ids, w, ex


def test_one_vocabulary_everywhere():
    assert MODE_NAMES == ("w4a16", "w4a8", "w4a4-token", "w4a4-tensor", "w4a4-static")
    assert tuple(TOOL_MODES) == MODE_NAMES  # fp4moe bench / plan --modes
    for name in MODE_NAMES:
        kernel, scale = resolve_mode(name)
        assert mode_name(kernel, scale) == name
        assert PhaseConfig.parse(name).name == name == str(PhaseConfig(name))
        assert TOOL_MODES[name] == (kernel, scale)


@pytest.mark.parametrize("old,name", list(OLD_SPELLINGS.items()), ids=str)
def test_old_spelling_maps_to_one_name(case, old, name):
    x, ids, w, ex = case
    assert resolve_mode(*old) == resolve_mode(name)
    mode, act = old
    kw = {} if act is None else {"act_scale": act}
    out = fp4moe.moe(x, ids, w, ex, mode=mode, **kw)
    assert torch.equal(out, fp4moe.moe(x, ids, w, ex, mode=name))


@pytest.mark.parametrize(
    "mode,act_scale,field,hint",
    [
        ("w4a16", "per-token", "act_scale", "W4A16 has no activation scale"),  # a typo
        ("w4a16", "static", "act_scale", "W4A16 has no activation scale"),
        ("w4a8", "per_tensor", "act_scale", "W4A8 has no activation scale"),
        ("w4a4-token", "static", "act_scale", "already says 'per_token'"),
        ("w4a4", "per_row", "act_scale", str(ACT_SCALES).replace("(", r"\(")[:20]),
        ("w4a4-per_token", None, "mode", "did you mean 'w4a4-token'"),
        ("W4A16", None, "mode", "did you mean 'w4a16'"),
        ("W4A8", None, "mode", "did you mean 'w4a8'"),
        ("w8a8", None, "mode", "expected one of"),
    ],
    ids=["typo-w4a16", "static-w4a16", "scale-w4a8", "contradiction", "bad-scale", "old-name",
         "case", "case-w4a8", "unknown"],
)  # fmt: skip
def test_refusals_name_the_argument(case, mode, act_scale, field, hint):
    x, ids, w, ex = case
    kw = {} if act_scale is None else {"act_scale": act_scale}
    with pytest.raises(ValueError, match=field) as info:
        fp4moe.moe(x, ids, w, ex, mode=mode, **kw)
    assert hint.replace("\\", "") in str(info.value) or hint in str(info.value)


def test_policies_and_runner_take_the_names(case):
    *_, ex = case
    policy = PhasePolicy(prefill="w4a4-static+fused", decode="w4a16")
    assert (policy.prefill.mode, policy.prefill.act_scale) == ("w4a4", "static")
    with pytest.raises(ValueError, match="did you mean 'w4a4-token'"):
        PhasePolicy(prefill="w4a4-per_token")
    with pytest.raises(ValueError, match="'w4a4' alone is 'w4a4-token'"):
        PhaseConfig.parse("w4a4")
    runner = fp4moe.MoERunner(ex, max_tokens=8, top_k=2, mode="w4a4-static")
    assert (runner.mode, runner.act_scale) == ("w4a4", "static")
    with pytest.raises(ValueError, match="act_scale"):
        fp4moe.MoERunner(ex, max_tokens=8, top_k=2, mode="w4a16", act_scale="tensor")


def test_plan_takes_the_names(case):
    *_, ex = case
    assert fp4moe.plan(ex, 16, 2, mode="w4a4-tensor") == fp4moe.plan(
        ex, 16, 2, mode="w4a4", act_scale="per_tensor"
    )
    with pytest.raises(ValueError, match="act_scale"):
        fp4moe.plan(ex, 16, 2, mode="w4a16", act_scale="static")


def test_w4a8_is_its_own_mode(case):
    """moe(mode="w4a8") runs numerics section 5a, not W4A16 or W4A4 under another name."""
    x, ids, w, ex = case
    out = fp4moe.moe(x, ids, w, ex, mode="w4a8", backend="reference")
    assert torch.equal(out, moe_reference(x, ids, w, ex, mode="w4a8"))
    for other in ("w4a16", "w4a4-token"):
        assert not torch.equal(out, fp4moe.moe(x, ids, w, ex, mode=other, backend="reference"))
    assert torch.equal(out, fp4moe.moe(x, ids, w, ex, mode="w4a8"))  # auto on the CPU
    assert torch.equal(fp4moe.moe(x[:2], ids[:2], w[:2], ex, mode="w4a8")[1], out[1])  # rows


def test_every_way_into_triton_runs_w4a8(case, interpret):
    """moe(backend="triton"), the custom op, MoERunner and plan run W4A8 as W4A8: the
    Triton backend's bits (interpreter on the CPU), within the W4A16 tolerance of the
    reference (numerics section 5a)."""
    x, ids, w, ex = case
    out = fp4moe.moe(x, ids, w, ex, mode="w4a8", backend="triton")
    assert_close_moe(out, moe_reference(x, ids, w, ex, mode="w4a8"), "w4a8", what="w4a8")
    assert torch.equal(out, moe_triton(x, ids, w, ex, mode="w4a8"))
    assert fp4moe.moe(x[:0], ids[:0], w[:0], ex, mode="w4a8", backend="triton").shape == (0, 64)
    args = (x, ids, w, *fp4moe.ops.expert_tensors(ex), "w4a8", "per_token", False, "triton")
    assert torch.equal(torch.ops.fp4moe.moe(*args, True, None, None), out)  # the op directly
    runner = fp4moe.MoERunner(ex, max_tokens=8, top_k=2, mode="w4a8")
    assert torch.equal(runner(x, ids, w), out)
    plan = fp4moe.plan(ex, 16, 2, mode="w4a8")
    assert (plan.mode, plan.fc2_input) == ("w4a8", "e4m3-row")


def test_relative_error():
    ref = torch.tensor([3.0, 4.0])
    assert relative_error(ref + torch.tensor([0.0, 0.5]), ref) == pytest.approx(0.1)
    assert relative_error(ref.bfloat16(), ref) == 0.0
    assert relative_error(torch.zeros(2), torch.zeros(2)) == 0.0
    assert relative_error(torch.empty(0, 4), torch.empty(0, 4)) == 0.0
    assert relative_error(torch.ones(2), torch.zeros(2)) > 1e20
