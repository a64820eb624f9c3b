"""Hugging Face transformers 5.x: run MoE models on fp4moe layers.

Three ways in:

* :func:`load_model` (``hf_load``): an NVFP4 checkpoint folder (ModelOpt or
  compressed-tensors) to a runnable model, built on the meta device and filled layer by
  layer, without those tools installed.
* :func:`convert`: replace every sparse MoE block of a model already in memory, in place,
  by an :class:`FP4MoEBlock` (``hf_blocks``: the supported blocks and how each routes),
  quantizing its experts once with :func:`fp4moe.prepare_experts` or reading them from an
  NVFP4 checkpoint.
* :func:`convert_block`: one block.

A converted model keeps the model's own routers, attention and (DeepSeek-V3) shared
experts; its ``state_dict`` holds the experts in the ModelOpt NVFP4 layout and
``model.save_pretrained()`` writes them with the quantization config (``hf_save``).
``.to()``, ``.cuda()`` and ``.cpu()`` move the experts with the model. Phase inference
inside ``generate``: ``hf_phases``.

Numerics inside a converted block follow docs/numerics.md (fp32 accumulation, one bf16 rounding of
each route row, routes summed in fp32 in ascending k): they differ from the model's own
bf16 expert loop by bf16 rounding only (W4A16), by the e4m3 rounding of activations and
weights (W4A8), or by the activation quantization (W4A4).
Activations enter the experts in bf16 whatever the model dtype; the output is cast back.
Gradients reach the inputs of the experts (straight-through, ``fp4moe.backward``), never
the NVFP4 expert weights.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import ExitStack

import torch
from torch import nn

from ..checkpoint_source import CheckpointSource
from ..phases import MoELayer, PhaseConfig, PhasePolicy
from ..progress import progress
from .hf_blocks import (
    SUPPORTED_BLOCKS,
    Checkpoint,
    FP4MoEBlock,
    check_block,
    convert_block,
    expert_prefix,
    find_blocks,
    replace_module,
)
from .hf_load import load_model, load_model_config
from .hf_phases import infer_phase, install_phase_hooks, remove_phase_hooks
from .hf_save import set_quantization_config

__all__ = [
    "SUPPORTED_BLOCKS",
    "Checkpoint",
    "FP4MoEBlock",
    "convert",
    "convert_block",
    "infer_phase",
    "install_phase_hooks",
    "load_model",
    "load_model_config",
    "moe_layers",
    "remove_phase_hooks",
    "set_policy",
]

# ------------------------------------------------------------------------------ convert


def convert(
    model: nn.Module,
    policy: PhasePolicy | PhaseConfig | str | None = None,
    checkpoint: Checkpoint | None = None,
    *,
    expert_dtype: torch.dtype | None = None,
    checkpoint_prefix: Callable[[str], str] | None = None,
    infer_phase: bool = True,
    progress_bar: bool | None = None,
) -> nn.Module:
    """Replace every sparse MoE block of a transformers model by an :class:`FP4MoEBlock`,
    in place, and return the model.

    Args:
        model: a transformers 5.x model (``*ForCausalLM``, the bare ``*Model``, or any module
            containing the blocks) of Qwen3-MoE, Mixtral or DeepSeek-V3, its weights loaded
            (to read a checkpoint folder whole, use :func:`load_model`).
        policy: one ``PhasePolicy`` shared by every converted layer (default
            ``PhasePolicy()``: W4A4 per-token prefill, W4A16 decode; on Hopper
            ``PhasePolicy(prefill="w4a8", decode="w4a16")``, docs/policies.md), or one mode
            string for every phase (e.g. ``"w4a16"``).
        checkpoint: None to quantize the model's own bf16/fp32 expert weights; else an NVFP4
            checkpoint in ModelOpt or compressed-tensors layout (safetensors file, HF
            checkpoint directory, or state dict). Only the experts are read from it: the
            router, shared experts and all other weights stay the model's; a router weight
            the checkpoint stores that differs from the model's is an error (the model's
            dense weights are not the checkpoint's: use :func:`load_model`).
        expert_dtype: see :func:`convert_block`.
        checkpoint_prefix: maps a block's module path (``"model.layers.3.mlp"``) to its
            experts' prefix in the checkpoint. Default: ``"{path}.experts"``, and for
            Mixtral also the on-disk name ``"model.layers.3.block_sparse_moe.experts"``,
            whichever the checkpoint holds.
        infer_phase: install the phase hooks (``hf_phases``, :func:`infer_phase`).
        progress_bar: a progress bar over the blocks (None: when stderr is a terminal).

    Returns:
        ``model``. The replaced blocks' expert tensors are no longer referenced by it (they
        are freed unless the caller holds them); the model's other parameters are untouched.
        ``model.config.quantization_config`` says that the experts are NVFP4 (``hf_save``),
        for ``save_pretrained``.

    Raises:
        NotImplementedError: the model has an MoE block fp4moe cannot compute exactly
            (gpt-oss's ``GptOssMLP``, or any unknown block owning an ``experts`` module);
            raised before anything is changed.
        ValueError: no supported block found (or the model was already converted), the
            model itself is a block (use :func:`convert_block`), or a checkpoint holds no
            experts for a block, or a router weight that differs from the checkpoint's.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model: expected a torch.nn.Module, got {type(model).__name__}")
    policy = PhasePolicy.coerce(policy if policy is not None else PhasePolicy())
    blocks = find_blocks(model)
    with ExitStack() as stack:
        src = None
        if isinstance(checkpoint, CheckpointSource):
            src = checkpoint
        elif checkpoint is not None:
            src = stack.enter_context(CheckpointSource(checkpoint))
        # Every check that needs no expert weights runs before the first block changes, so
        # that a refused model is left as it was. Blocks are then converted one at a time:
        # the extra memory is one block's NVFP4 experts, never a second copy of the model's.
        prefixes: list[str | None] = []
        keys = set(src.all_keys()) if src is not None else None
        for name, block in blocks:
            arch, gate = check_block(block)
            if src is None:
                prefixes.append(None)
                continue
            prefixes.append(expert_prefix(name, arch, keys, checkpoint_prefix))
            _check_router_matches(name, gate, src, arch.checkpoint_alias)
        for (name, block), prefix in progress(
            list(zip(blocks, prefixes)), desc="fp4moe: converting MoE blocks",
            enabled=progress_bar,
        ):  # fmt: skip
            new = convert_block(
                block, policy, checkpoint=src, prefix=prefix, expert_dtype=expert_dtype
            )
            replace_module(model, name, new)
            del block, new  # the old block (and its experts) goes once the model lets go
        blocks.clear()
    if infer_phase:
        install_phase_hooks(model)
    set_quantization_config(model)
    return model


def _check_router_matches(
    name: str, gate: nn.Module, src: CheckpointSource, alias: tuple[str, str] | None
) -> None:
    """A router weight stored unquantized in the checkpoint must be the model's own: else
    the model's dense weights are not the checkpoint's (a ``from_config`` model, say), and
    its outputs would be silently those of random attention and routers."""
    weight = getattr(gate, "weight", None)
    if not isinstance(weight, torch.Tensor) or weight.device.type == "meta":
        return
    keys = [f"{name}.gate.weight"]
    if alias is not None:
        keys.append(keys[0].replace(f".{alias[0]}.", f".{alias[1]}.", 1))
    for key in keys:
        if src.has(key) and src.info(key)[0].is_floating_point:
            stored = src.read([key])[key].to(device=weight.device, dtype=torch.float32)
            mine = weight.detach().float()
            # a tolerance: the model may hold the router in another dtype than the file
            if stored.shape != mine.shape or (stored - mine).norm() > 1e-2 * stored.norm():
                raise ValueError(
                    f"checkpoint: the router weight of {name!r} differs from the checkpoint's "
                    f"{key!r}: this model's dense weights (attention, routers) are not the "
                    "checkpoint's, and convert reads only the experts; load the whole "
                    "checkpoint with fp4moe.load_model(path)"
                )
            return


def moe_layers(model: nn.Module) -> dict[str, MoELayer]:
    """The MoELayer of every converted block, keyed by the block's module path (for the
    ``stats`` counters, ``memory_report()``, or changing ``policy``)."""
    return {n: m.moe for n, m in model.named_modules() if isinstance(m, FP4MoEBlock)}


def set_policy(model: nn.Module, policy: PhasePolicy | PhaseConfig | str) -> nn.Module:
    """Give every converted MoE layer of ``model`` this phase policy (a ``PhasePolicy``, or
    one mode name for every phase); returns ``model``. Nothing else changes: the experts
    stay the same tensors. Compiled graphs of the model recompile on their next call."""
    layers = moe_layers(model)
    if not layers:
        raise ValueError("model: holds no converted MoE layer")
    policy = PhasePolicy.coerce(policy)
    for layer in layers.values():
        for name in ("prefill", "decode"):
            cfg = getattr(policy, name)
            if cfg.act_scale == "static" and cfg.mode == "w4a4" and layer.experts.a13_scale is None:
                raise ValueError(
                    f"policy: {name} runs {cfg}, which needs calibrated activation scales; "
                    "these experts have none"
                )
    for layer in layers.values():
        layer.policy = policy
    return model
