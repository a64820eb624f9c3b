"""transformers' quantizer convention for NVFP4 MoE checkpoints in the ModelOpt layout::

    import fp4moe.integrations.hf_quantizer  # registers quant_method "modelopt"
    model = AutoModelForCausalLM.from_pretrained(folder)  # or quantization_config=FP4MoEConfig()

Importing this module registers :class:`FP4MoEConfig` and :class:`FP4MoEQuantizer` with
transformers under ``quant_method: "modelopt"`` (transformers 5.24 has no quantizer of that
name; if a later release brings one, it is kept and this registration is skipped, see
:data:`REGISTERED`). ``from_pretrained`` then reads a ModelOpt NVFP4 folder, a folder that
``save_pretrained`` of a converted model wrote included, as :func:`fp4moe.load_model` does:
routed experts bit for bit into fp4moe layers, other NVFP4 linears decoded to the model
dtype, the phase hooks installed. transformers loads the tensors itself (its device map
and dtype rules), through modules that hold the checkpoint's tensors as they are stored,
which the quantizer turns into the fp4moe blocks and bf16 linears after loading.

What differs from :func:`fp4moe.load_model`:

* the phase policy is the default ``PhasePolicy()`` (transformers keeps the folder's own
  quantization config, so a policy passed in one would be dropped): set another with
  :func:`fp4moe.integrations.hf.set_policy`;
* compressed-tensors folders stay with transformers' own quantizer (it needs the
  compressed-tensors package); ``fp4moe.load_model`` reads them without it;
* a dense tensor missing from the checkpoint is transformers' warning and random
  initialization, where ``load_model`` refuses; missing or malformed experts are errors;
* one device: a ``device_map`` over several devices is refused.
"""

from __future__ import annotations

import os
from typing import Any

import torch
from torch import nn
from transformers.quantizers import HfQuantizer
from transformers.quantizers.auto import (
    AUTO_QUANTIZATION_CONFIG_MAPPING,
    AUTO_QUANTIZER_MAPPING,
    register_quantization_config,
    register_quantizer,
)
from transformers.utils.quantization_config import QuantizationConfigMixin

from ..checkpoint_source import CheckpointSource
from ..checkpoints import load_checkpoint_experts
from ..nvfp4 import NVFP4Tensor, dequantize_nvfp4
from ..phases import PhasePolicy
from .hf_blocks import block_over, check_block, expert_prefix, find_blocks, replace_module
from .hf_phases import install_phase_hooks
from .hf_save import QUANT_METHOD, modelopt_quantization_config

__all__ = ["REGISTERED", "FP4MoEConfig", "FP4MoEQuantizer"]


class FP4MoEConfig(QuantizationConfigMixin):
    """The ModelOpt NVFP4 quantization config (``config.json``'s ``quantization_config``)
    as transformers' quantizers take it. Unknown fields of the file are kept as they are.

    Args:
        quant_algo: must be ``"NVFP4"`` (an FP8 or mixed ModelOpt checkpoint is refused).
        group_size: must be 16.
        exclude_modules: the modules that are not NVFP4 (informational).
    """

    def __init__(
        self,
        quant_algo: str = "NVFP4",
        group_size: int = 16,
        kv_cache_quant_algo: str | None = None,
        exclude_modules: list[str] | None = None,
        **kwargs: Any,
    ) -> None:
        kwargs.pop("quant_method", None)
        self.quant_method = QUANT_METHOD
        self.quant_algo = quant_algo
        self.group_size = group_size
        self.kv_cache_quant_algo = kv_cache_quant_algo
        self.exclude_modules = list(exclude_modules or [])
        self.extra = kwargs  # e.g. producer

    def to_dict(self) -> dict[str, Any]:
        return {
            **self.extra, "quant_method": self.quant_method, "quant_algo": self.quant_algo,
            "group_size": self.group_size, "kv_cache_quant_algo": self.kv_cache_quant_algo,
            "exclude_modules": list(self.exclude_modules),
        }  # fmt: skip


class _Stored(nn.Module):
    """Holds checkpoint tensors under their own names (buffers of the stored dtype and
    shape), for transformers to load into."""

    def __init__(self, tensors: dict[str, tuple[torch.dtype, tuple[int, ...]]]) -> None:
        super().__init__()
        for leaf, (dtype, shape) in tensors.items():
            self.register_buffer(leaf, torch.empty(shape, dtype=dtype, device="meta"))


class _StoredLinear(_Stored):
    """An NVFP4 linear as stored; :meth:`decoded` is the nn.Linear it stands for."""

    def __init__(self, tensors, linear: nn.Linear) -> None:
        super().__init__(tensors)
        self.out_features, self.in_features = linear.out_features, linear.in_features
        self.bias = linear.bias

    def decoded(self, dtype: torch.dtype) -> nn.Linear:
        if hasattr(self, "weight_packed"):  # compressed-tensors: an encode global
            global_scale = torch.reciprocal(self.weight_global_scale.float().reshape(()))
            codes = self.weight_packed
        else:
            global_scale, codes = self.weight_scale_2.float().reshape(()), self.weight
        q = NVFP4Tensor(codes, self.weight_scale.view(torch.float8_e4m3fn), global_scale)
        linear = nn.Linear(self.in_features, self.out_features, bias=self.bias is not None,
                           device="meta")  # fmt: skip
        linear.weight = nn.Parameter(dequantize_nvfp4(q, dtype), requires_grad=False)
        if self.bias is not None:
            linear.bias = self.bias
        return linear


class FP4MoEQuantizer(HfQuantizer):
    """Loads ModelOpt NVFP4 MoE checkpoints into fp4moe layers (module docstring)."""

    requires_calibration = False

    def __init__(self, quantization_config: FP4MoEConfig, **kwargs: Any) -> None:
        super().__init__(quantization_config, **kwargs)
        self._blocks: dict[str, str] = {}  # block path -> its experts' prefix on disk
        self._linears: list[str] = []

    def validate_environment(self, device_map: Any = None, **kwargs: Any) -> None:
        algo = self.quantization_config.quant_algo
        if algo != "NVFP4" or self.quantization_config.group_size != 16:
            raise ValueError(
                f"quantization_config: fp4moe reads ModelOpt NVFP4 (group size 16), this "
                f"checkpoint is {algo!r} (group size {self.quantization_config.group_size})"
            )
        if isinstance(device_map, dict) and len(set(device_map.values())) > 1:
            raise NotImplementedError(
                "device_map: fp4moe loads a model onto one device; got "
                f"{sorted(set(map(str, device_map.values())))}"
            )

    def _process_model_before_weight_loading(
        self, model: nn.Module, checkpoint_files: list[str] | None = None, **kwargs: Any
    ) -> None:
        if not checkpoint_files:
            raise ValueError("fp4moe: from_pretrained gave the quantizer no checkpoint files")
        with CheckpointSource(os.path.dirname(checkpoint_files[0])) as src:
            keys = set(src.all_keys())
            aliases = set()
            for name, block in find_blocks(model):
                arch, _ = check_block(block)
                prefix = expert_prefix(name, arch, keys, None)
                if arch.checkpoint_alias is not None:
                    aliases.add(arch.checkpoint_alias)
                under = [k for k in keys if k.startswith(prefix + ".")]
                stored: dict[str, dict] = {}
                for k in under:
                    e, proj, leaf = k[len(prefix) + 1 :].split(".", 2)
                    stored.setdefault(e, {}).setdefault(proj, {})[leaf] = src.info(k)
                block.experts = nn.ModuleDict(
                    {e: nn.ModuleDict({p: _Stored(t) for p, t in projs.items()})
                     for e, projs in stored.items()}
                )  # fmt: skip
                self._blocks[name] = prefix
            for name, m in list(model.named_modules()):
                if not isinstance(m, nn.Linear):
                    continue
                for disk in {name} | {name.replace(f".{a}.", f".{b}.", 1) for a, b in aliases}:
                    leaves = [lf for lf in ("weight", "weight_packed", "weight_scale",
                                            "weight_scale_2", "weight_global_scale")
                              if src.has(f"{disk}.{lf}")]  # fmt: skip
                    if "weight_scale" in leaves and (
                        "weight_packed" in leaves or src.info(f"{disk}.weight")[0] == torch.uint8
                    ):
                        info = {lf: src.info(f"{disk}.{lf}") for lf in leaves}
                        replace_module(model, name, _StoredLinear(info, m))
                        self._linears.append(name)
                        break

    def update_weight_conversions(
        self, weight_conversions: list, model: nn.Module | None = None
    ) -> list:  # (transformers before 5.24 passes no model)
        # The experts stay one tensor set an expert (no merge into gate_up_proj / down_proj).
        def merges_experts(conv: Any) -> bool:
            targets = getattr(conv, "_original_target_patterns", None) or []
            return type(conv).__name__ == "WeightConverter" and any(
                t.endswith(("experts.gate_up_proj", "experts.down_proj")) for t in targets
            )

        return [c for c in weight_conversions if not merges_experts(c)]

    def _process_model_after_weight_loading(self, model: nn.Module, **kwargs: Any) -> None:
        from transformers import AutoModelForCausalLM

        dtype = next(p.dtype for p in model.parameters() if p.is_floating_point())
        for name in self._linears:
            replace_module(model, name, model.get_submodule(name).decoded(dtype))
        # The blocks' own expert modules were replaced before loading: a skeleton block of
        # the same config gives the shapes convert's checks read (on meta, no memory).
        with torch.device("meta"):
            skeleton = AutoModelForCausalLM.from_config(model.config)
        policy = PhasePolicy()
        for name, prefix in self._blocks.items():
            block = model.get_submodule(name)
            tensors = {
                f"{prefix}.{e}.{proj}.{leaf}": t
                for e, projs in block.experts.items()
                for proj, stored in projs.items()
                for leaf, t in stored.named_buffers()
            }
            n = len(block.experts)
            device = next(iter(tensors.values())).device
            block.experts = skeleton.get_submodule(name).experts
            check_block(block)
            prepared = load_checkpoint_experts(tensors, prefix=prefix, num_experts=n, device=device)
            replace_module(model, name, block_over(block, prepared, policy))
            del tensors
        install_phase_hooks(model)
        self.quantization_config.exclude_modules = modelopt_quantization_config(model)[
            "exclude_modules"
        ]

    def is_serializable(self) -> bool:
        return True  # save_pretrained writes the experts in this same layout

    @property
    def is_trainable(self) -> bool:
        return False

    @property
    def is_compileable(self) -> bool:
        return True


def _register() -> bool:
    if QUANT_METHOD in AUTO_QUANTIZER_MAPPING or QUANT_METHOD in AUTO_QUANTIZATION_CONFIG_MAPPING:
        return AUTO_QUANTIZER_MAPPING.get(QUANT_METHOD) is FP4MoEQuantizer
    register_quantization_config(QUANT_METHOD)(FP4MoEConfig)
    register_quantizer(QUANT_METHOD)(FP4MoEQuantizer)
    return True


# Whether transformers' "modelopt" quant method is fp4moe's (False: another was there).
REGISTERED: bool = _register()
