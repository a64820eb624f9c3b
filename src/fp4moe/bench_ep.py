"""``fp4moe bench --ep N``: the expert-parallel layer (``EPMoELayer``) over N processes.

One process a GPU (rank r on ``cuda:r``, NCCL, the Triton backend). The preset's experts
(all of them: 256 for deepseek-v3-ep8) are split in contiguous ranges over the ranks
(``fp4moe.expert_range``); each rank prepares only its own slice (random bf16 weights,
``fp4moe.prepare_experts``) and has T tokens of its own, routed at random over *all* experts
with the preset's routing. Per token count T (per rank), mode and path (``--ep-path``: the
variable path, ``max_tokens=None``; the fixed-capacity path, ``max_tokens=T``; or both),
each rank times, with CUDA events, median over ``--iters`` after ``--warmup`` calls:

- dispatch: ``EPMoELayer.dispatch``: the count exchange, W4A4 or W4A8 quantization on the
  home rank, the row ``all_to_all_single`` (variable path: one host read of the counts);
- compute: ``EPMoELayer.compute_experts``: FC1, SwiGLU, FC2 on the rows received (W4A4
  per-tensor: includes the 4-byte ``all_reduce(max)`` of the FC2 amax);
- combine: ``EPMoELayer.combine``: the return ``all_to_all_single`` and the deterministic
  finalize on the home rank;
- total: one whole ``EPMoELayer.forward``;
- local compute: the same expert compute on the same received rows run alone
  (``compute_route_rows`` without any collective): what this rank's share of the expert
  work costs on one GPU with no communication.

The variable path runs eagerly (its split sizes are read on the host: not capturable). The
fixed path, on CUDA, is timed as CUDA-graph replays: after the warm-up every rank captures
each step, the forward and the local compute in graphs of their own, then replays them
(``--no-cuda-graph``: eager calls, as on gloo/CPU). Before a fixed row is timed, its output
is checked bitwise against the variable path's on the same inputs (not for W4A4
per-tensor); the run stops if any rank differs.

All ranks meet at a barrier (after a device synchronize) before each timed step (and before
each capture), so a step's time is that step's, including the wait for the slowest rank
inside its collectives. A row reports the max over ranks of each rank's median (the slowest
rank bounds the step), the bytes a rank sends to other ranks in one call
(``EPMoELayer.last_comm_bytes``; fixed path: the capacity, padding included) and the rows
each rank received (max and min over ranks). ``--ep-backend gloo`` (CPU, reference backend)
is for tests on small shapes.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import statistics
import sys
import tempfile
import time
import traceback
from dataclasses import asdict, replace
from datetime import timedelta

import torch

from .modes import TOLERANCE, relative_error, resolve_mode
from .progress import step_line

__all__ = ["EPUnavailable", "format_table", "main_args", "run_ep", "write_outputs"]

PREPARE_CHUNK = 16  # experts quantized at a time (bounds the bf16 weights held at once)
EP_PATHS = {"variable": ["variable"], "fixed": ["fixed"], "both": ["variable", "fixed"]}
STEPS = ("dispatch", "compute", "combine")


class EPUnavailable(RuntimeError):
    """This machine cannot run the requested expert-parallel benchmark (no GPU, too few)."""


# ----------------------------------------------------------------------------- settings


def resolve(args: argparse.Namespace) -> dict:
    """Check the --ep options (raises ValueError for bad usage, EPUnavailable when this
    machine lacks the GPUs); returns the settings the workers run with."""
    from .bench import MODES, resolve_preset

    world = args.ep
    if isinstance(world, bool) or not isinstance(world, int) or world < 2:
        raise ValueError(
            f"--ep: expected a number of processes of at least 2 (one GPU each), got {world}; "
            "without --ep, fp4moe bench times one GPU"
        )
    if args.local_experts is not None:
        raise ValueError(
            "--local-experts: not used with --ep (each rank holds --experts / --ep experts)"
        )
    if args.cold_l2:
        raise ValueError("--cold-l2: not supported with --ep")
    comm, device = args.ep_backend, args.device
    if comm is None:
        comm = "gloo" if device == "cpu" else "nccl"
    if device is None:
        device = "cpu" if comm == "gloo" else "cuda"
    if (comm, device) not in (("nccl", "cuda"), ("gloo", "cpu")):
        raise ValueError(
            f"--ep-backend {comm} with --device {device}: NCCL runs on CUDA GPUs, gloo "
            "(for tests) on the CPU"
        )
    kernels = args.ep_kernels
    if kernels == "auto":
        kernels = "triton" if device == "cuda" else "reference"
    p = resolve_preset(args)
    p = replace(p, local_experts=p.experts)  # routes over all experts, nothing masked
    if p.experts % world:
        raise ValueError(
            f"--ep {world}: the preset's {p.experts} experts do not split evenly over "
            f"{world} processes (choose --ep dividing --experts)"
        )
    if any(t < 0 for t in args.num_tokens):
        raise ValueError("--num-tokens: expected counts >= 0")
    if args.iters < 1 or args.warmup < 0:
        raise ValueError("--iters must be >= 1 and --warmup >= 0")
    for m in args.modes:
        if m not in MODES:
            raise ValueError(f"--modes: unknown mode {m!r}")
    ep_path = getattr(args, "ep_path", None) or "both"
    if ep_path not in EP_PATHS:
        raise ValueError(f"--ep-path: expected one of {', '.join(EP_PATHS)}, got {ep_path!r}")
    if device == "cuda":
        if not torch.cuda.is_available():
            raise EPUnavailable(
                f"fp4moe bench --ep {world} needs {world} CUDA GPUs (one a process, NCCL); none "
                "is available here (torch.cuda.is_available() is False). On a CPU, "
                "`fp4moe demo --layer` runs every mode with the reference backend."
            )
        found = torch.cuda.device_count()
        if found < world:
            seen = os.environ.get("CUDA_VISIBLE_DEVICES")
            where = f" (CUDA_VISIBLE_DEVICES={seen})" if seen is not None else ""
            raise EPUnavailable(
                f"fp4moe bench --ep {world} needs {world} CUDA GPUs (one a process), but "
                f"{found} {'is' if found == 1 else 'are'} visible here{where}; "
                f"use --ep {found} or fewer" + ("" if found >= 2 else " on a multi-GPU machine")
            )
    return {
        "world": world,
        "comm": comm,
        "device": device,
        "kernels": kernels,
        "preset": p,
        "timeout_s": args.ep_timeout,
        "paths": EP_PATHS[ep_path],
        # The fixed path as CUDA-graph replays (CUDA only; the variable path is never captured).
        "graph": device == "cuda" and not getattr(args, "no_cuda_graph", False),
    }


# ----------------------------------------------------------------------------- worker


class _Clock:
    """Microseconds of one call: CUDA events on the GPU, the host clock on the CPU. A
    graph replay's ``hold`` (GPU clock cycles, ``bench.hold_cycles``) enqueues it behind a
    wait longer than the host takes to submit it, so its time is the GPU's alone."""

    def __init__(self, cuda: bool) -> None:
        self.cuda = cuda

    def __call__(self, fn, hold: int = 0):
        if self.cuda:
            a = torch.cuda.Event(enable_timing=True)
            b = torch.cuda.Event(enable_timing=True)
            if hold:
                torch.cuda._sleep(hold)
            a.record()
            out = fn()
            b.record()
            b.synchronize()
            return out, a.elapsed_time(b) * 1000.0
        t0 = time.perf_counter()
        out = fn()
        return out, (time.perf_counter() - t0) * 1e6


def _submit_hold(replay) -> int:
    """One untimed ``replay()``: the hold (``bench.hold_cycles``) its submission needs."""
    from .bench import hold_cycles

    t0 = time.perf_counter()
    replay()
    return hold_cycles((time.perf_counter() - t0) * 1e6)


def _align(cuda: bool, rank: int) -> None:
    """Every rank idle and at the same point before a timed step."""
    import torch.distributed as dist

    if cuda:
        torch.cuda.synchronize()
        dist.barrier(device_ids=[rank])
        torch.cuda.synchronize()
    else:
        dist.barrier()


def _prepare_slice(p, start: int, stop: int, seed: int, device: str):
    """Random bf16 experts [start, stop) quantized on this rank, PREPARE_CHUNK at a time."""
    import fp4moe

    g = torch.Generator(device=device).manual_seed(seed)
    parts = []
    for lo in range(start, stop, PREPARE_CHUNK):
        n = min(PREPARE_CHUNK, stop - lo)
        w13 = torch.randn(n, 2 * p.inter, p.hidden, device=device, generator=g) * 0.02
        w2 = torch.randn(n, p.hidden, p.inter, device=device, generator=g) * 0.02
        static = torch.full((n,), 4.0 / 2688, device=device)  # as bench.run
        ex = fp4moe.prepare_experts(
            w13.to(torch.bfloat16), w2.to(torch.bfloat16), a13_scale=static,
            a2_scale=static * 0.1,
        )  # fmt: skip
        del w13, w2
        parts.append(ex.tensors())
    return fp4moe.PreparedExperts(**{k: torch.cat([d[k] for d in parts]) for k in parts[0]})


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equality of two bf16 outputs (-0.0 and 0.0 differ, as do NaN payloads)."""
    return a.shape == b.shape and bool(torch.equal(a.view(torch.int16), b.view(torch.int16)))


def _warm_side_stream(fn, warmup: int) -> None:
    """Warm-up calls on a side stream before a capture (``bench.warm_up``), then a sync."""
    from .bench import warm_up

    warm_up(fn, warmup)
    torch.cuda.synchronize()


def _capture(fn):
    """One ``fn()`` captured in a CUDA graph: (graph, its static output)."""
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = fn()
    return g, out


def _eager_runs(layer, x, kw, state: dict) -> dict:
    """The timed calls, eagerly: each stores its output in ``state``."""

    def dispatch():
        state["d"] = layer.dispatch(x, **kw)

    def compute():
        state["y"] = layer.compute_experts(state["d"])

    def combine():
        state["split_out"] = layer.combine(state["d"], state["y"])

    def total():
        state["out"] = layer(x, **kw)

    return {"dispatch": dispatch, "compute": compute, "combine": combine, "total": total}


def _graph_runs(layer, x, kw, state: dict, rank: int) -> dict:
    """The fixed path's timed calls as CUDA graphs: dispatch, compute, combine and the whole
    forward, each captured once (every rank, after a barrier: the collectives inside the
    graphs must line up over the ranks), then replayed once in order before any timing. The
    graphs' static outputs are in ``state`` (the graphs too, to keep them alive)."""
    _align(True, rank)
    gd, state["d"] = _capture(lambda: layer.dispatch(x, **kw))
    _align(True, rank)
    gc, state["y"] = _capture(lambda: layer.compute_experts(state["d"]))
    _align(True, rank)
    gb, state["split_out"] = _capture(lambda: layer.combine(state["d"], state["y"]))
    _align(True, rank)
    gt, state["out"] = _capture(lambda: layer(x, **kw))
    state["graphs"] = [gd, gc, gb, gt]
    run = {"dispatch": gd.replay, "compute": gc.replay, "combine": gb.replay, "total": gt.replay}
    state["hold"] = {}
    for k in (*STEPS, "total"):
        _align(True, rank)
        state["hold"][k] = _submit_hold(run[k])
    _align(True, rank)
    return run


def _measure(
    layer, x, routes, clock, cuda, rank, warmup, iters, check, *, graph=False, expect=None
) -> dict:
    """One (T, mode, path) on this rank: the per-step medians, bytes, rows, checks.

    graph: capture and replay (the fixed path on CUDA) instead of eager calls. expect: the
    variable path's output for the same inputs, which the timed forward's must equal
    bitwise (fixed path; None: not checked)."""
    from .distributed import compute_route_rows

    kw = {"phase": "prefill", "routes": routes}
    if graph:
        _warm_side_stream(lambda: layer(x, **kw), warmup)
    else:
        for _ in range(max(warmup, 1)):
            layer(x, **kw)
    state: dict = {}
    run = _graph_runs(layer, x, kw, state, rank) if graph else _eager_runs(layer, x, kw, state)
    steps: dict[str, list[float]] = {k: [] for k in (*STEPS, "total")}
    hold = state.get("hold", {})
    for _ in range(iters):
        for k in STEPS:  # in forward's order: each step consumes the one before
            _align(cuda, rank)
            steps[k].append(clock(run[k], hold.get(k, 0))[1])
    for _ in range(iters):
        _align(cuda, rank)
        steps["total"].append(clock(run["total"], hold.get("total", 0))[1])
    if cuda:
        torch.cuda.synchronize()
    d, y, split_out, out = state["d"], state["y"], state["split_out"], state["out"]
    comm = dict(layer.last_comm_bytes)

    # The same expert work alone: the received rows, no collective (per-tensor W4A4: the
    # FC2 amax of this rank's rows only; the work is the same).
    def local():
        return compute_route_rows(
            d.rows, d.row_expert, layer.experts, mode=d.mode, act_scale=d.act_scale,
            backend=d.backend,
        )  # fmt: skip

    if graph:
        _warm_side_stream(local, warmup)
        g_local, _ = _capture(local)
        local_hold = _submit_hold(g_local.replay)
        torch.cuda.synchronize()
        local_us = [clock(g_local.replay, local_hold)[1] for _ in range(iters)]
    else:
        for _ in range(max(warmup, 1)):
            local()
        if cuda:
            torch.cuda.synchronize()
        local_us = [clock(local)[1] for _ in range(iters)]

    err = None
    if check and d.backend != "reference":  # the compute against the reference, same rows
        reduce = layer.all_reduce_max if d.act_scale == "per_tensor" else None
        ref = compute_route_rows(
            d.rows, d.row_expert, layer.experts, mode=d.mode, act_scale=d.act_scale,
            backend="reference", amax_reduce=reduce,
        )  # fmt: skip
        live = d.row_expert >= 0
        err = relative_error(y[live], ref[live]) if bool(live.any()) else None
    med = {k: statistics.median(v) for k, v in steps.items()}
    return {
        "dispatch_us": med["dispatch"],
        "compute_us": med["compute"],
        "combine_us": med["combine"],
        "total_us": med["total"],
        "local_compute_us": statistics.median(local_us),
        "dispatch_bytes": comm["dispatch"],
        "combine_bytes": comm["combine"],
        "metadata_bytes": comm["metadata"],
        "bytes_sent": comm["dispatch"] + comm["combine"] + comm["metadata"],
        "dispatch_rows": comm["dispatch_rows"],
        "recv_rows": comm["recv_rows"],
        "rel_err": err,
        "split_matches_forward": _same_bits(split_out, out),
        "fixed_matches_variable": None if expect is None else _same_bits(out, expect),
    }


def _fixed_mismatch(t: int, mode: str, max_tokens: int, same: list) -> RuntimeError | None:
    """The error when the fixed path did not give the variable path's bits on some rank."""
    bad = [r for r, ok in enumerate(same) if not ok]
    if not bad:
        return None
    return RuntimeError(
        f"T={t} {mode}: the fixed-capacity path (max_tokens={max_tokens}) did not give the "
        f"variable path's output bits for the same inputs on rank(s) {bad}; the fixed row "
        "is not timed (both are deterministic and row-local in this mode, so they must agree)"
    )


def _check_fixed(var_layer, fixed, x, routes, t: int, mode: str, world: int):
    """Before a fixed row is timed: one eager forward of each path on the same inputs,
    bitwise equal on every rank, or every rank raises. Returns the variable path's output
    (the timed forward is checked against it again), None for W4A4 per-tensor (skipped)."""
    import torch.distributed as dist

    if mode == "w4a4-tensor":
        return None
    kw = {"phase": "prefill", "routes": routes}
    want = var_layer(x, **kw)
    same: list = [None] * world
    dist.all_gather_object(same, _same_bits(fixed(x, **kw), want))
    exc = _fixed_mismatch(t, mode, fixed.max_tokens, same)
    if exc is not None:
        raise exc
    return want


def _combine_ranks(
    t: int, mode: str, path: str, max_tokens: int | None, graph: bool, world: int, per: list[dict]
) -> dict:
    def mx(k):
        return max(r[k] for r in per)

    errs = [r["rel_err"] for r in per if r["rel_err"] is not None]
    fixed_ok = [r["fixed_matches_variable"] for r in per]
    return {
        "tokens": t,  # per rank
        "global_tokens": t * world,
        "mode": mode,
        "path": path,
        "max_tokens": max_tokens,
        "cuda_graph": graph,
        "dispatch_us": mx("dispatch_us"),
        "compute_us": mx("compute_us"),
        "combine_us": mx("combine_us"),
        "total_us": mx("total_us"),
        "local_compute_us": mx("local_compute_us"),
        "total_over_local": mx("total_us") / mx("local_compute_us")
        if mx("local_compute_us") > 0
        else None,
        "bytes_sent": mx("bytes_sent"),
        "dispatch_bytes": mx("dispatch_bytes"),
        "combine_bytes": mx("combine_bytes"),
        "bytes_sent_all_ranks": sum(r["bytes_sent"] for r in per),
        "recv_rows_max": mx("recv_rows"),
        "recv_rows_min": min(r["recv_rows"] for r in per),
        "rel_err": max(errs) if errs else None,
        "split_matches_forward": all(r["split_matches_forward"] for r in per),
        "fixed_matches_variable": None if None in fixed_ok else all(fixed_ok),
    }


def _check_row(row: dict, rank: int) -> None:
    """The expert compute against the reference on the same rows (as ``fp4moe bench``
    checks each configuration), and the timed steps against ``forward``."""
    err, tol = row["rel_err"], TOLERANCE[resolve_mode(row["mode"])[0]]
    if err is not None and not (err <= tol):
        raise RuntimeError(
            f"T={row['tokens']} {row['mode']}: expert compute rel. error {err:.2e} against "
            f"the reference backend on the same rows, above the contract's tolerance {tol}"
        )
    if row["fixed_matches_variable"] is False:
        raise RuntimeError(
            f"T={row['tokens']} {row['mode']}: the timed fixed-capacity forward "
            f"(max_tokens={row['max_tokens']}, {'CUDA graph' if row['cuda_graph'] else 'eager'})"
            " did not give the variable path's output bits on some rank (the eager check "
            "before timing had passed)"
        )
    if not row["split_matches_forward"] and rank == 0:
        sys.stderr.write(
            f"\nwarning: T={row['tokens']} {row['mode']} {row['path']}: dispatch + "
            "compute_experts + combine did not give forward's bits on some rank (a "
            "nondeterministic kernel?)\n"
        )


def _worker(rank: int, settings: dict, args: argparse.Namespace, init: str, out_dir: str):
    import torch.distributed as dist

    import fp4moe

    from .bench import make_routes
    from .distributed import EPMoELayer
    from .phases import PhasePolicy, RouterConfig

    world, p = settings["world"], settings["preset"]
    cuda = settings["device"] == "cuda"
    if cuda:
        torch.cuda.set_device(rank)
        dev = f"cuda:{rank}"
    else:
        torch.set_num_threads(1)
        dev = "cpu"
    dist.init_process_group(
        settings["comm"], init_method=init, rank=rank, world_size=world,
        timeout=timedelta(seconds=settings["timeout_s"]),
    )  # fmt: skip
    try:
        start, stop = fp4moe.expert_range(rank, world, p.experts)
        experts = _prepare_slice(p, start, stop, args.seed * 1000 + rank, dev)
        g = torch.Generator(device=dev).manual_seed(args.seed)  # same gate on every rank
        gate = torch.randn(p.experts, p.hidden, device=dev, generator=g) * 0.02
        router = RouterConfig(
            method=p.method, top_k=p.top_k,
            **(
                dict(n_group=p.n_group, topk_group=p.topk_group, scaling_factor=p.scaling)
                if p.method == "sigmoid_grouped" else {}
            ),
        )  # fmt: skip
        policies = {m: PhasePolicy.single(m, backend=settings["kernels"]) for m in args.modes}

        def make_layer(m, max_tokens=None):  # collective: every rank builds the same one
            return EPMoELayer(
                experts, router, gate_weight=gate, policy=policies[m], max_tokens=max_tokens
            )

        # The variable path's layers: timed (--ep-path variable/both), and the reference the
        # fixed path is checked against.
        layers = {m: make_layer(m) for m in args.modes}
        paths, graph = settings["paths"], settings["graph"]
        clock = _Clock(cuda)
        rows, per_rank = [], []
        plan = [(t, m, q) for t in args.num_tokens for m in args.modes for q in paths]
        step = 0
        for t in args.num_tokens:
            s = args.seed + 7919 * rank + t
            gx = torch.Generator(device=dev).manual_seed(s)
            x = torch.randn(t, p.hidden, device=dev, generator=gx).to(torch.bfloat16)
            routes = make_routes(p, t, s, dev)
            for m in args.modes:
                for path in paths:
                    step += 1
                    if rank == 0:
                        step_line(step, len(plan), f"T={t}/rank {m} {path}")
                    if path == "variable":
                        layer, cap, expect, timed_graph = layers[m], None, None, False
                    else:
                        cap = max(t, 1)  # max_tokens must be >= 1 (T = 0: capacity 1)
                        layer = make_layer(m, cap)
                        expect = _check_fixed(layers[m], layer, x, routes, t, m, world)
                        timed_graph = graph
                    mine = _measure(
                        layer, x, routes, clock, cuda, rank, args.warmup, args.iters,
                        not args.no_check, graph=timed_graph, expect=expect,
                    )  # fmt: skip
                    del layer
                    every: list = [None] * world
                    dist.all_gather_object(every, mine)
                    row = _combine_ranks(t, m, path, cap, timed_graph, world, every)
                    _check_row(row, rank)  # the same verdict on every rank: all raise or none
                    rows.append(row)
                    per_rank += [
                        {"tokens": t, "mode": m, "path": path, "rank": r, **v}
                        for r, v in enumerate(every)
                    ]
        names: list = [None] * world
        here = torch.cuda.get_device_name(rank) if cuda else (platform.processor() or "cpu")
        dist.all_gather_object(names, here)
        if rank == 0:
            sys.stderr.write("\n")
            doc = _document(settings, args, names, rows, per_rank, experts)
            with open(os.path.join(out_dir, "result.json"), "w") as f:
                json.dump(doc, f)
    except Exception:
        with open(os.path.join(out_dir, f"error{rank}.txt"), "w") as f:
            f.write(traceback.format_exc())
        raise
    finally:
        dist.destroy_process_group()


def _document(settings, args, names, rows, per_rank, experts) -> dict:
    import fp4moe

    from .bench import git_commit, triton_version

    p = settings["preset"]
    nccl = None
    if settings["comm"] == "nccl":
        try:
            nccl = ".".join(str(v) for v in torch.cuda.nccl.version())
        except Exception:
            nccl = None
    shape = asdict(p)
    shape.pop("local_experts")
    return {
        "device": names[0],
        "devices": names,
        "world_size": settings["world"],
        "backend": settings["comm"],
        "kernels": settings["kernels"],
        "torch": torch.__version__,
        "triton": triton_version(),
        "nccl": nccl,
        "fp4moe": fp4moe.__version__,
        "commit": git_commit(),
        "date": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "preset": args.preset,
        "shape": shape,
        "experts_per_rank": p.experts // settings["world"],
        "expert_bytes_per_rank": experts.nbytes(),
        "warmup": args.warmup,
        "iters": args.iters,
        "paths": settings["paths"],
        "cuda_graph": settings["graph"] and "fixed" in settings["paths"],
        "path": (
            "variable: max_tokens=None, eager (split sizes read on the host). fixed: "
            "max_tokens=T (per rank; 1 for T=0), every rank sends max_tokens*top_k rows to "
            "every rank, padding included, "
            + (
                "timed as CUDA-graph replays (dispatch, compute, combine, forward and the "
                "local compute each captured in a graph of its own)"
                if settings["graph"]
                else "eager"
            )
            + ". Both: deterministic finalize"
        ),
        "timing": (
            "per rank: median over iters of each step, every rank at a barrier before each "
            "step (and before each graph capture); rows: max over ranks. local_compute_us: "
            "the compute step on the same received rows run alone, no collective. bytes: "
            "sent to other ranks in one call (dispatch + combine + metadata; fixed path: by "
            "capacity, padding included), max over ranks. fixed_matches_variable: the fixed "
            "path's forward (eager before timing, and the timed one) equals the variable "
            "path's bitwise on every rank; null where not checked (variable rows, "
            "w4a4-tensor)"
        ),
        "rows": rows,
        "per_rank": per_rank,
    }


# ----------------------------------------------------------------------------- parent


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _failure(world: int, tmp: str, exc: Exception) -> str:
    """The tracebacks the ranks wrote, the first written (most likely the cause) first."""
    files = [os.path.join(tmp, f) for f in os.listdir(tmp) if f.startswith("error")]
    files.sort(key=os.path.getmtime)
    parts = []
    for path in files:
        rank = os.path.basename(path)[len("error") : -len(".txt")]
        with open(path) as f:
            parts.append(f"[rank {rank}] {f.read().rstrip()}")
    detail = "\n".join(parts) if parts else str(exc)
    return f"fp4moe bench --ep {world}: a process failed (first error first):\n{detail}"


def run_ep(args: argparse.Namespace) -> dict:
    """Spawn ``args.ep`` processes, run the benchmark, write JSON and CSV under ``args.out``
    (``bench-ep.json``, ``bench-ep.csv``); returns the JSON document."""
    import torch.multiprocessing as mp

    settings = resolve(args)
    world = settings["world"]
    with tempfile.TemporaryDirectory(prefix="fp4moe-bench-ep-") as tmp:
        init = f"tcp://127.0.0.1:{_free_port()}"
        ctx = mp.start_processes(
            _worker, args=(settings, args, init, tmp), nprocs=world, join=False,
            start_method="spawn",
        )  # fmt: skip
        try:
            while not ctx.join(timeout=1.0):
                pass
        except Exception as exc:
            raise RuntimeError(_failure(world, tmp, exc)) from exc
        finally:
            for proc in ctx.processes:
                if proc.is_alive():
                    proc.terminate()
        with open(os.path.join(tmp, "result.json")) as f:
            doc = json.load(f)
    write_outputs(doc, args.out)
    return doc


TABLE_COLS = [
    "tokens", "mode", "path", "cuda_graph", "dispatch_us", "compute_us", "combine_us", "total_us",
    "local_compute_us", "total_over_local", "bytes_sent", "recv_rows_max", "recv_rows_min",
]  # fmt: skip


def format_table(doc: dict) -> str:
    s = doc["shape"]
    head = (
        f"# {doc['device']} x{doc['world_size']}  {doc['backend']}, {doc['kernels']} kernels  "
        f"preset {doc['preset']}: {s['experts']} experts ({doc['experts_per_rank']} a rank), "
        f"top-{s['top_k']}, H {s['hidden']}, I {s['inter']}\n"
        "# tokens per rank; microseconds: max over ranks of each rank's median; bytes sent by "
        "one rank to the others in one call; path fixed: max_tokens = tokens, cuda_graph: "
        "timed as CUDA-graph replays"
    )
    from .bench import table_rows

    return "\n".join([head, *table_rows(doc["rows"], TABLE_COLS, 16)])


def write_outputs(doc: dict, out: str) -> None:
    from .bench import write_json_csv

    write_json_csv(doc, out, "bench-ep")


def main_args(args: argparse.Namespace) -> int:
    """The command line's ``--ep`` path: exit 0, 1 (cannot run here, or a process failed)
    or 2 (bad usage)."""
    try:
        doc = run_ep(args)
    except ValueError as exc:
        print(f"fp4moe bench: error: {exc}", file=sys.stderr)
        return 2
    except EPUnavailable as exc:
        print(str(exc), file=sys.stderr)
        return 1
    except RuntimeError as exc:
        print(str(exc), file=sys.stderr)
        return 1
    print(format_table(doc))
    print(f"(JSON and CSV in {args.out}/bench-ep.json, bench-ep.csv)")
    return 0
