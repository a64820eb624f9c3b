"""pytest set-up for every test: ``--device``, the ``gpu`` marker, the Triton interpreter.

Without CUDA, ``TRITON_INTERPRET=1`` is set here, when pytest imports this file and so before
any test module imports triton or ``fp4moe.kernels``: ``triton.jit`` reads the variable when
it decorates a kernel, and on the CPU the kernels then run in Triton's interpreter. An
explicit ``TRITON_INTERPRET`` in the environment is left as it is.

The interpreter's behaviour follows Triton's front end, so kernel tests are only trusted with
the Triton version pinned in the ``test`` extra of pyproject.toml; with any other version
they are skipped (those marked ``kernel`` or using the ``interpret`` fixture), with a warning.

A run in which no test passed is a failure (exit 5, like pytest's own "no tests collected"),
so that a mistyped path, marker or skip condition can never end green.

After a test fails with an error that loses the process's CUDA context (an illegal address,
say), the process's later tests are skipped, naming it, rather than each failing for it;
a pytest-xdist worker leaves instead, and xdist starts a new one for the rest.
"""

from __future__ import annotations

import os
import sys
import warnings
from importlib import metadata

import pytest
import torch

PINNED_TRITON = "3.6.0"  # keep in step with the `test` extra of pyproject.toml

CUDA = torch.cuda.is_available()
if not CUDA and "TRITON_INTERPRET" not in os.environ:
    if any(m == "fp4moe.kernels" or m.startswith("fp4moe.kernels.") for m in sys.modules):
        warnings.warn(
            "fp4moe.kernels was imported before tests/conftest.py set TRITON_INTERPRET=1; "
            "its kernels are compiled, not interpreted",
            stacklevel=1,
        )
    os.environ["TRITON_INTERPRET"] = "1"
INTERPRET = os.environ.get("TRITON_INTERPRET", "0").strip().lower() not in ("", "0", "false", "off")

try:
    TRITON_VERSION: str | None = metadata.version("triton")
except metadata.PackageNotFoundError:
    TRITON_VERSION = None
TRITON_OK = not INTERPRET or TRITON_VERSION == PINNED_TRITON


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--device",
        default="cpu",
        choices=("cpu", "cuda"),
        help='device the tests run on: "cpu" (default; kernels in the Triton interpreter) '
        'or "cuda" (the GPU machine)',
    )


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        "kernel: runs a Triton kernel (skipped when the interpreter's Triton "
        f"is not the pinned {PINNED_TRITON})",
    )
    if config.getoption("--device") == "cuda":
        if not CUDA:
            raise pytest.UsageError("--device cuda: no CUDA device is available here")
        if INTERPRET:
            raise pytest.UsageError(
                "--device cuda with TRITON_INTERPRET set: unset it to run the kernels on the GPU"
            )
    if not TRITON_OK:
        warnings.warn(
            f"the Triton interpreter is on with triton {TRITON_VERSION}, not the pinned "
            f"{PINNED_TRITON}: kernel tests are skipped (pip install -e '.[test]')",
            stacklevel=1,
        )


def pytest_report_header(config: pytest.Config) -> str:
    interp = f"on (TRITON_INTERPRET={os.environ.get('TRITON_INTERPRET')})" if INTERPRET else "off"
    return (
        f"fp4moe: --device {config.getoption('--device')}, CUDA available: {CUDA}, "
        f"Triton interpreter: {interp}, triton {TRITON_VERSION} (pinned {PINNED_TRITON})"
    )


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    no_gpu = pytest.mark.skip(reason="needs a CUDA GPU (run `pytest -m gpu --device cuda` there)")
    wrong_triton = pytest.mark.skip(
        reason=f"Triton interpreter with triton {TRITON_VERSION}, not the pinned {PINNED_TRITON}"
    )
    for item in items:
        if "gpu" in item.keywords and not CUDA:
            item.add_marker(no_gpu)
        is_kernel = "kernel" in item.keywords or "interpret" in getattr(item, "fixturenames", ())
        if is_kernel and not TRITON_OK:
            item.add_marker(wrong_triton)


@pytest.fixture(scope="session")
def device(request: pytest.FixtureRequest) -> str:
    """The torch device of the run: "cpu" or "cuda" (the ``--device`` option)."""
    return request.config.getoption("--device")


@pytest.fixture(scope="session")
def interpret() -> bool:
    """Whether Triton kernels run in the interpreter (TRITON_INTERPRET) in this run."""
    return INTERPRET


# ------------------------------------------------------------ a lost CUDA context

# CUDA errors after which the process's context is unusable: every later CUDA call fails
LOST_CONTEXT = (
    "illegal memory access",
    "an illegal instruction",
    "misaligned address",
    "unspecified launch failure",
    "device-side assert",
)
_lost_at: str | None = None  # the test that lost this process's CUDA context


def lost_context(text: str) -> bool:
    """Whether an error message is one of CUDA's context-losing errors (``LOST_CONTEXT``)."""
    return any(m in text for m in LOST_CONTEXT)


def pytest_runtest_setup(item: pytest.Item) -> None:
    # after a test lost the CUDA context, the rest would fail for it, hiding what fails
    # on its own: they are skipped, naming that test
    if _lost_at is not None:
        pytest.skip(f"the CUDA context was lost in {_lost_at}; run this test in a new process")


@pytest.hookimpl(trylast=True)
def pytest_runtest_logfinish(nodeid: str, location) -> None:
    # a pytest-xdist worker leaves once the test that lost its context is reported: xdist
    # reports it as crashed too and starts a new worker for the tests still to run
    if _lost_at == nodeid and os.environ.get("PYTEST_XDIST_WORKER"):
        sys.stderr.flush()
        os._exit(3)


# ------------------------------------------------------------------ no green empty runs

_passed = 0  # tests passed in this session


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    global _passed, _lost_at
    if report.when == "call" and report.passed:
        _passed += 1
    if _lost_at is None and report.failed and lost_context(report.longreprtext):
        _lost_at = report.nodeid


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    # With nothing collected pytest itself exits 5; this catches collected-but-none-ran.
    if session.config.option.collectonly or session.testscollected == 0:
        return
    if exitstatus == pytest.ExitCode.OK and _passed == 0:
        session.exitstatus = pytest.ExitCode.NO_TESTS_COLLECTED
        sys.stderr.write(
            f"\nfp4moe: no test passed ({session.testscollected} collected, all skipped); "
            "failing the run (exit 5) so that an empty run never passes\n"
        )


@pytest.fixture(scope="module")
def gpu_experts():
    """``get(name)``: PreparedExperts of the ``test_kernels.GPU_SHAPES`` shape ``name`` on
    the GPU (seed 0), made once a module."""
    from test_kernels import GPU_SHAPES, _experts

    cache = {}

    def get(name):
        if name not in cache:
            e, h, i, _, _ = GPU_SHAPES[name]
            cache[name] = _experts(e, h, i, seed=0, device="cuda")
        return cache[name]

    return get
