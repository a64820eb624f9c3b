"""The Gluon decode GEMMs (fp4moe.kernels.gluon_ws) against loop 3's split GEMMs.

    PYTHONPATH=src python3 benchmarks/gluon_experiment.py --tokens 1 16 64 256

The shapes and routes of an ``fp4moe bench`` preset (``--preset``, DeepSeek-V3 EP8 by
default), W4A16. For each token count:
each GEMM (FC1 gathered and gated, FC2 on sorted rows) with 8- and 16-row tiles, loop 3's
split GEMM against the Gluon kernel (its last unit of a tile runs the epilogue), bitwise
compared and timed with CUDA events over CUDA-graph replays; then the whole call both
ways (``TritonOptions.gluon_decode``). ``--buffers``: the kernel's ring
(``gluon_ws.BUFFERS``), ``--wgmma``, ``--codes`` (the code copies), ``--four-boxes``,
``--stage-k`` (the ring's stage, ``gluon_ws.STAGE_K``), ``--pdl``, ``--a-tma``, ``--x-ring``,
``--l2-ahead``, ``--diag``, ``--persist``, ``--skew``, ``--tile-rows`` (every
combination of these and ``--buffers``, ``--stage-k``, ``--pdl``, ``--codes``, ``--a-tma``
and ``--x-ring`` is timed against one loop 3 time a token count),
``--gluon-upto``,
``--split-k`` and ``--whole-only`` as their help says.
"""

from __future__ import annotations

import argparse
import itertools
import json

import torch

import fp4moe
from fp4moe.bench import PRESETS, make_routes, time_us
from fp4moe.kernels import gluon_ws
from fp4moe.kernels.gemm import GemmConfig
from fp4moe.kernels.launch import TritonOptions, _gemm, moe_triton
from fp4moe.kernels.sort import sort_routes


def timed(fn, iters: int = 20) -> float:
    """Median us of one call: a CUDA graph of the call, replayed ``iters`` times."""
    return time_us(fn, graph=True, warmup=1, iters=iters)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--tokens", type=int, nargs="+", default=[1, 16, 64])
    p.add_argument("--preset", default="deepseek-v3-ep8", choices=sorted(PRESETS),
                   help="the model shape and routes (fp4moe bench's presets)")  # fmt: skip
    p.add_argument("--out", default=None)
    p.add_argument("--wgmma", choices=("sync", "async"), default="async",
                   help="the Gluon main loop (gluon_ws.ASYNC_WGMMA)")  # fmt: skip
    p.add_argument("--buffers", type=int, nargs="+", default=[1],
                   help="gluon_ws.BUFFERS, each timed (1, 2 or 4)")  # fmt: skip
    p.add_argument("--stage-k", type=int, nargs="+", default=[gluon_ws.STAGE_K],
                   help="gluon_ws.STAGE_K, each timed (64, 128 or 256)")  # fmt: skip
    p.add_argument("--pdl", nargs="+", default=["rule"],
                   choices=("rule", "off", "on", "early"),
                   help="the Gluon kernels' PDL, each timed: the library's rule (the "
                   "default: early copies up to TritonOptions.gluon_pdl_upto valid routes, "
                   "plain launches above), or at every size plain launches (gluon_ws.PDL "
                   "off), PDL (EARLY_WEIGHTS off), PDL with FC2's first weight copies "
                   "before its wait")  # fmt: skip
    p.add_argument("--codes", nargs="+", default=["wide"], choices=("wide", "box3", "four"),
                   help="the code copies a stage, each timed: one 2-D box [64, 128] with a "
                   "128-byte swizzle (gluon_ws.CODE_WIDE, the default), one 3-D box [4, 64, "
                   "32] (CODE_BOX3), four [64, 32] boxes")  # fmt: skip
    p.add_argument("--a-tma", nargs="+", default=["off"], choices=("off", "on"),
                   help="TritonOptions.gluon_a_tma, each timed: the activation rows by TMA "
                   "with each stage")  # fmt: skip
    p.add_argument("--x-ring", nargs="+", default=["off"], choices=("off", "on"),
                   help="gluon_ws.X_RING, each timed: the activation rows a ring stage at a "
                   "time (without --a-tma)")  # fmt: skip
    p.add_argument("--l2-ahead", type=int, nargs="+", default=[0],
                   help="whole calls: stages prefetched into L2 ahead of the ring "
                        "(gluon_ws.L2_AHEAD)")  # fmt: skip
    p.add_argument("--diag", type=int, nargs="+", default=[0], choices=(0, 1, 2, 3, 4),
                   help="gluon_ws.DIAG, each timed (1 to 4 give WRONG results, for timing "
                   "only: 1 no decode, 2 no copies and no waits, 3 neither, 4 neither "
                   "and no wgmma)")  # fmt: skip
    p.add_argument("--grid-blocks", nargs="+", default=["off"],
                   help="TritonOptions.gluon_grid_blocks, each timed: off (the worst-case "
                   "grid), auto, or a number of row blocks")  # fmt: skip
    p.add_argument("--persist", nargs="+", default=["off"],
                   help="whole calls: TritonOptions.gluon_persist, each of off, auto or F:S "
                        "(FC1 and FC2 programs an SM, gluon_ws.PERSIST_PER_SM)")  # fmt: skip
    p.add_argument(
        "--tile-rows",
        type=int,
        nargs="+",
        default=[64],
        choices=(64, 128),
        help="gluon_ws.TILE_ROWS: weight rows a program (128: 8 warps)",
    )
    p.add_argument("--persist-buffers", type=int, nargs="+", default=[0],
                   help="gluon_ws.PERSIST_BUFFERS: the ring of the persistent launches "
                        "(0: --buffers)")  # fmt: skip
    p.add_argument(
        "--skew",
        type=int,
        nargs="+",
        default=[0],
        help="gluon_ws.SKEW_NS: ns half the programs sleep before their copies",
    )
    p.add_argument("--split-k", action="store_true",
                   help="whole calls with TritonOptions.split_k=True (64 tokens, up)")  # fmt: skip
    p.add_argument("--whole-only", action="store_true", help="time the whole calls only")
    p.add_argument("--four-boxes", action="store_true",
                   help="--codes four: a stage's codes as four 2-D TMA boxes")  # fmt: skip
    p.add_argument("--gluon-upto", type=float, default=TritonOptions().gluon_upto,
                   help="whole calls: TritonOptions.gluon_upto (routes an expert)")  # fmt: skip
    a = p.parse_args()
    gluon_ws.ASYNC_WGMMA = a.wgmma == "async"
    if a.four_boxes:
        a.codes = ["four"]
    pr = PRESETS[a.preset]
    dev = "cuda"
    torch.manual_seed(0)
    e, h, inter, topk = pr.local_experts, pr.hidden, pr.inter, pr.top_k
    w13 = torch.randn(e, 2 * inter, h, device=dev, dtype=torch.bfloat16) * 0.02
    w2 = torch.randn(e, h, inter, device=dev, dtype=torch.bfloat16) * 0.02
    ex = fp4moe.prepare_experts(w13, w2)
    del w13, w2
    rows = []
    for g in a.grid_blocks:
        if g not in ("off", "auto") and not g.isdigit():
            p.error(f"--grid-blocks: off, auto or a number, got {g!r}")
    for ps in a.persist:
        if ps not in ("off", "auto") and not all(v.isdigit() for v in ps.split(":")):
            p.error(f"--persist: off, auto or F:S, got {ps!r}")
    variants = list(itertools.product(a.buffers, a.stage_k, a.pdl, a.codes, a.a_tma, a.diag,
                                      a.grid_blocks, a.x_ring, a.l2_ahead, a.persist,
                                      a.skew, a.persist_buffers, a.tile_rows))  # fmt: skip
    per_sm0 = dict(gluon_ws.PERSIST_PER_SM)

    def set_flags(nb, sk, pdl, codes, diag, xring, l2=0):
        """The module flags of one variant (the kernels' compile-time switches)."""
        gluon_ws.X_RING = xring == "on"
        gluon_ws.L2_AHEAD = l2
        gluon_ws.DIAG = diag
        gluon_ws.BUFFERS, gluon_ws.STAGE_K = nb, sk
        gluon_ws.CODE_WIDE, gluon_ws.CODE_BOX3 = codes == "wide", codes != "four"
        gluon_ws.PDL, gluon_ws.EARLY_WEIGHTS = pdl != "off", pdl in ("early", "rule")

    for t in a.tokens:
        # each GEMM alone with the first variant's flags, real results (no DIAG, no X_RING)
        nb0, sk0, pdl0, codes0 = variants[0][:4]
        set_flags(nb0, sk0, pdl0, codes0, 0, "off")
        nb = gluon_ws.BUFFERS
        ids, wts = make_routes(pr, t, t, dev)
        nr = ids.numel()
        x = torch.randn(t, h, device=dev).to(torch.bfloat16)
        # 1. Each GEMM alone: Gluon partials + sum against loop 3's split GEMM, bitwise.
        for bm in () if a.whole_only else (8, 16):
            sort = sort_routes(ids, e, bm)
            a2 = torch.randn(nr, inter, device=dev).to(torch.bfloat16)
            for name, (src, codes, scales, glob, n, k, gated, gather) in {
                "fc1": (x, ex.w13_codes, ex.w13_scales, ex.w13_global, inter, h, True, True),
                "fc2": (a2, ex.w2_codes, ex.w2_scales, ex.w2_global, h, inter, False, False),
            }.items():
                outs = {}
                us = {}
                for g in (False, True):
                    out = torch.full((nr, n), float("nan"), device=dev, dtype=torch.bfloat16)

                    def call(g=g, out=out):
                        _gemm(GemmConfig(bm, 64, 128, 4, 3), sort, src, None, None, codes,
                              scales, glob, out, wts.reshape(-1), n=n, k=k, topk=topk,
                              gated=gated, a_gather=gather, fused=False, pdl=False,
                              split=True, gluon=g)  # fmt: skip

                    call()
                    torch.cuda.synchronize()
                    outs[g] = out.clone()
                    us[g] = timed(call)
                nv = int(sort.expert_offsets[-1])
                same = bool(torch.equal(outs[False][:nv], outs[True][:nv]))
                row = dict(tokens=t, buffers=nb, stage_k=gluon_ws.STAGE_K, gemm=name,
                           block_m=bm, valid_rows=nv, same=same, loop3_split_us=us[False],
                           gluon_us=us[True])  # fmt: skip
                rows.append(row)
                print(f"B{nb} T={t:5d} {name} bm {bm:2d} rows {nv:4d} same {same}  loop3 split "
                      f"{us[False]:7.1f} us  gluon+sum {us[True]:7.1f} us", flush=True)  # fmt: skip

        # 2. The whole call (W4A16, deterministic finalize, PDL, CUDA graph): loop 3 once,
        # then each (buffers, stage_k) of the Gluon kernels.
        def whole_call(g, pdl="rule", atma="off", gb="off", ps="off"):
            rule = {} if pdl == "rule" else dict(gluon_pdl_upto=float("inf"))
            rule["gluon_a_tma"] = atma == "on"
            gluon_ws.PERSIST_PER_SM.update(per_sm0)
            if ps not in ("off", "auto"):
                f1, f2 = (int(v) for v in ps.split(":"))
                gluon_ws.PERSIST_PER_SM.update(
                    {(True, 8): f1, (True, 16): f1, (False, 8): f2, (False, 16): f2}
                )
            rule["gluon_persist"] = None if ps == "off" else "auto"
            rule["gluon_grid_blocks"] = None if gb == "off" else gb if gb == "auto" else int(gb)
            opt = TritonOptions(valid_fraction=pr.local_experts / pr.experts, gluon_decode=g,
                                split_k=True if a.split_k else None,
                                gluon_upto=a.gluon_upto, **rule)  # fmt: skip

            def whole(opt=opt):
                return moe_triton(x, ids, wts, ex, mode="w4a16",
                                  fused_finalize=False, options=opt)  # fmt: skip

            y = whole()
            torch.cuda.synchronize()
            return y.clone(), timed(whole)

        y3, us3 = whole_call(False)
        for nb, sk, pdl, codes, atma, diag, gb, xring, l2, ps, skew, pb, tr in variants:
            if xring == "on" and atma == "on":
                continue  # the rows come one way
            set_flags(nb, sk, pdl, codes, diag, xring, l2)
            gluon_ws.SKEW_NS = skew
            gluon_ws.PERSIST_BUFFERS = pb or None
            gluon_ws.TILE_ROWS = tr
            try:
                yg, usg = whole_call(True, pdl, atma, gb, ps)
            except Exception as exc:  # a variant that does not compile or fit: say so, go on
                print(f"B{nb} SK{sk} persist-{ps} skew-{skew} T={t}: {type(exc).__name__}: "
                      f"{str(exc)[:300]}", flush=True)  # fmt: skip
                continue
            finally:
                gluon_ws.SKEW_NS = 0
                gluon_ws.PERSIST_BUFFERS = None
                gluon_ws.TILE_ROWS = 64
            same = bool(torch.equal(y3, yg))
            rows.append(dict(tokens=t, buffers=nb, stage_k=sk, pdl=pdl, codes=codes,
                             a_tma=atma, diag=diag, grid_blocks=gb, x_ring=xring, l2_ahead=l2,
                             persist=ps, skew_ns=skew, persist_buffers=pb, tile_rows=tr,
                             gemm="call",
                             same=same,
                             loop3_us=us3, gluon_us=usg))  # fmt: skip
            print(f"B{nb} SK{sk} PDL-{pdl} {codes} atma-{atma} xring-{xring} L2-{l2} diag{diag} "
                  f"gb-{gb} persist-{ps} PB{pb} skew-{skew} TR{tr} "
                  f"T={t:5d} "
                  f"whole call same "
                  f"{same}  loop 3 {us3:7.1f} us  with gluon {usg:7.1f} us",
                  flush=True)  # fmt: skip
    if a.out:
        with open(a.out, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
