"""Every kernel family that can serve a preset's GEMMs, timed against the planner's choice
at each token count: the measurement a threshold of ``backend/heuristics.py`` rests on.

    python3 benchmarks/sweep.py --preset deepseek-v3-ep8 --num-tokens 256 512 768 1024 \\
        --modes w4a16 --out sweep-out

Each configuration (the planner's, then each ``Options.gemm`` pin that applies; a pin
``KERNEL@ROWS`` also pins the tiles' rows, e.g. ``gluon-prefill@64``) is checked against
the planner's output bit for bit, then all are timed interleaved in rounds as ``fp4moe
bench`` times them (CUDA-graph replays). Output: a table (us, and each pin's time over the
planner's; each token count's row tiles of 32, 64 and 128 rows) and ``sweep.json`` in --out;
the exit status is 1 when any pin's bits differ.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

from fp4moe import InapplicableOverride, Options
from fp4moe.backend import KERNELS
from fp4moe.backend.launch import moe_triton
from fp4moe.bench import make_routes, random_experts, time_interleaved
from fp4moe.kernels.gemm.shapes import PREFILL_BLOCKS
from fp4moe.kernels.sort import sort_routes
from fp4moe.presets import MODES, PRESETS
from pins import pin_arg, pin_options


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    ap.add_argument("--preset", default="deepseek-v3-ep8", choices=sorted(PRESETS))
    ap.add_argument("--num-tokens", type=int, nargs="+", default=[1, 16, 64, 256, 1024, 4096])
    ap.add_argument("--modes", nargs="+", default=["w4a16"], choices=sorted(MODES))
    ap.add_argument("--gemm", nargs="+", default=list(KERNELS), type=pin_arg,
                    help=f"pins: {', '.join(KERNELS)}, each optionally @ROWS")  # fmt: skip
    ap.add_argument("--fused", action="store_true", help="the fused finalize")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--out", default="sweep-out")
    a = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("sweep.py needs a CUDA GPU", file=sys.stderr)
        return 1
    p = PRESETS[a.preset]
    torch.manual_seed(0)
    experts = random_experts(p)
    frac = p.local_experts / p.experts
    rows = []
    differ = 0
    for t in a.num_tokens:
        x = torch.randn(t, p.hidden, device="cuda").to(torch.bfloat16)
        ids, w = make_routes(p, t, t, "cuda")
        # the row tiles of 32, 64 and 128 rows the routes need, one tile rows a call
        # (fit_tile_cost.py reads them)
        tiles = {bm: int(sort_routes(ids, p.local_experts, bm, use_kernel=False).valid_blocks)
                 for bm in PREFILL_BLOCKS}  # fmt: skip
        print(f"{t:6d} tiles: " + ", ".join(f"{v} of {bm} rows" for bm, v in tiles.items()),
              flush=True)  # fmt: skip
        calls = {}
        for mode in a.modes:
            m, sc = MODES[mode]
            kw = dict(mode=m, act_scale=sc, fused_finalize=a.fused)
            base = moe_triton(x, ids, w, experts, options=Options(valid_fraction=frac), **kw)
            for g in (None, *a.gemm):
                opt = pin_options(g, valid_fraction=frac)
                try:
                    out = moe_triton(x, ids, w, experts, options=opt, **kw)
                except InapplicableOverride:
                    continue
                if not a.fused and not torch.equal(out, base):
                    print(f"T={t} {mode} gemm={g}: not the planner's bits", flush=True)
                    differ += 1

                def call(opt=opt, kw=kw):
                    return moe_triton(x, ids, w, experts, options=opt, **kw)

                calls[mode, g or "planner"] = call
        us = time_interleaved(calls, graph=True, warmup=3, iters=a.iters, rounds=a.rounds)
        for (mode, g), v in us.items():
            rows.append(dict(tokens=t, mode=mode, gemm=g, us=v, tiles=tiles,
                             over_planner=v / us[mode, "planner"]))  # fmt: skip
        for r in rows[-len(us) :]:
            print(f"{r['tokens']:6d} {r['mode']:12s} {r['gemm']:14s} {r['us']:10.1f} "
                  f"{r['over_planner']:6.3f}", flush=True)  # fmt: skip
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "sweep.json"), "w") as f:
        json.dump({"preset": a.preset, "fused": a.fused, "rows": rows}, f, indent=1)
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main())
