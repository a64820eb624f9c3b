"""fp4moe: Mixture-of-Experts layers over NVFP4 expert weights.

One prepared copy of the experts serves every mode of ``fp4moe.modes`` (``MODE_NAMES``):
W4A16, W4A8 (e4m3 activations and weights, FP8 tensor cores) and W4A4 (per-tensor,
per-token or static activation scales); see README.md and docs/. ``fp4moe.load_model``
(a checkpoint folder to a transformers model) imports transformers on first use.
"""

from typing import Any

from .backend import InapplicableOverride, Options, Plan, Tile, explain
from .checkpoints import load_checkpoint_experts, save_modelopt_experts
from .distributed import EPMoELayer
from .experts import PreparedExperts, load_experts, prepare_experts
from .modes import MODE_NAMES
from .moe import moe, plan
from .nvfp4 import NVFP4Tensor, dequantize_nvfp4, quantize_nvfp4
from .phases import (
    MoELayer,
    PhaseConfig,
    PhasePolicy,
    RouterConfig,
    current_phase,
    serving_phase,
    set_phase,
)
from .routing import expert_range, local_expert_ids, route
from .runner import MoERunner

__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    # load_model needs transformers: imported when first asked for, not with fp4moe.
    if name == "load_model":
        from .integrations.hf_load import load_model

        return load_model
    raise AttributeError(f"module 'fp4moe' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | {"load_model"})


__all__ = [
    "MODE_NAMES",
    "EPMoELayer",
    "InapplicableOverride",
    "MoELayer",
    "MoERunner",
    "NVFP4Tensor",
    "Options",
    "PhaseConfig",
    "PhasePolicy",
    "Plan",
    "PreparedExperts",
    "RouterConfig",
    "Tile",
    "__version__",
    "current_phase",
    "dequantize_nvfp4",
    "expert_range",
    "explain",
    "load_checkpoint_experts",
    "load_experts",
    "load_model",
    "local_expert_ids",
    "moe",
    "plan",
    "prepare_experts",
    "quantize_nvfp4",
    "route",
    "save_modelopt_experts",
    "serving_phase",
    "set_phase",
]
