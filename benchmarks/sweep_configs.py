"""Time pinned GEMM configs of the Triton MoE (DeepSeek-V3 EP8 shape) and report the
compiler's view of each (registers, spills, whether the MMAs are wgmma).

    python3 benchmarks/sweep_configs.py --tokens 16 8192 --mode w4a16
"""

from __future__ import annotations

import argparse
import sys

import torch

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from bench_moe import PRESETS, make_routes, time_graph

CANDIDATES = {
    # (BM, BN, BK, warps, stages, prefetch)
    "small": [
        (16, 64, 256, 4, 4, False),
        (16, 64, 256, 4, 1, True),
        (16, 64, 256, 4, 3, True),
        (16, 128, 128, 4, 3, False),
        (16, 128, 128, 4, 1, True),
        (16, 64, 128, 4, 1, True),
        (16, 128, 256, 8, 1, True),
        (16, 64, 512, 4, 1, True),
    ],
    "large": [
        (128, 128, 32, 8, 4, False),
        (128, 128, 64, 8, 3, False),
        (128, 128, 64, 8, 1, True),
        (128, 128, 32, 8, 3, True),
        (128, 256, 32, 8, 3, False),
        (64, 128, 64, 4, 3, True),
    ],
}


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--tokens", type=int, nargs="+", default=[16, 8192])
    p.add_argument("--mode", default="w4a16")
    p.add_argument("--preset", default="deepseek-v3-ep8")
    p.add_argument("--decode-asm", action="store_true")
    args = p.parse_args(argv)
    import fp4moe
    from fp4moe.kernels import gemm
    from fp4moe.kernels.gemm import GemmConfig
    from fp4moe.kernels.launch import TritonOptions, moe_triton

    h, inter, e_total, e_local, k = PRESETS[args.preset]
    torch.manual_seed(0)
    w13 = (torch.randn(e_local, 2 * inter, h, device="cuda") * 0.02).to(torch.bfloat16)
    w2 = (torch.randn(e_local, h, inter, device="cuda") * 0.02).to(torch.bfloat16)
    experts = fp4moe.prepare_experts(w13, w2)
    del w13, w2
    m, sc = ("w4a16", "per_token") if args.mode == "w4a16" else ("w4a4", "per_token")
    for t in args.tokens:
        x = torch.randn(t, h, device="cuda").to(torch.bfloat16)
        ids, w = make_routes(t, e_total, e_local, k, seed=t)
        touched = int(torch.unique(ids[ids >= 0]).numel())
        bytes_ = touched * experts.nbytes() / e_local
        flops = 2 * int((ids >= 0).sum()) * 3 * h * inter
        for c in CANDIDATES["small" if t <= 64 else "large"]:
            cfg = GemmConfig(*c)
            opt = TritonOptions(fc1=cfg, fc2=cfg, decode_asm=args.decode_asm)
            try:
                us = time_graph(
                    lambda: moe_triton(
                        x,
                        ids,
                        w,
                        experts,
                        mode=m,
                        act_scale=sc,
                        options=opt,
                    )
                )
            except Exception as exc:
                print(f"T={t} {c} failed: {str(exc)[:200]}")
                continue
            info = []
            try:
                cache = gemm.moe_gemm_kernel.device_caches[torch.cuda.current_device()][0]
                for kern in cache.values():
                    asm = kern.asm.get("ptx", "")
                    info.append(
                        f"regs={kern.n_regs} spills={kern.n_spills} "
                        f"wgmma={'wgmma' in asm} mma={'mma.sync' in asm}"
                    )
                cache.clear()
            except Exception as exc:
                info.append(f"no compiler info ({type(exc).__name__})")
            print(
                f"T={t:5d} cfg={c} {us:9.1f} us  {bytes_ / us / 1e6:.2f} TB/s  "
                f"{flops / us / 1e6:.1f} TFLOP/s  | " + " ; ".join(info),
                flush=True,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
