"""Read and write NVFP4 MoE experts in the checkpoint layouts of other tools.

Two layouts are understood, both one tensor set per expert and projection under
``{prefix}.{e}.{proj}.`` (``proj`` is ``gate_proj``/``up_proj``/``down_proj``, or the
Mixtral names ``w1``/``w3``/``w2``):

ModelOpt (NVIDIA TensorRT Model Optimizer, ``quant_algo: NVFP4``)::

    weight          uint8          [N, K/2]   two e2m1 codes a byte, element 2j low nibble
    weight_scale    float8_e4m3fn  [N, K/16]  linear (not swizzled); uint8 accepted
    weight_scale_2  float32        [] or [1]  decode global scale
    input_scale     float32        [] or [1]  decode global scale of the input (optional)

compressed-tensors (``format: nvfp4-pack-quantized``)::

    weight_packed        uint8          [N, K/2]
    weight_scale         float8_e4m3fn  [N, K/16]
    weight_global_scale  float32        [] or [1]  ENCODE scale: decode global = 1 / it
    input_global_scale   float32        [] or [1]  encode scale of the input (optional)

Codes and block scales are copied bit for bit. ModelOpt globals are copied bit for bit.
compressed-tensors globals are converted with one fp32 division (numerics section 1), so a
round trip PreparedExperts -> compressed-tensors -> PreparedExperts keeps codes and block
scales bit for bit and each global within one ulp (``1 / (1 / g)`` differs from ``g`` in
the last bit for about one fp32 value in seven).
"""

from __future__ import annotations

import os
from collections.abc import Mapping, MutableMapping, Sequence
from contextlib import ExitStack
from typing import Any

import torch

from .checkpoint_source import CheckpointSource
from .experts import PreparedExperts, empty_block_scales, validate_block_scales
from .kernels.gemm.fields import from_fields, to_fields

__all__ = [
    "CHECKPOINT_FORMATS",
    "load_checkpoint_experts",
    "modelopt_expert_tensors",
    "save_compressed_tensors_experts",
    "save_modelopt_experts",
]

CHECKPOINT_FORMATS = ("modelopt", "compressed-tensors")

# Projection names: (gate, up, down). HF style first, Mixtral second.
_PROJ_NAMES = (("gate_proj", "up_proj", "down_proj"), ("w1", "w3", "w2"))

# Leaf tensor names per format: (codes, block scales, weight global, input global).
_LEAVES = {
    "modelopt": ("weight", "weight_scale", "weight_scale_2", "input_scale"),
    "compressed-tensors": (
        "weight_packed",
        "weight_scale",
        "weight_global_scale",
        "input_global_scale",
    ),
}

_SCALAR_DTYPES = (torch.float32, torch.bfloat16, torch.float16)  # widen to fp32 exactly

# ----------------------------------------------------------------------------- checks


def _check_args(prefix: Any, num_experts: Any, fmt: Any, expert_range: Any) -> tuple[str, int, int]:
    if not isinstance(prefix, str):
        raise TypeError(f"prefix: expected a str, got {type(prefix).__name__}")
    if not prefix.strip("."):
        raise ValueError("prefix: must name the experts module, e.g. 'model.layers.0.mlp.experts'")
    if not isinstance(num_experts, int) or isinstance(num_experts, bool):
        raise TypeError(f"num_experts: expected an int, got {type(num_experts).__name__}")
    if num_experts < 1:
        raise ValueError(f"num_experts: must be at least 1, got {num_experts}")
    if fmt != "auto" and fmt not in CHECKPOINT_FORMATS:
        raise ValueError(f"format: expected 'auto' or one of {CHECKPOINT_FORMATS}, got {fmt!r}")
    if expert_range is None:
        return prefix.rstrip("."), 0, num_experts
    if (
        not isinstance(expert_range, (tuple, list))
        or len(expert_range) != 2
        or not all(isinstance(x, int) and not isinstance(x, bool) for x in expert_range)
    ):
        raise TypeError(
            f"expert_range: expected a pair of ints (start, stop), got {expert_range!r}"
        )
    start, stop = expert_range
    if not 0 <= start < stop <= num_experts:
        raise ValueError(
            f"expert_range: expected 0 <= start < stop <= num_experts={num_experts}, "
            f"got ({start}, {stop})"
        )
    return prefix.rstrip("."), start, stop


def _detect(
    src: CheckpointSource, prefix: str, e0: int, fmt: str
) -> tuple[str, tuple[str, str, str]]:
    """(format, projection names) from the keys of expert ``e0``'s gate projection."""
    # compressed-tensors: weight_packed; ModelOpt: weight beside weight_scale (an unquantized
    # checkpoint has a weight but no weight_scale).
    marks = {"modelopt": ("weight", "weight_scale"), "compressed-tensors": ("weight_packed",)}
    found = [
        (f, names)
        for names in _PROJ_NAMES
        for f, leaves in marks.items()
        if all(src.has(f"{prefix}.{e0}.{names[0]}.{leaf}") for leaf in leaves)
    ]
    if fmt != "auto":
        hits = [x for x in found if x[0] == fmt]
        if hits:
            return hits[0]
        other = f" (the keys there are of format {found[0][0]!r})" if found else ""
        expected = [f"{prefix}.{e0}.{n[0]}.{marks[fmt][-1]}" for n in _PROJ_NAMES]
        raise ValueError(
            f"source: missing tensor {expected[0]!r} (or Mixtral naming {expected[1]!r}) "
            f"in {src.description} for format {fmt!r}{other}{_hint(src, prefix)}"
        )
    if len({f for f, _ in found}) > 1:
        raise ValueError(
            f"source: expert {e0} under {prefix!r} has tensors of both formats "
            f"{sorted({f for f, _ in found})}; pass format= explicitly"
        )
    if not found:
        looked = [
            f"{prefix}.{e0}.{n[0]}.{leaves[-1]}" for n in _PROJ_NAMES for leaves in marks.values()
        ]
        raise ValueError(
            f"source: format detection found neither ModelOpt nor compressed-tensors NVFP4 "
            f"tensors in {src.description}: looked for {looked}{_hint(src, prefix)}"
        )
    return found[0]


def _hint(src: CheckpointSource, prefix: str) -> str:
    under = [k for k in src.all_keys() if k.startswith(prefix + ".")]
    if not under:
        return f"; no key starts with {prefix + '.'!r}"
    return f"; keys under the prefix include {sorted(under)[:6]}"


def _check_expert_count(
    src: CheckpointSource, prefix: str, num_experts: int, names: Sequence[str], codes_leaf: str
) -> None:
    last = f"{prefix}.{num_experts - 1}.{names[0]}.{codes_leaf}"
    if not src.has(last):
        raise ValueError(f"num_experts: {num_experts} given, but the checkpoint has no {last!r}")
    beyond = f"{prefix}.{num_experts}.{names[0]}.{codes_leaf}"
    if src.has(beyond):
        raise ValueError(
            f"num_experts: {num_experts} given, but the checkpoint also holds {beyond!r}"
        )


def _as_codes(t: torch.Tensor, key: str, shape: tuple[int, int]) -> torch.Tensor:
    if t.dtype != torch.uint8 or tuple(t.shape) != shape:
        raise ValueError(
            f"{key}: expected torch.uint8 {list(shape)} (packed e2m1 codes), "
            f"got {t.dtype} {list(t.shape)}"
        )
    return t


def _as_block_scales(t: torch.Tensor, key: str, shape: tuple[int, int]) -> torch.Tensor:
    if t.dtype not in (torch.float8_e4m3fn, torch.uint8) or tuple(t.shape) != shape:
        raise ValueError(
            f"{key}: expected torch.float8_e4m3fn (or uint8 bits) {list(shape)} "
            f"(linear block scales), got {t.dtype} {list(t.shape)}"
        )
    validate_block_scales(t, key)
    return t.view(torch.float8_e4m3fn)


def _as_scalar(t: torch.Tensor, key: str) -> torch.Tensor:
    """A float scalar stored as [] or [1], widened to an fp32 0-d tensor."""
    if t.dtype not in _SCALAR_DTYPES or t.dim() > 1 or t.numel() != 1:
        raise ValueError(
            f"{key}: expected a float32 (or bf16/fp16) scalar of shape [] or [1], "
            f"got {t.dtype} {list(t.shape)}"
        )
    return t.reshape(()).to(torch.float32)


def _decode_global(t: torch.Tensor, key: str, fmt: str) -> torch.Tensor:
    g = _as_scalar(t, key)
    if fmt == "compressed-tensors":
        # The stored value is the encode scale; numerics section 1: global = 1 / encode in fp32.
        if not bool(torch.isfinite(g)) or float(g) <= 0:
            raise ValueError(f"{key}: encode scale must be finite and positive, got {float(g)}")
        g = torch.reciprocal(g)
    if not bool(torch.isfinite(g)) or float(g) <= 0:
        raise ValueError(f"{key}: decode global scale must be finite and positive, got {float(g)}")
    return g


# ----------------------------------------------------------------------------- load


def load_checkpoint_experts(
    source: str | os.PathLike | Mapping[str, torch.Tensor] | CheckpointSource,
    *,
    prefix: str,
    num_experts: int,
    format: str = "auto",
    expert_range: tuple[int, int] | None = None,
    device: torch.device | str | None = None,
) -> PreparedExperts:
    """Read one MoE block's NVFP4 experts from a ModelOpt or compressed-tensors checkpoint.

    Only the tensors of the chosen experts are read; each safetensors shard is opened once.

    Args:
        source: a safetensors file; a directory with ``model.safetensors.index.json`` (HF
            sharded layout, its ``weight_map`` says which shard holds each key) or with a
            single ``model.safetensors``; a state dict ``dict[str, Tensor]``; or an open
            :class:`CheckpointSource` (left open).
        prefix: module path of the experts, e.g. ``"model.layers.3.mlp.experts"``; expert
            e's tensors are ``{prefix}.{e}.{proj}.{leaf}``.
        num_experts: experts the block has in the checkpoint (checked against the keys).
        format: ``"modelopt"``, ``"compressed-tensors"`` or ``"auto"`` (from the key names).
        expert_range: ``(start, stop)``: read experts ``start .. stop-1`` only (expert
            parallelism); local expert i is checkpoint expert ``start + i``. Default all.
        device: where the result lives (default CPU).

    Returns:
        PreparedExperts with E = stop - start: w13_codes uint8 [E, 2I, H/2] (gate rows, then
        up rows), w13_scales e4m3 [E, 2I, H/16], w13_global fp32 [E, 2] (gate, up: each its
        own), w2_codes uint8 [E, H, I/2], w2_scales e4m3 [E, H, I/16], w2_global fp32 [E];
        a13_scale = max(gate, up input scale) and a2_scale = down input scale, fp32 [E]
        decode scales, when every loaded expert has them (None when none has).

    Raises:
        TypeError, ValueError: bad arguments, a missing tensor (naming the key), a wrong
            dtype or shape (naming the key, what was expected and what came), shapes that
            differ between experts, input scales present for only some experts.
    """
    prefix, start, stop = _check_args(prefix, num_experts, format, expert_range)
    target = torch.device(device) if device is not None else torch.device("cpu")
    with ExitStack() as stack, torch.no_grad():
        if isinstance(source, CheckpointSource):
            src = source  # the caller's, left open
        else:
            src = stack.enter_context(CheckpointSource(source))
        fmt, names = _detect(src, prefix, start, format)
        codes_leaf, scale_leaf, global_leaf, input_leaf = _LEAVES[fmt]
        _check_expert_count(src, prefix, num_experts, names, codes_leaf)

        def key(e: int, p: int, leaf: str) -> str:
            return f"{prefix}.{e}.{names[p]}.{leaf}"

        experts = range(start, stop)
        needed = {
            e: [key(e, p, leaf) for p in range(3) for leaf in _LEAVES[fmt][:3]] for e in experts
        }
        missing = [k for e in experts for k in needed[e] if not src.has(k)]
        if missing:
            raise ValueError(
                f"source: missing tensor {missing[0]!r} in {src.description} "
                f"({len(missing)} missing in all)"
            )
        inputs = [key(e, p, input_leaf) for e in experts for p in range(3)]
        present = [k for k in inputs if src.has(k)]
        if present and len(present) != len(inputs):
            absent = [k for k in inputs if not src.has(k)]
            raise ValueError(
                f"source: static input scales must be present for every loaded expert "
                f"projection or for none; {len(present)} present, missing e.g. {absent[0]!r}"
            )
        static = bool(present)

        # Shapes come from the first expert's gate codes; every other tensor must agree.
        first = key(start, 0, codes_leaf)
        g0 = src.read([first])[first]
        if g0.dim() != 2 or g0.dtype != torch.uint8:
            raise ValueError(
                f"{first}: expected torch.uint8 [I, H/2], got {g0.dtype} {list(g0.shape)}"
            )
        i, h = g0.shape[0], g0.shape[1] * 2
        if i % 32 or h % 32:
            raise ValueError(
                f"{first}: H and I must be multiples of 32, got shape {list(g0.shape)} "
                f"(I={i}, H={h})"
            )
        n = stop - start
        w13_codes = torch.empty((n, 2 * i, h // 2), dtype=torch.uint8, device=target)
        w13_scales = empty_block_scales(n, 2 * i, h // 16, device=target)  # rows aligned
        w2_codes = torch.empty((n, h, i // 2), dtype=torch.uint8, device=target)
        w2_scales = empty_block_scales(n, h, i // 16, device=target)
        w13_global = torch.empty((n, 2), dtype=torch.float32)
        w2_global = torch.empty((n,), dtype=torch.float32)
        a13 = torch.empty((n,), dtype=torch.float32)
        a2 = torch.empty((n,), dtype=torch.float32)

        for local, e in enumerate(experts):
            # One expert at a time keeps host memory to one expert beyond the result.
            tensors = src.read(
                needed[e] + ([key(e, p, input_leaf) for p in range(3)] if static else [])
            )
            for p in range(3):
                rows, cols = (h, i) if p == 2 else (i, h)
                kc, ks, kg = (key(e, p, leaf) for leaf in (codes_leaf, scale_leaf, global_leaf))
                try:
                    codes = _as_codes(tensors[kc], kc, (rows, cols // 2))
                    scales = _as_block_scales(tensors[ks], ks, (rows, cols // 16))
                except ValueError as exc:
                    raise ValueError(
                        f"{exc} (shapes inferred from {first!r}: I={i}, H={h}; "
                        "every expert must have the same shapes)"
                    ) from None
                g = _decode_global(tensors[kg], kg, fmt)
                if p == 2:
                    w2_codes[local].copy_(codes)
                    w2_scales[local].copy_(scales)
                    w2_global[local] = g
                else:
                    w13_codes[local, p * i : (p + 1) * i].copy_(codes)
                    w13_scales[local, p * i : (p + 1) * i].copy_(scales)
                    w13_global[local, p] = g
            # the prepared layout (codes in the fields layout), on the target device
            w13_codes[local] = to_fields(w13_codes[local])
            w2_codes[local] = to_fields(w2_codes[local])
            if static:
                gate_in, up_in, down_in = (
                    _decode_global(tensors[key(e, p, input_leaf)], key(e, p, input_leaf), fmt)
                    for p in range(3)
                )
                a13[local] = torch.maximum(gate_in, up_in)
                a2[local] = down_in

    return PreparedExperts(
        w13_codes=w13_codes,
        w13_scales=w13_scales,
        w13_global=w13_global.to(target),
        w2_codes=w2_codes,
        w2_scales=w2_scales,
        w2_global=w2_global.to(target),
        a13_scale=a13.to(target) if static else None,
        a2_scale=a2.to(target) if static else None,
    )


# ----------------------------------------------------------------------------- save


def _projections(experts: PreparedExperts, names: Sequence[str], codes_device=None):
    """(expert, projection name, codes, block scales, global, static input scale or None)
    of each expert's gate, up and down projection: the codes linear copies (numerics
    section 1; the experts hold them in the fields layout), converted an expert at a time
    on the experts' device and moved to ``codes_device`` (None: left there), the rest views
    of the experts' tensors."""
    i = experts.intermediate_size

    def linear(codes: torch.Tensor) -> torch.Tensor:
        out = from_fields(codes)
        return out if codes_device is None else out.to(codes_device)

    for e in range(experts.num_experts):
        w13, w2 = linear(experts.w13_codes[e]), linear(experts.w2_codes[e])
        parts = (
            (w13[:i], experts.w13_scales[e, :i], experts.w13_global[e, 0]),
            (w13[i:], experts.w13_scales[e, i:], experts.w13_global[e, 1]),
            (w2, experts.w2_scales[e], experts.w2_global[e]),
        )
        statics = (experts.a13_scale, experts.a13_scale, experts.a2_scale)
        for name, (codes, scales, g), a in zip(names, parts, statics):
            yield e, name, codes, scales, g, (a[e] if a is not None else None)


def _save(
    experts: PreparedExperts,
    path_or_dict: str | os.PathLike | MutableMapping[str, torch.Tensor] | None,
    prefix: str,
    names: Sequence[str],
    expert_offset: int,
    fmt: str,
) -> dict[str, torch.Tensor] | MutableMapping[str, torch.Tensor]:
    if not isinstance(experts, PreparedExperts):
        raise TypeError(f"experts: expected a PreparedExperts, got {type(experts).__name__}")
    if not isinstance(prefix, str) or not prefix.strip("."):
        raise ValueError(f"prefix: expected a non-empty module path, got {prefix!r}")
    prefix = prefix.rstrip(".")
    if (
        isinstance(names, str)
        or len(names) != 3
        or not all(isinstance(x, str) and x for x in names)
        or len(set(names)) != 3
    ):
        raise ValueError(f"names: expected three distinct names (gate, up, down), got {names!r}")
    if not isinstance(expert_offset, int) or isinstance(expert_offset, bool) or expert_offset < 0:
        raise ValueError(f"expert_offset: expected an int >= 0, got {expert_offset!r}")
    codes_leaf, scale_leaf, global_leaf, input_leaf = _LEAVES[fmt]
    encode = fmt == "compressed-tensors"
    scalar_shape = (1,) if encode else ()  # what each tool writes

    def scalar(g: torch.Tensor) -> torch.Tensor:
        g = g.detach().to(device="cpu", dtype=torch.float32)
        return (torch.reciprocal(g) if encode else g.clone()).reshape(scalar_shape)

    out: dict[str, torch.Tensor] = {}
    for e, name, codes, scales, g, a in _projections(experts, names, "cpu"):
        base = f"{prefix}.{e + expert_offset}.{name}"
        # clone: safetensors refuses tensors that share storage
        out[f"{base}.{codes_leaf}"] = codes.detach().clone()
        out[f"{base}.{scale_leaf}"] = scales.detach().cpu().clone()
        out[f"{base}.{global_leaf}"] = scalar(g)
        if a is not None:
            out[f"{base}.{input_leaf}"] = scalar(a)

    if path_or_dict is None:
        return out
    if isinstance(path_or_dict, MutableMapping):
        path_or_dict.update(out)
        return path_or_dict
    if isinstance(path_or_dict, (str, os.PathLike)):
        from safetensors.torch import save_file

        save_file(out, os.fspath(path_or_dict), metadata={"format": "pt"})
        return out
    raise TypeError(
        f"path_or_dict: expected a path, a dict or None, got {type(path_or_dict).__name__}"
    )


def modelopt_expert_tensors(
    experts: PreparedExperts,
    *,
    prefix: str,
    names: Sequence[str] = ("gate_proj", "up_proj", "down_proj"),
    codes_device: torch.device | str | None = None,
) -> dict[str, torch.Tensor]:
    """The experts in the ModelOpt NVFP4 layout of :func:`save_modelopt_experts`: what a
    state dict holds. The codes are linear copies (the experts hold them in the fields
    layout), made an expert at a time on the experts' device and kept on ``codes_device``
    (None: the experts' device; the transformers blocks' state dicts keep them on the CPU,
    so that a model's state dict does not hold its codes a second time on the GPU); the
    scales are views of the experts' own tensors, on their device.

    Keys ``{prefix}.{e}.{p}.weight`` uint8 [N, K/2], ``.weight_scale`` e4m3 [N, K/16],
    ``.weight_scale_2`` fp32 [] and, with static activation scales, ``.input_scale`` fp32 []
    (views of ``a13_scale`` for gate and up, of ``a2_scale`` for down). Every entry is
    contiguous: where the experts hold block scales with padded rows
    (``experts.align_scale_rows``, K/16 not a multiple of 16) the scale entries are
    contiguous copies. The views of one expert tensor share its storage: writers that
    refuse shared storage (safetensors) need copies, as :func:`save_modelopt_experts` makes
    (a gate and an up entry share one expert's converted codes too).
    """
    if not isinstance(experts, PreparedExperts):
        raise TypeError(f"experts: expected a PreparedExperts, got {type(experts).__name__}")
    prefix = prefix.rstrip(".")
    out: dict[str, torch.Tensor] = {}
    for e, name, codes, scales, g, a in _projections(experts, names, codes_device):
        base = f"{prefix}.{e}.{name}"
        out[f"{base}.weight"] = codes
        out[f"{base}.weight_scale"] = scales.contiguous()
        out[f"{base}.weight_scale_2"] = g
        if a is not None:
            out[f"{base}.input_scale"] = a
    return out


def save_modelopt_experts(
    experts: PreparedExperts,
    path_or_dict: str | os.PathLike | MutableMapping[str, torch.Tensor] | None = None,
    *,
    prefix: str,
    names: Sequence[str] = ("gate_proj", "up_proj", "down_proj"),
    expert_offset: int = 0,
) -> dict[str, torch.Tensor] | MutableMapping[str, torch.Tensor]:
    """Write experts in the ModelOpt NVFP4 layout; :func:`load_checkpoint_experts` reads them
    back bit for bit.

    Per expert e (written as ``e + expert_offset``) and projection name p of ``names``
    (gate, up, down; ``("w1", "w3", "w2")`` for Mixtral):
    ``{prefix}.{e}.{p}.weight`` uint8 [N, K/2], ``.weight_scale`` e4m3 [N, K/16],
    ``.weight_scale_2`` fp32 [] and, when the experts carry static activation scales,
    ``.input_scale`` fp32 [] (a13_scale for gate and up, a2_scale for down). Tensors are
    CPU copies.

    Args:
        experts: the experts to write.
        path_or_dict: a safetensors file to write, a dict to fill, or None.
        prefix: module path of the experts, e.g. ``"model.layers.0.mlp.experts"``.
        names: the three projection names (gate, up, down).
        expert_offset: added to the local expert index in the keys (expert parallelism).

    Returns:
        The tensors written: the given dict when one was given, else a new dict.
    """
    return _save(experts, path_or_dict, prefix, names, expert_offset, "modelopt")


def save_compressed_tensors_experts(
    experts: PreparedExperts,
    path_or_dict: str | os.PathLike | MutableMapping[str, torch.Tensor] | None = None,
    *,
    prefix: str,
    names: Sequence[str] = ("gate_proj", "up_proj", "down_proj"),
    expert_offset: int = 0,
) -> dict[str, torch.Tensor] | MutableMapping[str, torch.Tensor]:
    """Write experts in the compressed-tensors ``nvfp4-pack-quantized`` layout.

    Per expert and projection: ``weight_packed`` uint8 [N, K/2], ``weight_scale`` e4m3
    [N, K/16], ``weight_global_scale`` fp32 [1] = 1 / global (the encode scale, one fp32
    division) and, with static activation scales, ``input_global_scale`` fp32 [1] = 1 / a.

    Reading the result back keeps codes and block scales bit for bit; each global comes back
    as ``1 / (1 / g)`` in fp32, which equals ``g`` or is one ulp from it (numerics section 1).
    Arguments and return value as :func:`save_modelopt_experts`.
    """
    return _save(experts, path_or_dict, prefix, names, expert_offset, "compressed-tensors")
