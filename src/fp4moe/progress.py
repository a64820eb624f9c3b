"""Progress bars for long work (loading, converting, evaluating): tqdm, on stderr."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import TypeVar

__all__ = ["progress"]

T = TypeVar("T")


def progress(
    items: Iterable[T], *, desc: str, total: int | None = None, enabled: bool | None = None
) -> Iterator[T]:
    """``items`` with a tqdm bar on stderr. ``enabled``: True, False, or None (a bar only
    when stderr is a terminal, so logs and tests stay clean)."""
    from tqdm.auto import tqdm

    disable = None if enabled is None else not enabled
    return iter(tqdm(items, desc=desc, total=total, disable=disable, leave=False))
