"""The ``fp4moe`` command line: demo, prepare, inspect, bench.

Exit codes: 0 success, 1 cannot run here (no GPU, not implemented yet), 2 bad usage or input.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence

import torch

__all__ = ["build_parser", "main"]


def _default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def _fail(command: str, message: str, code: int = 2) -> int:
    print(f"fp4moe {command}: error: {message}", file=sys.stderr)
    return code


def _check_device(command: str, device: str) -> int:
    try:
        dev = torch.device(device)
    except RuntimeError as exc:
        return _fail(command, f"--device: {exc}")
    if dev.type == "cuda" and not torch.cuda.is_available():
        return _fail(command, "--device cuda: no CUDA device is available here")
    return 0


# ----------------------------------------------------------------------------- demo


def _cmd_demo(args: argparse.Namespace, extra: list[str]) -> int:
    from .demo import DemoConfig, render_demo, run_demo

    if rc := _check_device("demo", args.device):
        return rc
    try:
        cfg = DemoConfig(
            hidden=args.hidden,
            inter=args.inter,
            experts=args.experts,
            top_k=args.top_k,
            tokens=args.tokens,
            calib_tokens=args.calib_tokens,
            seed=args.seed,
            repeats=args.repeats,
            device=args.device,
            backend=args.backend,
        )
    except ValueError as exc:
        return _fail("demo", str(exc))
    res = run_demo(cfg)
    print(render_demo(res))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res.to_json(), f, indent=2)
        print(f"wrote {args.json}")
    return 0


# ----------------------------------------------------------------------------- prepare


def _cmd_prepare(args: argparse.Namespace, extra: list[str]) -> int:
    from safetensors import safe_open

    from .experts import prepare_experts

    if rc := _check_device("prepare", args.device):
        return rc
    keys = {
        "w13": args.w13_key,
        "w2": args.w2_key,
        "a13_scale": args.a13_key,
        "a2_scale": args.a2_key,
    }
    keys = {k: v for k, v in keys.items() if v is not None}
    try:
        with safe_open(args.input, framework="pt", device="cpu") as f:
            present = set(f.keys())
            missing = [v for v in keys.values() if v not in present]
            if missing:
                return _fail(
                    "prepare", f"{args.input}: no tensor {missing}; it holds {sorted(present)}"
                )
            tensors = {k: f.get_tensor(v).to(args.device) for k, v in keys.items()}
    except FileNotFoundError:
        return _fail("prepare", f"{args.input}: no such file")
    except Exception as exc:  # safetensors raises its own error types for bad headers
        return _fail("prepare", f"{args.input}: not a readable safetensors file ({exc})")
    try:
        experts = prepare_experts(**tensors)
    except (TypeError, ValueError) as exc:
        return _fail("prepare", str(exc))
    experts.save(args.output)
    print(f"prepared {experts!r}")
    print(f"wrote {args.output} ({os.path.getsize(args.output)} bytes)")
    return 0


# ----------------------------------------------------------------------------- inspect


def _cmd_inspect(args: argparse.Namespace, extra: list[str]) -> int:
    from safetensors import safe_open

    from .demo import format_table
    from .experts import load_experts

    try:
        experts = load_experts(args.path)
    except ValueError as exc:
        return _fail("inspect", str(exc))
    with safe_open(args.path, framework="pt", device="cpu") as f:
        meta = f.metadata() or {}
    print(f"file: {args.path} ({os.path.getsize(args.path)} bytes)")
    print("metadata:")
    first = (
        "format",
        "layout",
        "layout_version",
        "num_experts",
        "hidden_size",
        "intermediate_size",
    )
    for k in sorted(meta, key=lambda k: (first.index(k) if k in first else len(first), k)):
        if k != "tensors":  # shown as the table below
            print(f"  {k}: {meta[k]}")
    print(f"experts: {experts!r}")
    rows = [
        [
            name,
            str(t.dtype).removeprefix("torch."),
            str(list(t.shape)),
            str(t.numel() * t.element_size()),
        ]
        for name, t in experts._tensors().items()
    ]
    print(format_table(["tensor", "dtype", "shape", "bytes"], rows, "lllr"))
    e, h, i = experts.num_experts, experts.hidden_size, experts.intermediate_size
    bf16 = e * 3 * h * i * 2
    total = experts.nbytes()
    print(f"total {total} bytes; the same weights in bf16: {bf16} bytes ({total / bf16:.3f}x)")
    return 0


# ----------------------------------------------------------------------------- bench


def _cmd_bench(args: argparse.Namespace, extra: list[str]) -> int:
    if not torch.cuda.is_available():
        print(
            "fp4moe bench needs a CUDA GPU; none is available here "
            "(torch.cuda.is_available() is False). On a CPU, `fp4moe demo` runs every mode "
            "with the reference backend.",
            file=sys.stderr,
        )
        return 1
    from .bench import format_table, run

    try:
        doc = run(args)
    except ValueError as exc:
        print(f"fp4moe bench: {exc}", file=sys.stderr)
        return 2
    print(format_table(doc))
    print(f"(JSON, CSV and PNG in {args.out}/)")
    return 0


# ----------------------------------------------------------------------------- parser


def build_parser() -> argparse.ArgumentParser:
    from . import __version__
    from .moe import BACKENDS

    parser = argparse.ArgumentParser(
        prog="fp4moe",
        description="NVFP4 Mixture-of-Experts layers: one prepared copy, W4A4 and W4A16.",
    )
    parser.add_argument("--version", action="version", version=f"fp4moe {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    p = sub.add_parser(
        "demo",
        help="run every mode on a small synthetic MoE layer and compare with bf16",
        description=(
            "Build a small MoE layer with realistic random weights, prepare its experts once "
            "(with calibrated static activation scales), route with softmax top-k, and run "
            "w4a16 and w4a4 (per_token, static, per_tensor) against the bf16 layer."
        ),
    )
    p.add_argument("--hidden", type=int, default=512, help="hidden size H (default 512)")
    p.add_argument(
        "--inter", type=int, default=256, help="expert intermediate size I (default 256)"
    )
    p.add_argument("--experts", type=int, default=16, help="experts E (default 16)")
    p.add_argument("--top-k", type=int, default=4, help="routes a token K (default 4)")
    p.add_argument("--tokens", type=int, default=64, help="tokens T (default 64)")
    p.add_argument(
        "--calib-tokens",
        type=int,
        default=256,
        help="tokens of the separate calibration batch for static scales (default 256)",
    )
    p.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    p.add_argument("--repeats", type=int, default=5, help="timed runs a mode (default 5)")
    p.add_argument(
        "--device",
        default=_default_device(),
        help="torch device (default cuda if available, else cpu)",
    )
    p.add_argument(
        "--backend",
        choices=BACKENDS,
        default="auto",
        help="auto: triton on CUDA (the reference where a kernel is not there yet), "
        "reference elsewhere (default auto)",
    )
    p.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    p.set_defaults(func=_cmd_demo)

    p = sub.add_parser(
        "prepare",
        help="quantize expert weights from a safetensors file to a prepared NVFP4 file",
        description=(
            "Read bf16/fp16/fp32 expert weights w13 [E, 2I, H] (gate rows, then up rows) and "
            "w2 [E, H, I] from a safetensors file and write the prepared NVFP4 experts "
            "(docs/layout.md)."
        ),
    )
    p.add_argument("input", help="safetensors file with the expert weights")
    p.add_argument("output", help="prepared file to write")
    p.add_argument("--w13-key", default="w13", help="tensor name of w13 (default w13)")
    p.add_argument("--w2-key", default="w2", help="tensor name of w2 (default w2)")
    p.add_argument("--a13-key", help="tensor name of static FC1 input scales, fp32 [E] (optional)")
    p.add_argument("--a2-key", help="tensor name of static FC2 input scales, fp32 [E] (optional)")
    p.add_argument("--device", default="cpu", help="device to quantize on (default cpu)")
    p.set_defaults(func=_cmd_prepare)

    p = sub.add_parser(
        "inspect",
        help="print the metadata, shapes and bytes of a prepared file",
        description="Load a prepared file (validating it) and print its metadata and tensors.",
    )
    p.add_argument("path", help="prepared file (written by `fp4moe prepare` or experts.save)")
    p.set_defaults(func=_cmd_inspect)

    p = sub.add_parser(
        "bench",
        help="benchmark the MoE layer on a CUDA GPU",
        description=(
            "Benchmark the MoE layer on a CUDA GPU against a bf16 torch._grouped_mm MoE and "
            "the naive NVFP4 path, with this card's copy bandwidth and bf16 matmul rate "
            "measured in the same run. Writes bench.json, bench.csv and bench.png to --out."
        ),
    )
    from .bench import add_arguments as _bench_arguments

    _bench_arguments(p)
    p.set_defaults(func=_cmd_bench)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit code (``--help`` gives 0, bad usage 2)."""
    parser = build_parser()
    try:
        args, extra = parser.parse_known_args(argv)
        if extra and args.command != "bench":
            parser.error(f"unrecognized arguments: {' '.join(extra)}")
    except SystemExit as exc:
        return exc.code if isinstance(exc.code, int) else 2
    if args.command is None:
        parser.print_help()
        return 2
    return args.func(args, extra)
