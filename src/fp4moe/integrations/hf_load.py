"""Load a whole NVFP4 MoE checkpoint folder into a runnable transformers model.

:func:`load_model` reads a folder written by NVIDIA ModelOpt (``quant_algo: NVFP4``), by
llm-compressor (compressed-tensors ``nvfp4-pack-quantized``), by ``save_pretrained`` of a
converted model, or by :func:`fp4moe.integrations.hf_export.write_nvfp4_checkpoint`,
without those tools installed:

1. the config (``config.json``; its ``quantization_config`` is not given to transformers);
2. the model built on the meta device (no memory, no random initialization);
3. filled layer by layer, each tensor read from its shard and put on ``device``:

   * routed experts: NVFP4 codes and block scales kept bit for bit in one
     :class:`fp4moe.PreparedExperts` a block (``fp4moe.load_checkpoint_experts``);
   * every other NVFP4 linear (attention, shared experts, dense MLPs): dequantized to the
     model dtype (bf16 by default), ``code * block scale * global`` (numerics section 1), so
     those layers run as plain bf16 linears; their input scales are not used;
   * routers, norms, embeddings, biases and any other unquantized tensor: as stored, cast
     to the model's dtype for that tensor;

4. non-persistent buffers (rotary frequencies) computed by transformers' own initializer,
   tied weights tied, the phase hooks installed, the quantization config set for saving.

A tensor the model needs and the checkpoint lacks is an error naming it; nothing is left
random. Checkpoint tensors the model does not use (a DeepSeek-V3 multi-token-prediction
layer, FP8 KV-cache scales) are reported in one warning.

Peak host memory: about the checkpoint's size when ``device`` is the CPU (the model lives
there: NVFP4 experts plus the dense weights in bf16), plus the memory-mapped pages of the
shards being read; with a GPU ``device`` a layer at a time passes through host memory.
docs/integration.md has the numbers measured.
"""

from __future__ import annotations

import copy
import json
import os
import re
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..checkpoint_source import CheckpointSource
from ..nvfp4 import NVFP4Tensor, dequantize_nvfp4
from ..phases import PhaseConfig, PhasePolicy
from ..progress import progress
from .hf_blocks import (
    FP4MoEBlock,
    check_block,
    convert_block,
    expert_prefix,
    find_blocks,
    replace_module,
)
from .hf_phases import install_phase_hooks
from .hf_save import set_quantization_config

__all__ = [
    "dequantized_model",
    "estimate_bytes",
    "load_model",
    "load_model_config",
    "read_weight",
    "set_expert_weights",
]

# Leaves of quantized linears that the loader reads with their weight, or does not need.
_QUANT_LEAVES = (
    "weight_scale", "weight_scale_2", "input_scale", "weight_packed", "weight_global_scale",
    "input_global_scale", "k_scale", "v_scale", "weight_shape",
)  # fmt: skip
_LAYER = re.compile(r"^(.*?\.layers\.(\d+))\.")


def load_model_config(path: str | os.PathLike):
    """A transformers config from a ``config.json`` file, or a directory holding one.

    Read offline; the ``quantization_config`` entry is dropped (fp4moe reads the NVFP4
    tensors itself, so transformers must not try to), as is ``transformers_version``."""
    from transformers import AutoConfig

    p = Path(path)
    if p.is_dir():
        p = p / "config.json"
    if not p.is_file():
        raise ValueError(f"model config: no such file {str(p)!r}")
    try:
        with open(p) as f:
            d = json.load(f)
    except (OSError, ValueError) as exc:
        raise ValueError(f"model config: {str(p)!r} is not a JSON file ({exc})") from None
    if not isinstance(d, dict) or "model_type" not in d:
        raise ValueError(f"model config: {str(p)!r} has no model_type")
    d.pop("quantization_config", None)
    d.pop("transformers_version", None)
    model_type = d.pop("model_type")
    try:
        return AutoConfig.for_model(model_type, **d)
    except ValueError as exc:
        raise ValueError(f"model config: {str(p)!r}: {exc}") from None


def read_weight(src: CheckpointSource, key: str) -> torch.Tensor | None:
    """The tensor of ``key`` from a checkpoint, or None when it holds none; an NVFP4 linear
    weight (ModelOpt ``weight`` uint8 + ``weight_scale`` + ``weight_scale_2``, or
    compressed-tensors ``weight_packed`` + ``weight_scale`` + ``weight_global_scale``, an
    encode scale) decoded to fp32 [N, K]."""
    base = key.removesuffix(".weight")
    if key.endswith(".weight") and src.has(f"{base}.weight_packed"):  # compressed-tensors
        t = src.read(
            [f"{base}.weight_packed", f"{base}.weight_scale", f"{base}.weight_global_scale"]
        )
        encode = t[f"{base}.weight_global_scale"].float().reshape(())
        q = NVFP4Tensor(
            t[f"{base}.weight_packed"],
            t[f"{base}.weight_scale"].view(torch.float8_e4m3fn),
            torch.reciprocal(encode),
        )
        return dequantize_nvfp4(q)
    if not src.has(key):
        return None
    dtype, _ = src.info(key)
    quantized = key.endswith(".weight") and src.has(f"{base}.weight_scale")
    if quantized and dtype == torch.uint8:  # ModelOpt NVFP4
        s = src.read([key, f"{base}.weight_scale", f"{base}.weight_scale_2"])
        g = s[f"{base}.weight_scale_2"].float().reshape(())
        return dequantize_nvfp4(
            NVFP4Tensor(s[key], s[f"{base}.weight_scale"].view(torch.float8_e4m3fn), g)
        )
    if quantized:
        raise NotImplementedError(
            f"{key}: a {dtype} weight with a weight_scale (an FP8 or other quantized linear); "
            "fp4moe reads NVFP4 linears and unquantized tensors only"
        )
    return src.read([key])[key]


def _owner(model: nn.Module, key: str) -> tuple[nn.Module, str]:
    owner, _, leaf = key.rpartition(".")
    return (model.get_submodule(owner) if owner else model), leaf


def _assign(model: nn.Module, key: str, value: torch.Tensor) -> None:
    module, leaf = _owner(model, key)
    old = module._parameters.get(leaf)
    if old is not None:
        module.register_parameter(leaf, nn.Parameter(value, requires_grad=old.requires_grad))
    else:
        persistent = leaf not in module._non_persistent_buffers_set
        module.register_buffer(leaf, value, persistent=persistent)


def _materialize_buffers(model: nn.Module, device: torch.device) -> None:
    """Non-persistent buffers (rotary frequencies) still on meta: computed by transformers'
    initializer on those modules only (every other module is marked initialized)."""
    pending = {
        name
        for name, m in model.named_modules()
        for b in m.buffers(recurse=False)
        if b is not None and b.device.type == "meta"
    }
    if not pending:
        return
    for name, m in model.named_modules():
        if name in pending:
            for leaf, b in list(m._buffers.items()):
                if b is not None and b.device.type == "meta":
                    m.register_buffer(
                        leaf, torch.empty_like(b, device=device),
                        persistent=leaf not in m._non_persistent_buffers_set,
                    )  # fmt: skip
        else:
            m._is_hf_initialized = True
    model.initialize_weights()


def load_model(
    path: str | os.PathLike,
    *,
    policy: PhasePolicy | PhaseConfig | str | None = None,
    device: torch.device | str | None = None,
    dtype: torch.dtype = torch.bfloat16,
    checkpoint_prefix: Callable[[str], str] | None = None,
    infer_phase: bool = True,
    progress_bar: bool | None = None,
) -> nn.Module:
    """An NVFP4 MoE checkpoint folder as a runnable transformers model on fp4moe experts.

    Args:
        path: the checkpoint folder: ``config.json`` and ``model.safetensors`` or a sharded
            ``model.safetensors.index.json`` (ModelOpt, compressed-tensors, or
            ``save_pretrained`` of a converted model). Qwen3-MoE, Mixtral, DeepSeek-V3.
        policy: the phase policy of every MoE layer (default ``PhasePolicy()``: W4A4
            per-token prefill, W4A16 decode), or one mode name for every phase.
        device: where the model goes (default the CPU); filled there layer by layer.
        dtype: the dtype of the dense weights (NVFP4 linears are dequantized to it).
        checkpoint_prefix: maps a block's module path to its experts' prefix in the
            checkpoint (default ``"{path}.experts"``, Mixtral also ``block_sparse_moe``).
        infer_phase: install the phase hooks (``hf_phases``).
        progress_bar: a progress bar over the layers (None: when stderr is a terminal).

    Returns:
        The ``*ForCausalLM`` model in eval mode, every MoE block an ``FP4MoEBlock``.

    Raises:
        ValueError: no such folder, no config, a tensor the model needs missing from the
            checkpoint (named), a shape that differs from the model's.
        NotImplementedError: an MoE block fp4moe does not compute (gpt-oss), or a quantized
            linear of another format (FP8).
    """
    from transformers import AutoModelForCausalLM, GenerationConfig

    if not isinstance(path, (str, os.PathLike)) or not os.path.isdir(path):
        raise ValueError(f"path: expected a checkpoint directory, got {path!r}")
    config = load_model_config(path)
    device = torch.device(device if device is not None else "cpu")
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    blocks = dict(find_blocks(model))  # refuses unsupported blocks before reading anything
    policy = PhasePolicy.coerce(policy if policy is not None else PhasePolicy())

    with CheckpointSource(path) as src:
        keys = set(src.all_keys())
        prefixes, aliases = {}, set()
        for name, block in blocks.items():
            arch, _ = check_block(block)
            prefixes[name] = expert_prefix(name, arch, keys, checkpoint_prefix)
            if arch.checkpoint_alias is not None:
                aliases.add(arch.checkpoint_alias)
        skip = tuple(f"{name}.experts." for name in blocks)
        tied = _tied_keys(model)
        groups: dict[str, list[str]] = {}
        for key in model.state_dict(keep_vars=True):
            if not key.startswith(skip):
                m = _LAYER.match(key)
                groups.setdefault(m.group(1) if m else "", []).append(key)
        for name in blocks:
            m = _LAYER.match(name + ".")
            groups.setdefault(m.group(1) if m else "", [])
        used: set[str] = set()
        missing: list[str] = []
        with torch.no_grad():
            for group in progress(
                sorted(groups, key=_layer_order), desc="fp4moe: loading layers",
                enabled=progress_bar,
            ):  # fmt: skip
                _fill(model, groups[group], src, aliases, device, used, missing, tied)
                for name in [n for n in blocks if _group_of(n) == group]:
                    new = convert_block(
                        blocks.pop(name), policy, checkpoint=src, prefix=prefixes[name],
                        device=device,
                    )  # fmt: skip
                    replace_module(model, name, new)
                    used.update(k for k in keys if k.startswith(prefixes[name] + "."))
                if missing:
                    raise ValueError(
                        f"checkpoint: {path!r} holds no tensor for {missing[0]!r} (needed by "
                        f"the model; {len(missing)} missing in this layer)"
                    )
        unused = sorted(k for k in keys - used if k.rpartition(".")[2] not in _QUANT_LEAVES)
    if unused:
        warnings.warn(
            f"checkpoint: {len(unused)} tensors not used by the model, e.g. {unused[:3]}",
            stacklevel=2,
        )
    if tied:
        model.tie_weights()
    _materialize_buffers(model, device)
    left = [n for n, t in (*model.named_parameters(), *model.named_buffers()) if t.is_meta]
    if left:
        raise ValueError(f"checkpoint: nothing loaded {left[0]!r} ({len(left)} tensors)")
    if os.path.isfile(os.path.join(path, "generation_config.json")):
        model.generation_config = GenerationConfig.from_pretrained(path)
    if infer_phase:
        install_phase_hooks(model)
    set_quantization_config(model)
    return model.eval()


def _group_of(name: str) -> str:
    m = _LAYER.match(name + ".")
    return m.group(1) if m else ""


def _layer_order(group: str) -> tuple[int, int]:
    m = _LAYER.match(group + ".")
    return (0, int(m.group(2))) if m else (1, 0)  # layers first, then the rest


def _tied_keys(model: nn.Module) -> set[str]:
    """Keys the model ties to another (the output embedding of ``tie_word_embeddings``)."""
    config = getattr(model, "config", None)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    if not getattr(text, "tie_word_embeddings", False):
        return set()
    out = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    for name, m in model.named_modules():
        if m is out and out is not None:
            return {f"{name}.weight"}
    return set()


def _fill(
    model: nn.Module, keys: list[str], src: CheckpointSource, aliases: set[tuple[str, str]],
    device: torch.device, used: set[str], missing: list[str], tied: set[str],
) -> None:  # fmt: skip
    """Read each of ``keys`` (model names) from the checkpoint and put it into the model."""
    for key in keys:
        module, leaf = _owner(model, key)
        want = getattr(module, leaf)
        value, found = None, None
        for cand in _candidates(key, aliases):
            value = read_weight(src, cand)
            if value is not None:
                found = cand
                break
        if value is None:
            if key not in tied:
                missing.append(key)
            continue
        if tuple(value.shape) != tuple(want.shape):
            raise ValueError(
                f"checkpoint: {found} has shape {list(value.shape)}, the model's "
                f"{key} {list(want.shape)}"
            )
        dtype = want.dtype if value.is_floating_point() else value.dtype
        _assign(model, key, value.to(device=device, dtype=dtype))
        base = found.removesuffix(".weight")
        used.add(found)
        used.update(f"{base}.{leaf}" for leaf in _QUANT_LEAVES)


def _candidates(key: str, aliases: set[tuple[str, str]]) -> list[str]:
    out = [key]
    for module_part, disk_part in aliases:
        alt = key.replace(f".{module_part}.", f".{disk_part}.", 1)
        if alt != key:
            out.append(alt)
    return out


def estimate_bytes(path: str | os.PathLike) -> dict[str, Any]:
    """Sizes of a checkpoint folder from its headers (nothing is read): ``checkpoint``
    (its tensors), ``loaded`` (the model :func:`load_model` builds: NVFP4 tensors of routed
    experts as stored, every other NVFP4 linear in bf16, the rest as stored)."""
    with CheckpointSource(path) as src:
        total = loaded = 0
        for k in src.all_keys():
            dtype, shape = src.info(k)
            n = dtype.itemsize
            for d in shape:
                n *= d
            total += n
            if ".experts." in k or dtype != torch.uint8 or not k.endswith((".weight", "_packed")):
                loaded += n
            else:
                loaded += n * 4  # two codes a byte, each a bf16 value
    return {"checkpoint": total, "loaded": loaded}


def set_expert_weights(block: nn.Module, w13: torch.Tensor, w2: torch.Tensor) -> None:
    """Give a transformers MoE block's fused experts the weights w13 [E, 2I, H] (gate rows,
    then up rows) and w2 [E, H, I], in its layout (``is_concatenated``, ``is_transposed``);
    experts on the meta device get new tensors, others are copied into."""
    ex = block.experts
    gu, down = w13, w2
    if not getattr(ex, "is_concatenated", True):  # gate0, up0, gate1, up1, ...
        e, two_i, h = w13.shape
        gu = torch.stack((w13[:, : two_i // 2], w13[:, two_i // 2 :]), dim=2).reshape(e, two_i, h)
    if getattr(ex, "is_transposed", False):
        gu, down = gu.transpose(1, 2), down.transpose(1, 2)
    with torch.no_grad():
        for leaf, value in (("gate_up_proj", gu), ("down_proj", down)):
            param = getattr(ex, leaf)
            if param.is_meta:
                ex.register_parameter(leaf, nn.Parameter(value.contiguous(), requires_grad=False))
            else:
                param.copy_(value)


def dequantized_model(model: nn.Module) -> nn.Module:
    """The plain transformers model of a converted ``model``: every ``FP4MoEBlock`` back to
    the model's own block, its experts the NVFP4 experts decoded to the model dtype (bf16);
    the reference a converted model is measured against. The dense weights are the converted
    model's own tensors (shared, not copied); only the decoded experts take new memory.
    """
    from transformers import AutoModelForCausalLM

    blocks = {n: m for n, m in model.named_modules() if isinstance(m, FP4MoEBlock)}
    if not blocks:
        raise ValueError("model: holds no FP4MoEBlock (convert it first)")
    config = copy.deepcopy(model.config)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    dtype = next(p.dtype for p in model.parameters() if p.is_floating_point())
    with torch.device("meta"):
        ref = AutoModelForCausalLM.from_config(config, dtype=dtype)
    skip = tuple(f"{name}.experts." for name in blocks)
    targets = dict(ref.state_dict(keep_vars=True))
    with torch.no_grad():
        for key, value in model.state_dict().items():
            if key in targets and not key.startswith(skip):
                _assign(ref, key, value)
        for name, block in blocks.items():
            set_expert_weights(ref.get_submodule(name), *block.experts.dequantize(dtype))
    device = next(iter(block.experts.tensors().values())).device
    _materialize_buffers(ref, device)
    left = [n for n, t in (*ref.named_parameters(), *ref.named_buffers()) if t.is_meta]
    if left:
        raise ValueError(f"model: the reference lacks {left[0]!r} ({len(left)} tensors)")
    ref.generation_config = copy.deepcopy(model.generation_config)
    return ref.eval()
