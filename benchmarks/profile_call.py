"""One MoE call of a bench preset, for profilers and checkers (ncu, compute-sanitizer):
warm-up, then --calls calls; optionally a pinned kernel family and a check against the
reference.

    ncu --clock-control none -k regex:tma_split -c 2 \
        python3 benchmarks/profile_call.py --tokens 16 --mode w4a16
    compute-sanitizer --tool memcheck --error-exitcode 1 \
        python3 benchmarks/profile_call.py --tokens 40 --gemm gluon-whole --check
    python3 benchmarks/profile_call.py --tokens 8192 --calls 5 --kernels   # torch.profiler
    python3 benchmarks/profile_call.py --tokens 1 --calls 5 --kernels --graph --timeline \
        --cold-l2

``--kernels`` prints the GPU time of each kernel (torch.profiler, averaged over the
calls); ``--graph`` profiles replays of one CUDA graph of the call, ``--timeline`` prints
the last call's kernels in time; ``--cold-l2`` cycles the calls through copies of the
experts (``bench.cold_copies``), so each finds none of its weights in L2. Options as
``fp4moe bench`` sets them (``valid_fraction`` from the preset); ``--gemm`` pins both
GEMMs' kernel family (``KERNEL@ROWS`` also the tiles' rows).
"""

import argparse
import dataclasses

import torch

from fp4moe import explain, moe
from fp4moe.backend import KERNELS
from fp4moe.bench import cold_copies, make_routes, random_experts
from fp4moe.modes import TOLERANCE, relative_error
from fp4moe.presets import MODES, PRESETS
from fp4moe.reference import moe_reference
from pins import pin_arg, pin_options

p = argparse.ArgumentParser()
p.add_argument("--preset", default="deepseek-v3-ep8", choices=sorted(PRESETS))
p.add_argument("--tokens", type=int, default=16)
p.add_argument("--local-experts", type=int, default=None, help="override the preset's")
p.add_argument("--mode", default="w4a16", choices=sorted(MODES))
p.add_argument("--fused", action="store_true")
p.add_argument("--gemm", default=None, type=pin_arg,
               help=f"pin both GEMMs' kernel family ({', '.join(KERNELS)}), optionally @ROWS "
               "(the tiles' rows, e.g. gluon-prefill@128)")  # fmt: skip
p.add_argument("--calls", type=int, default=1)
p.add_argument("--check", action="store_true", help="check the output against the reference")
p.add_argument("--kernels", action="store_true", help="print each kernel's GPU time")
p.add_argument("--graph", action="store_true",
               help="--kernels over replays of one CUDA graph of the call")  # fmt: skip
p.add_argument("--timeline", action="store_true",
               help="--kernels: also each kernel's start and end in the last call, us from "
               "its first kernel's start")  # fmt: skip
p.add_argument(
    "--cold-l2",
    action="store_true",
    help="calls cycle through copies of the experts: none finds its weights in L2",
)
a = p.parse_args()
pr = PRESETS[a.preset]
if a.local_experts:
    pr = dataclasses.replace(pr, local_experts=a.local_experts)
torch.manual_seed(0)
ex = random_experts(pr)
x = torch.randn(a.tokens, pr.hidden, device="cuda").to(torch.bfloat16)
ids, w = make_routes(pr, a.tokens, a.tokens, "cuda")
m, sc = MODES[a.mode]
opt = pin_options(a.gemm, valid_fraction=pr.local_experts / pr.experts)
# the checked call's buffers NaN-poisoned first (their fills are kernels of their own, so
# the profiled calls leave them out)
check_opt = dataclasses.replace(opt, poison=True)
import fp4moe  # noqa: E402

print(explain(fp4moe.plan(ex, a.tokens, pr.top_k, mode=m, act_scale=sc, fused_finalize=a.fused,
                          options=opt)))  # fmt: skip


copies = cold_copies(ex) if a.cold_l2 else [ex]


def call(c=0, options=opt):
    return moe(x, ids, w, copies[c], mode=m, act_scale=sc, fused_finalize=a.fused,
               options=options, backend="triton")  # fmt: skip


out = call(options=check_opt if a.check else opt)
torch.cuda.synchronize()
if a.check:
    ref = moe_reference(x, ids, w, ex, mode=m, act_scale=sc).float()
    err = relative_error(out, ref)
    tol = TOLERANCE[m]
    print(f"rel err {err:.2e} (tolerance {tol}), NaN {bool(out.isnan().any())}")
    if not err <= tol or out.isnan().any():
        raise SystemExit(1)
runs = [lambda c=c: call(c) for c in range(len(copies))]
if a.graph:
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        call()  # the workspaces' allocations before the capture
    torch.cuda.current_stream().wait_stream(s)
    graphs = [torch.cuda.CUDAGraph() for _ in copies]
    for c, g in enumerate(graphs):
        with torch.cuda.graph(g):
            call(c)
        g.replay()
    torch.cuda.synchronize()
    runs = [g.replay for g in graphs]
# the first call takes the copy after the one that ran last (the graphs': the last one)
turn = iter(range(0 if a.graph else 1, 1 << 30))


def run():
    runs[next(turn) % len(runs)]()


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
    print(f"{a.preset} T={a.tokens} {a.mode}: us a call (launches)")
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
        run()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStop()
