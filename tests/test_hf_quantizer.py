"""transformers' quantizer convention: from_pretrained of a ModelOpt NVFP4 folder (and of
one that save_pretrained of a converted model wrote) through fp4moe's registered quantizer
gives the model fp4moe.load_model gives, bit for bit."""

from __future__ import annotations

import json

import pytest
import torch

transformers = pytest.importorskip("transformers")

import fp4moe  # noqa: E402
from fp4moe.integrations import hf  # noqa: E402
from fp4moe.integrations.hf_export import write_nvfp4_checkpoint  # noqa: E402
from fp4moe.integrations.hf_quantizer import REGISTERED, FP4MoEConfig  # noqa: E402
from test_hf import ARCHS, build  # noqa: E402

AutoModel = transformers.AutoModelForCausalLM


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    out = {}
    for arch in ARCHS:
        folder = tmp_path_factory.mktemp(arch)
        write_nvfp4_checkpoint(build(arch, seed=7), folder, max_shard_bytes=80_000)
        out[arch] = folder
    return out


def _logits(model, seed=0):
    ids = torch.randint(0, 128, (2, 6), generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        return model(ids).logits


def test_registered_as_modelopt():
    assert REGISTERED
    from transformers.quantizers.auto import AUTO_QUANTIZER_MAPPING

    assert AUTO_QUANTIZER_MAPPING["modelopt"].__name__ == "FP4MoEQuantizer"


@pytest.mark.parametrize("arch", ARCHS)
def test_from_pretrained_is_load_model(folders, arch, tmp_path):
    model = AutoModel.from_pretrained(folders[arch])
    want = fp4moe.load_model(folders[arch])
    assert len(hf.moe_layers(model)) == len(hf.moe_layers(want)) > 0
    assert torch.equal(_logits(model), _logits(want))
    # save_pretrained, then from_pretrained again (no argument needed): the same bits
    model.save_pretrained(tmp_path)
    assert (
        json.loads((tmp_path / "config.json").read_text())["quantization_config"]["quant_method"]
        == "modelopt"
    )
    again = AutoModel.from_pretrained(tmp_path, quantization_config=FP4MoEConfig())
    assert torch.equal(_logits(again, 1), _logits(model, 1))
    assert torch.equal(_logits(fp4moe.load_model(tmp_path), 1), _logits(model, 1))
    # the policy is set afterwards
    hf.set_policy(again, "w4a16")
    assert all(str(m.policy.prefill) == "w4a16" for m in hf.moe_layers(again).values())


def test_refusals(folders, tmp_path):
    config = json.loads((folders["qwen3_moe"] / "config.json").read_text())
    config["quantization_config"]["quant_algo"] = "FP8"
    for f in folders["qwen3_moe"].iterdir():
        (tmp_path / f.name).write_bytes(f.read_bytes())
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"fp4moe reads ModelOpt NVFP4 .* 'FP8'"):
        AutoModel.from_pretrained(tmp_path)
    with pytest.raises(ValueError, match="static"):
        hf.set_policy(AutoModel.from_pretrained(folders["qwen3_moe"]), "w4a4-static")


def test_compressed_tensors_folders_stay_with_transformers(tmp_path):
    """transformers keeps its own quantizer for compressed-tensors folders (it needs the
    compressed-tensors package, and refuses a second config class); fp4moe.load_model reads
    them without it."""
    write_nvfp4_checkpoint(build("qwen3_moe", seed=8), tmp_path, format="compressed-tensors")
    with pytest.raises(
        (ValueError, ImportError), match=r"CompressedTensorsConfig|compressed-tensors"
    ):
        AutoModel.from_pretrained(tmp_path, quantization_config=FP4MoEConfig())
    assert hf.moe_layers(fp4moe.load_model(tmp_path))


@pytest.mark.gpu
def test_from_pretrained_onto_the_gpu(folders):
    model = AutoModel.from_pretrained(folders["deepseek_v3"], device_map="cuda")
    for layer in hf.moe_layers(model).values():
        assert layer.experts.device.type == "cuda"
    cpu = fp4moe.load_model(folders["deepseek_v3"], policy=fp4moe.PhasePolicy(backend="reference"))
    ref = _logits(cpu)
    ids = torch.randint(0, 128, (2, 6), generator=torch.Generator().manual_seed(0)).cuda()
    with torch.no_grad():
        out = model(ids).logits.cpu()
    assert float((out.float() - ref.float()).norm() / ref.float().norm()) < 3e-2
