"""fp4moe bench --ep: 2 gloo processes on the CPU (reference backend, a tiny shape), both
paths (variable, fixed-capacity), and the errors. The GPU run (NCCL, Triton) is manual:
docs/expert-parallel.md has the command.

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

H, I, E, K = 64, 32, 8, 2  # noqa: E741 (the contract's name)
TINY = [
    "--hidden", str(H), "--inter", str(I), "--experts", str(E), "--top-k", str(K),
    "--warmup", "1", "--iters", "2", "--ep-timeout", "30",
]  # fmt: skip
GLOO = ["--ep", "2", "--ep-backend", "gloo", "--device", "cpu", *TINY]
MODES = ["w4a16", "w4a8", "w4a4-token", "w4a4-tensor"]
PATHS = ["variable", "fixed"]
ROW_FIELDS = {
    "tokens", "global_tokens", "mode", "path", "max_tokens", "cuda_graph", "dispatch_us",
    "compute_us", "combine_us", "total_us",
    "local_compute_us", "total_over_local", "bytes_sent", "dispatch_bytes", "combine_bytes",
    "bytes_sent_all_ranks", "recv_rows_max", "recv_rows_min", "rel_err",
    "split_matches_forward", "fixed_matches_variable",
}  # fmt: skip
TIMES = ("dispatch_us", "compute_us", "combine_us", "total_us", "local_compute_us")
SRC = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "src")


def _args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    bench.add_arguments(p)
    return p.parse_args(argv)


@pytest.fixture(scope="module")
def cli_run(tmp_path_factory):
    """`python -m fp4moe bench --ep 2` (gloo, CPU), T = 1 and 5 a rank, four modes, both
    paths (the default --ep-path)."""
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
    assert [(r["tokens"], r["mode"], r["path"]) for r in doc["rows"]] == [
        (t, m, q) for t in (1, 5) for m in MODES for q in PATHS
    ]
    assert doc["paths"] == PATHS and doc["cuda_graph"] is False  # no graphs on the CPU
    assert "fixed" in doc["path"] and "eager" in doc["path"]


def test_ep_rows_sane(cli_run):
    _, doc, _ = cli_run
    for r in doc["rows"]:
        assert set(r) == ROW_FIELDS, set(r) ^ ROW_FIELDS
        for k in TIMES:
            assert r[k] > 0, (k, r)
        assert r["bytes_sent"] > 0 and r["bytes_sent_all_ranks"] >= r["bytes_sent"]
        assert 0 <= r["recv_rows_min"] <= r["recv_rows_max"]
        assert r["global_tokens"] == 2 * r["tokens"]
        assert r["split_matches_forward"] is True  # the timed steps give forward's bits
        assert r["rel_err"] is None  # the reference backend is not checked against itself
        assert r["cuda_graph"] is False
        if r["path"] == "variable":
            assert r["max_tokens"] is None and r["fixed_matches_variable"] is None
        else:
            assert r["max_tokens"] == r["tokens"]
            # Bitwise against the variable path (W4A4 per-tensor: not checked).
            want = None if r["mode"] == "w4a4-tensor" else True
            assert r["fixed_matches_variable"] is want, r
    # Variable path: every route of every token is sent (no masking) and received by some
    # rank. Fixed path: max_tokens * K rows to every rank, padding included.
    for t in (1, 5):
        for m in MODES:
            for q in PATHS:
                ranks = [p for p in doc["per_rank"] if (p["tokens"], p["mode"], p["path"]) ==
                         (t, m, q)]  # fmt: skip
                assert sorted(p["rank"] for p in ranks) == [0, 1]
                if q == "variable":
                    assert all(p["dispatch_rows"] == t * K for p in ranks)
                    assert sum(p["recv_rows"] for p in ranks) == 2 * t * K
                else:
                    assert all(p["dispatch_rows"] == p["recv_rows"] == 2 * t * K for p in ranks)


@pytest.mark.parametrize("path", PATHS)
def test_ep_quantized_modes_send_fewer_bytes(cli_run, path):
    _, doc, _ = cli_run
    row = {(r["tokens"], r["mode"]): r for r in doc["rows"] if r["path"] == path}
    for t in (1, 5):
        sent = {m: sum(p["dispatch_bytes"] for p in doc["per_rank"] if p["tokens"] == t and
                       p["mode"] == m and p["path"] == path) for m in MODES}  # fmt: skip
        if sent["w4a16"]:
            # Same routes (or capacity) in every mode: the ratio of the wire rows exactly.
            tok = sent["w4a16"] / sent["w4a4-token"]
            assert tok == pytest.approx(wire_row_bytes(H, "w4a16") / wire_row_bytes(H, "w4a4"))
            assert sent["w4a16"] / sent["w4a4-tensor"] == pytest.approx(128 / 36)
            w8 = wire_row_bytes(H, "w4a16") / wire_row_bytes(H, "w4a8")
            assert sent["w4a16"] / sent["w4a8"] == pytest.approx(w8)  # 2H / (H + 4)
        if path == "fixed":  # by capacity: max_tokens * K rows to the other rank
            assert sent["w4a16"] == 2 * t * K * wire_row_bytes(H, "w4a16")
    for m in ("w4a8", "w4a4-token", "w4a4-tensor"):
        assert row[5, m]["bytes_sent_all_ranks"] < row[5, "w4a16"]["bytes_sent_all_ranks"]
        assert row[5, m]["dispatch_bytes"] < row[5, "w4a16"]["dispatch_bytes"]
        assert row[5, m]["combine_bytes"] == row[5, "w4a16"]["combine_bytes"]  # bf16 rows back


def test_ep_table_and_csv(cli_run):
    proc, doc, rows = cli_run
    assert "x2  gloo, reference kernels" in proc.stdout
    for m in MODES:
        assert m in proc.stdout
    table = bench_ep.format_table(doc).splitlines()
    assert table[2].split()[:4] == ["tokens", "mode", "path", "cuda_graph"]
    assert [line.split()[2] for line in table[3:]] == [r["path"] for r in doc["rows"]]
    assert "bench-ep.json" in proc.stdout
    assert len(rows) == len(doc["rows"]) and set(rows[0]) == ROW_FIELDS
    assert bench_ep.format_table(doc).splitlines()[2].split()[0] == "tokens"


def test_ep_python_api_run_ep(tmp_path):
    """bench_ep.run_ep from Python; T = 0 on every rank; static scales."""
    args = _args([*GLOO, "--num-tokens", "0", "3", "--modes", "w4a4-static", "--iters", "1",
                  "--ep-path", "variable", "--out", str(tmp_path)])  # fmt: skip
    doc = bench_ep.run_ep(args)
    assert (tmp_path / "bench-ep.json").exists()
    empty, three = doc["rows"]
    assert empty["tokens"] == 0 and empty["recv_rows_max"] == 0
    assert empty["bytes_sent"] == empty["bytes_sent_all_ranks"] // 2 > 0  # metadata only
    assert three["recv_rows_max"] + three["recv_rows_min"] == 2 * 3 * K
    assert three["split_matches_forward"] is True
    assert {r["path"] for r in doc["rows"]} == {"variable"} and doc["paths"] == ["variable"]


def test_ep_fixed_path_alone(tmp_path):
    """--ep-path fixed: only fixed-capacity rows (max_tokens = T, 1 for T = 0), timed,
    bitwise equal to the variable path; --no-cuda-graph is accepted (eager on the CPU
    anyway); the CSV carries the path."""
    args = _args([*GLOO, "--num-tokens", "0", "4", "--modes", "w4a16", "w4a4-static",
                  "--ep-path", "fixed", "--no-cuda-graph", "--out", str(tmp_path)])  # fmt: skip
    doc = bench_ep.run_ep(args)
    assert doc["paths"] == ["fixed"] and doc["cuda_graph"] is False
    assert [(r["tokens"], r["mode"]) for r in doc["rows"]] == [
        (t, m) for t in (0, 4) for m in ("w4a16", "w4a4-static")
    ]
    for r in doc["rows"]:
        assert r["path"] == "fixed" and r["cuda_graph"] is False
        assert r["max_tokens"] == max(r["tokens"], 1)
        assert r["fixed_matches_variable"] is True and r["split_matches_forward"] is True
        assert all(r[k] > 0 for k in TIMES), r
        # Capacity rows to every rank, padding included, whatever the routes.
        assert r["recv_rows_max"] == r["recv_rows_min"] == 2 * r["max_tokens"] * K
    assert all(p["path"] == "fixed" for p in doc["per_rank"])
    rows = list(csv.DictReader((tmp_path / "bench-ep.csv").open()))
    assert [r["path"] for r in rows] == ["fixed"] * 4
    assert {r["fixed_matches_variable"] for r in rows} == {"True"}


def test_fixed_mismatch_error():
    """The error every rank raises when the fixed path's bits differ from the variable's."""
    assert bench_ep._fixed_mismatch(4, "w4a16", 4, [True, True]) is None
    exc = bench_ep._fixed_mismatch(4, "w4a4-token", 4, [True, False])
    assert isinstance(exc, RuntimeError)
    msg = str(exc)
    assert "T=4 w4a4-token" in msg and "max_tokens=4" in msg and "rank(s) [1]" in msg
    assert "not timed" in msg


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


def test_ep_path_choices(capsys):
    with pytest.raises(SystemExit):
        _args([*GLOO, "--ep-path", "sometimes"])
    assert "--ep-path" in capsys.readouterr().err
    args = _args(GLOO)
    assert args.ep_path == "both"
    assert bench_ep.resolve(args)["paths"] == PATHS
    args.ep_path = "sometimes"  # a Namespace built by hand
    with pytest.raises(ValueError, match="--ep-path"):
        bench_ep.resolve(args)


def test_ep_option_in_help(capsys):
    assert main(["bench", "--help"]) == 0
    out = capsys.readouterr().out
    assert "--ep N" in out and "--ep-backend" not in out  # the testing flags are hidden
    assert "--ep-path {variable,fixed,both}" in out


@pytest.mark.gpu
def test_ep_nccl_two_gpus(tmp_path):
    """The default run on 2 GPUs: NCCL, Triton kernels checked against the reference, both
    paths, the fixed one as CUDA-graph replays bitwise equal to the variable one."""
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
    assert doc["cuda_graph"] is True
    assert {r["path"] for r in doc["rows"]} == set(PATHS)
    for r in doc["rows"]:
        assert min(r[k] for k in TIMES) > 0
        assert r["rel_err"] is not None and r["split_matches_forward"] is True
        assert r["cuda_graph"] is (r["path"] == "fixed")
        if r["path"] == "fixed" and r["mode"] != "w4a4-tensor":
            assert r["fixed_matches_variable"] is True
