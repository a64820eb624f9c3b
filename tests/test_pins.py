"""benchmarks/pins.py: the kernel pins sweep.py and profile_call.py take (the tools
themselves time on a GPU; their argument parsing runs here)."""

import argparse
import importlib.util
import os
import subprocess
import sys

import pytest

BENCH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "benchmarks")


def _pins():
    spec = importlib.util.spec_from_file_location("pins", os.path.join(BENCH, "pins.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_pin_options():
    pins = _pins()
    opt = pins.pin_options("gluon-prefill@128", valid_fraction=0.5)
    assert (opt.gemm, opt.fc1_tile.block_m, opt.fc2_tile.block_m) == ("gluon-prefill", 128, 128)
    assert opt.valid_fraction == 0.5
    opt = pins.pin_options("triton")
    assert (opt.gemm, opt.fc1_tile, opt.fc2_tile) == ("triton", None, None)
    assert pins.pin_options(None).gemm is None
    assert pins.pin_arg("gluon-split@8") == "gluon-split@8"
    for bad in ("cutlass", "gluon-prefill@", "gluon-prefill@x"):
        with pytest.raises(argparse.ArgumentTypeError, match="optionally @ROWS"):
            pins.pin_arg(bad)


@pytest.mark.parametrize("tool", ["sweep.py", "profile_call.py"])
def test_tools_refuse_a_bad_pin(tool):
    run = subprocess.run([sys.executable, os.path.join(BENCH, tool), "--gemm", "cutlass"],
                         capture_output=True, text=True, timeout=120)  # fmt: skip
    assert run.returncode == 2 and "optionally @ROWS" in run.stderr, run.stderr[-2000:]
