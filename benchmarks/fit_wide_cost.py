"""Fit the prefill kernel's WIDE_TILE_COST (a 128-row tile's cost in 64-row tiles,
``backend/heuristics.py``) to sweeps that pinned both tile rows:

    python3 benchmarks/sweep.py --preset mixtral-8x7b --num-tokens 256 320 384 512 \\
        --gemm gluon-prefill@64 gluon-prefill@128 --out sweep-mixtral
    python3 benchmarks/fit_wide_cost.py sweep-*/sweep.json

Each point (preset, tokens, mode) holds both pins' times and the routes' tiles of 64 and
128 rows. A cost c picks 128-row tiles where c times their count is below the 64-row
tiles' count; its loss at a point is the picked time over the faster one, less 1. Prints,
for each cost of the grid, the summed loss and the points it misses by more than
``--miss``, then the cost with the least summed loss; the exit status is 1 when the files
hold no point.
"""

from __future__ import annotations

import argparse
import json
import sys

from fp4moe.backend.heuristics import wide_tiles_cheaper

PINS = ("gluon-prefill@64", "gluon-prefill@128")


def points(docs: list[dict]) -> list[dict]:
    """The points of sweep.json documents with both pins timed and the tile counts:
    dicts of preset, tokens, mode, us (by rows) and tiles (by rows)."""
    out = {}
    for doc in docs:
        for r in doc["rows"]:
            if r["gemm"] not in PINS or "tiles" not in r:
                continue
            key = (doc["preset"], r["tokens"], r["mode"])
            tiles = {int(k): v for k, v in r["tiles"].items()}
            pt = out.setdefault(key, dict(preset=key[0], tokens=key[1], mode=key[2], us={},
                                          tiles=tiles))  # fmt: skip
            pt["us"][int(r["gemm"].split("@")[1])] = r["us"]
    return [p for p in out.values() if set(p["us"]) == {64, 128}]


def loss(pt: dict, cost: float) -> float:
    """The time ``cost`` picks at ``pt`` over the faster pin's, less 1."""
    wide = wide_tiles_cheaper(pt["tiles"][64], pt["tiles"][128], cost)
    return pt["us"][128 if wide else 64] / min(pt["us"].values()) - 1.0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("sweeps", nargs="+", help="sweep.json files of benchmarks/sweep.py")
    ap.add_argument("--costs", type=float, nargs=3, default=[1.5, 2.0, 0.02],
                    metavar=("FROM", "TO", "STEP"))  # fmt: skip
    ap.add_argument("--miss", type=float, default=0.015, help="a miss: a loss above this")
    a = ap.parse_args(argv)
    docs = []
    for path in a.sweeps:
        with open(path) as f:
            docs.append(json.load(f))
    pts = points(docs)
    if not pts:
        print("no point with both prefill tile rows timed and tile counts", file=sys.stderr)
        return 1
    lo, hi, step = a.costs
    grid = [round(lo + i * step, 6) for i in range(round((hi - lo) / step) + 1)]
    print(f"{len(pts)} points; cost, summed loss, points missed by more than {a.miss:.1%}")
    best = None
    for c in grid:
        losses = [(loss(p, c), p) for p in pts]
        total = sum(v for v, _ in losses)
        missed = ", ".join(f"{p['preset']} {p['tokens']} {v:.1%}" for v, p in losses if v > a.miss)
        print(f"{c:6.3f} {total:7.3f}  {missed}")
        if best is None or total < best[1]:
            best = (c, total)
    print(f"least summed loss: {best[0]:.3f} ({best[1]:.3f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
