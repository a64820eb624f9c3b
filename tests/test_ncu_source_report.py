"""benchmarks/ncu_source_report.py reads ncu's source page (one row a SASS instruction
with its warp-state samples) and attributes the samples: checked here on a small CSV of
the same form, two kernels, one with an early-exit path that more warps execute."""

import csv
import gzip
import importlib.util
import json
import os

import pytest

TOOL = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "benchmarks",
                    "ncu_source_report.py")  # fmt: skip
spec = importlib.util.spec_from_file_location("ncu_source_report", TOOL)
report = importlib.util.module_from_spec(spec)
spec.loader.exec_module(report)

HEADER = ["Address", "Source", "Warp Stall Sampling (All Samples)",
          "Warp Stall Sampling (Not-issued Samples)", "Instructions Executed",
          "stall_barrier", "stall_long_sb", "stall_selected",
          "stall_long_sb (Not Issued)"]  # fmt: skip


def _row(i, src, samples, executed, barrier=0, long_sb=0, selected=0):
    return [hex(i), f"      {src}", str(samples), "0", str(executed), str(barrier),
            str(long_sb), str(selected), "0"]  # fmt: skip


def _csv(path):
    fc1 = [
        _row(0, "LDG.E.STRONG.GPU R15, desc[UR14][R2.64]", 10, 400, selected=10),
        _row(1, "ISETP.GE.AND P0, PT, R15, RZ, PT", 90, 400, long_sb=90),
        _row(2, "@!P0  EXIT", 0, 400),
        _row(3, "UTMALDG.2D [UR8], [UR4]", 5, 40, selected=5),
        _row(4, "SYNCS.PHASECHK.TRANS64.TRYWAIT P0, [UR8+0x8800], RZ", 60, 40, barrier=60),
        _row(5, "LOP3.LUT R39, R33, 0x81c081c0, RZ, 0xc0, !PT", 15, 40, selected=15),
        _row(6, "HGMMA.64x8x16.F32.BF16 R24, R40, gdesc[UR16], RZ, !UPT", 20, 40, long_sb=20),
        _row(7, "EXIT", 0, 40),
    ]
    fc2 = [_row(0, "LDS R4, [UR8]", 7, 8, barrier=7), _row(1, "EXIT", 1, 8, selected=1)]
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        for name, rows in (("tma_split_kernel", fc1), ("other_kernel", fc2)):
            w.writerow(["Kernel Name", name])
            w.writerow(HEADER)
            w.writerows(rows)


def test_summaries_leave_out_the_early_exit(tmp_path):
    path = tmp_path / "sass.csv"
    _csv(path)
    kernels = report.load(str(path))
    assert [k["name"] for k in kernels] == ["tma_split_kernel", "other_kernel"]
    assert report.exit_prefix(kernels[0]["rows"]) == 3
    assert report.exit_prefix(kernels[1]["rows"]) == 0
    s = report.summarize(kernels[0], window=2)
    assert s["first"] == 3 and s["instructions"] == 5
    assert s["samples"] == 100 and s["samples_before_first"] == 100
    assert s["reasons_pct"] == {"barrier": 60.0, "selected": 20.0, "long_sb": 20.0}
    assert [w["first"] for w in s["windows"]] == [3, 5, 7]
    assert [w["samples_pct"] for w in s["windows"]] == [65.0, 35.0, 0.0]
    assert s["windows"][0]["landmarks"] == {"UTMALDG": 1, "SYNCS": 1}
    assert s["windows"][1]["reasons_pct"] == {"long_sb": 57.1, "selected": 42.9}
    ops = {o["opcode"]: o for o in s["opcodes"]}
    assert ops["SYNCS"]["samples_pct"] == 60.0 and ops["LOP3"]["executed_pct"] == 20.0
    assert s["hot"][0]["index"] == 3  # in address order
    assert max(s["hot"], key=lambda h: h["samples_pct"])["index"] == 4
    whole = report.summarize(kernels[0], window=100, start=0)
    assert whole["samples"] == 200 and whole["reasons_pct"]["long_sb"] == 55.0
    assert report.opcode("@!P0  BRA 0x7f30") == "BRA"


def test_command_line(tmp_path, capsys):
    path = tmp_path / "sass.csv"
    _csv(path)
    out = tmp_path / "s.json"
    assert report.main([str(path), "--window", "3", "--top", "2", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "== tma_split_kernel: instructions 3 on (5)" in text and "== other_kernel" in text
    data = json.loads(out.read_text())
    assert len(data) == 2 and len(data[0]["hot"]) == 2
    assert report.main([str(path), "--from", "0"]) == 0
    gz = tmp_path / "sass.csv.gz"
    gz.write_bytes(gzip.compress(path.read_bytes()))
    assert [k["name"] for k in report.load(str(gz))] == ["tma_split_kernel", "other_kernel"]
    for bad in (["--window", "0"], ["--from", "x"]):
        with pytest.raises(SystemExit):
            report.main([str(path), *bad])
    empty = tmp_path / "empty.csv"
    empty.write_text("nothing,here\n")
    with pytest.raises(SystemExit):
        report.main([str(empty)])
