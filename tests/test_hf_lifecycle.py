"""A model's whole life on CPU: load an NVFP4 checkpoint folder (ModelOpt sharded,
compressed-tensors single file; written by the library's own writer, and by the tools
themselves where installed), run it, move it, compile it, save it and load it back, with
nothing lost. GPU: the same model on the Triton backend."""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
import textwrap
import warnings

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

transformers = pytest.importorskip("transformers")

import fp4moe  # noqa: E402
from fp4moe import PhasePolicy, load_checkpoint_experts  # noqa: E402
from fp4moe.checkpoint_source import CheckpointSource  # noqa: E402
from fp4moe.checkpoints import save_modelopt_experts  # noqa: E402
from fp4moe.integrations import hf  # noqa: E402
from fp4moe.integrations.hf_export import write_nvfp4_checkpoint  # noqa: E402
from fp4moe.integrations.hf_load import dequantized_model, estimate_bytes, read_weight  # noqa: E402
from test_hf import ARCHS, build, moe_blocks, rel  # noqa: E402

REF = PhasePolicy(prefill="w4a4-token", decode="w4a16", backend="reference")
FORMATS = {"modelopt": 60_000, "compressed-tensors": None}  # format -> shard size (sharded)
EXPERT_NAMES = {"mixtral": ("w1", "w3", "w2")}


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """(arch, format) -> (checkpoint folder, the bf16 model it was written from)."""
    out = {}
    for arch in ARCHS:
        model = build(arch, seed=3)
        for fmt, shard in FORMATS.items():
            folder = tmp_path_factory.mktemp(f"{arch}-{fmt}")
            write_nvfp4_checkpoint(model, folder, format=fmt, max_shard_bytes=shard)
            out[arch, fmt] = (folder, model)
    return out


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


def _ids(seed=0, t=7):
    return torch.randint(0, 128, (2, t), generator=torch.Generator().manual_seed(seed))


def _logits(model, ids):
    with torch.no_grad():
        return model(ids).logits


def _expert_prefix(name: str, arch: str) -> str:
    return (
        name.replace(".mlp", ".block_sparse_moe") + ".experts"
        if arch == "mixtral"
        else (f"{name}.experts")
    )


# ------------------------------------------------------------------------------ load


@pytest.mark.parametrize("fmt", list(FORMATS))
@pytest.mark.parametrize("arch", ARCHS)
def test_load_model_from_a_checkpoint_folder(folders, arch, fmt):
    folder, original = folders[arch, fmt]
    assert fmt != "modelopt" or os.path.isfile(folder / "model.safetensors.index.json")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # every tensor of the checkpoint is used
        model = fp4moe.load_model(folder, policy=REF)
    assert type(model).__name__ == type(original).__name__ and not model.training
    layers = hf.moe_layers(model)
    assert sorted(layers) == [n for n, _ in moe_blocks(original)]
    with CheckpointSource(folder) as src:
        for name, layer in layers.items():  # experts: the file's bits
            want = load_checkpoint_experts(src, prefix=_expert_prefix(name, arch),
                                           num_experts=layer.experts.num_experts)  # fmt: skip
            for k, t in want.tensors().items():
                assert torch.equal(_bits(getattr(layer.experts, k)), _bits(t)), (name, k)
        # NVFP4 attention: decoded to bf16; routers, norms, embeddings: as stored
        q = "model.layers.1.self_attn.o_proj.weight"
        assert torch.equal(model.get_parameter(q), read_weight(src, q).bfloat16())
    for key in ("model.embed_tokens.weight", "model.norm.weight", "lm_head.weight",
                f"{next(iter(layers))}.gate.weight"):  # fmt: skip
        assert torch.equal(model.get_parameter(key), original.get_parameter(key)), key
    assert bool(torch.isfinite(_logits(model, _ids())).all())
    # W4A16 against the same model with every NVFP4 tensor decoded: bf16 rounding only
    for layer in layers.values():
        layer.policy = PhasePolicy.single("w4a16", backend="reference")
    ref = dequantized_model(model)
    assert rel(_logits(model, _ids(1)), _logits(ref, _ids(1))) < 2e-2
    assert hf.moe_layers(model)  # the reference left the model converted


@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral"])
def test_load_model_reads_modelopts_own_export(arch, tmp_path):
    """A tiny model quantized by NVIDIA ModelOpt (NVFP4_DEFAULT_CFG) and exported with its
    export_hf_checkpoint (where ModelOpt is installed): load_model reads the whole folder,
    its experts bit for bit, and runs close to the model ModelOpt quantized."""
    mtq = pytest.importorskip("modelopt.torch.quantization")
    from modelopt.torch.export import export_hf_checkpoint

    model = build(arch, num_hidden_layers=1)
    ids = torch.randint(0, 128, (4, 16), generator=torch.Generator().manual_seed(5))
    mtq.quantize(model, mtq.NVFP4_DEFAULT_CFG, lambda m: m(ids))
    with torch.no_grad():
        quantized = model(ids).logits
    export_hf_checkpoint(model, export_dir=tmp_path)
    loaded = fp4moe.load_model(tmp_path, policy=PhasePolicy.single("w4a4-static"))
    name, layer = next(iter(hf.moe_layers(loaded).items()))
    want = load_checkpoint_experts(tmp_path, prefix=_expert_prefix(name, arch),
                                   num_experts=layer.experts.num_experts)  # fmt: skip
    for k, t in want.tensors().items():
        assert torch.equal(_bits(getattr(layer.experts, k)), _bits(t)), k
    assert rel(_logits(loaded, ids), quantized) < 0.1


def test_load_model_generates_with_phases(folders):
    model = fp4moe.load_model(folders["qwen3_moe", "modelopt"][0], policy=REF)
    out = model.generate(_ids(), attention_mask=torch.ones(2, 7, dtype=torch.long),
                         max_new_tokens=3, do_sample=False, pad_token_id=0)  # fmt: skip
    assert out.shape == (2, 10)
    for layer in hf.moe_layers(model).values():
        assert layer.stats.calls == {"prefill": 1, "decode": 2}


def test_missing_tensors_are_errors_naming_them(folders, tmp_path):
    folder, _ = folders["qwen3_moe", "compressed-tensors"]
    tensors = load_file(str(folder / "model.safetensors"))
    for key in ("model.layers.1.input_layernorm.weight",
                "model.layers.0.self_attn.q_proj.weight_packed",
                "model.layers.1.mlp.experts.7.down_proj.weight_scale"):  # fmt: skip
        broken = tmp_path / key
        broken.mkdir()
        (broken / "config.json").write_text((folder / "config.json").read_text())
        save_file({k: v for k, v in tensors.items() if k != key}, str(broken / "model.safetensors"))
        stem = key.removesuffix("_packed").rpartition(".")[0] if "packed" in key else key
        with pytest.raises(ValueError, match=stem.replace(".", r"\.")):
            fp4moe.load_model(broken)


def test_unused_tensors_are_reported_and_bad_input_refused(folders, tmp_path):
    folder, _ = folders["mixtral", "compressed-tensors"]
    tensors = load_file(str(folder / "model.safetensors"))
    tensors["model.layers.9.mtp.weight"] = torch.zeros(4)
    (tmp_path / "config.json").write_text((folder / "config.json").read_text())
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.warns(UserWarning, match=r"1 tensors not used.*layers\.9\.mtp"):
        fp4moe.load_model(tmp_path)
    with pytest.raises(ValueError, match="path: expected a checkpoint directory"):
        fp4moe.load_model(tmp_path / "model.safetensors")
    gpt = tmp_path / "gpt-oss"
    gpt.mkdir()
    cfg = transformers.GptOssConfig(
        hidden_size=64, intermediate_size=32, num_local_experts=4, num_experts_per_tok=2,
        head_dim=32, num_key_value_heads=1, vocab_size=128, num_hidden_layers=2,
        num_attention_heads=2,
    )  # fmt: skip
    (gpt / "config.json").write_text(cfg.to_json_string())
    with pytest.raises(NotImplementedError, match="GptOssMLP"):  # before any file is read
        fp4moe.load_model(gpt)


def test_convert_refuses_a_model_whose_dense_weights_are_not_the_checkpoints(folders):
    """convert(checkpoint=) reads only the experts: on a from_config model (random routers
    and attention) it refuses instead of running silently wrong."""
    folder, original = folders["qwen3_moe", "modelopt"]
    with pytest.raises(ValueError, match=r"router weight .* fp4moe\.load_model"):
        hf.convert(build("qwen3_moe", seed=99), checkpoint=folder)
    hf.convert(copy.deepcopy(original), checkpoint=folder)  # its own dense weights: fine


MEMORY_CASES = {  # name -> (config overrides, quantize the attention too)
    "test": (dict(hidden_size=512, intermediate_size=512, moe_intermediate_size=256,
                  num_hidden_layers=4, num_attention_heads=4, num_experts=32), False),
    "larger": (dict(vocab_size=32000, hidden_size=1024, intermediate_size=2048,
                    moe_intermediate_size=512, num_hidden_layers=8, num_attention_heads=8,
                    num_experts=64), True),
}  # fmt: skip


LARGER = pytest.mark.skipif(
    os.environ.get("FP4MOE_MEASURE_LARGER") != "1",
    reason="about a minute (1.7 GB of bf16 weights written as NVFP4): FP4MOE_MEASURE_LARGER=1",
)


@pytest.mark.parametrize("case", ["test", pytest.param("larger", marks=[pytest.mark.slow, LARGER])])
def test_peak_host_memory_stays_near_the_checkpoint(tmp_path, case, capsys):
    """Built on meta and filled layer by layer: the load's peak host memory is about the
    loaded model (NVFP4 experts, bf16 dense), far below the bf16 model. The numbers of
    docs/integration.md (run with -s to see them)."""
    over, quantize_linears = MEMORY_CASES[case]
    config = transformers.Qwen3MoeConfig(**{
        "vocab_size": 256, "num_key_value_heads": 2, "head_dim": 128, "num_experts_per_tok": 4,
        "tie_word_embeddings": False, **over,
    })  # fmt: skip
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    bf16 = sum(p.numel() * 2 for p in model.parameters())
    write_nvfp4_checkpoint(model, tmp_path, format="modelopt", quantize_linears=quantize_linears,
                           max_shard_bytes=200_000_000)  # fmt: skip
    del model
    sizes = estimate_bytes(tmp_path)
    peak = measure_load_peak(tmp_path)
    mib = 2**20
    with capsys.disabled():
        print(f"\npeak host memory ({case}): bf16 model {bf16 / mib:.1f} MiB, checkpoint "
              f"{sizes['checkpoint'] / mib:.1f} MiB, loaded {sizes['loaded'] / mib:.1f} MiB, "
              f"peak {peak / mib:.1f} MiB ({peak / sizes['loaded']:.2f}x loaded)")  # fmt: skip
    assert sizes["loaded"] < 0.4 * bf16
    assert peak < 1.25 * sizes["loaded"] + 16 * mib, (peak, sizes, bf16)


@pytest.mark.gpu
def test_gpu_peak_host_memory_is_about_a_layer(tmp_path):
    """With a GPU device the host holds about one layer at a time."""
    config = transformers.Qwen3MoeConfig(
        vocab_size=256, hidden_size=512, intermediate_size=512, moe_intermediate_size=256,
        num_hidden_layers=8, num_attention_heads=4, num_key_value_heads=2, head_dim=128,
        num_experts=32, num_experts_per_tok=4, tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    write_nvfp4_checkpoint(model, tmp_path, format="modelopt")
    del model
    loaded = estimate_bytes(tmp_path)["loaded"]
    peak = measure_load_peak(tmp_path, device="cuda")
    print(
        f"\npeak host memory (cuda): loaded {loaded / 2**20:.1f} MiB, peak {peak / 2**20:.1f} MiB"
    )
    assert peak < 0.5 * loaded + 16 * 2**20


def measure_load_peak(folder, device: str = "cpu") -> int:
    """Peak resident host memory added by fp4moe.load_model(folder), in a fresh process
    (VmHWM after a reset, less VmRSS before; the imports, of the model's code too, before)."""
    script = textwrap.dedent(f"""
        import json, torch, transformers, fp4moe
        from fp4moe.integrations.hf_load import load_model, load_model_config
        def status(key):
            return int(next(l for l in open("/proc/self/status") if l.startswith(key)).split()[1])
        with torch.device("meta"):
            transformers.AutoModelForCausalLM.from_config(load_model_config({str(folder)!r}))
        if {device!r} == "cuda":
            torch.zeros(1, device="cuda")  # the CUDA context: not the loader's memory
        open("/proc/self/clear_refs", "w").write("5")  # reset the high-water mark
        before = status("VmRSS:")
        model = load_model({str(folder)!r}, device={device!r})
        print(json.dumps({{"peak": (status("VmHWM:") - before) * 1024}}))
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])["peak"]


# ------------------------------------------------------------------------------ save


@pytest.mark.parametrize("arch", ARCHS)
def test_save_pretrained_and_reload_bitwise(folders, arch, tmp_path):
    model = fp4moe.load_model(folders[arch, "compressed-tensors"][0], policy=REF)
    ids = _ids(2)
    before = _logits(model, ids)
    model.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    qc = config["quantization_config"]
    assert (qc["quant_method"], qc["quant_algo"], qc["group_size"]) == ("modelopt", "NVFP4", 16)
    assert "model.layers.0.self_attn.o_proj" in qc["exclude_modules"]
    # every expert, in the ModelOpt layout and bits, beside the dense weights in bf16
    with safe_open(str(tmp_path / "model.safetensors"), "pt") as f:
        saved = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118
    for name, layer in hf.moe_layers(model).items():
        names = EXPERT_NAMES.get(arch, ("gate_proj", "up_proj", "down_proj"))
        want = save_modelopt_experts(layer.experts, prefix=_expert_prefix(name, arch), names=names)
        for k, t in want.items():
            assert saved[k].dtype == t.dtype and torch.equal(_bits(saved[k]), _bits(t)), k
    assert saved["model.layers.0.self_attn.o_proj.weight"].dtype == torch.bfloat16
    # the plain loader reads it back; the outputs are the same bits
    back = fp4moe.load_model(tmp_path, policy=REF)
    assert torch.equal(_logits(back, ids), before)
    # and so does load_state_dict: state_dict() is what save_pretrained writes
    sd = model.state_dict()
    assert sorted(sd) == sorted(back.state_dict())
    other = fp4moe.load_model(folders[arch, "modelopt"][0], policy=REF)
    for layer in hf.moe_layers(other).values():
        layer.experts.w13_codes.zero_()  # the buffers themselves: load_state_dict copies in
    assert not torch.equal(_logits(other, ids), before)
    other.load_state_dict(sd)
    assert torch.equal(_logits(other, ids), before)
    # a state dict an earlier fp4moe saved (its MoE blocks' and layers' metadata version 1;
    # the same ModelOpt keys) loads as the same experts, its codes converted once
    old = type(sd)(sd)
    old._metadata = copy.deepcopy(sd._metadata)
    for name in hf.moe_layers(other):
        for key in (name, f"{name}.moe"):
            assert old._metadata[key]["version"] == 2
            old._metadata[key]["version"] = 1
    for layer in hf.moe_layers(other).values():
        layer.experts.w13_codes.zero_()
    other.load_state_dict(old)
    assert torch.equal(_logits(other, ids), before)


def test_state_dict_holds_the_experts_and_refuses_bad_ones(folders):
    model = fp4moe.load_model(folders["qwen3_moe", "modelopt"][0], policy=REF)
    name, layer = next(iter(hf.moe_layers(model).items()))
    sd = model.state_dict()
    key = f"{name}.experts.3.up_proj.weight_scale_2"  # the globals are views, no copy
    assert (
        sd[key].untyped_storage().data_ptr()
        == layer.experts.w13_global.untyped_storage().data_ptr()
    )
    i = layer.experts.intermediate_size  # the codes linear (ModelOpt) copies
    want = layer.experts.to_linear()["w13_codes"][3, i:]
    assert torch.equal(sd[f"{name}.experts.3.up_proj.weight"], want)
    assert not any(".moe." in k for k in sd)  # the layer's buffers appear once, under these names
    bad = dict(sd)
    bad[f"{name}.experts.3.up_proj.weight_scale"] = torch.full_like(
        sd[f"{name}.experts.3.up_proj.weight_scale"].view(torch.uint8), 0x7F
    ).view(torch.float8_e4m3fn)
    with pytest.raises(
        ValueError, match=r"experts\.3\.up_proj\.weight_scale: block scales hold NaN"
    ):
        model.load_state_dict(bad)
    del bad[f"{name}.experts.3.up_proj.weight_scale"]
    with pytest.raises(ValueError, match=r"missing tensor .*experts\.3\.up_proj\.weight_scale"):
        model.load_state_dict(bad)
    # missing experts are reported under the state dict's names, not the layer's buffers'
    dense = {k: v for k, v in sd.items() if ".experts." not in k}
    missing = model.load_state_dict(dense, strict=False).missing_keys
    assert sorted(missing) == sorted(f"{n}.experts.*" for n in hf.moe_layers(model))


# ------------------------------------------------------------------------------ move


def test_to_moves_the_experts_and_keeps_their_dtypes(folders):
    model = fp4moe.load_model(folders["deepseek_v3", "modelopt"][0], policy=REF)
    ids = _ids(3)
    before = _logits(model, ids)
    model.to(torch.float32).to(torch.bfloat16)  # dtype changes never touch the experts
    model.to("meta")
    for layer in hf.moe_layers(model).values():
        assert all(t.is_meta for t in layer.experts.tensors().values())
        assert layer.experts.w13_scales.dtype == torch.float8_e4m3fn
        assert layer.experts.w13_global.dtype == torch.float32
    again = fp4moe.load_model(folders["deepseek_v3", "modelopt"][0], policy=REF).cpu()
    assert torch.equal(_logits(again, ids), before)


# ------------------------------------------------------------------------------ compile


@pytest.mark.parametrize("arch", ARCHS)
def test_compiled_model_fullgraph_bitwise(folders, arch):
    """torch.compile(model, fullgraph=True): no graph break anywhere (the MoE layers, the
    phase hooks), the eager bits in prefill (W4A4) and in a decode step (W4A16)."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    model = fp4moe.load_model(folders[arch, "modelopt"][0], policy=REF)
    ids = _ids(4)
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    with torch.no_grad():
        eager = model(ids, use_cache=True)
        got = compiled(ids, use_cache=True)
        assert torch.equal(got.logits, eager.logits)
        step = ids[:, -1:]
        assert torch.equal(compiled(step, cache=got.past_key_values).logits,
                           model(step, cache=eager.past_key_values).logits)  # fmt: skip
    assert sum(counters["graph_break"].values()) == 0
    assert counters["stats"]["unique_graphs"] == 2  # one prefill, one decode graph
    for layer in hf.moe_layers(model).values():
        assert layer.stats.calls == {"prefill": 2, "decode": 2}
    torch._dynamo.reset()


# ------------------------------------------------------------------------------ train around


def test_gradients_reach_attention_and_routers_not_experts(folders):
    """Fine-tuning around frozen NVFP4 experts: the loss reaches the inputs of the experts
    (straight-through), the routers and attention; the experts are buffers, not
    parameters."""
    model = fp4moe.load_model(folders["qwen3_moe", "modelopt"][0], policy=REF)
    model.train()
    for p in model.parameters():
        p.requires_grad_(True)
    model(_ids(5), labels=_ids(5)).loss.backward()
    gate = model.get_parameter(f"{next(iter(hf.moe_layers(model)))}.gate.weight")
    q = model.get_parameter("model.layers.0.self_attn.q_proj.weight")
    for g in (gate.grad, q.grad):
        assert g is not None and bool(torch.isfinite(g).all()) and g.abs().sum() > 0
    assert not any("experts" in n for n, _ in model.named_parameters())


# ------------------------------------------------------------------------------ GPU


@pytest.mark.gpu
@pytest.mark.parametrize("arch", ARCHS)
def test_gpu_loaded_model_on_triton(folders, arch):
    folder, _ = folders[arch, "modelopt"]
    cpu = fp4moe.load_model(folder, policy=REF)
    gpu = fp4moe.load_model(folder, policy=PhasePolicy(prefill="w4a4-token", decode="w4a16"),
                            device="cuda")  # fmt: skip
    ids = _ids(6)
    for layer in hf.moe_layers(gpu).values():
        assert layer.experts.device.type == "cuda"
    # Triton against the reference (W4A4 prefill), and GPU attention against the CPU's
    assert rel(_logits(gpu, ids.cuda()).cpu(), _logits(cpu, ids)) < 3e-2
    moved = cpu.cuda()  # .cuda() moves the experts; Triton from then on
    for layer in hf.moe_layers(moved).values():
        layer.policy = PhasePolicy(prefill="w4a4-token", decode="w4a16")
    assert torch.equal(_logits(moved, ids.cuda()), _logits(gpu, ids.cuda()))
    out = gpu.generate(ids.cuda(), attention_mask=torch.ones_like(ids).cuda(), max_new_tokens=4,
                       do_sample=False, pad_token_id=0)  # fmt: skip
    assert out.shape == (2, 11)


@pytest.mark.gpu
def test_gpu_state_dict_keeps_no_second_copy_on_the_gpu(folders):
    """A GPU model's state dict: the linear code copies on the CPU (no second copy of the
    codes on the GPU), the scales views on the GPU; it loads back bit for bit."""
    folder, _ = folders["qwen3_moe", "modelopt"]
    model = fp4moe.load_model(folder, device="cuda")
    layers = hf.moe_layers(model)
    codes = sum(m.experts.w13_codes.nbytes + m.experts.w2_codes.nbytes for m in layers.values())
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    sd = model.state_dict()
    torch.cuda.synchronize()
    assert torch.cuda.memory_allocated() - before < codes  # a copy of the codes would be more
    name = next(iter(layers))
    assert sd[f"{name}.experts.0.gate_proj.weight"].device.type == "cpu"
    assert sd[f"{name}.experts.0.gate_proj.weight_scale_2"].device.type == "cuda"
    back = fp4moe.load_model(folder, device="cuda")
    for m in hf.moe_layers(back).values():
        m.experts.w13_codes.zero_()
    back.load_state_dict(sd)
    for n, m in hf.moe_layers(back).items():
        assert torch.equal(m.experts.w13_codes, layers[n].experts.w13_codes)


@pytest.mark.gpu
def test_gpu_compiled_model_cuda_graphs(folders):
    """The whole model under torch.compile(backend="cudagraphs"): replays give the eager
    bits, prefill and decode."""
    torch._dynamo.reset()
    model = fp4moe.load_model(folders["qwen3_moe", "modelopt"][0], device="cuda")
    compiled = torch.compile(model, backend="cudagraphs", fullgraph=True)
    ids = _ids(7).cuda()
    with torch.no_grad():
        for _ in range(3):
            for step in (ids, ids[:, :1]):  # 14 tokens, then 2: two graphs
                got = compiled(step, use_cache=False).logits.clone()
                assert torch.equal(got, model(step, use_cache=False).logits)
    torch._dynamo.reset()
