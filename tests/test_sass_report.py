"""benchmarks/sass_report.py compiles the kernels of a plan for sm_90 on a machine without
a GPU (Triton's bundled ptxas) and reads their SASS. It runs in a subprocess: this test
process has the kernels imported for the interpreter."""

import os
import subprocess
import sys

import pytest

TOOL = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "benchmarks",
                    "sass_report.py")  # fmt: skip


def test_sass_report_reads_the_planned_kernels():
    pytest.importorskip("triton")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, TOOL, "--preset", "qwen3-30b-a3b", "--num-tokens",
                          "1"], capture_output=True, text=True, env=env, timeout=600)  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    rows = [line.split() for line in out.stdout.splitlines()]
    assert rows[0][:4] == ["tokens", "mode", "gemm", "kernel"]
    fc1, fc2 = rows[1], rows[2]
    assert fc1[3] == "gluon-split" and fc2[3] == "gluon-whole"  # FC2: K 768, one segment
    for r in (fc1, fc2):
        regs, stack, mma, lop3 = int(r[-11]), int(r[-10]), int(r[-7]), int(r[-6])
        assert 32 <= regs <= 255 and stack == 0 and mma > 0 and lop3 > 0, r
        # the decode kernels decode the next unit while the last unit's wgmmas run (whole
        # K: 22% with a stage's units held in registers)
        assert 20 <= int(r[-2]) <= 100, r
        # instructions a decoded weight: the decode alone is 1.625 on the fields layout
        # (unrolled kernels: the whole kernel's count, its prologue and epilogue in it)
        assert 1.625 < float(r[-1]) < 6, r
