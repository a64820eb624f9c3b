"""Routing: router logits to routes (numerics section 4), and the expert-parallel id mapping.

A route is a pair of tensors of the same shape [T, K]: ``topk_ids`` (int32, global expert
ids before :func:`local_expert_ids`, local ids or -1 for masked after) and
``topk_weights`` (fp32).

Methods of :func:`route` (all computed in fp32 whatever the dtype of the logits):

``"softmax"``
    softmax over all E experts, top-k, then (``renormalize``) divide the k weights by their
    sum. Qwen3-MoE (``norm_topk_prob`` is ``renormalize``).
``"topk_softmax"``
    top-k of the logits, then softmax over the k selected. gpt-oss, and Mixtral (which
    computes softmax over all, top-k and renormalizes: the same numbers up to fp32 rounding,
    and the same experts because softmax is monotonic). The weights always sum to 1.
``"sigmoid_grouped"``
    DeepSeek-V3 / Kimi-K2 / GLM-4.5 ("noaux_tc"). ``scores = sigmoid(logits)``; experts are
    chosen on ``scores + correction_bias`` restricted to the best ``topk_group`` of
    ``n_group`` contiguous groups (a group's score is the sum of its two best biased scores);
    the weights are the unbiased scores of the chosen experts, divided by their sum plus
    1e-20 (``renormalize``), times ``scaling_factor``.

Ties are broken in whatever order ``torch.topk`` gives (on the CPU, usually the lower
index first; not guaranteed, and it may differ between devices). Routes come out in
``torch.topk(sorted=True)`` order: descending weight for the softmax methods, descending
biased selection score for ``"sigmoid_grouped"``.
"""

from __future__ import annotations

import operator
from typing import Literal

import torch

__all__ = [
    "ROUTING_METHODS",
    "RoutingMethod",
    "check_expert_ids",
    "expert_range",
    "local_expert_ids",
    "route",
]

RoutingMethod = Literal["softmax", "topk_softmax", "sigmoid_grouped"]
ROUTING_METHODS: tuple[str, ...] = ("softmax", "topk_softmax", "sigmoid_grouped")

# DeepSeek-V3 adds this to the denominator of the renormalization; kept for bit-parity.
_RENORM_EPS = 1e-20

_INT_DTYPES = (torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8)


def route(
    logits: torch.Tensor,
    top_k: int,
    *,
    method: RoutingMethod,
    renormalize: bool = True,
    correction_bias: torch.Tensor | None = None,
    n_group: int = 1,
    topk_group: int = 1,
    scaling_factor: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Choose ``top_k`` experts a token from router logits.

    Args:
        logits: [T, E] router logits, any floating dtype, any device (T may be 0).
        top_k: K, routes a token, 1 <= K <= E.
        method: ``"softmax"``, ``"topk_softmax"`` or ``"sigmoid_grouped"`` (module docstring).
        renormalize: divide the K weights by their sum. Must stay True for
            ``"topk_softmax"``, whose weights always sum to 1.
        correction_bias: [E] floating, same device as ``logits``; ``"sigmoid_grouped"``
            only. Added to the scores for the choice of experts, never to the weights.
        n_group: groups of E / n_group contiguous experts; ``"sigmoid_grouped"`` only.
        topk_group: groups kept a token, 1 <= topk_group <= n_group, with
            K <= topk_group * E / n_group; ``"sigmoid_grouped"`` only.
        scaling_factor: multiplies the weights (DeepSeek ``routed_scaling_factor``);
            ``"sigmoid_grouped"`` only.

    Returns:
        ``(topk_ids, topk_weights)``: int32 [T, K] global expert ids and fp32 [T, K]
        weights, on the device of ``logits``, in ``torch.topk(sorted=True)`` order.

    Raises:
        TypeError / ValueError naming the argument. NaN in ``logits`` is not checked
        (hot path); such a token gets whatever ``torch.topk`` makes of it.
    """
    num_experts, top_k = _check_common(logits, top_k, method)
    if method != "sigmoid_grouped":
        _check_unused(method, correction_bias, n_group, topk_group, scaling_factor)
    x = logits.float()

    if method == "softmax":
        probs = torch.softmax(x, dim=-1)
        weights, ids = torch.topk(probs, top_k, dim=-1, sorted=True)
        if renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return ids.to(torch.int32), weights

    if method == "topk_softmax":
        if not renormalize:
            raise ValueError(
                "renormalize: expected True for method 'topk_softmax' (the softmax over the "
                "k selected always sums to 1), got False; use method='softmax' with "
                "renormalize=False for unnormalized softmax weights"
            )
        values, ids = torch.topk(x, top_k, dim=-1, sorted=True)
        return ids.to(torch.int32), torch.softmax(values, dim=-1)

    n_group, topk_group, bias = _check_grouped(
        logits, num_experts, top_k, correction_bias, n_group, topk_group, scaling_factor
    )
    scores = torch.sigmoid(x)
    choice = scores if bias is None else scores + bias
    tokens = x.shape[0]
    group_size = num_experts // n_group
    # DeepSeek's group score is the sum of the two best experts of the group (one if the
    # group has a single expert).
    grouped = choice.reshape(tokens, n_group, group_size)
    group_scores = torch.topk(grouped, min(2, group_size), dim=-1).values.sum(dim=-1)
    group_ids = torch.topk(group_scores, topk_group, dim=-1).indices
    group_mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, group_ids, True)
    expert_mask = group_mask.unsqueeze(-1).expand(tokens, n_group, group_size)
    choice = choice.masked_fill(~expert_mask.reshape(tokens, num_experts), float("-inf"))
    ids = torch.topk(choice, top_k, dim=-1, sorted=True).indices
    weights = scores.gather(1, ids)
    if renormalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + _RENORM_EPS)
    weights = weights * scaling_factor
    return ids.to(torch.int32), weights


def local_expert_ids(topk_ids: torch.Tensor, expert_start: int, expert_stop: int) -> torch.Tensor:
    """Map global expert ids to the ids of one expert-parallel rank.

    Args:
        topk_ids: [T, K] integer global expert ids (negative = already masked).
        expert_start, expert_stop: the rank holds global experts
            ``expert_start <= id < expert_stop`` (0 <= start <= stop).

    Returns:
        int32 [T, K] on the device of ``topk_ids``: ``id - expert_start`` for ids in the
        range, -1 (a masked route, numerics section 4) for every other id. The weights are not
        touched: a masked route contributes nothing downstream.
    """
    if not isinstance(topk_ids, torch.Tensor):
        raise TypeError(f"topk_ids: expected a torch.Tensor, got {type(topk_ids).__name__}")
    if topk_ids.dtype not in _INT_DTYPES:
        raise TypeError(f"topk_ids: expected an integer dtype, got {topk_ids.dtype}")
    if topk_ids.dim() != 2:
        raise ValueError(f"topk_ids: expected 2-D [T, K], got shape {tuple(topk_ids.shape)}")
    expert_start = _as_int("expert_start", expert_start)
    expert_stop = _as_int("expert_stop", expert_stop)
    if not 0 <= expert_start <= expert_stop:
        raise ValueError(
            "expert_start, expert_stop: expected 0 <= expert_start <= expert_stop, "
            f"got {expert_start}, {expert_stop}"
        )
    ids = topk_ids.to(torch.int64)  # no overflow in the subtraction whatever the input dtype
    local = (ids >= expert_start) & (ids < expert_stop)
    return torch.where(local, ids - expert_start, -1).to(torch.int32)


def check_expert_ids(topk_ids: torch.Tensor, num_experts: int) -> None:
    """Raise ValueError naming ``topk_ids`` if an id is >= ``num_experts`` (numerics section 4;
    negative ids are masked routes). Reads the ids: a host sync on a GPU."""
    if topk_ids.numel():
        hi = int(topk_ids.max())
        if hi >= num_experts:
            raise ValueError(
                f"topk_ids: expert id {hi} out of range; these experts hold "
                f"{num_experts} (ids 0..{num_experts - 1}, negative = masked)"
            )


def expert_range(rank: int, world_size: int, num_experts: int) -> tuple[int, int]:
    """The contiguous global experts ``[start, stop)`` held by ``rank`` of ``world_size``.

    Each rank holds ``num_experts // world_size`` experts, rank r the r-th slice.
    ``num_experts`` must be a multiple of ``world_size`` (ValueError otherwise).
    """
    rank = _as_int("rank", rank)
    world_size = _as_int("world_size", world_size)
    num_experts = _as_int("num_experts", num_experts)
    if world_size < 1:
        raise ValueError(f"world_size: expected >= 1, got {world_size}")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank: expected 0 <= rank < world_size={world_size}, got {rank}")
    if num_experts < 1:
        raise ValueError(f"num_experts: expected >= 1, got {num_experts}")
    if num_experts % world_size != 0:
        raise ValueError(
            "num_experts, world_size: expected num_experts to be a multiple of world_size, "
            f"got num_experts={num_experts}, world_size={world_size}"
        )
    per_rank = num_experts // world_size
    return rank * per_rank, (rank + 1) * per_rank


def _as_int(name: str, value: object) -> int:
    if isinstance(value, bool):
        raise TypeError(f"{name}: expected an int, got bool")
    try:
        return operator.index(value)  # type: ignore[arg-type]
    except TypeError:
        raise TypeError(f"{name}: expected an int, got {type(value).__name__}") from None


def _check_common(logits: torch.Tensor, top_k: int, method: str) -> tuple[int, int]:
    if not isinstance(logits, torch.Tensor):
        raise TypeError(f"logits: expected a torch.Tensor, got {type(logits).__name__}")
    if logits.dim() != 2:
        raise ValueError(f"logits: expected 2-D [T, E], got shape {tuple(logits.shape)}")
    if not logits.dtype.is_floating_point:
        raise TypeError(f"logits: expected a floating dtype, got {logits.dtype}")
    top_k = _as_int("top_k", top_k)
    num_experts = logits.shape[1]
    if not 1 <= top_k <= num_experts:
        raise ValueError(
            f"top_k: expected 1 <= top_k <= E={num_experts} (logits.shape[1]), got {top_k}"
        )
    if method not in ROUTING_METHODS:
        raise ValueError(f"method: expected one of {ROUTING_METHODS}, got {method!r}")
    return num_experts, top_k


def _check_unused(
    method: str,
    correction_bias: torch.Tensor | None,
    n_group: int,
    topk_group: int,
    scaling_factor: float,
) -> None:
    # Silently ignoring a grouped-routing argument would route a model wrongly.
    given = {
        "correction_bias": correction_bias is not None,
        "n_group": n_group != 1,
        "topk_group": topk_group != 1,
        "scaling_factor": scaling_factor != 1.0,
    }
    for name, is_given in given.items():
        if is_given:
            raise ValueError(
                f"{name}: only used by method 'sigmoid_grouped', got a non-default value "
                f"with method {method!r}"
            )


def _check_grouped(
    logits: torch.Tensor,
    num_experts: int,
    top_k: int,
    correction_bias: torch.Tensor | None,
    n_group: int,
    topk_group: int,
    scaling_factor: float,
) -> tuple[int, int, torch.Tensor | None]:
    n_group = _as_int("n_group", n_group)
    topk_group = _as_int("topk_group", topk_group)
    if n_group < 1:
        raise ValueError(f"n_group: expected >= 1, got {n_group}")
    if num_experts % n_group != 0:
        raise ValueError(
            f"n_group: expected a divisor of E={num_experts} (logits.shape[1]), got {n_group}"
        )
    if not 1 <= topk_group <= n_group:
        raise ValueError(
            f"topk_group: expected 1 <= topk_group <= n_group={n_group}, got {topk_group}"
        )
    kept = topk_group * (num_experts // n_group)
    if top_k > kept:
        raise ValueError(
            f"top_k: expected <= topk_group * E / n_group = {kept} experts in the kept "
            f"groups, got {top_k}"
        )
    if isinstance(scaling_factor, bool) or not isinstance(scaling_factor, (int, float)):
        raise TypeError(f"scaling_factor: expected a float, got {type(scaling_factor).__name__}")
    if correction_bias is None:
        return n_group, topk_group, None
    if not isinstance(correction_bias, torch.Tensor):
        raise TypeError(
            f"correction_bias: expected a torch.Tensor or None, got "
            f"{type(correction_bias).__name__}"
        )
    if tuple(correction_bias.shape) != (num_experts,):
        raise ValueError(
            f"correction_bias: expected shape ({num_experts},) [E], "
            f"got {tuple(correction_bias.shape)}"
        )
    if not correction_bias.dtype.is_floating_point:
        raise TypeError(f"correction_bias: expected a floating dtype, got {correction_bias.dtype}")
    if correction_bias.device != logits.device:
        raise ValueError(
            f"correction_bias: expected device {logits.device} (that of logits), "
            f"got {correction_bias.device}"
        )
    return n_group, topk_group, correction_bias.float()
