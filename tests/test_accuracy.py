"""The accuracy example (examples/accuracy/, docs/accuracy.md) on its shipped tiny model.

Loads the shipped byte-level Qwen3-MoE trained on the Jargon File, converts it with
``fp4moe.integrations.hf.convert`` and evaluates a few hundred bytes of the shipped held-out
sample on the reference backend. Asserts only what held with margin on the full report.
"""

from __future__ import annotations

import importlib.util
import math
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")
pytest.importorskip("safetensors")

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "accuracy"
WEIGHTS = EXAMPLE / "tiny-moe.safetensors"
CONFIG = EXAMPLE / "tiny-moe.config.json"


@pytest.fixture(scope="module")
def evaluate():
    if not WEIGHTS.is_file():
        pytest.skip(f"{WEIGHTS} is not in this checkout (train it with examples/accuracy/train.py)")
    sys.path.insert(0, str(EXAMPLE))  # evaluate.py imports its neighbours
    try:
        spec = importlib.util.spec_from_file_location(
            "fp4moe_accuracy_eval", EXAMPLE / "evaluate.py"
        )
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        yield module
    finally:
        sys.path.remove(str(EXAMPLE))


@pytest.fixture(scope="module")
def result(evaluate):
    return evaluate.run(
        weights=WEIGHTS, config=CONFIG,
        heldout=EXAMPLE / "heldout_sample.txt", calib=EXAMPLE / "calib_sample.txt",
        windows_n=3, seq=128, batch=3, calib_windows=4,
        prompts_n=3, prompt_len=64, gen=12,
        policies=(("w4a4-token", "w4a16"), ("w4a16", "w4a16"), ("w4a4-tensor", "w4a4-tensor"),
                  ("w4a8", "w4a8")),
        log=lambda *a: None,
    )  # fmt: skip


def test_uses_library_converter(result):
    assert result["converter"] == "fp4moe.integrations.hf.convert"


def test_perplexities_finite_and_near_bf16(result):
    modes = result["modes"]
    assert set(modes) == {"bf16", "w4a16", "w4a8", "w4a4-token", "w4a4-tensor", "w4a4-static"}
    for name, m in modes.items():
        assert m["finite"], name
        assert math.isfinite(m["ppl"]) and m["ppl"] > 1, name
    # A trained model, not noise: the bf16 model is far below the 256-way uniform guess.
    assert modes["bf16"]["ppl"] < 16
    for name in ("w4a16", "w4a8", "w4a4-token", "w4a4-tensor", "w4a4-static"):
        assert modes[name]["ppl_ratio"] < 1.5, (name, modes[name]["ppl_ratio"])


def test_w4a16_closest_to_bf16(result):
    modes = result["modes"]
    kl = {name: modes[name]["kl_vs_bf16"] for name in modes if name != "bf16"}
    assert modes["bf16"]["kl_vs_bf16"] == 0
    # Quantizing the activations too never brings the model closer to bf16, and e4m3
    # activations (W4A8) stay closer than NVFP4 ones (W4A4: about twice W4A8's KL).
    for name in ("w4a4-token", "w4a4-tensor", "w4a4-static"):
        assert kl["w4a16"] < kl[name], kl
        assert kl["w4a8"] < kl[name], kl


def test_policies_follow_bf16_generation(result):
    pol = result["policies"]
    assert set(pol) == {"w4a4-token/w4a16", "w4a16/w4a16", "w4a4-tensor/w4a4-tensor", "w4a8/w4a8"}
    for name, p in pol.items():
        assert 0 <= p["free_match"] <= 1 and 0 <= p["free_prefix"] <= 12, name
        assert p["forced_agree"] >= 0.75, (name, p["forced_agree"])
    # Policies with the same prefill mode report the same perplexity (one forward = prefill).
    assert pol["w4a4-token/w4a16"]["ppl_ratio"] == result["modes"]["w4a4-token"]["ppl_ratio"]
