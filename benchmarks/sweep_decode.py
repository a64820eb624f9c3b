"""Compare GEMM main loops and configs of the Triton MoE on one preset, with a correctness
check of every variant (against the reference, and chunked configs bitwise against each
other: one summation order for every config is what keeps batch invariance).

    PYTHONPATH=src python3 benchmarks/sweep_decode.py --out sweep.json
    PYTHONPATH=src python3 benchmarks/sweep_decode.py --variants c2 c3 c3configs

Variants: c2 (loop 2), old (loop 0), c3 (the defaults: loop 3, its own configs, the dense
path above ``dense_above``), c3-nodense (loop 3 never dense), c3-split / c3-nosplit
(split K forced, never dense), c3-dense (loop 3 on weights decoded once, dense_above=0;
the same bits as c3), c3-qsplit (the defaults with the W4A4 quantize split into one chunk
of a row a program up to QSPLIT_ROWS rows), c2-torch-amax (per-tensor amaxes with torch
ops), configs (loop 2 at each config of SMALL or LARGE), c3configs (loop 3 at each of C3_SMALL or
C3_LARGE, split and not), c3pairs (FC1 and FC2 configs of their own, C3_PAIRS), c3dense
(above 256 tokens, dense at each of C3_DENSE), c3-segN for each N of --segments (the
defaults with K segments of N elements, launch.SEGMENT: more or fewer split programs;
other bits, checked against the reference only), c3-famax (the defaults with
TritonOptions.fused_amax: per-tensor W4A4's second amax in FC1's epilogue; the same bits),
c3-ordx (ordered_x: W4A16 activation rows in the unit order), c3-noblast (blocks_last
off: split K on the (tiles, blocks, segments) grid, the default up to session 9; c3 is
the (tiles, segments, blocks) grid, named c3-blast in session 9's data), c3-noqdec
(TritonOptions.quantize_decoded off: W4A4's decoded rows by dense_rows launches; session
10's data has c3-qdec, the option on, before it became the default), c3-fc1early
(TritonOptions.fc1_early: W4A4's FC1 issues weight copies before its grid wait; the
default since session 12, c3-nofc1early without),
c3-atma (TritonOptions.gluon_a_tma: the Gluon GEMMs' rows by TMA),
c3-noamaxself (TritonOptions.amax_self_upto 0: per-tensor W4A4's amax kernel at every
size), c3-amaxself128k / c3-amaxself256k (amax_self_upto 131072 / 262144),
c3-noamaxzeros (TritonOptions.amax_zeros_in_sort off: a memset before each amax kernel),
c3-denseoverlap, c3-nodenseoverlap (TritonOptions.dense_overlap on / off: FC2's weights
decoded on a side stream during FC1, or after it; session 15's data names the default,
then on, c3),
c3-gbauto, c3-gbworst (TritonOptions.gluon_grid_blocks "auto" and None: the Gluon GEMMs'
grid at the expected valid row blocks, each program looping over its share, or at the
worst case), c3-persist, c3-persistN (TritonOptions.gluon_persist "auto" and N programs
an SM: the Gluon GEMMs as persistent programs that issue the next unit's copies early),
c3-persist-u8 (the same, with the Gluon GEMMs up to 8 expected valid rows an expert),
c3-tiled (gluon_ws.TILED: the Gluon GEMMs read a tiled copy of the weights, contiguous
8 KB a stage; timing only, the same bits),
c3-nogluon (gluon_decode off: loop 3 at decode sizes too),
c3-wholeN (TritonOptions.gluon_whole_upto N: the Gluon GEMMs with whole-K programs and
16-row tiles where loop 3 runs unsplit, up to N expected valid rows an expert),
c3-wholeNb2 (the same with gluon_ws.WHOLE_BUFFERS 2: two ring stages a program),
c3-wholeNuU (the same with gluon_upto U: the split Gluon kernels only up to U rows),
c3-wideN (TritonOptions.gluon_whole_wide 16: whole-K at 32-row tiles above 16 rows, up to
gluon_whole_upto N; above 24 with prefill_above_long off), c3-nowide (session 19's
defaults: whole-K at 16-row tiles up to 24 rows, prefill_above_long 24),
c3-paN (TritonOptions.prefill_above N: the prefill kernels from N valid rows an expert
where both GEMMs fit them), c3-paN-FLAGS (the same with c3-FLAGS of PREFILL_FLAGS below,
e.g. c3-pa48-pbm64x2-defer), c3-noover (TritonOptions.gluon_whole_over None: the split
Gluon kernels up to gluon_upto, no whole-K below it), c3-fill1 / c3-fill2
(TritonOptions.gluon_whole_fill 1 / 2), c3-nolong (prefill_above_long None), c3-sched
(gluon_ws.SCHED_AHEAD: a valid program's block start and end read beside its expert),
c3-rowfirst (launch.QUANTIZE_ROW_FIRST: W4A4's quantize programs load their first chunk
before their global), c3-grot (gluon_ws.ROT_LAYOUT: the Gluon GEMMs read the codes'
rotated copy, 15 decode instructions a code word instead of 18; the same bits),
c3-cuda[-dN][-rN][-capN][-x][-pfN][-w16][-rot][-diagN][-fc1|-fc2]
(TritonOptions.cuda_decode: W4A16's Gluon GEMMs at 8- or 16-row tiles on the CUDA C++
kernel of kernels.cuda_decode, with N ring slots of four units a warp, N row groups a
thread block, registers capped at N, the ring across a block's items
(cuda_decode.CROSS_ITEMS), FC1 prefetching FC2's weights into L2 (cuda_decode.L2_NEXT N),
16 weight rows a warp (WARP_ROWS), the codes in the rotated layout (ROT_LAYOUT), or one
GEMM only; the same bits;
-diagN:
cuda_decode.DIAG N, timing only, wrong results),
c3-nofusedchain (TritonOptions.fused_chain off: with --fused, the accumulator's zeros after
W4A4's quantize and torch's cast, as before session 16),
c3-prefill, c3-noprefill (TritonOptions.gluon_prefill on / off: the dense path's GEMMs on
kernels.gluon_prefill, the weights decoded in registers; on by default since session 17,
whose data names the option off c3), c3-prefill-d64 / c3-prefill-d16 (the option on with
dense_above 64 / 16: the path from fewer valid rows an expert), c3-dense64 (dense_above 64
on the decoded weights, the option off), c3-wholek (TritonOptions.gluon_whole_k: the
decode-size Gluon GEMMs on the prefill kernel, whole K a program), c3-pdefer
(gluon_prefill.DEFER on; the default since session 17), c3-pnodefer (DEFER off), c3-pbm64
(gluon_prefill.BM 64: 64-row blocks on the prefill path), c3-pbm64x2 (the same with two
programs an SM, registers capped at 128), c3-pbm64x2-defer; these set the module flags of
PREFILL_FLAGS, every other variant runs gluon_prefill's defaults. All the same bits as c3.

--fused times every variant with the fused finalize (atomics: no bitwise check).
"""

from __future__ import annotations

import argparse
import json

import torch

from fp4moe.bench import MODES, PRESETS, card_ceilings, make_routes, random_experts, time_us
from fp4moe.kernels import cuda_decode, gluon_prefill, gluon_ws, launch
from fp4moe.kernels.gemm import GemmConfig
from fp4moe.kernels.launch import TritonOptions, moe_triton
from fp4moe.reference import moe_reference

SMALL = [
    (16, 64, 256, 4, 3),
    (16, 128, 256, 4, 2),
    (32, 128, 128, 4, 2),
]
LARGE = [
    (128, 128, 32, 8, 3),
    (64, 128, 32, 4, 4),
    (128, 64, 32, 4, 4),
    (64, 64, 64, 4, 3),
]
C3_SMALL = [
    (16, 64, 256, 4, 2),
    (16, 128, 128, 4, 2),
    (16, 64, 128, 4, 3),
    (32, 64, 128, 4, 2),
    # after the unit order (88 registers at (16, 64, 128) instead of 124): deeper
    # pipelines and two warpgroups a program
    (16, 64, 128, 4, 4),
    (16, 64, 64, 4, 4),
    (16, 128, 128, 8, 3),
    # register caps (GemmConfig.maxnreg): FC1 fits 80 registers with no spill and the same
    # 3.73 instructions a weight, 6 programs an SM instead of 5; 64 registers, 4.23 a
    # weight, 7 (shared memory) -- so 1 and 16 tokens' FC1 programs (672, 896 valid) fit
    # one wave (perf-notes, session 6, item 11)
    (16, 64, 128, 4, 3, False, 80),
    (16, 64, 128, 4, 3, False, 64),
    (16, 64, 128, 4, 2, False, 64),
]
C3_LARGE = [
    (128, 64, 64, 4, 3),
    (128, 128, 64, 8, 2),
    (64, 128, 32, 4, 4),
    (64, 128, 64, 4, 3),
    (64, 64, 64, 4, 3),
]

# c3pairs: FC1 and FC2 configs of their own at decode sizes. FC2 (not gated) amortizes the
# activation permutation over half the weights of FC1: 4.30 SASS instructions a weight at
# (16, 64, 128) against 3.56 at (16, 128, 128), whose 127 registers fit fewer programs.
C3_PAIRS = [
    ((16, 64, 128, 4, 3), (16, 128, 128, 4, 3)),
    ((16, 64, 128, 4, 3, False, 80), (16, 128, 128, 4, 3)),
    ((16, 64, 128, 4, 3, False, 80), (16, 64, 128, 4, 3)),
]

QSPLIT_ROWS = 1024  # c3-qsplit: launch.QUANTIZE_SPLIT_ROWS

C3_DENSE = [  # the dense path: both operands from shared memory, bigger tiles pay
    (64, 128, 64, 4, 3),
    (64, 128, 64, 4, 4),
    (128, 64, 64, 4, 3),
    (128, 128, 64, 8, 3),
    (64, 256, 64, 8, 3),
]


# variants that run c3 with one module flag switched on
FLAG_VARIANTS = {
    "c3-tiled": (gluon_ws, "TILED"),
    "c3-sched": (gluon_ws, "SCHED_AHEAD"),
    "c3-rowfirst": (launch, "QUANTIZE_ROW_FIRST"),
    "c3-grot": (gluon_ws, "ROT_LAYOUT"),
}

# gluon_prefill's module flags of its experiment variants: (DEFER, BM, PER_SM entries), as
# session 17 measured them (c3-pbm64 and c3-pbm64x2 without DEFER, then its default off)
PREFILL_FLAGS = {
    "c3-pdefer": (True, 128, {}),
    "c3-pnodefer": (False, 128, {}),
    "c3-pbm64": (False, 64, {}),
    "c3-pbm64x2": (False, 64, {64: 2}),
    "c3-pbm64x2-defer": (True, 64, {64: 2}),
}


def cuda_knobs(name: str, defaults: tuple) -> None:
    """Set ``cuda_decode``'s knobs for variant ``name``
    (c3-cuda[-dN][-rN][-capN][-x][-pfN][-w16][-rot][-diagN][-fc1|-fc2]: N ring slots of
    four units a warp, N row groups a thread block, registers capped at N, the ring across
    a block's items, cuda_decode.L2_NEXT N, WARP_ROWS 16, ROT_LAYOUT, DIAG N (timing
    only), one GEMM only), or back to ``defaults`` (DEPTH, ROWS_PER_BLOCK, ONLY, REG_CAP,
    CROSS_ITEMS; DIAG and L2_NEXT 0, WARP_ROWS 32, ROT_LAYOUT off) for any other name."""
    depth, rpb, only, cap, cross = defaults
    diag, pf, wrows, rot = 0, 0, 32, False
    if name.startswith("c3-cuda"):
        for part in name[7:].split("-")[1:]:
            if part.startswith("d") and part[1:].isdigit():
                depth = int(part[1:])
            elif part.startswith("r") and part[1:].isdigit():
                rpb = int(part[1:])
            elif part in ("fc1", "fc2"):
                only = part
            elif part.startswith("cap") and part[3:].isdigit():
                cap = int(part[3:])
            elif part == "x":
                cross = True
            elif part[:2] == "pf" and part[2:].isdigit():
                pf = int(part[2:])
            elif part == "w16":
                wrows = 16
            elif part == "rot":
                rot = True
            elif part.startswith("diag") and part[4:].isdigit():
                diag = int(part[4:])
            else:
                raise SystemExit(f"variant {name}: unknown part {part!r}")
    cuda_decode.DEPTH, cuda_decode.ROWS_PER_BLOCK, cuda_decode.ONLY = depth, rpb, only
    cuda_decode.REG_CAP, cuda_decode.CROSS_ITEMS = cap, cross
    cuda_decode.DIAG, cuda_decode.L2_NEXT, cuda_decode.WARP_ROWS = diag, pf, wrows
    cuda_decode.ROT_LAYOUT = rot


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="deepseek-v3-ep8")
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 16, 64, 256, 1024, 8192])
    ap.add_argument("--modes", nargs="+", default=["w4a16", "w4a4-token"])
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--out", default="sweep.json")
    ap.add_argument(
        "--variants",
        nargs="+",
        default=["c2", "old", "c3", "c3-nosplit", "c2-torch-amax", "configs"],
        help="which variants to time; 'configs' is every loop-2 config of SMALL or LARGE, "
        "'c3configs' every loop-3 config of C3_SMALL or C3_LARGE, 'c3pairs' the FC1 and "
        "FC2 pairs of C3_PAIRS (up to 256 tokens), 'c3dense' every dense config of "
        "C3_DENSE (above 256 tokens)",
    )
    ap.add_argument("--fused", action="store_true", help="the fused finalize (atomics)")
    ap.add_argument(
        "--segments",
        type=int,
        nargs="+",
        default=[512, 2048],
        help="K segments of the c3-segN variants (name them in --variants)",
    )
    ap.add_argument(
        "--small-upto",
        type=int,
        default=256,
        help="c3configs: C3_SMALL's configs up to this many tokens",
    )
    ap.add_argument(
        "--large-above",
        type=int,
        default=256,
        help="c3configs: C3_LARGE's configs above this many tokens",
    )
    a = ap.parse_args()
    qsplit0, segment0 = launch.QUANTIZE_SPLIT_ROWS, launch.SEGMENT
    flags0 = {v: getattr(mod, attr) for v, (mod, attr) in FLAG_VARIANTS.items()}
    prefill0 = gluon_prefill.DEFER, gluon_prefill.BM, dict(gluon_prefill.PER_SM)
    whole_buffers0 = gluon_ws.WHOLE_BUFFERS
    cuda0 = (cuda_decode.DEPTH, cuda_decode.ROWS_PER_BLOCK, cuda_decode.ONLY,
             cuda_decode.REG_CAP, cuda_decode.CROSS_ITEMS)  # fmt: skip
    ceil = card_ceilings()
    tbs, tfl = ceil["copy_bytes_per_s"] / 1e12, ceil["bf16_matmul_flops"] / 1e12
    print(f"copy {tbs:.2f} TB/s, bf16 {tfl:.0f} TFLOP/s")
    p = PRESETS[a.preset]
    torch.manual_seed(0)
    e = p.local_experts
    ex = random_experts(p)
    per_expert = ex.nbytes() / e
    rows = []
    for t in a.tokens:
        x = torch.randn(t, p.hidden, device="cuda").to(torch.bfloat16)
        ids, w = make_routes(p, t, t, "cuda")
        valid = ids >= 0
        touched = int(torch.unique(ids[valid]).numel()) if valid.any() else 0
        floor = touched * per_expert / ceil["copy_bytes_per_s"] * 1e6
        for mode in a.modes:
            m, sc = MODES[mode]
            ref = moe_reference(x, ids, w, ex, mode=m, act_scale=sc).float()

            def c3(**kw):  # loop 3 with the preset's valid share of routes, as the bench
                return TritonOptions(chunked=3, valid_fraction=p.local_experts / p.experts, **kw)

            variants = {
                "c2": TritonOptions(chunked=2, dense_above=None),
                "old": TritonOptions(chunked=0, decode_asm=False),
                # the defaults (dense above dense_above valid rows, the preset's valid share
                # of routes as `fp4moe bench` passes it)
                "c3": c3(),
                "c3-nodense": TritonOptions(chunked=3, dense_above=None),
                "c3-nosplit": TritonOptions(chunked=3, split_k=False, dense_above=None),
                "c3-split": TritonOptions(chunked=3, split_k=True, dense_above=None),
                "c3-dense": TritonOptions(chunked=3, dense_above=0),  # decoded weights loaded
                # the defaults with the chunk-a-program quantize (launch.QUANTIZE_SPLIT_ROWS)
                "c3-qsplit": c3(),
                # W4A16 activation rows in the unit order (ordered_x; the same bits)
                "c3-ordx": c3(ordered_x=True),
                # split K with the row blocks before the K segments in the 3-D grid
                # (blocks_last off, the default up to session 9; the same bits)
                "c3-noblast": c3(blocks_last=False),
                # per-tensor W4A4's FC1-output amax in FC1's epilogue (the same bits)
                "c3-famax": c3(fused_amax=True),
                # W4A4 on the Gluon kernels: decoded rows by dense_rows launches (the
                # default since session 10 takes them from the quantize kernels)
                "c3-noqdec": c3(quantize_decoded=False),
                # W4A4: FC1's Gluon programs issue weight copies before their grid wait (the
                # default since session 12; c3-nofc1early without)
                "c3-fc1early": c3(fc1_early=True),
                "c3-nofc1early": c3(fc1_early=False),
                # the Gluon GEMMs' activation rows by TMA with each stage (the same bits)
                "c3-atma": c3(gluon_a_tma=True),
                # per-tensor W4A4: the amax kernel kept at every size (amax_self_upto 0)
                "c3-noamaxself": c3(amax_self_upto=0),
                # per-tensor W4A4: the quantize kernels' own amax up to 128 Ki / 256 Ki
                # elements (FC1 to 16 / 36 tokens, FC2 to 64 / 128 routes at I 2048)
                "c3-amaxself128k": c3(amax_self_upto=131072),
                "c3-amaxself256k": c3(amax_self_upto=262144),
                # per-tensor W4A4: the amax kernels' zeros by torch.zeros (a memset each),
                # not from the sort kernel's buffer (the default since session 15)
                "c3-noamaxzeros": c3(amax_zeros_in_sort=False),
                # the fused finalize (--fused): zeros after the quantize, torch's cast
                "c3-nofusedchain": c3(fused_chain=False),
                # gluon_prefill: the dense path's GEMMs decode in registers (session 17)
                "c3-prefill": c3(gluon_prefill=True),
                "c3-noprefill": c3(gluon_prefill=False),
                "c3-prefill-d64": c3(gluon_prefill=True, dense_above=64),
                "c3-prefill-d16": c3(gluon_prefill=True, dense_above=16),
                "c3-dense64": c3(dense_above=64, gluon_prefill=False),
                "c3-wholek": c3(gluon_whole_k=True),
                # gluon_prefill's experiments (module flags set below)
                "c3-pdefer": c3(),
                "c3-pnodefer": c3(),
                "c3-pbm64": c3(),
                "c3-pbm64x2": c3(),
                "c3-pbm64x2-defer": c3(),
                # the dense path: FC2's weights decoded on a side stream during FC1
                # (dense_overlap; off: slower at 8192 tokens, session 15) or after FC1
                "c3-denseoverlap": c3(dense_overlap=True),
                "c3-nodenseoverlap": c3(dense_overlap=False),
                # the Gluon GEMMs' grid: expected valid row blocks (looped) or worst case
                "c3-gbauto": c3(gluon_grid_blocks="auto"),
                "c3-gbworst": c3(gluon_grid_blocks=None),
                # loop 3 everywhere (the Gluon kernels off; the same bits)
                "c3-nogluon": c3(gluon_decode=False),
                # the split Gluon kernels up to gluon_upto, never whole-K below it
                # (gluon_whole_over None; 3.5 by default since session 19)
                "c3-noover": c3(gluon_whole_over=None),
                # whole-K at 16-row tiles up to 24 rows, the prefill kernels above 24 rows
                # for long-K shapes: session 19's defaults (gluon_whole_wide 16 since 20)
                "c3-nowide": c3(
                    gluon_whole_wide=None, gluon_whole_upto=24.0, prefill_above_long=24
                ),
                # prefill_above everywhere, none from fewer rows for long-K shapes
                "c3-nolong": c3(prefill_above_long=None),
                # whole-K only where its programs fill the SMs' slots once / twice, else
                # the split Gluon kernels (gluon_whole_fill)
                "c3-fill1": c3(gluon_whole_fill=1.0),
                "c3-fill2": c3(gluon_whole_fill=2.0),
                # the valid programs' block start and end read beside their expert
                # (gluon_ws.SCHED_AHEAD, FLAG_VARIANTS; the same bits)
                "c3-sched": c3(),
                # the quantize programs' first chunk before their global (W4A4;
                # launch.QUANTIZE_ROW_FIRST)
                "c3-rowfirst": c3(),
            }
            # the Gluon kernels with whole-K programs where loop 3 runs unsplit, up to N
            # expected valid rows an expert (TritonOptions.gluon_whole_upto)
            for name in a.variants:
                if name.startswith("c3-whole") and name[8:].isdigit():
                    variants[name] = c3(gluon_whole_upto=float(name[8:]))
                elif name.startswith("c3-whole") and name.endswith("b2"):  # WHOLE_BUFFERS 2
                    variants[name] = c3(gluon_whole_upto=float(name[8:-2]))
                elif name.startswith("c3-pa") and name[5:].isdigit():  # prefill_above N
                    variants[name] = c3(prefill_above=int(name[5:]))
                elif name.startswith("c3-pa") and f"c3-{name[5:].partition('-')[2]}" in (
                    PREFILL_FLAGS
                ):  # prefill_above N with one of gluon_prefill's experiments (c3-paN-FLAGS)
                    variants[name] = c3(prefill_above=int(name[5:].partition("-")[0]))
                elif name.startswith("c3-wide") and name[7:].isdigit():
                    # whole-K at 32-row tiles above 16 rows (gluon_whole_wide), up to N rows
                    # (gluon_whole_upto N; above 24, prefill_above_long off so that
                    # Mixtral's 25 to N rows are not on the prefill kernels)
                    n_ = int(name[7:])
                    extra = {"prefill_above_long": None} if n_ > 24 else {}
                    variants[name] = c3(gluon_whole_upto=float(n_), gluon_whole_wide=16.0,
                                        **extra)  # fmt: skip
                elif name.startswith("c3-whole") and "u" in name:  # and gluon_upto U
                    n_, u_ = name[8:].split("u")
                    variants[name] = c3(gluon_whole_upto=float(n_), gluon_upto=float(u_))
                elif name.startswith("c3-cuda"):  # the CUDA decode GEMMs (cuda_decode)
                    variants[name] = c3(cuda_decode=True)  # knobs from the name, below
            # the Gluon GEMMs as persistent programs: as many as the SMs hold, or N an SM
            variants["c3-persist"] = c3(gluon_persist="auto")
            variants["c3-tiled"] = c3()  # with gluon_ws.TILED (FLAG_VARIANTS)
            # ... and taking calls of up to 8 expected valid rows an expert (gluon_upto 8)
            variants["c3-persist-u8"] = c3(gluon_persist="auto", gluon_upto=8.0)
            for name in a.variants:
                if name.startswith("c3-persist") and name[10:].isdigit():
                    variants[name] = c3(gluon_persist=int(name[10:]))
            for seg in a.segments:  # another K segment (launch.SEGMENT): other bits
                variants[f"c3-seg{seg}"] = c3()
            if sc == "per_tensor":  # the amaxes on the device against torch ops
                variants["c2-torch-amax"] = TritonOptions(
                    chunked=2, device_amax=False, dense_above=None
                )
            if "configs" in a.variants:
                for c in SMALL if t <= 256 else LARGE:
                    g = GemmConfig(*c)
                    variants[f"c2{c}"] = TritonOptions(chunked=2, fc1=g, fc2=g, dense_above=None)
            if "c3configs" in a.variants:  # loop 3's own configs, with split K and without
                lists = (C3_SMALL if t <= a.small_upto else []) + (
                    C3_LARGE if t > a.large_above else []
                )
                for c in lists:
                    g = GemmConfig(*c)
                    for split in (True, False) if t <= 1024 else (False,):
                        tag = "s" if split else ""
                        variants[f"c3{tag}{c}"] = TritonOptions(
                            chunked=3, split_k=split, fc1=g, fc2=g, dense_above=None
                        )
            if "c3pairs" in a.variants and t <= 256:  # FC1 and FC2 configs of their own
                for c1, c2 in C3_PAIRS:
                    g1, g2 = GemmConfig(*c1), GemmConfig(*c2)
                    for split in (True, False):
                        tag = "s" if split else ""
                        variants[f"c3{tag}({c1}, {c2})"] = TritonOptions(
                            chunked=3, split_k=split, fc1=g1, fc2=g2, dense_above=None
                        )
            if "c3dense" in a.variants and t > 256:  # the dense path at prefill sizes
                for c in C3_DENSE:
                    g = GemmConfig(*c)
                    variants[f"c3d{c}"] = TritonOptions(
                        chunked=3, split_k=False, fc1=g, fc2=g, dense_above=0
                    )
            variants = {
                k: v
                for k, v in variants.items()
                if k in a.variants or k.startswith(("c2(", "c3(", "c3s(", "c3d("))
            }
            first = first3 = None
            for name, opt in variants.items():
                launch.QUANTIZE_SPLIT_ROWS = QSPLIT_ROWS if name == "c3-qsplit" else qsplit0
                launch.SEGMENT = int(name[6:]) if name.startswith("c3-seg") else segment0
                for v, (mod, attr) in FLAG_VARIANTS.items():
                    setattr(mod, attr, name == v or flags0[v])
                b2 = name.startswith("c3-whole") and name.endswith("b2")
                gluon_ws.WHOLE_BUFFERS = 2 if b2 else whole_buffers0
                # gluon_prefill's experiments; every other variant runs its defaults
                defer, bm, per_sm = prefill0
                flags = name
                if name.startswith("c3-pa") and "-" in name[5:]:  # c3-paN-FLAGS
                    flags = "c3-" + name[5:].partition("-")[2]
                if flags in PREFILL_FLAGS:
                    defer, bm, extra = PREFILL_FLAGS[flags]
                    per_sm = {**per_sm, **extra}
                gluon_prefill.DEFER, gluon_prefill.BM, gluon_prefill.PER_SM = defer, bm, per_sm
                cuda_knobs(name, cuda0)
                try:
                    out = moe_triton(x, ids, w, ex, mode=m, act_scale=sc, options=opt,
                                     fused_finalize=a.fused)  # fmt: skip
                    torch.cuda.synchronize()
                    err = float((out.float() - ref).norm() / ref.norm().clamp_min(1e-30))
                    same = None
                    if a.fused:  # atomics in any order: no bitwise check
                        pass
                    elif name.startswith("c2"):  # loop 2: every config (and amax) the same bits
                        if first is None:
                            first = out
                        same = bool(torch.equal(out, first))
                    elif name.startswith("c3") and not name.startswith("c3-seg"):
                        # loop 3: any config, split or not, the same bits
                        if first3 is None:
                            first3 = out
                        same = bool(torch.equal(out, first3))
                    us = time_us(
                        lambda: moe_triton(
                            x, ids, w, ex, mode=m, act_scale=sc, options=opt, fused_finalize=a.fused
                        ),
                        graph=True,
                        warmup=3,
                        iters=a.iters,
                    )
                except Exception as exc:
                    print(f"T={t} {mode} {name}: FAILED {type(exc).__name__}: {exc}"[:400])
                    rows.append(
                        {"tokens": t, "mode": mode, "variant": name, "error": str(exc)[:300]}
                    )
                    continue
                r = {
                    "tokens": t, "mode": mode, "variant": name, "us": us, "rel_err": err,
                    "bitwise_same": same, "touched": touched,
                    "floor_fraction": floor / us if touched else None,
                }  # fmt: skip
                rows.append(r)
                ff = f"{r['floor_fraction']:.3f}" if touched else "-"
                print(f"T={t:5d} {mode:11s} {name:28s} {us:9.1f} us  floor {ff}", end="")
                print(f"  err {err:.2e}  same {same}")
                with open(a.out, "w") as f:  # after every row: a time limit keeps the rest
                    json.dump(
                        {"ceilings": ceil, "preset": a.preset, "fused": a.fused, "rows": rows},
                        f,
                        indent=1,
                    )
    launch.QUANTIZE_SPLIT_ROWS = qsplit0
    launch.SEGMENT = segment0
    gluon_prefill.DEFER, gluon_prefill.BM, gluon_prefill.PER_SM = prefill0
    gluon_ws.WHOLE_BUFFERS = whole_buffers0
    cuda_knobs("", cuda0)
    for v, (mod, attr) in FLAG_VARIANTS.items():
        setattr(mod, attr, flags0[v])


if __name__ == "__main__":
    main()
