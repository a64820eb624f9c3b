"""How fast TMA copies alone stream bytes from HBM on this GPU: the ceiling of the Gluon
decode GEMMs' weight stream (``kernels.gluon_ws``), with no decode and no wgmma.

    PYTHONPATH=src python3 benchmarks/tma_stream.py --out tma.json
    PYTHONPATH=src python3 benchmarks/tma_stream.py --compile-only   # no GPU: compile only

Each program of a 1-D grid (``--per-sm`` programs an SM) takes every P-th [64, 128]-byte
box of a 1 GiB uint8 tensor into a ring of ``--buffers`` shared-memory buffers, waiting
for each box and refilling its buffer with the next (the Gluon kernels' ring without the
consumer). Box order ``rows``: the boxes of a [rows, 3584] tensor (FC1's codes, K/2 bytes
a row) tile-fastest, as the Gluon grid orders its programs (each box 64 rows of 128
bytes, 3584 apart); ``contig``: each box 8 KB of contiguous bytes. Printed and saved:
GB/s of bytes read, against the same run's torch copy (read + write bytes, as ``fp4moe
bench``'s floor takes it) and a torch read-only reduction.
"""

from __future__ import annotations

import argparse
import json

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma

ROW_BYTES = 3584  # FC1's codes a row on DeepSeek-V3 (K/2)
LAYOUT = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=8, rank=2)


@gluon.jit
def _issue(desc, i, tiles, bar, dst, CONTIG: gl.constexpr):
    """The copy of box ``i`` into ``dst``, completing on ``bar``: ``CONTIG`` the i-th 8 KB,
    else tile-fastest (row tile i % tiles of column chunk i // tiles)."""
    mbarrier.expect(bar, 64 * 128)
    if CONTIG:
        tma.async_copy_global_to_shared(desc, [i * 64, 0], bar, dst)
    else:
        tma.async_copy_global_to_shared(desc, [(i % tiles) * 64, (i // tiles) * 128], bar, dst)


@gluon.jit
def stream_kernel(desc, n_boxes, tiles, NB: gl.constexpr, CONTIG: gl.constexpr):
    pid = gl.program_id(0)
    step = gl.num_programs(0)
    buf = gl.allocate_shared_memory(gl.uint8, [NB, 64, 128], LAYOUT)
    bars = gl.allocate_shared_memory(gl.int64, [NB, 1], mbarrier.MBarrierLayout())
    for b in gl.static_range(NB):
        mbarrier.init(bars.index(b), count=1)
    cnt = (n_boxes - pid + step - 1) // step
    for b in gl.static_range(NB):
        if b < cnt:
            _issue(desc, pid + b * step, tiles, bars.index(b), buf.index(b), CONTIG)
    for j in range(cnt):
        s = j % NB
        mbarrier.wait(bars.index(s), (j // NB) % 2)
        if j + NB < cnt:
            _issue(desc, pid + (j + NB) * step, tiles, bars.index(s), buf.index(s), CONTIG)
    for b in gl.static_range(NB):
        mbarrier.invalidate(bars.index(b))


def compile_only() -> None:
    """Compile every variant for sm_90 (no GPU needed)."""
    from fp4moe.kernels.common import compile_sm90

    for nb in (1, 2, 4):
        for contig in (False, True):
            c = compile_sm90(stream_kernel, {}, dict(NB=nb, CONTIG=contig),
                             ints=("n_boxes", "tiles"), gluon=True,
                             descs={"desc": f"tensordesc<u8[64, 128],{LAYOUT!r}>"},
                             num_warps=4)  # fmt: skip
            ptx = c.asm["ptx"]
            assert "cp.async.bulk.tensor" in ptx and ".local" not in ptx
            print(f"NB {nb} contig {contig}: compiled, {c.metadata.shared} B shared")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--per-sm", type=int, nargs="+", default=[1, 2, 4, 6, 8, 12, 16])
    p.add_argument("--buffers", type=int, nargs="+", default=[1, 2, 4])
    p.add_argument("--order", nargs="+", default=["rows", "contig"], choices=("rows", "contig"))
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--out", default=None)
    p.add_argument("--compile-only", action="store_true")
    a = p.parse_args()
    if a.compile_only:
        compile_only()
        return
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    from fp4moe.bench import card_ceilings, time_us

    sms = torch.cuda.get_device_properties(0).multi_processor_count
    ceil = card_ceilings()
    rows = (1 << 30) // ROW_BYTES // 64 * 64
    data = torch.randint(0, 256, (rows, ROW_BYTES), dtype=torch.uint8, device="cuda")
    nbytes = data.numel()
    flat = data.reshape(-1, 128)
    red_us = time_us(lambda: data.view(torch.int32).amax(), graph=True, warmup=2, iters=a.iters)
    out = {"device": torch.cuda.get_device_name(0), "sms": sms, "bytes": nbytes,
           "copy_bytes_per_s": ceil["copy_bytes_per_s"],
           "torch_amax_read_bytes_per_s": nbytes / (red_us * 1e-6), "rows": []}  # fmt: skip
    print(f"copy {ceil['copy_bytes_per_s'] / 1e12:.2f} TB/s (read + write), torch amax read "
          f"{out['torch_amax_read_bytes_per_s'] / 1e12:.2f} TB/s")  # fmt: skip
    descs = {
        "rows": TensorDescriptor.from_tensor(data, [64, 128], LAYOUT),
        "contig": TensorDescriptor.from_tensor(flat, [64, 128], LAYOUT),
    }
    n_boxes = nbytes // (64 * 128)
    tiles = rows // 64
    for order in a.order:
        for nb in a.buffers:
            for per in a.per_sm:
                grid = (sms * per,)

                def run(order=order, nb=nb, grid=grid):
                    stream_kernel[grid](descs[order], n_boxes, tiles, NB=nb,
                                        CONTIG=order == "contig", num_warps=4)  # fmt: skip

                try:
                    us = time_us(run, graph=True, warmup=2, iters=a.iters)
                except Exception as exc:  # e.g. too much shared memory for the slots
                    print(f"{order} NB {nb} {per}/SM: FAILED {type(exc).__name__}: {exc}"[:300])
                    continue
                rate = nbytes / (us * 1e-6)
                inflight = per * nb * 8  # KB of copies in flight an SM
                out["rows"].append(dict(order=order, buffers=nb, per_sm=per, us=us,
                                        bytes_per_s=rate,
                                        kb_in_flight_per_sm=inflight))  # fmt: skip
                print(f"{order:6s} NB {nb} {per:2d}/SM ({inflight:4d} KB in flight an SM): "
                      f"{us:8.1f} us  {rate / 1e12:.2f} TB/s  "
                      f"{rate / ceil['copy_bytes_per_s']:.2f} of copy", flush=True)  # fmt: skip
    if a.out:
        with open(a.out, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
