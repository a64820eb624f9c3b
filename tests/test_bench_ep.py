"""fp4moe bench --ep: 2 gloo processes on the CPU (reference backend, a tiny shape), and the
errors. The GPU run (NCCL, Triton) is manual: docs/expert-parallel.md has the command.

Every spawned run uses a 30 s process-group timeout (``--ep-timeout``), and the CLI run is a
subprocess with a wall-clock limit, so a failure never hangs the suite.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import subprocess
import sys

import pytest
import torch

from fp4moe import bench, bench_ep
from fp4moe.cli import main
from fp4moe.distributed import wire_row_bytes

H, I, E, K = 64, 32, 8, 2  # noqa: E741 (the SPEC's name)
TINY = [
    "--hidden", str(H), "--inter", str(I), "--experts", str(E), "--top-k", str(K),
    "--warmup", "1", "--iters", "2", "--ep-timeout", "30",
]  # fmt: skip
GLOO = ["--ep", "2", "--ep-backend", "gloo", "--device", "cpu", *TINY]
MODES = ["w4a16", "w4a4-token", "w4a4-tensor"]
ROW_FIELDS = {
    "tokens", "global_tokens", "mode", "dispatch_us", "compute_us", "combine_us", "total_us",
    "local_compute_us", "total_over_local", "bytes_sent", "dispatch_bytes", "combine_bytes",
    "bytes_sent_all_ranks", "recv_rows_max", "recv_rows_min", "rel_err",
    "split_matches_forward",
}  # fmt: skip
SRC = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "src")


def _args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    bench.add_arguments(p)
    return p.parse_args(argv)


@pytest.fixture(scope="module")
def cli_run(tmp_path_factory):
    """`python -m fp4moe bench --ep 2` (gloo, CPU), T = 1 and 5 a rank, three modes."""
    out = tmp_path_factory.mktemp("bench-ep")
    env = dict(os.environ, PYTHONPATH=SRC + os.pathsep + os.environ.get("PYTHONPATH", ""))
    cmd = [sys.executable, "-m", "fp4moe", "bench", *GLOO, "--num-tokens", "1", "5",
           "--modes", *MODES, "--out", str(out)]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=150, env=env)
    assert proc.returncode == 0, proc.stderr[-4000:]
    doc = json.loads((out / "bench-ep.json").read_text())
    rows = list(csv.DictReader((out / "bench-ep.csv").open()))
    return proc, doc, rows


def test_ep_document(cli_run):
    _, doc, _ = cli_run
    assert doc["world_size"] == 2 and doc["backend"] == "gloo" and doc["kernels"] == "reference"
    assert doc["device"] and doc["devices"] == [doc["device"]] * 2
    for key in ("torch", "triton", "fp4moe", "commit", "date", "preset", "shape"):
        assert key in doc, key
    assert doc["torch"] == torch.__version__
    assert doc["shape"]["experts"] == E and doc["experts_per_rank"] == E // 2
    assert [(r["tokens"], r["mode"]) for r in doc["rows"]] == [
        (t, m) for t in (1, 5) for m in MODES
    ]


def test_ep_rows_sane(cli_run):
    _, doc, _ = cli_run
    for r in doc["rows"]:
        assert set(r) == ROW_FIELDS, set(r) ^ ROW_FIELDS
        for k in ("dispatch_us", "compute_us", "combine_us", "total_us", "local_compute_us"):
            assert r[k] > 0, (k, r)
        assert r["bytes_sent"] > 0 and r["bytes_sent_all_ranks"] >= r["bytes_sent"]
        assert 0 <= r["recv_rows_min"] <= r["recv_rows_max"]
        assert r["global_tokens"] == 2 * r["tokens"]
        assert r["split_matches_forward"] is True  # the timed steps give forward's bits
        assert r["rel_err"] is None  # the reference backend is not checked against itself
    # Every route of every token is sent (no masking) and received by some rank.
    for t in (1, 5):
        for m in MODES:
            ranks = [p for p in doc["per_rank"] if p["tokens"] == t and p["mode"] == m]
            assert sorted(p["rank"] for p in ranks) == [0, 1]
            assert all(p["dispatch_rows"] == t * K for p in ranks)
            assert sum(p["recv_rows"] for p in ranks) == 2 * t * K


def test_ep_w4a4_sends_fewer_bytes(cli_run):
    _, doc, _ = cli_run
    row = {(r["tokens"], r["mode"]): r for r in doc["rows"]}
    for t in (1, 5):
        sent = {m: sum(p["dispatch_bytes"] for p in doc["per_rank"] if p["tokens"] == t and
                       p["mode"] == m) for m in MODES}  # fmt: skip
        if sent["w4a16"]:
            # Same routes in every mode: the ratio is that of the wire rows exactly.
            tok = sent["w4a16"] / sent["w4a4-token"]
            assert tok == pytest.approx(wire_row_bytes(H, "w4a16") / wire_row_bytes(H, "w4a4"))
            assert sent["w4a16"] / sent["w4a4-tensor"] == pytest.approx(128 / 36)
    for m in ("w4a4-token", "w4a4-tensor"):
        assert row[5, m]["bytes_sent_all_ranks"] < row[5, "w4a16"]["bytes_sent_all_ranks"]
        assert row[5, m]["dispatch_bytes"] < row[5, "w4a16"]["dispatch_bytes"]
        assert row[5, m]["combine_bytes"] == row[5, "w4a16"]["combine_bytes"]  # bf16 rows back


def test_ep_table_and_csv(cli_run):
    proc, doc, rows = cli_run
    assert "x2  gloo, reference kernels" in proc.stdout
    for m in MODES:
        assert m in proc.stdout
    assert "bench-ep.json" in proc.stdout
    assert len(rows) == len(doc["rows"]) and set(rows[0]) == ROW_FIELDS
    assert bench_ep.format_table(doc).splitlines()[2].split()[0] == "tokens"


def test_ep_python_api_through_bench_run(tmp_path):
    """bench.run dispatches to bench_ep.run_ep; T = 0 on every rank; static scales."""
    args = _args([*GLOO, "--num-tokens", "0", "3", "--modes", "w4a4-static", "--iters", "1",
                  "--out", str(tmp_path)])  # fmt: skip
    doc = bench.run(args)
    assert (tmp_path / "bench-ep.json").exists()
    empty, three = doc["rows"]
    assert empty["tokens"] == 0 and empty["recv_rows_max"] == 0
    assert empty["bytes_sent"] == empty["bytes_sent_all_ranks"] // 2 > 0  # metadata only
    assert three["recv_rows_max"] + three["recv_rows_min"] == 2 * 3 * K
    assert three["split_matches_forward"] is True


# ----------------------------------------------------------------------------- errors


@pytest.mark.parametrize("n", ["1", "0", "-2"])
def test_ep_below_two_is_a_usage_error(n, capsys):
    assert main(["bench", "--ep", n, "--ep-backend", "gloo"]) == 2
    err = capsys.readouterr().err
    assert "--ep" in err and "at least 2" in err and f"got {n}" in err


def test_ep_without_cuda_fails_clearly(capsys):
    if torch.cuda.is_available():
        pytest.skip("has a GPU")
    assert main(["bench", "--ep", "2"]) == 1
    err = capsys.readouterr().err
    assert "needs 2 CUDA GPUs" in err and "none is available here" in err
    assert bench.main(["--ep", "2"]) == 1  # the module's own entry point too
    assert "needs 2 CUDA GPUs" in capsys.readouterr().err


def test_ep_more_processes_than_gpus_fails_clearly(monkeypatch, capsys):
    """Checked before any process is spawned, so nothing waits on a missing rank."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3")
    assert main(["bench", "--ep", "4", "--num-tokens", "1"]) == 1
    err = capsys.readouterr().err
    assert "needs 4 CUDA GPUs" in err and "1 is visible" in err and "CUDA_VISIBLE_DEVICES=3" in err


@pytest.mark.parametrize(
    ("extra", "needle"),
    [
        (["--ep", "3", "--ep-backend", "gloo", *TINY], "do not split evenly"),
        (["--ep", "2", "--ep-backend", "nccl", "--device", "cpu"], "NCCL runs on CUDA"),
        (["--ep", "2", "--ep-backend", "gloo", "--local-experts", "4"], "--local-experts"),
        (["--ep", "2", "--ep-backend", "gloo", "--cold-l2"], "--cold-l2"),
    ],
    ids=["uneven", "nccl-on-cpu", "local-experts", "cold-l2"],
)
def test_ep_bad_usage(extra, needle, capsys):
    assert main(["bench", *extra]) == 2
    assert needle in capsys.readouterr().err


def test_ep_option_in_help(capsys):
    assert main(["bench", "--help"]) == 0
    out = capsys.readouterr().out
    assert "--ep N" in out and "--ep-backend" not in out  # the testing flags are hidden


@pytest.mark.gpu
def test_ep_nccl_two_gpus(tmp_path):
    """The default path on 2 GPUs: NCCL, Triton kernels checked against the reference."""
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 CUDA GPUs")
    env = dict(os.environ, PYTHONPATH=SRC + os.pathsep + os.environ.get("PYTHONPATH", ""))
    cmd = [sys.executable, "-m", "fp4moe", "bench", "--ep", "2", "--hidden", "512", "--inter",
           "256", "--experts", "16", "--top-k", "4", "--num-tokens", "1", "64", "--warmup", "2",
           "--iters", "5", "--ep-timeout", "120", "--out", str(tmp_path)]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=500, env=env)
    assert proc.returncode == 0, proc.stderr[-4000:]
    doc = json.loads((tmp_path / "bench-ep.json").read_text())
    assert doc["backend"] == "nccl" and doc["kernels"] == "triton" and doc["nccl"]
    assert len(doc["devices"]) == 2
    for r in doc["rows"]:
        assert min(r[k] for k in ("dispatch_us", "compute_us", "combine_us", "total_us")) > 0
        assert r["rel_err"] is not None and r["split_matches_forward"] is True
