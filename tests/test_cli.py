"""The ``fp4moe`` command line (in-process through ``fp4moe.cli.main``) and the demo layer."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from safetensors.torch import save_file

from fp4moe import load_experts, moe, prepare_experts, route
from fp4moe.cli import main
from fp4moe.demo import (
    DEMO_MODES,
    calibrate_static_scales,
    moe_bf16,
    synthetic_layer,
    synthetic_tokens,
)

TINY = ["--hidden", "128", "--inter", "64", "--experts", "4", "--top-k", "2", "--tokens", "16"]


@pytest.mark.parametrize("command", [[], ["demo"], ["prepare"], ["inspect"], ["bench"]], ids=str)
def test_help_of_every_command(command, capsys):
    assert main([*command, "--help"]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"usage: fp4moe {' '.join(command)}".rstrip())
    if command == ["demo"]:
        for option in ("--layer", "--disaggregated", "--model-config", "--checkpoint", "--json"):
            assert option in out


def test_python_m_fp4moe():
    proc = subprocess.run(
        [sys.executable, "-m", "fp4moe", "--help"], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    assert "demo" in proc.stdout and "bench" in proc.stdout


def test_no_command_prints_help_and_fails(capsys):
    assert main([]) == 2
    assert "usage: fp4moe" in capsys.readouterr().out


def test_unknown_argument_is_an_error(capsys):
    assert main(["demo", "--no-such-option"]) == 2
    assert "unrecognized arguments: --no-such-option" in capsys.readouterr().err


def test_demo_layer_runs_every_mode(tmp_path, capsys, device):
    path = tmp_path / "demo.json"
    argv = ["demo", "--layer", *TINY, "--calib-tokens", "256", "--repeats", "1", "--device", device]
    assert main([*argv, "--json", str(path)]) == 0
    out = capsys.readouterr().out
    assert DEMO_MODES == ("w4a16", "w4a8", "w4a4-token", "w4a4-tensor", "w4a4-static")
    for mode in DEMO_MODES:
        assert any(line.split()[:1] == [mode] for line in out.splitlines()), mode
    assert "All 5 modes read the same prepared tensors" in out
    result = json.loads(path.read_text())
    rows = {r["mode"]: r for r in result["rows"]}
    assert set(rows) == {"bf16", *DEMO_MODES}
    for key in DEMO_MODES:
        # NVFP4 loses about 9% per weight matrix (RMS); three matrices and, for W4A4, two
        # quantized activations put this tiny layer near 0.15 to 0.3. NaN fails too.
        assert 0.0 < rows[key]["rel_error"] < 0.4, (key, rows[key])
        assert rows[key]["weight_bytes"] == result["prepared_bytes"]
        if device == "cpu":
            assert rows[key]["backend"] == "reference"
    assert result["prepared_bytes"] < 0.3 * result["bf16_bytes"]


def test_demo_layer_rejects_bad_sizes(capsys):
    assert main(["demo", "--layer", "--hidden", "100"]) == 2
    assert "hidden: expected a positive multiple of 32, got 100" in capsys.readouterr().err
    assert main(["demo", "--layer", "--experts", "2", "--top-k", "3"]) == 2


# ------------------------------------------------------------------ the transformer demo

TINY_MODEL = dict(
    model_type="qwen3_moe", vocab_size=128, hidden_size=64, intermediate_size=64,
    moe_intermediate_size=32, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
    head_dim=32, num_experts=8, num_experts_per_tok=2, norm_topk_prob=True,
    max_position_embeddings=64,
)  # fmt: skip


def _phase_rows(out: str) -> dict[str, list[str]]:
    return {
        line.split()[0]: line.split()
        for line in out.splitlines()
        if line.split()[:1] in (["prefill"], ["decode"])
    }


def test_demo_default_is_the_transformer_demo(capsys, device):
    pytest.importorskip("transformers")
    argv = ["demo", "--batch", "1", "--prompt-len", "3", "--new-tokens", "2", "--device", device]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert out.startswith("fp4moe demo: Qwen3MoeForCausalLM, the Qwen3-30B-A3B architecture")
    flat = " ".join(out.split())
    assert "4 layers, H=256, 16 experts of I=128 (softmax top-2), vocab 1024" in flat
    rows = _phase_rows(out)
    assert rows["prefill"][1:4] == ["w4a4-token", "3", "1"]  # mode, tokens, calls
    assert rows["decode"][1:4] == ["w4a16", "1", "1"]
    memory = {line[:20]: line.split()[-3:-1] for line in out.splitlines()}
    assert memory["one NVFP4 copy, shar"] == ["3.38", "MiB"]  # 4 layers of 16 experts
    assert memory["bf16 (the reference "] == ["12.00", "MiB"]


def test_demo_model_config_policy_and_json(tmp_path, capsys, device):
    pytest.importorskip("transformers")
    config = tmp_path / "config.json"
    config.write_text(json.dumps(TINY_MODEL))
    path = tmp_path / "demo.json"
    argv = ["demo", "--model-config", str(config), "--batch", "2", "--prompt-len", "5",
            "--new-tokens", "3", "--prefill", "w4a4-tensor", "--device", device,
            "--json", str(path)]  # fmt: skip
    assert main(argv) == 0
    out = capsys.readouterr().out
    rows = _phase_rows(out)
    assert rows["prefill"][1:4] == ["w4a4-tensor", "10", "1"]
    assert rows["decode"][1:4] == ["w4a16", "4", "2"]
    doc = json.loads(path.read_text())
    assert [p["mode"] for p in doc["phases"]] == ["w4a4-tensor", "w4a16"]
    for p in doc["phases"]:
        assert 0.0 <= p["top1_agreement"] <= 1.0 and 0.0 < p["logit_rel_error"] < 0.3
    assert doc["memory"]["two_nvfp4_copies"] == 2 * doc["memory"]["one_shared_nvfp4_copy"]
    assert doc["shared_storage"]["same_object_and_pointers"] is True
    assert doc["model"]["experts"] == 8 and doc["config"]["model_config"] == str(config)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--hidden", "256"], "--hidden: only with --layer"),
        (["--layer", "--new-tokens", "4"], "--new-tokens: not an option of --layer"),
        (["--disaggregated", "--prefill", "w4a16"], "--prefill: not an option of --disaggregated"),
        (["--new-tokens", "1"], "new_tokens: expected at least 2"),
        (["--model-config", "no/such.json"], "--model-config: no such file or directory"),
        (["--prefill", "w8a8"], "is not one of 'w4a16', 'w4a8'"),
    ],
    ids=str,
)
def test_demo_bad_options(argv, message, capsys):
    pytest.importorskip("transformers")
    assert main(["demo", *argv]) == 2
    assert message in capsys.readouterr().err


def test_demo_refuses_a_model_without_moe_blocks(tmp_path, capsys):
    pytest.importorskip("transformers")
    config = tmp_path / "config.json"
    config.write_text(json.dumps(dict(model_type="llama", vocab_size=64, hidden_size=64,
        intermediate_size=64, num_hidden_layers=1, num_attention_heads=2)))  # fmt: skip
    assert main(["demo", "--model-config", str(config), "--device", "cpu"]) == 2
    assert "found no MoE block to convert" in capsys.readouterr().err


@pytest.mark.slow  # two worker processes start torch and transformers: about 20 s
def test_demo_disaggregated(tmp_path, capsys):
    pytest.importorskip("transformers")
    path = tmp_path / "dis.json"
    argv = ["demo", "--disaggregated", "--batch", "1", "--prompt-len", "4", "--new-tokens", "2",
            "--device", "cpu", "--json", str(path)]  # fmt: skip
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert out.startswith("fp4moe demo --disaggregated: prefill worker (w4a4-token)")
    assert "bitwise the same last logits): True" in out
    rep = json.loads(path.read_text())
    assert rep["matches_single_process"] is True and rep["decode_steps"] == 1
    assert len(rep["tokens"]) == 1 and len(rep["tokens"][0]) == 2


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message shown without a GPU")
def test_bench_without_gpu_fails_with_a_message(capsys):
    assert main(["bench"]) != 0
    assert "fp4moe bench needs a CUDA GPU" in capsys.readouterr().err


def test_plan_w4a8(capsys):
    """``fp4moe plan --modes w4a8`` prints W4A8's own plan: e4m3 row inputs, the portable
    kernel's FP8 loop at decode sizes and the Gluon prefill kernel at prefill sizes."""
    argv = ["plan", "--preset", "deepseek-v3-ep8", "--num-tokens", "1", "8192", "--modes", "w4a8"]
    assert main(argv) == 0
    out, err = capsys.readouterr()
    rows = [line.split()[:6] for line in out.splitlines()[2:]]
    assert rows == [
        ["1", "w4a8", "deterministic", "0.031", "e4m3-row", "triton"],
        ["8192", "w4a8", "deterministic", "256.0", "e4m3-gather", "gluon-prefill"],
    ]
    assert err == ""


def _weights(e=3, h=64, i=32, seed=0):
    g = torch.Generator().manual_seed(seed)
    w13 = (torch.randn(e, 2 * i, h, generator=g) * 0.05).to(torch.bfloat16)
    w2 = (torch.randn(e, h, i, generator=g) * 0.05).to(torch.bfloat16)
    return w13, w2


def test_prepare_then_inspect(tmp_path, capsys):
    w13, w2 = _weights()
    src, dst = tmp_path / "weights.safetensors", tmp_path / "prepared.safetensors"
    a13, a2 = torch.full((3,), 0.01), torch.full((3,), 0.02)
    save_file({"gate_up": w13, "down": w2, "s13": a13, "s2": a2}, str(src))
    argv = ["prepare", str(src), str(dst), "--w13-key", "gate_up", "--w2-key", "down"]
    assert main([*argv, "--a13-key", "s13", "--a2-key", "s2"]) == 0
    assert "wrote" in capsys.readouterr().out

    got = load_experts(dst)
    want = prepare_experts(w13, w2, a13_scale=a13, a2_scale=a2)
    for name, t in want.to_linear().items():
        assert torch.equal(got.to_linear()[name].view(torch.uint8), t.view(torch.uint8)), name

    assert main(["inspect", str(dst)]) == 0
    out = capsys.readouterr().out
    assert "layout_version: 2" in out and "format: fp4moe.prepared_experts" in out
    assert "w13_codes" in out and "[3, 64, 32]" in out and "a2_scale" in out
    assert f"total {want.nbytes()} bytes" in out


def test_prepare_reports_a_missing_key(tmp_path, capsys):
    w13, w2 = _weights()
    src = tmp_path / "weights.safetensors"
    save_file({"w13": w13, "w2": w2}, str(src))
    assert main(["prepare", str(src), str(tmp_path / "p.safetensors"), "--w2-key", "down"]) == 2
    err = capsys.readouterr().err
    assert "no tensor ['down']" in err and "['w13', 'w2']" in err


def test_prepare_never_writes_over_its_input(tmp_path, capsys):
    w13, w2 = _weights()
    src = tmp_path / "weights.safetensors"
    save_file({"w13": w13, "w2": w2}, str(src))
    before = src.read_bytes()
    for out in (src, tmp_path / "." / "weights.safetensors"):
        assert main(["prepare", str(src), str(out)]) == 2
        assert "is the input file; refusing to write over it" in capsys.readouterr().err
    link = tmp_path / "link.safetensors"
    link.symlink_to(src)
    assert main(["prepare", str(src), str(link)]) == 2
    assert src.read_bytes() == before
    assert not [p for p in tmp_path.iterdir() if ".tmp-" in p.name]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the messages shown without a GPU")
@pytest.mark.parametrize(
    "argv",
    [["demo", "--layer", "--backend", "triton"], ["demo", "--backend", "triton"],
     ["demo", "--layer", "--device", "cuda"], ["plan", "--target", "current"]],
    ids=str,
)  # fmt: skip
def test_gpu_only_options_on_a_cpu_machine_are_one_line_errors(argv, capsys, monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert main([*argv, *(["--device", "cpu"] if "--backend" in argv else [])]) in (1, 2)
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and err.startswith(f"fp4moe {argv[0]}: error: "), err
    assert "CUDA" in err or "cuda" in err


def test_demo_refuses_a_model_too_large_for_the_machine(tmp_path, capsys):
    """Checked from the model's shapes before anything is built: a clear refusal with the
    bytes needed, not an out-of-memory kill."""
    pytest.importorskip("transformers")
    config = tmp_path / "config.json"
    big = dict(TINY_MODEL, vocab_size=151936, hidden_size=4096, moe_intermediate_size=1536,
               num_hidden_layers=94, num_experts=128, num_attention_heads=64,
               num_key_value_heads=4, head_dim=128)  # fmt: skip
    config.write_text(json.dumps(big))
    assert main(["demo", "--model-config", str(config), "--device", "cpu"]) == 1
    err = capsys.readouterr().err
    assert "this model needs about" in err and "bytes:" in err and "available" in err


def test_inspect_refuses_a_foreign_file(tmp_path, capsys):
    path = tmp_path / "foreign.safetensors"
    save_file({"w13": torch.zeros(2, 2)}, str(path))
    assert main(["inspect", str(path)]) == 2
    assert "not an fp4moe prepared-experts file" in capsys.readouterr().err


# ------------------------------------------------------------------ the demo's building blocks


def test_bf16_baseline_matches_the_reference_on_the_same_weights():
    """moe_bf16 computes the same layer as fp4moe.moe: fed the decoded NVFP4 weights, it
    agrees with W4A16 up to bf16 rounding (gate/up order, route weights, SwiGLU)."""
    layer = synthetic_layer(128, 64, 4, seed=1)
    experts = prepare_experts(layer.w13, layer.w2)
    x, logits = synthetic_tokens(layer, 24, seed=2)
    ids, weights = route(logits, 2, method="softmax")
    w13, w2 = experts.dequantize(torch.bfloat16)
    base = moe_bf16(x, ids, weights, w13, w2).float()
    ref = moe(x, ids, weights, experts, mode="w4a16", backend="reference").float()
    assert float((base - ref).norm() / ref.norm()) < 2e-2


def test_calibrated_scales_are_amax_over_the_routed_rows():
    layer = synthetic_layer(64, 32, 3, seed=3)
    x, logits = synthetic_tokens(layer, 40, seed=4)
    ids, _ = route(logits, 1, method="softmax")
    ids[0, 0] = 0  # expert 0 certainly sees a token
    ids[ids == 2] = 1  # expert 2 sees none: it takes the largest amax of the others
    a13, a2 = calibrate_static_scales(x, ids, layer.w13, layer.w2)
    rows0 = x[ids[:, 0] == 0].float()
    assert a13[0] == rows0.abs().amax() / 2688
    assert a13[2] == torch.maximum(a13[0], a13[1])
    assert a2[2] == torch.maximum(a2[0], a2[1])
    assert bool((a2 > 0).all())
