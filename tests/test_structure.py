"""The shape of the code base, checked from its sources: no import cycles among the
modules of src/fp4moe (imports inside functions included), no module importing another
module's private names, no source file over 700 lines, and no development history in
the repository's text."""

from __future__ import annotations

import ast
import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src"
PKG = SRC / "fp4moe"
MAX_LINES = 700


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(SRC).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def _imports(path: Path) -> list[tuple[str, list[str]]]:
    """(imported module, names) of every import in ``path``, relative ones resolved."""
    mod = _module_name(path)
    package = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out += [(a.name, []) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            out.append((target, [a.name for a in node.names]))
    return out


def _graph() -> dict[str, set[str]]:
    modules = {_module_name(p): p for p in PKG.rglob("*.py")}
    graph: dict[str, set[str]] = {m: set() for m in modules}
    for m, path in modules.items():
        for target, names in _imports(path):
            if not target.startswith("fp4moe"):
                continue
            for name in names or [""]:
                sub = f"{target}.{name}" if name else target
                dep = sub if sub in modules else target
                while dep not in modules and "." in dep:
                    dep = dep.rpartition(".")[0]
                # importing a package runs its __init__; a module's own package is no edge
                if dep != m and not m.startswith(dep + "."):
                    graph[m].add(dep)
    return graph


def test_no_import_cycles():
    graph = _graph()
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(m: str) -> None:
        state[m] = 1
        stack.append(m)
        for d in sorted(graph[m]):
            if state.get(d) == 1:
                cycle = [*stack[stack.index(d) :], d]
                pytest.fail("import cycle: " + " -> ".join(cycle))
            if d not in state:
                visit(d)
        stack.pop()
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m)


def test_the_cycle_check_can_fail(tmp_path, monkeypatch):
    """The check above finds a planted cycle (a test that cannot fail proves nothing)."""
    pkg = tmp_path / "fp4moe"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("def f():\n    from .b import g\n")
    (pkg / "b.py").write_text("from .a import f\n")
    monkeypatch.setattr(__import__(__name__), "SRC", tmp_path)
    monkeypatch.setattr(__import__(__name__), "PKG", pkg)
    with pytest.raises(pytest.fail.Exception, match="import cycle"):
        test_no_import_cycles()


def test_no_private_names_across_modules():
    bad = []
    for path in PKG.rglob("*.py"):
        for target, names in _imports(path):
            if not target.startswith("fp4moe") or target == _module_name(path):
                continue
            bad += [f"{_module_name(path)} imports {target}.{n}" for n in names
                    if n.startswith("_") and not n.startswith("__")]  # fmt: skip
    assert not bad, "\n".join(bad)


def test_source_files_are_small():
    long = {str(p.relative_to(ROOT)): n for p in PKG.rglob("*.py")
            if (n := len(p.read_text().splitlines())) > MAX_LINES}  # fmt: skip
    assert not long, long


_HISTORY = re.compile(r"\bsessions? \d+|\bs\d\d[a-h]\b|perf-notes|gpu_session", re.I)


def test_no_development_history_in_the_repository():
    """The repository describes the product as it is: no numbered work sessions or steps
    (git keeps the history)."""
    try:
        files = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True,
                               check=True).stdout.split()  # fmt: skip
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout")
    hits = []
    for f in files:
        path = ROOT / f
        if path.suffix not in (".py", ".md", ".sh", ".toml", ".txt", ".cfg") or not path.exists():
            continue
        if path == Path(__file__).resolve():
            continue
        for n, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            if _HISTORY.search(line):
                hits.append(f"{f}:{n}: {line.strip()[:90]}")
    assert not hits, "\n".join(hits[:40]) + f"\n({len(hits)} lines)"
