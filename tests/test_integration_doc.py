"""The Python blocks of docs/integration.md run, in order, in one namespace (CPU; their GPU
parts are guarded by torch.cuda.is_available())."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

pytest.importorskip("transformers")

DOC = Path(__file__).resolve().parents[1] / "docs" / "integration.md"


def python_blocks(text: str) -> list[str]:
    return re.findall(r"^```python\n(.*?)^```$", text, flags=re.DOTALL | re.MULTILINE)


def test_integration_snippets_run(monkeypatch, tmp_path):
    import torch

    monkeypatch.chdir(tmp_path)
    blocks = python_blocks(DOC.read_text())
    assert len(blocks) >= 8  # load, quantizer, convert, save, move, compile, moe, grads, EP
    namespace: dict = {"__name__": "integration_md"}
    torch._dynamo.reset()
    try:
        for i, block in enumerate(blocks):
            code = compile(block, f"{DOC.name} block {i + 1}", "exec")
            exec(code, namespace)
    finally:
        torch._dynamo.reset()


def test_every_section_the_issue_asks_for_is_there():
    text = DOC.read_text()
    for heading in ("## Load", "## Save and reload", "## Move", "## Compile",
                    "## Expert parallelism", "inference-only", "### Peak host memory"):  # fmt: skip
        assert heading in text, heading
