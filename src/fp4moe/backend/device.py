"""What the planner knows of the device: the hardware queries in one place."""

from __future__ import annotations

import functools
import os
import warnings
from dataclasses import dataclass

import torch

__all__ = ["GLUON_TRITON", "H200", "Target", "gluon_supported", "target_for"]

# The Triton release line the Gluon kernels are written for and tested with. Gluon is
# Triton's experimental API and changes between releases, so with another Triton every
# GEMM stays on the portable Triton kernels (a one-time warning says so).
GLUON_TRITON = "3.6."


@dataclass(frozen=True)
class Target:
    """The device facts a plan depends on.

    name: for display. interpret: kernels run in Triton's interpreter. gluon: the Gluon
    kernels run (a Hopper GPU, compute capability 9.x, with a supported Triton). pdl:
    programmatic dependent launch is available (compute capability 9 and newer). sm_count:
    the device's SMs. sort_kernel: the route-sort kernel can run (CUDA or interpreter)."""

    name: str
    interpret: bool
    gluon: bool
    pdl: bool
    sm_count: int
    sort_kernel: bool = True


# The plan `fp4moe plan` shows on a machine without a GPU.
H200 = Target("NVIDIA H200", interpret=False, gluon=True, pdl=True, sm_count=132)


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


@functools.cache
def gluon_supported() -> bool:
    """Whether this Triton runs the Gluon kernels (the ``GLUON_TRITON`` line, and the
    kernels import); warns once when it does not."""
    import triton

    if not triton.__version__.startswith(GLUON_TRITON):
        reason = f"triton {triton.__version__} is not the tested {GLUON_TRITON}x"
    else:
        try:
            from ..kernels.gemm import gluon_decode, gluon_prefill  # noqa: F401
        except Exception as exc:  # an incompatible Gluon
            reason = f"the Gluon kernels do not import ({type(exc).__name__}: {exc})"
        else:
            return True
    warnings.warn(
        f"fp4moe: {reason}; the GEMMs run on the portable Triton kernels (slower on Hopper)",
        RuntimeWarning,
        stacklevel=3,
    )
    return False


@functools.cache
def _cuda_target(index: int) -> Target:
    props = torch.cuda.get_device_properties(index)
    major = props.major
    return Target(
        props.name,
        interpret=False,
        gluon=major == 9 and gluon_supported(),
        pdl=major >= 9,
        sm_count=props.multi_processor_count,
    )


def target_for(device: torch.device | str | None) -> Target:
    """The ``Target`` of a call on ``device``: the interpreter's when
    ``TRITON_INTERPRET=1``, else the CUDA device's (queried once a device)."""
    if _interpreting():
        return Target("Triton interpreter", interpret=True, gluon=False, pdl=False,
                      sm_count=1)  # fmt: skip
    dev = torch.device(device) if device is not None else torch.device("cuda")
    if dev.type != "cuda":
        raise RuntimeError(
            "backend: 'triton' needs a CUDA device (or TRITON_INTERPRET=1 for the "
            f"interpreter); the tensors are on {dev}. Use backend='reference' or 'auto' here."
        )
    index = dev.index if dev.index is not None else torch.cuda.current_device()
    return _cuda_target(index)
