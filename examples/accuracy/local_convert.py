"""A minimal stand-in for ``fp4moe.integrations.hf.convert`` (Qwen3-MoE only).

evaluate.py uses the library's converter when it exists (``--convert auto``, the default);
this module is the fallback it was developed against, and ``--convert local`` forces it.
Each ``Qwen3MoeSparseMoeBlock`` becomes a module that routes exactly as the Hugging Face block
does (its own router: bf16 logits, softmax in fp32, top-k, renormalized, weights rounded to
the model dtype) and runs the experts through one ``fp4moe.MoELayer`` over NVFP4 experts.
"""

from __future__ import annotations

import torch
from torch import nn

import fp4moe


class LocalFp4MoeBlock(nn.Module):
    def __init__(self, block: nn.Module, policy) -> None:
        super().__init__()
        self.gate = block.gate  # the HF router, unchanged
        ex = block.experts
        experts = fp4moe.prepare_experts(ex.gate_up_proj.detach(), ex.down_proj.detach())
        self.moe = fp4moe.MoELayer(
            experts, fp4moe.RouterConfig(top_k=block.gate.top_k), policy=policy
        )

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        b, s, h = hidden_states.shape
        x = hidden_states.reshape(-1, h)
        _, weights, ids = self.gate(x)
        out = self.moe(x.to(torch.bfloat16), routes=(ids.to(torch.int32), weights.float()))
        return out.to(hidden_states.dtype).reshape(b, s, h)


def convert(model: nn.Module, policy="w4a16", checkpoint=None) -> nn.Module:
    """Replace every Qwen3MoeSparseMoeBlock of ``model`` in place; returns ``model``."""
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    if checkpoint is not None:
        raise ValueError("checkpoint: the local converter only quantizes the model's weights")
    n = 0
    for name, mod in list(model.named_modules()):
        if isinstance(mod, Qwen3MoeSparseMoeBlock):
            parent_name, _, attr = name.rpartition(".")
            setattr(model.get_submodule(parent_name), attr, LocalFp4MoeBlock(mod, policy))
            n += 1
    if n == 0:
        raise ValueError("model: no Qwen3MoeSparseMoeBlock to convert")
    return model
