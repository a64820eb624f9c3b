"""PreparedExperts: the one copy of NVFP4 expert weights that every execution mode reads.

Physical layout, version 2 ("fields-v2"; docs/layout.md): the tensors of the logical form
of numerics section 3, row-major and contiguous, the codes' bits permuted within each
32-bit word (``kernels.gemm.fields``: the decode is then one or two instructions a bf16
pair):

    w13_codes   uint8          [E, 2I, H/2]   rows 0..I-1 gate, I..2I-1 up (fields layout)
    w13_scales  float8_e4m3fn  [E, 2I, H/16]
    w13_global  float32        [E, 2]         gate, up
    w2_codes    uint8          [E, H, I/2]    (fields layout)
    w2_scales   float8_e4m3fn  [E, H, I/16]
    w2_global   float32        [E]
    a13_scale   float32        [E] or None    static activation globals (W4A4 static)
    a2_scale    float32        [E] or None

The kernels read this layout directly (the reduction axis is contiguous, so one tile row
of 256 weights is one 128-byte line of codes plus 16 bytes of scales; gate and up tiles
come from two row pointers of the same expert), so no mode needs a second copy.

In memory the rows of a block-scale tensor lie a multiple of 16 bytes apart
(:func:`align_scale_rows`: where K/16 is not a multiple of 16, each row is followed by
zero bytes outside the tensor's view), so that TMA can copy them; the kernels read either
that or the contiguous form, and files hold the contiguous form.
"""

from __future__ import annotations

import json
import os
from dataclasses import InitVar, dataclass, fields
from typing import ClassVar

import torch

from .kernels.gemm.fields import from_fields, to_fields
from .kernels.gemm.shapes import scale_rows_tma
from .nvfp4 import NVFP4Tensor, dequantize_blocks, global_from_amax, quantize_blocks

__all__ = [
    "LAYOUT_NAME",
    "LAYOUT_VERSION",
    "PreparedExperts",
    "align_scale_rows",
    "check_block_scales",
    "empty_block_scales",
    "load_experts",
    "prepare_experts",
    "validate_block_scales",
]

FORMAT_NAME = "fp4moe.prepared_experts"
LAYOUT_NAME = "fields"
LAYOUT_VERSION = 2
# files of version 1 hold the linear form under this name; they are converted on load
_LINEAR_NAME = "linear"
_CODE_NAMES = ("w13_codes", "w2_codes")

_TENSOR_NAMES = ("w13_codes", "w13_scales", "w13_global", "w2_codes", "w2_scales", "w2_global")
_OPTIONAL_NAMES = ("a13_scale", "a2_scale")


@dataclass(eq=False)
class PreparedExperts:
    """E experts of a SwiGLU MoE in NVFP4 (numerics section 3), in physical layout version 2:
    the constructor takes the physical tensors (codes in the fields layout).

    Build with :func:`prepare_experts`, :func:`load_experts`,
    :func:`fp4moe.load_checkpoint_experts` or :meth:`from_linear` (the logical form). No
    call of the library modifies these tensors.

    Construction checks shapes, dtypes and devices (and that static activation scales are
    finite and positive) and lays the tensors out as the kernels read them: contiguous,
    the block scales by :func:`align_scale_rows` (a copy where a tensor is not so; the
    caller's tensors are never changed); every loader also runs :func:`check_block_scales`.
    ``validate=False`` skips both for tensors already checked (the custom op rebuilds the
    object from its tensors on every call, where a check would cost a host sync).
    """

    w13_codes: torch.Tensor
    w13_scales: torch.Tensor
    w13_global: torch.Tensor
    w2_codes: torch.Tensor
    w2_scales: torch.Tensor
    w2_global: torch.Tensor
    a13_scale: torch.Tensor | None = None
    a2_scale: torch.Tensor | None = None

    validate: InitVar[bool] = True

    layout: ClassVar[str] = LAYOUT_NAME
    layout_version: ClassVar[int] = LAYOUT_VERSION

    def __post_init__(self, validate: bool) -> None:
        if validate:
            _validate_linear(self.tensors())
            for f in ("w13_codes", "w13_global", "w2_codes", "w2_global", "a13_scale", "a2_scale"):
                t = getattr(self, f)
                if t is not None and not t.is_contiguous():  # the kernels read rows densely
                    setattr(self, f, t.contiguous())
            self.w13_scales = align_scale_rows(self.w13_scales)
            self.w2_scales = align_scale_rows(self.w2_scales)

    # ------------------------------------------------------------------ shape facts
    @property
    def num_experts(self) -> int:
        return self.w13_codes.shape[0]

    @property
    def hidden_size(self) -> int:
        return self.w13_codes.shape[2] * 2

    @property
    def intermediate_size(self) -> int:
        return self.w13_codes.shape[1] // 2

    @property
    def device(self) -> torch.device:
        return self.w13_codes.device

    def nbytes(self) -> int:
        """Bytes of all expert tensors (codes, block scales, global and activation scales):
        their elements, as a file holds them (the zero bytes that pad block-scale rows in
        memory, ``align_scale_rows``, are not counted)."""
        return sum(t.numel() * t.element_size() for t in self.tensors().values())

    def tensors(self) -> dict[str, torch.Tensor]:
        """The tensors themselves (not copies), keyed by field name; absent static
        activation scales are left out."""
        out = {f.name: getattr(self, f.name) for f in fields(self)}
        return {k: v for k, v in out.items() if v is not None}

    # ------------------------------------------------------------------ per-expert views
    def w13_nvfp4(self, e: int) -> tuple[NVFP4Tensor, NVFP4Tensor]:
        """Expert e's gate and up matrices, each NVFP4 [I, H] in the logical form with its
        own global scale (the codes a linear copy, the scales views)."""
        i = self.intermediate_size
        c, s, g = from_fields(self.w13_codes[e]), self.w13_scales[e], self.w13_global[e]
        return (NVFP4Tensor(c[:i], s[:i], g[0]), NVFP4Tensor(c[i:], s[i:], g[1]))

    def w2_nvfp4(self, e: int) -> NVFP4Tensor:
        """Expert e's down matrix, NVFP4 [H, I] in the logical form (the codes a copy)."""
        return NVFP4Tensor(from_fields(self.w2_codes[e]), self.w2_scales[e], self.w2_global[e])

    def dequantize(self, dtype: torch.dtype = torch.bfloat16) -> tuple[torch.Tensor, torch.Tensor]:
        """All experts decoded with their global scales: (w13 [E, 2I, H], w2 [E, H, I])."""
        i = self.intermediate_size
        w13 = dequantize_blocks(from_fields(self.w13_codes), self.w13_scales)
        g13 = self.w13_global.repeat_interleave(i, dim=1).unsqueeze(-1)
        w2 = dequantize_blocks(from_fields(self.w2_codes), self.w2_scales)
        w2 = w2 * self.w2_global[:, None, None]
        return (w13 * g13).to(dtype), w2.to(dtype)

    # ------------------------------------------------------------------ layout conversion
    def to_linear(self) -> dict[str, torch.Tensor]:
        """The logical (linear) form of numerics section 3 as new tensors, keyed by field name.

        Lossless: ``PreparedExperts.from_linear(e.to_linear())`` is bit-identical to ``e``.
        The codes' bits go back to the linear places (``fields.from_fields``); the other
        tensors are contiguous copies.
        """
        return {
            k: from_fields(v)
            if k in _CODE_NAMES
            else v.clone(memory_format=torch.contiguous_format)
            for k, v in self.tensors().items()
        }

    @classmethod
    def from_linear(cls, tensors: dict[str, torch.Tensor]) -> PreparedExperts:
        """Build from the linear form (keys as returned by :meth:`to_linear`); the caller's
        tensors are not changed (the codes are converted into new tensors)."""
        _check_keys(tensors)
        _validate_linear(tensors)  # named errors before the conversion runs
        physical = {k: to_fields(v) if k in _CODE_NAMES else v.contiguous()
                    for k, v in tensors.items()}  # fmt: skip
        return cls(**physical)

    def to(self, device: torch.device | str) -> PreparedExperts:
        return PreparedExperts(**{k: v.to(device) for k, v in self.tensors().items()})

    # ------------------------------------------------------------------ files
    def save(self, path: str | os.PathLike) -> None:
        """Write safetensors with metadata (format, layout and version, shapes, dtypes)."""
        from safetensors.torch import save_file

        tensors = {k: v.detach().contiguous().cpu() for k, v in self.tensors().items()}
        meta = {
            "format": FORMAT_NAME,
            "layout": LAYOUT_NAME,
            "layout_version": str(LAYOUT_VERSION),
            "num_experts": str(self.num_experts),
            "hidden_size": str(self.hidden_size),
            "intermediate_size": str(self.intermediate_size),
            "tensors": json.dumps(
                {k: {"shape": list(v.shape), "dtype": str(v.dtype)} for k, v in tensors.items()}
            ),
        }
        save_file(tensors, os.fspath(path), metadata=meta)

    def __repr__(self) -> str:
        static = "static activation scales" if self.a13_scale is not None else "no static scales"
        return (
            f"PreparedExperts(E={self.num_experts}, H={self.hidden_size}, "
            f"I={self.intermediate_size}, layout={LAYOUT_NAME}-v{LAYOUT_VERSION}, "
            f"{self.nbytes() / 2**20:.1f} MiB, {static}, device={self.device})"
        )


def empty_block_scales(e: int, n: int, cols: int, device=None) -> torch.Tensor:
    """Block scales e4m3 [e, n, cols] laid out as :func:`align_scale_rows` returns them,
    each row's padding zero and its values zero (to fill before use)."""
    width = -(-cols // 16) * 16
    buf = torch.zeros(e, n, width, dtype=torch.uint8, device=device)
    return buf[:, :, :cols].view(torch.float8_e4m3fn)


def align_scale_rows(scales: torch.Tensor) -> torch.Tensor:
    """Block scales [E, N, K/16] whose rows lie a multiple of 16 bytes apart in memory.

    ``scales`` itself when its rows already do (evenly over the experts, from a 16-byte
    aligned start: one 2-D view [E * N, K/16] with such a row stride); else a new tensor of
    the same shape, dtype, device and values whose row stride is K/16 rounded up to a
    multiple of 16, the bytes between rows zero. TMA (the Gluon kernels' copies) needs
    that stride; every kernel reads either form.
    """
    if scales.dim() != 3:
        raise ValueError(f"scales: expected [E, N, K/16], got shape {tuple(scales.shape)}")
    if scales.numel() == 0 or scale_rows_tma(scales):
        return scales
    out = empty_block_scales(*scales.shape, device=scales.device)
    out.view(torch.uint8).copy_(scales.view(torch.uint8))
    return out.view(scales.dtype)


def _expected_shapes(e: int, h: int, i: int) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    return {
        "w13_codes": ((e, 2 * i, h // 2), torch.uint8),
        "w13_scales": ((e, 2 * i, h // 16), torch.float8_e4m3fn),
        "w13_global": ((e, 2), torch.float32),
        "w2_codes": ((e, h, i // 2), torch.uint8),
        "w2_scales": ((e, h, i // 16), torch.float8_e4m3fn),
        "w2_global": ((e,), torch.float32),
        "a13_scale": ((e,), torch.float32),
        "a2_scale": ((e,), torch.float32),
    }


def _check_keys(tensors: dict[str, torch.Tensor]) -> None:
    missing = [k for k in _TENSOR_NAMES if k not in tensors]
    if missing:
        raise ValueError(f"tensors: missing {missing}")
    unknown = sorted(set(tensors) - set(_TENSOR_NAMES) - set(_OPTIONAL_NAMES))
    if unknown:
        raise ValueError(f"tensors: unknown keys {unknown}")


def _validate_linear(t: dict[str, torch.Tensor]) -> None:
    for k, v in t.items():
        if not isinstance(v, torch.Tensor):
            raise TypeError(f"{k}: expected a torch.Tensor, got {type(v).__name__}")
    c = t["w13_codes"]
    if c.dim() != 3:
        raise ValueError(f"w13_codes: expected [E, 2I, H/2], got shape {tuple(c.shape)}")
    e, two_i, half_h = c.shape
    if two_i % 2 or (two_i // 2) % 32 or (half_h * 2) % 32:
        raise ValueError(
            f"w13_codes: H and I must be multiples of 32, got H={half_h * 2}, I={two_i // 2}"
        )
    expected = _expected_shapes(e, half_h * 2, two_i // 2)
    device = c.device
    for k, v in t.items():
        shape, dtype = expected[k]
        if tuple(v.shape) != shape or v.dtype != dtype:
            raise ValueError(f"{k}: expected {dtype} {list(shape)}, got {v.dtype} {list(v.shape)}")
        if v.device != device:
            raise ValueError(f"{k}: on {v.device}, but w13_codes is on {device}")
    if ("a13_scale" in t) != ("a2_scale" in t):
        raise ValueError("a13_scale, a2_scale: give both static activation scales or neither")
    for k in _OPTIONAL_NAMES:
        if k in t and (not bool(torch.isfinite(t[k]).all()) or bool((t[k] <= 0).any())):
            raise ValueError(f"{k}: static activation scales must be finite and positive")


# ------------------------------------------------------------------------------ prepare


def _check_weights(w: torch.Tensor, name: str, dims: int = 3) -> None:
    if not isinstance(w, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(w).__name__}")
    if w.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise TypeError(f"{name}: expected bfloat16, float16 or float32, got {w.dtype}")
    if w.dim() != dims:
        raise ValueError(f"{name}: expected {dims} dimensions, got shape {tuple(w.shape)}")
    if not bool(torch.isfinite(w).all()):
        raise ValueError(f"{name}: contains NaN or Inf; refusing to quantize it")


def _static_scale(s: torch.Tensor | float | None, e: int, name: str, device) -> torch.Tensor | None:
    if s is None:
        return None
    t = torch.as_tensor(s, dtype=torch.float32, device=device)
    if t.dim() == 0:
        t = t.expand(e).clone()
    if tuple(t.shape) != (e,):
        raise ValueError(f"{name}: expected a scalar or shape [{e}], got {tuple(t.shape)}")
    if not bool(torch.isfinite(t).all()) or bool((t <= 0).any()):
        raise ValueError(f"{name}: static activation scales must be finite and positive")
    return t.contiguous().clone()  # own it: never alias the caller's tensor


def prepare_experts(
    w13: torch.Tensor,
    w2: torch.Tensor,
    *,
    a13_scale: torch.Tensor | float | None = None,
    a2_scale: torch.Tensor | float | None = None,
) -> PreparedExperts:
    """Quantize SwiGLU expert weights to NVFP4 once, for every execution mode.

    Args:
        w13: bf16/fp16/fp32 [E, 2I, H]: I gate rows, then I up rows, per expert.
        w2: bf16/fp16/fp32 [E, H, I].
        a13_scale: optional calibrated decode global scale of the FC1 input (W4A4 static),
            a scalar or fp32 [E].
        a2_scale: the same for the FC2 input; give both or neither.

    Returns:
        PreparedExperts on the device of ``w13``. Gate, up and down matrices of each expert
        each get their own global scale (amax / 2688).
    """
    _check_weights(w13, "w13")
    _check_weights(w2, "w2")
    e, two_i, h = w13.shape
    if two_i % 2:
        raise ValueError(f"w13: dimension 1 must be 2*I (gate rows then up rows), got {two_i}")
    i = two_i // 2
    if h % 32 or i % 32:
        raise ValueError(f"w13: H and I must be multiples of 32, got H={h}, I={i}")
    if tuple(w2.shape) != (e, h, i):
        raise ValueError(f"w2: expected shape [E={e}, H={h}, I={i}], got {tuple(w2.shape)}")
    if w2.device != w13.device:
        raise ValueError(f"w2: on {w2.device}, but w13 is on {w13.device}")
    if (a13_scale is None) != (a2_scale is None):
        raise ValueError("a13_scale, a2_scale: give both static activation scales or neither")

    gate_up = w13.unflatten(1, (2, i))  # [E, 2, I, H]
    g13 = global_from_amax(gate_up.abs().amax(dim=(2, 3)))  # [E, 2]
    codes13, scales13 = quantize_blocks(gate_up, g13[:, :, None].expand(e, 2, i))
    g2 = global_from_amax(w2.abs().amax(dim=(1, 2)))  # [E]
    codes2, scales2 = quantize_blocks(w2, g2[:, None].expand(e, h))
    return PreparedExperts(
        w13_codes=to_fields(codes13.flatten(1, 2)),
        w13_scales=scales13.flatten(1, 2).contiguous(),
        w13_global=g13.contiguous(),
        w2_codes=to_fields(codes2),
        w2_scales=scales2.contiguous(),
        w2_global=g2.contiguous(),
        a13_scale=_static_scale(a13_scale, e, "a13_scale", w13.device),
        a2_scale=_static_scale(a2_scale, e, "a2_scale", w13.device),
    )


def load_experts(
    path: str | os.PathLike, device: torch.device | str | None = None
) -> PreparedExperts:
    """Read a file written by :meth:`PreparedExperts.save`.

    Args:
        path: the safetensors file.
        device: where to place the tensors (default CPU).

    Raises:
        ValueError: a foreign, truncated or corrupt file, or one of a newer layout version.
    """
    from safetensors import safe_open

    path = os.fspath(path)
    if not os.path.isfile(path):
        raise ValueError(f"path: no such file {path!r}")
    try:
        with safe_open(path, framework="pt", device="cpu") as f:
            meta = f.metadata() or {}
            linear = _check_metadata(meta, path)
            tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118
    except ValueError:
        raise
    except Exception as exc:  # safetensors raises its own error types for bad headers
        raise ValueError(f"path: {path!r} is truncated or not a safetensors file ({exc})") from exc
    try:
        declared = json.loads(meta["tensors"])
        meta_dims = tuple(int(meta[k]) for k in ("num_experts", "hidden_size", "intermediate_size"))
    except ValueError:
        raise ValueError(f"path: {path!r} has corrupt metadata (tensors or sizes)") from None
    if not isinstance(declared, dict):
        raise ValueError(f"path: {path!r} has corrupt metadata (tensors is not a mapping)")
    if sorted(declared) != sorted(tensors):
        raise ValueError(
            f"path: {path!r} declares tensors {sorted(declared)}, holds {sorted(tensors)}"
        )
    try:
        if linear:
            experts = PreparedExperts.from_linear(tensors)
        else:
            _check_keys(tensors)
            experts = PreparedExperts(**tensors)
        check_block_scales(experts)
    except (ValueError, TypeError) as exc:
        raise ValueError(f"path: {path!r} holds inconsistent tensors: {exc}") from exc
    dims = (experts.num_experts, experts.hidden_size, experts.intermediate_size)
    if dims != meta_dims:
        raise ValueError(f"path: {path!r} metadata shapes disagree with its tensors")
    return experts.to(device) if device is not None else experts


def validate_block_scales(scales: torch.Tensor, name: str) -> None:
    """Block scales (e4m3, or their uint8 bits) hold no NaN and no negative value
    (float8_e4m3fn has no Inf; its NaN is 0x7F / 0xFF). Raises ValueError naming ``name``."""
    bits = scales.view(torch.uint8)
    if bool(((bits & 0x7F) == 0x7F).any()):
        raise ValueError(f"{name}: block scales hold NaN")
    if bool(((bits & 0x80) != 0).logical_and((bits & 0x7F) != 0).any()):
        raise ValueError(f"{name}: block scales must be non-negative, found negative values")


def check_block_scales(experts: PreparedExperts) -> None:
    """The check every loader of prepared experts runs (files of :meth:`PreparedExperts.save`
    here; ModelOpt and compressed-tensors checkpoints run :func:`validate_block_scales` key
    by key): no NaN or negative block scale, every global scale finite and positive.
    Raises ValueError naming the tensor.

    One pass over the scale bytes (a sixteenth of the codes), on the experts' device.
    """
    for name in ("w13_scales", "w2_scales"):
        validate_block_scales(getattr(experts, name), name)
    for name in ("w13_global", "w2_global"):
        g = getattr(experts, name)
        if not bool(torch.isfinite(g).all()) or bool((g <= 0).any()):
            raise ValueError(f"{name}: global scales must be finite and positive")


def _check_metadata(meta: dict[str, str], path: str) -> bool:
    """Checks a file's metadata; True where its tensors are the linear form (version 1)."""
    if meta.get("format") != FORMAT_NAME:
        raise ValueError(
            f"path: {path!r} is not an fp4moe prepared-experts file "
            f"(format {meta.get('format')!r}, expected {FORMAT_NAME!r})"
        )
    try:
        version = int(meta.get("layout_version", ""))
    except ValueError:
        raise ValueError(f"path: {path!r} has no valid layout_version") from None
    if version > LAYOUT_VERSION:
        raise ValueError(
            f"path: {path!r} has layout version {version}, newer than this fp4moe reads "
            f"({LAYOUT_VERSION}); upgrade fp4moe"
        )
    if version < 1:
        raise ValueError(f"path: {path!r} has an invalid layout version {version}")
    want = _LINEAR_NAME if version == 1 else LAYOUT_NAME
    if meta.get("layout") != want:
        raise ValueError(
            f"path: {path!r} has layout {meta.get('layout')!r} at version {version}; this "
            f"fp4moe reads {_LINEAR_NAME!r} (version 1) and {LAYOUT_NAME!r} (version "
            f"{LAYOUT_VERSION})"
        )
    for key in ("num_experts", "hidden_size", "intermediate_size", "tensors"):
        if key not in meta:
            raise ValueError(f"path: {path!r} metadata lacks {key!r}")
    return version == 1
