"""``fp4moe bench``: the MoE layer on a CUDA GPU against the baselines a user would pick.

Per token count and mode: median microseconds over CUDA-graph replays, TFLOP/s, GB/s of
expert weights, fraction of the byte floor (touched NVFP4 expert bytes over this card's
copy bandwidth, measured in the same run), fraction of the roofline and which bound sets
it (the larger of the byte floor and the FLOPs over this card's matmul rate, measured in
the same run: the FP8 rate for W4A8 rows, which multiply on the FP8 tensor cores, the bf16
rate for the others; the rows keep the bytes and the FLOPs), speed-up over a bf16
``torch._grouped_mm`` MoE and over the naive NVFP4 path (dequantize every expert, then the
same grouped GEMMs), and the unfused/fused ratio. Output: a table, and JSON, CSV and (with
matplotlib) a PNG plot with the byte floor and the roofline. Each timed configuration is
checked against the reference once before it is timed.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import os
import statistics
import subprocess
import sys
import time
from dataclasses import asdict

import torch

from .modes import TOLERANCE, relative_error
from .presets import MODES, PRESETS, Preset
from .progress import step_line
from .roofline import bound, compute_roof, roofline_us

__all__ = [
    "PRESETS",
    "Preset",
    "add_arguments",
    "run",
]


DEFAULT_TOKENS = [2**i for i in range(15)]  # 1 .. 16384


def _count(text: str) -> int:
    """argparse type: an int >= 0."""
    v = int(text)
    if v < 0:
        raise argparse.ArgumentTypeError(f"expected a count >= 0, got {v}")
    return v


def _positive(text: str) -> int:
    """argparse type: an int >= 1."""
    v = int(text)
    if v < 1:
        raise argparse.ArgumentTypeError(f"expected an int >= 1, got {v}")
    return v


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--preset", default="deepseek-v3-ep8", choices=sorted(PRESETS))
    for name in ("hidden", "inter", "experts", "local-experts", "top-k"):
        p.add_argument(f"--{name}", type=int, default=None, help=f"override the preset's {name}")
    p.add_argument("--num-tokens", type=int, nargs="+", default=DEFAULT_TOKENS)
    p.add_argument(
        "--modes", nargs="+", default=["w4a4-tensor", "w4a4-token", "w4a16"], choices=sorted(MODES)
    )
    p.add_argument("--no-fused-finalize", action="store_true", help="deterministic finalize only")
    p.add_argument(
        "--finalize",
        choices=["fused", "unfused", "both"],
        default=None,
        help="time each row fused, unfused or both (default: both)",
    )
    p.add_argument("--no-cuda-graph", action="store_true", help="time eager calls")
    p.add_argument("--no-pdl", action="store_true", help="programmatic dependent launch off")
    p.add_argument(
        "--cold-l2",
        action="store_true",
        help="rotate several copies of the experts so weights never sit in L2",
    )
    p.add_argument("--no-baseline", action="store_true", help="skip the bf16 and naive baselines")
    p.add_argument("--no-check", action="store_true", help="skip the check against the reference")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--iters", type=int, default=20, help="timed samples a configuration")
    p.add_argument(
        "--rounds",
        type=_positive,
        default=5,
        help="the samples of a token count's configurations are taken in this many rounds, "
        "each configuration in turn (a rotated order each round), so that clock or "
        "temperature drift falls on all alike (default 5)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="bench-out", help="folder for JSON, CSV and PNG")
    p.add_argument(
        "--ep",
        type=int,
        default=None,
        metavar="N",
        help="expert parallelism over N processes, one GPU each (NCCL): the preset's experts "
        "split over the ranks, T tokens a rank; times dispatch, expert compute and combine "
        "separately, and the same expert compute alone on one GPU. Writes bench-ep.json and "
        "bench-ep.csv to --out (docs/expert-parallel.md)",
    )
    p.add_argument(
        "--ep-path",
        choices=["variable", "fixed", "both"],
        default="both",
        help="with --ep: the variable path (split sizes read on the host, eager), the "
        "fixed-capacity path (max_tokens = --num-tokens; CUDA-graph replays unless "
        "--no-cuda-graph, checked bitwise against the variable path first), or both "
        "(default)",
    )
    # Testing only (CI on CPU): gloo processes on the CPU with the reference backend.
    p.add_argument("--ep-backend", choices=["nccl", "gloo"], default=None, help=argparse.SUPPRESS)
    p.add_argument("--device", choices=["cuda", "cpu"], default=None, help=argparse.SUPPRESS)
    p.add_argument(
        "--ep-kernels", choices=["auto", "triton", "reference"], default="auto",
        help=argparse.SUPPRESS,
    )  # fmt: skip
    p.add_argument("--ep-timeout", type=float, default=600.0, help=argparse.SUPPRESS)


# ----------------------------------------------------------------------------- timing


def warm_up(fn, warmup: int) -> None:
    """``warmup`` (at least 1) calls on a side stream, so a CUDA-graph capture after them
    finds the kernels compiled and the allocator warm; the current stream waits for them."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(max(warmup, 1)):
            fn()
    torch.cuda.current_stream().wait_stream(s)


# The shortest GPU wait before a timed replay, microseconds.
HOLD_MIN_US = 20.0


def hold_cycles(submit_us: float) -> int:
    """GPU clock cycles to wait before a timed replay the host took ``submit_us``
    microseconds to submit: four times that, at least ``HOLD_MIN_US``, counted at 2.1 GHz
    (above any Hopper clock, so the wait lasts at least that long)."""
    return int(max(4.0 * submit_us, HOLD_MIN_US) * 2100)


class GraphTimer:
    """One configuration's call, warmed up and (``graph``) captured once as a CUDA graph of
    ``reps`` calls; ``sample(n)`` replays it once untimed, then ``n`` times, and returns
    each timed replay's microseconds a call (CUDA events).

    With ``graph`` each timed replay is enqueued behind a GPU wait longer than the host
    takes to submit it (``hold_cycles`` of the replay's measured submission), so the time
    is the GPU's, from the replay's first kernel to its last, as inside a model's graph
    where the host submits ahead of the GPU; without it the start event would also count
    the host's submission of the graph. Eager calls (not ``graph``) are timed from the
    host's first launch, which they pay."""

    def __init__(self, fn, *, graph: bool, warmup: int, reps: int = 1):
        warm_up(fn, warmup)
        self.reps = reps
        if graph:
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                for _ in range(reps):
                    fn()
            self._run = g.replay
            self._graph = g
        else:

            def run():
                for _ in range(reps):
                    fn()

            self._run = run
        self._run()
        torch.cuda.synchronize()
        self.hold_cycles = 0
        if graph:
            t0 = time.perf_counter()
            self._run()
            submit_us = (time.perf_counter() - t0) * 1e6
            torch.cuda.synchronize()
            self.hold_cycles = hold_cycles(submit_us)

    def replay(self) -> None:
        """One replay of the capture (or ``reps`` eager calls), not timed."""
        self._run()

    def sample(self, n: int) -> list[float]:
        """``n`` timed replays after one untimed one (the caches as a run of this
        configuration alone leaves them, whatever ran before)."""
        self._run()
        out = []
        for _ in range(n):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            if self.hold_cycles:
                torch.cuda._sleep(self.hold_cycles)
            a.record()
            self._run()
            b.record()
            b.synchronize()
            out.append(a.elapsed_time(b) * 1000 / self.reps)
        return out


def round_orders(names: list, rounds: int) -> list[list]:
    """The order of each round of ``time_interleaved``: ``names`` rotated by one place a
    round, so each configuration runs early in some rounds and late in others."""
    if rounds < 1:
        raise ValueError(f"rounds: expected an int >= 1, got {rounds!r}")
    n = len(names)
    return [[names[(r + i) % n] for i in range(n)] for r in range(rounds)] if n else []


def time_interleaved(
    fns: dict, *, graph: bool, warmup: int, iters: int, rounds: int = 1, reps: int = 1,
    timer=GraphTimer,
) -> dict:  # fmt: skip
    """Median microseconds of one call of each ``fns[name]()``, ``iters`` samples each
    (``reps`` calls a sample), taken in ``rounds`` rounds: every configuration is
    captured once, then each round samples each in turn (``round_orders``), about
    ``iters / rounds`` samples at a time after one untimed replay. A drift of the card's
    clock or temperature over the run (a power-capped matmul slows the next
    configurations) then falls on every configuration alike, so ratios between them
    taken in one run stay fair. ``timer``: the capture class (``GraphTimer``; tests pass
    a fake)."""
    if iters < 1:
        raise ValueError(f"iters: expected an int >= 1, got {iters!r}")
    timers = {name: timer(fn, graph=graph, warmup=warmup, reps=reps) for name, fn in fns.items()}
    samples: dict = {name: [] for name in fns}
    orders = round_orders(list(fns), rounds)
    for r, order in enumerate(orders):
        n = iters * (r + 1) // len(orders) - iters * r // len(orders)
        for name in order:
            if n:
                samples[name] += timers[name].sample(n)
    return {name: statistics.median(v) for name, v in samples.items()}


def time_us(fn, *, graph: bool, warmup: int, iters: int, reps: int = 1) -> float:
    """Median microseconds of one ``fn()`` call (``reps`` calls a sample)."""
    return time_interleaved({0: fn}, graph=graph, warmup=warmup, iters=iters, reps=reps)[0]


def cold_copies(experts, l2_bytes: int | None = None) -> list:
    """``experts`` and clones of it, enough that calls cycling through them find none of
    their weights in L2 (``--cold-l2``): the copies hold twice the L2's bytes and one copy
    more, at least two. ``l2_bytes``: the L2's size (default: the current CUDA device's)."""
    if l2_bytes is None:
        l2_bytes = torch.cuda.get_device_properties(torch.cuda.current_device()).L2_cache_size
    n = max(2, math.ceil(2 * l2_bytes / experts.nbytes()) + 1)
    clone = type(experts)
    return [experts] + [
        clone(**{k: v.clone() for k, v in experts.tensors().items()}) for _ in range(n - 1)
    ]


def card_ceilings() -> dict:
    """This card's copy bandwidth (bytes/s), and its bf16 and FP8 (e4m3, ``torch._scaled_mm``
    with one scale a tensor and fast accumulation: the peak) matmul rates (FLOP/s) on
    8192^3 products, each the median of CUDA-graph replays."""
    n = 1 << 30
    src = torch.empty(n // 4, dtype=torch.float32, device="cuda")
    dst = torch.empty_like(src)
    us = time_us(lambda: torch.mul(src, 1.0, out=dst), graph=True, warmup=2, iters=10, reps=3)
    copy = 2 * n / (us * 1e-6)
    m = 8192
    a = torch.randn(m, m, dtype=torch.bfloat16, device="cuda")
    b = torch.randn(m, m, dtype=torch.bfloat16, device="cuda")
    us = time_us(lambda: a @ b, graph=True, warmup=2, iters=10, reps=3)
    bf16 = 2 * m**3 / (us * 1e-6)
    a8 = a.to(torch.float8_e4m3fn)
    b8 = b.to(torch.float8_e4m3fn).t()  # column-major, as _scaled_mm takes its second input
    one = torch.ones((), dtype=torch.float32, device="cuda")

    def fp8_mm():
        return torch._scaled_mm(a8, b8, one, one, out_dtype=torch.bfloat16, use_fast_accum=True)

    us = time_us(fp8_mm, graph=True, warmup=2, iters=10, reps=3)
    fp8 = 2 * m**3 / (us * 1e-6)
    return {"copy_bytes_per_s": copy, "bf16_matmul_flops": bf16, "fp8_matmul_flops": fp8}


# ----------------------------------------------------------------------------- baselines


def bf16_grouped_moe(x, ids, w, w13_t, w2_t, n_valid: int):
    """bf16 MoE on ``torch._grouped_mm`` (w13_t [E, H, 2I], w2_t [E, I, H], K-contiguous
    views); ``n_valid`` valid routes, known on the host, keep masked routes out."""
    e = w13_t.shape[0]
    t, k = ids.shape
    key = torch.where(ids.reshape(-1) < 0, e, ids.reshape(-1)).long()
    order = torch.argsort(key, stable=True)[:n_valid]
    counts = torch.zeros(e + 1, dtype=torch.int64, device=x.device)
    counts.scatter_add_(0, key, torch.ones_like(key))
    offs = torch.cumsum(counts[:e], 0).to(torch.int32)
    tok = order // k
    h = torch._grouped_mm(x[tok], w13_t, offs=offs)
    i = w2_t.shape[1]
    a = (torch.nn.functional.silu(h[:, :i].float()) * h[:, i:].float()).to(torch.bfloat16)
    y = torch._grouped_mm(a, w2_t, offs=offs)
    out = torch.zeros(t, x.shape[1], dtype=torch.float32, device=x.device)
    out.index_add_(0, tok, y.float() * w.reshape(-1)[order].unsqueeze(1))
    return out.to(torch.bfloat16)


def naive_nvfp4_moe(x, ids, w, experts, n_valid: int):
    """Dequantize every expert to bf16 on each call, then the bf16 grouped-GEMM MoE."""
    w13, w2 = experts.dequantize(torch.bfloat16)
    return bf16_grouped_moe(x, ids, w, w13.transpose(1, 2), w2.transpose(1, 2), n_valid)


# ----------------------------------------------------------------------------- run


def git_commit() -> str | None:
    """HEAD of the checkout the code runs from, with "+dirty" when tracked files differ
    from it (a copied working tree can carry a stale .git: then the suffix says so).
    ``FP4MOE_COMMIT`` in the environment overrides both."""
    if os.environ.get("FP4MOE_COMMIT"):
        return os.environ["FP4MOE_COMMIT"]
    try:
        here = os.path.dirname(os.path.abspath(__file__))
        run = dict(cwd=here, capture_output=True, text=True, timeout=5)
        head = subprocess.run(["git", "rev-parse", "HEAD"], **run).stdout.strip()
        if not head:
            return None
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], **run)
        return head + ("+dirty" if dirty.stdout.strip() else "")
    except Exception:
        return None


def _source_digest() -> str:
    """The first 12 hex digits of a SHA-256 over the package's Python sources (relative
    path and bytes of each, in sorted order): names the code a run timed even where the
    checkout's .git is stale or missing (a copied working tree)."""
    import hashlib
    from pathlib import Path

    root = Path(__file__).resolve().parent
    h = hashlib.sha256()
    for path in sorted(root.rglob("*.py")):
        h.update(path.relative_to(root).as_posix().encode() + b"\0" + path.read_bytes() + b"\0")
    return h.hexdigest()[:12]


def resolve_preset(args: argparse.Namespace) -> Preset:
    p = PRESETS[args.preset]
    over = {
        "hidden": args.hidden,
        "inter": args.inter,
        "experts": args.experts,
        "local_experts": args.local_experts,
        "top_k": args.top_k,
    }
    kw = {k: v for k, v in over.items() if v is not None}
    if "experts" in kw and "local_experts" not in kw:
        kw["local_experts"] = min(p.local_experts, kw["experts"])
    p = Preset(**{**asdict(p), **kw})
    if p.hidden % 32 or p.inter % 32:
        raise ValueError(f"--hidden and --inter must be multiples of 32, got {p.hidden}, {p.inter}")
    if not 1 <= p.local_experts <= p.experts or not 1 <= p.top_k <= p.experts:
        raise ValueError("--local-experts and --top-k must be between 1 and --experts")
    return p


def random_experts(p: Preset, device: str = "cuda"):
    """The preset's local experts from random bf16 weights (std 0.02, drawn from torch's
    global generator: seed it first), prepared, with static W4A4 globals of 4 / 2688 (FC1
    input) and 0.4 / 2688 (FC2 input)."""
    import fp4moe

    e = p.local_experts
    w13 = torch.randn(e, 2 * p.inter, p.hidden, device=device, dtype=torch.bfloat16) * 0.02
    w2 = torch.randn(e, p.hidden, p.inter, device=device, dtype=torch.bfloat16) * 0.02
    static = torch.full((e,), 4.0 / 2688, device=device)
    return fp4moe.prepare_experts(w13, w2, a13_scale=static, a2_scale=static * 0.1)


def make_routes(p: Preset, t: int, seed: int, device: str):
    """Router logits from random tokens through the preset's routing; other ranks' experts
    masked (this rank holds experts 0 .. local_experts-1)."""
    import fp4moe

    g = torch.Generator(device=device).manual_seed(seed)
    logits = torch.randn(t, p.experts, device=device, generator=g) * 2.0
    kw = {}
    if p.method == "sigmoid_grouped":
        bias = torch.randn(p.experts, device=device, generator=g) * 0.01
        kw = dict(
            correction_bias=bias,
            n_group=p.n_group,
            topk_group=p.topk_group,
            scaling_factor=p.scaling,
        )
    ids, w = fp4moe.route(logits, p.top_k, method=p.method, **kw)
    if p.local_experts < p.experts:
        ids = fp4moe.local_expert_ids(ids, 0, p.local_experts)
    return ids, w


def run(args: argparse.Namespace) -> dict:
    """Run the benchmark (needs CUDA); returns the JSON document it writes (``fp4moe
    bench``; the expert-parallel one, ``--ep``, is ``fp4moe.bench_ep``)."""
    import fp4moe
    from fp4moe.backend import Options, plan_call, target_for
    from fp4moe.backend.launch import moe_triton
    from fp4moe.reference import moe_reference

    p = resolve_preset(args)
    finals = {"both": [True, False], "fused": [True], "unfused": [False]}[
        args.finalize or ("unfused" if args.no_fused_finalize else "both")
    ]
    ceil = card_ceilings()
    torch.manual_seed(args.seed)
    e = p.local_experts
    experts = random_experts(p)
    copies = cold_copies(experts) if args.cold_l2 else [experts]
    per_expert = experts.nbytes() / e
    base = None
    if not args.no_baseline:
        w13d, w2d = experts.dequantize(torch.bfloat16)
        base = (w13d.transpose(1, 2), w2d.transpose(1, 2))
    # The preset's share of valid routes (ranks hold local_experts of experts), as a
    # caller that masks routes to other ranks passes it (fp4moe.moe(options=...)).
    opt = Options(pdl=not args.no_pdl, valid_fraction=p.local_experts / p.experts)
    target = target_for("cuda")
    graph = not args.no_cuda_graph
    rows = []
    doc = {  # rows fill in as they are timed; written after each token count
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": triton_version(),
        "fp4moe": fp4moe.__version__,
        "commit": git_commit(),
        "source_sha": _source_digest(),
        "date": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "preset": args.preset,
        "shape": asdict(p),
        "ceilings": ceil,
        "cuda_graph": graph,
        "held_replays": graph,  # GraphTimer: each timed replay behind a GPU wait
        "pdl": not args.no_pdl,
        "cold_l2": args.cold_l2,
        "iters": args.iters,
        "rounds": args.rounds,
        "valid_fraction": opt.valid_fraction,
        "rows": rows,
    }
    plan = [(t, m, f) for t in args.num_tokens for m in args.modes for f in finals]
    step = 0
    for t in args.num_tokens:
        x = torch.randn(t, p.hidden, device="cuda").to(torch.bfloat16)
        ids, w = make_routes(p, t, args.seed + t, "cuda")
        valid = ids >= 0
        routes = int(valid.sum())
        touched = int(torch.unique(ids[valid]).numel()) if routes else 0
        floor_us = touched * per_expert / ceil["copy_bytes_per_s"] * 1e6
        flops = 2 * routes * 3 * p.hidden * p.inter
        # Check each configuration against the reference, then time them all interleaved
        # in rounds (--rounds), with the baselines: one capture each, the same samples
        calls = {}
        if base is not None and routes:
            calls["bf16"] = lambda: bf16_grouped_moe(x, ids, w, *base, routes)  # noqa: B023
            calls["naive"] = lambda: naive_nvfp4_moe(x, ids, w, experts, routes)  # noqa: B023
        errs = {}
        for mode in args.modes:
            m, sc = MODES[mode]
            for fused in finals:
                step += 1
                step_line(step, len(plan), f"T={t} {mode} {'fused' if fused else 'unfused'}")
                err = None
                if not args.no_check:
                    ref = moe_reference(x, ids, w, experts, mode=m, act_scale=sc).float()
                    out = moe_triton(
                        x, ids, w, experts, mode=m, act_scale=sc, fused_finalize=fused, options=opt
                    ).float()
                    err = relative_error(out, ref)
                    tol = TOLERANCE[m]  # numerics section 8
                    if not math.isfinite(err) or err > tol:
                        raise RuntimeError(
                            f"T={t} {mode} fused={fused}: rel. error {err:.2e} "
                            f"above the contract's tolerance {tol}"
                        )
                errs[mode, fused] = err
                it = iter(range(1 << 30))

                def call(m=m, sc=sc, fused=fused, it=it, x=x, ids=ids, w=w):
                    ex = copies[next(it) % len(copies)]
                    return moe_triton(
                        x, ids, w, ex, mode=m, act_scale=sc, fused_finalize=fused, options=opt
                    )

                calls[mode, fused] = call
        # each baseline a call, each fp4moe configuration len(copies) calls a sample
        reps = {k: 1 if k in ("bf16", "naive") else len(copies) for k in calls}
        timed: dict = {}
        for r in sorted(set(reps.values())):
            group = {k: f for k, f in calls.items() if reps[k] == r}
            timed.update(
                time_interleaved(
                    group, graph=graph, warmup=args.warmup, iters=args.iters,
                    rounds=args.rounds, reps=r,
                )
            )  # fmt: skip
        if len(set(reps.values())) > 1:  # --cold-l2: two groups, the baselines first
            doc["notes"] = ["with --cold-l2 the baselines were interleaved among themselves only"]
        calls.clear()
        bf16_us, naive_us = timed.get("bf16"), timed.get("naive")
        fused_us = {mode: timed[mode, True] for mode in args.modes if (mode, True) in timed}
        for mode in args.modes:
            for fused in finals:
                us = timed[mode, fused]
                m, sc = MODES[mode]
                # the roofline: the larger of the bytes' time and the tensor cores' time
                roof_us = roofline_us(mode, floor_us, flops, ceil)
                kernels = plan_call(t, p.top_k, e, p.hidden, p.inter, mode=m, act_scale=sc,
                                    fused_finalize=fused, options=opt, target=target)  # fmt: skip
                rows.append(
                    {
                        "tokens": t,
                        "local_routes": routes,
                        "experts_touched": touched,
                        "mode": mode,
                        "finalize": "fused" if fused else "unfused",
                        "us": us,
                        "tflops": flops / (us * 1e-6) / 1e12,
                        "weight_GBps": touched * per_expert / (us * 1e-6) / 1e9,
                        "weight_bytes": touched * per_expert,
                        "flops": flops,
                        "roofline_us": roof_us if touched else None,
                        "bound": bound(mode, floor_us, flops, ceil) if touched else None,
                        "floor_fraction": floor_us / us if touched else None,
                        "roofline_fraction": roof_us / us if touched else None,
                        "compute_roof": compute_roof(mode),
                        "vs_bf16": bf16_us / us if bf16_us else None,
                        "vs_naive_nvfp4": naive_us / us if naive_us else None,
                        "unfused_over_fused": us / fused_us[mode]
                        if not fused and mode in fused_us
                        else None,
                        "bf16_us": bf16_us,
                        "naive_nvfp4_us": naive_us,
                        "rel_err": errs[mode, fused],
                        "plan": kernels.summary(),
                    }
                )
        write_outputs(doc, args.out, plot=False)  # a run cut short keeps its rows
    sys.stderr.write("\n")
    write_outputs(doc, args.out)
    return doc


def triton_version() -> str | None:
    try:
        import triton

        return triton.__version__
    except Exception:
        return None


def format_table(doc: dict) -> str:
    c = doc["ceilings"]
    fp8 = c.get("fp8_matmul_flops")  # absent from runs before it was measured
    head = (
        f"# {doc['device']}  copy {c['copy_bytes_per_s'] / 1e12:.2f} TB/s  bf16 "
        f"{c['bf16_matmul_flops'] / 1e12:.0f} TFLOP/s  "
        + (f"fp8 {fp8 / 1e12:.0f} TFLOP/s  " if fp8 else "")
        + f"preset {doc['preset']}"
    )
    cols = [
        "tokens",
        "local_routes",
        "experts_touched",
        "mode",
        "finalize",
        "us",
        "tflops",
        "weight_GBps",
        "roofline_fraction",
        "bound",
        "vs_bf16",
        "vs_naive_nvfp4",
        "unfused_over_fused",
    ]
    return "\n".join([head, *table_rows(doc["rows"], cols, 12)])


def table_rows(rows: list[dict], cols: list[str], width: int) -> list[str]:
    """The header line and one line a row: floats with 2 decimals, None (or a column an
    older JSON lacks) as "-"."""
    lines = ["  ".join(f"{k:>{width}s}" for k in cols)]
    for r in rows:
        cells = []
        for k in cols:
            v = r.get(k)
            if v is None:
                cells.append(f"{'-':>{width}s}")
            elif isinstance(v, float):
                cells.append(f"{v:{width}.2f}")
            else:
                cells.append(f"{v!s:>{width}s}")
        lines.append("  ".join(cells))
    return lines


def write_json_csv(doc: dict, out: str, stem: str) -> None:
    """``doc`` as ``out/stem.json`` and its rows as ``out/stem.csv``."""
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, f"{stem}.json"), "w") as f:
        json.dump(doc, f, indent=1)
    if doc["rows"]:
        with open(os.path.join(out, f"{stem}.csv"), "w", newline="") as f:
            flat = [{k: v for k, v in r.items() if not isinstance(v, dict)} for r in doc["rows"]]
            wr = csv.DictWriter(f, fieldnames=list(flat[0]))
            wr.writeheader()
            wr.writerows(flat)


def write_outputs(doc: dict, out: str, plot: bool = True) -> None:
    write_json_csv(doc, out, "bench")
    if not plot:
        return
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception:
        print(f"(no matplotlib: {out}/bench.png not drawn)", file=sys.stderr)
        return
    fig, ax = plt.subplots(figsize=(7, 4.5))
    series: dict[str, list[tuple[int, float]]] = {}
    for r in doc["rows"]:
        series.setdefault(f"{r['mode']} {r['finalize']}", []).append((r["tokens"], r["us"]))
        if r["bf16_us"]:
            series.setdefault("bf16 grouped_mm", []).append((r["tokens"], r["bf16_us"]))
        if r["naive_nvfp4_us"]:
            series.setdefault("naive NVFP4", []).append((r["tokens"], r["naive_nvfp4_us"]))
    for name, pts in series.items():
        pts = sorted(set(pts))
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=name)
    floor = sorted(
        {(r["tokens"], r["us"] * r["floor_fraction"]) for r in doc["rows"] if r["floor_fraction"]}
    )
    if floor:
        ax.plot([p[0] for p in floor], [p[1] for p in floor], "k--", label="byte floor")
    roofs: dict[str, set] = {}
    for r in doc["rows"]:
        if r.get("roofline_us"):
            roofs.setdefault(r.get("compute_roof", "bf16"), set()).add(
                (r["tokens"], r["roofline_us"])
            )
    for name, pts in sorted(roofs.items()):
        pts = sorted(pts)
        style = "k:" if name == "bf16" else "k-."
        ax.plot([p[0] for p in pts], [p[1] for p in pts], style, label=f"roofline ({name})")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("tokens")
    ax.set_ylabel("microseconds (median)")
    ax.set_title(f"fp4moe on {doc['device']}, {doc['preset']}")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(os.path.join(out, "bench.png"), dpi=120)
