"""benchmarks/peers_table.py: one markdown table from an ``fp4moe bench`` JSON and a peers
CSV of the same call (the merge runs here; the GPU run is ``gpu.sh peers``)."""

import csv
import json
import os
import subprocess
import sys

TOOL = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "benchmarks",
                    "peers_table.py")  # fmt: skip


def _row(t, mode, us, frac, fc1="gluon-prefill (64 rows)", fc2=None):
    plan = {"fc1": fc1, "fc2": fc2 or fc1}
    return dict(tokens=t, mode=mode, finalize="unfused", us=us, roofline_fraction=frac,
                plan=plan)  # fmt: skip


def test_peers_table(tmp_path):
    bench = {
        "preset": "qwen3-30b-a3b", "device": "NVIDIA H200",
        "ceilings": {"copy_bytes_per_s": 4.24e12, "bf16_matmul_flops": 7.27e14},
        "rows": [
            _row(1, "w4a16", 29.3, 0.17, "gluon-split (16 rows)", "triton (16x64x128)"),
            _row(1, "w4a4-token", 32.2, 0.15, "gluon-split (16 rows)", "triton (16x64x128)"),
            _row(1024, "w4a16", 515.0, 0.21),
            dict(_row(1024, "w4a16", 400.0, 0.3), finalize="fused"),  # left out
        ],
    }  # fmt: skip
    bj, pc = tmp_path / "bench.json", tmp_path / "peers.csv"
    bj.write_text(json.dumps(bench))
    with open(pc, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["tokens", "local_routes", "experts_touched", "peer", "us", "rel_err"])
        w.writerow([1, 8, 8, "tk-mxfp4", 142.8, 3e-3])
        w.writerow([1024, 8192, 128, "tk-mxfp4", 495.6, 3e-3])
    out = subprocess.run([sys.executable, TOOL, str(bj), str(pc)], capture_output=True,
                         text=True, timeout=60)  # fmt: skip
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0].startswith("qwen3-30b-a3b: copy 4.24 TB/s, bf16 727 TFLOP/s")
    assert lines[2].split(" | ")[4:6] == ["tk-mxfp4 us", "vs tk-mxfp4"]
    rows = [[c.strip() for c in ln.strip("|").split("|")] for ln in lines[4:]]
    assert rows[0] == ["1", "29.3", "1.10", "0.17", "142.8", "4.87x",
                       "gluon-split (16 rows) / triton (16x64x128)"]  # fmt: skip
    assert rows[1] == ["1024", "515.0", "-", "0.21", "495.6", "0.96x", "gluon-prefill (64 rows)"]
    assert len(rows) == 2
