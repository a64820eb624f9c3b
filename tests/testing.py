"""Shared test helpers: THE tolerances of numerics section 8 and realistic random inputs.

Import from test files as ``from testing import ...`` (pytest's default "prepend" import
mode puts ``tests/`` on ``sys.path``). Every numeric tolerance a test compares a fast path
against the reference with lives here, in one place.
"""

from __future__ import annotations

import math

import torch

from fp4moe.modes import TOLERANCE

__all__ = [
    "TOL",
    "assert_close_moe",
    "nan_empty",
    "poison_like",
    "random_moe_weights",
    "random_routes",
    "random_x",
    "rel_err",
]

# numerics section 8: ||out - ref|| / ||ref|| for route rows and outputs, kernel against reference
TOL: dict[str, float] = TOLERANCE


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref||_F / ||ref||_F computed in float64 (0 when both are exactly zero)."""
    o = out.detach().to("cpu", torch.float64)
    r = ref.detach().to("cpu", torch.float64)
    num = torch.linalg.vector_norm(o - r).item()
    den = torch.linalg.vector_norm(r).item()
    if den == 0.0:
        return 0.0 if num == 0.0 else math.inf
    return num / den


def assert_close_moe(out: torch.Tensor, ref: torch.Tensor, mode: str, *, what: str = "out") -> None:
    """Assert ``out`` matches ``ref`` within numerics section 8 tolerance of ``mode``.

    Fails on a shape or dtype mismatch, on any NaN in ``out`` (an element never written into
    a NaN-poisoned buffer shows up this way), on Inf, and on a relative Frobenius error above
    ``TOL[mode]``. ``mode`` is "w4a16", "w4a8" or "w4a4" (any activation-scale variant).
    """
    tol = TOL[mode]
    assert out.shape == ref.shape, f"{what}: shape {tuple(out.shape)}, reference {tuple(ref.shape)}"
    assert out.dtype == ref.dtype, f"{what}: dtype {out.dtype}, reference {ref.dtype}"
    o = out.detach().to("cpu", torch.float64)
    r = ref.detach().to("cpu", torch.float64)
    assert not torch.isnan(r).any(), f"{what}: the reference itself holds NaN"
    nan = torch.isnan(o)
    if nan.any():
        idx = nan.nonzero()
        raise AssertionError(
            f"{what}: {int(nan.sum())} of {o.numel()} elements are NaN (never written, or a "
            f"NaN computed); first at index {tuple(idx[0].tolist())}"
        )
    inf = torch.isinf(o) & ~torch.isinf(r)
    assert not inf.any(), f"{what}: {int(inf.sum())} elements are Inf where the reference is finite"
    err = rel_err(o, r)
    if err > tol:
        diff = (o - r).abs()
        worst = tuple(torch.nonzero(diff == diff.max())[0].tolist()) if diff.numel() else ()
        raise AssertionError(
            f"{what}: relative error {err:.3e} above the {mode} tolerance {tol:.0e}; "
            f"max abs diff {diff.max().item():.3e} at {worst} "
            f"(out {o[worst].item():.6g}, ref {r[worst].item():.6g}); "
            f"||ref|| = {torch.linalg.vector_norm(r).item():.4g}"
        )


def nan_empty(
    shape: tuple[int, ...] | torch.Size,
    dtype: torch.dtype = torch.bfloat16,
    device: torch.device | str = "cpu",
) -> torch.Tensor:
    """``torch.empty`` filled with NaN, so that an element a kernel never writes shows up."""
    return torch.full(tuple(shape), float("nan"), dtype=dtype, device=device)


def poison_like(t: torch.Tensor) -> torch.Tensor:
    """A tensor like ``t`` filled with NaN (floating dtypes) or all-ones bits (integers)."""
    if t.dtype.is_floating_point:
        return torch.full_like(t, float("nan"))
    return torch.full_like(t, -1) if t.dtype.is_signed else torch.full_like(t, 255)


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _realistic(shape: tuple[int, ...], g: torch.Generator, outliers: bool) -> torch.Tensor:
    """Gaussian [..., R, C] times per-row and per-column scales, plus a few outlier columns."""
    *lead, r, c = shape
    w = torch.randn(shape, generator=g)
    row = torch.exp(0.5 * torch.randn((*lead, r, 1), generator=g))
    col = torch.exp(0.5 * torch.randn((*lead, 1, c), generator=g))
    w = w * row * col
    if outliers:
        n = max(1, c // 64)
        cols = torch.randint(0, c, (n,), generator=g)
        boost = 8.0 + 24.0 * torch.rand((n,), generator=g)
        w[..., cols] = w[..., cols] * boost
    return w


def random_moe_weights(
    E: int,
    H: int,
    I: int,  # noqa: E741 (the contract's name)
    *,
    seed: int,
    dtype: torch.dtype = torch.float32,
    outliers: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Realistic SwiGLU expert weights on the CPU.

    Returns:
        (w13 [E, 2I, H], w2 [E, H, I]) of ``dtype``, roughly of scale 1/sqrt(fan-in), with
        per-row and per-column scale variation, a few large outlier columns when
        ``outliers``, and gate and up halves of different magnitude (each gets its own
        global scale when prepared).
    """
    g = _gen(seed)
    w13 = _realistic((E, 2 * I, H), g, outliers) / math.sqrt(H)
    w13[:, I:] *= 0.5  # up rows smaller than gate rows
    w2 = _realistic((E, H, I), g, outliers) / math.sqrt(I)
    return w13.to(dtype), w2.to(dtype)


def random_x(T: int, H: int, seed: int) -> torch.Tensor:
    """bf16 [T, H] activations: Gaussian with per-token scales and a few outlier columns."""
    g = _gen(seed)
    x = torch.randn((T, H), generator=g) * torch.exp(0.5 * torch.randn((T, 1), generator=g))
    n = max(1, H // 32)
    cols = torch.randint(0, H, (n,), generator=g)
    x[:, cols] *= 10.0 + 20.0 * torch.rand((n,), generator=g)
    return x.to(torch.bfloat16)


def random_routes(
    T: int,
    K: int,
    E: int,
    *,
    seed: int,
    masked_frac: float = 0.0,
    all_on_one: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Random routes (numerics section 4).

    Args:
        T, K, E: tokens, routes per token, experts (K <= E).
        masked_frac: probability that a route is masked (id -1).
        all_on_one: an expert id; every token then routes to this expert (in a random slot)
            and its other K - 1 routes are masked, so no other expert receives a token.

    Returns:
        (topk_ids int32 [T, K], distinct experts within a token, negative = masked;
         topk_weights fp32 [T, K], positive, each token's weights summing to about 1;
         masked routes keep a finite nonzero weight that must be ignored).
    """
    if K > E:
        raise ValueError(f"K={K} routes need at least K distinct experts, got E={E}")
    g = _gen(seed)
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)]) if T else None
    ids = ids if ids is not None else torch.empty(0, K, dtype=torch.int64)
    if all_on_one is not None:
        ids = torch.full((T, K), -1, dtype=torch.int64)
        slot = torch.randint(0, K, (T,), generator=g)
        ids[torch.arange(T), slot] = all_on_one
    elif masked_frac > 0:
        mask = torch.rand((T, K), generator=g) < masked_frac
        ids = torch.where(mask, torch.full_like(ids, -1), ids)
    weights = torch.softmax(torch.randn((T, K), generator=g), dim=-1)
    return ids.to(torch.int32).contiguous(), weights.to(torch.float32).contiguous()


def tma_box(desc, coords: list[int]) -> torch.Tensor:
    """What a TMA copy of ``desc``'s box at ``coords`` reads (elements past the shape are
    zeros), from the descriptor's base, shape and strides alone."""
    flat = desc.base.as_strided((desc.base.untyped_storage().nbytes(),), (1,),
                                0)  # fmt: skip
    out = torch.zeros(desc.block_shape, dtype=desc.base.dtype)
    for idx in torch.cartesian_prod(*(torch.arange(b) for b in desc.block_shape)).tolist():
        pos = [c + i for c, i in zip(coords, idx)]
        if all(0 <= p < n for p, n in zip(pos, desc.shape)):
            out[tuple(idx)] = flat[desc.base.storage_offset()
                                   + sum(p * st for p, st in zip(pos, desc.strides))]  # fmt: skip
    return out
