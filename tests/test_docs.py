"""The README and docs/ say what is true: their relative links resolve, and the README's
self-contained Python example runs (on the CPU: the reference backend)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", ROOT / "CHANGELOG.md", *sorted((ROOT / "docs").glob("*.md"))]


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_relative_links_resolve(doc):
    text = doc.read_text()
    bad = []
    for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text):
        if re.match(r"[a-z]+:", target):  # a URL
            continue
        if not (doc.parent / target).exists():
            bad.append(target)
    assert not bad, f"{doc.name}: links to missing files {bad}"


def test_readme_example_runs(capsys):
    blocks = re.findall(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), re.S)
    runnable = [b for b in blocks if "prepare_experts(" in b]
    assert runnable, "the README's example calling moe() is gone"
    scope: dict = {}
    exec(compile(runnable[0], "README.md", "exec"), scope)
    assert scope["decode"].shape == scope["prefill"].shape == scope["x"].shape
    assert "FC1: bf16 input -> gluon-whole" in capsys.readouterr().out  # an H200's kernels
