"""The Triton backend's public options: what a user legitimately sets for a call."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["KERNELS", "InapplicableOverride", "Options", "Tile"]

# The GEMM kernel families the planner chooses among (``Plan.fc1.kernel``):
KERNELS = (
    "gluon-split",  # Hopper, decode sizes: one program a (64 weight rows, 1024-K segment,
    # 8- or 16-row block) unit, weights by TMA and decoded in registers, split-K partials
    # summed by the tile's last program
    "gluon-whole",  # Hopper, middle sizes: a program takes every K segment of its 16- or
    # 32-row block's tile, no partials
    "gluon-prefill",  # Hopper, prefill sizes: persistent programs over 128 x 128 tiles
    "triton-split",  # portable Triton loop, split K (few rows an expert)
    "triton",  # portable Triton loop, the whole K a program
    "triton-dense",  # portable: the weights decoded to bf16 once a call, then a bf16 GEMM
)


class InapplicableOverride(ValueError):
    """An override in ``Options`` (a pinned kernel or tile) that cannot serve this call."""


def _pow2(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v > 0 and v & (v - 1) == 0


@dataclass(frozen=True)
class Tile:
    """A pinned tile of the portable Triton GEMM (``Options.fc1_tile`` / ``fc2_tile``).

    block_m: token rows a tile, the route sort's rows a block (8 to 128; both GEMMs of a
        call share it; a pinned tile needs at least 16). block_n: weight rows a tile.
        block_k: K elements a step (32 to 256, dividing 1024). num_warps, num_stages: the
        Triton launch's. Any tile gives the same bits; the Gluon kernels use block_m and
        their own tile shapes.
    """

    block_m: int
    block_n: int
    block_k: int
    num_warps: int = 4
    num_stages: int = 3

    def __post_init__(self) -> None:
        for name in ("block_m", "block_n", "block_k", "num_warps"):
            v = getattr(self, name)
            if not _pow2(v):
                raise ValueError(f"Tile.{name}: expected a power of two, got {v!r}")
        if not 8 <= self.block_m <= 128:
            raise ValueError(f"Tile.block_m: expected 8 to 128, got {self.block_m}")
        if not 32 <= self.block_k <= 256:
            raise ValueError(f"Tile.block_k: expected 32 to 256, got {self.block_k}")
        if not 16 <= self.block_n <= 256:
            raise ValueError(f"Tile.block_n: expected 16 to 256, got {self.block_n}")
        s = self.num_stages
        if isinstance(s, bool) or not isinstance(s, int) or not 1 <= s <= 8:
            raise ValueError(f"Tile.num_stages: expected an int from 1 to 8, got {s!r}")


@dataclass(frozen=True)
class Options:
    """Options of the Triton backend for ``fp4moe.moe(..., options=...)``. Every option
    gives the same bits (except ``poison``'s unwritten elements, which a correct call has
    none of).

    Args:
        pdl: programmatic dependent launch between consecutive kernels (None: on for
            CUDA devices of compute capability 9 and newer; never in the interpreter).
        valid_fraction: the expected fraction of a call's routes that are valid (not
            masked). Expert parallelism by masking over R ranks with balanced routing:
            1 / R. None (unknown): 1/6. The planner reads the expected valid rows an
            expert from it (``Plan.valid_rows``).
        fc1_tile, fc2_tile: pin the portable GEMM's tile (``Tile``); both or neither, with
            one block_m. The planner then keeps the portable kernels' choices off the
            Gluon tile shapes.
        gemm: pin the kernel family of both GEMMs (one of ``KERNELS``; "triton-split"
            splits each GEMM of more than one 1024-element K segment), for tests and
            benchmarks; a call it cannot serve raises ``InapplicableOverride``.
        poison: fill every workspace and the output with NaN (0xFF bytes for codes and
            scales) before the kernels run, so tests see any element no kernel wrote.
    """

    pdl: bool | None = None
    valid_fraction: float | None = None
    fc1_tile: Tile | None = None
    fc2_tile: Tile | None = None
    gemm: str | None = None
    poison: bool = False

    def __post_init__(self) -> None:
        if self.pdl is not None and not isinstance(self.pdl, bool):
            raise TypeError(f"pdl: expected None or a bool, got {self.pdl!r}")
        f = self.valid_fraction
        if f is not None and (
            isinstance(f, bool) or not isinstance(f, (int, float)) or not 0 < f <= 1
        ):
            raise ValueError(f"valid_fraction: expected None or a number in (0, 1], got {f!r}")
        for name in ("fc1_tile", "fc2_tile"):
            t = getattr(self, name)
            if t is not None and not isinstance(t, Tile):
                raise TypeError(f"{name}: expected None or fp4moe.Tile, got {type(t).__name__}")
            if t is not None and t.block_m < 16:
                # Triton's dot below 16 token columns is not the main loop's MMA: other bits
                raise ValueError(f"{name}: block_m must be at least 16, got {t.block_m}")
        if (self.fc1_tile is None) != (self.fc2_tile is None):
            raise ValueError("fc1_tile, fc2_tile: pin both tiles or neither")
        if self.fc1_tile is not None and self.fc1_tile.block_m != self.fc2_tile.block_m:
            raise ValueError(
                f"fc1_tile, fc2_tile: one block_m for both (one tile schedule), got "
                f"{self.fc1_tile.block_m} and {self.fc2_tile.block_m}"
            )
        if self.gemm is not None and self.gemm not in KERNELS:
            raise ValueError(f"gemm: expected None or one of {KERNELS}, got {self.gemm!r}")
        if not isinstance(self.poison, bool):
            raise TypeError(f"poison: expected a bool, got {self.poison!r}")
