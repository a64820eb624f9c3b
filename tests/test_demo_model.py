"""The transformer demo (``fp4moe demo``) on tiny models: report fields, the phases' modes,
agreement with bf16, memory, one shared copy, ``--model-config`` and NVFP4 checkpoints."""

from __future__ import annotations

import json
import math

import pytest
import torch

transformers = pytest.importorskip("transformers")

import fp4moe.phases  # noqa: E402
from fp4moe.checkpoint_source import CheckpointSource  # noqa: E402
from fp4moe.demo_model import (  # noqa: E402
    ModelDemoConfig,
    NotEnoughMemory,
    demo_memory,
    load_model_config,
    render_model_demo,
    run_model_demo,
)
from fp4moe.integrations.hf import load_model  # noqa: E402
from fp4moe.integrations.hf_export import write_nvfp4_checkpoint  # noqa: E402
from fp4moe.integrations.hf_load import read_weight  # noqa: E402

B, S, N = 2, 6, 3  # batch, prompt tokens, new tokens


def tiny(arch: str = "qwen3_moe"):
    common = dict(vocab_size=128, num_hidden_layers=2, num_attention_heads=2,
                  max_position_embeddings=64, tie_word_embeddings=False)  # fmt: skip
    if arch == "qwen3_moe":
        return transformers.Qwen3MoeConfig(
            **common, hidden_size=64, intermediate_size=64, moe_intermediate_size=32,
            num_experts=8, num_experts_per_tok=2, norm_topk_prob=True, num_key_value_heads=1,
            head_dim=32,
        )  # fmt: skip
    if arch == "mixtral":
        return transformers.MixtralConfig(
            **common, hidden_size=64, intermediate_size=32, num_local_experts=4,
            num_experts_per_tok=2, num_key_value_heads=1, head_dim=32,
        )  # fmt: skip
    return transformers.DeepseekV3Config(
        **common, hidden_size=128, intermediate_size=64, moe_intermediate_size=32,
        n_routed_experts=8, num_experts_per_tok=3, n_group=4, topk_group=2, n_shared_experts=1,
        first_k_dense_replace=1, routed_scaling_factor=2.5, norm_topk_prob=True,
        num_key_value_heads=2, q_lora_rank=32, kv_lora_rank=32, qk_rope_head_dim=16,
        qk_nope_head_dim=16, v_head_dim=16,
    )  # fmt: skip


@pytest.fixture
def moe_calls(monkeypatch):
    """(mode, tokens) of every fp4moe.moe call made by an MoELayer."""
    calls = []
    real = fp4moe.phases.moe

    def spy(x, ids, w, experts, *, mode, **kw):
        calls.append((mode, x.shape[0]))
        return real(x, ids, w, experts, mode=mode, **kw)

    monkeypatch.setattr(fp4moe.phases, "moe", spy)
    return calls


def check_report(res, moe_layers_count: int, b: int = B, s: int = S, n: int = N) -> None:
    assert [r["phase"] for r in res.rows] == ["prefill", "decode"]
    pre, dec = res.row("prefill"), res.row("decode")
    assert (pre["mode"], dec["mode"]) == ("w4a4-token", "w4a16")
    assert (pre["calls"], pre["tokens"], pre["positions"]) == (1, b * s, b * s)
    assert (dec["calls"], dec["tokens"], dec["positions"]) == (n - 1, b * (n - 1), b * (n - 1))
    for r in (pre, dec):
        assert r["seconds"] > 0 and r["tokens_per_s"] == pytest.approx(r["tokens"] / r["seconds"])
        assert 0.0 <= r["top1_agreement"] <= 1.0
        assert r["top1_matches"] == round(r["top1_agreement"] * r["positions"])
        assert math.isfinite(r["logit_rel_error"]) and 0.0 < r["logit_rel_error"] < 0.3
        assert len(r["moe_layer_calls"]) == moe_layers_count
    # MoELayer.stats of every layer: one prefill call over the prompt, then one call a step.
    assert set(pre["moe_layer_calls"].values()) == {1}
    assert set(pre["moe_layer_tokens"].values()) == {b * s}
    assert set(dec["moe_layer_calls"].values()) == {n - 1}
    assert set(dec["moe_layer_tokens"].values()) == {b * (n - 1)}

    mem = res.memory
    one = mem["one_shared_nvfp4_copy"]
    assert mem["two_nvfp4_copies"] == 2 * one
    assert mem["nvfp4_plus_bf16_copies"] == one + mem["bf16"]
    m = res.model
    assert (
        mem["bf16"]
        == moe_layers_count
        * m["experts"]
        * 3
        * m["hidden_size"]
        * m["expert_intermediate_size"]
        * 2
    )
    assert 0.25 * mem["bf16"] < one < 0.3 * mem["bf16"]  # 4.5 bits a weight, plus globals
    assert mem["copies_of_expert_weights"] == 1
    assert res.shared_storage == {
        "layers": moe_layers_count,
        "same_object_and_pointers": True,
        "contents_unchanged": True,
        "both_phases_ran_on_every_layer": True,
    }
    assert len(res.tokens) == b and all(len(t) == s + n for t in res.tokens)
    json.dumps(res.to_json())  # serializable
    text = render_model_demo(res)
    assert "prefill  w4a4-token" in text and "decode   w4a16" in text
    assert "one NVFP4 copy, shared by prefill and decode" in text


def test_prefill_runs_w4a4_and_decode_w4a16(moe_calls):
    res = run_model_demo(ModelDemoConfig(model_config=tiny(), batch=B, prompt_len=S, new_tokens=N))
    check_report(res, moe_layers_count=2)
    assert res.model["model_type"] == "qwen3_moe" and res.backend == "reference"
    # The measured generate (after a 2-token warm-up): per layer one W4A4 per-token call over
    # the prompt, then N - 1 W4A16 calls of B tokens.
    measured = moe_calls[-2 * N :]
    assert measured[:2] == [("w4a4-token", B * S)] * 2
    assert set(measured[2:]) == {("w4a16", B)}


@pytest.mark.parametrize("arch", ["mixtral", "deepseek_v3"])
def test_other_architectures_from_a_config_file(arch, tmp_path):
    path = tmp_path / "config.json"
    cfg = tiny(arch).to_dict()
    cfg["quantization_config"] = {"quant_method": "modelopt"}  # dropped: we convert ourselves
    path.write_text(json.dumps(cfg))
    assert type(load_model_config(tmp_path)).__name__ == type(tiny(arch)).__name__
    res = run_model_demo(
        ModelDemoConfig(model_config=str(path), batch=B, prompt_len=S, new_tokens=N)
    )
    check_report(res, moe_layers_count=1 if arch == "deepseek_v3" else 2)
    assert res.model["model_type"] == arch and res.model["layers"] == 2


def test_policy_and_sizes_are_options():
    cfg = ModelDemoConfig(
        model_config=tiny(), batch=1, prompt_len=4, new_tokens=2, prefill="w4a8",
        decode="w4a4-tensor", seed=3,
    )  # fmt: skip
    res = run_model_demo(cfg)
    assert [r["mode"] for r in res.rows] == ["w4a8", "w4a4-tensor"]
    assert res.row("decode")["tokens"] == 1 and res.row("prefill")["tokens"] == 4
    assert "two NVFP4 copies: w4a8 for prefill, w4a4-tensor for decode" in render_model_demo(res)


def test_w4a8_on_the_triton_backend(interpret):
    """A W4A8 prefill runs on the Triton backend (the interpreter on the CPU)."""
    cfg = ModelDemoConfig(
        model_config=tiny(), batch=1, prompt_len=4, new_tokens=2, prefill="w4a8",
        decode="w4a16", backend="triton", seed=3,
    )  # fmt: skip
    res = run_model_demo(cfg)
    assert res.backend == "triton"
    assert [r["mode"] for r in res.rows] == ["w4a8", "w4a16"]


def test_bad_settings_are_refused():
    with pytest.raises(ValueError, match="new_tokens"):
        ModelDemoConfig(new_tokens=1)
    with pytest.raises(ValueError, match="give one"):
        ModelDemoConfig(model_config="a.json", checkpoint="ckpt")
    with pytest.raises(ValueError, match="w8a8"):
        ModelDemoConfig(prefill="w8a8")


def write_checkpoint(folder, arch: str, fmt: str) -> None:
    """A checkpoint directory as an NVFP4 exporter writes it: config.json, the experts and
    the attention projections in NVFP4, everything else in bf16."""
    torch.manual_seed(5)
    model = transformers.AutoModelForCausalLM.from_config(tiny(arch)).bfloat16()
    write_nvfp4_checkpoint(model, folder, format=fmt)


@pytest.mark.parametrize(
    ("arch", "fmt"), [("qwen3_moe", "modelopt"), ("mixtral", "compressed-tensors")]
)
def test_nvfp4_checkpoint(arch, fmt, tmp_path):
    write_checkpoint(tmp_path, arch, fmt)
    model = load_model(tmp_path)
    key = "model.layers.1.self_attn.o_proj.weight"
    with CheckpointSource(tmp_path) as src:
        o_proj = read_weight(src, key)  # the NVFP4 linear, decoded
    assert torch.equal(model.get_submodule(key.removesuffix(".weight")).weight, o_proj.bfloat16())

    res = run_model_demo(
        ModelDemoConfig(checkpoint=str(tmp_path), batch=B, prompt_len=S, new_tokens=N)
    )
    check_report(res, moe_layers_count=2)
    assert res.model["source"] == f"checkpoint {tmp_path}"
    assert "decoded to bf16" in res.reference
    # The reference holds the checkpoint's experts decoded: W4A16 differs by rounding only.
    assert res.row("decode")["logit_rel_error"] < 0.02


def test_checkpoint_without_a_dense_weight_is_refused(tmp_path):
    write_checkpoint(tmp_path, "qwen3_moe", "modelopt")
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(tmp_path / "model.safetensors"))
    del tensors["model.norm.weight"]
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match=r"model\.norm\.weight"):
        run_model_demo(
            ModelDemoConfig(checkpoint=str(tmp_path), batch=1, prompt_len=2, new_tokens=2)
        )


def test_memory_is_checked_before_anything_is_built(monkeypatch):
    """A full-size config is refused from its shapes alone, saying what it would need."""
    big = transformers.Qwen3MoeConfig(
        vocab_size=151936, hidden_size=2048, moe_intermediate_size=768, num_hidden_layers=48,
        num_experts=128, num_experts_per_tok=8, num_attention_heads=32, num_key_value_heads=4,
        head_dim=128,
    )  # fmt: skip
    need = demo_memory(big)
    # Qwen3-30B-A3B: about 30.5 G parameters, twice in bf16, plus its NVFP4 experts
    assert 2 * 2 * 30e9 < need["total"] < 2 * 2 * 31e9 + 0.6 * 29e9
    monkeypatch.setattr(fp4moe.demo_model, "available_bytes", lambda device: 8 * 2**30)
    with pytest.raises(NotEnoughMemory, match=r"needs about 1\d\d\.\d\d GiB .* 8\.00 GiB"):
        run_model_demo(ModelDemoConfig(model_config=big, batch=1, prompt_len=2, new_tokens=2))
