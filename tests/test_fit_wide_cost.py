"""benchmarks/fit_wide_cost.py: the prefill kernel's tile cost fit to sweeps (the fit runs
here on sweep.json documents; the sweeps run on a GPU)."""

import json
import os
import subprocess
import sys

TOOL = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "benchmarks",
                    "fit_wide_cost.py")  # fmt: skip


def _rows(tokens, tiles, us64, us128):
    return [dict(tokens=tokens, mode="w4a16", gemm=g, us=us, tiles=tiles, over_planner=1.0)
            for g, us in (("planner", us64), ("gluon-prefill@64", us64),
                          ("gluon-prefill@128", us128))]  # fmt: skip


def _run(*args):
    return subprocess.run([sys.executable, TOOL, *map(str, args)], capture_output=True,
                          text=True, timeout=60)  # fmt: skip


def test_fit_wide_cost(tmp_path):
    # 128-row tiles win where 8 of them replace 16 64-row ones, lose at 13 against 21: a
    # cost from 21/13 = 1.615 to 2 picks the faster at both
    doc = {"preset": "mixtral-8x7b", "fused": False,
           "rows": [*_rows(320, {"64": 16, "128": 8}, 760.0, 690.0),
                    *_rows(512, {"64": 21, "128": 13}, 1082.0, 1188.0),
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


def test_fit_wide_cost_no_points(tmp_path):
    path = tmp_path / "sweep.json"
    path.write_text(json.dumps({"preset": "qwen3-30b-a3b", "rows": _rows(64, None, 1, 2)[:1]}))
    out = _run(path)
    assert out.returncode == 1 and "no point" in out.stderr
