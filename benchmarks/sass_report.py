"""What the compiler makes of the kernels a call runs, without a GPU: each GEMM of the
planner's plan (an H200's) compiled for sm_90 (Triton's bundled ptxas), with its
registers, spills, shared memory and SASS: instructions, tensor-core instructions and the
integer instructions of the NVFP4 decode.

    python3 benchmarks/sass_report.py --preset deepseek-v3-ep8 --num-tokens 1 256 1024 8192
    python3 benchmarks/sass_report.py --preset qwen3-30b-a3b --modes w4a4-static --dump fc1

The decode's cost shows in LOP3/SHF/IMAD against HGMMA, QGMMA or HMMA; a change to a kernel
should leave the default kernels' counts as they were unless it means to change them.
``ovl%``: of a wgmma kernel's decode (its scale multiplies, HMUL2), the percent the SASS
places while a wgmma is in flight; 0 where each decode waits for the last wgmma, "-" for
kernels without wgmma. ``ins/w``: instructions a
thread issues a decoded weight, in the innermost loop holding the most of the decode (the
prefill kernel's K-segment loop), or over the whole kernel where no loop holds it (the
split-K decode kernel, unrolled); the decode's bf16x2 scale multiplies (HMUL2, one a
weight pair) count the weights. "-" for kernels that decode nothing. ``wgmma``: "serial"
where ptxas serializes a kernel's asynchronous wgmmas (its C75xx note: each then waits
for the one before, whatever the source asks), "async" where it keeps them in flight,
"-" without wgmma. ``/SM``: programs an
SM can hold (Hopper: 64K registers in 256-register warp units, 228 KB of shared memory
with 1 KB reserved a program, 2048 threads, 32 programs). ``waves``: for the decode
kernels, the programs that have work (weight tiles x K segments x row blocks of the
touched experts) over /SM x 132 SMs, with routes drawn as ``fp4moe bench`` draws them
(seed T) on ``--routes-device``: the CPU's generator gives another sample than the GPU's,
which the bench times (``--routes-device cuda`` on a GPU machine). Above 1 the last wave
runs short.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from collections import Counter

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))
# compiling needs real @triton.jit functions, not the interpreter's
os.environ.pop("TRITON_INTERPRET", None)


def sass(compiled) -> list[str]:
    """The SASS instructions (opcode and operands) of a compiled kernel."""
    return [i for _, i in sass_addressed(compiled)]


def sass_addressed(compiled) -> list[tuple[int, str]]:
    """(address, instruction) of each SASS instruction of a compiled kernel."""
    from fp4moe.kernels.common import cuobjdump

    return [(int(m.group(1), 16), m.group(2)) for ln in cuobjdump(compiled, "-sass").splitlines()
            if (m := re.match(r"\s+/\*([0-9a-f]+)\*/\s+(.*?)\s*;", ln))]  # fmt: skip


def compile_gemm(plan, which: str) -> list[tuple[str, object]]:
    """The compiled kernels of GEMM ``which`` ("fc1" or "fc2") of ``plan``: (a label, the
    kernel) each; the prefill kernel over each expert's tile rows is three launches, one a
    tile size (the label its rows)."""
    from fp4moe.kernels.gemm import gluon_decode, gluon_prefill, portable
    from fp4moe.kernels.sort import MIXED_ROWS

    g = getattr(plan, which)
    gated = which == "fc1"
    n, k = (plan.inter, plan.hidden) if gated else (plan.hidden, plan.inter)
    a_fp4 = plan.mode == "w4a4"
    e4m3 = plan.mode == "w4a8"
    fused = g.epilogue == "atomic"
    if g.kernel in ("gluon-split", "gluon-whole"):
        return [("", gluon_decode.compile_sm90(
            n=n, k=k, gated=gated, block_m=g.tile.block_m, epilogue=g.epilogue != "nvfp4",
            fused=fused, a_fp4=a_fp4, pdl=g.pdl, early_weights=g.early_weights,
            whole=g.kernel == "gluon-whole", scale_tma=not plan.scale_loads,
        ))]  # fmt: skip
    if g.kernel == "gluon-prefill":
        runs = [(g.tile.block_m, 0)]
        if g.mixed:  # the launches' chain: the first, then the later ones (PDL)
            runs = [(bm, 1 if i == 0 else 2) for i, bm in enumerate(MIXED_ROWS)]
        return [(f"@{bm}" if g.mixed else "", gluon_prefill.compile_sm90(
            n=n, k=k, gated=gated, fused=fused, a_fp4=a_fp4, a_e4m3=e4m3, block_m=bm,
            scale_tma=not plan.scale_loads, chain=chain)) for bm, chain in runs]  # fmt: skip
    t = g.tile
    return [("", portable.compile_sm90(
        n=n, k=k, gated=gated, tile=(t.block_m, t.block_n, t.block_k, t.num_warps,
                                     t.num_stages), a_fp4=a_fp4,
        a_gather=gated and plan.fc1_input not in ("static",), fused=fused, split=g.split,
        dense=g.kernel == "triton-dense", out_fp4=g.epilogue == "nvfp4", pdl=plan.pdl,
        a_fp8=e4m3,
    ))]  # fmt: skip


def report(compiled) -> dict:
    from fp4moe.kernels.common import resource_usage

    addressed = sass_addressed(compiled)
    ins = [i for _, i in addressed]
    ops = Counter(_opcode(i) for i in ins)
    res = resource_usage(compiled)
    base = lambda name: sum(v for o, v in ops.items() if o.split(".")[0] == name)
    wgmma = base("HGMMA") + base("QGMMA")
    mode = ("serial" if wgmma_serialized(compiled) else "async") if wgmma else "-"
    return dict(regs=res["REG"], stack=res.get("STACK", 0), shared=compiled.metadata.shared,
                sass=len(ins), mma=wgmma + base("HMMA"), lop3=base("LOP3"),
                shf=base("SHF"), imad=base("IMAD"), bar=base("BAR"),
                overlap=decode_overlap(ins), per_weight=per_weight(addressed),
                wgmma=mode)  # fmt: skip


def wgmma_serialized(compiled) -> bool:
    """Whether ptxas serializes the kernel's asynchronous wgmmas: its note C7510 to C7519
    ("wgmma.mma_async instructions are serialized due to ...") when Triton's bundled ptxas
    compiles the kernel's PTX again for sm_90a (the PTX carries its register cap)."""
    import subprocess
    import tempfile

    from fp4moe.kernels.common import bundled_tool

    tool = bundled_tool("ptxas")
    with tempfile.TemporaryDirectory() as tmp:
        src = os.path.join(tmp, "k.ptx")
        with open(src, "w") as f:
            f.write(compiled.asm["ptx"])
        run = subprocess.run([tool, "-arch=sm_90a", "-v", src, "-o", os.path.join(tmp, "k.o")],
                             capture_output=True, text=True, check=True)  # fmt: skip
    return bool(re.search(r"\(C751\d\).*wgmma\.mma_async instructions are serialized",
                          run.stdout + run.stderr))  # fmt: skip


def per_weight(addressed: list[tuple[int, str]]) -> float | None:
    """Instructions a decoded weight (``ins/w`` in the module docstring): the loops are the
    backward branches' ranges without an EXIT (a wait's retry stub past the kernel's end
    branches back over it); of those holding HMUL2 and no such loop inside, the one with
    the most; else the whole kernel. None without HMUL2."""
    at = {a: k for k, (a, _) in enumerate(addressed)}
    ins = [i for _, i in addressed]
    hmul = [_opcode(i).startswith("HMUL2") for i in ins]
    loops = []
    for end, i in enumerate(ins):
        m = re.search(r"\bBRA\s+(0x[0-9a-f]+)", i)
        start = at.get(int(m.group(1), 16)) if m else None
        if start is not None and start <= end:
            body = range(start, end + 1)
            if any(hmul[j] for j in body) and not any(_opcode(ins[j]) == "EXIT" for j in body):
                loops.append((start, end))
    inner = [
        (s, e)
        for s, e in loops
        if not any((s2, e2) != (s, e) and s <= s2 and e2 <= e for s2, e2 in loops)
    ]
    s, e = max(inner, key=lambda r: sum(hmul[r[0] : r[1] + 1]), default=(0, len(ins) - 1))
    pairs = sum(hmul[s : e + 1])
    return round((e - s + 1) / (2 * pairs), 2) if pairs else None


def decode_overlap(ins: list[str]) -> int | None:
    """The percent of the decode's scale multiplies (HMUL2) placed, in program order, after
    a wgmma (HGMMA, or QGMMA for FP8) and before the wait that drains it
    (``WARPGROUP.DEPBAR.LE gsb0, 0x0``): decode issued while a wgmma runs. None without
    wgmma."""
    wgmma, pending, over, total = False, False, 0, 0
    for i in ins:
        op = _opcode(i)
        if op.startswith(("HGMMA", "QGMMA")):
            wgmma = pending = True
        elif op.startswith("WARPGROUP.DEPBAR") and i.endswith("0x0"):
            pending = False
        elif op.startswith("HMUL2"):
            total += 1
            over += pending
    if not wgmma:
        return None
    return round(100 * over / total) if total else 0


SMS = 132  # the H100's and H200's SMs


def per_sm(regs: int, shared: int, num_warps: int) -> int:
    """Programs an SM holds (``/SM`` in the module docstring)."""
    threads = 32 * num_warps
    by_regs = 65536 // (num_warps * 256 * -(-max(regs, 1) // 8))
    return min(by_regs, 233472 // (shared + 1024), 2048 // threads, 32)


def decode_programs(plan, which: str, ids) -> int | None:
    """The programs of GEMM ``which`` that have work with top-k ids ``ids`` (negative:
    masked) on a decode kernel (split or whole K), else None."""
    import torch

    from fp4moe.kernels.gemm.shapes import SEGMENT

    g = getattr(plan, which)
    if g.kernel not in ("gluon-split", "gluon-whole"):
        return None
    n, k = (plan.inter, plan.hidden) if which == "fc1" else (plan.hidden, plan.inter)
    rows = torch.bincount(ids[ids >= 0].flatten().long().cpu(), minlength=plan.num_experts)
    blocks = int((-(-rows // g.tile.block_m)).sum())
    segs = 1 if g.kernel == "gluon-whole" else -(-k // SEGMENT)
    return -(-n // 64) * segs * blocks  # 64 weight rows a tile


def _opcode(ins: str) -> str:
    """An instruction's opcode with its modifiers (past a predicate)."""
    return ins.split()[1] if ins.startswith("@") else ins.split()[0]


def main(argv: list[str] | None = None) -> int:
    from fp4moe.backend import H200, Options, plan_call
    from fp4moe.bench import make_routes
    from fp4moe.presets import MODES, PRESETS

    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    ap.add_argument("--preset", default="deepseek-v3-ep8", choices=sorted(PRESETS))
    ap.add_argument("--num-tokens", type=int, nargs="+", default=[1, 256, 1024, 8192])
    ap.add_argument("--modes", nargs="+", default=["w4a16"], choices=sorted(MODES))
    ap.add_argument("--dump", choices=("fc1", "fc2"), help="also print that GEMM's SASS")
    ap.add_argument("--routes-device", default="cpu",
                    help="where the waves' routes are drawn (cuda: the bench's)")  # fmt: skip
    a = ap.parse_args(argv)
    p = PRESETS[a.preset]
    cols = ["tokens", "mode", "gemm", "kernel", "regs", "stack", "shared", "sass", "mma",
            "lop3", "shf", "imad", "bar", "ovl%", "wgmma", "ins/w", "/SM", "waves"]  # fmt: skip
    print(" ".join(f"{c:>8s}" if c != "kernel" else f"{c:34s}" for c in cols))
    for mode in a.modes:
        m, sc = MODES[mode]
        for t in a.num_tokens:
            opt = Options(valid_fraction=p.local_experts / p.experts)
            plan = plan_call(t, p.top_k, p.local_experts, p.hidden, p.inter, mode=m,
                             act_scale=sc, target=H200, options=opt)  # fmt: skip
            ids, _ = make_routes(p, t, t, a.routes_device)  # as fp4moe bench draws them
            for which in ("fc1", "fc2"):
                for label, compiled in compile_gemm(plan, which):
                    r = report(compiled)
                    r["ovl%"] = "-" if r["overlap"] is None else r["overlap"]
                    r["ins/w"] = "-" if r["per_weight"] is None else r["per_weight"]
                    r["/SM"] = per_sm(r["regs"], r["shared"], compiled.metadata.num_warps)
                    progs = decode_programs(plan, which, ids)
                    r["waves"] = "-" if progs is None else round(progs / (r["/SM"] * SMS), 2)
                    g = getattr(plan, which)
                    desc = f"{g.kernel} ({label[1:]} rows)" if label else g.describe()
                    print(f"{t:8d} {mode:>8s} {which:>8s} {desc:34s} "
                          + " ".join(f"{r[c]:>8}" for c in cols[4:]), flush=True)  # fmt: skip
                    if a.dump == which:
                        print("\n".join(sass(compiled)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
