"""One MoE call of a bench preset, for profilers (ncu, nsys): warm-up, then --calls calls.

    ncu --clock-control none -k regex:moe_gemm_kernel -c 2 \
        python3 benchmarks/profile_call.py --tokens 16 --mode w4a16
    python3 benchmarks/profile_call.py --tokens 8192 --calls 5 --kernels   # torch.profiler
    python3 benchmarks/profile_call.py --tokens 1 --calls 5 --kernels --graph --timeline

``--kernels`` prints the GPU time of each kernel (torch.profiler, averaged over the
calls) instead of leaving the profiling to an outside tool; ``--graph`` profiles replays
of one CUDA graph of the call, ``--timeline`` prints the last call's kernels in time.
Options as ``fp4moe bench`` sets them (``valid_fraction`` from the preset);
``--no-dense`` turns the dense path off; ``--cuda`` puts the decode GEMMs on the CUDA
kernel (``TritonOptions.cuda_decode``).
"""

import argparse

import torch

from fp4moe.bench import MODES, PRESETS, make_routes, random_experts
from fp4moe.kernels.launch import TritonOptions, moe_triton

p = argparse.ArgumentParser()
p.add_argument("--preset", default="deepseek-v3-ep8", choices=sorted(PRESETS))
p.add_argument("--tokens", type=int, default=16)
p.add_argument("--mode", default="w4a16", choices=sorted(MODES))
p.add_argument("--fused", action="store_true")
p.add_argument("--calls", type=int, default=1)
p.add_argument("--kernels", action="store_true", help="print each kernel's GPU time")
p.add_argument("--no-dense", action="store_true")
p.add_argument("--split-k", action="store_true", help="TritonOptions.split_k=True")
p.add_argument("--gluon-tma", type=int, default=None, metavar="BUFFERS",
               help="gluon_ws.BUFFERS of the Gluon GEMMs (default: the library's); "
               "0: gluon_decode off (loop 3)")  # fmt: skip
p.add_argument("--diag", type=int, default=0, choices=(0, 1, 2, 3, 4),
               help="gluon_ws.DIAG: 1 to 4 give WRONG results, timing only (1 the Gluon "
               "GEMMs without their decode, 2 without their copies and waits, 3 "
               "without both, 4 without both and their wgmmas)")  # fmt: skip
p.add_argument(
    "--tile-rows",
    type=int,
    default=64,
    choices=(64, 128),
    help="gluon_ws.TILE_ROWS: the Gluon GEMMs' weight rows a program",
)
p.add_argument("--whole-k", action="store_true", help="TritonOptions.gluon_whole_k=True")
p.add_argument("--whole-upto", type=float, default=None,
               help="TritonOptions.gluon_whole_upto (0: loop 3 where it runs unsplit)")  # fmt: skip
p.add_argument("--cuda", action="store_true",
               help="TritonOptions.cuda_decode=True (the CUDA decode GEMMs)")  # fmt: skip
p.add_argument("--cuda-depth", type=int, default=None, help="cuda_decode.DEPTH")
p.add_argument("--cuda-rows", type=int, default=None, help="cuda_decode.ROWS_PER_BLOCK")
p.add_argument("--cuda-only", choices=("fc1", "fc2"), default=None, help="cuda_decode.ONLY")
p.add_argument("--cuda-nopdl", action="store_true", help="cuda_decode.PDL False")
p.add_argument("--cuda-diag", type=int, default=0, help="cuda_decode.DIAG (timing only)")
p.add_argument("--cuda-l2next", type=int, default=0, help="cuda_decode.L2_NEXT (0 to 2)")
p.add_argument("--cuda-cross", action="store_true", help="cuda_decode.CROSS_ITEMS")
p.add_argument("--cuda-rot", action="store_true", help="cuda_decode.ROT_LAYOUT")
p.add_argument("--graph", action="store_true",
               help="--kernels over replays of one CUDA graph of the call")  # fmt: skip
p.add_argument("--timeline", action="store_true",
               help="--kernels: also each kernel's start and end in the last call, us from "
               "its first kernel's start")  # fmt: skip
a = p.parse_args()
pr = PRESETS[a.preset]
if a.diag or a.tile_rows != 64:
    from fp4moe.kernels import gluon_ws

    gluon_ws.DIAG = a.diag
    gluon_ws.TILE_ROWS = a.tile_rows
torch.manual_seed(0)
ex = random_experts(pr)
x = torch.randn(a.tokens, pr.hidden, device="cuda").to(torch.bfloat16)
ids, w = make_routes(pr, a.tokens, a.tokens, "cuda")
m, sc = MODES[a.mode]


kw = {}
if a.no_dense:
    kw["dense_above"] = None
if a.split_k:
    kw["split_k"] = True
if a.whole_k:
    kw["gluon_whole_k"] = True
if a.whole_upto is not None:
    kw["gluon_whole_upto"] = a.whole_upto
if a.cuda:
    from fp4moe.kernels import cuda_decode

    kw["cuda_decode"] = True
    if a.cuda_depth is not None:
        cuda_decode.DEPTH = a.cuda_depth
    cuda_decode.ROWS_PER_BLOCK = a.cuda_rows
    cuda_decode.ONLY = a.cuda_only
    cuda_decode.PDL = not a.cuda_nopdl
    cuda_decode.DIAG = a.cuda_diag
    cuda_decode.L2_NEXT = a.cuda_l2next
    cuda_decode.CROSS_ITEMS = a.cuda_cross
    cuda_decode.ROT_LAYOUT = a.cuda_rot
if a.gluon_tma == 0:
    kw["gluon_decode"] = False
elif a.gluon_tma is not None:
    from fp4moe.kernels import gluon_ws

    gluon_ws.BUFFERS = a.gluon_tma
opt = TritonOptions(valid_fraction=pr.local_experts / pr.experts, **kw)


def call():
    return moe_triton(x, ids, w, ex, mode=m, act_scale=sc, fused_finalize=a.fused, options=opt)


call()
torch.cuda.synchronize()
run = call
if a.graph:
    g = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        call()  # the workspaces' allocations before the capture
    torch.cuda.current_stream().wait_stream(s)
    with torch.cuda.graph(g):
        call()
    g.replay()
    torch.cuda.synchronize()
    run = g.replay
if a.kernels:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(a.calls):
            run()
            torch.cuda.synchronize()  # calls apart, so the last call's kernels are its own
    tot: dict[str, list[float]] = {}
    spans = []
    for ev in prof.events():
        if ev.device_type.name == "CUDA":
            tot.setdefault(ev.name[:60], []).append(ev.device_time_total)
            spans.append((ev.time_range.start, ev.time_range.end, ev.name[:60]))
    print(f"{a.preset} T={a.tokens} {a.mode} dense={not a.no_dense}: us a call (launches)")
    for name, ts in sorted(tot.items(), key=lambda kv: -sum(kv[1])):
        print(f"  {sum(ts) / a.calls:9.1f}  ({len(ts) // a.calls})  {name}")
    print(f"  {sum(sum(v) for v in tot.values()) / a.calls:9.1f}  total")
    if not tot:  # a torch whose events carry no device type: its own table
        print(prof.key_averages().table(sort_by="self_device_time_total", row_limit=25))
    if a.timeline and spans:
        spans.sort()
        per = len(spans) // a.calls  # the last call: its kernels are the last ones started
        last = spans[-per:]
        t0 = last[0][0]
        print(f"the last call's kernels, us from its first kernel's start ({per} kernels):")
        for st, en, name in last:
            print(f"  {st - t0:8.1f} .. {en - t0:8.1f}  ({en - st:6.1f})  {name}")
        print(f"  span {last[-1][1] - t0:.1f} (last end {max(e for _, e, _ in last) - t0:.1f})")
else:
    torch.cuda.cudart().cudaProfilerStart()
    for _ in range(a.calls):
        call()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStop()
