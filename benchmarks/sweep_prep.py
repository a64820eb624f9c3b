"""Time the memory-bound passes of a prefill call on the GPU: the dense path's weight
decode (``dense_rows_kernel`` at several tile shapes, each checked bitwise against
``dense_weights``) and the W4A4 activation quantize (``quantize_rows``) at prefill shapes.

    PYTHONPATH=src python3 benchmarks/sweep_prep.py --out prep.json

Each row: microseconds (median of CUDA-graph replays), GB/s moved (bytes read + written),
and whether the output is bit-identical to the default launch.
"""

from __future__ import annotations

import argparse
import json

import torch
import triton
import triton.language as tl

from fp4moe.bench import card_ceilings, time_us
from fp4moe.kernels import launch
from fp4moe.kernels.dequant import dense_rows_kernel, dense_weights
from fp4moe.kernels.quantize import MODE_PER_ROW

DECODE_TILES = [  # (rows, K elements, warps) a program; the first is dense_weights' own
    (64, 128, 4), (32, 128, 4), (128, 128, 8), (64, 256, 4), (64, 256, 8),
    (32, 256, 4), (16, 512, 4), (32, 512, 8), (128, 64, 4),
]  # fmt: skip
QUANT_SHAPES = [(131072, 768), (16384, 2048), (8192, 7168), (65536, 2048)]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="prep.json")
    a = ap.parse_args()
    ceil = card_ceilings()
    print(f"copy {ceil['copy_bytes_per_s'] / 1e12:.2f} TB/s")
    rows = []
    g = torch.Generator(device="cuda").manual_seed(0)
    for name, r, k in (("deepseek w13", 32 * 4096, 7168), ("mixtral w2", 8 * 4096, 14336)):
        codes = torch.randint(0, 256, (r, k // 2), dtype=torch.uint8, device="cuda", generator=g)
        scales = (torch.rand(r, k // 16, device="cuda", generator=g) * 2).to(torch.float8_e4m3fn)
        ref = dense_weights(codes, scales)
        out = torch.empty_like(ref)
        moved = codes.numel() + scales.numel() + ref.numel() * 2
        for br, bk, warps in DECODE_TILES:

            def run(br=br, bk=bk, warps=warps):
                dense_rows_kernel[(triton.cdiv(r, br), k // bk)](
                    codes, scales, codes, out, r, K=k, BR=br, BK=bk, FP4=True,
                    HAS_COUNT=False, DECODE_ASM=True, DOT_DTYPE=tl.bfloat16, num_warps=warps,
                )  # fmt: skip

            us = time_us(run, graph=True, warmup=2, iters=10, reps=3)
            same = bool(torch.equal(out.view(torch.int16), ref.view(torch.int16)))
            row = dict(kind="decode", what=name, tile=[br, bk, warps], us=us,
                       gbps=moved / us / 1e3, same=same)  # fmt: skip
            rows.append(row)
            print(f"decode {name:13s} {br:4d} {bk:4d} {warps} {us:9.1f} us "
                  f"{row['gbps']:7.0f} GB/s same {same}")  # fmt: skip
    for n, c in QUANT_SHAPES:
        x = torch.randn(n, c, device="cuda", generator=g).to(torch.bfloat16)

        def run():
            return launch.quantize_rows(x, n, mode=MODE_PER_ROW)

        us = time_us(run, graph=True, warmup=2, iters=10, reps=3)
        moved = n * c * 2 + n * (c // 2 + c // 16 + 4)
        row = dict(kind="quantize", what=[n, c], us=us, gbps=moved / us / 1e3)
        rows.append(row)
        print(f"quantize {n:6d} x {c:5d} {us:9.1f} us {row['gbps']:7.0f} GB/s")
    with open(a.out, "w") as f:
        json.dump({"ceilings": ceil, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
