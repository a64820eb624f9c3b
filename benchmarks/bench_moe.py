"""Measure the Triton MoE against the byte floor and a bf16 grouped-GEMM MoE on one GPU.

    python3 benchmarks/bench_moe.py --tokens 1 16 256 8192 --json out.json

Prints a table and writes JSON: card ceilings measured in the same run (device-to-device
copy bandwidth, bf16 matmul rate), then per token count and mode the median time over
CUDA-graph replays, the fraction of the byte floor (touched NVFP4 expert bytes over the
measured copy bandwidth) and the speed-up over the bf16 ``torch._grouped_mm`` MoE with the
same routes. Each timed configuration is checked against the reference first.
This script grows into ``fp4moe bench`` (issue 4).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys

import torch

from fp4moe.bench import bf16_grouped_moe  # the same baseline as `fp4moe bench`

PRESETS = {
    # name: (hidden, inter, experts total, local experts, top_k)
    "deepseek-v3-ep8": (7168, 2048, 256, 32, 8),
    "qwen3-30b-a3b": (2048, 768, 128, 128, 8),
    "gpt-oss-like": (2880, 2880, 128, 128, 4),
}


def time_graph(fn, iters: int = 20, reps: int = 5) -> float:
    """Median microseconds of one call, over CUDA-graph replays of ``reps`` calls each."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(reps):
            fn()
    g.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        a = torch.cuda.Event(enable_timing=True)
        b = torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1000 / reps)
    return statistics.median(times)


def card_ceilings() -> dict:
    n = 1 << 30  # 1 GiB each way; a kernel copy (a graph's memcpy node may use a copy engine)
    src = torch.empty(n // 4, dtype=torch.float32, device="cuda")
    dst = torch.empty_like(src)
    us = time_graph(lambda: torch.mul(src, 1.0, out=dst), iters=10, reps=3)
    copy_tbs = 2 * n / (us * 1e-6) / 1e12
    m = 8192
    a = torch.randn(m, m, dtype=torch.bfloat16, device="cuda")
    b = torch.randn(m, m, dtype=torch.bfloat16, device="cuda")
    us = time_graph(lambda: a @ b, iters=10, reps=3)
    tflops = 2 * m**3 / (us * 1e-6) / 1e12
    return {"copy_TBps": copy_tbs, "bf16_matmul_TFLOPs": tflops}


def make_routes(t: int, e_total: int, e_local: int, k: int, seed: int):
    g = torch.Generator(device="cuda").manual_seed(seed)
    scores = torch.rand(t, e_total, device="cuda", generator=g)
    w, ids = scores.topk(k, dim=1)
    w = (w / w.sum(1, keepdim=True)).float()
    ids = torch.where(ids < e_local, ids, -1).to(torch.int32)
    return ids, w


def main(argv=None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--preset", default="deepseek-v3-ep8", choices=sorted(PRESETS))
    p.add_argument("--tokens", type=int, nargs="+", default=[1, 16, 256, 8192])
    p.add_argument("--modes", nargs="+", default=["w4a16", "w4a4-token", "w4a4-tensor"])
    p.add_argument("--finalize", choices=["fused", "unfused", "both"], default="both")
    p.add_argument("--no-pdl", action="store_true")
    p.add_argument("--decode-asm", action="store_true", help="inline-PTX W4A16 weight decode")
    p.add_argument("--no-baseline", action="store_true")
    p.add_argument("--check", action="store_true", help="check each config against the reference")
    p.add_argument("--json", default=None)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_moe.py needs a CUDA GPU", file=sys.stderr)
        return 2

    import fp4moe
    from fp4moe.kernels.launch import TritonOptions, moe_triton
    from fp4moe.reference import moe_reference

    h, inter, e_total, e_local, k = PRESETS[args.preset]
    ceil = card_ceilings()
    print(
        f"# {torch.cuda.get_device_name()}  copy {ceil['copy_TBps']:.2f} TB/s  "
        f"bf16 {ceil['bf16_matmul_TFLOPs']:.0f} TFLOP/s  preset {args.preset}"
    )
    torch.manual_seed(args.seed)
    w13 = (torch.randn(e_local, 2 * inter, h, device="cuda") * 0.02).to(torch.bfloat16)
    w2 = (torch.randn(e_local, h, inter, device="cuda") * 0.02).to(torch.bfloat16)
    experts = fp4moe.prepare_experts(w13, w2)
    bytes_per_expert = experts.nbytes() / e_local
    # _grouped_mm wants B [G, K, N] with K contiguous: a transposed view of [G, N, K].
    w13_deq, w2_deq = experts.dequantize(torch.bfloat16)
    w13_t, w2_t = w13_deq.transpose(1, 2), w2_deq.transpose(1, 2)
    del w13, w2
    opt = TritonOptions(pdl=not args.no_pdl, decode_asm=args.decode_asm)
    finals = {"both": [True, False], "fused": [True], "unfused": [False]}[args.finalize]
    rows = []
    for t in args.tokens:
        x = (torch.randn(t, h, device="cuda")).to(torch.bfloat16)
        ids, w = make_routes(t, e_total, e_local, k, args.seed + t)
        touched = int(torch.unique(ids[ids >= 0]).numel())
        routes = int((ids >= 0).sum())
        floor_us = touched * bytes_per_expert / (ceil["copy_TBps"] * 1e12) * 1e6
        flops = 2 * routes * 3 * h * inter
        base_us = None
        if not args.no_baseline and t >= 4096:
            # Where does the bf16 baseline's time go? Its two grouped GEMMs alone:
            grows = x[torch.argsort(torch.where(ids < 0, e_local, ids).reshape(-1))[:routes] // k]
            offs = torch.cumsum(torch.bincount(ids[ids >= 0].long(), minlength=e_local), 0)
            offs = offs.to(torch.int32)
            hbuf = torch.empty(routes, 2 * inter, dtype=torch.bfloat16, device="cuda")
            abuf = torch.empty(routes, inter, dtype=torch.bfloat16, device="cuda")
            gm_us = time_graph(
                lambda: (
                    torch._grouped_mm(grows, w13_t, offs=offs),
                    torch._grouped_mm(abuf, w2_t, offs=offs),
                )
            )
            dense_us = time_graph(lambda: (grows @ w13_t[0], abuf @ w2_t[0]))
            print(
                f"# T={t}: bf16 _grouped_mm pair {gm_us:.1f} us "
                f"({flops / gm_us / 1e6:.0f} TFLOP/s); one dense bf16 pair of the same "
                f"shapes {dense_us:.1f} us ({flops / dense_us / 1e6:.0f} TFLOP/s)"
            )
            del hbuf
        if not args.no_baseline:
            try:
                base_us = time_graph(lambda: bf16_grouped_moe(x, ids, w, w13_t, w2_t, routes))
            except Exception as exc:
                print(f"# baseline failed at T={t}: {exc}")
        for mode in args.modes:
            m, sc = {
                "w4a16": ("w4a16", "per_token"),
                "w4a4-token": ("w4a4", "per_token"),
                "w4a4-tensor": ("w4a4", "per_tensor"),
                "w4a4-static": ("w4a4", "static"),
            }[mode]
            for fused in finals:
                fn = lambda: moe_triton(
                    x,
                    ids,
                    w,
                    experts,
                    mode=m,
                    act_scale=sc,
                    fused_finalize=fused,
                    options=opt,
                )
                err = None
                if args.check and t <= 1024:
                    ref = moe_reference(x, ids, w, experts, mode=m, act_scale=sc).float()
                    out = fn().float()
                    err = ((out - ref).norm() / ref.norm().clamp_min(1e-30)).item()
                us = time_graph(fn)
                row = {
                    "tokens": t,
                    "routes": routes,
                    "touched": touched,
                    "mode": mode,
                    "finalize": "fused" if fused else "unfused",
                    "us": us,
                    "floor_frac": floor_us / us,
                    "TFLOPs": flops / (us * 1e-6) / 1e12,
                    "weight_TBps": touched * bytes_per_expert / (us * 1e-6) / 1e12,
                    "vs_bf16": (base_us / us) if base_us else None,
                    "bf16_us": base_us,
                    "rel_err": err,
                }
                rows.append(row)
                print(
                    f"T={t:6d} routes={routes:6d} touched={touched:3d} {mode:12s} "
                    f"{row['finalize']:8s} {us:9.1f} us  floor {row['floor_frac']:.2f}  "
                    f"{row['TFLOPs']:6.1f} TFLOP/s  {row['weight_TBps']:.2f} TB/s  "
                    f"bf16 {base_us or float('nan'):9.1f} us  x{row['vs_bf16'] or float('nan'):.2f}"
                    + (f"  err {err:.1e}" if err is not None else ""),
                    flush=True,
                )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    "device": torch.cuda.get_device_name(),
                    "ceilings": ceil,
                    "preset": args.preset,
                    "torch": torch.__version__,
                    "rows": rows,
                },
                f,
                indent=1,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
