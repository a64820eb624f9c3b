"""The CUDA C++ decode GEMMs (``kernels.cuda_decode``, ``TritonOptions.cuda_decode``):
built with nvcc for sm_90a here where nvcc is, its arguments checked, and on the GPU the
Gluon kernels' bits."""

from __future__ import annotations

import functools
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest
import torch

from fp4moe.kernels import cuda_decode
from fp4moe.kernels.launch import TritonOptions, moe_triton
from fp4moe.reference import moe_reference
from test_kernels import GPU_SHAPES, _edge_inputs, _x
from testing import TOL, pretend_hopper, rel_err


def _cuobjdump() -> str | None:
    exe = shutil.which("cuobjdump")
    if exe:
        return exe
    try:
        import triton

        p = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
        return str(p) if p.is_file() else None
    except ImportError:
        return None


@functools.cache
def _built(flags: tuple[str, ...] = ()) -> tuple[str, str | None]:
    """decode_gemm.cu built with the package's flags and ``flags`` (once a session), and
    ptxas's report and the SASS (None without a cuobjdump)."""
    with tempfile.TemporaryDirectory(prefix="fp4moe-cuda-") as tmp:
        out = Path(tmp) / "lib.so"
        res = subprocess.run(
            [cuda_decode.nvcc(), *cuda_decode.NVCC_FLAGS, *flags, "-Xptxas", "-v", "-o",
             str(out), str(cuda_decode.SOURCE)],
            capture_output=True, text=True,
        )  # fmt: skip
        assert res.returncode == 0, res.stderr[-3000:]
        dump = _cuobjdump()
        if dump is None:
            return res.stderr, None
        sass = subprocess.run([dump, "-sass", str(out)], capture_output=True, text=True).stdout
        return res.stderr, sass


@pytest.mark.skipif(cuda_decode.nvcc() is None, reason="no nvcc")
def test_cuda_kernel_builds_for_sm90a():
    """The library builds with the package's flags; ptxas reports no spill and no stack
    for any of the kernel's specializations, every register budget within the 512-thread
    launch bound (128 a thread); the SASS (where a cuobjdump is) holds only bf16 MMAs of
    m16n8k16 with fp32 sums, fully unrolled (128 a segment a warp at 8 rows, 256 at 16;
    20 specializations: 16 and the 4 of CROSS_ITEMS), and the fp32 atomic add of the fused
    epilogue."""
    report, sass = _built()
    regs = [int(r) for r in re.findall(r"Used (\d+) registers", report)]
    assert len(regs) == 20 and max(regs) <= 128, regs
    stacks = re.findall(r"(\d+) bytes stack frame, (\d+) bytes spill stores", report)
    assert stacks and all(s == ("0", "0") for s in stacks), stacks
    if sass is None:
        return
    mma = re.findall(r"\bHMMA\.[0-9A-Z.]+", sass)
    assert set(mma) == {"HMMA.16816.F32.BF16"}, set(mma)
    assert len(mma) == 10 * 128 + 10 * 256
    assert "REDG.E.ADD.F32" in sass


def _unit_mean(sass: str, spec: str) -> tuple[float, int]:
    """Mean SASS instructions of units 1 to 14 (between HMMAs 8 and 120) of the kernel
    specialization ``spec`` (its mangled template part) in a cuobjdump listing, and its
    HMMAs."""
    for f in re.split(r"\n\s*Function : ", sass)[1:]:
        if f"kernelI{spec}EEvNS" in f.split("\n", 1)[0]:
            ins = re.findall(r"/\*[0-9a-f]{4,}\*/\s+([^;]*);", f)
            hmma = [i for i, x in enumerate(ins) if "HMMA" in x]
            return (hmma[120] - hmma[8]) / 14, len(hmma)
    raise AssertionError(f"no specialization {spec}")


@pytest.mark.skipif(cuda_decode.nvcc() is None, reason="no nvcc")
def test_rot_decode_is_shorter():
    """``ROT_LAYOUT``'s library holds session 23's count in SASS: ``decode_rot``'s 15
    instructions a code word against ``decode_pair``'s 18, so a unit of the 16-token FC1
    and FC2 (8 code words a warp) has 24 fewer, with the same HMMAs; no spill."""
    report, rot = _built(("-DFP4MOE_ROT=1",))
    stacks = re.findall(r"(\d+) bytes stack frame, (\d+) bytes spill stores", report)
    assert len(stacks) == 20 and all(s == ("0", "0") for s in stacks), stacks
    base = _built()[1]
    if base is None or rot is None:
        pytest.skip("no cuobjdump")
    for spec in ("Lb1ELi1ELi2ELb0E", "Lb0ELi1ELi2ELb0E"):
        (b, n0), (r, n1) = _unit_mean(base, spec), _unit_mean(rot, spec)
        assert n0 == n1 == 128
        assert 20 <= b - r <= 28, (spec, b, r)


def _ptx_of(fn: str, nth: int = 0) -> list[str]:
    """The PTX lines of the ``nth`` inline asm of ``fn`` in decode_gemm.cu (its template's
    string literals joined, split at the newlines)."""
    src = cuda_decode.SOURCE.read_text()
    body = src[src.index(f"void {fn}(") :]
    body = body[: body.index("\n}\n")]
    for _ in range(nth + 1):
        body = body[body.index("asm(") + 4 :]
    quoted = False
    for i, ch in enumerate(body):  # the template ends at the first ':' outside a string
        if ch == '"' and body[i - 1] != "\\":
            quoted = not quoted
        elif ch == ":" and not quoted:
            body = body[:i]
            break
    text = "".join(re.findall(r'"((?:[^"\\]|\\.)*)"', body))
    return [ln.strip().rstrip(";") for ln in text.split("\\n") if ln.strip()]


def _run_ptx(lines: list[str], args: dict[str, int]) -> dict[str, int]:
    """The integer part of the decode's PTX on one input: mov, and, mul.lo, prmt (b 0,
    the default mode), shf.l.wrap and lop3; an fma.rn.bf16x2 stores its first source (the
    pair before the scale) in its destination. Returns every register."""
    regs = dict(args)
    m32 = 0xFFFFFFFF

    def val(t: str) -> int:
        t = t.strip()
        return regs[t] if t in regs else int(t, 0) & m32

    for ln in lines:
        if ln.startswith(("{", "}", ".reg")):
            continue
        op, rest = ln.split(None, 1)
        d, *src = [t.strip() for t in rest.split(",")]
        if op == "mov.b32":
            regs[d] = val(src[0])
        elif op == "and.b32":
            regs[d] = val(src[0]) & val(src[1])
        elif op == "mul.lo.u32":
            regs[d] = val(src[0]) * val(src[1]) & m32
        elif op == "shf.l.wrap.b32":
            a, n = val(src[0]), val(src[2]) % 32
            assert val(src[1]) == a  # a rotation
            regs[d] = (a << n | a >> (32 - n)) & m32 if n else a
        elif op == "lop3.b32":
            a, b, c, lut = (val(t) for t in src)
            regs[d] = sum(
                (lut >> ((a >> i & 1) << 2 | (b >> i & 1) << 1 | (c >> i & 1)) & 1) << i
                for i in range(32)
            )  # fmt: skip
        elif op == "prmt.b32":
            a, b, sel = val(src[0]), val(src[1]), val(src[2])
            assert b == 0 and not sel & 0x8888  # no sign replication in these decodes
            pool = a | b << 32
            regs[d] = sum((pool >> (8 * (sel >> 4 * i & 7)) & 0xFF) << 8 * i for i in range(4))
        elif op == "fma.rn.bf16x2":
            regs[d] = val(src[0])
        else:
            raise AssertionError(f"unexpected PTX: {ln}")
    return regs


def test_rotated_layout_gives_todays_registers():
    """The rotated layout is lossless, and ``decode_rot`` (its PTX in decode_gemm.cu, run
    here on the integer part) builds from a rotated word exactly the four bf16 pair
    registers (before the scale's fma) that ``decode_pair`` builds from today's word: its
    two steps' low and high nibbles' registers. So the same MMA operands, the same bits.
    Checked on every one-bit word, 0, all ones and 5000 random words (the integer decode
    is linear over bits, so the one-bit words alone decide it); the kept copy is made anew
    when the codes change in place; bad codes are refused."""
    pair, even, odd = _ptx_of("decode_pair"), _ptx_of("decode_rot"), _ptx_of("decode_rot", 1)
    g = torch.Generator().manual_seed(23)
    words = [1 << b for b in range(32)] + [0, 0xFFFFFFFF]
    words += torch.randint(0, 1 << 32, (5000,), generator=g, dtype=torch.int64).tolist()
    as_bytes = torch.tensor([[w >> (8 * i) & 0xFF for i in range(4)] for w in words],
                            dtype=torch.uint8)  # fmt: skip
    rotated = cuda_decode.rotated_codes(as_bytes)
    assert torch.equal(cuda_decode.rotated_codes(rotated, inverse=True), as_bytes)
    assert sorted(cuda_decode.ROT_PERM) == list(range(32))
    for w, rb in zip(words, rotated.tolist()):
        v = rb[0] | rb[1] << 8 | rb[2] << 16 | rb[3] << 24
        today = []
        for sel in (0x4140, 0x4342):  # steps 2 j and 2 j + 1 (bytes 0, 1 and 2, 3)
            r = _run_ptx([ln.replace("%4", str(sel)) for ln in pair], {"%2": w, "%3": 0})
            today += [r["%0"], r["%1"]]
        got = []
        for ptx in (even, odd):
            r = _run_ptx(ptx, {"%2": v, "%3": 0})
            got += [r["%0"], r["%1"]]
        assert got == today, hex(w)
    kept = cuda_decode._rotated(as_bytes)  # ROT_LAYOUT's copy: made once a codes tensor
    assert cuda_decode._rotated(as_bytes) is kept and torch.equal(kept, rotated)
    changed = as_bytes.clone()
    changed[0, 0] ^= 1  # changed in place: a new copy
    first = cuda_decode._rotated(changed)
    changed[0, 0] ^= 1
    assert torch.equal(cuda_decode._rotated(changed), rotated) and not torch.equal(first, rotated)
    with pytest.raises(ValueError, match="codes"):
        cuda_decode.rotated_codes(as_bytes[:, :3])
    with pytest.raises(ValueError, match="codes"):
        cuda_decode.rotated_codes(as_bytes.to(torch.int32))


def test_decode_gemm_checks_its_arguments(monkeypatch):
    """Bad arguments are refused by name before anything is launched (on any machine)."""
    e, n, k = 2, 64, 2048
    dev = "cpu"
    i32 = torch.zeros(4, dtype=torch.int32)
    x = torch.zeros(3, k, dtype=torch.bfloat16)
    codes = torch.zeros(e, 2 * n, k // 2, dtype=torch.uint8)
    scales = torch.zeros(e, 2 * n, k // 16, dtype=torch.float8_e4m3fn)
    g = torch.ones(e, 2)
    out = torch.empty(8, n, dtype=torch.bfloat16, device=dev)
    args = (x, i32, codes, scales, i32, i32, i32, i32[:1], g, out)
    kw = dict(n=n, topk=2, gated=True, gather=True, block_m=8)
    bad = [
        ((x.float(), *args[1:]), kw, "x"),
        (args, {**kw, "block_m": 32}, "block_m"),
        ((*args[:2], codes[:, :n], *args[3:]), kw, "codes"),
        ((*args[:3], scales.view(torch.uint8), *args[4:]), kw, "scales"),
        ((*args[:8], g[:, 0], *args[9:]), kw, "w_global"),
        ((*args[:9], out.float()), kw, "out"),
        (args, {**kw, "fused": True, "topk_w": torch.ones(6)}, "fused"),
        ((*args[:4], i32.long(), *args[5:]), kw, "block_expert"),
    ]
    for a, k_, name in bad:
        with pytest.raises(ValueError, match=name):
            cuda_decode.decode_gemm(*a, **k_)
    knobs = (("DEPTH", 5, "DEPTH"), ("CROSS_ITEMS", True, "CROSS_ITEMS"), ("DIAG", 5, "DIAG"),
             ("L2_NEXT", 3, "L2_NEXT"), ("WARP_ROWS", 8, "WARP_ROWS"))  # fmt: skip
    for knob, value, name in knobs:
        with monkeypatch.context() as m:  # CROSS_ITEMS with DEPTH 3: built for 2 only
            m.setattr(cuda_decode, knob, value)
            if knob in ("DEPTH", "CROSS_ITEMS"):
                m.setattr(cuda_decode, "DEPTH", 3 if knob == "CROSS_ITEMS" else value)
            with pytest.raises(ValueError, match=name):
                cuda_decode.decode_gemm(*args, **kw)
    with monkeypatch.context() as m:  # the rotated codes are not what L2_NEXT prefetches
        m.setattr(cuda_decode, "ROT_LAYOUT", True)
        m.setattr(cuda_decode, "L2_NEXT", 1)
        with pytest.raises(ValueError, match="ROT_LAYOUT"):
            cuda_decode.decode_gemm(*args, **kw)
    with monkeypatch.context() as m:  # FC2's weights for the L2 prefetch: [E, K, n / 2]
        m.setattr(cuda_decode, "L2_NEXT", 1)
        c2 = torch.zeros(e, k, n // 2, dtype=torch.uint8)
        s2 = torch.zeros(e, k, n // 16, dtype=torch.float8_e4m3fn)
        with pytest.raises(ValueError, match="l2_next"):
            cuda_decode.decode_gemm(*args, **kw, l2_next=(c2[:, :, :-1], s2))
        with pytest.raises(ValueError, match="l2_next"):
            cuda_decode.decode_gemm(*args, **kw, l2_next=(c2, s2.view(torch.uint8)))
        if not cuda_decode.available():  # the right ones pass the checks
            with pytest.raises(RuntimeError, match="not available"):
                cuda_decode.decode_gemm(*args, **kw, l2_next=(c2, s2))
    assert cuda_decode.applies(2048, 7168, True, 8) and cuda_decode.applies(7168, 2048, False, 16)
    assert not cuda_decode.applies(7168, 768, False, 8)  # K not a multiple of 1024
    assert not cuda_decode.applies(2880, 2880, True, 8)
    assert not cuda_decode.applies(2048, 7168, True, 32)
    assert not cuda_decode.applies(48, 2048, False, 8)  # FC2's n: 32 a warp
    assert not TritonOptions().cuda_decode


def test_rows_per_block_rule(monkeypatch):
    """Thread blocks of up to 8 warps (DeepSeek-V3: FC1's 7 K segments one row group,
    FC2's 2 segments four), halved while the items would not fill two blocks an SM; the
    ``ROWS_PER_BLOCK`` knob overrides it within 16 warps; ``DEPTH`` 2 by default."""
    assert cuda_decode.DEPTH == 2 and cuda_decode.ROWS_PER_BLOCK is None
    assert not cuda_decode.CROSS_ITEMS
    rpb = cuda_decode._rows_per_block
    assert rpb(7, 2048, True, 40) == 1
    assert rpb(2, 7168, False, 40) == 4  # 56 tiles x 40 blocks
    assert rpb(2, 7168, False, 3) == 2  # 3 blocks: 168 items at 4 rows, 336 at 2
    assert rpb(2, 7168, False, 1) == 1  # 1 block: 224 items even at 1 row
    assert rpb(2, 7168, False, 6) == 4
    assert rpb(4, 14336, True, 40) == 2  # Mixtral's FC1
    assert rpb(14, 4096, False, 40) == 1  # Mixtral's FC2
    with monkeypatch.context() as m:  # 16 rows a warp: half the outputs a row group
        m.setattr(cuda_decode, "WARP_ROWS", 16)
        assert rpb(2, 7168, False, 3) == 4  # 3 blocks: 336 items at 4 rows
        assert rpb(7, 2048, True, 40) == 1
    monkeypatch.setattr(cuda_decode, "ROWS_PER_BLOCK", 4)
    assert rpb(7, 2048, True, 40) == 2 and rpb(2, 7168, False, 1) == 4


def test_cuda_runs_rule(monkeypatch):
    """``launch._cuda_runs``: the CUDA kernel takes a GEMM the Gluon kernels would run only
    for W4A16 rows with the plain epilogue, a shape it fits, with the library available,
    and per ``cuda_decode.ONLY``."""
    from fp4moe.kernels.gemm import GemmConfig
    from fp4moe.kernels.launch import _cuda_runs

    c8, c32 = GemmConfig(8, 64, 128), GemmConfig(32, 64, 128)
    assert not _cuda_runs(2048, 7168, True, c8, False) or cuda_decode.available()
    monkeypatch.setattr(cuda_decode, "available", lambda: True)
    assert _cuda_runs(2048, 7168, True, c8, False) and _cuda_runs(7168, 2048, False, c8, False)
    assert not _cuda_runs(2048, 7168, True, c8, True)  # W4A4, NVFP4 out, ordered rows
    assert not _cuda_runs(2048, 7168, True, c32, False)  # 32-row tiles
    assert not _cuda_runs(7168, 768, False, c8, False)  # K 768
    monkeypatch.setattr(cuda_decode, "ONLY", "fc1")
    assert _cuda_runs(2048, 7168, True, c8, False)
    assert not _cuda_runs(7168, 2048, False, c8, False)
    monkeypatch.setattr(cuda_decode, "available", lambda: False)
    assert not _cuda_runs(2048, 7168, True, c8, False)


def test_workspace_bytes_with_cuda_decode(monkeypatch):
    """With ``cuda_decode`` on, the GEMMs the CUDA kernel takes hold no split-K partials:
    DeepSeek-V3 EP8 at 16 tokens (both GEMMs split on the Gluon kernels) counts neither
    GEMM's partials, with ``ONLY`` "fc1" only FC1's left out, and W4A4 (never on the CUDA
    kernel) and a machine without the kernel count them as before."""
    from fp4moe.kernels.launch import SEGMENT, workspace_bytes

    pretend_hopper(monkeypatch)
    h, i, e, t = 7168, 2048, 32, 16
    n = t * 8
    base = dict(valid_fraction=0.125)

    def ws(**kw):
        return workspace_bytes(t, 8, h, i, e, options=TritonOptions(**base, **kw))

    off = ws()
    monkeypatch.setattr(cuda_decode, "available", lambda: False)
    assert ws(cuda_decode=True) == off
    monkeypatch.setattr(cuda_decode, "available", lambda: True)
    both = ws(cuda_decode=True)
    # off: the FC1 phase holds FC1's partials; both: no partials, so the FC2 phase (FC1's
    # output and the route rows) is the largest
    act, rows = n * i * 2, n * h * 2
    assert off - both == (h // SEGMENT) * n * 2 * i * 4 - rows
    monkeypatch.setattr(cuda_decode, "ONLY", "fc1")
    fc1 = ws(cuda_decode=True)
    assert fc1 - both == (i // SEGMENT) * n * h * 4 and fc1 < off
    assert ws(cuda_decode=True, chunked=2) == ws(chunked=2) and act > 0
    w4a4 = dict(mode="w4a4", act_scale="per_token")
    opt = TritonOptions(**base, cuda_decode=True)
    assert workspace_bytes(t, 8, h, i, e, options=opt, **w4a4) == workspace_bytes(
        t, 8, h, i, e, options=TritonOptions(**base), **w4a4
    )


@pytest.mark.kernel
def test_cuda_decode_falls_back_without_the_kernel(interpret, device, monkeypatch):
    """Where the kernel cannot run (the interpreter here, or no Hopper GPU or nvcc) the
    option changes nothing: the kernel is never called and the results are the same bits
    with the option on and off; without a CUDA device ``available()`` says why not."""
    if device != "cpu":
        pytest.skip("interpreter case; the GPU runs test_cuda_decode_gpu")
    from test_kernels import _experts, _routes

    def boom(*a, **kw):
        raise AssertionError("cuda_decode.decode_gemm called in the interpreter")

    monkeypatch.setattr(cuda_decode, "decode_gemm", boom)
    experts = _experts(4, 64, 32, seed=3, device=device)
    x = _x(5, 64, seed=5, device=device)
    ids, w = _routes(5, 2, 4, seed=9, device=device)
    outs = [
        moe_triton(x, ids, w, experts, mode="w4a16",
                   options=TritonOptions(poison=True, cuda_decode=on))
        for on in (False, True)
    ]  # fmt: skip
    assert torch.equal(outs[0], outs[1])
    if not torch.cuda.is_available():
        assert not cuda_decode.available()
        assert "no CUDA device" in cuda_decode.build_error()


KNOBS = {  # the experiment knobs' cases: CROSS_ITEMS, L2_NEXT, WARP_ROWS, ROT_LAYOUT
    "": (False, 0, 32, False), "cross": (True, 0, 32, False),
    "cross-l2next1": (True, 1, 32, False), "cross-l2next2": (True, 2, 32, False),
    "rows16": (False, 0, 16, False), "cross-rows16": (True, 0, 16, False),
    "rot": (False, 0, 32, True), "cross-rot": (True, 0, 32, True),
    "rows16-rot": (False, 0, 16, True),
}  # fmt: skip


@pytest.mark.gpu
@pytest.mark.parametrize("knobs", list(KNOBS))
@pytest.mark.parametrize("fused", [False, True], ids=["deterministic", "fused"])
@pytest.mark.parametrize("t", [0, 1, 3, 16, 64, 200, "one-expert", "all-masked"])
def test_cuda_decode_gpu(gpu_experts, monkeypatch, t, fused, knobs):
    """On the H200, W4A16 with the CUDA decode GEMMs gives the default kernels' bits with
    the deterministic finalize and the reference's tolerance either way: DeepSeek-V3 EP8
    at 0 tokens (an empty output, the kernel not called), at 1 to 200 tokens (8- and
    16-row tiles), every route on one expert (many blocks of one expert), every route
    masked (zeros); with the ring across items too
    (``CROSS_ITEMS``), with FC1 prefetching FC2's weights into L2 (``L2_NEXT``), with
    16 weight rows a warp (``WARP_ROWS``) and with the codes in the rotated layout
    (``ROT_LAYOUT``, bitwise too). Outputs poisoned first; the kernel asserted to
    have run (from 1 token)."""
    cross, l2next, wrows, rot = KNOBS[knobs]
    monkeypatch.setattr(cuda_decode, "ROT_LAYOUT", rot)
    monkeypatch.setattr(cuda_decode, "WARP_ROWS", wrows)
    monkeypatch.setattr(cuda_decode, "L2_NEXT", l2next)
    monkeypatch.setattr(cuda_decode, "CROSS_ITEMS", cross)
    if not cuda_decode.available():
        pytest.skip(f"cuda_decode not available: {cuda_decode.build_error()}")
    e, h, _, k, e_total = GPU_SHAPES["deepseek-v3-ep8"]
    experts = gpu_experts("deepseek-v3-ep8")
    tt = 64 if isinstance(t, str) else t
    x, ids, w = _edge_inputs(tt, t, h, k, e, e_total, seed=23)
    calls = []
    real = cuda_decode.decode_gemm

    def spy(*a, **kw):
        calls.append(kw["gated"])
        return real(*a, **kw)

    monkeypatch.setattr(cuda_decode, "decode_gemm", spy)
    base = moe_triton(x, ids, w, experts, mode="w4a16", fused_finalize=fused,
                      options=TritonOptions(poison=True))  # fmt: skip
    assert not calls
    out = moe_triton(x, ids, w, experts, mode="w4a16", fused_finalize=fused,
                     options=TritonOptions(poison=True, cuda_decode=True))  # fmt: skip
    if t == 0:
        assert out.shape == (0, h) and base.shape == (0, h) and not calls
        return
    assert sorted(set(calls)) == [False, True], calls
    if t == "all-masked":
        assert not out.float().abs().any()
        return
    if not fused:
        assert torch.equal(out, base)
    ref = moe_reference(x, ids, w, experts, mode="w4a16")
    assert rel_err(out, ref) <= TOL["w4a16"]
