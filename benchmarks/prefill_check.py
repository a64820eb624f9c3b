"""A quick check of ``TritonOptions.gluon_prefill`` on the GPU: one call a mode on a
preset's routes with the dense path on and off, bitwise against the dense path on the
decoded weights (the deterministic finalize) and the reference's error, then each
GEMM's time with and without (CUDA-graph replays). Exits 1 when a bit differs.

    PYTHONPATH=src python3 benchmarks/prefill_check.py --tokens 2048 8192
"""

from __future__ import annotations

import argparse
import sys

import torch

from fp4moe.bench import MODES, PRESETS, make_routes, random_experts, time_us
from fp4moe.kernels.launch import TritonOptions, moe_triton
from fp4moe.reference import moe_reference


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="deepseek-v3-ep8")
    ap.add_argument("--tokens", type=int, nargs="+", default=[2048])
    ap.add_argument("--modes", nargs="+", default=list(MODES))
    ap.add_argument("--iters", type=int, default=5)
    a = ap.parse_args()
    p = PRESETS[a.preset]
    torch.manual_seed(0)
    ex = random_experts(p)
    vf = p.local_experts / p.experts
    ok = True
    for t in a.tokens:
        x = torch.randn(t, p.hidden, device="cuda").to(torch.bfloat16)
        ids, w = make_routes(p, t, t, "cuda")
        for mode in a.modes:
            m, sc = MODES[mode]
            outs, us = {}, {}
            for on in (False, True):
                opt = TritonOptions(dense_above=0, gluon_prefill=on, valid_fraction=vf,
                                    poison=True)  # fmt: skip
                outs[on] = moe_triton(x, ids, w, ex, mode=m, act_scale=sc, options=opt)
                torch.cuda.synchronize()
                us[on] = time_us(
                    lambda opt=opt: moe_triton(x, ids, w, ex, mode=m, act_scale=sc, options=opt),
                    graph=True,
                    warmup=2,
                    iters=a.iters,
                )
            ref = moe_reference(x, ids, w, ex, mode=m, act_scale=sc).float()
            err = float((outs[True].float() - ref).norm() / ref.norm().clamp_min(1e-30))
            same = bool(torch.equal(outs[False], outs[True]))
            ok = ok and same
            print(f"T={t:6d} {mode:11s} dense {us[False]:9.1f} us  prefill {us[True]:9.1f} us  "
                  f"same {same}  err {err:.2e}", flush=True)  # fmt: skip
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
