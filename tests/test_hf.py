"""fp4moe.integrations.hf on tiny random transformers models, on the CPU.

Converted blocks and whole models against the originals whose experts hold the dequantized
NVFP4 weights (so only activation numerics differ), phase inference inside ``generate``,
NVFP4 checkpoints (our ModelOpt-layout writer, compressed-tensors, ModelOpt's own export),
the refusal of gpt-oss and other unsupported blocks, and that no bf16 copy of the experts
is kept. Skipped when transformers is not installed.

Measured on transformers 5.24 / torch 2.13 CPU, these tests' inputs (relative Frobenius
errors):
- block, converted (W4A16) vs HF's own bf16 block with the dequantized experts: 0.0054 .. 0.0056;
- routed experts against HF's expert loop in fp32 on the same routes: ours (W4A16) 0.0037 ..
  0.0039, HF's own bf16 loop 0.0041 .. 0.0044; W4A4 per-token 0.161 .. 0.167 (two NVFP4
  activation quantizations of random data);
- whole-model logits vs the original in bf16: W4A16 0.0033 .. 0.0039, W4A8 0.0062 .. 0.012,
  W4A4 (per-token or per-tensor) 0.011 .. 0.032.
- routes: the same experts as HF's router for every token; the same weights bit for bit
  (Qwen3, Mixtral) or to 1e-6 relative (DeepSeek-V3 sums its k weights in another order).
"""

from __future__ import annotations

import copy
import gc
import weakref

import pytest
import torch
from torch import nn

transformers = pytest.importorskip("transformers")

import fp4moe  # noqa: E402
from fp4moe import (  # noqa: E402
    PhasePolicy,
    PreparedExperts,
    load_checkpoint_experts,
    prepare_experts,
    serving_phase,
)
from fp4moe import phases as phases_module  # noqa: E402
from fp4moe.checkpoints import save_compressed_tensors_experts, save_modelopt_experts  # noqa: E402
from fp4moe.integrations import hf  # noqa: E402

ARCHS = ["qwen3_moe", "mixtral", "deepseek_v3"]
MIXTRAL_NAMES = ("w1", "w3", "w2")
_COMMON = dict(
    vocab_size=128, num_hidden_layers=2, num_attention_heads=2, max_position_embeddings=128
)


_MODELS = {
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "mixtral": "MixtralForCausalLM",
    "deepseek_v3": "DeepseekV3ForCausalLM",
}


def config(arch: str, **over):
    over = {"architectures": [_MODELS[arch]], **over}  # ModelOpt's exporter reads it
    if arch == "qwen3_moe":
        kw = dict(
            hidden_size=64, intermediate_size=64, moe_intermediate_size=32, num_experts=8,
            num_experts_per_tok=2, norm_topk_prob=True, num_key_value_heads=1, head_dim=32,
        )  # fmt: skip
        return transformers.Qwen3MoeConfig(**(_COMMON | kw | over))
    if arch == "mixtral":
        kw = dict(
            hidden_size=64, intermediate_size=64, num_local_experts=4, num_experts_per_tok=2,
            num_key_value_heads=1, head_dim=32,
        )  # fmt: skip
        return transformers.MixtralConfig(**(_COMMON | kw | over))
    kw = dict(
        hidden_size=128, intermediate_size=64, moe_intermediate_size=32, n_routed_experts=8,
        num_experts_per_tok=3, n_group=4, topk_group=2, n_shared_experts=1,
        first_k_dense_replace=1, routed_scaling_factor=2.5, norm_topk_prob=True,
        num_key_value_heads=2, q_lora_rank=32, kv_lora_rank=32, qk_rope_head_dim=16,
        qk_nope_head_dim=16, v_head_dim=16,
    )  # fmt: skip
    return transformers.DeepseekV3Config(**(_COMMON | kw | over))


def build(arch: str, seed: int = 0, dtype: torch.dtype = torch.bfloat16, **over) -> nn.Module:
    """A tiny random model; routers get larger weights (clear choices) and DeepSeek a
    correction bias that changes some of them."""
    torch.manual_seed(seed)
    model = getattr(transformers, _MODELS[arch])(config(arch, **over)).to(dtype).eval()
    gen = torch.Generator().manual_seed(seed + 100)
    with torch.no_grad():
        for m in model.modules():
            if type(m).__name__ in hf.SUPPORTED_BLOCKS:
                w = m.gate.weight
                w.copy_(torch.randn(w.shape, generator=gen) / w.shape[1] ** 0.5)
                if arch == "deepseek_v3":
                    b = m.gate.e_score_correction_bias
                    b.copy_(torch.randn(b.shape, generator=gen) * 0.3)
    return model


def moe_blocks(model: nn.Module) -> list[tuple[str, nn.Module]]:
    return [(n, m) for n, m in model.named_modules() if type(m).__name__ in hf.SUPPORTED_BLOCKS]


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


def load_dequantized(model: nn.Module, converted: nn.Module) -> None:
    """Give ``model``'s original blocks the dequantized NVFP4 experts of ``converted``."""
    for name, layer in hf.moe_layers(converted).items():
        ex = model.get_submodule(name).experts
        w13, w2 = layer.experts.dequantize(torch.float32)
        with torch.no_grad():
            ex.gate_up_proj.copy_(w13)
            ex.down_proj.copy_(w2)


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view({1: torch.uint8, 4: torch.int32}[t.element_size()])


def assert_identical(a: PreparedExperts, b: PreparedExperts) -> None:
    la, lb = a.to_linear(), b.to_linear()
    assert sorted(la) == sorted(lb)
    for k in la:
        assert la[k].dtype == lb[k].dtype and la[k].shape == lb[k].shape, k
        assert torch.equal(bits(la[k]), bits(lb[k])), k


def hidden(model: nn.Module, tokens: int = 18, seed: int = 1) -> torch.Tensor:
    h = model.config.hidden_size
    return torch.randn(2, tokens // 2, h, generator=torch.Generator().manual_seed(seed)).bfloat16()


# ------------------------------------------------------------------------------ blocks


@pytest.mark.parametrize(
    ("arch", "over"),
    [
        ("qwen3_moe", {}),
        ("qwen3_moe", {"norm_topk_prob": False}),
        ("mixtral", {}),
        ("deepseek_v3", {}),
        ("deepseek_v3", {"norm_topk_prob": False, "n_group": 2, "topk_group": 1}),
    ],
    ids=["qwen3", "qwen3-no-norm", "mixtral", "deepseek", "deepseek-g2-no-norm"],
)
def test_block_matches_hf(arch, over):
    model = build(arch, **over)
    _, block = moe_blocks(model)[0]
    ref = copy.deepcopy(block)
    new = hf.convert_block(block, "w4a16")
    w13, w2 = new.experts.dequantize(torch.float32)
    with torch.no_grad():
        ref.experts.gate_up_proj.copy_(w13)
        ref.experts.down_proj.copy_(w2)
    x = hidden(model)
    x2d = x.reshape(-1, x.shape[-1])
    with torch.no_grad():
        # The router: the same experts, the same weights (HF's order may differ).
        hf_logits, hf_weights, hf_ids = ref.gate(x2d)
        assert torch.equal(new.router_logits(x2d), hf_logits)
        ids, weights = new.route(x2d)
        ours_sorted, order = ids.long().sort(-1)
        hf_sorted, hf_order = hf_ids.long().sort(-1)
        assert torch.equal(ours_sorted, hf_sorted)
        ours_w, hf_w = weights.gather(1, order), hf_weights.float().gather(1, hf_order)
        if arch == "deepseek_v3":  # HF sums the k weights in another order
            torch.testing.assert_close(ours_w, hf_w, rtol=1e-6, atol=0)
        else:
            assert torch.equal(ours_w, hf_w)

        # The whole block against HF's bf16 block: bf16 rounding in HF's expert loop.
        out = new(x)
        assert out.dtype == x.dtype and out.shape == x.shape
        assert rel(out, ref(x)) < 2e-2

        # The routed experts against HF's expert loop in fp32 on the same routes: three bf16
        # roundings (a, route rows, output), no worse than HF's own bf16 loop.
        ex32 = copy.deepcopy(ref.experts).float()
        exact = ex32(x2d.float(), ids.long(), weights)
        ours = rel(new.moe(x2d, routes=(ids, weights)), exact)
        assert ours < 6e-3
        assert ours < 1.2 * rel(ref.experts(x2d, hf_ids, hf_weights), exact)
        # W4A4 really quantizes the activations (and stays in the expected range).
        new.moe.policy = PhasePolicy.single("w4a4-token")
        w4a4 = rel(new.moe(x2d, routes=(ids, weights)), exact)
        assert 2e-2 < w4a4 < 0.25


def test_deepseek_shared_experts_are_the_models_own():
    model = build("deepseek_v3")
    _, block = moe_blocks(model)[0]
    new = hf.convert_block(block, "w4a16")
    assert new.shared_experts is block.shared_experts
    assert new.gate is block.gate
    x = hidden(model)
    with torch.no_grad():
        routed = new.moe(x.reshape(-1, x.shape[-1]), routes=new.route(x.reshape(-1, x.shape[-1])))
        assert torch.equal(new(x), routed.reshape(x.shape) + block.shared_experts(x))
    # The gate's own correction bias routes (no copy: load_state_dict and .to() reach it),
    # and the state dict holds the experts under ModelOpt names, not the layer's buffers.
    assert new.moe.correction_bias is None
    with torch.no_grad():
        block.gate.e_score_correction_bias.add_(1.0)
        x2d = x.reshape(-1, x.shape[-1])
        shifted = fp4moe.route(
            new.router_logits(x2d), 3, method="sigmoid_grouped",
            correction_bias=block.gate.e_score_correction_bias.float(), n_group=4, topk_group=2,
            scaling_factor=2.5,
        )  # fmt: skip
        assert all(torch.equal(a, b) for a, b in zip(new.route(x2d), shifted))
    sd = new.state_dict()
    assert not any(k.startswith("moe.") for k in sd)
    assert "experts.0.gate_proj.weight_scale_2" in sd and "gate.e_score_correction_bias" in sd


# ------------------------------------------------------------------------------ models


@pytest.mark.parametrize("arch", ARCHS)
def test_model_logits(arch):
    model = build(arch)
    original = copy.deepcopy(model)
    hf.convert(model, "w4a16")
    load_dequantized(original, model)
    ids = torch.randint(0, 128, (2, 11), generator=torch.Generator().manual_seed(2))
    policies = {
        "w4a16": 2e-2,
        "w4a8": 3e-2,
        "w4a4-token": 6e-2,
        "w4a4-tensor": 6e-2,
        PhasePolicy(prefill="w4a4-token", decode="w4a16"): 6e-2,
        PhasePolicy(prefill="w4a8", decode="w4a16"): 3e-2,
    }
    with torch.no_grad():
        ref = original(ids).logits
        for policy, tol in policies.items():
            for layer in hf.moe_layers(model).values():
                layer.policy = PhasePolicy.coerce(policy)
            out = model(ids).logits
            assert out.dtype == ref.dtype and out.shape == ref.shape
            assert rel(out, ref) < tol, policy


@pytest.mark.parametrize("arch", ["qwen3_moe", "deepseek_v3"])
def test_output_router_logits(arch):
    """transformers records the router logits through hooks on the router module: the
    converted block then calls that module, and the logits are the original model's."""
    model = build(arch)
    original = copy.deepcopy(model)
    hf.convert(model, "w4a16")
    ids = torch.randint(0, 128, (2, 6), generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        before = model(ids).logits  # router weight used directly
        ours = model(ids, output_router_logits=True).router_logits  # hooks now installed
        ref = original(ids, output_router_logits=True).router_logits
        assert len(ours) == len(ref) == len(hf.moe_layers(model))
        assert torch.equal(ours[0], ref[0])  # the first MoE layer sees the same input
        assert torch.equal(model(ids).logits, before)  # through the router module: the same


def test_fp32_model_and_expert_dtype():
    """An fp32 model: the experts see bf16 activations, the block returns fp32;
    expert_dtype=bf16 quantizes the bf16-rounded weights."""
    model = build("qwen3_moe", dtype=torch.float32)
    _, block = moe_blocks(model)[0]
    w13 = block.experts.gate_up_proj.detach().clone()
    w2 = block.experts.down_proj.detach().clone()
    assert_identical(hf.convert_block(block).experts, prepare_experts(w13, w2))
    as_bf16 = hf.convert_block(block, expert_dtype=torch.bfloat16).experts
    assert_identical(as_bf16, prepare_experts(w13.bfloat16(), w2.bfloat16()))
    original = copy.deepcopy(model)
    hf.convert(model, "w4a16")
    load_dequantized(original, model)
    ids = torch.randint(0, 128, (2, 11), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        out, ref = model(ids).logits, original(ids).logits
    assert out.dtype == torch.float32
    assert rel(out, ref) < 1e-2


# ------------------------------------------------------------------------------ phases


@pytest.fixture
def mode_spy(monkeypatch):
    """Records (tokens, mode) of every fp4moe.moe call made by a MoELayer."""
    calls: list[tuple[int, str]] = []
    real = phases_module.moe

    def spy(x, ids, w, experts, *, mode, **kw):
        calls.append((x.shape[0], mode))
        return real(x, ids, w, experts, mode=mode, **kw)

    monkeypatch.setattr(phases_module, "moe", spy)
    return calls


def _reset_stats(model: nn.Module) -> None:
    for layer in hf.moe_layers(model).values():
        layer.stats = type(layer.stats)()


def _stats(model: nn.Module) -> set[tuple]:
    return {
        (tuple(layer.stats.calls.values()), tuple(layer.stats.tokens.values()))
        for layer in hf.moe_layers(model).values()
    }


@pytest.mark.parametrize("arch", ARCHS)
def test_generate_prompt_is_prefill_then_decode(arch, mode_spy):
    model = build(arch)
    hf.convert(model, PhasePolicy(prefill="w4a4-token", decode="w4a16"))
    n_layers = len(hf.moe_layers(model))
    ids = torch.randint(0, 128, (2, 7), generator=torch.Generator().manual_seed(4))
    mask = torch.ones_like(ids)
    out = model.generate(ids, attention_mask=mask, max_new_tokens=5, min_new_tokens=5,
                         do_sample=False, pad_token_id=0)  # fmt: skip
    assert out.shape == (2, 12)
    # 14 prompt tokens: the policy's threshold (64) alone would call them decode.
    assert _stats(model) == {((1, 4), (14, 8))}  # (prefill, decode) calls and tokens
    assert mode_spy == [(14, "w4a4-token")] * n_layers + [(2, "w4a16")] * 4 * n_layers
    assert fp4moe.current_phase() is None


def test_convert_with_the_hopper_policy(mode_spy):
    """convert(policy=PhasePolicy(prefill="w4a8", decode="w4a16")): generate's prompt pass
    runs W4A8, its later steps W4A16, and the prompt pass gives W4A8's own numbers."""
    model = build("qwen3_moe")
    hf.convert(model, policy=PhasePolicy(prefill="w4a8", decode="w4a16"))
    n_layers = len(hf.moe_layers(model))
    ids = torch.randint(0, 128, (1, 5), generator=torch.Generator().manual_seed(8))
    model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=3, min_new_tokens=3,
                   do_sample=False, pad_token_id=0)  # fmt: skip
    assert mode_spy == [(5, "w4a8")] * n_layers + [(1, "w4a16")] * 2 * n_layers
    with torch.no_grad():
        prefill = model(ids).logits
        for layer in hf.moe_layers(model).values():
            layer.policy = PhasePolicy.single("w4a16")
        assert not torch.equal(model(ids).logits, prefill)  # W4A8 is not W4A16 renamed


def test_generate_explicit_phase_and_no_hooks():
    model = build("qwen3_moe")
    hf.convert(model, PhasePolicy(prefill="w4a4-token", decode="w4a16"))
    ids = torch.randint(0, 128, (2, 7), generator=torch.Generator().manual_seed(4))
    mask = torch.ones_like(ids)

    # A phase the caller sets wins, for every step.
    for phase, expected in (("decode", {((0, 5), (0, 22))}), ("prefill", {((5, 0), (22, 0))})):
        _reset_stats(model)
        with serving_phase(phase):
            model.generate(ids, attention_mask=mask, max_new_tokens=5, min_new_tokens=5,
                           do_sample=False, pad_token_id=0)  # fmt: skip
        assert _stats(model) == expected, phase

    # Without the hooks: the token-count threshold of the policy.
    hf.remove_phase_hooks(model)
    _reset_stats(model)
    model.generate(ids, attention_mask=mask, max_new_tokens=5, min_new_tokens=5,
                   do_sample=False, pad_token_id=0)  # fmt: skip
    assert _stats(model) == {((0, 5), (0, 22))}


def test_plain_forward_phases_and_reset_after_error():
    model = build("qwen3_moe")
    hf.convert(model)
    hf.install_phase_hooks(model)  # a second install is a no-op
    ids = torch.randint(0, 128, (1, 5))
    with torch.no_grad():
        model(ids)  # several tokens: prefill
        model(ids[:, :1])  # one token, no cache: prefill
        out = model(ids, use_cache=True)
        model(ids[:, :1], cache=out.past_key_values)  # one token after a cache: decode
        model(ids[:, :1], None, None, out.past_key_values)  # the same, positionally
    assert _stats(model) == {((3, 2), (11, 2))}
    twin = copy.deepcopy(model)  # the hooks come along, each model with its own
    _reset_stats(twin)
    with torch.no_grad():
        twin(ids)
    assert _stats(twin) == {((1, 0), (5, 0))}
    hf.remove_phase_hooks(twin)
    assert not twin._forward_pre_hooks and model._forward_pre_hooks
    with pytest.raises(IndexError), torch.no_grad():
        model(torch.full((1, 3), 10_000))  # fails inside the forward
    assert fp4moe.current_phase() is None


def test_infer_phase_rule():
    cache = transformers.DynamicCache(config=config("qwen3_moe"))
    one, many = torch.zeros(2, 1, dtype=torch.long), torch.zeros(2, 6, dtype=torch.long)
    assert hf.infer_phase(many) == "prefill"
    assert hf.infer_phase(one) == "prefill"
    assert hf.infer_phase(one, cache=cache) == "prefill"  # empty cache
    k = torch.zeros(2, 1, 3, 32)
    cache.update(k, k, 0)
    cache.update(k, k, 1)
    assert hf.infer_phase(one, cache=cache) == "decode"
    assert hf.infer_phase(many, cache=cache) == "prefill"  # a chunk, or a new turn
    assert hf.infer_phase(inputs_embeds=torch.zeros(2, 1, 64), cache=cache) == "decode"
    assert hf.infer_phase(one, cache=((k, k),)) == "decode"  # legacy tuple
    assert hf.infer_phase(one, cache=()) == "prefill"
    assert hf.infer_phase() is None


# ------------------------------------------------------------------------------ checkpoints


def _random_experts(block: nn.Module, seed: int, static: bool) -> PreparedExperts:
    """Experts unrelated to the model's weights, with gate and up scaled apart."""
    e, two_i, h = block.experts.gate_up_proj.shape
    gen = torch.Generator().manual_seed(seed)
    w13 = torch.randn(e, two_i, h, generator=gen)
    w13[:, two_i // 2 :] *= 3
    w2 = torch.randn(e, h, two_i // 2, generator=gen)
    scales = dict(a13_scale=torch.rand(e, generator=gen) + 0.1, a2_scale=torch.rand(e) + 0.1)
    return prepare_experts(w13.bfloat16(), w2.bfloat16(), **(scales if static else {}))


@pytest.mark.parametrize("arch", ARCHS)
def test_checkpoint_modelopt_layout(arch, tmp_path):
    """Experts written by save_modelopt_experts (Mixtral: its on-disk names
    ``block_sparse_moe.experts.{e}.w1``) are converted bit for bit; the model's own
    expert tensors are never read (they are on the meta device)."""
    model = build(arch)
    written: dict[str, PreparedExperts] = {}
    sd: dict[str, torch.Tensor] = {}
    for j, (name, block) in enumerate(moe_blocks(model)):
        written[name] = _random_experts(block, seed=j, static=True)
        if arch == "mixtral":
            prefix = name.replace(".mlp", ".block_sparse_moe") + ".experts"
            save_modelopt_experts(written[name], sd, prefix=prefix, names=MIXTRAL_NAMES)
        else:
            save_modelopt_experts(written[name], sd, prefix=f"{name}.experts")
        block.experts.to("meta")
    from safetensors.torch import save_file

    save_file(sd, tmp_path / "model.safetensors")
    hf.convert(model, "w4a4-static", checkpoint=tmp_path)
    layers = hf.moe_layers(model)
    assert sorted(layers) == sorted(written)
    for name, layer in layers.items():
        assert_identical(layer.experts, written[name])
    with torch.no_grad():
        logits = model(torch.randint(0, 128, (2, 5))).logits
    assert bool(torch.isfinite(logits).all())


def test_checkpoint_compressed_tensors_state_dict_and_errors():
    model = build("qwen3_moe")
    sd: dict[str, torch.Tensor] = {}
    written = {}
    for j, (name, block) in enumerate(moe_blocks(model)):
        written[name] = _random_experts(block, seed=10 + j, static=False)
        save_compressed_tensors_experts(written[name], sd, prefix=f"{name}.experts")
    fresh = copy.deepcopy(model)
    hf.convert(model, checkpoint=sd)
    for name, layer in hf.moe_layers(model).items():
        back = load_checkpoint_experts(sd, prefix=f"{name}.experts", num_experts=8)
        assert_identical(layer.experts, back)
    # Custom prefix mapping, and a clear error when the checkpoint lacks a block.
    renamed = {"llm." + k: v for k, v in sd.items()}
    hf.convert(
        copy.deepcopy(fresh), checkpoint=renamed, checkpoint_prefix=lambda n: f"llm.{n}.experts"
    )
    with pytest.raises(ValueError, match=r"no NVFP4 experts for block 'model\.layers\.0\.mlp'"):
        hf.convert(fresh, checkpoint=renamed)
    assert len(moe_blocks(fresh)) == 2  # nothing converted


@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral"])
def test_checkpoint_exported_by_modelopt(arch, tmp_path):
    """A tiny model quantized by NVIDIA ModelOpt (NVFP4_DEFAULT_CFG) and exported with its
    export_hf_checkpoint: converting the same model from that export gives the file's codes,
    block scales and global scales bit for bit. Against quantizing the model's own weights:
    the down projections are identical; ModelOpt gives gate and up one shared global scale
    (the larger of the two), and with that global our quantizer gives its codes and scales."""
    mtq = pytest.importorskip("modelopt.torch.quantization")
    from modelopt.torch.export import export_hf_checkpoint

    from fp4moe import quantize_nvfp4

    quantized = build(arch, num_hidden_layers=1)
    ids = torch.randint(0, 128, (4, 16), generator=torch.Generator().manual_seed(5))
    mtq.quantize(quantized, mtq.NVFP4_DEFAULT_CFG, lambda m: m(ids))
    export_hf_checkpoint(quantized, export_dir=tmp_path)

    from_file = hf.convert(build(arch, num_hidden_layers=1), "w4a4-static", checkpoint=tmp_path)
    name, layer = next(iter(hf.moe_layers(from_file).items()))
    assert name == "model.layers.0.mlp"
    prefix = f"model.layers.0.{'block_sparse_moe' if arch == 'mixtral' else 'mlp'}.experts"
    ex = layer.experts
    assert_identical(
        ex, load_checkpoint_experts(tmp_path, prefix=prefix, num_experts=ex.num_experts)
    )
    assert ex.a13_scale is not None  # ModelOpt's calibrated input scales came along

    _, block = moe_blocks(build(arch, num_hidden_layers=1))[0]
    w13, w2 = block.experts.gate_up_proj.detach(), block.experts.down_proj.detach()
    own = prepare_experts(w13, w2)
    for k in ("w2_codes", "w2_scales", "w2_global"):
        assert torch.equal(bits(getattr(ex, k)), bits(getattr(own, k))), k
    shared = own.w13_global.amax(dim=1)
    assert torch.equal(ex.w13_global, shared[:, None].expand(-1, 2))
    lin13 = ex.to_linear()["w13_codes"]  # the logical codes (the experts hold the fields layout)
    for e in range(ex.num_experts):
        q = quantize_nvfp4(w13[e], global_scale=shared[e])
        assert torch.equal(lin13[e], q.codes)
        assert torch.equal(bits(ex.w13_scales[e]), bits(q.scales))
    with torch.no_grad():
        assert bool(torch.isfinite(from_file(ids).logits).all())


# ------------------------------------------------------------------------------ refusals


def test_gpt_oss_is_refused():
    pytest.importorskip("transformers.models.gpt_oss")
    cfg = transformers.GptOssConfig(
        hidden_size=64, intermediate_size=32, num_local_experts=4, num_experts_per_tok=2,
        head_dim=32, num_key_value_heads=1, **_COMMON,
    )  # fmt: skip
    model = transformers.GptOssForCausalLM(cfg).eval()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(NotImplementedError, match=r"GptOssMLP.*clamped SwiGLU"):
        hf.convert(model)
    with pytest.raises(NotImplementedError, match="GptOssMLP"):
        hf.convert_block(model.model.layers[0].mlp)
    after = model.state_dict()
    assert sorted(after) == sorted(before)
    assert all(torch.equal(after[k], before[k]) for k in before)
    assert not getattr(model, "_fp4moe_phase_hooks", None)


def test_other_blocks_and_layouts_are_refused():
    class Experts(nn.Module):
        pass

    class CustomMoE(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.experts = Experts()

    model = nn.Sequential(build("qwen3_moe"), CustomMoE())
    with pytest.raises(NotImplementedError, match="CustomMoE"):
        hf.convert(model)
    assert len(moe_blocks(model)) == 2  # refused before anything changed

    plain = build("qwen3_moe")
    _, block = moe_blocks(plain)[0]
    block.experts.act_fn = nn.GELU()
    with pytest.raises(NotImplementedError, match="silu"):
        hf.convert_block(block)
    block.experts.act_fn = nn.SiLU()
    block.experts.has_bias = True
    with pytest.raises(NotImplementedError, match="biases"):
        hf.convert_block(block)
    block.experts.has_bias = False
    meta = copy.deepcopy(block).to("meta")
    with pytest.raises(ValueError, match="meta device"):
        hf.convert_block(meta)

    hf.convert(plain)
    with pytest.raises(ValueError, match="2 already converted"):
        hf.convert(plain)
    with pytest.raises(ValueError, match="convert_block"):
        hf.convert(moe_blocks(build("mixtral"))[0][1])


def test_transposed_and_interleaved_layouts():
    """Experts flagged is_transposed ([E, H, 2I], [E, I, H]) or not is_concatenated
    (gate and up rows interleaved) give the same prepared experts."""
    _, block = moe_blocks(build("qwen3_moe"))[0]
    expected = hf.convert_block(block).experts
    gu, down = block.experts.gate_up_proj.data, block.experts.down_proj.data
    t = copy.deepcopy(block)
    t.experts.gate_up_proj = nn.Parameter(gu.transpose(1, 2).contiguous())
    t.experts.down_proj = nn.Parameter(down.transpose(1, 2).contiguous())
    t.experts.is_transposed = True
    assert_identical(hf.convert_block(t).experts, expected)
    i = gu.shape[1] // 2
    inter = copy.deepcopy(block)
    inter.experts.gate_up_proj = nn.Parameter(torch.stack((gu[:, :i], gu[:, i:]), 2).flatten(1, 2))
    inter.experts.is_concatenated = False
    assert_identical(hf.convert_block(inter).experts, expected)


# ------------------------------------------------------------------------------ memory


def _expert_refs(model: nn.Module) -> tuple[list[weakref.ref], int]:
    refs, nbytes = [], 0
    for _, block in moe_blocks(model):
        for p in (block.experts.gate_up_proj, block.experts.down_proj):
            refs.append(weakref.ref(p))
            nbytes += p.numel() * p.element_size()
    return refs, nbytes


def _state_bytes(model: nn.Module) -> int:
    """Bytes of the model's parameters and buffers, less the NVFP4 expert buffers."""
    experts = {
        id(t) for layer in hf.moe_layers(model).values() for t in layer.experts.tensors().values()
    }
    tensors = list(model.parameters()) + list(model.buffers())
    return sum(t.numel() * t.element_size() for t in tensors if id(t) not in experts)


@pytest.mark.parametrize("arch", ARCHS)
def test_no_copy_of_the_original_experts(arch):
    model = build(arch)
    refs, expert_bytes = _expert_refs(model)
    before = _state_bytes(model)
    hf.convert(model)
    gc.collect()
    assert all(r() is None for r in refs)  # the model's expert tensors are freed
    names = [n for n, _ in model.named_parameters()] + [n for n, _ in model.named_buffers()]
    assert not [n for n in names if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]
    assert all(p.dim() <= 2 for p in model.parameters())
    layers = hf.moe_layers(model)
    assert _state_bytes(model) == before - expert_bytes  # no routing copy either
    nvfp4 = sum(layer.experts.nbytes() for layer in layers.values())
    assert nvfp4 < expert_bytes * 0.3  # 4.5 bits a weight (+ scales) instead of 16
    for layer in layers.values():
        assert layer.memory_report()["copies_of_expert_weights"] == 1
