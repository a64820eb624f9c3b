"""Model shapes the tools (``fp4moe bench``, ``fp4moe plan``) take by name, and the modes
they run (the names of ``fp4moe.modes``)."""

from __future__ import annotations

from dataclasses import dataclass

from .modes import MODE_NAMES, resolve_mode

__all__ = ["MODES", "PRESETS", "Preset"]


@dataclass(frozen=True)
class Preset:
    hidden: int
    inter: int
    experts: int  # in the whole model
    local_experts: int  # held by the benchmarked rank (expert parallelism)
    top_k: int
    method: str = "softmax"
    n_group: int = 1
    topk_group: int = 1
    scaling: float = 1.0


PRESETS = {
    "deepseek-v3-ep8": Preset(7168, 2048, 256, 32, 8, "sigmoid_grouped", 8, 4, 2.5),
    "qwen3-30b-a3b": Preset(2048, 768, 128, 128, 8, "softmax"),
    "mixtral-8x7b": Preset(4096, 14336, 8, 8, 2, "topk_softmax"),
    "kimi-k2-ep8": Preset(7168, 2048, 384, 48, 8, "sigmoid_grouped", 1, 1, 2.827),
    "gpt-oss-120b-shape": Preset(2880, 2880, 128, 128, 4, "topk_softmax"),
}
# mode name -> (kernel family, W4A4 activation scale), as the backends take them
MODES = {name: resolve_mode(name) for name in MODE_NAMES}
