"""benchmarks/gluon_timeline.py's summary of ``gluon_ws.TRACE`` stamps (synthetic stamps
here; the GPU run is ``gpu_session.sh timeline``), and the traced kernel compiled for
sm_90: the stamps are there and the kernel without them is unchanged."""

from __future__ import annotations

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "benchmarks"))
from gluon_timeline import summarize
from test_gluon_ws import _compile_check


def _program(g, sm, expert, g_start, phases_ns, ghz=2.0):
    """One program's stamps: starts at ``g_start`` ns on SM ``sm``; ``phases_ns`` the
    eight phase lengths (wait .. epilogue) in ns; %clock64 runs at ``ghz``."""
    row = torch.full((g.TRACE_FIELDS,), -1, dtype=torch.int64)
    cols = [g.T_START, g.T_WAIT, g.T_SCHED, g.T_ISSUE, g.T_X, g.T_W0, g.T_LOOP, g.T_PART,
            g.T_END]  # fmt: skip
    c = 1_000_000 + sm * 777  # each SM's counter has its own origin
    row[cols[0]] = c
    for col, ns in zip(cols[1:], phases_ns):
        c += int(ns * ghz)
        row[col] = c
    row[g.T_GSTART] = g_start
    row[g.T_GEND] = g_start + sum(phases_ns)
    row[g.T_SM] = sm
    row[g.T_EXPERT] = expert
    return row


def test_summarize_phases_waves_and_empty_programs():
    from fp4moe.kernels import gluon_ws as g

    valid = [100, 200, 300, 400, 2000, 3000, 200, 800]  # wait .. epilogue, ns: 7000 in all
    rows = [_program(g, sm, 3, start, valid) for sm, start in ((0, 0), (1, 0), (0, 7000),
                                                               (1, 500))]  # fmt: skip
    empty = [100, 600, 0, 0, 0, 0, 0, 0]
    rows += [_program(g, 1, -1, 7500, empty), _program(g, 0, -1, 14000, empty)]
    never = torch.full((g.TRACE_FIELDS,), -1, dtype=torch.int64)  # did not record
    s = summarize(torch.stack([*rows, never]), slots_per_sm=2)
    assert (s["programs"], s["valid"], s["empty"]) == (6, 4, 2)
    assert s["span_us"] == pytest.approx(14.7)
    assert s["cycles_per_ns"] == pytest.approx(2.0)
    ph = s["phases_us"]
    for name, ns in zip(("wait", "sched", "issue", "stage_x", "first_wait", "main",
                         "partials", "epilogue"), valid):  # fmt: skip
        assert ph[name]["median"] == pytest.approx(ns / 1000)
    assert ph["total"]["median"] == pytest.approx(7.0)
    assert s["empty_us"]["median"] == pytest.approx(0.7)
    assert s["empty_us"]["first_start"] == pytest.approx(7.5)
    assert s["valid_start_us"]["q100"] == pytest.approx(7.0)
    assert s["sms_used"] == 2
    busy = 4 * 7000 + 2 * 700
    assert s["mean_programs_in_flight_per_sm"] == pytest.approx(busy / 2 / 14700)
    assert s["slot_occupancy"] == pytest.approx(busy / 2 / 14700 / 2)


def test_traced_kernel_compiles_for_sm90():
    """``TRACE``: nine %clock64 reads, two %globaltimer, one %smid, no spill, the same
    shared memory; the untraced kernel has none of them."""
    pytest.importorskip("triton")
    code = (
        "from fp4moe.kernels.gluon_ws import compile_sm90\n"
        "for n, k, g in ((2048, 7168, True), (7168, 2048, False)):\n"
        "    kw = dict(n=n, k=k, gated=g, block_m=8, asynchronous=True, buffers=1,\n"
        "              epilogue=True, box3=2, pdl=True, early_weights=not g)\n"
        "    base, c = compile_sm90(**kw), compile_sm90(**kw, trace=True)\n"
        "    ptx, b = c.asm['ptx'], base.asm['ptx']\n"
        "    assert (ptx.count('%clock64'), ptx.count('%globaltimer'), ptx.count('%smid')) \\\n"
        "        == (9, 2, 1), n\n"
        "    assert '%clock64' not in b and '%globaltimer' not in b and '%smid' not in b\n"
        "    assert '.local' not in ptx and c.metadata.shared == base.metadata.shared\n"
        "print('ok')\n"
    )
    _compile_check(code)


@pytest.mark.gpu
@pytest.mark.parametrize("t", [1, 16])
def test_trace_gpu(monkeypatch, t):
    """On the GPU: a traced call gives the untraced call's bits, both Gluon GEMMs record
    every program, and each valid program's stamps run forward through its phases."""
    from fp4moe.kernels import gluon_ws as g
    from fp4moe.kernels.launch import TritonOptions, moe_triton
    from test_gluon_ws import _deepseek_case

    experts, x, ids, w = _deepseek_case(t, seed=31, expert=2)
    want = moe_triton(x, ids, w, experts, options=TritonOptions(poison=True))
    monkeypatch.setattr(g, "TRACE", True)
    monkeypatch.setattr(g, "TRACES", [])
    got = moe_triton(x, ids, w, experts, options=TritonOptions(poison=True))
    assert torch.equal(want, got)
    assert [f["gated"] for f, _ in g.TRACES] == [True, False]
    cols = [g.T_START, g.T_WAIT, g.T_SCHED, g.T_ISSUE, g.T_X, g.T_W0, g.T_LOOP, g.T_PART,
            g.T_END]  # fmt: skip
    for _, tr in g.TRACES:
        tr = tr.cpu()
        assert bool((tr[:, g.T_START] >= 0).all())  # every program recorded
        v = tr[tr[:, g.T_EXPERT] >= 0]
        assert v.shape[0] > 0
        assert bool((v[:, cols].diff(dim=1) >= 0).all())
        assert bool((v[:, g.T_GEND] >= v[:, g.T_GSTART]).all())
