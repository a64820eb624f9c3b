"""What ``model.save_pretrained()`` writes for a converted model: its NVFP4 experts in the
ModelOpt layout (the state dict of each ``FP4MoEBlock``, ``hf_blocks``) beside the dense
weights, and the quantization config that says so.

``convert`` / ``load_model`` put :func:`modelopt_quantization_config` into
``model.config.quantization_config``, so ``config.json`` carries it::

    {"quant_method": "modelopt", "quant_algo": "NVFP4", "group_size": 16,
     "kv_cache_quant_algo": null, "exclude_modules": [every linear that is not an expert],
     "producer": {"name": "fp4moe", "version": ...}}

Only the routed experts are NVFP4 in such a folder: attention, routers, shared experts,
dense MLPs, embeddings and the output head are saved in the model's dtype (bf16), which is
what ``exclude_modules`` lists. ``fp4moe.load_model`` reads the folder back bit for bit.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from .hf_blocks import FP4MoEBlock

__all__ = ["QUANT_METHOD", "modelopt_quantization_config", "set_quantization_config"]

QUANT_METHOD = "modelopt"


def modelopt_quantization_config(model: nn.Module) -> dict[str, Any]:
    """The ModelOpt-style quantization config of a converted model (module docstring)."""
    from .. import __version__

    blocks = [n for n, m in model.named_modules() if isinstance(m, FP4MoEBlock)]
    exclude = sorted(
        name
        for name, m in model.named_modules()
        if isinstance(m, nn.Linear) and not any(name.startswith(b + ".moe.") for b in blocks)
    )
    return {
        "quant_method": QUANT_METHOD,
        "quant_algo": "NVFP4",
        "group_size": 16,
        "kv_cache_quant_algo": None,
        "exclude_modules": exclude,
        "producer": {"name": "fp4moe", "version": __version__},
    }


def set_quantization_config(model: nn.Module) -> None:
    """Put :func:`modelopt_quantization_config` into ``model.config`` (a transformers
    model; other modules have no config and are left alone)."""
    config = getattr(model, "config", None)
    if config is not None and hasattr(config, "to_dict"):
        config.quantization_config = modelopt_quantization_config(model)
