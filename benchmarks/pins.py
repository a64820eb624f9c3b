"""The kernel pins the benchmark tools take (``sweep.py --gemm``, ``profile_call.py
--gemm``): a kernel family of ``fp4moe.backend.KERNELS``, optionally ``@ROWS`` to pin the
tiles' rows too (``gluon-prefill@128``)."""

from __future__ import annotations

import argparse

from fp4moe import Options, Tile
from fp4moe.backend import KERNELS


def pin_arg(v: str) -> str:
    """argparse type of a pin: ``KERNEL`` or ``KERNEL@ROWS``."""
    kernel, at, bm = v.partition("@")
    if kernel not in KERNELS or (at and not bm.isdigit()):
        raise argparse.ArgumentTypeError(f"expected one of {KERNELS}, optionally @ROWS: {v!r}")
    return v


def pin_options(pin: str | None, **kw) -> Options:
    """``Options(**kw)`` with both GEMMs on the pin's kernel family, and with ``@ROWS``
    both tiles of that many rows (None: the planner's choice)."""
    kernel, _, rows = (pin or "").partition("@")
    tile = Tile(int(rows), 128, 64, 8, 3) if rows else None
    return Options(gemm=kernel or None, fc1_tile=tile, fc2_tile=tile, **kw)
