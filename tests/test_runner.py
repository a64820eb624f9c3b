"""MoERunner: static workspaces and CUDA-graph replay give the eager kernels' bits."""

from __future__ import annotations

import pytest
import torch

import fp4moe
from fp4moe.backend.launch import moe_triton
from test_kernels import MODES, _experts, _gpu_routes, _mode_id, _routes, _x


@pytest.mark.kernel
@pytest.mark.parametrize("mode", MODES, ids=_mode_id)
def test_runner_matches_eager_interpreter(interpret, device, mode):
    if device != "cpu":
        pytest.skip("interpreter case; the GPU case replays graphs")
    m, sc = mode
    experts = _experts(4, 64, 32, seed=1, device=device)
    runner = fp4moe.MoERunner(experts, max_tokens=8, top_k=2, mode=m, act_scale=sc)
    assert runner.buckets == [1, 2, 4, 8]
    for t in (1, 3, 8, 5, 11):  # 11 > max_tokens: eager fallback
        x = _x(t, 64, seed=t, device=device)
        ids, w = _routes(t, 2, 4, seed=t, device=device, masked=0.2)
        out = runner(x, ids, w).clone()
        ref = moe_triton(x, ids, w, experts, mode=m, act_scale=sc)
        assert torch.equal(out, ref), t
    assert runner(x[:0], ids[:0], w[:0]).shape == (0, 64)


def test_runner_bad_arguments():
    experts = _experts(2, 64, 32, seed=0, device="cpu")
    with pytest.raises(ValueError, match="max_tokens"):
        fp4moe.MoERunner(experts, max_tokens=0, top_k=1)
    with pytest.raises(ValueError, match="mode"):
        fp4moe.MoERunner(experts, max_tokens=4, top_k=1, mode="w8a8")
    with pytest.raises(ValueError, match="act_scale"):
        fp4moe.MoERunner(experts, max_tokens=4, top_k=1, mode="w4a8", act_scale="static")
    with pytest.raises(TypeError, match="experts"):
        fp4moe.MoERunner(None, max_tokens=4, top_k=1)
    r = fp4moe.MoERunner(experts, max_tokens=4, top_k=2)
    x = _x(2, 64, seed=0, device="cpu")
    ids, w = _routes(2, 1, 2, seed=0, device="cpu")
    with pytest.raises(ValueError, match="topk_ids"):
        r(x, ids, w)


def test_modes_share_one_prepared_copy():
    """W4A16 and W4A4 runners read the very same PreparedExperts storage."""
    experts = _experts(2, 64, 32, seed=0, device="cpu")
    a = fp4moe.MoERunner(experts, max_tokens=4, top_k=1, mode="w4a16")
    b = fp4moe.MoERunner(experts, max_tokens=4, top_k=1, mode="w4a4", act_scale="per_token")
    for name in ("w13_codes", "w13_scales", "w2_codes", "w2_scales"):
        assert getattr(a.experts, name).data_ptr() == getattr(b.experts, name).data_ptr()


@pytest.mark.gpu
@pytest.mark.parametrize("mode", MODES, ids=_mode_id)
@pytest.mark.parametrize("fused", [False, True], ids=["deterministic", "fused"])
def test_runner_graph_replay_gpu(mode, fused):
    m, sc = mode
    e, h, i, k = 32, 7168, 2048, 8
    experts = _experts(e, h, i, seed=0, device="cuda")
    runner = fp4moe.MoERunner(
        experts, max_tokens=64, top_k=k, mode=m, act_scale=sc, fused_finalize=fused
    )
    x = _x(64, h, seed=5, device="cuda")
    ids, w = _gpu_routes(64, k, e, 256, seed=5)
    for t in (1, 7, 16, 64):
        runner(x[:t], ids[:t], w[:t])  # capture
    mem = torch.cuda.memory_allocated()
    for t in (1, 7, 16, 64, 100):
        xs, ids_s, ws = _x(t, h, seed=t, device="cuda"), *_gpu_routes(t, k, e, 256, seed=t)
        eager = moe_triton(xs, ids_s, ws, experts, mode=m, act_scale=sc, fused_finalize=fused)
        got = runner(xs, ids_s, ws).clone()
        again = runner(xs, ids_s, ws).clone()
        if fused:
            from testing import TOL, rel_err

            assert rel_err(got, eager) <= TOL[m]
        else:
            assert torch.equal(got, eager), t
            assert torch.equal(again, got), t
        del xs, ids_s, ws, eager, got, again
    torch.cuda.synchronize()
    assert torch.cuda.memory_allocated() <= mem + 64 * h * 4 * 8  # no growth from replays
