"""The GPU's SM clock, power and clock-event reasons while one workload runs in a loop.

    python3 benchmarks/clock_probe.py --tokens 1 16 --seconds 2 --out clocks.json

For each workload (a whole ``fp4moe`` call of a preset at ``--tokens`` tokens, W4A16 with
deterministic finalize, replayed as a CUDA graph; a device-to-device copy; a bf16 matmul),
``nvidia-smi`` samples the clocks every ``--every-ms`` while the workload replays for
``--seconds``. It answers whether the decode GEMMs run below the boost clock because the
chip is at its power limit while the copies and the decode run together (session 14's
open question), against the same card's clocks on pure copies and pure matmuls.
Needs a CUDA GPU and ``nvidia-smi``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import time

import torch

import fp4moe
from fp4moe.bench import PRESETS, GraphTimer, make_routes

FIELDS = ("clocks.sm", "clocks.mem", "power.draw", "temperature.gpu", "clocks_event_reasons.active")


def _sampler(every_ms: int) -> subprocess.Popen:
    q = ",".join(FIELDS)
    return subprocess.Popen(
        ["nvidia-smi", f"--query-gpu={q}", "--format=csv,noheader,nounits", f"-lms={every_ms}"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def probe(name: str, fn, seconds: float, every_ms: int) -> dict:
    """Replay ``fn``'s graph for ``seconds`` under ``nvidia-smi`` sampling."""
    g = GraphTimer(fn, graph=True, warmup=1)
    for _ in range(20):
        g.replay()
    torch.cuda.synchronize()
    sm = _sampler(every_ms)
    time.sleep(0.3)  # nvidia-smi's start
    t0 = time.perf_counter()
    n = 0
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    while time.perf_counter() - t0 < seconds:
        for _ in range(50):
            g.replay()
        n += 50
        torch.cuda.synchronize()
    b.record()
    b.synchronize()
    us = a.elapsed_time(b) * 1000 / n
    sm.terminate()
    out, _ = sm.communicate(timeout=10)
    rows = []
    for line in out.strip().splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) != len(FIELDS):
            continue
        try:
            rows.append(
                dict(
                    sm_mhz=float(parts[0]),
                    mem_mhz=float(parts[1]),
                    power_w=float(parts[2]),
                    temp_c=float(parts[3]),
                    reasons=parts[4],
                )
            )
        except ValueError:
            continue
    busy = rows[2:-2] if len(rows) > 6 else rows  # the loop's middle
    res = dict(workload=name, us_per_replay=us, replays=n, samples=len(rows))
    if busy:
        res.update(
            sm_mhz_median=statistics.median(r["sm_mhz"] for r in busy),
            sm_mhz_min=min(r["sm_mhz"] for r in busy),
            power_w_median=statistics.median(r["power_w"] for r in busy),
            power_w_max=max(r["power_w"] for r in busy),
            temp_c_max=max(r["temp_c"] for r in busy),
            reasons=sorted({r["reasons"] for r in busy}),
        )
    print(json.dumps(res), flush=True)
    res["rows"] = rows
    return res


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="deepseek-v3-ep8", choices=sorted(PRESETS))
    p.add_argument("--tokens", type=int, nargs="+", default=[1, 16])
    p.add_argument("--seconds", type=float, default=2.0)
    p.add_argument("--every-ms", type=int, default=20)
    p.add_argument("--out", default=None)
    a = p.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("clock_probe: needs a CUDA GPU")
    dev = "cuda"
    pr = PRESETS[a.preset]
    torch.manual_seed(0)
    e, h, inter = pr.local_experts, pr.hidden, pr.inter
    w13 = torch.randn(e, 2 * inter, h, device=dev, dtype=torch.bfloat16) * 0.02
    w2 = torch.randn(e, h, inter, device=dev, dtype=torch.bfloat16) * 0.02
    ex = fp4moe.prepare_experts(w13, w2)
    del w13, w2
    res = []
    src = torch.empty(1 << 28, dtype=torch.uint8, device=dev)
    dst = torch.empty_like(src)
    res.append(probe("copy 256 MiB", lambda: dst.copy_(src), a.seconds, a.every_ms))
    m1 = torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16)
    m2 = torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16)
    res.append(probe("bf16 matmul 8192^3", lambda: m1 @ m2, a.seconds, a.every_ms))
    for t in a.tokens:
        ids, wts = make_routes(pr, t, t, dev)
        x = torch.randn(t, h, device=dev).to(torch.bfloat16)

        def call(x=x, ids=ids, wts=wts):
            return fp4moe.moe(x, ids, wts, ex, mode="w4a16", backend="triton")

        res.append(probe(f"w4a16 {a.preset} {t} tokens", call, a.seconds, a.every_ms))
    if a.out:
        with open(a.out, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
