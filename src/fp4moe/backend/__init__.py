"""The Triton backend's planning layer: the public options, the planner and its named
heuristics, and the device facts it reads. Importing it imports no Triton kernel."""

from .device import H200, Target, target_for
from .options import KERNELS, InapplicableOverride, Options, Tile
from .plan import GemmPlan, Plan, experts_scales_tma, explain, plan_call, workspace_bytes

__all__ = [
    "H200",
    "KERNELS",
    "GemmPlan",
    "InapplicableOverride",
    "Options",
    "Plan",
    "Target",
    "Tile",
    "experts_scales_tma",
    "explain",
    "plan_call",
    "target_for",
    "workspace_bytes",
]
