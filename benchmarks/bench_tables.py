"""Markdown tables of `fp4moe bench` JSON files, as docs/benchmarks.md shows them.

    python3 benchmarks/bench_tables.py docs/bench/deepseek-v3-ep8.json [--short]

One row a token count, deterministic finalize in the time columns; the last column is
deterministic over fused time for W4A16, W4A4 per-token and W4A4 per-tensor. ``--short``
drops the route, floor and baseline-time columns (the other presets' tables).
"""

from __future__ import annotations

import argparse
import json

MODES = ("w4a16", "w4a4-token", "w4a4-tensor")


def table(doc: dict, short: bool = False) -> str:
    rows = {(r["tokens"], r["mode"], r["finalize"]): r for r in doc["rows"]}
    tokens = sorted({r["tokens"] for r in doc["rows"]})
    if short:
        head = ["tokens", "experts touched", "W4A16 us", "floor fraction", "vs bf16 grouped_mm",
                "W4A4 per-token us", "W4A4 per-tensor us",
                "deterministic / fused (W4A16, token, tensor)"]  # fmt: skip
    else:
        head = ["tokens", "local routes", "experts touched", "byte floor us", "W4A16 us",
                "floor fraction", "W4A4 per-token us", "W4A4 per-tensor us",
                "bf16 grouped_mm us", "W4A16 vs bf16", "naive NVFP4 us",
                "deterministic / fused (W4A16, token, tensor)"]  # fmt: skip
    out = [
        "| " + " | ".join(head) + " |",
        "| " + " | ".join(["---:"] * (len(head) - 1)) + " | --- |",
    ]
    for t in tokens:
        det = {m: rows.get((t, m, "unfused")) for m in MODES}
        fus = {m: rows.get((t, m, "fused")) for m in MODES}
        a = det["w4a16"]
        if a is None:
            continue

        def us(m):
            return f"{det[m]['us']:.1f}" if det[m] else "-"

        ratio = ", ".join(
            f"{det[m]['us'] / fus[m]['us']:.2f}" if det[m] and fus[m] else "-" for m in MODES
        )
        vs = f"{a['vs_bf16']:.2f}x" if a.get("vs_bf16") else "-"
        if short:
            cells = [t, a["experts_touched"], us("w4a16"), f"{a['floor_fraction']:.2f}", vs,
                     us("w4a4-token"), us("w4a4-tensor"), ratio]  # fmt: skip
        else:
            floor = a["us"] * a["floor_fraction"]
            bf16 = f"{a['bf16_us']:.1f}" if a.get("bf16_us") else "-"
            naive = f"{a['naive_nvfp4_us']:.0f}" if a.get("naive_nvfp4_us") else "-"
            cells = [t, a["local_routes"], a["experts_touched"], f"{floor:.1f}", us("w4a16"),
                     f"{a['floor_fraction']:.2f}", us("w4a4-token"), us("w4a4-tensor"), bf16,
                     vs, naive, ratio]  # fmt: skip
        out.append("| " + " | ".join(str(c) for c in cells) + " |")
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("json", nargs="+")
    ap.add_argument("--short", action="store_true")
    a = ap.parse_args()
    for path in a.json:
        with open(path) as f:
            doc = json.load(f)
        c = doc["ceilings"]
        print(f"{path}: {doc['preset']}, commit {doc.get('commit')}, copy "
              f"{c['copy_bytes_per_s'] / 1e12:.2f} TB/s, bf16 "
              f"{c['bf16_matmul_flops'] / 1e12:.0f} TFLOP/s\n")  # fmt: skip
        print(table(doc, a.short))
        print()


if __name__ == "__main__":
    main()
