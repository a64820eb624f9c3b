"""What the compiler makes of the grouped GEMM, without a GPU: compile ``moe_gemm_kernel``
for sm_90 (Triton's bundled ptxas) and report, per config, registers, spills and the SASS
of the main loop: instructions a weight, the most frequent opcodes, the synchronization
(BAR, MEMBAR, wgmma waits) and whether the MMAs are wgmma.

    python3 benchmarks/sass_report.py                      # DeepSeek-V3 FC1 and FC2, loops 0, 2, 3
    python3 benchmarks/sass_report.py --gemm fc1 --loop 2 --config 16,64,256,4,2

Instructions a weight is the count of SASS instructions in the innermost loop that holds
the HGMMAs, divided by the weights one thread decodes per trip. It is the model behind
docs/perf-notes.md (time = weights x instructions a weight / issue rate); measure on the
GPU before trusting a change.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
from collections import Counter

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))
# Compiling needs real @triton.jit functions, not the interpreter's (a process that has
# already imported fp4moe.kernels under TRITON_INTERPRET=1 cannot use this module).
os.environ.pop("TRITON_INTERPRET", None)

# Shapes (H, I) of the bench presets, without importing torch-heavy modules.
SHAPES = {
    "deepseek-v3-ep8": (7168, 2048),
    "qwen3-30b-a3b": (2048, 768),
    "mixtral-8x7b": (4096, 14336),
    "gpt-oss-120b-shape": (2880, 2880),
}
DEFAULT_CONFIGS = ["16,64,256,4,2", "16,128,128,4,2", "64,128,32,4,4", "128,64,64,4,3"]


def compile_gemm(
    *,
    n: int,
    k: int,
    gated: bool,
    a_fp4: bool,
    loop: int,
    cfg: tuple[int, ...],
    split: bool,
    dense: bool = False,
    maxnreg: int | None = None,
    out_amax: bool = False,
    ordered_x: bool = False,
    blocks_last: bool = False,
):
    """Compile one ``moe_gemm_kernel`` specialization for sm_90; returns the compiled kernel.
    ``out_amax``: the epilogue's per-tensor amax of the output (``OUT_AMAX``);
    ``ordered_x``: W4A16's activation rows already in the loop's K order (``A_ORDERED``);
    ``blocks_last``: the split grid (tiles, segments, blocks), the library's default
    (``BLOCKS_LAST``)."""
    import triton.language as tl

    from fp4moe.kernels.common import compile_sm90
    from fp4moe.kernels.gemm import moe_gemm_kernel
    from fp4moe.kernels.launch import SEGMENT, k_order

    bm, bn, bk, warps, stages = cfg
    ptrs = {
        "a_ptr": "*u8" if a_fp4 else "*bf16",
        "a_scales_ptr": "*fp8e4nv",
        "a_global_ptr": "*fp32",
        "sorted_routes_ptr": "*i32",
        "topk_w_ptr": "*fp32",
        "w_codes_ptr": "*u8",
        "w_scales_ptr": "*fp8e4nv",
        "w_global_ptr": "*fp32",
        "out_ptr": "*bf16",
        "out_scales_ptr": "*fp8e4nv",
        "out_global_ptr": "*fp32",
        "out_table_ptr": "*fp32",
        "block_expert_ptr": "*i32",
        "block_start_ptr": "*i32",
        "block_end_ptr": "*i32",
        "part_ptr": "*fp32",
        "cnt_ptr": "*i32",
        "amax_ptr": "*fp32",
    }
    chunked = loop > 0
    dense = dense and loop >= 2  # the dense path exists for the chunk-ordered loops only
    dot = tl.bfloat16 if chunked or not a_fp4 else tl.float16
    const = dict(
        N=n, K=k, TOPK=8, GATED=gated, A_FP4=a_fp4, A_GATHER=gated, FUSED=False,
        OUT_SCALE=1.0, BM=bm, BN=bn, BK=bk, DOT_DTYPE=dot, W_DTYPE=dot, USE_PDL=True,
        INTERPRET=False, DECODE_ASM=chunked, PREFETCH=False, OUT_FP4=False, CHUNKED=loop,
        SEG_TILES=SEGMENT // bk if loop == 3 else 0, SPLIT=split and loop == 3,
        W_DENSE=dense, GROUP_M=8 if dense else 0, ORDER=k_order(loop, k, bk),
        OUT_AMAX=out_amax,
        A_ORDERED=ordered_x and loop >= 2 and not a_fp4,
        BLOCKS_LAST=blocks_last and split and loop == 3,
    )  # fmt: skip
    if dense:  # both operands decoded, bf16 (dequant.dense_weights)
        ptrs = {**ptrs, "w_codes_ptr": "*bf16", "a_ptr": "*bf16"}
    opts = dict(num_warps=warps, num_stages=stages)
    if maxnreg:
        opts["maxnreg"] = maxnreg
    return compile_sm90(moe_gemm_kernel, ptrs, const, ints=("ws_rows",), **opts)


def _tool(name: str) -> str:
    import triton

    return os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", name)


def sass_stats(kernel, weights_per_trip: float) -> dict:
    """Registers, spills and the main loop's instruction mix of a compiled kernel."""
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "k.cubin")
        with open(path, "wb") as f:
            f.write(kernel.asm["cubin"])
        sass = subprocess.run(
            [_tool("cuobjdump"), "-sass", path], capture_output=True, text=True, check=True
        ).stdout
    from fp4moe.kernels.common import resource_usage

    res = resource_usage(kernel)
    regs = res["REG"]
    spills = res.get("LOCAL", 0)
    insts = []  # (address, opcode)
    branches = []  # (address, target)
    for line in sass.splitlines():
        m = re.match(r"\s+/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)", line)
        if not m:
            continue
        addr = int(m.group(1), 16)
        insts.append((addr, m.group(2)))
        b = re.search(r"\bBRA\s+(?:`\()?(0x[0-9a-f]+)", line)
        if b and int(b.group(1), 16) < addr:
            branches.append((addr, int(b.group(1), 16)))
    # The innermost backward branch whose body holds the HGMMAs is the main loop.
    best = None
    for end, start in branches:
        body = [op for a, op in insts if start <= a <= end]
        has_mma = "HGMMA" in body or "HMMA" in body
        if has_mma and (best is None or len(body) < len(best)):
            best = body
    ops = Counter(best or [])
    n = sum(ops.values())
    return {
        "registers": regs,
        "local_bytes": spills,
        "loop_instructions": n,
        "instructions_per_weight": n / weights_per_trip if n else None,
        "wgmma": "HGMMA" in ops,
        "sync": {k: ops.get(k, 0) for k in ("BAR", "MEMBAR", "WARPGROUP", "DEPBAR")},
        "top": ops.most_common(8),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="deepseek-v3-ep8", choices=sorted(SHAPES))
    p.add_argument("--gemm", choices=["fc1", "fc2", "both"], default="both")
    p.add_argument("--mode", choices=["w4a16", "w4a4"], default="w4a16")
    p.add_argument("--loop", type=int, nargs="+", default=[0, 2, 3], choices=[0, 1, 2, 3])
    p.add_argument("--config", nargs="+", default=DEFAULT_CONFIGS, help="BM,BN,BK,warps,stages")
    p.add_argument("--split", action="store_true", help="loop 3: the split-K programs")
    p.add_argument("--dense", action="store_true", help="loops 2, 3: operands loaded decoded")
    p.add_argument("--maxnreg", type=int, default=None, help="register cap (GemmConfig.maxnreg)")
    p.add_argument(
        "--out-amax",
        action="store_true",
        help="the epilogue's per-tensor amax (TritonOptions.fused_amax)",
    )
    p.add_argument(
        "--ordered-x",
        action="store_true",
        help="W4A16: activation rows already in the loop's order (TritonOptions.ordered_x)",
    )
    p.add_argument(
        "--blocks-last",
        action="store_true",
        help="with --split: the (tiles, segments, blocks) grid (TritonOptions.blocks_last, "
        "the default)",
    )
    a = p.parse_args(argv)
    h, inter = SHAPES[a.preset]
    gemms = ["fc1", "fc2"] if a.gemm == "both" else [a.gemm]
    print(f"{'gemm':4s} {'loop':>4s} {'config':>18s} {'regs':>5s} {'spill':>5s} "
          f"{'instr/weight':>12s} {'BAR':>4s} {'MEMBAR':>6s}  top opcodes")  # fmt: skip
    for g in gemms:
        n, k, gated = (inter, h, True) if g == "fc1" else (h, inter, False)
        for loop in a.loop:
            for c in a.config:
                cfg = tuple(int(v) for v in c.split(","))
                if k % cfg[2] or (loop and cfg[2] % 32):
                    continue
                kern = compile_gemm(n=n, k=k, gated=gated, a_fp4=a.mode == "w4a4", loop=loop,
                                    cfg=cfg, split=a.split, dense=a.dense,
                                    maxnreg=a.maxnreg, out_amax=a.out_amax,
                                    ordered_x=a.ordered_x,
                                    blocks_last=a.blocks_last)  # fmt: skip
                per_trip = (2 if gated else 1) * cfg[1] * cfg[2] / (cfg[3] * 32)
                st = sass_stats(kern, per_trip)
                ipw = st["instructions_per_weight"]
                top = " ".join(f"{op}:{c}" for op, c in st["top"][:6])
                print(f"{g:4s} {loop:4d} {c:>18s} {st['registers']:5d} {st['local_bytes']:5d} "
                      f"{(f'{ipw:.2f}' if ipw else '-'):>12s} {st['sync']['BAR']:4d} "
                      f"{st['sync']['MEMBAR']:6d}  {top}")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
