"""The layer behind ``fp4moe demo --layer``: synthetic weights, calibration, the bf16 baseline,
the table. (The default ``fp4moe demo``, a small transformer generating, is in demo_model.py.)

The weights are not plain Gaussian: each matrix has log-normal row and column scales and a
few outlier input columns, and the tokens have log-normal channel and token scales with a
few massive channels, as trained MoE layers do. That is what makes the NVFP4 block scales
and the activation scale modes (per-token, static, per-tensor) differ in error.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from .experts import PreparedExperts, prepare_experts
from .modes import MODE_NAMES, relative_error
from .moe import moe
from .nvfp4 import global_from_amax
from .routing import route

__all__ = [
    "DEMO_MODES",
    "DemoConfig",
    "DemoLayer",
    "DemoResult",
    "calibrate_static_scales",
    "format_table",
    "moe_bf16",
    "render_demo",
    "run_demo",
    "synthetic_layer",
    "synthetic_tokens",
]

# The modes of the demo, in table order (the names of fp4moe.modes).
DEMO_MODES = MODE_NAMES


@dataclass(frozen=True)
class DemoConfig:
    hidden: int = 512
    inter: int = 256
    experts: int = 16
    top_k: int = 4
    tokens: int = 64
    calib_tokens: int = 256
    seed: int = 0
    repeats: int = 5
    device: str = "cpu"
    backend: str = "auto"

    def __post_init__(self) -> None:
        for name in ("hidden", "inter"):
            v = getattr(self, name)
            if v < 32 or v % 32:
                raise ValueError(f"{name}: expected a positive multiple of 32, got {v}")
        if self.experts < 1:
            raise ValueError(f"experts: expected at least 1, got {self.experts}")
        if not 1 <= self.top_k <= self.experts:
            raise ValueError(f"top_k: expected 1..{self.experts} (experts), got {self.top_k}")
        for name in ("tokens", "calib_tokens", "repeats"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: expected at least 1, got {getattr(self, name)}")


@dataclass
class DemoLayer:
    """bf16 weights of one SwiGLU MoE layer, and the token distribution that feeds it."""

    w13: torch.Tensor  # bf16 [E, 2I, H]: I gate rows, then I up rows
    w2: torch.Tensor  # bf16 [E, H, I]
    router: torch.Tensor  # fp32 [E, H]
    router_bias: torch.Tensor  # fp32 [E]: some experts are more popular than others
    channel_scale: torch.Tensor  # fp32 [H]: per-channel token magnitude
    massive: torch.Tensor  # int64 [2]: channels with a large, nearly constant value


def _scaled_gaussian(
    shape: tuple[int, int, int], outlier_cols: torch.Tensor, g: torch.Generator
) -> torch.Tensor:
    """[E, R, C] fp32 with std ~ 1/sqrt(C), log-normal row/column scales, outlier columns."""
    e, r, c = shape
    w = torch.randn(e, r, c, generator=g)
    w *= torch.exp(0.35 * torch.randn(e, r, 1, generator=g))  # per output row
    w *= torch.exp(0.35 * torch.randn(e, 1, c, generator=g))  # per input column
    gain = 4.0 + 4.0 * torch.rand(e, 1, outlier_cols.numel(), generator=g)
    w[:, :, outlier_cols] *= gain
    return w / math.sqrt(c)


def synthetic_layer(hidden: int, inter: int, experts: int, *, seed: int = 0) -> DemoLayer:
    """Random but realistically shaped bf16 weights (on the CPU, reproducible from ``seed``)."""
    g = torch.Generator().manual_seed(seed)
    # Outlier input columns: the same hidden channels for every expert's FC1 (they are
    # channels of the residual stream), a separate set for FC2.
    out13 = torch.randperm(hidden, generator=g)[: max(1, hidden // 128)]
    out2 = torch.randperm(inter, generator=g)[: max(1, inter // 128)]
    w13 = _scaled_gaussian((experts, 2 * inter, hidden), out13, g)
    w2 = _scaled_gaussian((experts, hidden, inter), out2, g)
    router = torch.randn(experts, hidden, generator=g) / math.sqrt(hidden)
    massive = torch.randperm(hidden, generator=g)[:2]
    router[:, massive] *= 0.05  # trained routers all but ignore the massive channels
    return DemoLayer(
        w13=w13.to(torch.bfloat16),
        w2=w2.to(torch.bfloat16),
        router=router,
        router_bias=0.7 * torch.randn(experts, generator=g),
        channel_scale=torch.exp(0.5 * torch.randn(hidden, generator=g)),
        massive=massive,
    )


def synthetic_tokens(
    layer: DemoLayer, tokens: int, *, seed: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(x bf16 [T, H], router logits fp32 [T, E]) on the CPU.

    Channels have log-normal scales and two carry a "massive activation" (about 20 times
    the typical channel's magnitude, nearly the same in every token, as in trained
    transformers); each token has a log-normal magnitude. The logits are scaled to a
    standard deviation of 1.5 plus an expert bias, so the softmax is peaked and the experts
    unevenly loaded.
    """
    g = torch.Generator().manual_seed(seed)
    hidden = layer.channel_scale.numel()
    x = torch.randn(tokens, hidden, generator=g) * layer.channel_scale
    x[:, layer.massive] = 20.0 * (1.0 + 0.1 * torch.randn(tokens, 2, generator=g))
    x *= torch.exp(0.3 * torch.randn(tokens, 1, generator=g))
    x = x.to(torch.bfloat16)
    raw = x.float() @ layer.router.t()
    logits = 1.5 * raw / raw.std().clamp_min(1e-6) + layer.router_bias
    return x, logits


def _swiglu_bf16(x: torch.Tensor, w13: torch.Tensor) -> torch.Tensor:
    """a = silu(x @ Wg^T) * (x @ Wu^T) with bf16 matmuls; x bf16 [n, H], w13 bf16 [2I, H]."""
    gate, up = (x @ w13.t()).float().chunk(2, dim=-1)
    return (F.silu(gate) * up).to(torch.bfloat16)


def moe_bf16(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
) -> torch.Tensor:
    """The plain bf16 MoE layer, the accuracy baseline: bf16 [T, H]."""
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    ids = topk_ids.long()
    for e in range(w13.shape[0]):
        tok, slot = (ids == e).nonzero(as_tuple=True)
        if tok.numel():
            y = _swiglu_bf16(x[tok], w13[e]) @ w2[e].t()
            out.index_add_(0, tok, topk_weights[tok, slot, None] * y.float())
    return out.to(torch.bfloat16)


def calibrate_static_scales(
    x: torch.Tensor, topk_ids: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Static W4A4 activation globals (a13, a2), fp32 [E]: amax / 2688 per expert.

    a13 from the FC1 inputs routed to each expert, a2 from its FC2 inputs (the bf16 SwiGLU
    output). An expert that sees no calibration token takes the largest amax of the others.
    """
    num_experts = w13.shape[0]
    amax13 = torch.zeros(num_experts, dtype=torch.float32, device=x.device)
    amax2 = torch.zeros_like(amax13)
    for e in range(num_experts):
        rows = (topk_ids == e).any(dim=1)
        if bool(rows.any()):
            xe = x[rows]
            amax13[e] = xe.abs().amax().float()
            amax2[e] = _swiglu_bf16(xe, w13[e]).abs().amax().float()
    for amax in (amax13, amax2):
        amax[amax == 0] = amax.max()
    return global_from_amax(amax13), global_from_amax(amax2)


@dataclass
class DemoResult:
    config: DemoConfig
    rows: list[dict] = field(default_factory=list)
    experts: PreparedExperts | None = None
    prepared_bytes: int = 0
    bf16_bytes: int = 0
    experts_touched: int = 0
    routes_per_expert: tuple[int, int] = (0, 0)
    seconds: float = 0.0

    def to_json(self) -> dict:
        return {
            "config": self.config.__dict__,
            "rows": self.rows,
            "prepared_bytes": self.prepared_bytes,
            "bf16_bytes": self.bf16_bytes,
            "experts_touched": self.experts_touched,
            "routes_per_expert_min_max": list(self.routes_per_expert),
            "same_prepared_tensors": True,
            "seconds": self.seconds,
            "torch": torch.__version__,
        }


def _median_ms(fn: Callable[[], torch.Tensor], repeats: int, device: torch.device) -> float:
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def _tensor_ids(experts: PreparedExperts) -> dict[str, tuple[int, int]]:
    return {k: (id(v), v.data_ptr()) for k, v in experts.tensors().items()}


def run_demo(cfg: DemoConfig) -> DemoResult:
    """Prepare once, route, and run every mode against the bf16 layer (``fp4moe demo --layer``)."""
    start = time.perf_counter()
    device = torch.device(cfg.device)
    res = DemoResult(config=cfg)
    layer = synthetic_layer(cfg.hidden, cfg.inter, cfg.experts, seed=cfg.seed)
    w13, w2 = layer.w13.to(device), layer.w2.to(device)

    # Static activation scales from a separate calibration batch, then one prepared copy.
    x_cal, logits_cal = synthetic_tokens(layer, cfg.calib_tokens, seed=cfg.seed + 1)
    ids_cal, _ = route(logits_cal.to(device), cfg.top_k, method="softmax")
    a13, a2 = calibrate_static_scales(x_cal.to(device), ids_cal, w13, w2)
    experts = prepare_experts(w13, w2, a13_scale=a13, a2_scale=a2)
    res.experts = experts
    res.prepared_bytes = experts.nbytes()
    res.bf16_bytes = (w13.numel() + w2.numel()) * w13.element_size()
    before = _tensor_ids(experts)
    snapshot = experts.to_linear()

    x, logits = synthetic_tokens(layer, cfg.tokens, seed=cfg.seed + 2)
    x, logits = x.to(device), logits.to(device)
    topk_ids, topk_weights = route(logits, cfg.top_k, method="softmax")
    counts = torch.bincount(topk_ids.flatten().long(), minlength=cfg.experts)
    res.experts_touched = int((counts > 0).sum())
    res.routes_per_expert = (int(counts.min()), int(counts.max()))

    baseline = moe_bf16(x, topk_ids, topk_weights, w13, w2)
    ms = _median_ms(lambda: moe_bf16(x, topk_ids, topk_weights, w13, w2), cfg.repeats, device)
    res.rows.append(
        {
            "mode": "bf16",
            "backend": "torch",
            "rel_error": 0.0,
            "median_ms": ms,
            "weight_bytes": res.bf16_bytes,
            "weight_format": "bf16",
        }
    )

    for mode in DEMO_MODES:
        backend = cfg.backend
        if backend == "auto":
            backend = "triton" if device.type == "cuda" else "reference"

        def call(backend: str = backend, mode: str = mode):
            return moe(x, topk_ids, topk_weights, experts, mode=mode, backend=backend)

        out = call()
        ms = _median_ms(lambda b=backend: call(backend=b), cfg.repeats, device)
        res.rows.append(
            {
                "mode": mode,
                "backend": backend,
                "rel_error": relative_error(out, baseline),
                "median_ms": ms,
                "weight_bytes": res.prepared_bytes,
                "weight_format": "NVFP4",
            }
        )
        if _tensor_ids(experts) != before:
            raise AssertionError(f"{mode}: the prepared tensors were replaced")

    after = experts.to_linear()
    if sorted(after) != sorted(snapshot) or not all(
        torch.equal(after[k], snapshot[k]) for k in snapshot
    ):
        raise AssertionError("a call modified the prepared experts")
    res.seconds = time.perf_counter() - start
    return res


def _mib(n: int) -> str:
    return f"{n / 2**20:.2f} MiB"


def format_table(headers: list[str], rows: list[list[str]], align: str) -> str:
    """A plain aligned text table; ``align`` has one "l" or "r" a column."""
    widths = [max(len(h), *(len(r[j]) for r in rows)) for j, h in enumerate(headers)]

    def line(cells: list[str]) -> str:
        return "  ".join(
            c.rjust(w) if a == "r" else c.ljust(w) for c, w, a in zip(cells, widths, align)
        ).rstrip()

    return "\n".join([line(headers), "  ".join("-" * w for w in widths), *map(line, rows)])


def render_demo(res: DemoResult) -> str:
    """The report ``fp4moe demo --layer`` prints."""
    cfg = res.config
    lo, hi = res.routes_per_expert
    lines = [
        f"fp4moe demo --layer: E={cfg.experts} experts, H={cfg.hidden}, I={cfg.inter}, "
        f"top-{cfg.top_k}, T={cfg.tokens} tokens, device {cfg.device}, seed {cfg.seed}",
        f"routes: softmax top-{cfg.top_k}, renormalized; {res.experts_touched}/{cfg.experts} "
        f"experts touched, {lo} to {hi} routes an expert",
        f"prepared once: {res.experts!r}",
        f"static a13/a2 scales calibrated on {cfg.calib_tokens} separate tokens",
        "",
    ]
    table = [
        [
            r["mode"],
            r["backend"],
            f"{r['rel_error']:.4f}" if r["mode"] != "bf16" else "baseline",
            f"{r['median_ms']:.2f}",
            f"{_mib(r['weight_bytes'])} {r['weight_format']}",
        ]
        for r in res.rows
    ]
    headers = ["mode", "backend", "rel err vs bf16", "median ms", "expert weights"]
    lines.append(format_table(headers, table, "llrrr"))
    modes = len(res.rows) - 1
    lines += [
        "",
        f"rel err = ||out - bf16 layer|| / ||bf16 layer||; median of {cfg.repeats} runs.",
        f"All {modes} modes read the same prepared tensors (one PreparedExperts; every tensor's "
        "object and data pointer checked after each mode, contents unchanged).",
        f"NVFP4 experts: {_mib(res.prepared_bytes)}, "
        f"{res.prepared_bytes / res.bf16_bytes:.3f} of the bf16 weights ({_mib(res.bf16_bytes)}).",
        "w4a4-tensor takes one activation scale over the whole batch: a token's output "
        "depends on the other tokens (numerics section 7).",
    ]
    lines.append(f"done in {res.seconds:.1f} s")
    return "\n".join(lines)
