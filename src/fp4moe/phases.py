"""Precision by serving phase: PhasePolicy and the MoELayer users hold.

One PreparedExperts serves every phase; switching phase changes only the mode argument of
``fp4moe.moe`` (no copy, repack or conversion of the weights).
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
from torch import nn

from .backend.options import Options
from .experts import PreparedExperts
from .moe import ACT_SCALES, BACKENDS, MODES, moe
from .routing import ROUTING_METHODS, local_expert_ids, route

__all__ = ["PHASES", "MoELayer", "PhaseConfig", "PhasePolicy", "RouterConfig", "serving_phase"]

PHASES = ("prefill", "decode")
_SHORT = {"token": "per_token", "tensor": "per_tensor", "static": "static"}

_current_phase: contextvars.ContextVar[str | None] = contextvars.ContextVar(
    "fp4moe_phase", default=None
)


@contextlib.contextmanager
def serving_phase(phase: str | None) -> Iterator[None]:
    """Set the phase for every MoELayer called inside the block (``None``: infer it).

    Integrations (for example Hugging Face ``generate``) use this to say which pass is the
    prompt (prefill) and which are the later steps (decode)."""
    if phase is not None and phase not in PHASES:
        raise ValueError(f"phase: expected one of {PHASES} or None, got {phase!r}")
    token = _current_phase.set(phase)
    try:
        yield
    finally:
        _current_phase.reset(token)


def current_phase() -> str | None:
    """The phase ``serving_phase`` set for the calls of this context (None: infer it)."""
    return _current_phase.get()


@dataclass(frozen=True)
class PhaseConfig:
    """How one phase runs: mode, W4A4 activation scale, finalize.

    Strings parse too: "w4a16", "w4a4-token", "w4a4-tensor", "w4a4-static", each with an
    optional "+fused" suffix (fused finalize; default deterministic)."""

    mode: str = "w4a16"
    act_scale: str = "per_token"
    fused_finalize: bool = False

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"mode: expected one of {MODES}, got {self.mode!r}")
        if self.act_scale not in ACT_SCALES:
            raise ValueError(f"act_scale: expected one of {ACT_SCALES}, got {self.act_scale!r}")
        if not isinstance(self.fused_finalize, bool):
            raise TypeError(
                f"fused_finalize: expected a bool, got {type(self.fused_finalize).__name__}"
            )
        if self.mode == "w4a16":  # W4A16 ignores act_scale: one spelling, so str() round-trips
            object.__setattr__(self, "act_scale", "per_token")

    @classmethod
    def parse(cls, spec: str | PhaseConfig) -> PhaseConfig:
        if isinstance(spec, PhaseConfig):
            return spec
        if not isinstance(spec, str):
            raise TypeError(f"policy: expected a str or PhaseConfig, got {type(spec).__name__}")
        name, plus, suffix = spec.partition("+")
        if plus and suffix != "fused":  # "w4a16+" too
            raise ValueError(f"policy: unknown suffix {suffix!r} in {spec!r} (only '+fused')")
        fused = suffix == "fused"
        if name == "w4a16":
            return cls("w4a16", "per_token", fused)
        head, _, scale = name.partition("-")
        if head != "w4a4" or scale not in _SHORT:
            raise ValueError(
                f"policy: {spec!r} is not one of 'w4a16', 'w4a4-token', 'w4a4-tensor', "
                "'w4a4-static' (optionally with '+fused')"
            )
        return cls("w4a4", _SHORT[scale], fused)

    def __str__(self) -> str:
        base = "w4a16" if self.mode == "w4a16" else "w4a4-" + self.act_scale.replace("per_", "")
        return base + ("+fused" if self.fused_finalize else "")


@dataclass(frozen=True)
class PhasePolicy:
    """Maps serving phases to PhaseConfigs.

    Args:
        prefill: the prompt pass (compute-bound; W4A4 by default).
        decode: the generation steps (memory-bound; W4A16 by default).
        decode_max_tokens: when a call gives no phase (and none is set by
            ``serving_phase``), calls with at most this many tokens run as decode.
        backend: passed to ``fp4moe.moe`` ("auto": Triton on CUDA, reference elsewhere).
    """

    prefill: PhaseConfig | str = "w4a4-token"
    decode: PhaseConfig | str = "w4a16"
    decode_max_tokens: int = 64
    backend: str = "auto"

    def __post_init__(self) -> None:
        object.__setattr__(self, "prefill", PhaseConfig.parse(self.prefill))
        object.__setattr__(self, "decode", PhaseConfig.parse(self.decode))
        if isinstance(self.decode_max_tokens, bool) or not isinstance(self.decode_max_tokens, int):
            raise TypeError("decode_max_tokens: expected an int")
        if self.decode_max_tokens < 0:
            raise ValueError(f"decode_max_tokens: must be >= 0, got {self.decode_max_tokens}")
        if self.backend not in BACKENDS:
            raise ValueError(f"backend: expected one of {BACKENDS}, got {self.backend!r}")

    @classmethod
    def single(cls, spec: PhaseConfig | str, *, backend: str = "auto") -> PhasePolicy:
        """The same configuration for every phase."""
        return cls(prefill=spec, decode=spec, backend=backend)

    @classmethod
    def coerce(cls, policy: PhasePolicy | PhaseConfig | str) -> PhasePolicy:
        if isinstance(policy, PhasePolicy):
            return policy
        return cls.single(policy)

    def phase_of(self, num_tokens: int, phase: str | None = None) -> str:
        phase = phase if phase is not None else _current_phase.get()
        if phase is None:
            return "decode" if num_tokens <= self.decode_max_tokens else "prefill"
        if phase not in PHASES:
            raise ValueError(f"phase: expected one of {PHASES} or None, got {phase!r}")
        return phase

    def select(self, num_tokens: int, phase: str | None = None) -> PhaseConfig:
        return self.decode if self.phase_of(num_tokens, phase) == "decode" else self.prefill


@dataclass(frozen=True)
class RouterConfig:
    """Router settings (see ``fp4moe.route``); the gate weight and bias live in the layer."""

    method: str = "softmax"
    top_k: int = 2
    renormalize: bool = True
    n_group: int = 1
    topk_group: int = 1
    scaling_factor: float = 1.0

    def __post_init__(self) -> None:
        if self.method not in ROUTING_METHODS:
            raise ValueError(f"method: expected one of {ROUTING_METHODS}, got {self.method!r}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 1:
            raise ValueError(f"top_k: expected a positive int, got {self.top_k!r}")
        if self.method != "sigmoid_grouped":
            given = {"n_group": self.n_group != 1, "topk_group": self.topk_group != 1,
                     "scaling_factor": self.scaling_factor != 1.0}  # fmt: skip
            for name, is_given in given.items():
                if is_given:  # silently ignoring it would route the model wrongly
                    raise ValueError(
                        f"{name}: only used by method 'sigmoid_grouped', got a non-default "
                        f"value with method {self.method!r}"
                    )

    def route(
        self, logits: torch.Tensor, correction_bias: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``fp4moe.route`` with these settings: (int32 ids, fp32 weights) [T, top_k] for
        logits [T, E_total]; ``correction_bias`` is used by "sigmoid_grouped" only."""
        kw = {}
        if self.method == "sigmoid_grouped":
            kw = dict(
                correction_bias=correction_bias, n_group=self.n_group,
                topk_group=self.topk_group, scaling_factor=self.scaling_factor,
            )  # fmt: skip
        return route(logits, self.top_k, method=self.method, renormalize=self.renormalize, **kw)


def layer_settings(
    experts: PreparedExperts, router: RouterConfig | None, policy
) -> tuple[PreparedExperts, RouterConfig, PhasePolicy]:
    """The checks every MoE layer (single-process or expert-parallel) makes of its
    experts, router and policy; returns them with the defaults filled in."""
    if not isinstance(experts, PreparedExperts):
        raise TypeError(f"experts: expected PreparedExperts, got {type(experts).__name__}")
    router = router or RouterConfig()
    if not isinstance(router, RouterConfig):
        raise TypeError(f"router: expected RouterConfig, got {type(router).__name__}")
    return experts, router, PhasePolicy.coerce(policy if policy is not None else PhasePolicy())


@dataclass
class PhaseStats:
    """Calls and tokens a layer ran per phase."""

    calls: dict[str, int] = field(default_factory=lambda: {p: 0 for p in PHASES})
    tokens: dict[str, int] = field(default_factory=lambda: {p: 0 for p in PHASES})


class MoELayer(nn.Module):
    """A sparse MoE block over one PreparedExperts, its router, and a phase policy.

    Args:
        experts: the prepared experts (E local experts). Held as a plain attribute, not as
            parameters or buffers, so ``state_dict`` and ``.to()`` never copy them; move them
            with ``layer.experts = layer.experts.to(device)`` if you must.
        router: RouterConfig (method, top_k, groups, scaling).
        gate_weight: fp32/bf16 [E_total, H] router weight (logits = x @ gate_weight.T in
            fp32). May be None when every call passes ``router_logits`` or ``routes``.
        correction_bias: fp32 [E_total] selection bias (sigmoid_grouped only).
        policy: a PhasePolicy, or a single mode string for every phase.
        expert_range: (start, stop) when this layer holds only experts start..stop-1 of
            E_total (expert parallelism): other experts' routes are masked.
    """

    def __init__(
        self,
        experts: PreparedExperts,
        router: RouterConfig | None = None,
        *,
        gate_weight: torch.Tensor | None = None,
        correction_bias: torch.Tensor | None = None,
        policy: PhasePolicy | PhaseConfig | str | None = None,
        expert_range: tuple[int, int] | None = None,
    ) -> None:
        super().__init__()
        self.experts, self.router, self.policy = layer_settings(experts, router, policy)
        h = experts.hidden_size
        if gate_weight is not None:
            if not isinstance(gate_weight, torch.Tensor):
                raise TypeError(
                    "gate_weight: expected a torch.Tensor or None, got "
                    f"{type(gate_weight).__name__}"
                )
            if gate_weight.dim() != 2 or gate_weight.shape[1] != h:
                raise ValueError(
                    f"gate_weight: expected [E_total, {h}], got {tuple(gate_weight.shape)}"
                )
            self.register_buffer("gate_weight", gate_weight.detach().float().clone())
        else:
            self.gate_weight = None
        if correction_bias is not None:
            if self.router.method != "sigmoid_grouped":
                raise ValueError(
                    "correction_bias: only used by router method 'sigmoid_grouped', got "
                    f"method {self.router.method!r}"
                )
            self.register_buffer("correction_bias", correction_bias.detach().float().clone())
        else:
            self.correction_bias = None
        n_total = gate_weight.shape[0] if gate_weight is not None else experts.num_experts
        if expert_range is None:
            expert_range = (0, experts.num_experts)
        start, stop = expert_range
        if stop - start != experts.num_experts or start < 0 or stop > n_total:
            raise ValueError(
                f"expert_range: {expert_range} does not hold the {experts.num_experts} "
                f"prepared experts within {n_total}"
            )
        self.expert_range = (start, stop)
        for name in PHASES:
            cfg = getattr(self.policy, name)
            if cfg.mode == "w4a4" and cfg.act_scale == "static" and experts.a13_scale is None:
                raise ValueError(
                    f"policy: {name} runs {cfg}, which needs calibrated activation scales, but "
                    "these experts were prepared without a13_scale/a2_scale"
                )
        self.num_experts_total = n_total
        self.stats = PhaseStats()

    def route(self, x2d: torch.Tensor, router_logits: torch.Tensor | None = None):
        """(topk_ids int32 [T, K] local ids, topk_weights fp32 [T, K]) for x2d [T, H]."""
        if router_logits is None:
            if self.gate_weight is None:
                raise ValueError("router_logits: needed when the layer has no gate_weight")
            # .float(): the buffer follows layer.to(dtype) (bf16 models); logits stay fp32
            router_logits = x2d.float() @ self.gate_weight.float().t()
        elif not isinstance(router_logits, torch.Tensor):
            raise TypeError(
                f"router_logits: expected a torch.Tensor, got {type(router_logits).__name__}"
            )
        else:
            want = (x2d.shape[0], self.num_experts_total)
            if router_logits.dim() >= 2 and router_logits.shape[-1] == want[1]:
                router_logits = router_logits.reshape(-1, want[1])  # [..., E] like x
            if tuple(router_logits.shape) != want:
                raise ValueError(
                    f"router_logits: expected [T, E_total] = {list(want)}, got "
                    f"{tuple(router_logits.shape)}"
                )
        ids, w = self.router.route(router_logits, self.correction_bias)
        start, stop = self.expert_range
        if (start, stop) != (0, self.num_experts_total):
            ids = local_expert_ids(ids, start, stop)
        return ids, w

    def forward(
        self,
        x: torch.Tensor,
        phase: str | None = None,
        *,
        router_logits: torch.Tensor | None = None,
        routes: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """x: bf16 [..., H] -> bf16 [..., H].

        phase: "prefill", "decode", or None (the ``serving_phase`` context, else the
        policy's token-count threshold). routes: precomputed (ids, weights) [T, K]."""
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"x: expected a torch.Tensor, got {type(x).__name__}")
        if x.dtype != torch.bfloat16:
            raise TypeError(f"x: expected torch.bfloat16, got {x.dtype}")
        shape = x.shape
        h = self.experts.hidden_size
        if x.dim() < 1 or shape[-1] != h:
            raise ValueError(
                f"x: expected [..., {h}] (the experts' hidden size), got {tuple(shape)}"
            )
        x2d = x.reshape(-1, h)
        t = x2d.shape[0]
        ids, w = routes if routes is not None else self.route(x2d, router_logits)
        name = self.policy.phase_of(t, phase)
        cfg = self.policy.prefill if name == "prefill" else self.policy.decode
        out = moe(
            x2d, ids, w, self.experts, mode=cfg.mode, act_scale=cfg.act_scale,
            fused_finalize=cfg.fused_finalize, backend=self.policy.backend,
            options=self.triton_options,
        )  # fmt: skip
        self.stats.calls[name] += 1  # calls that ran: a call that raised is not counted
        self.stats.tokens[name] += t
        return out.reshape(shape)

    @functools.cached_property
    def triton_options(self) -> Options:
        """The Triton backend's options for this layer's calls (``fp4moe.Options``, built on
        first use): the share of valid routes is the share of experts it holds,
        ``expert_range`` over all experts (routes to other ranks' experts are masked),
        which puts the planner's regimes on valid rows an expert."""
        start, stop = self.expert_range
        return Options(valid_fraction=(stop - start) / self.num_experts_total)

    def memory_report(self, num_tokens: int | None = None) -> dict[str, int]:
        """Bytes of the expert weights (one prepared copy, shared by every phase), of the
        router, what a bf16 copy of the experts would cost, and the transient workspace of
        one call (Triton backend) for the decode phase at ``decode_max_tokens`` tokens and
        for the prefill phase at ``num_tokens`` (default 4096) tokens (the plans of the
        experts' CUDA device; an H200's where they are elsewhere)."""
        from .backend import H200, plan_call, target_for, workspace_bytes

        ex = self.experts
        e, h, i = ex.num_experts, ex.hidden_size, ex.intermediate_size
        router = sum(b.numel() * b.element_size() for b in self.buffers())
        target = target_for(ex.device) if ex.device.type == "cuda" else H200

        def ws(t: int, cfg: PhaseConfig) -> int:
            plan = plan_call(
                t, self.router.top_k, e, h, i, mode=cfg.mode, act_scale=cfg.act_scale,
                fused_finalize=cfg.fused_finalize, options=self.triton_options, target=target,
            )  # fmt: skip
            return workspace_bytes(plan)

        prefill_t = 4096 if num_tokens is None else num_tokens
        decode_t = max(self.policy.decode_max_tokens, 1)
        return {
            "expert_bytes": ex.nbytes(),
            "router_bytes": router,
            "bf16_expert_bytes": e * 3 * h * i * 2,
            "copies_of_expert_weights": 1,
            "decode_workspace_tokens": decode_t,
            "decode_workspace_bytes": ws(decode_t, self.policy.decode),
            "prefill_workspace_tokens": prefill_t,
            "prefill_workspace_bytes": ws(prefill_t, self.policy.prefill),
        }

    def extra_repr(self) -> str:
        return (
            f"experts={self.experts.num_experts} of {self.num_experts_total}, "
            f"H={self.experts.hidden_size}, I={self.experts.intermediate_size}, "
            f"router={self.router.method}/top{self.router.top_k}, "
            f"prefill={self.policy.prefill}, decode={self.policy.decode}"
        )
