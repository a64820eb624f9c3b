"""Expert parallelism on ``torch.distributed``: EPMoELayer (its expert side: expert_rows.py).

Each rank of a process group holds a contiguous slice of the experts
(``fp4moe.expert_range(rank, world, E_total)``) and its own tokens. One call:

1. route every token of this rank with the global router (fp32 logits, ``fp4moe.route``);
2. (W4A4, W4A8) quantize the activations on this (home) rank exactly as the
   single-process layer would, so that only NVFP4 (W4A4) or e4m3 (W4A8) bytes travel;
3. dispatch: exchange per-expert counts, then the rows (``all_to_all_single``);
4. expert ranks compute the route rows y (numerics sections 5, 5a) of the rows they
   received;
5. combine: send y back (``all_to_all_single``); the home rank runs the deterministic
   finalize of numerics section 6 (ascending k, fp32 fma, one bf16 rounding).

With the deterministic finalize and a batch-invariant mode (W4A16, W4A8, W4A4 per-token,
W4A4 static), each token's output is bitwise identical to the single-process ``MoELayer``
holding all experts. W4A4 per-tensor uses one global scale over the *global* batch (all
ranks' tokens; an ``all_reduce(max)`` of the amax), so it is bitwise identical to the
single-process layer run on all ranks' tokens concatenated. docs/expert-parallel.md has
the wire format and what is and is not guaranteed.
"""

from __future__ import annotations

import struct
import zlib
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from .expert_rows import E4M3Rows, compute_route_rows, pack_rows, unpack_rows, wire_row_bytes
from .experts import PreparedExperts
from .moe import ACT_SCALES, BACKENDS, MODES
from .nvfp4 import NVFP4Tensor, global_from_amax, quantize_blocks
from .phases import (
    PHASES,
    PhaseConfig,
    PhasePolicy,
    PhaseStats,
    RouterConfig,
    current_phase,
    layer_settings,
)
from .reference import e4m3_rows, finalize_reference
from .routing import ROUTING_METHODS, expert_range

__all__ = ["E4M3Rows", "EPDispatch", "EPMoELayer", "compute_route_rows", "wire_row_bytes"]

_SIG_VERSION = 2  # 2: policy codes index the modes (w4a16, w4a8, w4a4)
_SIG_FIELDS = (
    "signature version",
    "world size",
    "E_total (gate_weight rows)",
    "hidden size H",
    "intermediate size I",
    "experts per rank",
    "router method",
    "router top_k",
    "router renormalize",
    "router n_group",
    "router topk_group",
    "router scaling_factor",
    "prefill policy",
    "decode policy",
    "policy decode_max_tokens",
    "policy backend",
    "static activation scales present",
    "max_tokens",
    "gate_weight checksum",
    "correction_bias checksum",
    "device type",
)
_PHASE_CODE = {"prefill": 0, "decode": 1, None: 2}
_META_EXTRA = 3  # per destination: counts of its experts, then T_local, phase code, status


# ------------------------------------------------------------------------ helpers


def _crc(t: torch.Tensor | None) -> int:
    if t is None:
        return -1
    data = t.detach().float().contiguous().cpu().view(torch.uint8).numpy().tobytes()
    return zlib.crc32(data)


def _policy_code(cfg: PhaseConfig) -> int:
    return MODES.index(cfg.mode) * 100 + ACT_SCALES.index(cfg.act_scale) * 10 + cfg.fused_finalize


def _capturing() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


@dataclass(frozen=True)
class _Plan:
    """What one call sends where (home side) and receives (expert side)."""

    send_counts: torch.Tensor  # int64 [world, E_local] (device)
    recv_counts: torch.Tensor  # int64 [world, E_local] (device)
    send_splits: list[int] | None  # rows to each rank (variable path)
    recv_splits: list[int] | None
    cfg: PhaseConfig
    phase: str


@dataclass(frozen=True)
class EPDispatch:
    """What ``EPMoELayer.dispatch`` received and keeps for ``compute_experts`` and
    ``combine`` (one call of ``forward`` split in its three steps).

    Expert side: ``rows`` (W4A16 bf16 [N, H]; W4A8 ``E4M3Rows``, e4m3 [N, H] and one fp32
    scale a row; W4A4 an NVFP4Tensor with one global per row)
    and ``row_expert`` (int [N] local expert ids, -1 for padding rows of the fixed-capacity
    path), the input of ``compute_route_rows`` with ``mode``, ``act_scale`` and
    ``backend``. The other fields are the home side's bookkeeping for the combine."""

    rows: torch.Tensor | NVFP4Tensor | E4M3Rows
    row_expert: torch.Tensor
    mode: str
    act_scale: str
    backend: str
    row_bytes: int  # bytes of one dispatched row on the wire
    plan: _Plan
    ids: torch.Tensor  # int32 [T, K] global ids of this rank's tokens
    weights: torch.Tensor  # fp32 [T, K]
    perm: torch.Tensor  # send order of the routes
    sorted_key: torch.Tensor  # global expert id of each route in send order (E_total: masked)
    slot: torch.Tensor  # row each route in send order went to (and comes back from)
    n_send: int | None  # rows sent (variable path)
    shape: torch.Size  # of the x given to dispatch


class EPMoELayer(nn.Module):
    """An expert-parallel sparse MoE block: a sibling of ``MoELayer`` over a process group.

    Every rank of ``group`` builds one, with its slice of the experts and the same router,
    gate weight and policy; then every rank calls ``forward`` the same number of times
    (a collective), each with its own tokens (any T, including 0).

    Args:
        experts: this rank's prepared experts: global experts [start, stop) of E_total,
            where (start, stop) = ``fp4moe.expert_range(rank, world, E_total)``.
        router: RouterConfig (as ``MoELayer``).
        gate_weight: fp32/bf16 [E_total, H], the full router weight (every rank routes its
            own tokens over all experts). Required.
        correction_bias: fp32 [E_total] (``"sigmoid_grouped"`` only).
        policy: PhasePolicy or one mode string (as ``MoELayer``). The finalize is always the
            deterministic one (a "+fused" suffix is accepted and has no effect: FC2 runs on
            another rank than the token's output).
        group: the process group (default: the world group).
        expert_range: optional (start, stop) to check against ``fp4moe.expert_range``.
        max_tokens: declare the most tokens a rank passes in one call to use the
            fixed-capacity path: every rank sends ``max_tokens * top_k`` rows to every rank
            (padding included), so buffer shapes never depend on the routes, no host sync is
            needed, and the communication can be captured in a CUDA graph. ``None``: the
            variable path (split sizes read on the host, one sync per call, fewer bytes).

    Construction is collective too: every rank exchanges a signature (shapes, router,
    policy, checksums of the gate weight) and its static activation scales; any
    disagreement raises ``ValueError`` on every rank.

    Attributes:
        last_comm_bytes: bytes this rank sent to *other* ranks in the last call:
            ``dispatch`` and ``combine`` (row payloads), ``metadata`` (counts), and the
            same payloads kept on this rank (``dispatch_self``, ``combine_self``), plus the
            row counts ``dispatch_rows`` / ``recv_rows``.
    """

    def __init__(
        self,
        experts: PreparedExperts,
        router: RouterConfig | None = None,
        *,
        gate_weight: torch.Tensor,
        correction_bias: torch.Tensor | None = None,
        policy: PhasePolicy | PhaseConfig | str | None = None,
        group: dist.ProcessGroup | None = None,
        expert_range: tuple[int, int] | None = None,
        max_tokens: int | None = None,
    ) -> None:
        super().__init__()
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError(
                "EPMoELayer: torch.distributed is not initialized; call "
                "dist.init_process_group first (gloo on CPU, nccl on GPUs)"
            )
        self.group = group
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        self.stats = PhaseStats()
        self.last_comm_bytes: dict[str, int] = {}
        device = self._comm_device(experts)
        local_error: Exception | None = None
        sig = [0] * len(_SIG_FIELDS)
        try:
            self._setup(experts, router, gate_weight, correction_bias, policy, expert_range,
                        max_tokens)  # fmt: skip
            sig = self._signature(gate_weight, correction_bias)
        except (TypeError, ValueError) as exc:
            local_error = exc
        self._agree(sig, local_error, device)
        self._gather_static_scales(device)

    # ------------------------------------------------------------------ construction
    def _comm_device(self, experts) -> torch.device:
        if isinstance(experts, PreparedExperts):
            return experts.device
        if dist.get_backend(self.group) == "nccl":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

    def _setup(self, experts, router, gate_weight, correction_bias, policy, rng, max_tokens):
        self.experts, self.router, self.policy = layer_settings(experts, router, policy)
        h = experts.hidden_size
        if not isinstance(gate_weight, torch.Tensor):
            raise TypeError(
                f"gate_weight: expected a torch.Tensor [E_total, {h}], got "
                f"{type(gate_weight).__name__} (expert parallelism routes every token over "
                "all experts, so the full gate weight is required)"
            )
        if gate_weight.dim() != 2 or gate_weight.shape[1] != h:
            raise ValueError(
                f"gate_weight: expected [E_total, {h}], got {tuple(gate_weight.shape)}"
            )
        e_total = gate_weight.shape[0]
        if e_total % self.world_size:
            raise ValueError(
                f"gate_weight: E_total={e_total} experts do not split evenly over "
                f"world size {self.world_size}"
            )
        start, stop = expert_range(self.rank, self.world_size, e_total)
        if experts.num_experts != stop - start:
            raise ValueError(
                f"experts: rank {self.rank} of {self.world_size} must hold experts "
                f"[{start}, {stop}) of {e_total} ({stop - start} experts), got "
                f"{experts.num_experts} prepared experts"
            )
        if rng is not None and tuple(rng) != (start, stop):
            raise ValueError(
                f"expert_range: rank {self.rank} of {self.world_size} holds experts "
                f"[{start}, {stop}) of {e_total} (fp4moe.expert_range), got {tuple(rng)}"
            )
        if self.router.top_k > e_total:
            raise ValueError(f"router: top_k={self.router.top_k} exceeds E_total={e_total}")
        for name, cfg in (("prefill", self.policy.prefill), ("decode", self.policy.decode)):
            if cfg.mode == "w4a4" and cfg.act_scale == "static" and experts.a13_scale is None:
                raise ValueError(
                    f"policy: the {name} phase uses W4A4 static scales, but these experts "
                    "were prepared without a13_scale/a2_scale"
                )
        if max_tokens is not None and (
            isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1
        ):
            raise ValueError(f"max_tokens: expected a positive int or None, got {max_tokens!r}")
        self.max_tokens = max_tokens
        self.expert_range = (start, stop)
        self.num_experts_total = e_total
        self.experts_per_rank = stop - start
        self.register_buffer("gate_weight", gate_weight.detach().float().clone())
        if correction_bias is not None:
            self.register_buffer("correction_bias", correction_bias.detach().float().clone())
        else:
            self.correction_bias = None

    def _signature(self, gate_weight, correction_bias) -> list[int]:
        r, p, ex = self.router, self.policy, self.experts
        scaling = struct.unpack("<q", struct.pack("<d", float(r.scaling_factor)))[0]
        return [
            _SIG_VERSION, self.world_size, self.num_experts_total, ex.hidden_size,
            ex.intermediate_size, self.experts_per_rank, ROUTING_METHODS.index(r.method),
            r.top_k, int(r.renormalize), r.n_group, r.topk_group, scaling,
            _policy_code(p.prefill), _policy_code(p.decode), p.decode_max_tokens,
            BACKENDS.index(p.backend), int(ex.a13_scale is not None),
            -1 if self.max_tokens is None else self.max_tokens,
            _crc(gate_weight), _crc(correction_bias), int(ex.device.type == "cuda"),
        ]  # fmt: skip

    def _agree(self, sig: list[int], local_error: Exception | None, device) -> None:
        mine = torch.tensor([int(local_error is None), *sig], dtype=torch.int64, device=device)
        every = [torch.empty_like(mine) for _ in range(self.world_size)]
        dist.all_gather(every, mine, group=self.group)
        table = torch.stack(every).cpu().tolist()
        if local_error is not None:
            raise type(local_error)(
                f"{local_error} [EPMoELayer on rank {self.rank}; every rank of the group raises]"
            ) from local_error
        failed = [r for r, row in enumerate(table) if row[0] == 0]
        if failed:
            raise ValueError(
                f"EPMoELayer: rank(s) {failed} rejected their arguments (see the error raised "
                f"there); rank {self.rank} raises too so that no rank waits on the others"
            )
        problems = []
        for j, name in enumerate(_SIG_FIELDS):
            values = [row[j + 1] for row in table]
            if len(set(values)) > 1:
                shown = ", ".join(f"rank {r}: {v}" for r, v in enumerate(values))
                problems.append(f"{name} ({shown})")
        if problems:
            raise ValueError(
                "EPMoELayer: the ranks of the group disagree on "
                + "; ".join(problems)
                + f" [raised on every rank; this is rank {self.rank}]"
            )

    def _gather_static_scales(self, device) -> None:
        self.a13_scale_all = None
        if self.experts.a13_scale is None:
            return
        mine = self.experts.a13_scale.detach().float().contiguous().to(device)
        every = [torch.empty_like(mine) for _ in range(self.world_size)]
        dist.all_gather(every, mine, group=self.group)
        self.a13_scale_all = torch.cat(every)  # [E_total], global expert order

    # ------------------------------------------------------------------ routing
    def route(self, x2d: torch.Tensor, router_logits: torch.Tensor | None = None):
        """(topk_ids int32 [T, K] *global* expert ids, topk_weights fp32 [T, K])."""
        if router_logits is None:
            # .float(): the buffer follows layer.to(dtype); logits stay fp32 (as MoELayer)
            router_logits = x2d.float() @ self.gate_weight.float().t()
        return self.router.route(router_logits, self.correction_bias)

    def _backend(self) -> str:
        b = self.policy.backend
        if b == "auto":
            return "triton" if self.experts.device.type == "cuda" else "reference"
        return b

    def _check_input(self, x, phase, router_logits, routes):
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"x: expected a torch.Tensor, got {type(x).__name__}")
        h = self.experts.hidden_size
        if x.dtype != torch.bfloat16:
            raise TypeError(f"x: expected torch.bfloat16, got {x.dtype}")
        if x.dim() < 1 or x.shape[-1] != h:
            raise ValueError(f"x: expected [..., {h}] (hidden size), got {tuple(x.shape)}")
        if x.device != self.experts.device:
            raise ValueError(f"x: on {x.device}, but the experts are on {self.experts.device}")
        if phase is not None and phase not in PHASES:
            raise ValueError(f"phase: expected one of {PHASES} or None, got {phase!r}")
        x2d = x.reshape(-1, h)
        if routes is not None:
            ids, w = routes
            k = self.router.top_k
            t = x2d.shape[0]
            if not isinstance(ids, torch.Tensor) or ids.dtype != torch.int32:
                raise TypeError("routes: topk_ids must be an int32 tensor")
            if not isinstance(w, torch.Tensor) or w.dtype != torch.float32:
                raise TypeError("routes: topk_weights must be a float32 tensor")
            if tuple(ids.shape) != (t, k) or tuple(w.shape) != (t, k):
                raise ValueError(
                    f"routes: expected topk_ids and topk_weights of shape [{t}, {k}] "
                    f"(tokens, router top_k), got {tuple(ids.shape)} and {tuple(w.shape)}"
                )
            if ids.numel() and not _capturing():
                hi = int(ids.max())
                if hi >= self.num_experts_total:
                    raise ValueError(
                        f"routes: expert id {hi} out of range (E_total={self.num_experts_total})"
                    )
        else:
            if router_logits is not None and tuple(router_logits.shape) != (
                x2d.shape[0],
                self.num_experts_total,
            ):
                raise ValueError(
                    f"router_logits: expected [{x2d.shape[0]}, {self.num_experts_total}], "
                    f"got {tuple(router_logits.shape)}"
                )
            ids, w = self.route(x2d, router_logits)
        if self.max_tokens is not None and x2d.shape[0] > self.max_tokens:
            raise ValueError(
                f"x: {x2d.shape[0]} tokens, more than the declared max_tokens={self.max_tokens}"
            )
        return x2d, ids.contiguous(), w.contiguous()

    # ------------------------------------------------------------------ forward
    def forward(
        self,
        x: torch.Tensor,
        phase: str | None = None,
        *,
        router_logits: torch.Tensor | None = None,
        routes: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """x: bf16 [..., H], this rank's tokens -> bf16 [..., H]. A collective call.

        phase: "prefill", "decode" or None (the ``serving_phase`` context, else the
        policy's threshold applied to the *global* token count, the sum over ranks; a
        layer with ``max_tokens`` runs as decode then). Every rank must ask for the same
        phase. routes: precomputed (topk_ids int32 *global* ids, topk_weights fp32) [T, K].

        A rank whose input is invalid raises its TypeError/ValueError after the count
        exchange, and every other rank raises a ValueError naming it: no rank is left
        waiting in a collective.

        The call is ``combine(d, compute_experts(d))`` with ``d = dispatch(...)``; the three
        steps are public so that they can be timed one by one (``fp4moe bench --ep``)."""
        d = self.dispatch(x, phase, router_logits=router_logits, routes=routes)
        return self.combine(d, self.compute_experts(d))

    def dispatch(
        self,
        x: torch.Tensor,
        phase: str | None = None,
        *,
        router_logits: torch.Tensor | None = None,
        routes: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> EPDispatch:
        """Step 1 of ``forward`` (a collective; same arguments): route, exchange the counts,
        quantize (W4A4, W4A8) and send the rows to their expert ranks, and receive this rank's
        rows. Returns the state that ``compute_experts`` and ``combine`` take."""
        dev = self.experts.device
        k = self.router.top_k
        local_error: Exception | None = None
        requested = None
        try:
            requested = phase if phase is not None else current_phase()
            x2d, ids, w = self._check_input(x, phase, router_logits, routes)
            shape = x.shape
        except (TypeError, ValueError) as exc:
            local_error = exc
            h = self.experts.hidden_size
            x2d = torch.zeros(0, h, dtype=torch.bfloat16, device=dev)
            ids = torch.zeros(0, k, dtype=torch.int32, device=dev)
            w = torch.zeros(0, k, dtype=torch.float32, device=dev)
            requested = None
        t = x2d.shape[0]
        world, epr, e_total = self.world_size, self.experts_per_rank, self.num_experts_total

        # Send order: valid routes sorted by global expert id (so by destination rank, then
        # by its local expert), stable in (token, k); masked routes last.
        flat = ids.reshape(-1).long()
        key = torch.where(flat >= 0, flat, torch.full_like(flat, e_total))
        perm = torch.sort(key, stable=True).indices
        sorted_key = key[perm]
        counts = torch.zeros(e_total + 1, dtype=torch.int64, device=dev)
        counts.scatter_add_(0, key, torch.ones_like(key))
        send_counts = counts[:e_total].reshape(world, epr)

        meta = torch.empty(world, epr + _META_EXTRA, dtype=torch.int64, device=dev)
        meta[:, :epr] = send_counts
        meta[:, epr] = t
        meta[:, epr + 1] = _PHASE_CODE[requested]
        meta[:, epr + 2] = int(local_error is not None)
        meta_recv = torch.empty_like(meta)
        dist.all_to_all_single(meta_recv, meta, group=self.group)
        plan = self._plan(meta, meta_recv, requested, local_error)

        cfg = plan.cfg
        self.stats.calls[plan.phase] += 1
        self.stats.tokens[plan.phase] += t
        mode, act = cfg.mode, cfg.act_scale if cfg.mode == "w4a4" else "per_token"
        backend = self._backend()
        row_bytes = wire_row_bytes(self.experts.hidden_size, mode, act)
        payload, fc1_global = self._home_rows(x2d, perm, sorted_key, k, mode, act, backend)

        # Dispatch.
        if self.max_tokens is None:
            n_send = sum(plan.send_splits)
            recv = torch.empty(sum(plan.recv_splits), row_bytes, dtype=torch.uint8, device=dev)
            dist.all_to_all_single(
                recv, payload[:n_send].contiguous(), plan.recv_splits, plan.send_splits,
                group=self.group,
            )  # fmt: skip
            row_expert = torch.repeat_interleave(
                torch.arange(epr, device=dev).repeat(world), plan.recv_counts.reshape(-1)
            )
            slot = torch.arange(flat.numel(), device=dev)  # sorted position = row sent
        else:
            n_send = None
            cap = self.max_tokens * k
            dest = sorted_key // epr  # world for masked routes
            starts = torch.cumsum(send_counts.sum(1), 0) - send_counts.sum(1)
            pos = torch.arange(flat.numel(), device=dev) - starts[dest.clamp(max=world - 1)]
            slot = torch.where(sorted_key < e_total, dest * cap + pos, world * cap)
            send = torch.zeros(world * cap + 1, row_bytes, dtype=torch.uint8, device=dev)
            send[slot] = payload
            recv = torch.empty(world * cap, row_bytes, dtype=torch.uint8, device=dev)
            dist.all_to_all_single(recv, send[: world * cap], group=self.group)
            ends = torch.cumsum(plan.recv_counts, 1)  # [world, epr]
            j = torch.arange(cap, device=dev).expand(world, cap).contiguous()
            row_expert = torch.searchsorted(ends, j, right=True)
            row_expert = torch.where(row_expert < epr, row_expert, -1).reshape(-1)

        rows = self._unpack(recv, row_expert, mode, act, fc1_global)
        return EPDispatch(
            rows=rows, row_expert=row_expert, mode=mode, act_scale=act, backend=backend,
            row_bytes=row_bytes, plan=plan, ids=ids, weights=w, perm=perm,
            sorted_key=sorted_key, slot=slot, n_send=n_send, shape=shape,
        )  # fmt: skip

    def compute_experts(self, d: EPDispatch) -> torch.Tensor:
        """Step 2 of ``forward``: the route rows y (bf16 [rows received, H]) of the rows
        ``d`` received, on this rank's experts (``compute_route_rows``). A collective only
        for W4A4 per-tensor (an ``all_reduce(max)`` of the FC2 amax)."""
        reduce = self.all_reduce_max if (d.mode == "w4a4" and d.act_scale == "per_tensor") else None
        return compute_route_rows(
            d.rows, d.row_expert, self.experts, mode=d.mode, act_scale=d.act_scale,
            backend=d.backend, amax_reduce=reduce,
        )  # fmt: skip

    def combine(self, d: EPDispatch, y: torch.Tensor) -> torch.Tensor:
        """Step 3 of ``forward`` (a collective): send the route rows ``y`` back to their
        home ranks and run the deterministic finalize there; returns bf16 [..., H] in the
        shape of the ``x`` given to ``dispatch``. Sets ``last_comm_bytes``."""
        dev = self.experts.device
        plan, world, epr = d.plan, self.world_size, self.experts_per_rank
        hb = 2 * self.experts.hidden_size
        y_bytes = y.contiguous().view(torch.uint8).reshape(-1, hb)
        if self.max_tokens is None:
            back = torch.empty(d.n_send, hb, dtype=torch.uint8, device=dev)
            dist.all_to_all_single(
                back, y_bytes, plan.send_splits, plan.recv_splits, group=self.group
            )
        else:
            cap = self.max_tokens * self.router.top_k
            back = torch.empty(world * cap, hb, dtype=torch.uint8, device=dev)
            dist.all_to_all_single(back, y_bytes, group=self.group)
        self._account(plan, d.row_bytes, hb, epr)

        # Finalize on the home rank: route r's row is back[route_pos[r]].
        n_routes = d.perm.numel()
        route_pos = torch.zeros(n_routes, dtype=torch.int64, device=dev)
        route_pos[d.perm] = torch.where(d.sorted_key < self.num_experts_total, d.slot, 0)
        y_rows = back.view(torch.bfloat16)
        return self._finalize(y_rows, route_pos, d.ids, d.weights, d.backend).reshape(d.shape)

    def _plan(self, meta, meta_recv, requested, local_error) -> _Plan:
        world, epr = self.world_size, self.experts_per_rank
        send_counts = meta[:, :epr]
        recv_counts = meta_recv[:, :epr]
        if self.max_tokens is not None and _capturing():
            # No host reads under CUDA-graph capture: no checks, phase from the caller.
            phase = requested or "decode"
            return _Plan(send_counts, recv_counts, None, None, self._cfg(phase), phase)
        both = torch.stack([meta, meta_recv]).cpu()
        if local_error is not None:
            raise type(local_error)(
                f"{local_error} [EPMoELayer.forward on rank {self.rank}; every rank of the "
                "group raises]"
            ) from local_error
        m_recv = both[1]
        bad = [r for r in range(world) if int(m_recv[r, epr + 2]) != 0]
        if bad:
            raise ValueError(
                f"EPMoELayer.forward: rank(s) {bad} rejected their input (see the error raised "
                f"there); rank {self.rank} raises too so that no rank waits on the others"
            )
        codes = [int(m_recv[r, epr + 1]) for r in range(world)]
        if len(set(codes)) > 1:
            names = {v: k for k, v in _PHASE_CODE.items()}
            shown = ", ".join(f"rank {r}: {names[c]!r}" for r, c in enumerate(codes))
            raise ValueError(
                f"EPMoELayer.forward: the ranks asked for different phases ({shown}); every "
                "rank must run the same phase (same wire format) in one call"
            )
        if requested is not None:
            phase = requested
        elif self.max_tokens is not None:
            phase = "decode"
        else:
            phase = self.policy.phase_of(int(m_recv[:, epr].sum()), None)
        send_splits = both[0, :, :epr].sum(1).tolist()
        recv_splits = m_recv[:, :epr].sum(1).tolist()
        return _Plan(send_counts, recv_counts, send_splits, recv_splits, self._cfg(phase), phase)

    def _cfg(self, phase: str) -> PhaseConfig:
        return self.policy.prefill if phase == "prefill" else self.policy.decode

    def all_reduce_max(self, amax: torch.Tensor) -> torch.Tensor:
        """The max of ``amax`` (a one-element tensor) over the layer's group: fp32 [] (a
        copy; ``amax`` is not written). W4A4 per-tensor's global scales come from it."""
        buf = amax.detach().float().reshape(1).clone()
        dist.all_reduce(buf, op=dist.ReduceOp.MAX, group=self.group)
        return buf.reshape(())

    def _home_rows(self, x2d, perm, sorted_key, k, mode, act, backend):
        """The dispatched payload, one uint8 row per route in send order, and (per-tensor)
        the global FC1 scale. Quantization is that of the single-process layer: W4A8, W4A4
        per-token and per-tensor on the token rows, static per route with its expert's a13
        scale."""
        dev = x2d.device
        t = x2d.shape[0]
        src = perm // k  # token of each route in send order
        if mode == "w4a16":
            return pack_rows([x2d])[src], None
        if mode == "w4a8":  # e4m3_rows defines the rows on every backend (numerics 5a)
            return pack_rows(list(e4m3_rows(x2d)))[src], None
        if act == "per_tensor":
            amax = (
                x2d.abs().amax().float() if t else torch.zeros((), dtype=torch.float32, device=dev)
            )
            g = global_from_amax(self.all_reduce_max(amax))
        if backend == "triton":
            from .kernels.quantize import MODE_PER_ROW, MODE_SCALAR, MODE_STATIC, quantize_rows

            if act == "per_token":
                c, s, gl = quantize_rows(x2d.contiguous(), t, mode=MODE_PER_ROW, pdl=False)
                return pack_rows([c, s, gl])[src], None
            if act == "per_tensor":
                c, s, _ = quantize_rows(
                    x2d.contiguous(), t, mode=MODE_SCALAR, table=g.reshape(1), pdl=False
                )
                return pack_rows([c, s])[src], g
            expert = sorted_key.clamp(max=self.num_experts_total - 1).to(torch.int32)
            c, s, _ = quantize_rows(
                x2d.contiguous(), perm.numel(), mode=MODE_STATIC, index=perm.to(torch.int32),
                div=k, table=self.a13_scale_all, row_expert=expert, pdl=False,
            )  # fmt: skip
            return pack_rows([c, s]), None
        if act == "per_token":
            g_rows = global_from_amax(x2d.abs().amax(dim=-1))
            c, s = quantize_blocks(x2d, g_rows)
            return pack_rows([c, s, g_rows])[src], None
        if act == "per_tensor":
            c, s = quantize_blocks(x2d, g)
            return pack_rows([c, s])[src], g
        expert = sorted_key.clamp(max=self.num_experts_total - 1)
        c, s = quantize_blocks(x2d[src], self.a13_scale_all[expert])
        return pack_rows([c, s]), None

    def _unpack(self, recv, row_expert, mode, act, fc1_global):
        glob = None  # W4A4 globals known here: the expert's static scale, the batch's
        if mode == "w4a4" and act == "static":
            glob = self.experts.a13_scale[row_expert.clamp(min=0)]
        elif mode == "w4a4" and act == "per_tensor":
            glob = fc1_global.reshape(1).expand(recv.shape[0]).contiguous()
        return unpack_rows(recv, self.experts.hidden_size, mode, act, glob)

    def _finalize(self, y_rows, route_pos, ids, w, backend) -> torch.Tensor:
        t, k = ids.shape
        h = self.experts.hidden_size
        if backend == "triton" and t:
            from .kernels.finalize import finalize_rows

            if y_rows.shape[0] == 0:
                y_rows = torch.zeros(1, h, dtype=torch.bfloat16, device=y_rows.device)
            return finalize_rows(y_rows, route_pos.to(torch.int32), ids, w)
        if y_rows.shape[0] == 0:
            y_full = torch.zeros(t, k, h, dtype=torch.bfloat16, device=y_rows.device)
        else:
            y_full = y_rows[route_pos].reshape(t, k, h)
        return finalize_reference(y_full, ids, w)

    def _account(self, plan: _Plan, row_bytes: int, hb: int, epr: int) -> None:
        world, r = self.world_size, self.rank
        if self.max_tokens is None:
            send, recv = plan.send_splits, plan.recv_splits
        else:
            cap = self.max_tokens * self.router.top_k
            send = recv = [cap] * world
        others_send = sum(v for d, v in enumerate(send) if d != r)
        others_back = sum(v for d, v in enumerate(recv) if d != r)
        self.last_comm_bytes = {
            "dispatch": others_send * row_bytes,
            "combine": others_back * hb,
            "metadata": (world - 1) * (epr + _META_EXTRA) * 8,
            "dispatch_self": send[r] * row_bytes,
            "combine_self": recv[r] * hb,
            "dispatch_rows": sum(send),
            "recv_rows": sum(recv),
        }

    def memory_report(self) -> dict[str, int]:
        """Bytes of this rank's expert slice and router (as ``MoELayer.memory_report``)."""
        e, h, i = (self.experts.num_experts, self.experts.hidden_size,
                   self.experts.intermediate_size)  # fmt: skip
        router = sum(b.numel() * b.element_size() for b in self.buffers())
        return {
            "expert_bytes": self.experts.nbytes(),
            "router_bytes": router,
            "bf16_expert_bytes": e * 3 * h * i * 2,
            "copies_of_expert_weights": 1,
        }

    def extra_repr(self) -> str:
        start, stop = self.expert_range
        return (
            f"rank={self.rank}/{self.world_size}, experts=[{start}, {stop}) of "
            f"{self.num_experts_total}, H={self.experts.hidden_size}, "
            f"I={self.experts.intermediate_size}, router={self.router.method}/"
            f"top{self.router.top_k}, prefill={self.policy.prefill}, "
            f"decode={self.policy.decode}, max_tokens={self.max_tokens}"
        )
