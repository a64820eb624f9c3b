"""benchmarks/tma_pattern.py: its two descriptors read the boxes it says (checked by
emulating a TMA box read from a descriptor's base, shape and strides), its XOR
expectations match those boxes, and its kernel compiles for sm_90."""

import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from testing import tma_box

BENCH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "benchmarks")


@pytest.fixture(scope="module")
def tp():
    pytest.importorskip("triton.experimental.gluon")
    sys.path.insert(0, BENCH)
    try:
        import tma_pattern
    finally:
        sys.path.remove(BENCH)
    return tma_pattern


def test_descriptors_read_the_stated_boxes(tp):
    e, n, kb = 2, 128, 256
    g = torch.Generator().manual_seed(0)
    buf = torch.randint(0, 256, (e * 2 * n, kb), dtype=torch.uint8, generator=g)
    strided = tp.descriptor(buf, n, kb, contig=False)
    contig = tp.descriptor(buf, n, kb, contig=True)
    boxes_s, boxes_c = [], []
    for ex in range(e):
        for t in range(n // 64):
            row = ex * 2 * n + t * 64
            for c in range(0, kb, 128):  # the gate rows' box and the up rows' n below
                b = tma_box(strided, [0, row, c])
                assert torch.equal(b[0], buf[row : row + 64, c : c + 128])
                assert torch.equal(b[1], buf[row + n : row + n + 64, c : c + 128])
                boxes_s.append(b.numpy())
    flat = buf.view(-1)
    for blk in range(flat.numel() // 16384):  # 16 KB blocks, one a copy
        b = tma_box(contig, [0, 128 * blk, 0])
        assert torch.equal(b.reshape(-1), flat[blk * 16384 : (blk + 1) * 16384])
        boxes_c.append(b.numpy())
    for boxes, is_contig in ((boxes_s, False), (boxes_c, True)):
        want = tp.expected_xor(buf, n, kb, e, is_contig)
        assert np.array_equal(np.bitwise_xor.reduce(np.stack(boxes), axis=0), want)


_COMPILE = """
import sys
sys.path.insert(0, sys.argv[1])
import tma_pattern as t
from fp4moe.kernels.common import compile_sm90, resource_usage
for contig in (False, True):
    for nb in (1, 2, 4):
        for co in (False, True):
            k = compile_sm90(t.stream_kernel, {"out_ptr": "*u8"},
                             dict(S=4, NB=nb, CONTIG=contig, CONSUME=co),
                             ints=("n_items", "e0", "NT", "NSEG", "N_PAIR"), gluon=True,
                             descs={"desc": f"tensordesc<u8[2, 64, 128],{t.SMEM3!r}>"},
                             num_warps=4)
            r = resource_usage(k)
            assert r["REG"] <= 80, (contig, nb, co, r)  # 6 programs an SM fit
            assert k.asm["ptx"].count("cp.async.bulk.tensor") >= 2
print("ok")
"""


def test_kernel_compiles_for_sm90(tp):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, "-c", _COMPILE, BENCH], capture_output=True,
                         text=True, env=env, timeout=600)  # fmt: skip
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]
