"""Helpers shared by the kernel families: small Triton functions, the launch and
workspace helpers of every launcher, and ``compile_sm90`` (compile a kernel for the H200 on
a machine without a GPU)."""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

__all__ = [
    "bundled_tool",
    "compile_sm90",
    "cuobjdump",
    "empty",
    "fma_f32",
    "interpreting",
    "launch",
    "nibble_to_f16",
    "order_rows",
    "resource_usage",
    "round_e4m3",
    "to_bf16",
    "to_e4m3",
]


def interpreting() -> bool:
    """Whether Triton kernels run in Triton's interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def empty(shape: tuple[int, ...], dtype: torch.dtype, device, poison: bool) -> torch.Tensor:
    """``torch.empty``, or with ``poison`` filled with NaN (0xFF bytes for integer and
    one-byte types), so that an element no kernel writes shows up in tests."""
    if not poison:
        return torch.empty(shape, dtype=dtype, device=device)
    if dtype.is_floating_point and dtype.itemsize > 1:
        return torch.full(shape, float("nan"), dtype=dtype, device=device)
    return torch.full(shape, 0xFF, dtype=torch.uint8, device=device).view(dtype)


def launch(kernel, grid, pdl: bool, *args, **kwargs) -> None:
    """Launch a Triton kernel whose ``USE_PDL`` constexpr says whether it takes part in
    programmatic dependent launch (then launched with ``launch_pdl``)."""
    if pdl:
        kwargs["launch_pdl"] = True
    kernel[grid](*args, USE_PDL=pdl, **kwargs)


def compile_sm90(fn, ptrs: dict, constexprs: dict, *, ints=(), gluon=False, descs=None,
                 **options):  # fmt: skip
    """Compile one specialization of the jit function ``fn`` for sm_90 without a GPU
    (Triton's bundled ptxas), for SASS reading and compile-time checks. ``ptrs`` maps
    pointer arguments to their types (16-byte aligned, as at launch: without that every
    load compiles to byte loads), ``ints`` names the int32 arguments, every other argument
    is a constexpr from ``constexprs``. ``gluon``: ``fn`` is a Gluon kernel; ``descs`` maps
    TMA descriptor arguments to their signature types (``tensordesc<...>``)."""
    from triton.backends.compiler import GPUTarget

    if gluon:
        from triton.experimental.gluon._runtime import GluonASTSource as Source
    else:
        from triton.compiler import ASTSource as Source
    names = fn.arg_names
    descs = descs or {}
    sig = {a: ptrs.get(a) or descs.get(a) or ("i32" if a in ints else "constexpr") for a in names}
    attrs = {(i,): [["tt.divisibility", 16]] for i, a in enumerate(names) if a in ptrs}
    consts = {(names.index(a),): v for a, v in constexprs.items()}
    src = Source(fn, sig, constexprs=consts, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)


def bundled_tool(name: str) -> str:
    """The path of one of the CUDA tools Triton bundles (``ptxas``, ``cuobjdump``)."""
    return os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", name)


def cuobjdump(compiled, *flags: str) -> str:
    """The text Triton's bundled ``cuobjdump`` prints for a compiled kernel's cubin with
    ``flags`` (``-sass``, ``-res-usage``)."""
    import subprocess
    import tempfile

    tool = bundled_tool("cuobjdump")
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "k.cubin")
        with open(path, "wb") as f:
            f.write(compiled.asm["cubin"])
        return subprocess.run([tool, *flags, path], capture_output=True, text=True,
                              check=True).stdout  # fmt: skip


def resource_usage(compiled) -> dict[str, int]:
    """A compiled kernel's resources as Triton's bundled ``cuobjdump -res-usage`` reports
    them: REG (registers a thread), STACK and LOCAL (bytes a thread: a spill when not 0),
    SHARED (static bytes), and the rest of its ``NAME:number`` fields."""
    import re

    out = cuobjdump(compiled, "-res-usage")
    line = [ln for ln in out.splitlines() if "REG:" in ln][-1]
    return {k: int(v) for k, v in re.findall(r"([A-Z]+(?:\[\d+\])?):(\d+)", line)}


@triton.jit
def pdl_wait_release(USE_PDL: tl.constexpr):
    """Programmatic dependent launch (``launch``): wait for the preceding kernel's writes,
    then let the next kernel's programs start; nothing when USE_PDL is off."""
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()


@triton.jit
def to_bf16(x, INTERPRET: tl.constexpr):
    """fp32 to bf16, round to nearest even. Triton 3.6's interpreter truncates this cast,
    so under the interpreter the rounding is done on the bits first (finite values)."""
    if INTERPRET:
        b = x.to(tl.uint32, bitcast=True)
        b = (b + 0x7FFF + ((b >> 16) & 1)) & 0xFFFF0000
        return b.to(tl.float32, bitcast=True).to(tl.bfloat16)
    else:
        return x.to(tl.bfloat16)


@triton.jit
def fma_f32(a, b, c, INTERPRET: tl.constexpr):
    """a * b + c with one rounding. The interpreter's fma rounds twice in fp32, so there the
    sum is formed in fp64 (the product is exact; the sum is rounded twice, to fp64 then fp32,
    which can differ from one rounding only in extremely rare cases)."""
    if INTERPRET:
        return (a.to(tl.float64) * b.to(tl.float64) + c.to(tl.float64)).to(tl.float32)
    else:
        return tl.fma(a, b, c)


@triton.jit
def round_e4m3(v):
    """fp32 values rounded to nearest even on the float8_e4m3fn grid and saturated at
    +-448, still fp32 (the interpreter's own cast rounds ties away from zero): 3 mantissa
    bits for normals (>= 2^-6), multiples of 2^-9 below."""
    a = tl.minimum(tl.abs(v), 448.0)
    b = a.to(tl.uint32, bitcast=True)
    b = (b + 0x7FFFF + ((b >> 20) & 1)) & 0xFFF00000
    normal = b.to(tl.float32, bitcast=True)
    sub = ((a * 512.0 + 8388608.0) - 8388608.0) * (1.0 / 512.0)
    r = tl.where(a >= 0.015625, normal, sub).to(tl.uint32, bitcast=True)
    sign = v.to(tl.uint32, bitcast=True) & 0x80000000
    return (r | sign).to(tl.float32, bitcast=True)


@triton.jit
def to_e4m3(s, INTERPRET: tl.constexpr):
    """fp32 to float8_e4m3fn, round to nearest even, saturating at +-448 (the interpreter's
    cast rounds ties away from zero, so there the value is first rounded on the grid)."""
    if INTERPRET:
        return round_e4m3(s).to(tl.float8e4nv)
    else:
        return s.to(tl.float8e4nv)


@triton.jit
def order_rows(x, R: tl.constexpr, C: tl.constexpr, ORDER: tl.constexpr):
    """Values [R, C] in natural K order to a GEMM loop's K order (``gemm.decode_permuted``):
    64, the unit order (in each 64 elements, position 16 s + 8 b + 2 q + a holds element
    16 q + 4 s + 2 a + b), or 32, the chunk order."""
    if ORDER == 64:
        v = tl.reshape(x, (R, C // 64, 4, 4, 2, 2))  # [r, u, q, s, a, b]
        return tl.reshape(tl.permute(v, (0, 1, 3, 5, 2, 4)), (R, C))  # [r, u, s, b, q, a]
    else:
        v = tl.reshape(x, (R, C // 32, 16, 2))
        return tl.reshape(tl.permute(v, (0, 1, 3, 2)), (R, C))


@triton.jit
def nibble_to_f16(n):
    """e2m1 code (uint8 0..15) to fp16 holding e2m1 * 2^-14, exactly (code 8 gives -0)."""
    n16 = n.to(tl.int16)
    return (((n16 & 8) << 12) | ((n16 & 7) << 9)).to(tl.float16, bitcast=True)
