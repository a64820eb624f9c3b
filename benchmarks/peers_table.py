"""One markdown table from an ``fp4moe bench`` JSON and a peers CSV of the same call
(``../shared/peers/bench_peers.py``, the same preset, routes and token counts): fp4moe's
W4A16 time, W4A4 per-token over W4A16, the roofline fraction, each peer's time and
fp4moe's speed over it, and the planner's kernels.

    python3 benchmarks/peers_table.py OUT/bench.json OUT/tk-mxfp4.csv

``bash benchmarks/gpu.sh peers`` runs both and this script for each preset.
"""

from __future__ import annotations

import argparse
import csv
import json
import sys


def table(bench: dict, peer_rows: list[dict]) -> str:
    """The markdown table of a bench JSON (``bench``, ``fp4moe bench``'s bench.json) and the
    rows of a peers CSV (tokens, peer, us); a peer's columns where it has the token count."""
    rows = [r for r in bench["rows"] if r["finalize"] in ("unfused", "deterministic")]
    w16 = {r["tokens"]: r for r in rows if r["mode"] == "w4a16"}
    w4 = {r["tokens"]: r for r in rows if r["mode"] == "w4a4-token"}
    peers = sorted({p["peer"] for p in peer_rows})
    us = {(int(p["tokens"]), p["peer"]): float(p["us"]) for p in peer_rows}
    c = bench["ceilings"]
    head = (
        f"{bench['preset']}: copy {c['copy_bytes_per_s'] / 1e12:.2f} TB/s, bf16 "
        f"{c['bf16_matmul_flops'] / 1e12:.0f} TFLOP/s ({bench.get('device', '')})\n\n"
    )
    cols = ["tokens", "W4A16 us", "W4A4 per-token / W4A16", "roofline fraction"]
    for p in peers:
        cols += [f"{p} us", f"vs {p}"]
    cols.append("FC1 / FC2")
    lines = ["| " + " | ".join(cols) + " |", "|" + " ---: |" * (len(cols) - 1) + " --- |"]
    for t in sorted(w16):
        r = w16[t]
        ratio = f"{w4[t]['us'] / r['us']:.2f}" if t in w4 else "-"
        cells = [str(t), f"{r['us']:.1f}", ratio, f"{r['roofline_fraction']:.2f}"]
        for p in peers:
            v = us.get((t, p))
            cells += ["-", "-"] if v is None else [f"{v:.1f}", f"{v / r['us']:.2f}x"]
        fc1, fc2 = r["plan"]["fc1"], r["plan"]["fc2"]
        cells.append(fc1 if fc1 == fc2 else f"{fc1} / {fc2}")
        lines.append("| " + " | ".join(cells) + " |")
    return head + "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    ap.add_argument("bench_json", help="fp4moe bench's bench.json")
    ap.add_argument("peers_csv", help="bench_peers.py's CSV of the same call")
    a = ap.parse_args(argv)
    with open(a.bench_json) as f:
        bench = json.load(f)
    with open(a.peers_csv, newline="") as f:
        peer_rows = list(csv.DictReader(f))
    sys.stdout.write(table(bench, peer_rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
