"""MoERunner: repeated MoE calls (decode) as CUDA-graph replays over static workspaces."""

from __future__ import annotations

import torch

from .experts import PreparedExperts
from .modes import resolve_mode
from .moe import validate_moe_inputs

__all__ = ["MoERunner"]


class MoERunner:
    """Runs ``fp4moe.moe`` (Triton backend) for up to ``max_tokens`` tokens a call by
    replaying CUDA graphs captured once per token-count bucket (1, 2, 4, ..., max_tokens).

    A call copies its inputs into static buffers, masks the padding rows of its bucket
    (ids -1, x 0: they contribute nothing and do not move a per-tensor amax), replays the
    bucket's graph and returns a view of the bucket's static output. The graphs and their
    workspaces come from one memory pool, captured on first use of each bucket, so a
    replay allocates nothing. ``mode`` is a name of ``fp4moe.modes`` (``"w4a16"``,
    ``"w4a8"``, ``"w4a4-token"``, ...). Calls above ``max_tokens`` fall back to an eager
    ``fp4moe.moe`` call. Without CUDA (tests on the interpreter) the same buffers are used
    with eager kernel launches.

    The returned tensor is overwritten by the next call of the same bucket: clone it to keep it.
    """

    def __init__(
        self,
        experts: PreparedExperts,
        *,
        max_tokens: int,
        top_k: int,
        mode: str = "w4a16",
        act_scale: str | None = None,
        fused_finalize: bool = False,
        options=None,
    ) -> None:
        if not isinstance(experts, PreparedExperts):
            raise TypeError(f"experts: expected PreparedExperts, got {type(experts).__name__}")
        if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
            raise ValueError(f"max_tokens: expected a positive int, got {max_tokens!r}")
        if isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 1:
            raise ValueError(f"top_k: expected a positive int, got {top_k!r}")
        mode, act_scale = resolve_mode(mode, act_scale)  # names of fp4moe.modes
        self.experts = experts
        self.max_tokens = max_tokens
        self.top_k = top_k
        self.mode = mode
        self.act_scale = act_scale
        self.fused_finalize = fused_finalize
        self.options = options
        dev = experts.device
        self.use_graphs = dev.type == "cuda"
        h = experts.hidden_size
        self._x = torch.zeros(max_tokens, h, dtype=torch.bfloat16, device=dev)
        self._ids = torch.full((max_tokens, top_k), -1, dtype=torch.int32, device=dev)
        self._w = torch.zeros(max_tokens, top_k, dtype=torch.float32, device=dev)
        self.buckets = []
        b = 1
        while b < max_tokens:
            self.buckets.append(b)
            b *= 2
        self.buckets.append(max_tokens)
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self._pool = torch.cuda.graph_pool_handle() if self.use_graphs else None

    def _run(self, b: int) -> torch.Tensor:
        from .backend.launch import moe_triton

        return moe_triton(
            self._x[:b], self._ids[:b], self._w[:b], self.experts, mode=self.mode,
            act_scale=self.act_scale, fused_finalize=self.fused_finalize, options=self.options,
        )  # fmt: skip

    def _graph(self, b: int) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        if b not in self._graphs:
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                self._run(b)  # compile the kernels outside the capture
            torch.cuda.current_stream().wait_stream(side)
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, pool=self._pool):
                out = self._run(b)
            self._graphs[b] = (g, out)
        return self._graphs[b]

    def memory_bytes(self) -> int:
        """Bytes of the static input buffers (graph workspaces live in the graph pool)."""
        return sum(t.numel() * t.element_size() for t in (self._x, self._ids, self._w))

    def __call__(
        self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor
    ) -> torch.Tensor:
        """bf16 [T, H] for bf16 x [T, H], int32 ids and fp32 weights [T, K] (see ``moe``)."""
        validate_moe_inputs(
            x, topk_ids, topk_weights, self.experts, mode=self.mode, act_scale=self.act_scale,
            check_ids=not x.is_cuda,
        )  # fmt: skip
        t = x.shape[0]
        if topk_ids.shape[1] != self.top_k:
            raise ValueError(
                f"topk_ids: runner built for K={self.top_k}, got K={topk_ids.shape[1]}"
            )
        if t == 0:
            return torch.empty(0, x.shape[1], dtype=torch.bfloat16, device=x.device)
        if t > self.max_tokens:
            from .moe import moe

            return moe(
                x, topk_ids, topk_weights, self.experts, mode=self.mode,
                act_scale=self.act_scale, fused_finalize=self.fused_finalize, backend="triton",
            )  # fmt: skip
        b = next(s for s in self.buckets if s >= t)
        self._x[:t].copy_(x)
        self._ids[:t].copy_(topk_ids)
        self._w[:t].copy_(topk_weights)
        if b > t:
            self._x[t:b].zero_()
            self._ids[t:b].fill_(-1)
        if not self.use_graphs:
            return self._run(b)[:t]
        g, out = self._graph(b)
        g.replay()
        return out[:t]
