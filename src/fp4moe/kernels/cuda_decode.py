"""The decode-size W4A16 grouped GEMMs as a CUDA C++ kernel (``cuda/decode_gemm.cu``).

The kernel gives the Gluon decode kernels' bits (the same decode, the same K order and
segment sums, the same epilogue operations) with a thinner skeleton: each weight goes
from HBM straight into the registers of its ``mma.sync`` A fragment, and a tile's K
segments are the warps of one thread block, summed through shared memory (no partials in
HBM, no tile counter, no TMA descriptors or mbarriers). ``TritonOptions.cuda_decode``
routes the W4A16 GEMMs that would run on the Gluon kernels at 8- or 16-row tiles here.

Building: the library is compiled with ``nvcc`` (``$CUDA_HOME/bin/nvcc`` or the one on
PATH) for sm_90a on first use, into ``$FP4MOE_CACHE/cuda`` (default
``~/.cache/fp4moe/cuda``) under a name holding the source's hash, and loaded with ctypes:
no PyTorch extension ABI is involved, so it works with any torch of the machine. Where
there is no nvcc, no Hopper GPU or the build fails, ``available()`` is False and the
GEMMs stay on the Triton kernels (``build_error()`` says why).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

__all__ = [
    "ROT_PERM", "applies", "available", "build_error", "decode_gemm", "library_path",
    "rotated_codes",
]  # fmt: skip

SOURCE = Path(__file__).with_name("cuda") / "decode_gemm.cu"
ABI = 4
NVCC_FLAGS = (
    "-O3", "--fmad=false", "-std=c++17", "-gencode=arch=compute_90a,code=sm_90a",
    "-shared", "-Xcompiler", "-fPIC",
)  # fmt: skip

# Experiment knobs (benchmarks/sweep_decode.py variants c3-cuda*): groups of four units
# (64 K each of the warp's 32 weight rows) in flight a warp, its ring's slots in shared
# memory (1 to 4; 4: the whole 1024-K segment at once); row groups a thread block (None:
# ``_rows_per_block``; the library lowers it where the rings would not fit shared memory).
DEPTH = 2
ROWS_PER_BLOCK: int | None = None
# Diagnostics: "fc1" or "fc2" routes only that GEMM here (None: both); PDL False launches
# the kernel without programmatic dependent launch even in a PDL chain
ONLY: str | None = None
PDL = True
# Experiment (built after session 21's GPU time, not yet run): each thread block's ring
# runs on from one item to the next (the next item's first groups and scales copied while
# this one's last are read), DEPTH 2 only
CROSS_ITEMS = False
# Experiment: a register cap for every kernel of the library (64 or 128 divided by a power
# of two, through the launch bounds; None: the compiler's choice within 128), so that more
# warps fit an SM; built as a library of its own
REG_CAP: int | None = None
# Experiment (a library of its own): FC1 prefetches FC2's weights of its items' experts
# into L2 (1; 2 with FC1's own copies marked to leave L2 first and the prefetched lines
# last) where its valid blocks are at most L2_NEXT_BLOCKS (FC2's touched weights would
# then fit the 50-MB L2)
L2_NEXT = 0
L2_NEXT_BLOCKS = 5
# Experiment (a library of its own): weight rows a warp, 32 (two 16-row A tiles) or 16
# (one: FC1's 8 gate rows and their 8 up rows), fewer registers and shared memory a warp
WARP_ROWS = 32
# Diagnostics, timing only (wrong results; a library of its own): 1 leaves the decode out
# (the code words as the MMA's A fragments), 2 the weights' copies (codes and scales), 3
# both
DIAG = 0
# Experiment (a library of its own; built in session 23, not yet run on a GPU): the kernel
# reads a copy of the codes in the rotated layout (``rotated_codes``, made once a codes
# tensor and kept) and decodes each code word in 15 instructions instead of 18, into the
# same registers, so the same bits (docs/perf-notes.md session 23 item 1)
ROT_LAYOUT = False

# The rotated layout: bit b of each little-endian 32-bit code word is bit ROT_PERM[b] of
# today's word (``decode_rot`` in decode_gemm.cu builds today's four bf16 pair registers
# of the word from it: rotations 0, 1, 2, 3, 6 and 12, AND and LOP3 masks)
ROT_PERM = (20, 21, 22, 4, 5, 6, 0, 1, 2, 23, 24, 25, 26, 19, 7, 3,
            28, 29, 30, 12, 13, 14, 8, 9, 10, 31, 16, 17, 18, 27, 15, 11)  # fmt: skip
_ROTATED: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}

_ERR: list[str] = []


def nvcc() -> str | None:
    """The nvcc to build with: ``$CUDA_HOME/bin/nvcc``, else the one on PATH, else None."""
    home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    if home and (Path(home) / "bin" / "nvcc").is_file():
        return str(Path(home) / "bin" / "nvcc")
    return shutil.which("nvcc")


def _flags() -> tuple[str, ...]:
    """nvcc's flags: ``NVCC_FLAGS``, with the launch bounds' minimum blocks for a register
    cap where ``REG_CAP`` is set (512 threads a block: 65536 / 512 / cap blocks), the
    diagnostic ``DIAG`` where it is not 0, ``L2_NEXT``, ``WARP_ROWS`` 16 and
    ``ROT_LAYOUT``."""
    flags = NVCC_FLAGS
    if REG_CAP:
        flags = (*flags, f"-DFP4MOE_MIN_BLOCKS={max(1, 128 // int(REG_CAP))}")
    if DIAG:
        flags = (*flags, f"-DFP4MOE_DIAG={int(DIAG)}")
    if L2_NEXT:
        flags = (*flags, f"-DFP4MOE_L2NEXT={int(L2_NEXT)}")
    if WARP_ROWS == 16:
        flags = (*flags, "-DFP4MOE_RT=1")
    if ROT_LAYOUT:
        flags = (*flags, "-DFP4MOE_ROT=1")
    return flags


def rotated_codes(codes: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """``codes`` (uint8 [..., C], C a multiple of 4; any device) with each little-endian
    32-bit word's bits permuted into the rotated layout (``ROT_PERM``), or back with
    ``inverse``. A new tensor; lossless either way."""
    if codes.dtype != torch.uint8 or codes.dim() < 1 or codes.shape[-1] % 4:
        raise ValueError(f"codes: expected uint8 [..., C] with C a multiple of 4, got "
                         f"{codes.dtype} {tuple(codes.shape)}")  # fmt: skip
    b = codes.contiguous().to(torch.int64).reshape(*codes.shape[:-1], -1, 4)
    w = b[..., 0] | b[..., 1] << 8 | b[..., 2] << 16 | b[..., 3] << 24
    v = torch.zeros_like(w)
    for dst, src in enumerate(ROT_PERM):
        if inverse:
            dst, src = src, dst
        v |= ((w >> src) & 1) << dst
    out = torch.stack([(v >> (8 * i)) & 0xFF for i in range(4)], dim=-1)
    return out.to(torch.uint8).reshape(codes.shape)


def _rotated(codes: torch.Tensor) -> torch.Tensor:
    """The kept rotated copy of ``codes`` (``ROT_LAYOUT``), made on first use outside a
    CUDA graph capture (a copy made during one would live in the graph's memory). The
    cache holds ``codes`` too, so that its storage is not reused while the copy is kept
    (an experiment's cost: nothing is freed)."""
    key = (codes.data_ptr(), codes.device, tuple(codes.shape), codes._version)
    got = _ROTATED.get(key)
    if got is None:
        if codes.is_cuda and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("cuda_decode.ROT_LAYOUT: call once outside the CUDA graph "
                               "capture first (the codes' rotated copy is made then)")  # fmt: skip
        got = _ROTATED[key] = (codes, rotated_codes(codes))
    return got[1]


def library_path() -> Path:
    """Where the built library lives: the cache directory, named by the source's and the
    flags' hash (a changed source builds anew)."""
    h = hashlib.sha256(SOURCE.read_bytes() + " ".join(_flags()).encode()).hexdigest()[:16]
    root = Path(os.environ.get("FP4MOE_CACHE") or Path.home() / ".cache" / "fp4moe")
    return root / "cuda" / f"decode_gemm-{h}.so"


def build(path: Path | None = None) -> Path:
    """Compile ``decode_gemm.cu`` into ``path`` (default ``library_path()``) if it is not
    there. Raises RuntimeError with nvcc's output when the build fails."""
    path = path or library_path()
    if path.is_file():
        return path
    exe = nvcc()
    if exe is None:
        raise RuntimeError("cuda_decode: no nvcc (set CUDA_HOME or put nvcc on PATH)")
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=path.parent)
    os.close(fd)
    try:
        res = subprocess.run([exe, *_flags(), "-o", tmp, str(SOURCE)], capture_output=True,
                             text=True)  # fmt: skip
        if res.returncode:
            raise RuntimeError(f"cuda_decode: nvcc failed ({res.returncode}):\n"
                               f"{res.stderr[-4000:]}")  # fmt: skip
        os.replace(tmp, path)  # atomic: concurrent builders each write their own file
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return path


def _lib() -> ctypes.CDLL | None:
    return _load(_flags())


@functools.cache
def _load(flags: tuple[str, ...]) -> ctypes.CDLL | None:
    """The library built with ``flags`` (``_flags()``), loaded once a flag set."""
    try:
        lib = ctypes.CDLL(str(build()))
        lib.fp4moe_cuda_abi.restype = ctypes.c_int
        if lib.fp4moe_cuda_abi() != ABI:
            raise RuntimeError(f"cuda_decode: library ABI {lib.fp4moe_cuda_abi()}, want {ABI}")
        vp, i = ctypes.c_void_p, ctypes.c_int
        lib.fp4moe_decode_gemm.argtypes = [vp] * 11 + [i] * 13 + [vp, vp, i, vp]
        lib.fp4moe_decode_gemm.restype = i
        lib.fp4moe_cuda_error.argtypes = [i]
        lib.fp4moe_cuda_error.restype = ctypes.c_char_p
        return lib
    except (OSError, RuntimeError) as exc:
        _ERR.append(str(exc))
        return None


@functools.cache
def available() -> bool:
    """Whether the kernel can run here: a Hopper GPU (sm_90) and the library built and
    loaded (``build_error()`` says why not)."""
    if not torch.cuda.is_available():
        _ERR.append("cuda_decode: no CUDA device")
        return False
    if torch.cuda.get_device_capability()[0] != 9:
        _ERR.append("cuda_decode: the kernel is for Hopper (sm_90)")
        return False
    return _lib() is not None


def build_error() -> str | None:
    """Why ``available()`` is False (None when it is True or was not asked)."""
    return _ERR[-1] if _ERR else None


def applies(n: int, k: int, gated: bool, block_m: int) -> bool:
    """Whether a GEMM of ``n`` outputs and inner size ``k`` at ``block_m``-row tiles fits
    the kernel's shapes: K a multiple of 1024 of at most 16 segments, n a multiple of 16
    (FC1, gated) or 32 (FC2), 8 or 16 rows a tile."""
    return (
        k % 1024 == 0 and 0 < k // 1024 <= 16 and n % (16 if gated else 32) == 0
        and block_m in (8, 16)
    )  # fmt: skip


def _rows_per_block(segs: int, n: int, gated: bool, blocks: int) -> int:
    """Row groups (16 outputs of FC1, 32 of FC2; one warp a K segment each) a thread
    block: up to 8 warps (measured on the H200, session 21: DeepSeek-V3's FC1 at one row
    group of 7 warps, its FC2 at four of 2), fewer where the blocks' items would not fill
    two thread blocks an SM."""
    from .launch import sm_count

    if ROWS_PER_BLOCK is not None:
        return max(1, min(int(ROWS_PER_BLOCK), 16 // segs))
    out_w = (16 if gated else 32) * WARP_ROWS // 32
    r = max(1, 8 // segs)
    while r > 1 and -(-n // (r * out_w)) * blocks < 2 * sm_count():
        r //= 2
    return r


def decode_gemm(
    x: torch.Tensor,
    sorted_routes: torch.Tensor,
    codes: torch.Tensor,
    scales: torch.Tensor,
    block_expert: torch.Tensor,
    block_start: torch.Tensor,
    block_end: torch.Tensor,
    valid_blocks: torch.Tensor,
    w_global: torch.Tensor,
    out: torch.Tensor,
    *,
    n: int,
    topk: int,
    gated: bool,
    gather: bool,
    block_m: int,
    fused: bool = False,
    topk_w: torch.Tensor | None = None,
    pdl: bool = False,
    expected_blocks: int | None = None,
    l2_next: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> None:
    """One W4A16 grouped GEMM on the sort's schedule (``sort_routes`` at ``block_m`` rows
    a block), with the Gluon kernels' bits.

    Args:
        x: bf16 [rows, K]: the tokens (``gather``: row ``sorted_routes // topk``) for FC1,
            or FC1's output rows in sorted order for FC2.
        codes, scales: uint8 [E, W_ROWS, K/2] and float8_e4m3fn [E, W_ROWS, K/16], W_ROWS
            ``2 n`` (gated: n gate rows, then n up rows) or ``n``.
        block_expert, block_start, block_end: int32 [blocks], the schedule;
            ``valid_blocks`` int32 [1], its valid blocks (they come first).
        w_global: fp32 [E, 2] (gated) or [E].
        out: bf16 [rows, n], rows in sorted order (FC1: SwiGLU of gate and up; FC2: y),
            or with ``fused`` fp32 [T, n] into which router weight (``topk_w`` fp32
            [T * topk]) times y of each route is added atomically.
        pdl: launched with programmatic dependent launch (waits for the kernel before it,
            then releases the next).
        expected_blocks: the valid blocks expected (sizes the thread blocks); None: all.
        l2_next: FC1 only: FC2's codes and scales (uint8 [E, K, n/2], float8_e4m3fn
            [E, K, n/16]), prefetched into L2 while FC1 runs where ``L2_NEXT`` is set.
    """
    k = x.shape[-1]
    e = codes.shape[0]
    w_rows = 2 * n if gated else n
    if x.dtype != torch.bfloat16 or x.dim() != 2 or not x.is_contiguous():
        raise ValueError(f"x: expected contiguous bf16 [rows, K], got {x.dtype} {tuple(x.shape)}")
    if not applies(n, k, gated, block_m):
        raise ValueError(f"cuda_decode: n={n}, K={k}, gated={gated}, block_m={block_m} do not "
                         "fit the kernel (applies())")  # fmt: skip
    if codes.dtype != torch.uint8 or tuple(codes.shape) != (e, w_rows, k // 2):
        raise ValueError(f"codes: expected uint8 [{e}, {w_rows}, {k // 2}], got {codes.dtype} "
                         f"{tuple(codes.shape)}")  # fmt: skip
    if scales.dtype != torch.float8_e4m3fn or tuple(scales.shape) != (e, w_rows, k // 16):
        raise ValueError(f"scales: expected float8_e4m3fn [{e}, {w_rows}, {k // 16}], got "
                         f"{scales.dtype} {tuple(scales.shape)}")  # fmt: skip
    want_g = (e, 2) if gated else (e,)
    if w_global.dtype != torch.float32 or tuple(w_global.shape) != want_g:
        raise ValueError(f"w_global: expected fp32 {list(want_g)}, got {w_global.dtype} "
                         f"{tuple(w_global.shape)}")  # fmt: skip
    if fused:
        if gated or topk_w is None or out.dtype != torch.float32:
            raise ValueError("fused: FC2 only, with topk_w and fp32 out [T, n]")
    elif out.dtype != torch.bfloat16 or out.shape[-1] != n:
        raise ValueError(f"out: expected bf16 [rows, {n}], got {out.dtype} {tuple(out.shape)}")
    if x.data_ptr() % 16 or codes.data_ptr() % 16 or scales.data_ptr() % 16:
        raise ValueError("x, codes, scales: expected 16-byte aligned storage")
    if int(DEPTH) not in (1, 2, 3, 4):
        raise ValueError(f"cuda_decode.DEPTH: expected 1, 2, 3 or 4, got {DEPTH!r}")
    nx = None
    if l2_next is not None and L2_NEXT:
        c2, s2 = l2_next
        if (not gated or c2.dtype != torch.uint8 or tuple(c2.shape) != (e, k, n // 2)
                or tuple(s2.shape) != (e, k, n // 16) or s2.dtype != torch.float8_e4m3fn
                or not (c2.is_contiguous() and s2.is_contiguous())):  # fmt: skip
            raise ValueError(f"l2_next: expected FC1 with FC2's contiguous codes uint8 "
                             f"[{e}, {k}, {n // 2}] and scales float8_e4m3fn "
                             f"[{e}, {k}, {n // 16}]")  # fmt: skip
        nx = (c2.data_ptr(), s2.data_ptr(), int(L2_NEXT_BLOCKS))
    if WARP_ROWS not in (16, 32):
        raise ValueError(f"cuda_decode.WARP_ROWS: expected 16 or 32, got {WARP_ROWS!r}")
    if L2_NEXT not in (0, 1, 2):
        raise ValueError(f"cuda_decode.L2_NEXT: expected 0, 1 or 2, got {L2_NEXT!r}")
    if DIAG not in (0, 1, 2, 3):
        raise ValueError(f"cuda_decode.DIAG: expected 0, 1, 2 or 3, got {DIAG!r}")
    if ROT_LAYOUT and L2_NEXT:
        raise ValueError("cuda_decode.ROT_LAYOUT: not with L2_NEXT (which prefetches "
                         "today's codes)")  # fmt: skip
    if CROSS_ITEMS and int(DEPTH) != 2:
        raise ValueError(f"cuda_decode.CROSS_ITEMS: needs DEPTH 2, got {DEPTH!r}")
    tensors = (x, sorted_routes, codes, scales, block_expert, block_start, block_end,
               valid_blocks, w_global, out) + ((topk_w,) if fused else ())  # fmt: skip
    if any(not t.is_contiguous() or t.device != x.device for t in tensors):
        raise ValueError("cuda_decode: every tensor contiguous and on x's device")
    for name, t in (("sorted_routes", sorted_routes), ("block_expert", block_expert),
                    ("block_start", block_start), ("block_end", block_end),
                    ("valid_blocks", valid_blocks)):  # fmt: skip
        if t.dtype != torch.int32:
            raise ValueError(f"{name}: expected int32, got {t.dtype}")
    lib = _lib() if available() else None
    if lib is None:
        raise RuntimeError(f"cuda_decode: not available: {build_error()}")
    if ROT_LAYOUT:
        codes = _rotated(codes)
    blocks = block_expert.numel()
    segs = k // 1024
    rpb = _rows_per_block(segs, n, gated, blocks if expected_blocks is None else expected_blocks)
    stream = torch.cuda.current_stream(x.device).cuda_stream
    with torch.cuda.device(x.device):
        rc = lib.fp4moe_decode_gemm(
            x.data_ptr(), sorted_routes.data_ptr(), codes.data_ptr(), scales.data_ptr(),
            block_expert.data_ptr(), block_start.data_ptr(), block_end.data_ptr(),
            valid_blocks.data_ptr(), w_global.data_ptr(),
            topk_w.data_ptr() if fused else w_global.data_ptr(), out.data_ptr(),
            n, k, topk, int(gated), int(gather), int(fused), block_m, blocks, rpb,
            int(DEPTH), int(bool(CROSS_ITEMS)), int(pdl and PDL), 0,
            *(nx if nx is not None else (None, None, 0)), stream,
        )  # fmt: skip
    if rc:
        raise RuntimeError(f"cuda_decode: launch failed: {lib.fp4moe_cuda_error(rc).decode()}")
