"""The route sort alone, each implementation on the same routes: the torch ops, the sort
kernel in one launch and in two (``kernels.sort.ONE_PASS_MAX_ROUTES``), every output
checked field by field against the torch sort first; the measurement behind
``SORT_KERNEL_MAX_ROUTES`` and ``ONE_PASS_MAX_ROUTES``.

    python3 benchmarks/sort_bench.py --presets deepseek-v3-ep8 qwen3-30b-a3b \\
        --routes 8192 16384 32768 65536 262144

Routes are a preset's (``bench.make_routes``: other ranks' experts masked) for
``routes / top_k`` tokens. Each configuration is one CUDA graph of ``--reps`` sorts,
sampled interleaved in rounds (``bench.GraphTimer``); microseconds a sort. Exit status 1
when an output differs from the torch sort's.
"""

from __future__ import annotations

import argparse
import statistics
import sys

import torch

from fp4moe.bench import GraphTimer, make_routes, round_orders
from fp4moe.kernels import sort
from fp4moe.presets import PRESETS

VARIANTS = {  # name: (the kernel, ONE_PASS_MAX_ROUTES while captured)
    "torch": (False, None),
    "one-launch": (True, 1 << 40),
    "two-launch": (True, 0),
}


def _same(a: sort.RouteSort, b: sort.RouteSort) -> bool:
    return all(
        torch.equal(getattr(a, f), v) for f, v in vars(b).items() if isinstance(v, torch.Tensor)
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    ap.add_argument("--presets", nargs="+", default=["deepseek-v3-ep8", "qwen3-30b-a3b"],
                    choices=sorted(PRESETS))  # fmt: skip
    ap.add_argument("--routes", type=int, nargs="+",
                    default=[4096, 8192, 16384, 32768, 65536, 131072, 262144])  # fmt: skip
    ap.add_argument("--block-m", type=int, default=64, help="the tile schedule's rows")
    ap.add_argument("--reps", type=int, default=20, help="sorts a CUDA graph")
    ap.add_argument("--samples", type=int, default=9)
    a = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("sort_bench.py needs a CUDA GPU", file=sys.stderr)
        return 1
    default = sort.ONE_PASS_MAX_ROUTES
    differ = 0
    print(f"{'preset':18s} {'routes':>8s} " + " ".join(f"{v:>11s}" for v in VARIANTS) + "  (us)")
    for name in a.presets:
        p = PRESETS[name]
        for n in a.routes:
            ids, _ = make_routes(p, max(n // p.top_k, 1), 1, "cuda")
            ids = ids.to(torch.int32).contiguous()
            e = p.local_experts
            ref = sort.sort_routes(ids, e, a.block_m, use_kernel=False)
            timers = {}
            for v, (kernel, one_pass) in VARIANTS.items():
                sort.ONE_PASS_MAX_ROUTES = default if one_pass is None else one_pass
                try:
                    if not _same(sort.sort_routes(ids, e, a.block_m, use_kernel=kernel), ref):
                        print(f"{name} {n} {v}: not the torch sort's outputs", file=sys.stderr)
                        differ += 1
                    timers[v] = GraphTimer(
                        lambda kernel=kernel, ids=ids, e=e: sort.sort_routes(
                            ids, e, a.block_m, use_kernel=kernel),
                        graph=True, warmup=2, reps=a.reps,
                    )  # fmt: skip
                finally:
                    sort.ONE_PASS_MAX_ROUTES = default
            samples: dict = {v: [] for v in timers}
            for order in round_orders(list(timers), 3):
                for v in order:
                    samples[v] += timers[v].sample(max(a.samples // 3, 1))
            us = {v: statistics.median(s) for v, s in samples.items()}
            print(f"{name:18s} {n:8d} " + " ".join(f"{us[v]:11.1f}" for v in VARIANTS),
                  flush=True)  # fmt: skip
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main())
