"""benchmarks/sass_report.py compiles the grouped GEMM for sm_90 on a machine without a
GPU (Triton's bundled ptxas) and reads its SASS: the tool the perf notes rely on. It runs
in a subprocess: this test process has the kernels imported for the interpreter."""

import os
import subprocess
import sys

import pytest

TOOL = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "benchmarks",
                    "sass_report.py")  # fmt: skip


def _run(*args: str) -> list[list[str]]:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, TOOL, *args], capture_output=True, text=True,
                         env=env, timeout=300)  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    return [line.split() for line in out.stdout.splitlines()]


def test_sass_report_reads_the_main_loop():
    pytest.importorskip("triton")
    rows = _run("--preset", "qwen3-30b-a3b", "--gemm", "fc1", "--loop", "0", "2",
                "--config", "16,64,128,4,1")  # fmt: skip
    assert rows[0][:4] == ["gemm", "loop", "config", "regs"]
    by_loop = {r[1]: r for r in rows[1:]}
    assert set(by_loop) == {"0", "2"}
    for r in by_loop.values():
        regs, spill, ipw = int(r[3]), int(r[4]), float(r[5])
        assert 32 <= regs <= 255 and spill == 0
        assert 2.0 < ipw < 20.0
    # The chunk-ordered loop with the inline-PTX decode needs fewer instructions a weight.
    assert float(by_loop["2"][5]) < float(by_loop["0"][5])
    assert any(t.startswith("HMUL2:") for t in by_loop["2"][8:])  # the bf16x2 scale fma


def test_unit_order_loop_and_register_cap():
    """Loop 3's split FC1 at the default decode config (DeepSeek-V3 shapes): the unit order
    keeps it under 4.5 SASS instructions a weight (5.64 in the chunk order), and a
    register cap of 80 (GemmConfig.maxnreg) holds with no spill."""
    pytest.importorskip("triton")
    for cap in (None, 80):
        args = ["--gemm", "fc1", "--loop", "3", "--split", "--config", "16,64,128,4,3"]
        if cap:
            args += ["--maxnreg", str(cap)]
        rows = _run(*args)
        regs, spill, ipw = int(rows[1][3]), int(rows[1][4]), float(rows[1][5])
        assert spill == 0 and ipw < 4.5, rows[1]
        if cap:
            assert regs <= cap, rows[1]


def test_fused_amax_epilogue_compiles_for_sm90():
    """FC1 with the per-tensor amax in its epilogue (TritonOptions.fused_amax), split and
    not, W4A4 and W4A16 operands: compiles for sm_90, no spill, and leaves the main loop as
    it was (instructions a weight within 0.05: 3.95 against 3.94 when written)."""
    pytest.importorskip("triton")
    for split in ([], ["--split"]):
        base = ["--gemm", "fc1", "--loop", "3", "--mode", "w4a4", "--config", "16,64,128,4,3",
                *split]  # fmt: skip
        plain, fused = _run(*base)[1], _run(*base, "--out-amax")[1]
        assert int(fused[4]) == 0, fused
        assert abs(float(fused[5]) - float(plain[5])) <= 0.05, (plain, fused)


def test_blocks_last_same_main_loop():
    """The split kernel on the default (tiles, segments, blocks) grid
    (TritonOptions.blocks_last) compiles for sm_90 to the registers and main loop of the
    (tiles, blocks, segments) grid: only the program ids it reads differ."""
    pytest.importorskip("triton")
    base = ["--loop", "3", "--split", "--config", "16,64,128,4,3"]
    grid, blast = _run(*base), _run(*base, "--blocks-last")
    assert len(grid) == len(blast) == 3  # the header, FC1, FC2
    for g, b in zip(grid[1:], blast[1:]):
        assert g[3:] == b[3:], (g, b)  # registers, spill, instructions a weight, opcodes


def test_decode_layout_search():
    """benchmarks/decode_layout_search.py (perf notes, session 11): no code layout gives
    a bf16 pair register from one funnel shift and one AND over 1 or 2 words; the same
    search finds a layout where one exists (a target whose shifts tile a word)."""
    import importlib.util

    path = os.path.join(os.path.dirname(TOOL), "decode_layout_search.py")
    spec = importlib.util.spec_from_file_location("decode_layout_search", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    for words in (1, 2):
        found, nodes = mod.exact_cover(words)
        assert found is None and nodes < 2_000_000  # exhaustive: none exists
    mod.TARGET = (0, 1, 2, 3, 16, 17, 18, 19)  # four shifts (0, 4, 8, 12) tile a word
    found, _ = mod.exact_cover(1)
    assert found is not None and len(found) == 4
