"""benchmarks/peers_run.py: the peers' bench run with fp4moe bench's own timer (a stand-in
``bench_peers.py`` here; the real one runs on the GPU through ``gpu.sh peers``)."""

import os
import subprocess
import sys

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
TOOL = os.path.join(ROOT, "benchmarks", "peers_run.py")

STAND_IN = """
class GraphTimer:  # the peers' own copy, which peers_run replaces
    pass


def main(argv=None):
    import fp4moe.bench as fb

    print("timer", GraphTimer is fb.GraphTimer, "args", " ".join(argv))
    return 3
"""


def _run(*args):
    env = dict(os.environ, PYTHONPATH=os.path.join(ROOT, "src"))
    return subprocess.run([sys.executable, TOOL, *args], capture_output=True, text=True,
                          timeout=120, env=env)  # fmt: skip


def test_peers_run_swaps_in_the_bench_timer(tmp_path):
    (tmp_path / "bench_peers.py").write_text(STAND_IN)
    out = _run(str(tmp_path), "--preset", "qwen3-30b-a3b", "--iters", "5")
    assert out.returncode == 3, out.stderr  # the peers' exit status passed on
    assert "timer True args --preset qwen3-30b-a3b --iters 5" in out.stdout


def test_peers_run_without_the_folder_says_how(tmp_path):
    out = _run(str(tmp_path / "missing"))
    assert out.returncode == 2
    assert "PEERS_DIR" in out.stderr
