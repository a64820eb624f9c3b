"""Hugging Face transformers 5.x: run MoE models on fp4moe layers.

:func:`convert` replaces every sparse MoE block of a transformers model, in place, by an
:class:`FP4MoEBlock`: the model's own router (its ``gate`` module, kept as it is), an
:class:`fp4moe.MoELayer` over NVFP4 experts whose router settings reproduce the model's
routing code, and (DeepSeek-V3) the model's own bf16 shared experts. The expert weights
come from the model (quantized once with :func:`fp4moe.prepare_experts`) or from an NVFP4
checkpoint (ModelOpt or compressed-tensors layout, :func:`fp4moe.load_checkpoint_experts`);
the model's own expert tensors are dropped with the replaced block.

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

Numerics inside a converted block follow SPEC.md (fp32 accumulation, one bf16 rounding of
each route row, routes summed in fp32 in ascending k): they differ from the model's own
bf16 expert loop by bf16 rounding only (W4A16) or by the activation quantization (W4A4).
Activations enter the experts in bf16 whatever the model dtype; the output is cast back.

Phase inference (installed by :func:`convert`, rule in :func:`infer_phase`): a forward
pre-hook on the converted model sets ``fp4moe.serving_phase`` for the duration of each
forward call (a forward hook, run even when the forward raises, restores it):

* ``"prefill"`` when the call feeds more than one token a sequence (a prompt, a chunk of a
  prompt, or several tokens after a cache), or one token into an absent or empty cache;
* ``"decode"`` when it feeds one token a sequence into a cache that already holds tokens.

In ``model.generate`` the prompt pass is therefore prefill and every later step decode.
A phase set by the caller (``with fp4moe.serving_phase("decode"): model.generate(...)``)
is never overridden; with ``infer_phase=False`` (or without the hook) each MoELayer falls
back to its policy's ``decode_max_tokens`` threshold on the tokens of the call.
Converted blocks are for inference: no gradient reaches the NVFP4 experts.
"""

from __future__ import annotations

import inspect
import os
import threading
from collections.abc import Callable, Mapping
from contextlib import ExitStack, suppress
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ..checkpoints import _Source, load_checkpoint_experts
from ..experts import PreparedExperts, prepare_experts
from ..phases import MoELayer, PhaseConfig, PhasePolicy, RouterConfig, _current_phase

__all__ = [
    "SUPPORTED_BLOCKS",
    "FP4MoEBlock",
    "convert",
    "convert_block",
    "infer_phase",
    "install_phase_hooks",
    "moe_layers",
    "remove_phase_hooks",
]

Checkpoint = str | os.PathLike | Mapping[str, torch.Tensor]


@dataclass(frozen=True)
class _Arch:
    """What differs between the supported blocks."""

    name: str
    router_class: str  # the router module class whose forward the settings reproduce
    method: str
    logits_fp32: bool  # logits = fp32(x) @ fp32(W).T (DeepSeek) rather than in x's dtype
    weights_in_logits_dtype: bool  # Qwen3 casts the routing weights to the logits dtype
    shared_experts: bool
    # Module path part -> on-disk part, for checkpoints written with older module names.
    checkpoint_alias: tuple[str, str] | None = None


_ARCHS: dict[str, _Arch] = {
    "Qwen3MoeSparseMoeBlock": _Arch(
        "qwen3_moe", "Qwen3MoeTopKRouter", "softmax", False, True, False
    ),
    # transformers 5 renames Mixtral's ``block_sparse_moe`` to ``mlp`` when loading; ModelOpt
    # exports and original checkpoints keep ``block_sparse_moe.experts.{e}.w1``.
    "MixtralSparseMoeBlock": _Arch(
        "mixtral", "MixtralTopKRouter", "softmax", False, False, False, ("mlp", "block_sparse_moe")
    ),
    "DeepseekV3MoE": _Arch(
        "deepseek_v3", "DeepseekV3TopkRouter", "sigmoid_grouped", True, False, True
    ),
}

SUPPORTED_BLOCKS: tuple[str, ...] = tuple(_ARCHS)

_UNSUPPORTED: dict[str, str] = {
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
    """

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
    ) -> None:
        super().__init__()
        self.moe = moe
        self.gate = gate
        self.shared_experts = shared_experts
        self.arch = arch
        self.source_class = source_class
        self.logits_fp32 = logits_fp32
        self.weights_in_logits_dtype = weights_in_logits_dtype

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
        experts and weights as the model's own router gives."""
        logits = self.router_logits(x2d)
        ids, weights = self.moe.route(x2d, router_logits=logits)
        if self.weights_in_logits_dtype:
            weights = weights.to(logits.dtype).float()
        return ids, weights

    def forward(self, hidden_states: torch.Tensor, phase: str | None = None) -> torch.Tensor:
        """hidden_states [B, S, H] (or [T, H]), any float dtype -> the same shape and dtype.

        phase: "prefill", "decode", or None (the ``serving_phase`` context, which the phase
        hook of :func:`convert` sets, else the policy's token-count threshold)."""
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


# ------------------------------------------------------------------------------ convert


def convert_block(
    block: nn.Module,
    policy: PhasePolicy | PhaseConfig | str | None = None,
    *,
    checkpoint: Checkpoint | None = None,
    prefix: str | None = None,
    expert_dtype: torch.dtype | None = None,
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

    Returns:
        The new block. Its experts live on the device of the block's expert weights, or
        with ``checkpoint`` on that of its router weight (the CPU if that is on meta).

    Raises:
        NotImplementedError: an unsupported block, router or expert computation (biases,
            another activation or gating, no fused weights).
        ValueError: weights on the meta device without a checkpoint, a missing prefix,
            checkpoint shapes that do not match the model.
    """
    cls = type(block).__name__
    arch, gate = _check_block(block)
    policy = PhasePolicy.coerce(policy if policy is not None else PhasePolicy())
    w13, w2 = _expert_weights(block, materialize=checkpoint is None)
    e, two_i, h = w13.shape
    device = gate.weight.device if gate.weight.device.type != "meta" else torch.device("cpu")

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

    if arch.method == "sigmoid_grouped":
        router = RouterConfig(
            method="sigmoid_grouped", top_k=int(gate.top_k), renormalize=bool(gate.norm_topk_prob),
            n_group=int(gate.num_group), topk_group=int(gate.topk_group),
            scaling_factor=float(gate.routed_scaling_factor),
        )  # fmt: skip
        bias = gate.e_score_correction_bias.detach()
    else:
        renormalize = bool(getattr(gate, "norm_topk_prob", True))  # Mixtral: always
        router = RouterConfig(method="softmax", top_k=int(gate.top_k), renormalize=renormalize)
        bias = None
    layer = MoELayer(prepared, router, correction_bias=bias, policy=policy)
    if bias is not None:
        # A routing copy only: the gate's own buffer stays the one in the state dict.
        kept = layer.correction_bias
        del layer.correction_bias
        layer.register_buffer("correction_bias", kept, persistent=False)
    shared = block.shared_experts if arch.shared_experts else None
    return FP4MoEBlock(
        layer, gate, arch=arch.name, source_class=cls, logits_fp32=arch.logits_fp32,
        weights_in_logits_dtype=arch.weights_in_logits_dtype, shared_experts=shared,
    )  # fmt: skip


def convert(
    model: nn.Module,
    policy: PhasePolicy | PhaseConfig | str | None = None,
    checkpoint: Checkpoint | None = None,
    *,
    expert_dtype: torch.dtype | None = None,
    checkpoint_prefix: Callable[[str], str] | None = None,
    infer_phase: bool = True,
) -> nn.Module:
    """Replace every sparse MoE block of a transformers model by an :class:`FP4MoEBlock`,
    in place, and return the model.

    Args:
        model: a transformers 5.x model (``*ForCausalLM``, the bare ``*Model``, or any module
            containing the blocks) of Qwen3-MoE, Mixtral or DeepSeek-V3. Convert after
            loading its weights: routers keep referring to the model's gate modules, but the
            DeepSeek correction bias is copied for routing.
        policy: one ``PhasePolicy`` shared by every converted layer (default
            ``PhasePolicy()``: W4A4 per-token prefill, W4A16 decode), or one mode string
            for every phase (e.g. ``"w4a16"``).
        checkpoint: None to quantize the model's own bf16/fp32 expert weights; else an NVFP4
            checkpoint in ModelOpt or compressed-tensors layout (safetensors file, HF
            checkpoint directory, or state dict). Only the experts are read from it: the
            router, shared experts and all other weights stay the model's.
        expert_dtype: see :func:`convert_block`.
        checkpoint_prefix: maps a block's module path (``"model.layers.3.mlp"``) to its
            experts' prefix in the checkpoint. Default: ``"{path}.experts"``, and for
            Mixtral also the on-disk name ``"model.layers.3.block_sparse_moe.experts"``,
            whichever the checkpoint holds.
        infer_phase: install the phase hooks (module docstring, :func:`infer_phase`).

    Returns:
        ``model``. The replaced blocks' expert tensors are no longer referenced by it (they
        are freed unless the caller holds them); the model's other parameters are untouched.

    Raises:
        NotImplementedError: the model has an MoE block fp4moe cannot compute exactly
            (gpt-oss's ``GptOssMLP``, or any unknown block owning an ``experts`` module);
            raised before anything is changed.
        ValueError: no supported block found (or the model was already converted), the
            model itself is a block (use :func:`convert_block`), or a checkpoint holds no
            experts for a block.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model: expected a torch.nn.Module, got {type(model).__name__}")
    policy = PhasePolicy.coerce(policy if policy is not None else PhasePolicy())
    blocks = _find_blocks(model)
    # Every check that needs no weights runs before the first block changes, so that a
    # refused model is left as it was. Blocks are then converted one at a time: the extra
    # memory is one block's NVFP4 experts, never a second copy of the model's.
    prefixes: list[str | None] = []
    keys = _checkpoint_keys(checkpoint) if checkpoint is not None else None
    for name, block in blocks:
        arch, _ = _check_block(block)
        prefixes.append(
            None if keys is None else _checkpoint_prefix(name, arch, keys, checkpoint_prefix)
        )
    while blocks:
        (name, block), prefix = blocks.pop(0), prefixes.pop(0)
        new = convert_block(
            block, policy, checkpoint=checkpoint, prefix=prefix, expert_dtype=expert_dtype
        )
        _replace(model, name, new)
        del block, new  # the old block (and its experts) goes once the model lets go of it
    if infer_phase:
        install_phase_hooks(model)
    return model


def moe_layers(model: nn.Module) -> dict[str, MoELayer]:
    """The MoELayer of every converted block, keyed by the block's module path (for the
    ``stats`` counters, ``memory_report()``, or changing ``policy``)."""
    return {n: m.moe for n, m in model.named_modules() if isinstance(m, FP4MoEBlock)}


# ------------------------------------------------------------------------------ phases


def infer_phase(
    input_ids: torch.Tensor | None = None,
    inputs_embeds: torch.Tensor | None = None,
    cache: Any = None,
) -> str | None:
    """The serving phase of one model call, from what it is fed.

    Args:
        input_ids: [B, S] token ids, or None.
        inputs_embeds: [B, S, H] embeddings (used when ``input_ids`` is None), or None.
        cache: the KV cache passed to the model (the ``cache`` argument in transformers
            5.24, ``past_key_values`` in earlier releases; the hook reads either): a
            ``Cache`` (``get_seq_length()``), a legacy tuple of (key, value), or None.

    Returns:
        ``"prefill"`` when S > 1, or S == 1 and the cache is absent or empty;
        ``"decode"`` when S == 1 and the cache already holds tokens;
        None when neither ``input_ids`` nor ``inputs_embeds`` is given (nothing to infer).
    """
    if input_ids is not None:
        tokens = input_ids.shape[-1]
    elif inputs_embeds is not None:
        tokens = inputs_embeds.shape[-2]
    else:
        return None
    if tokens != 1:
        return "prefill"
    return "prefill" if _cache_is_empty(cache) else "decode"


def _cache_is_empty(cache: Any) -> bool:
    if cache is None:
        return True
    if hasattr(cache, "get_seq_length"):
        return int(cache.get_seq_length()) == 0
    if isinstance(cache, (tuple, list)):  # legacy ((k, v), ...) with k [B, heads, S, D]
        return len(cache) == 0 or int(cache[0][0].shape[-2]) == 0
    return False  # a cache object we cannot read: assume it holds the prompt


class _PhaseHooks:
    """Forward pre-hook and hook that set ``serving_phase`` for one model call."""

    def __init__(self, module: nn.Module) -> None:
        self._local = threading.local()  # the stack of tokens, one a thread
        try:
            self._signature: inspect.Signature | None = inspect.signature(module.forward)
        except (TypeError, ValueError):
            self._signature = None

    # copy.deepcopy and torch.save of a converted model: a fresh, empty stack.
    def __getstate__(self) -> dict[str, Any]:
        return {"_signature": self._signature}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self._signature = state["_signature"]
        self._local = threading.local()

    def _stack(self) -> list:
        if not hasattr(self._local, "stack"):
            self._local.stack = []
        return self._local.stack

    def before(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        token = None
        if _current_phase.get() is None:  # a phase the caller set is never overridden
            phase = infer_phase(**self._inputs(args, kwargs))
            if phase is not None:
                token = _current_phase.set(phase)
        self._stack().append(token)

    def after(self, module: nn.Module, args: tuple, output: Any) -> None:
        stack = self._stack()
        token = stack.pop() if stack else None
        if token is not None:
            _current_phase.reset(token)

    def _inputs(self, args: tuple, kwargs: dict) -> dict[str, Any]:
        given = dict(kwargs)
        if args and self._signature is not None:
            with suppress(TypeError):  # arguments this signature cannot bind: kwargs only
                given = dict(self._signature.bind_partial(*args, **kwargs).arguments)
        elif args:
            given.setdefault("input_ids", args[0])
        cache = given.get("cache", given.get("past_key_values"))
        ids, embeds = given.get("input_ids"), given.get("inputs_embeds")
        return {
            "input_ids": ids if isinstance(ids, torch.Tensor) else None,
            "inputs_embeds": embeds if isinstance(embeds, torch.Tensor) else None,
            "cache": cache,
        }


_HOOKS_ATTR = "_fp4moe_phase_hooks"


def install_phase_hooks(model: nn.Module) -> None:
    """Set ``fp4moe.serving_phase`` from the inputs of each call of ``model`` (rule:
    :func:`infer_phase`; a phase set by the caller wins). Installing twice is a no-op."""
    if getattr(model, _HOOKS_ATTR, None) is not None:
        return
    hooks = _PhaseHooks(model)
    handles = (
        model.register_forward_pre_hook(hooks.before, with_kwargs=True),
        model.register_forward_hook(hooks.after, always_call=True),
    )
    object.__setattr__(model, _HOOKS_ATTR, handles)


def remove_phase_hooks(model: nn.Module) -> None:
    """Remove the hooks of :func:`install_phase_hooks` (no-op if none)."""
    handles = getattr(model, _HOOKS_ATTR, None)
    if handles is None:
        return
    for handle in handles:
        handle.remove()
    object.__delattr__(model, _HOOKS_ATTR)


# ------------------------------------------------------------------------------ helpers


def _arch_of(block: nn.Module) -> _Arch:
    cls = type(block).__name__
    if cls in _ARCHS:
        return _ARCHS[cls]
    if cls in _UNSUPPORTED:
        raise NotImplementedError(f"{cls}: not supported by fp4moe: {_UNSUPPORTED[cls]}")
    raise NotImplementedError(
        f"{cls}: not a supported MoE block (supported: {', '.join(SUPPORTED_BLOCKS)})"
    )


def _is_silu(act: Any) -> bool:
    return isinstance(act, nn.SiLU) or type(act).__name__ == "SiLUActivation"


def _check_block(block: nn.Module) -> tuple[_Arch, nn.Module]:
    """(arch, router module) of a block fp4moe can compute exactly; raises otherwise.
    Reads no weight values (they may be on the meta device)."""
    cls = type(block).__name__
    arch = _arch_of(block)
    gate = getattr(block, "gate", None)
    if not isinstance(gate, nn.Module) or type(gate).__name__ != arch.router_class:
        raise NotImplementedError(
            f"{cls}: expected its router `gate` to be a {arch.router_class}, got "
            f"{type(gate).__name__}; this transformers version routes differently from the "
            "one fp4moe reproduces"
        )
    if arch.shared_experts and not isinstance(getattr(block, "shared_experts", None), nn.Module):
        raise NotImplementedError(f"{cls}: expected a `shared_experts` module")
    w13, _ = _expert_weights(block, materialize=False)
    _, two_i, h = w13.shape
    if h % 32 or (two_i // 2) % 32:
        raise ValueError(
            f"{cls}: fp4moe needs the hidden size H and the expert intermediate size I to be "
            f"multiples of 32, got H={h}, I={two_i // 2}"
        )
    return arch, gate


def _expert_weights(
    block: nn.Module, materialize: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
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


def _find_blocks(model: nn.Module) -> list[tuple[str, nn.Module]]:
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
        elif cls in _ARCHS:
            found.append((name, m))
        elif cls in _UNSUPPORTED:
            refused.append((name, cls, _UNSUPPORTED[cls]))
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


def _replace(model: nn.Module, name: str, new: nn.Module) -> None:
    parent_name, _, child = name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    if isinstance(parent, (nn.ModuleList, nn.Sequential)):
        parent[int(child)] = new
    else:
        setattr(parent, child, new)


def _checkpoint_keys(checkpoint: Checkpoint) -> set[str]:
    with ExitStack() as stack:
        return set(_Source(checkpoint, stack).all_keys())


def _checkpoint_prefix(
    name: str, arch: _Arch, keys: set[str], mapping: Callable[[str], str] | None
) -> str:
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
