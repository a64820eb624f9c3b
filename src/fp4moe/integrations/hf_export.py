"""Write a whole transformers MoE model as an NVFP4 checkpoint folder, in the layout NVIDIA
ModelOpt or llm-compressor (compressed-tensors) writes: the library's own writer, for tests
and for making small checkpoints without those tools.

What :func:`write_nvfp4_checkpoint` writes, from an unconverted model (its experts fused
``gate_up_proj`` / ``down_proj``, any float dtype):

* routed experts, per expert and projection (``fp4moe.checkpoints`` writers): NVFP4
  quantized once with :func:`fp4moe.prepare_experts` (gate and up each with its own
  global scale);
* every other ``nn.Linear`` whose input size is a multiple of 32 (attention, shared
  experts, dense MLPs) NVFP4 with one global scale a matrix (``quantize_linears``), except
  the output head; its bias, if any, as stored;
* routers, norms, embeddings, the output head and every other tensor as stored;
* names as the original checkpoints have them (Mixtral: ``block_sparse_moe``);
* ``config.json`` with the tool's ``quantization_config``, and one ``model.safetensors`` or
  shards with ``model.safetensors.index.json`` (``max_shard_bytes``).
"""

from __future__ import annotations

import json
import os
from typing import Any

import torch
from torch import nn

from ..checkpoints import (
    CHECKPOINT_FORMATS,
    save_compressed_tensors_experts,
    save_modelopt_experts,
)
from ..experts import prepare_experts
from ..nvfp4 import quantize_nvfp4
from .hf_blocks import check_block, expert_weights, find_blocks

__all__ = ["write_nvfp4_checkpoint"]


def _quantization_config(fmt: str, excluded: list[str]) -> dict[str, Any]:
    from .. import __version__

    if fmt == "modelopt":
        return {
            "quant_method": "modelopt", "quant_algo": "NVFP4", "group_size": 16,
            "kv_cache_quant_algo": None, "exclude_modules": excluded,
            "producer": {"name": "fp4moe", "version": __version__},
        }  # fmt: skip
    scheme = {"num_bits": 4, "type": "float", "strategy": "tensor_group", "group_size": 16,
              "symmetric": True, "dynamic": False}  # fmt: skip
    return {
        "quant_method": "compressed-tensors", "format": "nvfp4-pack-quantized",
        "quantization_status": "compressed", "ignore": excluded,
        "config_groups": {"group_0": {
            "targets": ["Linear"], "weights": scheme, "format": "nvfp4-pack-quantized",
            "input_activations": {**scheme, "dynamic": "local"},
        }},
    }  # fmt: skip


def _linear_tensors(base: str, w: torch.Tensor, fmt: str) -> dict[str, torch.Tensor]:
    q = quantize_nvfp4(w.detach().float().cpu())
    if fmt == "modelopt":
        return {
            f"{base}.weight": q.codes, f"{base}.weight_scale": q.scales,
            f"{base}.weight_scale_2": q.global_scale.reshape(()).clone(),
        }  # fmt: skip
    return {
        f"{base}.weight_packed": q.codes, f"{base}.weight_scale": q.scales,
        f"{base}.weight_global_scale": torch.reciprocal(q.global_scale).reshape(1),
    }  # fmt: skip


def write_nvfp4_checkpoint(
    model: nn.Module,
    folder: str | os.PathLike,
    *,
    format: str = "modelopt",
    quantize_linears: bool = True,
    max_shard_bytes: int | None = None,
) -> dict[str, torch.Tensor]:
    """Write ``model`` (a transformers Qwen3-MoE, Mixtral or DeepSeek-V3 ``*ForCausalLM``,
    not converted) as an NVFP4 checkpoint folder (module docstring).

    Args:
        model: the model; its weights are read, not changed.
        folder: the directory to write (created; files of the same names are replaced).
        format: ``"modelopt"`` or ``"compressed-tensors"``.
        quantize_linears: NVFP4 for the non-expert linears too (as the tools do by default);
            False keeps them as stored.
        max_shard_bytes: write shards of at most about this many bytes and an index (None:
            one ``model.safetensors``).

    Returns:
        The tensors written, by key (CPU).
    """
    from safetensors.torch import save_file

    if format not in CHECKPOINT_FORMATS:
        raise ValueError(f"format: expected one of {CHECKPOINT_FORMATS}, got {format!r}")
    if max_shard_bytes is not None and (
        isinstance(max_shard_bytes, bool) or not isinstance(max_shard_bytes, int)
        or max_shard_bytes < 1
    ):  # fmt: skip
        raise ValueError(
            f"max_shard_bytes: expected a positive int or None, got {max_shard_bytes!r}"
        )
    blocks = find_blocks(model)
    alias = {}
    for name, block in blocks:
        arch, _ = check_block(block)
        if arch.checkpoint_alias is not None:
            alias[name] = arch.checkpoint_alias

    def disk(key: str) -> str:
        for name, (module_part, disk_part) in alias.items():
            head = name.rpartition(".")[0]
            if key.startswith(f"{head}.{module_part}."):
                return f"{head}.{disk_part}." + key[len(f"{head}.{module_part}.") :]
        return key

    out: dict[str, torch.Tensor] = {}
    done: set[str] = set()
    with torch.no_grad():
        for name, block in blocks:
            arch, _ = check_block(block)
            w13, w2 = expert_weights(block)
            prepared = prepare_experts(w13.detach().cpu(), w2.detach().cpu())
            save = save_compressed_tensors_experts
            if format == "modelopt":
                save = save_modelopt_experts
            save(prepared, out, prefix=disk(f"{name}.experts"), names=arch.expert_names)
            done.update(f"{name}.experts.{p}" for p, _ in block.experts.named_parameters())
        head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
        excluded = []
        for name, m in model.named_modules():
            if not isinstance(m, nn.Linear):  # fused experts and routers are not Linear
                continue
            if quantize_linears and m is not head and m.in_features % 32 == 0:
                out.update(_linear_tensors(disk(name), m.weight, format))
                done.add(f"{name}.weight")
            else:
                excluded.append(disk(name))
        excluded += [disk(f"{name}.gate") for name, _ in blocks]
        for key, t in model.state_dict().items():
            if key not in done and disk(key) not in out:
                out[disk(key)] = t.detach().cpu().contiguous().clone()

    folder = os.fspath(folder)
    os.makedirs(folder, exist_ok=True)
    config = model.config.to_dict()
    config["architectures"] = [type(model).__name__]
    config["quantization_config"] = _quantization_config(format, sorted(set(excluded)))
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(config, f, indent=2, default=str)
    if max_shard_bytes is None:
        save_file(out, os.path.join(folder, "model.safetensors"), metadata={"format": "pt"})
        return out
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for key in sorted(out):
        n = out[key].numel() * out[key].element_size()
        if shards[-1] and size + n > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][key] = out[key]
        size += n
    weight_map = {}
    for j, shard in enumerate(shards):
        file = f"model-{j + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, os.path.join(folder, file), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard, file))
    total = sum(t.numel() * t.element_size() for t in out.values())
    with open(os.path.join(folder, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
    return out
