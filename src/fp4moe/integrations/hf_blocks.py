"""The transformers MoE blocks fp4moe replaces, and the block that replaces them.

Supported blocks (transformers 5.x, checked against 5.24; the routing formulas are those of
the models' own ``*TopKRouter`` modules):

======================== ================================================================
block class              router (``RouterConfig``) and what the wrapper adds
======================== ================================================================
Qwen3MoeSparseMoeBlock   logits = x @ W.T in the model dtype; ``"softmax"`` in fp32, top-k,
                         ``renormalize = norm_topk_prob``; the weights are then rounded to
                         the logits dtype, as ``Qwen3MoeTopKRouter`` does
MixtralSparseMoeBlock    logits in the model dtype; ``"softmax"`` in fp32, top-k,
                         renormalize (exactly Mixtral's order of operations)
DeepseekV3MoE            logits = fp32(x) @ fp32(W).T; ``"sigmoid_grouped"`` with
                         ``n_group``, ``topk_group``, ``e_score_correction_bias``,
                         ``renormalize = norm_topk_prob``, ``routed_scaling_factor``;
                         ``shared_experts`` (the model's bf16 MLP) added to the output
======================== ================================================================

gpt-oss (``GptOssMLP``) and any other block that owns an ``experts`` module are refused
with ``NotImplementedError``: fp4moe computes plain SwiGLU, ``silu(gate) * up``, without
expert biases, and converting anything else would give wrong outputs.

The state dict of an :class:`FP4MoEBlock` holds its experts in the ModelOpt NVFP4 layout
under the block's own path, ``{block}.experts.{e}.{gate_proj|up_proj|down_proj}.{weight,
weight_scale, weight_scale_2, input_scale}`` (Mixtral: ``w1``, ``w3``, ``w2``), as views
of the layer's buffers; ``load_state_dict`` reads that layout (or compressed-tensors) back.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ..checkpoint_source import CheckpointSource
from ..checkpoints import load_checkpoint_experts, modelopt_expert_tensors
from ..experts import PreparedExperts, prepare_experts
from ..ops import EXPERT_FIELDS
from ..phases import MoELayer, PhaseConfig, PhasePolicy, RouterConfig

__all__ = [
    "ARCHS",
    "SUPPORTED_BLOCKS",
    "Arch",
    "Checkpoint",
    "FP4MoEBlock",
    "arch_of",
    "block_over",
    "check_block",
    "convert_block",
    "expert_prefix",
    "expert_weights",
    "find_blocks",
    "replace_module",
]

# What convert and convert_block read NVFP4 experts from.
Checkpoint = str | os.PathLike | Mapping[str, torch.Tensor] | CheckpointSource


@dataclass(frozen=True)
class Arch:
    """What differs between the supported blocks."""

    name: str
    router_class: str  # the router module class whose forward the settings reproduce
    method: str
    logits_fp32: bool  # logits = fp32(x) @ fp32(W).T (DeepSeek) rather than in x's dtype
    weights_in_logits_dtype: bool  # Qwen3 casts the routing weights to the logits dtype
    shared_experts: bool
    # The expert projections' names on disk (gate, up, down).
    expert_names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")
    # Module path part -> on-disk part, for checkpoints written with older module names.
    checkpoint_alias: tuple[str, str] | None = None


ARCHS: dict[str, Arch] = {
    "Qwen3MoeSparseMoeBlock": Arch(
        "qwen3_moe", "Qwen3MoeTopKRouter", "softmax", False, True, False
    ),
    # transformers 5 renames Mixtral's ``block_sparse_moe`` to ``mlp`` when loading; ModelOpt
    # exports and original checkpoints keep ``block_sparse_moe.experts.{e}.w1``.
    "MixtralSparseMoeBlock": Arch(
        "mixtral",
        "MixtralTopKRouter",
        "softmax",
        False,
        False,
        False,
        ("w1", "w3", "w2"),
        ("mlp", "block_sparse_moe"),
    ),
    "DeepseekV3MoE": Arch(
        "deepseek_v3", "DeepseekV3TopkRouter", "sigmoid_grouped", True, False, True
    ),
}

SUPPORTED_BLOCKS: tuple[str, ...] = tuple(ARCHS)

UNSUPPORTED: dict[str, str] = {
    "GptOssMLP": (
        "gpt-oss experts compute a clamped SwiGLU, (clamp(up) + 1) * g * sigmoid(alpha * g) "
        "with g = clamp(gate), from interleaved gate/up columns plus per-expert biases; "
        "fp4moe implements plain SwiGLU, silu(gate) * up, without biases"
    ),
}


# ------------------------------------------------------------------------------ the block


class FP4MoEBlock(nn.Module):
    """A transformers sparse MoE block running on fp4moe: drop-in, same call and output.

    Attributes:
        moe: the :class:`fp4moe.MoELayer` (NVFP4 experts, router settings, phase policy,
            ``stats`` counters of calls and tokens a phase).
        gate: the model's own router module (its ``weight`` [E, H] and, DeepSeek-V3, its
            ``e_score_correction_bias`` [E]); kept so that state-dict names stay the model's.
        shared_experts: DeepSeek-V3's shared expert MLP (the model's module, bf16), or None.
        arch: ``"qwen3_moe"``, ``"mixtral"`` or ``"deepseek_v3"``.
        source_class: the class name of the block this one replaced.
        expert_names: the expert projections' names in the state dict (gate, up, down).
    """

    # state-dict version 2: the layer's codes in the fields layout (as MoELayer's)
    _version = 2

    def __init__(
        self,
        moe: MoELayer,
        gate: nn.Module,
        *,
        arch: str,
        source_class: str,
        logits_fp32: bool,
        weights_in_logits_dtype: bool,
        shared_experts: nn.Module | None = None,
        expert_names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj"),
    ) -> None:
        super().__init__()
        self.moe = moe
        self.gate = gate
        self.shared_experts = shared_experts
        self.arch = arch
        self.source_class = source_class
        self.logits_fp32 = logits_fp32
        self.weights_in_logits_dtype = weights_in_logits_dtype
        self.expert_names = tuple(expert_names)
        self.register_state_dict_post_hook(_modelopt_state_dict)
        self.register_load_state_dict_pre_hook(_load_modelopt_state_dict)
        self.register_load_state_dict_post_hook(_name_missing_experts)

    @property
    def experts(self) -> PreparedExperts:
        """The prepared NVFP4 experts (E experts, H hidden, I intermediate)."""
        return self.moe.experts

    def router_logits(self, x2d: torch.Tensor) -> torch.Tensor:
        """Router logits [T, E] of x2d [T, H], computed as the model's router computes them
        (in the dtype of x2d, or in fp32 for DeepSeek-V3).

        A router module with hooks (transformers' capture of ``output_router_logits``,
        accelerate's offloading) is called itself, and its logits used, so that the hooks
        see it run; otherwise its weight is used directly (its top-k would be wasted)."""
        gate = self.gate
        if gate._forward_hooks or gate._forward_pre_hooks:
            out = gate(x2d)
            return out[0] if isinstance(out, tuple) else out
        w = gate.weight
        if self.logits_fp32:
            return F.linear(x2d.float(), w.float())
        return F.linear(x2d, w)

    def route(self, x2d: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Routes of x2d [T, H]: (int32 [T, K] expert ids, fp32 [T, K] weights), the same
        experts and weights as the model's own router gives (DeepSeek-V3: with the gate's
        own ``e_score_correction_bias``)."""
        logits = self.router_logits(x2d)
        bias = getattr(self.gate, "e_score_correction_bias", None)
        ids, weights = self.moe.router.route(logits, None if bias is None else bias.float())
        if self.weights_in_logits_dtype:
            weights = weights.to(logits.dtype).float()
        return ids, weights

    def forward(self, hidden_states: torch.Tensor, phase: str | None = None) -> torch.Tensor:
        """hidden_states [B, S, H] (or [T, H]), any float dtype -> the same shape and dtype.

        phase: "prefill", "decode", or None (the ``serving_phase`` setting, which the phase
        hooks of ``convert`` set, else the policy's token-count threshold)."""
        shape = hidden_states.shape
        x2d = hidden_states.reshape(-1, shape[-1])
        routes = self.route(x2d)
        out = self.moe(x2d.to(torch.bfloat16), phase, routes=routes)
        out = out.to(hidden_states.dtype).reshape(shape)
        if self.shared_experts is not None:
            out = out + self.shared_experts(hidden_states)
        return out

    def extra_repr(self) -> str:
        return f"arch={self.arch}, replaces={self.source_class}"


def _modelopt_state_dict(
    block: FP4MoEBlock, state_dict: dict[str, Any], prefix: str, local_metadata: dict
) -> None:
    """State-dict post-hook: the layer's expert buffers under ModelOpt names (the scales
    views, the codes linear copies on the CPU: ``modelopt_expert_tensors``)."""
    for f in EXPERT_FIELDS:
        state_dict.pop(f"{prefix}moe.{f}", None)
    tensors = modelopt_expert_tensors(
        block.experts, prefix=f"{prefix}experts", names=block.expert_names, codes_device="cpu"
    )
    state_dict.update(tensors)


def _load_modelopt_state_dict(
    block: FP4MoEBlock, state_dict: dict[str, Any], prefix: str, *args: Any
) -> None:
    """Load-state-dict pre-hook: experts in the ModelOpt (or compressed-tensors) layout
    become the layer's buffer entries; a state dict with the buffer names loads as it is.
    The entries carry the codes in the layout the state dict's version says (linear where
    an earlier fp4moe's says version 1, for this block and its layer: the layer converts
    them)."""
    base = f"{prefix}experts"
    block._load_prefix = prefix  # for _name_missing_experts
    keys = [k for k in state_dict if k.startswith(base + ".")]
    if not keys:
        return
    sub = {k: state_dict.pop(k) for k in keys}
    loaded = load_checkpoint_experts(sub, prefix=base, num_experts=block.experts.num_experts)
    version = args[0].get("version") if args and isinstance(args[0], Mapping) else None
    tensors = loaded.to_linear() if version is not None and version < 2 else loaded.tensors()
    for f in EXPERT_FIELDS:
        t = tensors.get(f)
        if t is not None:
            state_dict[f"{prefix}moe.{f}"] = t


def _name_missing_experts(block: FP4MoEBlock, incompatible: Any) -> None:
    """Load-state-dict post-hook: missing experts are reported under the state dict's
    names (``{block}.experts.*``), not the layer's buffer names."""
    prefix = block.__dict__.pop("_load_prefix", None)
    if prefix is None:
        return
    inner = {f"{prefix}moe.{f}" for f in EXPERT_FIELDS}
    missing = incompatible.missing_keys
    if any(k in inner for k in missing):
        missing[:] = [k for k in missing if k not in inner] + [f"{prefix}experts.*"]


# ------------------------------------------------------------------------------ convert


def convert_block(
    block: nn.Module,
    policy: PhasePolicy | PhaseConfig | str | None = None,
    *,
    checkpoint: Checkpoint | None = None,
    prefix: str | None = None,
    expert_dtype: torch.dtype | None = None,
    device: torch.device | str | None = None,
) -> FP4MoEBlock:
    """Build the :class:`FP4MoEBlock` that replaces one sparse MoE block (the block itself
    is not modified).

    Args:
        block: a ``Qwen3MoeSparseMoeBlock``, ``MixtralSparseMoeBlock`` or ``DeepseekV3MoE``
            whose ``experts`` hold fused weights ``gate_up_proj`` [E, 2I, H] (I gate rows,
            then I up rows) and ``down_proj`` [E, H, I] (or their transposes, or interleaved
            gate/up rows, as the experts module's ``is_transposed`` / ``is_concatenated``
            flags say). H and I must be multiples of 32.
        policy: the phase policy of the new MoELayer (default ``PhasePolicy()``).
        checkpoint: None to quantize the block's own weights, else an NVFP4 checkpoint (a
            safetensors file, an HF checkpoint directory, or a state dict) read with
            ``load_checkpoint_experts(checkpoint, prefix=prefix, num_experts=E)``; the
            block's expert tensors are then never read (they may be on the meta device).
        prefix: the checkpoint's module path of this block's experts, e.g.
            ``"model.layers.3.mlp.experts"``; required with ``checkpoint``.
        expert_dtype: cast the block's expert weights to this dtype before quantizing
            (e.g. ``torch.bfloat16`` to quantize exactly what a bf16 checkpoint holds);
            None quantizes them as stored. Not used with ``checkpoint``.
        device: with ``checkpoint``, where the experts are read to (default: the device of
            the router weight, the CPU if that is on meta).

    Returns:
        The new block. Its experts live on the device of the block's expert weights, or
        with ``checkpoint`` on ``device``.

    Raises:
        NotImplementedError: an unsupported block, router or expert computation (biases,
            another activation or gating, no fused weights).
        ValueError: weights on the meta device without a checkpoint, a missing prefix,
            checkpoint shapes that do not match the model.
    """
    cls = type(block).__name__
    _, gate = check_block(block)
    w13, w2 = expert_weights(block, materialize=checkpoint is None)
    e, two_i, h = w13.shape
    if device is None:
        device = gate.weight.device if gate.weight.device.type != "meta" else "cpu"

    if checkpoint is None:
        if w13.device.type == "meta" or w2.device.type == "meta":
            raise ValueError(
                f"{cls}: the expert weights are on the meta device; pass checkpoint= to read "
                "NVFP4 experts from a file"
            )
        if expert_dtype is not None:
            w13, w2 = w13.to(expert_dtype), w2.to(expert_dtype)
        with torch.no_grad():
            prepared = prepare_experts(w13.detach(), w2.detach())
    else:
        if not isinstance(prefix, str) or not prefix:
            raise ValueError("prefix: the experts' module path in the checkpoint is required")
        prepared = load_checkpoint_experts(checkpoint, prefix=prefix, num_experts=e, device=device)
        if (prepared.hidden_size, prepared.intermediate_size) != (h, two_i // 2):
            raise ValueError(
                f"checkpoint: experts under {prefix!r} have H={prepared.hidden_size}, "
                f"I={prepared.intermediate_size}; the model's {cls} has H={h}, I={two_i // 2}"
            )
    del w13, w2
    return block_over(block, prepared, policy)


def block_over(
    block: nn.Module, prepared: PreparedExperts, policy: PhasePolicy | PhaseConfig | str | None
) -> FP4MoEBlock:
    """The :class:`FP4MoEBlock` of a supported block over experts already prepared (the
    block's router, shared experts and routing settings; its expert weights unread).
    :func:`convert_block` reads or quantizes the experts, then calls this."""
    cls = type(block).__name__
    arch = arch_of(block)
    gate = block.gate
    policy = PhasePolicy.coerce(policy if policy is not None else PhasePolicy())
    if arch.method == "sigmoid_grouped":
        router = RouterConfig(
            method="sigmoid_grouped", top_k=int(gate.top_k), renormalize=bool(gate.norm_topk_prob),
            n_group=int(gate.num_group), topk_group=int(gate.topk_group),
            scaling_factor=float(gate.routed_scaling_factor),
        )  # fmt: skip
    else:
        renormalize = bool(getattr(gate, "norm_topk_prob", True))  # Mixtral: always
        router = RouterConfig(method="softmax", top_k=int(gate.top_k), renormalize=renormalize)
    # The DeepSeek correction bias stays the gate's own (FP4MoEBlock.route reads it there),
    # so that load_state_dict and .to() of the model reach it.
    layer = MoELayer(prepared, router, policy=policy)
    shared = block.shared_experts if arch.shared_experts else None
    return FP4MoEBlock(
        layer, gate, arch=arch.name, source_class=cls, logits_fp32=arch.logits_fp32,
        weights_in_logits_dtype=arch.weights_in_logits_dtype, shared_experts=shared,
        expert_names=arch.expert_names,
    )  # fmt: skip


# ------------------------------------------------------------------------------ checks


def arch_of(block: nn.Module) -> Arch:
    """The :class:`Arch` of a supported block; NotImplementedError naming what fp4moe
    cannot compute for any other."""
    cls = type(block).__name__
    if cls in ARCHS:
        return ARCHS[cls]
    if cls in UNSUPPORTED:
        raise NotImplementedError(f"{cls}: not supported by fp4moe: {UNSUPPORTED[cls]}")
    raise NotImplementedError(
        f"{cls}: not a supported MoE block (supported: {', '.join(SUPPORTED_BLOCKS)})"
    )


def _is_silu(act: Any) -> bool:
    return isinstance(act, nn.SiLU) or type(act).__name__ == "SiLUActivation"


def check_block(block: nn.Module) -> tuple[Arch, nn.Module]:
    """(arch, router module) of a block fp4moe can compute exactly; raises otherwise.
    Reads no weight values (they may be on the meta device)."""
    cls = type(block).__name__
    arch = arch_of(block)
    gate = getattr(block, "gate", None)
    if not isinstance(gate, nn.Module) or type(gate).__name__ != arch.router_class:
        raise NotImplementedError(
            f"{cls}: expected its router `gate` to be a {arch.router_class}, got "
            f"{type(gate).__name__}; this transformers version routes differently from the "
            "one fp4moe reproduces"
        )
    if arch.shared_experts and not isinstance(getattr(block, "shared_experts", None), nn.Module):
        raise NotImplementedError(f"{cls}: expected a `shared_experts` module")
    w13, _ = expert_weights(block, materialize=False)
    _, two_i, h = w13.shape
    if h % 32 or (two_i // 2) % 32:
        raise ValueError(
            f"{cls}: fp4moe needs the hidden size H and the expert intermediate size I to be "
            f"multiples of 32, got H={h}, I={two_i // 2}"
        )
    return arch, gate


def expert_weights(block: nn.Module, materialize: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """The block's experts as (w13 [E, 2I, H], gate rows then up rows; w2 [E, H, I]): views
    of the model's tensors where the layout allows (interleaved gate/up rows are copied
    when ``materialize``), after checking the computation is plain SwiGLU without biases."""
    cls = type(block).__name__
    ex = getattr(block, "experts", None)
    gu = getattr(ex, "gate_up_proj", None)
    down = getattr(ex, "down_proj", None)
    if not isinstance(gu, torch.Tensor) or not isinstance(down, torch.Tensor) or gu.dim() != 3:
        raise NotImplementedError(
            f"{cls}: expected fused experts `experts.gate_up_proj` and `experts.down_proj` "
            f"(3-D, the transformers 5 layout), got {type(ex).__name__} with "
            f"gate_up_proj={type(gu).__name__}"
        )
    exc = type(ex).__name__
    if getattr(ex, "has_bias", False) or any(
        isinstance(getattr(ex, n, None), torch.Tensor)
        for n in ("gate_up_proj_bias", "down_proj_bias")
    ):
        raise NotImplementedError(f"{exc}: experts with biases are not supported by fp4moe")
    if not getattr(ex, "has_gate", True) or getattr(ex, "has_post_expert_norm", False):
        raise NotImplementedError(f"{exc}: only gated experts without a post-expert norm")
    apply_gate = getattr(type(ex), "_apply_gate", None)
    if apply_gate is not None and getattr(apply_gate, "__name__", "") != "_default_apply_gate":
        raise NotImplementedError(f"{exc}: a custom gating function is not supported by fp4moe")
    if not _is_silu(getattr(ex, "act_fn", None)):
        raise NotImplementedError(
            f"{exc}: activation {type(getattr(ex, 'act_fn', None)).__name__}; fp4moe computes "
            "SwiGLU (silu) only"
        )
    if getattr(ex, "is_transposed", False):  # [E, H, 2I] and [E, I, H]
        gu, down = gu.transpose(1, 2), down.transpose(1, 2)
    e, two_i, h = gu.shape
    if two_i % 2 or tuple(down.shape) != (e, h, two_i // 2):
        raise NotImplementedError(
            f"{exc}: gate_up_proj {tuple(gu.shape)} and down_proj {tuple(down.shape)} are not "
            "[E, 2I, H] and [E, H, I]"
        )
    if materialize and not getattr(ex, "is_concatenated", True):  # gate0, up0, gate1, ...
        gu = torch.cat((gu[:, 0::2], gu[:, 1::2]), dim=1)
    return gu, down


def find_blocks(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """(module path, block) of every supported MoE block of ``model``, outermost first.

    Raises NotImplementedError for a block fp4moe cannot compute (gpt-oss, or any module
    owning an ``experts`` module it does not know) and ValueError when there is none (or
    every block is converted already), both before anything is changed."""
    found: list[tuple[str, nn.Module]] = []
    refused: list[tuple[str, str, str]] = []
    already: list[str] = []
    inside: list[str] = []
    for name, m in model.named_modules():
        if any(name.startswith(p + ".") for p in inside):
            continue
        cls = type(m).__name__
        if isinstance(m, FP4MoEBlock):
            already.append(name)
        elif cls in ARCHS:
            found.append((name, m))
        elif cls in UNSUPPORTED:
            refused.append((name, cls, UNSUPPORTED[cls]))
        elif isinstance(getattr(m, "experts", None), nn.Module):
            refused.append((name, cls, f"supported blocks are {', '.join(SUPPORTED_BLOCKS)}"))
        else:
            continue
        inside.append(name)
    if refused:
        name, cls, why = refused[0]
        raise NotImplementedError(
            f"{cls} (at {name or 'the model itself'!r}): not supported by fp4moe: {why}; "
            "nothing was converted"
        )
    if not found:
        raise ValueError(
            "model: found no MoE block to convert ("
            + (f"{len(already)} already converted" if already else f"looked for {SUPPORTED_BLOCKS}")
            + ")"
        )
    if any(name == "" for name, _ in found):
        raise ValueError("model: is itself an MoE block; use convert_block(block) instead")
    return found


def replace_module(model: nn.Module, name: str, new: nn.Module) -> None:
    """Put ``new`` at module path ``name`` of ``model`` (lists and sequences by index)."""
    parent_name, _, child = name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    if isinstance(parent, (nn.ModuleList, nn.Sequential)):
        parent[int(child)] = new
    else:
        setattr(parent, child, new)


def expert_prefix(
    name: str, arch: Arch, keys: set[str], mapping: Callable[[str], str] | None
) -> str:
    """The checkpoint prefix of the experts of the block at ``name``, among the checkpoint's
    ``keys``: ``mapping(name)`` when given, else ``"{name}.experts"`` or the on-disk alias
    (Mixtral's ``block_sparse_moe``). ValueError naming what was looked for otherwise."""
    if mapping is not None:
        candidates = [mapping(name)]
    else:
        candidates = [f"{name}.experts"]
        if arch.checkpoint_alias is not None:
            module_part, disk_part = arch.checkpoint_alias
            head, _, last = name.rpartition(".")
            if last == module_part:
                candidates.append(f"{head}.{disk_part}.experts" if head else f"{disk_part}.experts")
    firsts = [
        f"{c}.0.{proj}.{leaf}"
        for c in candidates
        for proj in ("gate_proj", "w1")
        for leaf in ("weight", "weight_packed")
    ]
    for c in candidates:
        if any(k.startswith(f"{c}.0.") for k in firsts if k in keys):
            return c
    raise ValueError(
        f"checkpoint: no NVFP4 experts for block {name!r}: looked for keys like {firsts[0]!r} "
        f"under {candidates}; pass checkpoint_prefix= to map module paths to checkpoint names"
    )
