"""CPU-only SASS experiment (session 8): does loading the split loop's operands with TMA
tensor descriptors take the CTA barriers out of Triton 3.6's main loop on sm_90?

A reduced FC2-like split unit (the weight codes and contiguous activation rows, as
``TritonOptions.ordered_x`` leaves them; the scales by pointer) compiled twice for sm_90,
with pointer loads and with ``tl.make_tensor_descriptor`` loads; prints registers, spill,
SASS instructions a weight and the barriers of each main loop. No GPU needed:

    PYTHONPATH=src python3 benchmarks/tma_sass_experiment.py
"""

from __future__ import annotations

import triton
import triton.language as tl

from fp4moe.kernels.common import compile_sm90
from fp4moe.kernels.gemm import decode_permuted
from sass_report import sass_stats


@triton.jit
def split_unit_kernel(
    a_ptr, w_codes_ptr, w_scales_ptr, part_ptr, rows, start, e, s_id,
    N: tl.constexpr, K: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
    SEG_TILES: tl.constexpr, TMA: tl.constexpr,
):  # fmt: skip
    pid_n = tl.program_id(0)
    offs_n = pid_n * BN + tl.arange(0, BN)
    row_g = e * N + offs_n
    acc = tl.zeros((BN, BM), dtype=tl.float32)
    if TMA:
        cdesc = tl.make_tensor_descriptor(
            w_codes_ptr, shape=[N * 32, K // 2], strides=[K // 2, 1], block_shape=[BN, BK // 2]
        )
        xdesc = tl.make_tensor_descriptor(
            a_ptr, shape=[rows, K], strides=[K, 1], block_shape=[BM, BK]
        )
    sw = w_scales_ptr + row_g[:, None] * (K // 16) + tl.arange(0, BK // 16)[None, :]
    for j in range(0, SEG_TILES):
        kb = s_id * SEG_TILES + j
        if TMA:
            cg = cdesc.load([e * N + pid_n * BN, kb * (BK // 2)])
            x = xdesc.load([start, kb * BK])
        else:
            cg = tl.load(
                w_codes_ptr + row_g[:, None] * (K // 2) + kb * (BK // 2)
                + tl.arange(0, BK // 2)[None, :]
            )  # fmt: skip
            x = tl.load(
                a_ptr + (start + tl.arange(0, BM))[:, None] * K + kb * BK
                + tl.arange(0, BK)[None, :]
            )  # fmt: skip
        sg = tl.load(sw + kb * (BK // 16))
        w = decode_permuted(cg, sg, BN, BK, True, tl.bfloat16, 64)
        acc = tl.dot(w, tl.trans(x), acc)
    tl.store(part_ptr + offs_n[:, None] * BM + tl.arange(0, BM)[None, :], acc)


def main() -> None:
    ptrs = {"a_ptr": "*bf16", "w_codes_ptr": "*u8", "w_scales_ptr": "*fp8e4nv", "part_ptr": "*fp32"}
    for tma in (False, True):
        kern = compile_sm90(
            split_unit_kernel, ptrs,
            dict(N=7168, K=2048, BM=16, BN=64, BK=128, SEG_TILES=8, TMA=tma),
            ints=("rows", "start", "e", "s_id"), num_warps=4, num_stages=3,
        )  # fmt: skip
        st = sass_stats(kern, 64 * 128 / 128)
        print(
            f"{'TMA' if tma else 'pointers':8s} registers {st['registers']} spill "
            f"{st['local_bytes']} instr/weight {st['instructions_per_weight']:.2f} "
            f"barriers {st['sync']}"
        )


if __name__ == "__main__":
    main()
