"""fp4moe bench: the parts that run without a GPU (presets, outputs); the GPU run is manual."""

from __future__ import annotations

import argparse
import csv
import json
import os
from typing import ClassVar

import pytest
import torch

import fp4moe
from fp4moe import bench, roofline
from testing import random_moe_weights


def _args(**kw):
    p = argparse.ArgumentParser()
    bench.add_arguments(p)
    args = p.parse_args([])
    for k, v in kw.items():
        setattr(args, k, v)
    return args


def test_defaults_sweep_1_to_16384_all_modes():
    args = _args()
    assert args.num_tokens == [2**i for i in range(15)]
    assert set(args.modes) == {"w4a4-tensor", "w4a4-token", "w4a16"}


@pytest.mark.parametrize("name", sorted(bench.PRESETS))
def test_presets_route_on_cpu(name):
    p = bench.resolve_preset(_args(preset=name))
    ids, w = bench.make_routes(p, 5, 0, "cpu")
    assert ids.shape == (5, p.top_k) and w.shape == (5, p.top_k)
    assert int(ids.max()) < p.local_experts
    if p.local_experts < p.experts:
        assert bool((ids < 0).any())  # other ranks' experts are masked


def test_overrides_and_bad_shapes():
    p = bench.resolve_preset(_args(hidden=1024, inter=512, experts=16, top_k=4))
    assert (p.hidden, p.inter, p.experts, p.local_experts, p.top_k) == (1024, 512, 16, 16, 4)
    with pytest.raises(ValueError, match="multiples of 32"):
        bench.resolve_preset(_args(hidden=1000))
    with pytest.raises(ValueError, match="top-k"):
        bench.resolve_preset(_args(top_k=999))


def test_outputs_table_json_csv(tmp_path):
    row = {
        "tokens": 16, "local_routes": 11, "experts_touched": 11, "mode": "w4a16",
        "finalize": "unfused", "us": 300.0, "tflops": 3.0, "weight_GBps": 900.0,
        "floor_fraction": 0.2, "roofline_fraction": 0.2, "vs_bf16": 1.5, "vs_naive_nvfp4": 3.0,
        "unfused_over_fused": None,
        "bf16_us": 450.0, "naive_nvfp4_us": 900.0, "rel_err": 1e-4,
    }  # fmt: skip
    doc = {
        "device": "test", "preset": "deepseek-v3-ep8", "rows": [row],
        "ceilings": {"copy_bytes_per_s": 4.2e12, "bf16_matmul_flops": 7.5e14},
    }  # fmt: skip
    bench.write_outputs(doc, str(tmp_path))
    assert json.loads((tmp_path / "bench.json").read_text())["rows"][0]["us"] == 300.0
    rows = list(csv.DictReader((tmp_path / "bench.csv").open()))
    assert rows[0]["mode"] == "w4a16"
    table = bench.format_table(doc)  # a run without the FP8 rate (older JSON) still prints
    assert "4.20 TB/s" in table and "w4a16" in table and "fp8" not in table
    assert "bound" in table.splitlines()[1]  # a column the older row lacks prints "-"
    row.update(weight_bytes=2.7e8, flops=2.2e12, roofline_us=2900.0, bound="compute")
    table = bench.format_table(doc)
    assert table.splitlines()[2].split()[9] == "compute"
    doc["ceilings"]["fp8_matmul_flops"] = 1.5e15
    doc["rows"].append({**row, "mode": "w4a8", "compute_roof": "fp8"})
    table = bench.format_table(doc)
    assert "bf16 750 TFLOP/s  fp8 1500 TFLOP/s" in table and "w4a8" in table


def test_w4a8_roofline_takes_the_fp8_rate():
    """A W4A8 row's compute roof is the card's FP8 matmul rate; every other mode's the bf16
    rate (W4A4 multiplies in bf16 on Hopper); the byte floor bounds both from below."""
    ceil = {"copy_bytes_per_s": 4e12, "bf16_matmul_flops": 1e15, "fp8_matmul_flops": 2e15}
    assert {m: roofline.compute_roof(m) for m in bench.MODES} == {
        "w4a16": "bf16", "w4a8": "fp8", "w4a4-token": "bf16", "w4a4-tensor": "bf16",
        "w4a4-static": "bf16",
    }  # fmt: skip
    flops = 4e12  # 4 ms at 1 PFLOP/s
    assert roofline.roofline_us("w4a16", 10.0, flops, ceil) == pytest.approx(4000.0)
    assert roofline.roofline_us("w4a4-token", 10.0, flops, ceil) == pytest.approx(4000.0)
    assert roofline.roofline_us("w4a8", 10.0, flops, ceil) == pytest.approx(2000.0)
    assert roofline.roofline_us("w4a8", 5000.0, flops, ceil) == 5000.0  # bytes-bound
    with pytest.raises(KeyError):  # never the bf16 rate standing in for an unmeasured FP8 one
        roofline.roofline_us("w4a8", 10.0, flops, {"bf16_matmul_flops": 1e15})
    assert roofline.bound("w4a16", 10.0, flops, ceil) == "compute"
    assert roofline.bound("w4a8", 5000.0, flops, ceil) == "bytes"
    # 5000 us of bytes against 4000 of FLOPs
    assert roofline.bound("w4a16", 5000.0, flops, ceil) == "bytes"


def test_bench_takes_w4a8():
    p = argparse.ArgumentParser()
    bench.add_arguments(p)
    assert p.parse_args(["--modes", "w4a8", "w4a16"]).modes == ["w4a8", "w4a16"]


def test_bench_without_gpu_fails_clearly(capsys):
    import torch

    if torch.cuda.is_available():
        pytest.skip("has a GPU")
    from fp4moe.cli import main

    assert main(["bench", "--num-tokens", "1"]) == 1
    assert "needs a CUDA GPU" in capsys.readouterr().err


def test_random_experts_seeded_and_static_scales():
    """The benchmarks' experts: the preset's local experts, the same weights for the same
    seed, the static W4A4 globals set (so every mode runs on them)."""
    import dataclasses

    import torch

    p = dataclasses.replace(bench.PRESETS["qwen3-30b-a3b"], hidden=64, inter=32, local_experts=3)
    torch.manual_seed(5)
    a = bench.random_experts(p, device="cpu")
    torch.manual_seed(5)
    b = bench.random_experts(p, device="cpu")
    assert (a.num_experts, a.hidden_size, a.intermediate_size) == (3, 64, 32)
    assert torch.equal(a.w13_codes, b.w13_codes) and torch.equal(a.w2_scales, b.w2_scales)
    assert a.a13_scale is not None and a.a2_scale is not None
    assert torch.allclose(a.a2_scale, a.a13_scale * 0.1)


def test_round_orders_rotate():
    assert bench.round_orders(["a", "b", "c"], 4) == [
        ["a", "b", "c"],
        ["b", "c", "a"],
        ["c", "a", "b"],
        ["a", "b", "c"],
    ]
    assert bench.round_orders([], 3) == []
    with pytest.raises(ValueError, match="rounds"):
        bench.round_orders(["a"], 0)


class _FakeTimer:
    """Stands for GraphTimer: a 'card' whose clock slows by 1 us each sample it runs, so
    a configuration timed after another pays for its drift."""

    log: ClassVar[list] = []
    clock: ClassVar[list] = [0.0]

    def __init__(self, fn, *, graph, warmup, reps=1):
        self.base = fn()

    def sample(self, n):
        out = []
        for _ in range(n):
            self.clock[0] += 1.0
            out.append(self.base + self.clock[0])
            _FakeTimer.log.append(self.base)
        return out


def test_time_interleaved_spreads_the_drift():
    fns = {"slow": lambda: 100.0, "fast": lambda: 10.0, "mid": lambda: 50.0}
    _FakeTimer.log, _FakeTimer.clock = [], [0.0]
    us = bench.time_interleaved(fns, graph=True, warmup=1, iters=10, rounds=5, timer=_FakeTimer)
    assert len(_FakeTimer.log) == 30  # iters samples each
    assert [_FakeTimer.log.count(b) for b in (100.0, 10.0, 50.0)] == [10, 10, 10]
    # each configuration sampled in every round: the drift (1 to 30 us) falls on all alike
    drift = {k: us[k] - fns[k]() for k in fns}
    assert max(drift.values()) - min(drift.values()) <= 5.0, drift  # in sequence: 20
    # in sequence (one round) the last configuration pays the whole drift
    _FakeTimer.log, _FakeTimer.clock = [], [0.0]
    seq = bench.time_interleaved(fns, graph=True, warmup=1, iters=10, timer=_FakeTimer)
    assert seq["mid"] - 50.0 > seq["slow"] - 100.0 + 15
    with pytest.raises(ValueError, match="iters"):
        bench.time_interleaved(fns, graph=True, warmup=1, iters=0, timer=_FakeTimer)


def test_cold_copies_outgrow_the_l2():
    """--cold-l2's copies: at least two, twice the L2's bytes and one more, each a clone
    (its own storage, the same bits)."""
    w13, w2 = random_moe_weights(2, 64, 32, seed=5)
    ex = fp4moe.prepare_experts(w13, w2)
    assert len(bench.cold_copies(ex, l2_bytes=1)) == 2
    copies = bench.cold_copies(ex, l2_bytes=3 * ex.nbytes())
    assert len(copies) == 7 and copies[0] is ex
    for c in copies[1:]:
        assert c.w13_codes.data_ptr() != ex.w13_codes.data_ptr()
        for k, v in ex.tensors().items():
            assert torch.equal(c.tensors()[k].view(torch.uint8), v.view(torch.uint8)), k


def test_hold_covers_the_submission():
    """The GPU wait before a timed replay: four times the host's submission, at least
    HOLD_MIN_US, in cycles at 2.1 GHz (so at least that long on any Hopper clock)."""
    assert bench.hold_cycles(0.0) == bench.hold_cycles(1.0) == int(bench.HOLD_MIN_US * 2100)
    assert bench.hold_cycles(30.0) == 120 * 2100
    assert bench.hold_cycles(100.0) > bench.hold_cycles(30.0)


@pytest.mark.gpu
def test_graph_timer_holds_graph_replays_only():
    """A captured call's timed replays wait behind a hold of at least HOLD_MIN_US; eager
    calls none; both return one positive time a sample."""
    x = torch.ones(1 << 20, device="cuda")
    g = bench.GraphTimer(lambda: x.mul_(1.0), graph=True, warmup=1, reps=2)
    assert g.hold_cycles >= bench.HOLD_MIN_US * 2100
    e = bench.GraphTimer(lambda: x.mul_(1.0), graph=False, warmup=1)
    assert e.hold_cycles == 0
    for t in (g, e):
        us = t.sample(3)
        assert len(us) == 3 and all(0 < u < 1e5 for u in us)
    assert bool((x == 1).all())


def test_rounds_flag():
    p = argparse.ArgumentParser()
    bench.add_arguments(p)
    assert p.parse_args([]).rounds == 5
    assert p.parse_args(["--rounds", "2"]).rounds == 2
    with pytest.raises(SystemExit):
        p.parse_args(["--rounds", "0"])


def test_source_digest_names_the_code(tmp_path, monkeypatch):
    """``source_sha`` in the bench's JSON: 12 hex digits over the package's sources,
    stable from call to call and changed by a change to any source file."""
    import shutil

    import fp4moe

    d = bench._source_digest()
    assert len(d) == 12 and int(d, 16) >= 0 and bench._source_digest() == d
    pkg = tmp_path / "fp4moe"
    shutil.copytree(os.path.dirname(fp4moe.__file__), pkg)
    monkeypatch.setattr(bench, "__file__", str(pkg / "bench.py"))
    assert bench._source_digest() == d  # the same bytes elsewhere: the same digest
    with open(pkg / "kernels" / "sort.py", "a") as f:
        f.write("\n# changed\n")
    assert bench._source_digest() != d
