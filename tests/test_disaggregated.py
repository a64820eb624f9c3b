"""The disaggregated example: prefill worker and decode worker on one set of prepared expert
files continue exactly as one process with the same policy (here the Hopper policy, W4A8
prefill and W4A16 decode; ``fp4moe demo --disaggregated`` in test_cli runs the default
W4A4 prefill)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))

import disaggregated


def test_two_workers_continue_like_one_process(tmp_path):
    rep = disaggregated.run(steps=2, prompt_len=6, batch=2, device="cpu", folder=str(tmp_path),
                            prefill_mode="w4a8")  # fmt: skip
    assert rep["matches_single_process"]
    assert (rep["prefill_policy"], rep["decode_policy"]) == ("w4a8", "w4a16")
    assert rep["kv_bytes_handed_over"] > 0
    assert rep["expert_files"] == ["experts-0.safetensors", "experts-1.safetensors"]
    assert len(rep["tokens"]) == 2 and len(rep["tokens"][0]) == 3
