"""Precision by serving phase: PhasePolicy and the MoELayer users hold.

One PreparedExperts serves every phase; switching phase changes only the mode argument of
``fp4moe.moe`` (no copy, repack or conversion of the weights).

The phase a call runs in comes, in this order, from the ``phase`` argument of the layer,
from :func:`serving_phase` (process-wide state, readable by ``torch.compile``: the compiled
graph is guarded on it, so a phase change selects, or compiles, the graph of that phase),
and else from the policy's token-count threshold.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
from torch import nn

from .backend.options import Options
from .experts import PreparedExperts, align_scale_rows
from .kernels.gemm.fields import to_fields
from .modes import MODE_NAMES, mode_name, resolve_mode
from .moe import BACKENDS, moe
from .ops import EXPERT_FIELDS
from .routing import ROUTING_METHODS, local_expert_ids, route

__all__ = [
    "PHASES",
    "MoELayer",
    "PhaseConfig",
    "PhasePolicy",
    "RouterConfig",
    "current_phase",
    "serving_phase",
    "set_phase",
]

PHASES = ("prefill", "decode")


class _PhaseState:
    """The phase of :func:`serving_phase`: a plain object, one for the process.

    Not a ContextVar (``torch.compile`` cannot trace one: every MoE layer was a graph break)
    and not a ``threading.local`` (Dynamo mis-traces writes to one inside a compiled frame,
    as the phase hooks of ``fp4moe.integrations.hf`` make). So the phase is shared by the
    threads of a process; threads serving different phases at once pass ``phase=`` to the
    layers instead."""

    def __init__(self) -> None:
        self.phase: str | None = None


_STATE = _PhaseState()


def _check_phase(phase: object) -> None:
    if phase is not None and phase not in PHASES:
        raise ValueError(f"phase: expected one of {PHASES} or None, got {phase!r}")


def current_phase() -> str | None:
    """The phase set by :func:`serving_phase` / :func:`set_phase`, or None (infer it)."""
    return _STATE.phase


def set_phase(phase: str | None) -> str | None:
    """Set the process-wide serving phase (``None``: infer it); returns the previous one.
    :func:`serving_phase` is the scoped form."""
    _check_phase(phase)
    previous = _STATE.phase
    _STATE.phase = phase
    return previous


@contextlib.contextmanager
def serving_phase(phase: str | None) -> Iterator[None]:
    """Set the phase for every MoELayer called inside the block (``None``: infer it).

    Integrations (for example Hugging Face ``generate``) use this to say which pass is the
    prompt (prefill) and which are the later steps (decode). The setting is process-wide
    (all threads) and restored when the block exits, also on an exception."""
    previous = set_phase(phase)
    try:
        yield
    finally:
        _STATE.phase = previous


def _parse_error(spec: str) -> ValueError:
    m = spec.strip().lower().replace("_", "-")
    hint = ""
    if m == "w4a4":
        hint = " ('w4a4' alone is 'w4a4-token')"
    for short in ("token", "tensor", "static"):
        if m.split("+")[0] in (f"w4a4-per-{short}", f"w4a4{short}"):
            hint = f" (did you mean 'w4a4-{short}'?)"
    return ValueError(
        f"policy: {spec!r} is not one of {', '.join(map(repr, MODE_NAMES))} (optionally with "
        f"'+fused'){hint}"
    )


@dataclass(frozen=True)
class PhaseConfig:
    """How one phase runs: mode, W4A4 activation scale, finalize.

    ``mode`` takes a mode name of ``fp4moe.modes`` ("w4a16", "w4a8", "w4a4-token",
    "w4a4-tensor", "w4a4-static"), or the kernel family "w4a4" with ``act_scale``
    ("per_token", "per_tensor", "static"); the fields hold the kernel family ("w4a16",
    "w4a8", "w4a4") and the activation scale ("per_token" for W4A16 and W4A8).
    Strings parse too (:meth:`parse`): a mode name with an optional "+fused" suffix (fused
    finalize; default deterministic)."""

    mode: str = "w4a16"
    act_scale: str | None = None
    fused_finalize: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.mode, str) or (self.mode not in MODE_NAMES and self.mode != "w4a4"):
            raise ValueError(f"mode: expected one of {MODE_NAMES}, got {self.mode!r}")
        kernel, scale = resolve_mode(self.mode, self.act_scale)
        object.__setattr__(self, "mode", kernel)
        object.__setattr__(self, "act_scale", scale)
        if not isinstance(self.fused_finalize, bool):
            raise TypeError(
                f"fused_finalize: expected a bool, got {type(self.fused_finalize).__name__}"
            )

    @property
    def name(self) -> str:
        """The mode name ("w4a16", "w4a8", "w4a4-token", ...), without the finalize suffix."""
        return mode_name(self.mode, self.act_scale)

    @classmethod
    def parse(cls, spec: str | PhaseConfig) -> PhaseConfig:
        if isinstance(spec, PhaseConfig):
            return spec
        if not isinstance(spec, str):
            raise TypeError(f"policy: expected a str or PhaseConfig, got {type(spec).__name__}")
        name, plus, suffix = spec.partition("+")
        if plus and suffix != "fused":  # "w4a16+" too
            raise ValueError(f"policy: unknown suffix {suffix!r} in {spec!r} (only '+fused')")
        if name not in MODE_NAMES:
            raise _parse_error(spec)
        return cls(name, fused_finalize=suffix == "fused")

    def __str__(self) -> str:
        return self.name + ("+fused" if self.fused_finalize else "")


@dataclass(frozen=True)
class PhasePolicy:
    """Maps serving phases to PhaseConfigs.

    Args:
        prefill: the prompt pass (compute-bound; W4A4 per-token by default; on Hopper,
            ``"w4a8"`` runs it on the FP8 tensor cores: docs/policies.md).
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
        """``phase`` if given, else the :func:`serving_phase` one, else decode for at most
        ``decode_max_tokens`` tokens and prefill above."""
        phase = phase if phase is not None else _STATE.phase
        if phase is None:
            return "decode" if num_tokens <= self.decode_max_tokens else "prefill"
        _check_phase(phase)
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

    The expert tensors are buffers of the layer (``w13_codes``, ``w13_scales``,
    ``w13_global``, ``w2_codes``, ``w2_scales``, ``w2_global`` and, when calibrated,
    ``a13_scale``, ``a2_scale``; numerics section 3, prepared layout version 2, the codes
    in the fields layout): ``.to(device)``, ``.cuda()`` and ``.cpu()`` move them,
    ``state_dict()`` holds them (the tensors themselves, no copy) beside ``gate_weight``,
    and ``load_state_dict`` copies into them; a state dict whose metadata says version 1
    (linear codes, written by an earlier fp4moe) has its codes converted. A dtype change
    (``.to(torch.bfloat16)``, ``.half()``) never touches them: codes, e4m3 scales and fp32
    globals keep their dtypes. ``layer.experts`` is the PreparedExperts over the current
    buffers; assigning one replaces them.

    Args:
        experts: the prepared experts (E local experts), shared, not copied.
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
        experts, self.router, self.policy = layer_settings(experts, router, policy)
        self.experts = experts
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
        # The Triton backend's options for this layer's calls: the share of valid routes is
        # the share of experts it holds (routes to other ranks' experts are masked), which
        # puts the planner's regimes on valid rows an expert.
        self.triton_options = Options(valid_fraction=(stop - start) / n_total)
        self.stats = PhaseStats()

    # ------------------------------------------------------------------ the experts

    @property
    def experts(self) -> PreparedExperts:
        """The prepared experts over the layer's current expert buffers."""
        cached = self.__dict__.get("_experts")
        if cached is not None and all(
            getattr(cached, f) is self._buffers.get(f) for f in EXPERT_FIELDS
        ):
            return cached
        tensors = {f: self._buffers.get(f) for f in EXPERT_FIELDS}
        fresh = PreparedExperts(**tensors, validate=False)  # checked when first assigned
        self.__dict__["_experts"] = fresh
        return fresh

    @experts.setter
    def experts(self, experts: PreparedExperts) -> None:
        if not isinstance(experts, PreparedExperts):
            raise TypeError(f"experts: expected PreparedExperts, got {type(experts).__name__}")
        old = self.__dict__.get("_experts")
        if old is not None and (
            (experts.num_experts, experts.hidden_size, experts.intermediate_size)
            != (old.num_experts, old.hidden_size, old.intermediate_size)
        ):
            raise ValueError(
                f"experts: {experts!r} does not have the shape of the layer's experts {old!r}"
            )
        for f in EXPERT_FIELDS:
            self.register_buffer(f, getattr(experts, f))
        self.__dict__["_experts"] = experts

    # state-dict version 2: the expert codes in the fields layout (version 1: linear)
    _version = 2

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, *args, **kwargs):
        version = local_metadata.get("version")
        if version is not None and version < 2:  # the loader's copy of the dict, not the caller's
            for f in ("w13_codes", "w2_codes"):
                t = state_dict.get(prefix + f)
                if (
                    isinstance(t, torch.Tensor)
                    and t.dtype == torch.uint8
                    and t.dim() == 3
                    and t.shape[-1] % 4 == 0
                ):
                    state_dict[prefix + f] = to_fields(t)  # (a bad shape fails the copy below)
        super()._load_from_state_dict(state_dict, prefix, local_metadata, *args, **kwargs)

    def _apply(self, fn, recurse: bool = True):
        # Expert buffers follow device moves only: fn may also change floating dtypes
        # (module.to(torch.bfloat16)), which would ruin e4m3 scales and fp32 globals; the
        # block scales keep their rows 16-byte aligned in memory (``align_scale_rows``).
        held = {f: self._buffers.pop(f) for f in EXPERT_FIELDS if f in self._buffers}
        try:
            super()._apply(fn, recurse)
        finally:
            self._buffers.update(held)
        for f, t in held.items():
            if t is not None:
                new = fn(t)
                new = new if new.dtype == t.dtype else t.to(new.device)
                if f.endswith("_scales") and new is not t:  # a move made them contiguous
                    new = align_scale_rows(new)
                self._buffers[f] = new
        return self

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
            x2d, ids, w, self.experts, mode=cfg.name, fused_finalize=cfg.fused_finalize,
            backend=self.policy.backend, options=self.triton_options,
        )  # fmt: skip
        self.stats.calls[name] += 1  # calls that ran: a call that raised is not counted
        self.stats.tokens[name] += t
        return out.reshape(shape)

    def memory_report(self, num_tokens: int | None = None) -> dict[str, int]:
        """Bytes of the expert weights (one prepared copy, shared by every phase), of the
        router, what a bf16 copy of the experts would cost, and the transient workspace of
        one call (Triton backend) for the decode phase at ``decode_max_tokens`` tokens and
        for the prefill phase at ``num_tokens`` (default 4096) tokens (the plans of the
        experts' CUDA device; an H200's where they are elsewhere)."""
        from .backend import H200, experts_scales_tma, plan_call, target_for, workspace_bytes

        ex = self.experts
        e, h, i = ex.num_experts, ex.hidden_size, ex.intermediate_size
        router = sum(
            b.numel() * b.element_size()
            for b in (self.gate_weight, self.correction_bias)
            if b is not None
        )
        target = target_for(ex.device) if ex.device.type == "cuda" else H200

        def ws(t: int, cfg: PhaseConfig) -> int:
            plan = plan_call(
                t, self.router.top_k, e, h, i, mode=cfg.mode, act_scale=cfg.act_scale,
                fused_finalize=cfg.fused_finalize, options=self.triton_options, target=target,
                scales_tma=experts_scales_tma(ex),
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
