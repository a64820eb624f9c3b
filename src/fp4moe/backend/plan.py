"""The planner: one frozen ``Plan`` a call, from the shapes, the mode, the token count, the
options and the device, read by everything that needs the choice (the launcher, the
workspace accounting, expert parallelism, the bench, ``fp4moe plan``).

Regimes, by the expected valid rows an expert (``Plan.valid_rows``; heuristics.py has the
thresholds and their measurements): decode (a few rows: K split over many programs, the
split Gluon kernel with 8-row tiles on Hopper), middle (the whole-K Gluon kernel with 16-
or 32-row tiles, else the portable loop), prefill (the Gluon prefill kernel with 64- or
128-row tiles, else the weights decoded to bf16 once a call). Every kernel family computes
the same sums in the same order, so the bits do not depend on the plan.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace

from ..kernels.gemm.shapes import (
    PREFILL_BLOCKS,
    SEGMENT,
    gluon_decode_fits,
    max_blocks,
    prefill_fits,
    scale_rows_tma,
    scale_tma,
)
from ..kernels.sort import MIXED_ROWS
from ..modes import ACT_SCALES, KERNEL_MODES
from . import heuristics as hx
from .device import Target
from .options import InapplicableOverride, Options, Tile

__all__ = ["GemmPlan", "Plan", "experts_scales_tma", "explain", "plan_call", "workspace_bytes"]

_GLUON_TILE_N = 64  # weight rows a Gluon decode-kernel tile (its counters' tiles)
_WHOLE_TILE = Tile(16, 64, 128)  # the whole-K kernel's 16-row tiles, as the rules ask of them


@dataclass(frozen=True)
class GemmPlan:
    """How one grouped GEMM runs.

    kernel: one of ``options.KERNELS``. tile: the portable kernel's tile (block_m: the
    schedule's token rows a tile, which every family uses). segments: K's 1024-element
    segments (split kernels: one program a segment and tile). epilogue: "bf16" route rows,
    "atomic" (the fused finalize), or "nvfp4" (static W4A4's FC1; a split Gluon kernel's
    partials are then summed by the portable kernel). operand: how the activation rows
    reach the kernel: "x" (bf16 tokens, gathered), "rows" (bf16 rows in sorted order),
    "nvfp4" (decoded in the main loop), "decoded" (W4A4 rows decoded by the quantize
    kernel), "decode" (W4A4 rows decoded by a launch of their own), "gather" (rows
    gathered into sorted unit order by a launch: the prefill kernel), "dense" (decoded or
    reordered once with the weights: triton-dense), "e4m3" (W4A8's e4m3 rows). split: one
    program a K segment and tile (gluon-split, triton-split, and triton-dense of too few
    programs). pdl: the kernel joins the call's PDL chain. early_weights: its first weight
    copies are issued before its PDL wait. counters: int32 tile counters it needs zeroed
    (split kernels)."""

    kernel: str
    tile: Tile
    segments: int
    split: bool
    epilogue: str
    operand: str
    pdl: bool
    early_weights: bool = False
    counters: int = 0
    mixed: bool = False  # gluon-prefill: each expert's rows in 128, then 64 or 32-row tiles

    def describe(self) -> str:
        """One line: kernel, tile rows, K split, epilogue."""
        t = self.tile
        if self.mixed:
            shape = "32, 64 and 128 rows by each expert's routes"
        elif self.kernel.startswith("gluon-"):
            shape = f"{t.block_m} rows"
        else:
            shape = f"{t.block_m}x{t.block_n}x{t.block_k}"
        split = f", K split {self.segments}" if self.split else ""
        epi = "" if self.epilogue == "bf16" else f", {self.epilogue} out"
        return f"{self.kernel} ({shape}{split}{epi})"


@dataclass(frozen=True)
class Plan:
    """The choices of one call (``plan_call``). fc1_input / fc2_input: how each GEMM's
    activation is made ("bf16"; W4A4: "per-row", "per-tensor" (amax in the quantize
    kernel), "per-tensor+amax" (an amax kernel first), "static", "fc1-epilogue" (FC1
    writes NVFP4 itself), "dispatched" (quantized by the sending rank)). sort: "triton"
    (the kernel) or "torch". finalize: "deterministic" or "atomic". zero_words: int32
    words the sort kernel zeroes (the tile counters, then the per-tensor amax slots).
    scale_loads: a Gluon GEMM loads its weight scales by pointer, their rows not 16-byte
    aligned in memory (``plan_call(scales_tma=False)``)."""

    num_tokens: int
    top_k: int
    num_experts: int
    hidden: int
    inter: int
    mode: str
    act_scale: str
    fused_finalize: bool
    dispatched: bool
    valid_rows: float
    block_m: int
    sort: str
    fc1_input: str
    fc2_input: str
    fc1: GemmPlan
    fc2: GemmPlan
    finalize: str
    pdl: bool
    fc2_amax_slot: bool
    fc1_amax_slot: bool
    target: Target
    scale_loads: bool = False  # a Gluon GEMM loads its weight scales by pointer (not TMA)

    @property
    def routes(self) -> int:
        return self.num_tokens * self.top_k

    @property
    def mixed_sort(self) -> bool:
        """The sort also writes the mixed schedules, each expert's rows in tiles of its own
        size (a GEMM on them: ``GemmPlan.mixed``)."""
        return self.fc1.mixed or self.fc2.mixed

    @property
    def zero_words(self) -> int:
        return self.fc1.counters + self.fc2.counters + self.fc2_amax_slot + self.fc1_amax_slot

    def summary(self) -> dict:
        """The plan as plain data (the bench's JSON rows)."""
        return {
            "valid_rows": round(self.valid_rows, 3),
            "block_m": self.block_m,
            "sort": self.sort,
            "fc1_input": self.fc1_input,
            "fc1": self.fc1.describe(),
            "fc2_input": self.fc2_input,
            "fc2": self.fc2.describe(),
            "finalize": self.finalize,
            "pdl": self.pdl,
        }


class _Rules:
    """The planner's decisions for one call shape (the expected valid rows, the device)."""

    def __init__(self, routes: int, e: int, h: int, i: int, frac: float, tgt: Target,
                 scales_tma: bool = True):  # fmt: skip
        self.routes, self.e, self.h, self.i, self.tgt = routes, e, h, i, tgt
        self.valid = routes * frac / e if e > 0 else 0.0
        self.scales_tma = scales_tma

    def scale_tma(self, k: int) -> bool:
        """TMA copies the weight scales of the GEMM of inner size ``k``: rows padded in
        memory (``scales_tma``, as ``PreparedExperts`` lays them), or contiguous rows of a
        multiple of 16 bytes."""
        return self.scales_tma or scale_tma(k)

    def split_all(self, fc1_whole_can: bool = True) -> bool:
        """Both GEMMs split K: at most SPLIT_MAX_ROUTES_PER_EXPERT routes an expert, but
        above GLUON_SPLIT_MAX_ROWS valid rows not where both GEMMs can run whole-K
        (``fc1_whole_can``: FC1's epilogue can). At 8 rows, every route valid, whole-K
        on 16-row tiles won: the gpt-oss shape at 256 tokens 786 against 858 us split,
        Mixtral-8x7B at 32 tokens 332 against 346; at 4 rows split K did (the gpt-oss
        shape at 128 tokens 697 against 741)."""
        if self.routes / self.e > hx.SPLIT_MAX_ROUTES_PER_EXPERT:
            return False
        if self.valid <= hx.GLUON_SPLIT_MAX_ROWS or not fc1_whole_can or self.dense():
            return True
        return not self.whole_can_both()

    def dense(self) -> bool:
        """Prefill sizes: the prefill kernel (Hopper, both GEMMs fit) or decoded weights."""
        if self.routes == 0:
            return False
        if self.valid > hx.DENSE_ABOVE_ROWS:
            return True
        loads = self.scale_loads_both()
        above = hx.PREFILL_ABOVE_ROWS_SCALE_LOADS if loads else hx.PREFILL_ABOVE_ROWS
        return self.valid > above and self.prefill_both()

    def prefill_both(self) -> bool:
        return (self.tgt.gluon and prefill_fits(self.i, self.h, True)
                and prefill_fits(self.h, self.i, False))  # fmt: skip

    def gluon_fits(self, k: int, t: Tile, whole: bool = False) -> bool:
        return self.tgt.gluon and gluon_decode_fits(k, t.block_m, t.block_k, whole)

    def gluon8(self, k: int, t: Tile, whole_can: bool) -> bool:
        """A GEMM of inner size ``k`` runs a Gluon kernel on 8-row tiles: split K, or for
        one segment whole-K (``whole_can``: its epilogue can). The portable kernel must
        never run 8-row tiles: its Triton dot there gives other bits."""
        t8 = replace(t, block_m=8)
        if k > SEGMENT:
            return self.gluon_fits(k, t8)
        return whole_can and self.whole(False, False, k, t8)

    def whole(self, split: bool, dense: bool, k: int, t: Tile) -> bool:
        """The GEMM (not split, not dense) runs as the whole-K Gluon kernel, where TMA
        copies its scales (with pointer-loaded scales the gpt-oss shape at 16 rows lost
        to the portable loop: 1364 against 1166 us at 512 tokens), and a GEMM of one K
        segment only on 8-row tiles (Qwen3-30B-A3B's FC2, K 768, at 256 tokens: 208
        against the portable loop's 200 us on 16-row tiles; 131 against 152 at 64
        tokens on 8)."""
        if split or dense or self.e <= 0 or self.valid > hx.WHOLE_K_MAX_ROWS:
            return False
        if not self.scale_tma(k) or (k <= SEGMENT and t.block_m > 8):
            return False
        return self.gluon_fits(k, t, whole=True)

    def splits(self, t1: Tile, t2: Tile, fc1_whole_can: bool = True) -> tuple[bool, bool]:
        """Whether each GEMM splits K: both at decode sizes, both on the Gluon split
        kernel's 8-row tiles, else a GEMM of too few expected programs."""
        if self.split_all(fc1_whole_can):
            return True, True
        if t1.block_m == 8 and t2.block_m == 8 and self.gluon_split(None):
            return True, True
        dense = self.dense()
        valid = self.valid * self.e
        if valid <= 0:
            return False, False
        touched = hx.touched_experts(valid, self.e)
        rows = valid / max(touched, 1.0)
        out = []
        for n, k, t in ((self.i, self.h, t1), (self.h, self.i, t2)):
            if self.whole(False, dense, k, t):
                out.append(False)
            else:
                programs = hx.split_programs(n, t.block_n, touched, rows, t.block_m)
                out.append(k > SEGMENT and programs < hx.SPLIT_BELOW_PROGRAMS)
        return out[0], out[1]

    def whole_can_both(self) -> bool:
        """Both GEMMs can run whole-K on 16-row tiles (their shapes, scales and rows)."""
        return all(self.whole(False, False, k, _WHOLE_TILE) for k in (self.h, self.i))

    def whole_both(self) -> bool:
        """Both GEMMs would run whole-K at 16-row tiles."""
        if self.split_all() or self.dense():
            return False
        if any(self.splits(_WHOLE_TILE, _WHOLE_TILE)):
            return False
        return self.whole_can_both()

    def gluon_split(self, fc1_whole_can: bool | None) -> bool:
        """The split GEMMs may run as the Gluon split kernel (8-row tiles): up to
        GLUON_SPLIT_MAX_ROWS, and not above WHOLE_K_FROM_ROWS where both GEMMs can run
        whole-K instead (``fc1_whole_can``: FC1's epilogue can; None: not asked)."""
        if self.e <= 0 or self.valid > hx.GLUON_SPLIT_MAX_ROWS:
            return False
        if fc1_whole_can and self.valid > hx.WHOLE_K_FROM_ROWS:
            return not self.whole_both()
        return True

    def portable_tiles(self, a_fp4: bool) -> tuple[Tile, Tile]:
        per = self.routes / self.e
        kw = dict(a_fp4=a_fp4, valid_rows=self.valid, interpret=self.tgt.interpret)
        return (hx.portable_tile(per, self.i, self.h, gated=True, **kw),
                hx.portable_tile(per, self.h, self.i, gated=False, **kw))  # fmt: skip

    def prefill_tile(self, w4a8: bool = False) -> Tile:
        """The prefill kernel's tile (its rows by the expected rows an expert, where one
        tile rows serve the call: ``heuristics.prefill_rows``)."""
        bm = hx.prefill_rows(self.valid, w4a8=w4a8, scale_loads=self.scale_loads_both())
        return replace(hx.DENSE_TILE, block_m=bm)

    def scale_loads_both(self) -> bool:
        """Some GEMM's scale rows are not TMA-copyable (the prefill kernel loads them)."""
        return not (self.scale_tma(self.h) and self.scale_tma(self.i))

    def tiles(self, a_fp4: bool, fc1_whole_can: bool, pins) -> tuple[Tile, Tile]:
        interp = self.tgt.interpret
        if pins is None and self.dense() and not interp and self.h % 64 == 0 and self.i % 64 == 0:
            if self.prefill_both():
                tile = self.prefill_tile()
                return tile, tile
            return hx.DENSE_TILE, hx.DENSE_TILE
        if pins is not None:
            return pins
        t1, t2 = self.portable_tiles(a_fp4)
        if (self.gluon_split(fc1_whole_can) and self.gluon8(self.h, t1, fc1_whole_can)
                and self.gluon8(self.i, t2, True)):  # fmt: skip
            # the split Gluon kernel's 8-row tiles: half the activation staging of 16
            return replace(t1, block_m=8), replace(t2, block_m=8)
        if any(self.whole(False, False, k, replace(t, block_m=16))
               for k, t in ((self.h, t1), (self.i, t2))):  # fmt: skip
            bm = 32 if self.valid > hx.WHOLE_K_WIDE_ROWS else 16
            return replace(t1, block_m=bm), replace(t2, block_m=bm)
        return t1, t2


def _amax_self(elements: int, reduced: bool) -> bool:
    return not reduced and elements <= hx.QUANTIZE_AMAX_SELF_MAX_ELEMENTS


def _scale_loads(r: _Rules, fc1: GemmPlan, fc2: GemmPlan) -> bool:
    """A Gluon GEMM of the plan loads its weight scales by pointer."""
    return any(g.kernel.startswith("gluon") and not r.scale_tma(k)
               for g, k in ((fc1, r.h), (fc2, r.i)))  # fmt: skip


def experts_scales_tma(experts) -> bool:
    """Whether TMA can copy the rows of both weight-scale tensors of ``experts``
    (``PreparedExperts``): ``plan_call``'s ``scales_tma``."""
    return scale_rows_tma(experts.w13_scales) and scale_rows_tma(experts.w2_scales)


@functools.lru_cache(maxsize=4096)
def plan_call(
    num_tokens: int,
    top_k: int,
    num_experts: int,
    hidden: int,
    inter: int,
    *,
    mode: str = "w4a16",
    act_scale: str = "per_token",
    fused_finalize: bool = False,
    options: Options | None = None,
    target: Target,
    dispatched: bool = False,
    amax_all_reduce: bool = False,
    scales_tma: bool = True,
) -> Plan:
    """The plan of one call of ``num_tokens`` tokens with ``top_k`` routes each over
    ``num_experts`` local experts of hidden size ``hidden`` and intermediate size
    ``inter``, on ``target`` (``device.target_for``, or ``device.H200``).

    ``dispatched``: expert parallelism's expert side: every row is one valid route
    (top_k 1) and W4A4 rows arrive quantized with per-row globals (no fused finalize);
    ``amax_all_reduce``: the per-tensor amax of FC2's input is all-reduced over the ranks
    (an amax kernel, never the quantize kernel's own); ``scales_tma``: TMA can copy both
    weight-scale tensors' rows (``PreparedExperts`` pads them so in memory; False: the
    scales are contiguous rows, TMA-copyable only where K / 16 is a multiple of 16).
    Raises ``InapplicableOverride`` when a kernel pinned in ``options.gemm`` cannot serve
    a GEMM of this call."""
    opt = options or Options()
    if mode not in KERNEL_MODES:
        raise ValueError(f"mode: expected one of {KERNEL_MODES}, got {mode!r}")
    if act_scale not in ACT_SCALES:
        raise ValueError(f"act_scale: expected one of {ACT_SCALES}, got {act_scale!r}")
    t, k, e, h, i = num_tokens, top_k, num_experts, hidden, inter
    routes = t * k
    frac = hx.UNKNOWN_VALID_FRACTION if opt.valid_fraction is None else opt.valid_fraction
    r = _Rules(routes, e, h, i, frac, target, scales_tma)
    pdl = not target.interpret and (target.pdl if opt.pdl is None else opt.pdl)
    sort = "triton" if target.sort_kernel and 0 < routes <= hx.SORT_KERNEL_MAX_ROUTES else "torch"
    if mode == "w4a8":
        return _plan_w4a8(t, k, r, fused_finalize, opt, pdl, sort, dispatched)
    w4a4 = mode == "w4a4"
    static = w4a4 and act_scale == "static"
    per_tensor = w4a4 and act_scale == "per_tensor"
    pins = (opt.fc1_tile, opt.fc2_tile) if opt.fc1_tile is not None else None

    # FC1 writes bf16 where it may run whole-K (static W4A4's FC1 writes NVFP4)
    fc1_whole_can = not static
    t1, t2 = r.tiles(w4a4, fc1_whole_can, pins)
    split1, split2 = r.splits(t1, t2, fc1_whole_can)
    dense = r.dense()
    gpdl = pdl and r.valid * e <= hx.GLUON_PDL_MAX_ROUTES
    # the prefill kernel where its shape fits, on its tiles' rows
    prefill_here = dense and target.gluon
    fc1_prefill = prefill_here and prefill_fits(i, h, True) and t1.block_m in PREFILL_BLOCKS
    fc2_prefill = prefill_here and prefill_fits(h, i, False) and t2.block_m in PREFILL_BLOCKS
    fc1_fp4 = static and not fc1_prefill

    def family(kk, t, split, prefill, whole_can, out_fp4) -> tuple[str, bool]:
        """The kernel family of a GEMM of inner size ``kk`` and whether it splits K."""
        split = split and kk > SEGMENT  # one segment: nothing to split
        if dense and prefill:
            return "gluon-prefill", False
        if dense:
            return "triton-dense", split
        if split and r.gluon_fits(kk, t):
            return "gluon-split", True
        if whole_can and not out_fp4 and r.whole(split, False, kk, t):
            return "gluon-whole", False
        return ("triton-split", True) if split else ("triton", False)

    (k1, s1), (k2, s2) = (family(h, t1, split1, fc1_prefill, fc1_whole_can, fc1_fp4),
                          family(i, t2, split2, fc2_prefill, True, False))  # fmt: skip
    if opt.gemm is not None:
        base = pins if pins is not None else r.portable_tiles(w4a4)
        k1, t1, t2 = _pin(opt.gemm, r, *base, static, pinned=pins is not None)
        # a triton-split pin splits each GEMM of more than one segment
        k2, s1, s2 = (
            k1,
            k1.endswith("-split") and h > SEGMENT,
            k1.endswith("-split") and i > SEGMENT,
        )
        if k1 == "triton-split":
            k1, k2 = ("triton-split" if s1 else "triton"), ("triton-split" if s2 else "triton")
        elif k1 == "gluon-split":  # a GEMM of one segment runs whole-K: nothing to split
            k1, k2 = (("gluon-split" if s1 else "gluon-whole"),
                      ("gluon-split" if s2 else "gluon-whole"))  # fmt: skip
        fc1_fp4 = static and k1 != "gluon-prefill"
    block_m = t1.block_m

    def gemm(kernel, split, n, kk, t, epilogue, operand, early):
        counters = 0
        nb = max_blocks(routes, e, block_m)
        if kernel == "gluon-split" and epilogue != "nvfp4":
            counters = -(-n // _GLUON_TILE_N) * nb
        elif split and kernel != "gluon-split":
            counters = -(-n // t.block_n) * nb
        decode_family = kernel in ("gluon-split", "gluon-whole")
        # each expert's rows in tiles of its own size, unless the tile rows are pinned or
        # the scales come by pointer loads (measured on one tile rows a call only)
        mixed = kernel == "gluon-prefill" and pins is None and not r.scale_loads_both()
        return GemmPlan(kernel, t, -(-kk // SEGMENT), split, epilogue, operand,
                        pdl=gpdl if decode_family else pdl and kernel != "gluon-prefill",
                        early_weights=decode_family and gpdl and early, counters=counters,
                        mixed=mixed)  # fmt: skip

    def operand(kernel: str, quantize_decodes: bool, plain: str) -> str:
        """How a GEMM's activation rows reach ``kernel`` (``GemmPlan.operand``): W4A4 rows
        for a Gluon decode kernel come decoded by their quantize kernel where it
        ``quantize_decodes``, else by a launch of their own."""
        if kernel == "gluon-prefill":
            return "gather"
        if kernel == "triton-dense":
            return "dense"
        if not w4a4:
            return plain
        if kernel in ("gluon-split", "gluon-whole"):
            return "decoded" if quantize_decodes else "decode"
        return "nvfp4"

    # FC1's input and operand
    if dispatched:
        fc1_input = "dispatched" if w4a4 else "bf16"
    elif not w4a4:
        fc1_input = "bf16"
    elif per_tensor:
        fc1_input = "per-tensor" if _amax_self(t * h, False) else "per-tensor+amax"
    else:
        fc1_input = {"per_token": "per-row", "static": "static"}[act_scale]
    op1 = operand(k1, not dispatched, "x")
    fc1 = gemm(k1, s1, i, h, t1, "nvfp4" if fc1_fp4 else "bf16", op1,
               early=w4a4 and not dispatched)  # fmt: skip

    # FC2's input and operand
    if not w4a4:
        fc2_input = "bf16"
    elif fc1_fp4:
        fc2_input = "fc1-epilogue"
    elif per_tensor:
        fc2_input = "per-tensor" if _amax_self(routes * i, amax_all_reduce) else "per-tensor+amax"
    else:
        fc2_input = {"per_token": "per-row", "static": "static"}[act_scale]
    op2 = operand(k2, not fc1_fp4, "rows")
    fused = fused_finalize and not dispatched
    fc2 = gemm(k2, s2, h, i, t2, "atomic" if fused else "bf16", op2, early=True)

    return Plan(
        num_tokens=t, top_k=k, num_experts=e, hidden=h, inter=i, mode=mode,
        act_scale=act_scale, fused_finalize=fused, dispatched=dispatched, valid_rows=r.valid,
        block_m=block_m, sort=sort, fc1_input=fc1_input, fc2_input=fc2_input, fc1=fc1, fc2=fc2,
        finalize="atomic" if fused else "deterministic", pdl=pdl,
        fc2_amax_slot=fc2_input == "per-tensor+amax",
        fc1_amax_slot=fc1_input == "per-tensor+amax", target=target,
        scale_loads=_scale_loads(r, fc1, fc2),
    )  # fmt: skip


def _plan_w4a8(
    t: int, k: int, r: _Rules, fused_finalize: bool, opt: Options, pdl: bool, sort: str,
    dispatched: bool,
) -> Plan:  # fmt: skip
    """W4A8 (numerics section 5a): each GEMM's input quantized to e4m3 rows by a launch of
    its own (FC1's by token, gathered by the GEMM, or at prefill sizes by route into
    sorted order; dispatched rows arrive quantized), both GEMMs on the portable kernel's
    FP8 main loop, or above ``W4A8_PREFILL_ABOVE_ROWS`` on the Gluon prefill kernel's FP8
    path: the same sums in the same order (``shapes.FP8_GROUP``), never split K."""
    if opt.gemm not in (None, "triton", "gluon-prefill"):
        raise InapplicableOverride(
            f"gemm={opt.gemm!r} cannot serve this call: W4A8 runs on 'triton' and 'gluon-prefill'"
        )
    e, h, i, target, valid = r.e, r.h, r.i, r.tgt, r.valid
    fits = r.prefill_both()
    pre = r.prefill_tile(w4a8=True)
    if opt.gemm == "gluon-prefill":  # refused where the prefill kernel cannot run
        pinned = opt.fc1_tile is not None
        tile = opt.fc1_tile if pinned else pre
        _, pre, _ = _pin(opt.gemm, r, tile, tile, False, pinned=pinned, w4a8=True)
    prefill = r.routes > 0 and (
        opt.gemm == "gluon-prefill"
        or (opt.gemm is None and fits and valid > hx.W4A8_PREFILL_ABOVE_ROWS)
    )
    if prefill:
        t1 = t2 = pre
    elif opt.fc1_tile is not None:
        t1, t2 = opt.fc1_tile, opt.fc2_tile
        for name, tile, kk in (("fc1_tile", t1, h), ("fc2_tile", t2, i)):
            want = hx.w4a8_block_k(kk, target.interpret)
            if tile.block_k != want:
                raise InapplicableOverride(
                    f"{name}={tile} cannot serve W4A8 with K = {kk}: its K tile is {want} "
                    "(the mode's accumulation order)"
                )
    else:
        kw = dict(interpret=target.interpret)
        t1 = hx.w4a8_tile(valid, h, gated=True, **kw)
        t2 = replace(hx.w4a8_tile(valid, i, gated=False, **kw), block_m=t1.block_m)
    fused = fused_finalize and not dispatched
    kernel = "gluon-prefill" if prefill else "triton"

    def gemm(kk: int, tile: Tile, epilogue: str, operand: str) -> GemmPlan:
        return GemmPlan(kernel, tile, -(-kk // SEGMENT), False, epilogue, operand,
                        pdl=pdl and not prefill)  # fmt: skip

    fc1 = gemm(h, t1, "bf16", "gather" if prefill else "e4m3")
    fc2 = gemm(i, t2, "atomic" if fused else "bf16", "e4m3")
    return Plan(
        num_tokens=t, top_k=k, num_experts=e, hidden=h, inter=i, mode="w4a8",
        act_scale="per_token", fused_finalize=fused, dispatched=dispatched, valid_rows=valid,
        block_m=t1.block_m, sort=sort,
        fc1_input="dispatched" if dispatched else "e4m3-gather" if prefill else "e4m3-row",
        fc2_input="e4m3-row", fc1=fc1, fc2=fc2,
        finalize="atomic" if fused else "deterministic", pdl=pdl, fc2_amax_slot=False,
        fc1_amax_slot=False, target=target, scale_loads=_scale_loads(r, fc1, fc2),
    )  # fmt: skip


def _pin(kernel: str, r: _Rules, t1: Tile, t2: Tile, static: bool, *,
         pinned: bool = False, w4a8: bool = False) -> tuple[str, Tile, Tile]:  # fmt: skip
    """Both GEMMs on ``kernel`` (``Options.gemm``) with the tiles it takes (from the
    portable tiles ``t1``, ``t2``; ``pinned``: the caller's ``Options.fc1_tile``, whose
    rows the prefill kernel keeps where it has tiles of them, else its rows by the plan's
    rule, W4A8's with ``w4a8``); raises ``InapplicableOverride`` where it cannot run."""
    tgt = r.tgt

    def refuse(why: str):
        raise InapplicableOverride(f"gemm={kernel!r} cannot serve this call: {why}")

    if kernel.startswith("gluon-") and not tgt.gluon:
        refuse(f"the Gluon kernels do not run on {tgt.name}")
    if kernel == "gluon-prefill":
        if not (prefill_fits(r.i, r.h, True) and prefill_fits(r.h, r.i, False)):
            refuse("H and I must be multiples of 64")
        keep = pinned and t1.block_m in PREFILL_BLOCKS
        bm = t1.block_m if keep else r.prefill_tile(w4a8).block_m
        tile = replace(hx.DENSE_TILE, block_m=bm)
        return kernel, tile, tile
    if kernel == "triton-dense" and not tgt.interpret:
        if r.h % 64 or r.i % 64:
            refuse("the decoded-weights tiles need H and I multiples of 64")
        return kernel, hx.DENSE_TILE, hx.DENSE_TILE
    if kernel in ("gluon-split", "gluon-whole"):
        whole = kernel == "gluon-whole"
        bm = 16 if whole else 8
        for kk in (r.h, r.i):
            if not gluon_decode_fits(kk, bm, 128, whole):
                refuse(f"K = {kk} must be a multiple of 64")
        if static and (whole or r.h <= SEGMENT):  # (one segment: FC1 would run whole-K)
            refuse("static W4A4's FC1 writes NVFP4, which the whole-K kernel does not")
        return kernel, replace(t1, block_m=bm, block_k=128), replace(t2, block_m=bm, block_k=128)
    if kernel == "triton-split" and max(r.h, r.i) <= SEGMENT:
        refuse(f"K = {r.h} and {r.i} are one 1024-element segment each: nothing to split")
    return kernel, t1, t2


def explain(plan: Plan) -> str:
    """A few lines saying which kernels a call runs and why (the regime's rows)."""
    p = plan
    rows = f"{p.block_m} rows"
    if p.mixed_sort:
        rows = "32, 64 and 128 rows (each expert's by its routes, counted on the device)"
    lines = [
        f"{p.num_tokens} tokens x top-{p.top_k} over {p.num_experts} experts (H {p.hidden}, "
        f"I {p.inter}), {p.mode}"
        + (f" {p.act_scale}" if p.mode == "w4a4" else "")
        + f", {p.finalize} finalize, on {p.target.name}",
        f"  expected valid rows an expert {p.valid_rows:.2f}; tiles of {rows}; "
        f"sort: {p.sort}; PDL {'on' if p.pdl else 'off'}",
        f"  FC1: {p.fc1_input} input -> {p.fc1.describe()}",
        f"  FC2: {p.fc2_input} input -> {p.fc2.describe()}",
    ]
    if p.scale_loads:
        lines.append("  weight scales by pointer loads: rows not 16-byte aligned in memory "
                     "(PreparedExperts aligns them: experts.align_scale_rows)")  # fmt: skip
    return "\n".join(lines)


def workspace_bytes(plan: Plan) -> int:
    """Peak bytes a call of ``plan`` holds on the device beyond its inputs and output
    (freed after the call, or held by a CUDA graph's pool), as the largest of its three
    phases: FC1 (the sort's outputs, W4A4's quantized input, the fused finalize's fp32
    accumulator, FC1's output, and FC1's temporaries: split-K partials, decoded weights and
    rows), FC2 (the same less FC1's temporaries, plus FC2's input, the route rows and its
    own temporaries) and the finalize (the route rows or accumulator and the bf16 output).
    Tile counters and amax slots (a few KB) are left out."""
    p = plan
    t, h, i, e = p.num_tokens, p.hidden, p.inter, p.num_experts
    n = t * p.top_k
    nb = max_blocks(n, e, p.block_m)
    if p.mixed_sort:  # the three schedules of each expert's tile rows
        nb += len(MIXED_ROWS) * max_blocks(n, e, MIXED_ROWS[-1]) + 1
    common = 4 * (3 * n + 2 * e + 1 + 3 * nb)  # the sort's outputs (int32)
    w4a4 = p.mode == "w4a4"
    nvfp4_row = lambda c: c // 2 + c // 16 + 4  # codes, scales, global
    fc1_fp4 = p.fc1.epilogue == "nvfp4"
    act = n * nvfp4_row(i) if fc1_fp4 else n * i * 2  # FC1's output
    b_in = 0
    if p.mode == "w4a8":  # e4m3 rows and a scale a row: FC1's by token or by route
        common += (n if p.fc1_input in ("dispatched", "e4m3-gather") else t) * (h + 4)
        b_in = n * (i + 4)
    if w4a4:
        rows = n if p.fc1_input in ("static", "dispatched") else t
        common += rows * nvfp4_row(h)
        if not fc1_fp4:
            b_in = n * nvfp4_row(i)
    if p.fused_finalize:
        common += t * h * 4
        rows_out = 0
    else:
        rows_out = n * h * 2

    def temps(g: GemmPlan, n_out: int, kk: int, rows: int) -> tuple[int, int]:
        """(held for the call, held during the GEMM) by ``g``'s own workspace."""
        call = tmp = 0
        if g.kernel == "triton-dense":
            tmp = e * (2 * n_out if g is p.fc1 else n_out) * kk * 2 + rows * kk * 2
        elif g.kernel == "gluon-prefill" and p.mode != "w4a8":
            tmp = n * kk * 2  # the rows gathered into sorted unit order (W4A8: its input)
        if g.split:
            tmp += g.segments * n * (2 * n_out if g is p.fc1 else n_out) * 4  # partials
        if g.operand == "decoded":
            call = rows * kk * 2
        elif g.operand == "decode":
            tmp += rows * kk * 2
        return call, tmp

    x_rows = n if p.fc1_input in ("static", "dispatched") else t
    c1, tmp1 = temps(p.fc1, i, h, x_rows)
    c2, tmp2 = temps(p.fc2, h, i, n)
    common += c1
    fc1 = common + act + tmp1
    fc2 = common + c2 + act + b_in + rows_out + tmp2
    fin = common + rows_out + t * h * 2  # the bf16 output
    return max(fc1, fc2, fin)
