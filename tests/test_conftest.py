"""The test set-up's own behaviour (tests/conftest.py), in pytest runs of a scratch folder."""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

FAKE = """
def test_a_loses():
    raise RuntimeError("Triton Error [CUDA]: an illegal memory access was encountered")

def test_b():
    pass

def test_c():
    pass
"""


def _run(tmp_path: Path, *args: str) -> tuple[int, str]:
    """(exit code, stdout and stderr) of a pytest run of the fake tests with this conftest.
    The output's CUDA error is reworded: a failure here, which shows it, must not read as a
    lost CUDA context to this run's own conftest."""
    shutil.copy(Path(__file__).with_name("conftest.py"), tmp_path / "conftest.py")
    (tmp_path / "test_fake.py").write_text(FAKE)
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}
    r = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", *args],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    return r.returncode, (r.stdout + r.stderr).replace("illegal memory access", "illegal (...)")


def test_lost_cuda_context_skips_the_rest(tmp_path):
    """After a test fails with a context-losing CUDA error, the process's later tests are
    skipped, naming that test, instead of failing for it; the run still fails."""
    rc, out = _run(tmp_path, "-p", "no:xdist")
    assert rc == 1, out
    assert "1 failed, 2 skipped" in out, out
    assert "the CUDA context was lost in test_fake.py::test_a_loses" in out, out


def test_lost_cuda_context_xdist_worker_restarts(tmp_path):
    """Under pytest-xdist the worker leaves after the test that lost its context is
    reported; a new worker runs the rest."""
    if importlib.util.find_spec("xdist") is None:
        pytest.skip("pytest-xdist is not installed (it is on the GPU machine)")
    rc, out = _run(tmp_path, "-n", "1")
    assert rc == 1, out
    assert "2 passed" in out and "skipped" not in out, out
    assert "test_a_loses" in out and "crashed" in out, out
