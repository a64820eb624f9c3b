"""Does the weights' layout cap the TMA read rate of the decode kernels?

Streams the same bytes through a shared-memory ring of TMA copies in two patterns and
prints the read rate (TB/s) beside the card's copy rate (as ``fp4moe bench`` measures it):

- ``strided``: today's layout, the codes of a gated GEMM as [E * 2N, K/2] bytes; a copy
  is one ring stage of the decode kernels, the gate rows' [64, 128-byte] box and the up
  rows' N below (16 KB in 128 rows of 128 bytes, K/2 bytes apart); a work item is one
  (64-row tile, segment of ``--stages`` stages), in the split kernel's launch order
  (tiles fastest, then segments, then experts);
- ``contig``: a stage-contiguous layout, the same 16 KB a copy as one contiguous block,
  a work item's stages consecutive.

Persistent programs (``--programs`` an SM) take work items in turn, each keeping
``--ring`` copies in flight; with ``--consume`` a stage is read from shared memory into
registers before its buffer is refilled (as the decode kernels read it). The windows of
experts rotate so that L2 holds none of a launch's bytes: one CUDA graph replays a
launch a window, timed together (no launch gaps).

    python3 benchmarks/tma_pattern.py                      # DeepSeek-V3 FC1 shape
    python3 benchmarks/tma_pattern.py --n 768 --k 2048     # Qwen3-30B-A3B FC1
"""

from __future__ import annotations

import argparse
import itertools

import numpy as np
import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma

from fp4moe.bench import card_ceilings, time_us

BOX_ROWS = 64
BOX_BYTES = 128
SMEM3 = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=8, rank=3)


@gluon.jit
def _issue(desc, buf, bar, item, j, e0, NT, NSEG, N_PAIR, S: gl.constexpr,
           CONTIG: gl.constexpr):  # fmt: skip
    """Copy stage ``j`` of work item ``item`` into ``buf`` (a [2, 64, 128] destination)."""
    mbarrier.expect(bar, 2 * 64 * 128)
    if CONTIG:
        tma.async_copy_global_to_shared(desc, [0, 128 * (item * S + j + e0), 0], bar, buf)
    else:
        t = item % NT
        s = (item // NT) % NSEG
        e = item // (NT * NSEG) + e0
        row = e * 2 * N_PAIR + t * 64
        tma.async_copy_global_to_shared(desc, [0, row, (s * S + j) * 128], bar, buf)


@gluon.jit
def stream_kernel(desc, out_ptr, n_items, e0, NT, NSEG, N_PAIR, S: gl.constexpr,
                  NB: gl.constexpr, CONTIG: gl.constexpr, CONSUME: gl.constexpr):  # fmt: skip
    """Persistent programs reading ``n_items`` work items of ``S`` stages each through a
    ring of ``NB`` stages (NB divides S); with CONSUME each program writes the XOR of the
    boxes it read to ``out_ptr`` (uint8 [programs, 2, 64, 128])."""
    gl.static_assert(S % NB == 0, "the ring divides a work item's stages")
    pid = gl.program_id(0)
    nprog = gl.num_programs(0)
    bufs = gl.allocate_shared_memory(gl.uint8, [2 * NB, 64, 128], SMEM3)
    bars = gl.allocate_shared_memory(gl.int64, [NB, 1], mbarrier.MBarrierLayout())
    for b in gl.static_range(NB):
        mbarrier.init(bars.index(b), count=1)
    L: gl.constexpr = gl.BlockedLayout([1, 1, 16], [1, 4, 8], [1, 4, 1], [2, 1, 0])
    acc = gl.zeros([2, 64, 128], gl.uint8, layout=L)
    if pid < n_items:
        for b in gl.static_range(NB):
            _issue(desc, bufs.slice(2 * b, 2), bars.index(b), pid, b, e0, NT, NSEG, N_PAIR,
                   S, CONTIG)  # fmt: skip
    phase = 0
    for item in range(pid, n_items, nprog):
        for j0 in range(0, S, NB):
            for b in gl.static_range(NB):
                j = j0 + b
                mbarrier.wait(bars.index(b), phase)
                if CONSUME:
                    acc = acc ^ bufs.slice(2 * b, 2).load(L)
                    gl.thread_barrier()
                if j + NB < S:
                    _issue(desc, bufs.slice(2 * b, 2), bars.index(b), item, j + NB, e0, NT,
                           NSEG, N_PAIR, S, CONTIG)  # fmt: skip
                elif item + nprog < n_items:
                    _issue(desc, bufs.slice(2 * b, 2), bars.index(b), item + nprog,
                           j + NB - S, e0, NT, NSEG, N_PAIR, S, CONTIG)  # fmt: skip
            phase = phase ^ 1
    for b in gl.static_range(NB):
        mbarrier.invalidate(bars.index(b))
    if CONSUME:  # the XOR of every byte the program read, by position in the box
        i0 = gl.arange(0, 2, layout=gl.SliceLayout(1, gl.SliceLayout(2, L)))
        i1 = gl.arange(0, 64, layout=gl.SliceLayout(0, gl.SliceLayout(2, L)))
        i2 = gl.arange(0, 128, layout=gl.SliceLayout(0, gl.SliceLayout(1, L)))
        off = i0[:, None, None] * 8192 + i1[None, :, None] * 128 + i2[None, None, :]
        gl.store(out_ptr + pid * 16384 + off, acc)


def descriptor(buf: torch.Tensor, n: int, kb: int, contig: bool):
    """The [2, rows, bytes] descriptor with [2, 64, 128] boxes over ``buf`` (all experts'
    codes, [E * 2n, kb] bytes): the gate and up rows n apart, or 16 KB blocks."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    flat = buf.view(-1)
    if contig:
        m = flat.numel() // BOX_BYTES
        t = flat.view(m, BOX_BYTES)
        return TensorDescriptor(t, [2, m - BOX_ROWS, BOX_BYTES], [BOX_ROWS * BOX_BYTES,
                                BOX_BYTES, 1], [2, BOX_ROWS, BOX_BYTES], SMEM3)  # fmt: skip
    t = flat.view(-1, kb)
    return TensorDescriptor(t, [2, t.shape[0] - n, kb], [n * kb, kb, 1],
                            [2, BOX_ROWS, BOX_BYTES], SMEM3)  # fmt: skip


def expected_xor(buf: torch.Tensor, n: int, kb: int, experts: int, contig: bool):
    """The XOR of the first ``experts`` experts' boxes by position in a [2, 64, 128] box."""
    w = buf[: experts * 2 * n].cpu().numpy()
    if contig:
        return np.bitwise_xor.reduce(w.reshape(-1, 2, 64, 128), axis=0)
    w = w.reshape(experts, 2, n // 64, 64, kb // 128, 128)
    return np.bitwise_xor.reduce(w, axis=(0, 2, 4))


def run(buf, n, kb, experts, total_experts, contig, s, nb, programs, consume, reps=20):
    """Median read rate (bytes a second) of one configuration over rotating windows."""
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    nt, nseg = n // BOX_ROWS, kb // BOX_BYTES // s
    n_items = experts * nt * nseg
    desc = descriptor(buf, n, kb, contig)
    out = torch.zeros(sms * programs, 2 * BOX_ROWS * BOX_BYTES, dtype=torch.uint8,
                      device="cuda")  # fmt: skip
    windows = max(1, total_experts // experts)
    blocks_per_expert = 2 * n * kb // (2 * BOX_ROWS * BOX_BYTES)
    grid = (min(sms * programs, n_items),)

    def launch(w):
        e0 = w * experts * (blocks_per_expert if contig else 1)
        stream_kernel[grid](desc, out, n_items, e0, nt, nseg, n, S=s, NB=nb, CONTIG=contig,
                            CONSUME=consume, num_warps=4)  # fmt: skip

    launch(0)
    if consume:  # every byte of the window read once: the XORs agree
        got = np.bitwise_xor.reduce(out.cpu().numpy(), axis=0).reshape(2, 64, 128)
        assert np.array_equal(got, expected_xor(buf, n, kb, experts, contig)), (
            f"{'contig' if contig else 'strided'}: the copies missed bytes"
        )
    # one CUDA graph of a launch a window (no launch gaps, no window twice in a row)
    calls = itertools.count()
    us = time_us(
        lambda: launch(next(calls) % windows), graph=True, warmup=1, iters=reps, reps=windows
    )
    return experts * 2 * n * kb / (us * 1e-6), us * 1e-6


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--n", type=int, default=2048, help="a weight's rows (FC1's I)")
    p.add_argument("--k", type=int, default=7168, help="K elements (FC1's H)")
    p.add_argument("--total-experts", type=int, default=32)
    p.add_argument("--experts", type=int, nargs="+", default=[3, 32])
    p.add_argument("--stages", type=int, nargs="+", default=[4],
                   help="stages a work item (4: a 1024-K segment; K/256: whole K)")  # fmt: skip
    p.add_argument("--ring", type=int, nargs="+", default=[1, 2, 4])
    p.add_argument("--programs", type=int, nargs="+", default=[1, 2, 4, 6, 8])
    p.add_argument("--consume", type=int, nargs="+", default=[0, 1])
    a = p.parse_args(argv)
    kb = a.k // 2
    buf = torch.randint(0, 255, (a.total_experts * 2 * a.n, kb), dtype=torch.uint8,
                        device="cuda")  # fmt: skip
    cr = card_ceilings()["copy_bytes_per_s"]
    print(f"# {torch.cuda.get_device_name()}: device copy {cr / 1e12:.2f} TB/s "
          f"(read + written); n {a.n}, k {a.k}, {2 * a.n * kb / 1e6:.1f} MB an expert")  # fmt: skip
    print("| experts | stages | ring | programs/SM | consume | strided TB/s | contig TB/s "
          "| strided/contig | strided us |")  # fmt: skip
    print("| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for ex, s, nb, pr, co in itertools.product(a.experts, a.stages, a.ring, a.programs,
                                               a.consume):  # fmt: skip
        if s % nb or pr * nb * 16 > 208 or (a.k // 256) % s:
            continue
        rs, ts = run(buf, a.n, kb, ex, a.total_experts, False, s, nb, pr, co)
        rc, _ = run(buf, a.n, kb, ex, a.total_experts, True, s, nb, pr, co)
        print(f"| {ex} | {s} | {nb} | {pr} | {co} | {rs / 1e12:.2f} | {rc / 1e12:.2f} "
              f"| {rs / rc:.3f} | {ts * 1e6:.1f} |", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
