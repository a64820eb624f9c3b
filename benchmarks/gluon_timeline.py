"""Per-program timeline of the Gluon decode GEMMs (``gluon_ws.TRACE``): where each
program's time goes, phase by phase, and how the programs fill the SMs.

Session 12's diagnostics (docs/perf-notes.md) left 85% to 90% of the GEMMs' time at 16
tokens when either the weight copies or the decode were taken out, and put the rest in
each program's chain of dependent steps. This script times that chain. One eager MoE call
(no CUDA graph: each launch allocates its stamp buffer) with ``TRACE`` on records, per
program, %clock64 at each phase boundary and %globaltimer at its start and end:

- wait: the grid wait (PDL) at the start
- sched: reading the tile schedule (the block's expert, rows)
- issue: barrier init and the first stages' TMA copies (FC2 under PDL: its grid wait too)
- stage_x: the activation rows gathered into shared memory
- first_wait: the first stage's copies still in flight after that
- main: decode and wgmma of the segment (the later stages' waits included)
- partials: the fp32 partial stores
- epilogue: the tile counter's atomic and, for the last unit, the sum and output

It prints, per GEMM, the programs (valid and empty), the kernel's span, each phase's
median and 90th percentile over the valid programs, when the programs started (waves),
and how busy the SMs' program slots were. The stamps cost about 50 instructions a
program; the results stay right.

    PYTHONPATH=src python3 benchmarks/gluon_timeline.py --tokens 1 16 64 --out timeline.json
"""

from __future__ import annotations

import argparse
import json

import torch

PHASES = (
    ("wait", "T_START", "T_WAIT"),
    ("sched", "T_WAIT", "T_SCHED"),
    ("issue", "T_SCHED", "T_ISSUE"),
    ("stage_x", "T_ISSUE", "T_X"),
    ("first_wait", "T_X", "T_W0"),
    ("main", "T_W0", "T_LOOP"),
    ("partials", "T_LOOP", "T_PART"),
    ("epilogue", "T_PART", "T_END"),
    ("total", "T_START", "T_END"),
)


def _q(v: torch.Tensor, q: float) -> float:
    return float(torch.quantile(v.double(), q)) if v.numel() else float("nan")


def summarize(trace: torch.Tensor, *, slots_per_sm: int | None = None) -> dict:
    """Summary of one launch's stamps (int64 [programs, TRACE_FIELDS], ``gluon_ws``'s
    columns; -1 where a program did not record). Cycles become microseconds by the
    valid programs' own cycles per nanosecond (%clock64 against %globaltimer, median)."""
    from fp4moe.kernels import gluon_ws as g

    t = trace.cpu()
    col = {name: getattr(g, name) for name in dir(g) if name.startswith("T_")}
    ran = t[:, col["T_START"]] >= 0
    valid = ran & (t[:, col["T_EXPERT"]] >= 0)
    empty = ran & (t[:, col["T_EXPERT"]] < 0)
    v = t[valid]
    gspan = (t[ran, col["T_GEND"]].max() - t[ran, col["T_GSTART"]].min()).item()
    g0 = t[ran, col["T_GSTART"]].min()
    dg = (v[:, col["T_GEND"]] - v[:, col["T_GSTART"]]).double()
    dc = (v[:, col["T_END"]] - v[:, col["T_START"]]).double()
    long = dg > 1000  # programs of more than 1 us: the timer's steps do not dominate
    ghz = float((dc[long] / dg[long]).median()) if bool(long.any()) else 1.98
    out: dict = {
        "programs": int(ran.sum()),
        "valid": int(valid.sum()),
        "empty": int(empty.sum()),
        "span_us": gspan / 1000.0,
        "cycles_per_ns": ghz,
        "phases_us": {},
    }
    for name, a, b in PHASES:
        if not v.shape[0]:
            break
        d = (v[:, col[b]] - v[:, col[a]]).double() / ghz / 1000.0
        out["phases_us"][name] = {"median": _q(d, 0.5), "p90": _q(d, 0.9)}
    if empty.any():
        e = t[empty]
        d = (e[:, col["T_GEND"]] - e[:, col["T_GSTART"]]).double() / 1000.0
        s = (e[:, col["T_GSTART"]] - g0).double() / 1000.0
        out["empty_us"] = {"median": _q(d, 0.5), "p90": _q(d, 0.9),
                           "first_start": _q(s, 0.0), "last_start": _q(s, 1.0)}  # fmt: skip
    if v.shape[0]:
        s = (v[:, col["T_GSTART"]] - g0).double() / 1000.0
        out["valid_start_us"] = {f"q{int(q * 100)}": _q(s, q) for q in (0.0, 0.5, 0.9, 1.0)}
        # the SMs' program slots: busy time of every program (valid and empty) over the span
        sm = t[ran, col["T_SM"]]
        busy = (t[ran, col["T_GEND"]] - t[ran, col["T_GSTART"]]).double()
        n_sm = int(sm.max().item()) + 1
        per_sm = torch.zeros(n_sm, dtype=torch.float64).index_add_(0, sm.long(), busy)
        out["sms_used"] = int((per_sm > 0).sum())
        out["mean_programs_in_flight_per_sm"] = float(per_sm.mean() / max(gspan, 1))
        if slots_per_sm:
            out["slot_occupancy"] = out["mean_programs_in_flight_per_sm"] / slots_per_sm
    return out


def _print(name: str, s: dict) -> None:
    print(f"  {name}: {s['programs']} programs ({s['valid']} valid, {s['empty']} empty), "
          f"span {s['span_us']:.1f} us, {s['cycles_per_ns']:.2f} cycles/ns, "
          f"{s.get('mean_programs_in_flight_per_sm', 0):.2f} programs in flight an SM")  # fmt: skip
    for ph, q in s["phases_us"].items():
        print(f"    {ph:10s} median {q['median']:7.2f} us   p90 {q['p90']:7.2f} us")
    if "valid_start_us" in s:
        q = s["valid_start_us"]
        print(f"    valid programs started at {q['q0']:.1f} / {q['q50']:.1f} / {q['q90']:.1f} / "
              f"{q['q100']:.1f} us (min / median / p90 / max)")  # fmt: skip
    if "empty_us" in s:
        q = s["empty_us"]
        print(f"    empty programs: {q['median']:.2f} us each (p90 {q['p90']:.2f}), started "
              f"{q['first_start']:.1f} to {q['last_start']:.1f} us")  # fmt: skip


def main() -> None:
    from fp4moe.bench import MODES, PRESETS, make_routes, random_experts
    from fp4moe.kernels import gluon_ws
    from fp4moe.kernels.launch import TritonOptions, moe_triton

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="deepseek-v3-ep8", choices=sorted(PRESETS))
    p.add_argument("--tokens", type=int, nargs="+", default=[1, 16, 64])
    p.add_argument("--mode", default="w4a16", choices=sorted(MODES))
    p.add_argument("--out", default=None)
    p.add_argument("--x-ring", action="store_true", help="gluon_ws.X_RING on (FC1's rows a "
                   "ring stage at a time)")  # fmt: skip
    a = p.parse_args()
    gluon_ws.X_RING = a.x_ring
    pr = PRESETS[a.preset]
    torch.manual_seed(0)
    ex = random_experts(pr)
    m, sc = MODES[a.mode]
    opt = TritonOptions(valid_fraction=pr.local_experts / pr.experts)
    rows = []
    for t in a.tokens:
        x = torch.randn(t, pr.hidden, device="cuda").to(torch.bfloat16)
        ids, w = make_routes(pr, t, t, "cuda")
        want = moe_triton(x, ids, w, ex, mode=m, act_scale=sc, options=opt)  # compiles
        gluon_ws.TRACE = True
        try:
            for _ in range(3):  # the last call's launches are summarized
                gluon_ws.TRACES.clear()
                got = moe_triton(x, ids, w, ex, mode=m, act_scale=sc, options=opt)
            torch.cuda.synchronize()
        finally:
            gluon_ws.TRACE = False
        same = bool(torch.equal(want, got))
        print(f"{a.preset} T={t} {a.mode}: {len(gluon_ws.TRACES)} Gluon launches, "
              f"results the same as untraced: {same}", flush=True)  # fmt: skip
        for facts, tr in gluon_ws.TRACES:
            name = "fc1" if facts["gated"] else "fc2"
            s = summarize(tr)
            _print(name, s)
            rows.append(dict(tokens=t, mode=a.mode, gemm=name, same=same, x_ring=a.x_ring,
                             **facts, **s))  # fmt: skip
    if a.out:
        with open(a.out, "w") as f:
            json.dump(rows, f, indent=1, default=str)


if __name__ == "__main__":
    main()
