"""benchmarks/fit_tile_cost.py: the prefill kernel's tile costs fit to sweeps (the fit runs
here on sweep.json documents; the sweeps run on a GPU)."""

import json
import os
import subprocess
import sys

TOOL = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "benchmarks",
                    "fit_tile_cost.py")  # fmt: skip


def _rows(tokens, tiles, us64, other, us_other):
    return [dict(tokens=tokens, mode="w4a16", gemm=g, us=us, tiles=tiles, over_planner=1.0)
            for g, us in (("planner", us64), ("gluon-prefill@64", us64),
                          (f"gluon-prefill@{other}", us_other))]  # fmt: skip


def _run(*args):
    return subprocess.run([sys.executable, TOOL, *map(str, args)], capture_output=True,
                          text=True, timeout=60)  # fmt: skip


def test_fit_tile_cost_128(tmp_path):
    # 128-row tiles win where 8 of them replace 16 64-row ones, lose at 13 against 21: a
    # cost from 21/13 = 1.615 to 2 picks the faster at both
    doc = {"preset": "mixtral-8x7b", "fused": False,
           "rows": [*_rows(320, {"32": 30, "64": 16, "128": 8}, 760.0, 128, 690.0),
                    *_rows(512, {"32": 40, "64": 21, "128": 13}, 1082.0, 128, 1188.0),
                    dict(tokens=640, mode="w4a16", gemm="gluon-prefill@64", us=1.0)]}  # fmt: skip
    path = tmp_path / "sweep.json"
    path.write_text(json.dumps(doc))
    out = _run(path, "--costs", 1.5, 2.1, 0.02)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0].startswith("2 points")  # the 640-token row has one pin and no tiles
    by_cost = {line.split()[0]: line for line in lines[1:-1]}
    assert "mixtral-8x7b 512 9.8%" in by_cost["1.600"]  # picks 128 rows at 512: 1188/1082
    assert "mixtral-8x7b 320 10.1%" in by_cost["2.000"]  # picks 64 rows at 320: 760/690
    assert lines[-1] == "least summed loss: 1.620 (0.000)"


def test_fit_tile_cost_32(tmp_path):
    # 32-row tiles win where 32 of them replace 32 64-row ones (16 rows an expert), lose
    # where 60 replace 32: a cost below 32/60 = 0.533 picks 32 rows at both, one from 0.54
    # to 1 at neither, one above 1 at both
    doc = {"preset": "deepseek-v3-ep8",
           "rows": [*_rows(512, {"32": 32, "64": 32, "128": 32}, 451.0, 32, 363.0),
                    *_rows(1024, {"32": 60, "64": 32, "128": 32}, 466.0, 32, 600.0)]}  # fmt: skip
    path = tmp_path / "sweep.json"
    path.write_text(json.dumps(doc))
    out = _run(path, "--rows", 32, "--costs", 0.5, 1.1, 0.1)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    by_cost = {line.split()[0]: line for line in lines[1:-1]}
    assert "deepseek-v3-ep8 1024 28.8%" in by_cost["0.500"]  # 600 / 466
    assert "deepseek-v3-ep8 512 24.2%" in by_cost["1.100"]  # 451 / 363
    assert lines[-1].startswith("least summed loss: 0.600 (0.000)")


def test_fit_tile_cost_no_points(tmp_path):
    path = tmp_path / "sweep.json"
    path.write_text(json.dumps({"preset": "qwen3-30b-a3b",
                                "rows": _rows(64, None, 1, 128, 2)[:1]}))  # fmt: skip
    out = _run(path)
    assert out.returncode == 1 and "no point" in out.stderr
