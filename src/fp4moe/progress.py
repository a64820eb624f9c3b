"""Progress bars for long work (loading, converting, evaluating: tqdm) and the benches'
one-line step counter, on stderr."""

from __future__ import annotations

import sys
from collections.abc import Iterable, Iterator
from typing import TypeVar

__all__ = ["progress", "step_line"]

T = TypeVar("T")


def progress(
    items: Iterable[T], *, desc: str, total: int | None = None, enabled: bool | None = None
) -> Iterator[T]:
    """``items`` with a tqdm bar on stderr. ``enabled``: True, False, or None (a bar only
    when stderr is a terminal, so logs and tests stay clean)."""
    from tqdm.auto import tqdm

    disable = None if enabled is None else not enabled
    return iter(tqdm(items, desc=desc, total=total, disable=disable, leave=False))


def step_line(i: int, n: int, label: str) -> None:
    """Step ``i`` of ``n`` (``label``) as one bar line on stderr, rewritten in place."""
    width = 30
    done = int(width * i / max(n, 1))
    sys.stderr.write(f"\r[{'#' * done}{'.' * (width - done)}] {i}/{n} {label:40s}")
    sys.stderr.flush()
