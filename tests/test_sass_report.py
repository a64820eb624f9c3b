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
    head = rows[0]
    assert head[:4] == ["tokens", "mode", "gemm", "kernel"]
    fc1, fc2 = rows[1], rows[2]
    assert fc1[3] == "gluon-split" and fc2[3] == "gluon-whole"  # FC2: K 768, one segment
    # the kernel column's words: "gluon-split (8 rows, K split 2)", "gluon-whole (8 rows)"
    for r, programs in ((fc1, 12 * 2 * 8), (fc2, 32 * 8)):
        col = dict(zip(head[4:], r[len(r) - len(head) + 4 :], strict=True))
        regs, stack, mma, lop3 = (int(col[c]) for c in ("regs", "stack", "mma", "lop3"))
        assert 32 <= regs <= 255 and stack == 0 and mma > 0 and lop3 > 0, r
        # the decode kernels decode the next unit while the last unit's wgmmas run (whole
        # K: 22% with a stage's units held in registers)
        assert 20 <= int(col["ovl%"]) <= 100, r
        # instructions a decoded weight: the decode alone is 1.625 on the fields layout
        # (unrolled kernels: the whole kernel's count, its prologue and epilogue in it)
        assert 1.625 < float(col["ins/w"]) < 6, r
        # 1 token, top-8, every route valid: 8 experts of one row each, so FC1 runs 12
        # weight tiles x 2 K segments x 8 blocks and FC2 32 tiles x 8 blocks
        per_sm = int(col["/SM"])
        assert 1 <= per_sm <= 32, r
        assert float(col["waves"]) == round(programs / (per_sm * 132), 2), r
    # ptxas serializes the gated 8-row tiles' wgmmas under their register cap (C7512;
    # docs/performance.md says so), and keeps the whole-K FC2's asynchronous
    assert dict(zip(head, fc1[-len(head) :], strict=True))["wgmma"] == "serial", fc1
    assert dict(zip(head, fc2[-len(head) :], strict=True))["wgmma"] == "async", fc2
