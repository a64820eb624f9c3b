"""The deterministic finalize's tokens a program (``finalize.TOKENS_PER_PROGRAM``) on a
preset's routes: each value timed (CUDA-graph replays) on the same route rows, bitwise
against one token a program.

    PYTHONPATH=src python3 benchmarks/finalize_tpp.py --tokens 2048 8192 16384
"""

from __future__ import annotations

import argparse

import torch

from fp4moe.bench import PRESETS, make_routes, time_us
from fp4moe.kernels import finalize
from fp4moe.kernels.launch import finalize_rows
from fp4moe.kernels.sort import sort_routes


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="deepseek-v3-ep8")
    ap.add_argument("--tokens", type=int, nargs="+", default=[2048, 8192, 16384])
    ap.add_argument("--tpp", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    ap.add_argument("--iters", type=int, default=20)
    a = ap.parse_args()
    p = PRESETS[a.preset]
    tpp0, from0 = finalize.TOKENS_PER_PROGRAM, finalize.TOKENS_FROM
    finalize.TOKENS_FROM = 1
    for t in a.tokens:
        ids, w = make_routes(p, t, t, "cuda")
        ids = ids.to(torch.int32)
        s = sort_routes(ids, p.local_experts, 128)
        y = torch.randn(ids.numel(), p.hidden, device="cuda").to(torch.bfloat16)
        wf = w.reshape(-1).float()
        first = None
        for tpp in a.tpp:
            finalize.TOKENS_PER_PROGRAM = tpp
            out = finalize_rows(y, s.route_pos, ids, wf)
            first = out if first is None else first
            us = time_us(lambda: finalize_rows(y, s.route_pos, ids, wf),
                         graph=True, warmup=3, iters=a.iters)  # fmt: skip
            print(f"T={t:6d} tokens a program {tpp:3d} {us:8.1f} us  "
                  f"same {bool(torch.equal(out, first))}", flush=True)  # fmt: skip
    finalize.TOKENS_PER_PROGRAM, finalize.TOKENS_FROM = tpp0, from0


if __name__ == "__main__":
    main()
