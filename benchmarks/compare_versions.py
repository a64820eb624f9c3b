"""Two versions of fp4moe side by side on one GPU: the outputs bit for bit and the speed.

The base version (a git revision, or a folder holding it as the package ``fp4moe_base``)
is imported beside the working tree's ``fp4moe`` in the same processes, so both see the
same experts, tokens and routes, and their calls are timed interleaved in the same rounds
(CUDA-graph replays, as ``fp4moe bench`` times them; with ``--cold-l2`` each version's
calls cycle through copies of its experts, so that no call finds its weights in L2, as a
model's layers at decode sizes do not):

    python3 benchmarks/compare_versions.py --base 7e882ce --out cmp
    python3 benchmarks/compare_versions.py --base-src .base --presets qwen3-30b-a3b \\
        --num-tokens 1 16 --no-time

Bits: every mode and both finalizes at each token count; the deterministic finalize must
be bitwise equal; the fused (atomic) one may differ in the last bit from run to run, so
where it differs the base is also run against itself. The bit checks of the presets and
modes run in parallel processes (compiling is what takes the time); the timing runs after
them in one process at a time. Output: a table on stdout (with each token count's valid
routes: a row without any times the call's fixed cost alone) and ``compare.json`` in --out.
Exit code 1 when a deterministic output differs or a median moves more than --max-slower.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
from fp4moe.presets import MODES  # noqa: E402 (the mode names of fp4moe bench)


def extract_base(rev: str, dest: Path) -> Path:
    """``git archive`` of ``rev``'s src/fp4moe into ``dest``/fp4moe_base, its absolute
    imports of fp4moe renamed; returns ``dest``."""
    dest.mkdir(parents=True, exist_ok=True)
    tar = subprocess.run(["git", "archive", rev, "src/fp4moe"], cwd=ROOT, check=True,
                         capture_output=True).stdout  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run(["tar", "-x", "-C", tmp], input=tar, check=True)
        pkg = dest / "fp4moe_base"
        if pkg.exists():
            subprocess.run(["rm", "-rf", str(pkg)], check=True)
        Path(tmp, "src", "fp4moe").rename(pkg)
    for path in pkg.rglob("*.py"):
        text = path.read_text()
        text = re.sub(r"\bfrom fp4moe([. ])", r"from fp4moe_base\1", text)
        text = re.sub(r"\bimport fp4moe\b", "import fp4moe_base as fp4moe", text)
        path.write_text(text)
    return dest


# ----------------------------------------------------------------------------- worker


def _versions(base_src: str):
    sys.path.insert(0, base_src)  # (this tree's src is on the path since the import)
    import fp4moe_base

    import fp4moe

    return fp4moe, fp4moe_base


def _options(pkg, frac: float):
    if hasattr(pkg, "Options"):
        return pkg.Options(valid_fraction=frac)
    from importlib import import_module

    launch = import_module(pkg.__name__ + ".kernels.launch")
    return launch.TritonOptions(valid_fraction=frac)


def _setup(preset: str, base_src: str):
    import torch

    new, base = _versions(base_src)
    from fp4moe.bench import make_routes, random_experts
    from fp4moe.presets import PRESETS

    p = PRESETS[preset]
    torch.manual_seed(0)
    ex_new = random_experts(p)
    ex_base = base.PreparedExperts.from_linear(ex_new.to_linear())
    frac = p.local_experts / p.experts
    return new, base, p, ex_new, ex_base, _options(new, frac), _options(base, frac), make_routes


def worker_bits(preset: str, mode: str, tokens: list[int], base_src: str) -> list[dict]:
    import torch

    new, base, p, ex_new, ex_base, o_new, o_base, make_routes = _setup(preset, base_src)
    m, sc = MODES[mode]
    rows = []
    for t in tokens:
        x = torch.randn(t, p.hidden, device="cuda").to(torch.bfloat16)
        ids, w = make_routes(p, t, 1000 + t, "cuda")
        for fused in (False, True):
            kw = dict(mode=m, act_scale=sc, fused_finalize=fused, backend="triton")
            a = new.moe(x, ids, w, ex_new, options=o_new, **kw)
            b = base.moe(x, ids, w, ex_base, options=o_base, **kw)
            diff = a.view(torch.int16) != b.view(torch.int16)
            same = not bool(diff.any())
            row = dict(preset=preset, tokens=t, mode=mode, fused=fused, bitwise=same,
                       differing=int(diff.sum()))  # fmt: skip
            if not same:
                d = (a.float() - b.float()).abs()
                row["max_abs_diff"] = float(d.max())
                b2 = base.moe(x, ids, w, ex_base, options=o_base, **kw)
                self_diff = b.view(torch.int16) != b2.view(torch.int16)
                row["base_self_differing"] = int(self_diff.sum())
            rows.append(row)
    return rows


def worker_time(preset: str, modes: list[str], tokens: list[int], base_src: str, iters: int,
                rounds: int, cold: bool = False) -> list[dict]:  # fmt: skip
    import torch

    new, base, p, ex_new, ex_base, o_new, o_base, make_routes = _setup(preset, base_src)
    from fp4moe.bench import cold_copies, time_interleaved

    # cold: each version's calls cycle through copies of its experts (fp4moe bench --cold-l2)
    c_new = cold_copies(ex_new) if cold else [ex_new]
    c_base = cold_copies(ex_base) if cold else [ex_base]

    rows = []
    for t in tokens:
        x = torch.randn(t, p.hidden, device="cuda").to(torch.bfloat16)
        ids, w = make_routes(p, t, 1000 + t, "cuda")
        routes = int((ids >= 0).sum())  # valid (local) routes; with none a call is its fixed cost
        calls = {}
        for mode in modes:
            m, sc = MODES[mode]
            for fused in (False, True):
                kw = dict(mode=m, act_scale=sc, fused_finalize=fused, backend="triton")

                i_new, i_base = iter(range(1 << 30)), iter(range(1 << 30))

                def call_new(kw=kw, it=i_new):
                    ex = c_new[next(it) % len(c_new)]
                    return new.moe(x, ids, w, ex, options=o_new, **kw)

                def call_base(kw=kw, it=i_base):
                    ex = c_base[next(it) % len(c_base)]
                    return base.moe(x, ids, w, ex, options=o_base, **kw)

                calls["new", mode, fused] = call_new
                calls["base", mode, fused] = call_base
        us = time_interleaved(calls, graph=True, warmup=3, iters=iters, rounds=rounds,
                              reps=len(c_new))  # fmt: skip
        for mode in modes:
            for fused in (False, True):
                a, b = us["new", mode, fused], us["base", mode, fused]
                rows.append(dict(preset=preset, tokens=t, routes=routes, mode=mode,
                                 fused=fused, new_us=a, base_us=b, ratio=a / b))  # fmt: skip
    return rows


# ----------------------------------------------------------------------------- driver


def _run_worker(args: list[str]) -> list[dict]:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, __file__, "--worker", *args], capture_output=True,
                         text=True, env=env)  # fmt: skip
    if out.returncode:
        raise RuntimeError(f"worker {args[:4]} failed:\n{out.stderr[-4000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    src = ap.add_mutually_exclusive_group()
    src.add_argument("--base", help="git revision of the base version")
    src.add_argument("--base-src", help="folder holding the base as the package fp4moe_base")
    ap.add_argument("--presets", nargs="+",
                    default=["deepseek-v3-ep8", "qwen3-30b-a3b", "mixtral-8x7b"])  # fmt: skip
    ap.add_argument("--num-tokens", type=int, nargs="+", default=[1, 16, 256, 1024, 8192])
    ap.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES))
    ap.add_argument("--time-modes", nargs="+", default=["w4a16", "w4a4-token", "w4a4-tensor"],
                    choices=list(MODES), help="modes timed (both finalizes)")  # fmt: skip
    ap.add_argument("--no-time", action="store_true", help="bits only")
    ap.add_argument("--no-bits", action="store_true", help="timing only")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--cold-l2", action="store_true",
                    help="time calls that find no weights in L2, as fp4moe bench --cold-l2 "
                         "(decode sizes: what a model's layers see)")  # fmt: skip
    ap.add_argument("--jobs", type=int, default=3,
                    help="bit-check processes at once (one may hold about 18 GB of GPU "
                         "memory: six ran an 80 GB H100 out of memory)")  # fmt: skip
    ap.add_argument("--max-slower", type=float, default=0.03,
                    help="the largest slowdown of a median that passes (default 3%%)")  # fmt: skip
    ap.add_argument("--out", default="compare-out")
    ap.add_argument("--worker", nargs="+", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.worker:
        kind, preset, base_src, *rest = a.worker
        tokens = [int(t) for t in rest[rest.index("tokens") + 1 :]]
        if kind == "bits":
            rows = worker_bits(preset, rest[0], tokens, base_src)
        else:
            modes = rest[: rest.index("tokens")][3:]
            rows = worker_time(preset, modes, tokens, base_src, int(rest[0]), int(rest[1]),
                               rest[2] == "cold")  # fmt: skip
        print(json.dumps(rows))
        return 0
    if a.base_src:
        base_src = str(Path(a.base_src).resolve())
    elif a.base:
        base_src = str(extract_base(a.base, Path(tempfile.mkdtemp(prefix="fp4moe-base-"))))
    else:
        ap.error("give --base REV or --base-src DIR")
    toks = ["tokens", *map(str, a.num_tokens)]
    doc = {"base": a.base or a.base_src, "bits": [], "time": []}
    if not a.no_bits:
        # presets interleaved, so that the large ones' experts are not all in memory at once
        jobs = [["bits", p, base_src, m, *toks] for m in a.modes for p in a.presets]
        with ThreadPoolExecutor(a.jobs) as pool:
            for rows in pool.map(_run_worker, jobs):
                doc["bits"] += rows
    if not a.no_time:
        for p in a.presets:
            args = ["time", p, base_src, str(a.iters), str(a.rounds),
                    "cold" if a.cold_l2 else "warm", *a.time_modes, *toks]  # fmt: skip
            doc["time"] += _run_worker(args)
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "compare.json"), "w") as f:
        json.dump(doc, f, indent=1)
    bad_bits = [r for r in doc["bits"] if not r["bitwise"] and not r["fused"]]
    fused_diff = [r for r in doc["bits"] if not r["bitwise"] and r["fused"]]
    slow = [r for r in doc["time"] if r["ratio"] > 1 + a.max_slower]
    print(f"bits: {len(doc['bits'])} outputs compared; deterministic differing: {len(bad_bits)}; "
          f"fused differing: {len(fused_diff)} (the base against itself: "
          f"{sum(r.get('base_self_differing', 0) > 0 for r in fused_diff)} of them)")  # fmt: skip
    for r in bad_bits + fused_diff:
        print("  ", r)
    if doc["time"]:
        print(f"{'preset':18s} {'tokens':>6s} {'routes':>6s} {'mode':12s} {'finalize':8s} "
              f"{'base us':>9s} {'new us':>9s} {'new/base':>8s}")  # fmt: skip
        for r in doc["time"]:
            print(f"{r['preset']:18s} {r['tokens']:6d} {r['routes']:6d} {r['mode']:12s} "
                  f"{'fused' if r['fused'] else 'determ':8s} {r['base_us']:9.1f} "
                  f"{r['new_us']:9.1f} {r['ratio']:8.3f}")  # fmt: skip
        print(f"medians slower than {a.max_slower:.0%}: {len(slow)}")
    return 1 if bad_bits or slow else 0


if __name__ == "__main__":
    sys.exit(main())
