"""Where a kernel's warps wait, instruction by instruction, from ncu's warp-state samples.

    ncu --section SourceCounters --warp-sampling-interval 0 -k regex:tma_split -c 2 \\
        -o rep python3 benchmarks/profile_call.py --tokens 16
    ncu -i rep.ncu-rep --page source --csv --print-source sass > sass.csv
    python3 benchmarks/ncu_source_report.py sass.csv [--window 200] [--json out.json]

(``gpu_session.sh s16b`` runs the first two.) The CSV has one row a SASS instruction of
each profiled kernel: its warp-state samples (all, and by stall reason) and how many
times warps executed it. For each kernel this prints the samples by stall reason and by
opcode, the instructions with the most samples, and the samples of consecutive windows
of the SASS with their main stall reasons and landmarks (TMA waits, wgmma, barriers,
global loads: the opcodes of ``LANDMARKS``). Samples are counted per warp, so they say
where warps spend their time, not which instruction limits the kernel. ``--from`` leaves
out the first instructions: by default the early exit that empty programs take, which
more warps execute than the rest (their samples are a warp's time in a slot, not time
on the critical path).
"""

from __future__ import annotations

import argparse
import collections
import csv
import gzip
import json
from typing import Any

SAMPLES = "Warp Stall Sampling (All Samples)"
EXECUTED = "Instructions Executed"
LANDMARKS = ("HGMMA", "WARPGROUP", "SYNCS", "BAR", "UTMALDG", "LDG", "STS", "ATOMG", "EXIT")


def _num(v: str) -> float:
    try:
        return float(v)
    except ValueError:
        return 0.0


def load(path: str) -> list[dict[str, Any]]:
    """The kernels of a source-page CSV (gzip if it ends in .gz): [{"name", "rows":
    [{column: value}]}]."""
    kernels: list[dict[str, Any]] = []
    header: list[str] | None = None
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt", newline="") as f:
        for row in csv.reader(f):
            if not row:
                continue
            if row[0] == "Kernel Name":
                kernels.append({"name": row[1] if len(row) > 1 else "?", "rows": []})
                header = None
            elif row[0] == "Address":
                header = row
            elif header is not None and kernels and len(row) >= len(header) - 1:
                kernels[-1]["rows"].append(dict(zip(header, row)))
    return kernels


def opcode(source: str) -> str:
    """The opcode of a SASS line without predicate and modifiers ("@!P0 BRA x" -> BRA)."""
    parts = source.split()
    if parts and parts[0].startswith("@"):
        parts = parts[1:]
    return parts[0].split(".")[0] if parts else "?"


def reasons(rows: list[dict[str, str]]) -> list[str]:
    """The stall-reason columns (all samples, not the not-issued ones)."""
    return [c for c in rows[0] if c.startswith("stall_") and "Not Issued" not in c] if rows else []


def exit_prefix(rows: list[dict[str, str]]) -> int:
    """The leading instructions that more warps execute than the kernel's most common
    count: the path of programs that exit at once (empty row blocks)."""
    counts = collections.Counter(_num(r[EXECUTED]) for r in rows if _num(r[EXECUTED]) > 0)
    if not counts:
        return 0
    common = counts.most_common(1)[0][0]
    i = 0
    while i < len(rows) and _num(rows[i][EXECUTED]) > common:
        i += 1
    return i if i < len(rows) else 0


def summarize(
    kernel: dict[str, Any], window: int = 200, start: int | None = None, top: int = 20
) -> dict:
    """Samples of one kernel by reason, opcode, instruction and window, from instruction
    ``start`` on (None: after ``exit_prefix``)."""
    if start is None:
        start = exit_prefix(kernel["rows"])
    skipped = sum(_num(r[SAMPLES]) for r in kernel["rows"][:start])
    rows = kernel["rows"][start:]
    cols = reasons(rows)
    total = sum(_num(r[SAMPLES]) for r in rows) or 1.0
    by_reason = collections.Counter({c[6:]: sum(_num(r[c]) for r in rows) for c in cols})
    by_op: collections.Counter = collections.Counter()
    exec_op: collections.Counter = collections.Counter()
    for r in rows:
        by_op[opcode(r["Source"])] += _num(r[SAMPLES])
        exec_op[opcode(r["Source"])] += _num(r[EXECUTED])
    executed = sum(exec_op.values()) or 1.0

    def main_reasons(rs: list[dict[str, str]], n: int) -> dict[str, float]:
        c = collections.Counter({k[6:]: sum(_num(r[k]) for r in rs) for k in cols})
        s = sum(c.values()) or 1.0
        return {k: round(100 * v / s, 1) for k, v in c.most_common(n) if v}

    windows = []
    for a in range(0, len(rows), window):
        rs = rows[a : a + window]
        marks = collections.Counter(
            opcode(r["Source"]) for r in rs if opcode(r["Source"]) in LANDMARKS
        )
        windows.append({
            "first": start + a, "end": start + a + len(rs),
            "samples_pct": round(100 * sum(_num(r[SAMPLES]) for r in rs) / total, 2),
            "warp_instructions": sum(_num(r[EXECUTED]) for r in rs),
            "reasons_pct": main_reasons(rs, 4), "landmarks": dict(marks),
        })  # fmt: skip
    order = sorted(range(len(rows)), key=lambda i: -_num(rows[i][SAMPLES]))[:top]
    hot = [
        {
            "index": start + i,
            "source": rows[i]["Source"].strip(),
            "samples_pct": round(100 * _num(rows[i][SAMPLES]) / total, 2),
            "executed": _num(rows[i][EXECUTED]),
            "reasons_pct": main_reasons([rows[i]], 2),
        }
        for i in sorted(order)
    ]
    return {
        "name": kernel["name"], "first": start, "instructions": len(rows), "samples": total,
        "samples_before_first": skipped,
        "warp_instructions": executed,
        "reasons_pct": {k: round(100 * v / total, 1) for k, v in by_reason.most_common() if v},
        "opcodes": [
            {"opcode": o, "samples_pct": round(100 * v / total, 1),
             "executed_pct": round(100 * exec_op[o] / executed, 1)}
            for o, v in by_op.most_common(15)
        ],
        "hot": hot, "windows": windows,
    }  # fmt: skip


def print_summary(s: dict) -> None:
    print(f"== {s['name']}: instructions {s['first']} on ({s['instructions']}): "
          f"{s['samples']:.0f} samples ({s['samples_before_first']:.0f} before), "
          f"{s['warp_instructions']:.0f} warp instructions executed")  # fmt: skip
    print("   by reason: " + ", ".join(f"{k} {v}%" for k, v in s["reasons_pct"].items()))
    print("   by opcode (samples %, executed %): " + ", ".join(
        f"{o['opcode']} {o['samples_pct']}/{o['executed_pct']}" for o in s["opcodes"]))  # fmt: skip
    print("   windows:")
    for w in s["windows"]:
        rs = ", ".join(f"{k} {v}%" for k, v in w["reasons_pct"].items())
        print(f"     [{w['first']:5d}, {w['end']:5d}) {w['samples_pct']:5.1f}% of samples "
              f"| {rs} | {w['landmarks']}")  # fmt: skip
    print("   hottest instructions:")
    for h in s["hot"]:
        rs = ", ".join(f"{k} {v}%" for k, v in h["reasons_pct"].items())
        print(f"     #{h['index']:5d} {h['samples_pct']:5.1f}% x{h['executed']:.0f} "
              f"{h['source'][:64]:64s} {rs}")  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("csv", help="ncu -i REP --page source --csv --print-source sass output")
    ap.add_argument("--window", type=int, default=200, help="instructions a window")
    ap.add_argument("--from", dest="start", default="auto",
                    help="leave out the instructions before this index (auto: the early "
                    "exit that more warps run than the rest; 0: none)")  # fmt: skip
    ap.add_argument("--top", type=int, default=20, help="hottest instructions listed")
    ap.add_argument("--json", help="write the summaries here too")
    a = ap.parse_args(argv)
    if a.window < 1:
        ap.error("--window: must be at least 1")
    if a.start != "auto" and not a.start.isdigit():
        ap.error(f"--from: expected auto or an instruction index, got {a.start!r}")
    start = None if a.start == "auto" else int(a.start)
    kernels = load(a.csv)
    if not kernels:
        ap.error(f"csv: no 'Kernel Name' section in {a.csv}")
    out = [summarize(k, a.window, start, a.top) for k in kernels]
    for s in out:
        print_summary(s)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
