"""Fit the prefill kernel's tile costs (``sort.MIXED_COST``: a block of 128 or of 32 rows
in 64-row blocks, by which the sort splits each expert's rows) to sweeps that pinned
64-row tiles and the other tile rows:

    python3 benchmarks/sweep.py --preset mixtral-8x7b --num-tokens 256 320 384 512 \\
        --gemm gluon-prefill@64 gluon-prefill@128 --out sweep-mixtral
    python3 benchmarks/fit_tile_cost.py --rows 128 sweep-*/sweep.json

Each point (preset, tokens, mode) holds both pins' times and the routes' tile counts of
each tile rows (one tile rows a call). A cost c picks the other tile rows where c times
their count is below the 64-row tiles' count; its loss at a point is the picked time
over the faster one, less 1. Prints, for each cost of the grid, the summed loss and the
points it misses by more than ``--miss``, then the cost with the least summed loss; the
exit status is 1 when the files hold no point.
"""

from __future__ import annotations

import argparse
import json
import sys

GRIDS = {128: (1.5, 2.0, 0.02), 32: (0.6, 1.0, 0.02)}


def points(docs: list[dict], rows: int) -> list[dict]:
    """The points of sweep.json documents with the 64-row and ``rows``-row pins timed and
    the tile counts: dicts of preset, tokens, mode, us (by rows) and tiles (by rows)."""
    pins = {"gluon-prefill@64", f"gluon-prefill@{rows}"}
    out = {}
    for doc in docs:
        for r in doc["rows"]:
            if r["gemm"] not in pins or "tiles" not in r:
                continue
            key = (doc["preset"], r["tokens"], r["mode"])
            tiles = {int(k): v for k, v in r["tiles"].items()}
            pt = out.setdefault(key, dict(preset=key[0], tokens=key[1], mode=key[2], us={},
                                          tiles=tiles))  # fmt: skip
            pt["us"][int(r["gemm"].split("@")[1])] = r["us"]
    return [p for p in out.values() if set(p["us"]) == {64, rows} and rows in p["tiles"]]


def other_cheaper(tiles64: int, other: int, cost: float) -> bool:
    """Whether ``other`` tiles of the other rows, ``cost`` 64-row tiles each, cost less
    than ``tiles64`` 64-row tiles (the sort's choice for an expert's rows)."""
    return cost * other < tiles64


def loss(pt: dict, rows: int, cost: float) -> float:
    """The time ``cost`` picks at ``pt`` over the faster pin's, less 1."""
    pick = rows if other_cheaper(pt["tiles"][64], pt["tiles"][rows], cost) else 64
    return pt["us"][pick] / min(pt["us"].values()) - 1.0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("sweeps", nargs="+", help="sweep.json files of benchmarks/sweep.py")
    ap.add_argument("--rows", type=int, choices=sorted(GRIDS), default=128,
                    help="the tile rows whose cost to fit (against 64)")  # fmt: skip
    ap.add_argument("--costs", type=float, nargs=3, metavar=("FROM", "TO", "STEP"),
                    help="the grid (default: 1.5 to 2 for 128 rows, 0.6 to 1 for 32)")  # fmt: skip
    ap.add_argument("--miss", type=float, default=0.015, help="a miss: a loss above this")
    a = ap.parse_args(argv)
    docs = []
    for path in a.sweeps:
        with open(path) as f:
            docs.append(json.load(f))
    pts = points(docs, a.rows)
    if not pts:
        print(f"no point with the 64 and {a.rows}-row prefill tiles timed and tile counts",
              file=sys.stderr)  # fmt: skip
        return 1
    lo, hi, step = a.costs or GRIDS[a.rows]
    grid = [round(lo + i * step, 6) for i in range(round((hi - lo) / step) + 1)]
    print(f"{len(pts)} points; cost, summed loss, points missed by more than {a.miss:.1%}")
    best = None
    for c in grid:
        losses = [(loss(p, a.rows, c), p) for p in pts]
        total = sum(v for v, _ in losses)
        missed = ", ".join(f"{p['preset']} {p['tokens']} {v:.1%}" for v, p in losses if v > a.miss)
        print(f"{c:6.3f} {total:7.3f}  {missed}")
        if best is None or total < best[1]:
            best = (c, total)
    print(f"least summed loss: {best[0]:.3f} ({best[1]:.3f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
