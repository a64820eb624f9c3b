"""One MoE call of a bench preset, for profilers (ncu, nsys): warm-up, then --calls calls.

    ncu --clock-control none -k regex:moe_gemm_kernel -c 2 \
        python3 benchmarks/profile_call.py --tokens 16 --mode w4a16
"""

import argparse

import torch

import fp4moe
from fp4moe.bench import MODES, PRESETS, make_routes
from fp4moe.kernels.launch import TritonOptions, moe_triton

p = argparse.ArgumentParser()
p.add_argument("--preset", default="deepseek-v3-ep8", choices=sorted(PRESETS))
p.add_argument("--tokens", type=int, default=16)
p.add_argument("--mode", default="w4a16", choices=sorted(MODES))
p.add_argument("--fused", action="store_true")
p.add_argument("--calls", type=int, default=1)
a = p.parse_args()
pr = PRESETS[a.preset]
torch.manual_seed(0)
e = pr.local_experts
w13 = torch.randn(e, 2 * pr.inter, pr.hidden, device="cuda", dtype=torch.bfloat16) * 0.02
w2 = torch.randn(e, pr.hidden, pr.inter, device="cuda", dtype=torch.bfloat16) * 0.02
s = torch.full((e,), 4.0 / 2688, device="cuda")
ex = fp4moe.prepare_experts(w13, w2, a13_scale=s, a2_scale=s * 0.1)
x = torch.randn(a.tokens, pr.hidden, device="cuda").to(torch.bfloat16)
ids, w = make_routes(pr, a.tokens, a.tokens, "cuda")
m, sc = MODES[a.mode]


def call():
    return moe_triton(
        x, ids, w, ex, mode=m, act_scale=sc, fused_finalize=a.fused, options=TritonOptions()
    )


call()
torch.cuda.synchronize()
torch.cuda.cudart().cudaProfilerStart()
for _ in range(a.calls):
    call()
torch.cuda.synchronize()
torch.cuda.cudart().cudaProfilerStop()
