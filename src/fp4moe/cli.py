"""The ``fp4moe`` command line: demo, prepare, inspect, plan, bench.

Exit codes: 0 success, 1 cannot run here (no GPU, not enough memory, a missing file), 2 bad
usage or input.
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


def _check_device(command: str, device: str, backend: str | None = None) -> int:
    """0, or the exit code after a one-line error for a device or backend this machine
    cannot run (GPU-only options on a CPU machine)."""
    try:
        dev = torch.device(device)
    except RuntimeError as exc:
        return _fail(command, f"--device: {exc}")
    if dev.type == "cuda" and not torch.cuda.is_available():
        return _fail(command, "--device cuda: no CUDA device is available here", 1)
    interpreter = os.environ.get("TRITON_INTERPRET", "0") == "1"
    if backend == "triton" and dev.type != "cuda" and not interpreter:
        where = (
            "no CUDA device is available here"
            if not torch.cuda.is_available()
            else (f"--device is {device}")
        )
        return _fail(
            command,
            f"--backend triton: the Triton kernels need a CUDA device ({where}); use "
            "--backend reference, or auto (the reference on the CPU)",
            1,
        )
    return 0


# ----------------------------------------------------------------------------- demo


# Options of ``fp4moe demo --layer`` only, with their defaults there.
_LAYER_DEFAULTS = {
    "hidden": 512,
    "inter": 256,
    "experts": 16,
    "top_k": 4,
    "tokens": 64,
    "calib_tokens": 256,
    "repeats": 5,
}
# Options of the transformer demo (and, the first three, of --disaggregated).
_MODEL_DEFAULTS = {
    "batch": 2,
    "prompt_len": 16,
    "new_tokens": 8,
    "model_config": None,
    "checkpoint": None,
    "prefill": "w4a4-token",
    "decode": "w4a16",
}


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _write_json(path: str | None, doc: dict) -> None:
    if path:
        with open(path, "w") as f:
            json.dump(doc, f, indent=2)
        print(f"wrote {path}")


def _cmd_demo(args: argparse.Namespace, extra: list[str]) -> int:
    if rc := _check_device("demo", args.device, args.backend):
        return rc
    given = {k for k in (*_LAYER_DEFAULTS, *_MODEL_DEFAULTS) if getattr(args, k) is not None}
    if args.layer:
        wrong = [k for k in _MODEL_DEFAULTS if k in given]
        if wrong:
            return _fail("demo", f"{_flag(wrong[0])}: not an option of --layer")
        return _demo_layer(args)
    wrong = [k for k in _LAYER_DEFAULTS if k in given]
    if wrong:
        return _fail("demo", f"{_flag(wrong[0])}: only with --layer (the layer-level demo)")
    try:
        import transformers  # noqa: F401
    except ImportError:
        return _fail(
            "demo",
            "needs transformers 5.x (pip install 'transformers>=5,<6', or -e '.[test]'); "
            "`fp4moe demo --layer` runs without it",
            1,
        )
    opts = {k: getattr(args, k) if k in given else v for k, v in _MODEL_DEFAULTS.items()}
    if args.disaggregated:
        wrong = [k for k in ("model_config", "checkpoint", "prefill", "decode") if k in given]
        if args.backend is not None:
            wrong.append("backend")
        if wrong:
            return _fail("demo", f"{_flag(wrong[0])}: not an option of --disaggregated")
        return _demo_disaggregated(args, opts)
    return _demo_model(args, opts)


def _demo_layer(args: argparse.Namespace) -> int:
    from .demo import DemoConfig, render_demo, run_demo

    sizes = {k: getattr(args, k) if getattr(args, k) is not None else v
             for k, v in _LAYER_DEFAULTS.items()}  # fmt: skip
    try:
        cfg = DemoConfig(
            **sizes, seed=args.seed, device=args.device, backend=args.backend or "auto"
        )
    except ValueError as exc:
        return _fail("demo", str(exc))
    res = run_demo(cfg)
    print(render_demo(res))
    _write_json(args.json, res.to_json())
    return 0


def _demo_model(args: argparse.Namespace, opts: dict) -> int:
    from .demo_model import ModelDemoConfig, NotEnoughMemory, render_model_demo, run_model_demo

    for key in ("model_config", "checkpoint"):
        path = opts[key]
        if path is not None and not os.path.exists(path):
            return _fail("demo", f"{_flag(key)}: no such file or directory {path!r}")
    if opts["checkpoint"] is not None and not os.path.isdir(opts["checkpoint"]):
        return _fail(
            "demo", f"--checkpoint: expected a checkpoint directory, got {opts['checkpoint']!r}"
        )
    try:
        cfg = ModelDemoConfig(
            **opts, seed=args.seed, device=args.device, backend=args.backend or "auto"
        )
    except (TypeError, ValueError) as exc:
        return _fail("demo", str(exc))
    try:
        res = run_model_demo(cfg)
    except NotEnoughMemory as exc:  # refused before anything large was built
        return _fail("demo", str(exc), 1)
    except (ValueError, NotImplementedError) as exc:  # a config or checkpoint we cannot run
        return _fail("demo", str(exc))
    print(render_model_demo(res))
    _write_json(args.json, res.to_json())
    return 0


def _demo_disaggregated(args: argparse.Namespace, opts: dict) -> int:
    from .demo_model import render_disaggregated, run_disaggregated

    if opts["new_tokens"] < 2:
        return _fail("demo", f"--new-tokens: expected at least 2, got {opts['new_tokens']}")
    for key in ("batch", "prompt_len"):
        if opts[key] < 1:
            return _fail("demo", f"{_flag(key)}: expected at least 1, got {opts[key]}")
    try:
        rep = run_disaggregated(
            steps=opts["new_tokens"] - 1, prompt_len=opts["prompt_len"], batch=opts["batch"],
            seed=args.seed, device=args.device,
        )  # fmt: skip
    except FileNotFoundError as exc:
        return _fail("demo", str(exc), 1)
    print(render_disaggregated(rep))
    _write_json(args.json, rep)
    return 0


# ----------------------------------------------------------------------------- prepare


def _cmd_prepare(args: argparse.Namespace, extra: list[str]) -> int:
    from safetensors import safe_open

    from .experts import prepare_experts

    if rc := _check_device("prepare", args.device):
        return rc
    if os.path.realpath(args.output) == os.path.realpath(args.input) or (
        os.path.exists(args.output) and os.path.samefile(args.output, args.input)
    ):
        return _fail("prepare", f"{args.output}: is the input file; refusing to write over it")
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
    tmp = f"{args.output}.tmp-{os.getpid()}"
    experts.save(tmp)  # complete before it replaces anything
    os.replace(tmp, args.output)
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
        for name, t in experts.tensors().items()
    ]
    print(format_table(["tensor", "dtype", "shape", "bytes"], rows, "lllr"))
    e, h, i = experts.num_experts, experts.hidden_size, experts.intermediate_size
    bf16 = e * 3 * h * i * 2
    total = experts.nbytes()
    print(f"total {total} bytes; the same weights in bf16: {bf16} bytes ({total / bf16:.3f}x)")
    return 0


# ----------------------------------------------------------------------------- plan


def _cmd_plan(args: argparse.Namespace, extra: list[str]) -> int:
    from .backend import H200, Options, explain, plan_call, target_for
    from .presets import MODES, PRESETS

    p = PRESETS[args.preset]
    if any(t < 0 for t in args.num_tokens):
        return _fail("plan", "--num-tokens: counts must be >= 0")
    if args.target == "current":
        if not torch.cuda.is_available():
            return _fail("plan", "--target current: no CUDA device here (use --target h200)")
        target = target_for("cuda")
    else:
        target = H200
    opt = Options(valid_fraction=p.local_experts / p.experts)
    rows = []
    for mode in args.modes:
        m, sc = MODES[mode]
        for fused in {"both": (False, True), "fused": (True,), "unfused": (False,)}[args.finalize]:
            for t in args.num_tokens:
                plan = plan_call(t, p.top_k, p.local_experts, p.hidden, p.inter, mode=m,
                                 act_scale=sc, fused_finalize=fused, options=opt,
                                 target=target)  # fmt: skip
                if args.explain:
                    print(explain(plan) + "\n")
                rows.append({"tokens": t, "mode": mode, **plan.summary()})
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"preset": args.preset, "target": target.name, "rows": rows}, f, indent=1)
    if not args.explain:
        print(f"# {args.preset} (H {p.hidden}, I {p.inter}, {p.local_experts} local experts, "
              f"top-{p.top_k}, valid fraction {opt.valid_fraction:.3g}) on "
              f"{target.name}")  # fmt: skip
        cols = ["tokens", "mode", "finalize", "valid_rows", "fc1_input", "fc1", "fc2_input", "fc2"]
        widths = {c: max(len(c), *(len(str(r[c])) for r in rows)) for c in cols}
        print("  ".join(f"{c:<{widths[c]}}" for c in cols))
        for r in rows:
            print("  ".join(f"{r[c]!s:<{widths[c]}}" for c in cols))
    return 0


# ----------------------------------------------------------------------------- bench


def _cmd_bench(args: argparse.Namespace, extra: list[str]) -> int:
    if args.ep is not None:
        from .bench_ep import main_args

        return main_args(args)
    if not torch.cuda.is_available():
        print(
            "fp4moe bench needs a CUDA GPU; none is available here "
            "(torch.cuda.is_available() is False). On a CPU, `fp4moe demo --layer` runs every "
            "mode with the reference backend.",
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
    from .modes import MODE_NAMES
    from .moe import BACKENDS

    parser = argparse.ArgumentParser(
        prog="fp4moe",
        description="NVFP4 Mixture-of-Experts layers: one prepared copy, W4A16, W4A8 and W4A4.",
    )
    parser.add_argument("--version", action="version", version=f"fp4moe {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    p = sub.add_parser(
        "demo",
        help="generate with a small MoE transformer on one NVFP4 copy; compare with bf16",
        description=(
            "Convert a small MoE transformer (default: Qwen3-MoE scaled down, random weights) "
            "once to NVFP4 experts, generate greedily with the default phase policy (prefill "
            "w4a4-token, decode w4a16), and print per phase the mode, tokens, time, tokens/s "
            "and the agreement with the bf16 model (logit relative error, top-1), then the "
            "bytes of the expert weights: one copy against two. --layer: the layer-level "
            "table of every mode; --disaggregated: prefill and decode in two processes "
            "(examples/disaggregated.py)."
        ),
    )
    which = p.add_mutually_exclusive_group()
    which.add_argument(
        "--layer",
        action="store_true",
        help="the layer-level demo: one synthetic MoE layer, every mode against bf16",
    )
    which.add_argument(
        "--disaggregated",
        action="store_true",
        help="run examples/disaggregated.py: a W4A4 prefill worker hands the KV cache to a "
        "W4A16 decode worker, both opening the same prepared expert files",
    )
    p.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    p.add_argument(
        "--device",
        default=_default_device(),
        help="torch device (default cuda if available, else cpu)",
    )
    p.add_argument(
        "--backend",
        choices=BACKENDS,
        default=None,
        help="auto: triton on CUDA, reference elsewhere (default auto)",
    )
    p.add_argument("--json", metavar="PATH", help="also write the results as JSON")

    g = p.add_argument_group("the transformer demo (default) and --disaggregated")
    g.add_argument("--batch", type=int, help="sequences (default 2)")
    g.add_argument("--prompt-len", type=int, help="random prompt tokens a sequence (default 16)")
    g.add_argument(
        "--new-tokens", type=int, help="tokens to generate a sequence, greedily (default 8)"
    )
    g = p.add_argument_group("the transformer demo (default)")
    src = g.add_mutually_exclusive_group()
    src.add_argument(
        "--model-config",
        metavar="PATH",
        help="a transformers config.json (or its directory) of a Qwen3-MoE, Mixtral or "
        "DeepSeek-V3 model, scaled down to run here; built with random weights",
    )
    src.add_argument(
        "--checkpoint",
        metavar="DIR",
        help="a local HF checkpoint directory (config.json, safetensors) whose experts are "
        "NVFP4 (ModelOpt or compressed-tensors); read offline",
    )
    names = ", ".join(MODE_NAMES)
    g.add_argument(
        "--prefill", metavar="MODE", help=f"prefill mode: {names}, optionally +fused "
        "(default w4a4-token)",
    )  # fmt: skip
    g.add_argument(
        "--decode", metavar="MODE", help=f"decode mode: {names}, optionally +fused "
        "(default w4a16)",
    )  # fmt: skip

    g = p.add_argument_group("the layer demo (--layer)")
    g.add_argument("--hidden", type=int, help="hidden size H (default 512)")
    g.add_argument("--inter", type=int, help="expert intermediate size I (default 256)")
    g.add_argument("--experts", type=int, help="experts E (default 16)")
    g.add_argument("--top-k", type=int, help="routes a token K (default 4)")
    g.add_argument("--tokens", type=int, help="tokens T (default 64)")
    g.add_argument(
        "--calib-tokens",
        type=int,
        help="tokens of the separate calibration batch for static scales (default 256)",
    )
    g.add_argument("--repeats", type=int, help="timed runs a mode (default 5)")
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

    from .presets import MODES as _BENCH_MODES
    from .presets import PRESETS as _PRESETS

    p = sub.add_parser(
        "plan",
        help="print which kernels serve each GEMM of a call (no GPU needed)",
        description=(
            "The planner's choice per token count: for FC1 and FC2 the kernel family, tile "
            "rows and K split, and the quantize and finalize steps, for a preset's shape "
            "on an H200 (or on this machine's GPU: --target current)."
        ),
    )
    p.add_argument("--preset", default="deepseek-v3-ep8", choices=sorted(_PRESETS))
    p.add_argument("--num-tokens", type=int, nargs="+", default=[1, 16, 256, 1024, 8192])
    p.add_argument("--modes", nargs="+", default=["w4a16"], choices=sorted(_BENCH_MODES))
    p.add_argument("--finalize", choices=["unfused", "fused", "both"], default="unfused",
                   help="deterministic (unfused, default), fused, or both")  # fmt: skip
    p.add_argument("--target", choices=["h200", "current"], default="h200",
                   help="plan for an H200 (default) or this machine's CUDA device")  # fmt: skip
    p.add_argument("--explain", action="store_true", help="a paragraph a call, not a table")
    p.add_argument("--json", metavar="PATH", help="also write the plans as JSON")
    p.set_defaults(func=_cmd_plan)

    p = sub.add_parser(
        "bench",
        help="benchmark the MoE layer on a CUDA GPU",
        description=(
            "Benchmark the MoE layer on a CUDA GPU against a bf16 torch._grouped_mm MoE and "
            "the naive NVFP4 path, with this card's copy bandwidth and bf16 and FP8 matmul "
            "rates measured in the same run (the roofline of a w4a8 row takes the FP8 rate). "
            "Writes bench.json, bench.csv and bench.png to --out. "
            "--ep N: the expert-parallel layer over N GPUs (dispatch, compute and combine "
            "timed separately); writes bench-ep.json and bench-ep.csv."
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
