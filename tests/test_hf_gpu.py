"""Converted Hugging Face models on the GPU: the Triton backend against the reference
backend on the same converted model, and generate with a phase policy (marked gpu)."""

from __future__ import annotations

import copy

import pytest
import torch

transformers = pytest.importorskip("transformers")

import fp4moe  # noqa: E402
from fp4moe.integrations.hf import convert, moe_layers  # noqa: E402
from test_hf import build  # noqa: E402


@pytest.mark.gpu
@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral", "deepseek_v3"])
def test_converted_model_triton_matches_reference_gpu(arch):
    model = build(arch).cuda()
    policy = fp4moe.PhasePolicy(prefill="w4a4-token", decode="w4a16")
    tri = convert(model, policy)
    ref = copy.deepcopy(tri)
    for layer in moe_layers(ref).values():
        layer.policy = fp4moe.PhasePolicy(prefill="w4a4-token", decode="w4a16", backend="reference")
    ids = torch.randint(0, 128, (2, 12), device="cuda")
    with torch.no_grad():
        a = tri(input_ids=ids).logits.float()
        b = ref(input_ids=ids).logits.float()
    assert torch.isfinite(a).all()
    assert ((a - b).norm() / b.norm()).item() < 2e-2
    out = tri.generate(ids, max_new_tokens=4, do_sample=False)
    assert out.shape == (2, 16)
    stats = next(iter(moe_layers(tri).values())).stats
    assert stats.calls["prefill"] >= 1 and stats.calls["decode"] >= 3
