"""Expert parallelism (EPMoELayer) on gloo, CPU, 2 and 4 processes.

Each world size is spawned once (module-scoped fixture): every rank runs all the cases in
one process group, compares its outputs with the single-process layer holding all experts
(``MoELayer``'s router, then ``fp4moe.moe`` in the same mode: bitwise), and writes its
verdicts to a JSON file that the tests below read. A rank that fails a case stops there
(the group is then out of step); the 30 s gloo timeout and the join timeout make sure
nothing hangs.
"""

from __future__ import annotations

import json
import os
import socket
import time
import traceback
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import fp4moe
from fp4moe.distributed import E4M3Rows, EPMoELayer, compute_route_rows, wire_row_bytes
from fp4moe.modes import resolve_mode
from fp4moe.phases import MoELayer, PhasePolicy, RouterConfig
from testing import random_moe_weights, random_x, rel_err

H, I, E_TOTAL, K = 64, 32, 8, 2  # noqa: E741 (the contract's name)
MODES = ("w4a16", "w4a8", "w4a4-token", "w4a4-static", "w4a4-tensor")
TOKENS = {1: [13], 2: [13, 5], 4: [9, 0, 17, 4]}  # uneven loads; T = 0 on one rank at world 4
JOIN_TIMEOUT_S = 150
_DEVICE = ["cpu"]  # the worker's device: "cpu" (gloo) or "cuda:<rank>" (nccl)


def _dev() -> str:
    return _DEVICE[0]


# ----------------------------------------------------------------------------- inputs


def _full_experts(h: int = H) -> fp4moe.PreparedExperts:
    w13, w2 = random_moe_weights(E_TOTAL, h, I, seed=0)
    e = torch.arange(E_TOTAL, dtype=torch.float32)
    return fp4moe.prepare_experts(
        w13, w2, a13_scale=(120.0 + 10.0 * e) / 2688, a2_scale=(1500.0 + 200.0 * e) / 2688
    ).to(_dev())


def _slice(full: fp4moe.PreparedExperts, start: int, stop: int) -> fp4moe.PreparedExperts:
    return fp4moe.PreparedExperts.from_linear(
        {k: v[start:stop] for k, v in full.to_linear().items()}
    )


def _gate(h: int = H) -> torch.Tensor:
    g = torch.Generator().manual_seed(7)
    return (torch.randn(E_TOTAL, h, generator=g) * 0.2).to(_dev())


def _x(rank: int, t: int, salt: int = 0) -> torch.Tensor:
    return random_x(t, H, seed=1000 * salt + rank).to(_dev())


def _ep(rank, world, mode, full, **kw) -> EPMoELayer:
    start, stop = fp4moe.expert_range(rank, world, E_TOTAL)
    policy = kw.pop("policy", None) or PhasePolicy.single(mode, backend=kw.pop("backend", "auto"))
    return EPMoELayer(
        _slice(full, start, stop), RouterConfig(top_k=K), gate_weight=_gate(), policy=policy, **kw
    )


class _Single:
    """The single-process layer holding all experts: ``MoELayer``'s router, then
    ``fp4moe.moe`` in ``mode`` with the deterministic finalize, which is what
    ``MoELayer.forward`` runs for a one-mode policy (the phase does not change it)."""

    def __init__(self, mode: str, full: fp4moe.PreparedExperts, backend: str) -> None:
        self.mode, self.full, self.backend = mode, full, backend
        self.layer = MoELayer(full, RouterConfig(top_k=K), gate_weight=_gate(), policy=mode)

    def route(self, x: torch.Tensor):
        return self.layer.route(x)

    def __call__(self, x, phase=None, routes=None) -> torch.Tensor:
        x2d = x.reshape(-1, H)
        ids, w = routes if routes is not None else self.route(x2d)
        out = fp4moe.moe(x2d, ids, w, self.full, mode=self.mode, backend=self.backend)
        return out.reshape(x.shape)


def _single(mode, full, backend="auto") -> _Single:
    return _Single(mode, full, backend)


def _bitwise(out: torch.Tensor, ref: torch.Tensor, what: str) -> None:
    assert out.shape == ref.shape and out.dtype == ref.dtype, (what, out.shape, ref.shape)
    same = out.view(torch.int16) == ref.view(torch.int16)
    if not bool(same.all()):
        bad = (~same).nonzero()
        raise AssertionError(
            f"{what}: {int((~same).sum())} of {out.numel()} elements differ; first at "
            f"{tuple(bad[0].tolist())}: {out[tuple(bad[0])].item()} vs {ref[tuple(bad[0])].item()}"
        )


def _skewed_routes(rank, world, t, target_rank, seed):
    """Routes of rank ``rank`` only to experts of ``target_rank`` (some masked)."""
    g = torch.Generator().manual_seed(seed + rank)
    epr = E_TOTAL // world
    start = target_rank * epr
    ids = (
        torch.stack([torch.randperm(epr, generator=g)[:K] + start for _ in range(t)]) if t else None
    )
    ids = ids if ids is not None else torch.zeros(0, K, dtype=torch.int64)
    if t > 2:
        ids[1, 1] = -1  # a masked route
        ids[2, :] = -1  # a token with no route at all
    w = torch.softmax(torch.randn(t, K, generator=g), dim=-1)
    return ids.to(torch.int32).to(_dev()), w.to(_dev())


# ----------------------------------------------------------------------------- cases


def _case_router_modes(rank, world, res, full):
    """Global router, uneven loads, every mode: bitwise as the single-process layer."""
    ts = TOKENS[world]
    xs = [_x(r, ts[r]) for r in range(world)]
    for mode in MODES:
        ep = _ep(rank, world, mode, full)
        out = ep(xs[rank], phase="prefill")
        res.setdefault("bytes", {})[mode] = ep.last_comm_bytes
        single = _single(mode, full)
        # The global batch: every rank's tokens, routed as that rank routes them.
        routes = [single.route(x) for x in xs]
        x_all = torch.cat(xs)
        ids_all = torch.cat([r[0] for r in routes])
        w_all = torch.cat([r[1] for r in routes])
        ref_all = single(x_all, phase="prefill", routes=(ids_all, w_all))
        lo = sum(ts[:rank])
        _bitwise(out, ref_all[lo : lo + ts[rank]], f"{mode} vs global batch")
        ref_own = single(xs[rank], phase="prefill")
        if mode == "w4a4-tensor":
            # Per-tensor scales come from the global batch (other ranks' tokens too), so
            # bits differ from this rank's tokens alone; the accuracy stays that of W4A4.
            if ts[rank]:
                w16 = _single("w4a16", full)(xs[rank], phase="prefill")
                noise = rel_err(ref_own, w16)
                assert rel_err(out, w16) < 2 * noise, (rel_err(out, w16), noise)
        else:
            _bitwise(out, ref_own, f"{mode} vs own tokens")


def _case_skewed(rank, world, res, full):
    """All routes to rank 0's experts: other ranks receive nothing, their tokens are all
    remote; masked routes and a token with no route; T = 0 on the last rank."""
    ts = [6, 3, 0, 5][:world] if world == 4 else [6, 0]
    xs = [_x(r, ts[r], salt=2) for r in range(world)]
    rts = [_skewed_routes(r, world, ts[r], 0, seed=50) for r in range(world)]
    for mode in MODES:
        ep = _ep(rank, world, mode, full)
        out = ep(xs[rank], phase="decode", routes=rts[rank])
        single = _single(mode, full)
        ref = single(
            torch.cat(xs), phase="decode",
            routes=(torch.cat([r[0] for r in rts]), torch.cat([r[1] for r in rts])),
        )  # fmt: skip
        lo = sum(ts[:rank])
        _bitwise(out, ref[lo : lo + ts[rank]], f"{mode} skewed")
        b = ep.last_comm_bytes
        if rank != 0:
            assert b["recv_rows"] == 0, b  # receives no rows
            assert b["dispatch_self"] == 0, b  # every route of its tokens is remote
        if ts[rank] > 2:
            assert not bool(out[2].any())  # the token with no route is 0


def _case_all_remote(rank, world, res, full):
    """Rank r's tokens all go to rank r+1's experts."""
    ts = TOKENS[world]
    xs = [_x(r, ts[r], salt=3) for r in range(world)]
    rts = [_skewed_routes(r, world, ts[r], (r + 1) % world, seed=60) for r in range(world)]
    for mode in ("w4a16", "w4a8", "w4a4-token", "w4a4-static"):
        ep = _ep(rank, world, mode, full)
        out = ep(xs[rank], phase="prefill", routes=rts[rank])
        ref = _single(mode, full)(xs[rank], phase="prefill", routes=rts[rank])
        _bitwise(out, ref, f"{mode} all remote")
        assert ep.last_comm_bytes["dispatch_self"] == 0


def _case_fixed_capacity(rank, world, res, full):
    """max_tokens: fixed buffers, same bits as the variable path; bytes by capacity."""
    ts = TOKENS[world]
    xs = [_x(r, ts[r], salt=4) for r in range(world)]
    for mode in MODES:
        var = _ep(rank, world, mode, full)
        fix = _ep(rank, world, mode, full, max_tokens=20)
        a = var(xs[rank], phase="decode")
        b = fix(xs[rank], phase="decode")
        _bitwise(b, a, f"{mode} fixed capacity")
        row = wire_row_bytes(H, *resolve_mode(mode))
        assert fix.last_comm_bytes["dispatch"] == (world - 1) * 20 * K * row
    fix = _ep(rank, world, "w4a16", full, max_tokens=20)
    fix(xs[rank])  # no phase given: a fixed-capacity layer runs as decode
    assert fix.stats.calls["decode"] == 1


def _case_phase_inference(rank, world, res, full):
    """Inferred phase uses the global token count (the sum over ranks)."""
    ts = [5] * world
    xs = [_x(r, 5, salt=5) for r in range(world)]
    policy = PhasePolicy(prefill="w4a4-token", decode="w4a16", decode_max_tokens=5 * world - 1)
    start, stop = fp4moe.expert_range(rank, world, E_TOTAL)
    ep = EPMoELayer(
        _slice(full, start, stop), RouterConfig(top_k=K), gate_weight=_gate(), policy=policy
    )
    out = ep(xs[rank])
    assert ep.stats.calls == {"prefill": 1, "decode": 0}, ep.stats.calls
    _bitwise(out, _single("w4a4-token", full)(xs[rank], phase="prefill"), "inferred prefill")
    with fp4moe.serving_phase("decode"):
        out = ep(xs[rank])
    _bitwise(out, _single("w4a16", full)(xs[rank], phase="decode"), "context decode")
    assert sum(ts) > policy.decode_max_tokens


def _case_shapes(rank, world, res, full):
    """[B, S, H] inputs keep their shape."""
    ep = _ep(rank, world, "w4a16", full)
    x = _x(rank, 6, salt=6).reshape(2, 3, H)
    out = ep(x, phase="decode")
    assert out.shape == (2, 3, H)
    _bitwise(out.reshape(6, H), _single("w4a16", full)(x.reshape(6, H), phase="decode"), "3d")


def _case_split_steps(rank, world, res, full):
    """dispatch, compute_experts, combine one by one: the bits and bytes of forward."""
    ts = TOKENS[world]
    x = _x(rank, ts[rank], salt=13)
    for mode in MODES:
        for max_tokens in (None, 20):
            ep = _ep(rank, world, mode, full, max_tokens=max_tokens)
            ref = ep(x, phase="prefill")
            ref_bytes = dict(ep.last_comm_bytes)
            d = ep.dispatch(x, phase="prefill")
            y = ep.compute_experts(d)
            assert y.shape == (d.row_expert.numel(), H), y.shape
            _bitwise(ep.combine(d, y), ref, f"{mode} max_tokens={max_tokens} split steps")
            assert ep.last_comm_bytes == ref_bytes
            assert ep.stats.calls["prefill"] == 2


def _case_triton_interpreter(rank, world, res, full):
    """The Triton backend's pieces (interpreter): bitwise as single-process moe_triton."""
    if world != 2 or os.environ.get("TRITON_INTERPRET") != "1":
        return
    ts = [4, 3]
    xs = [_x(r, ts[r], salt=7) for r in range(world)]
    for mode in MODES:
        ep = _ep(rank, world, mode, full, backend="triton")
        out = ep(xs[rank], phase="prefill")
        single = _single(mode, full, backend="triton")
        routes = [single.route(x) for x in xs]
        ref = single(
            torch.cat(xs), phase="prefill",
            routes=(torch.cat([r[0] for r in routes]), torch.cat([r[1] for r in routes])),
        )  # fmt: skip
        lo = sum(ts[:rank])
        _bitwise(out, ref[lo : lo + ts[rank]], f"triton {mode}")
        if mode in ("w4a8", "w4a4-static"):  # padding rows among the received ones
            fixed = _ep(rank, world, mode, full, backend="triton", max_tokens=5)
            _bitwise(fixed(xs[rank], phase="prefill"), out, f"triton {mode} fixed capacity")


def _expect_error(fn, exc_type, *patterns):
    try:
        fn()
    except exc_type as exc:
        msg = str(exc)
        for p in patterns:
            assert p in msg, f"expected {p!r} in {msg!r}"
        return
    raise AssertionError(f"no {exc_type.__name__} raised")


def _case_errors(rank, world, res, full):
    """Disagreements raise a clear error on every rank, and the group stays usable."""
    start, stop = fp4moe.expert_range(rank, world, E_TOTAL)
    good = _slice(full, start, stop)
    last = world - 1

    # Wrong expert slice on the last rank.
    experts = _slice(full, 0, E_TOTAL) if rank == last else good
    mk = lambda: EPMoELayer(experts, RouterConfig(top_k=K), gate_weight=_gate())
    if rank == last:
        _expect_error(mk, ValueError, f"must hold experts [{start}, {stop})", "every rank")
    else:
        _expect_error(mk, ValueError, f"rank(s) [{last}] rejected")

    # A wrong declared expert_range on rank 0.
    rng = (start, stop) if rank else (1, 1 + stop - start)
    mk = lambda: EPMoELayer(good, RouterConfig(top_k=K), gate_weight=_gate(), expert_range=rng)
    _expect_error(mk, ValueError, *(["rank(s) [0] rejected"] if rank else ["expert_range"]))

    # Different policies, router and max_tokens.
    pol = "w4a4-token" if rank == last else "w4a16"
    mk = lambda: EPMoELayer(good, RouterConfig(top_k=K), gate_weight=_gate(), policy=pol)
    _expect_error(mk, ValueError, "disagree on prefill policy", "decode policy")
    top = 3 if rank == 0 else K
    mk = lambda: EPMoELayer(good, RouterConfig(top_k=top), gate_weight=_gate())
    _expect_error(mk, ValueError, "router top_k", "rank 0: 3")
    mt = 8 if rank == 0 else None
    mk = lambda: EPMoELayer(good, RouterConfig(top_k=K), gate_weight=_gate(), max_tokens=mt)
    _expect_error(mk, ValueError, "max_tokens")

    # Different hidden size on the last rank (its experts and gate agree with each other).
    if rank == last:
        w13, w2 = random_moe_weights(stop - start, 96, I, seed=3)
        ex96 = fp4moe.prepare_experts(w13, w2).to(_dev())
        mk = lambda: EPMoELayer(ex96, RouterConfig(top_k=K), gate_weight=_gate(96))
    else:
        mk = lambda: EPMoELayer(good, RouterConfig(top_k=K), gate_weight=_gate())
    _expect_error(mk, ValueError, "hidden size H", "gate_weight checksum")

    # A different gate weight.
    gw = _gate() + (1.0 if rank == 0 else 0.0)
    mk = lambda: EPMoELayer(good, RouterConfig(top_k=K), gate_weight=gw)
    _expect_error(mk, ValueError, "gate_weight checksum")

    # Forward: bad input on one rank; phases that disagree.
    ep = EPMoELayer(good, RouterConfig(top_k=K), gate_weight=_gate(), policy="w4a16")
    x = _x(rank, 4, salt=8)
    if rank == last:
        _expect_error(lambda: ep(x.float()), TypeError, "x: expected torch.bfloat16")
    else:
        _expect_error(lambda: ep(x), ValueError, f"rank(s) [{last}] rejected their input")
    ph = "prefill" if rank == 0 else "decode"
    _expect_error(lambda: ep(x, phase=ph), ValueError, "different phases", "rank 0: 'prefill'")
    bad_ids = torch.full((4, K), E_TOTAL if rank == 0 else 0, dtype=torch.int32, device=_dev())
    w = torch.full((4, K), 0.5, device=_dev())
    call = lambda: ep(x, phase="decode", routes=(bad_ids, w))
    _expect_error(call, ValueError, *(["out of range"] if rank == 0 else ["rank(s) [0]"]))
    # The group still works.
    _bitwise(ep(x, phase="decode"), _single("w4a16", full)(x, phase="decode"), "after errors")


def _case_cuda_graph(rank, world, res, full):
    """GPU only: the fixed-capacity path captured in a CUDA graph (NCCL all_to_all and the
    Triton kernels) replays with the eager bits."""
    if not _dev().startswith("cuda"):
        return
    for mode in ("w4a16", "w4a4-token", "w4a4-static"):
        ep = _ep(rank, world, mode, full, max_tokens=4)
        static_x = _x(rank, 4, salt=9).clone()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                ep(static_x, phase="decode")
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            static_out = ep(static_x, phase="decode")
        for salt in (10, 11, 12):
            x = _x(rank, 4, salt=salt)
            static_x.copy_(x)
            graph.replay()
            torch.cuda.synchronize()
            _bitwise(static_out, ep(x, phase="decode"), f"{mode} graph replay {salt}")
        res.setdefault("graph", []).append(mode)


CASES = {
    "router_modes": _case_router_modes,
    "skewed_and_empty": _case_skewed,
    "all_remote": _case_all_remote,
    "fixed_capacity": _case_fixed_capacity,
    "phase_inference": _case_phase_inference,
    "shapes": _case_shapes,
    "split_steps": _case_split_steps,
    "errors": _case_errors,
    "triton_interpreter": _case_triton_interpreter,
    "cuda_graph": _case_cuda_graph,
}


def _worker(rank: int, world: int, init: str, out_dir: str, device: str,
            cases: tuple[str, ...]) -> None:  # fmt: skip
    torch.set_num_threads(1)
    backend = "gloo"
    if device == "cuda":
        torch.cuda.set_device(rank)
        _DEVICE[0] = f"cuda:{rank}"
        backend = "nccl"
    dist.init_process_group(
        backend, init_method=init, rank=rank, world_size=world, timeout=timedelta(seconds=30)
    )
    res: dict = {"cases": {}, "seconds": {}}
    full = _full_experts()
    try:
        for name, fn in CASES.items():
            if name not in cases:
                continue
            t0 = time.perf_counter()
            try:
                fn(rank, world, res, full)
                res["cases"][name] = "ok"
            except Exception:  # recorded for the parent; the group is out of step now
                res["cases"][name] = traceback.format_exc()
                break
            finally:
                res["seconds"][name] = round(time.perf_counter() - t0, 3)
    finally:
        with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
            json.dump(res, f)
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


_RESULTS: dict[tuple[int, str], list[dict]] = {}


def _run(world: int, tmp_dir: str, device: str = "cpu",
         cases: tuple[str, ...] = tuple(CASES)) -> list[dict]:  # fmt: skip
    if (world, device) not in _RESULTS:
        init = f"tcp://127.0.0.1:{_free_port()}"
        ctx = mp.start_processes(
            _worker, args=(world, init, tmp_dir, device, cases), nprocs=world, join=False,
            start_method="spawn",
        )  # fmt: skip
        deadline = time.monotonic() + JOIN_TIMEOUT_S
        try:
            while not ctx.join(timeout=1.0):
                if time.monotonic() > deadline:
                    raise AssertionError(f"world {world}: workers still running after timeout")
        finally:
            for p in ctx.processes:
                if p.is_alive():
                    p.terminate()
        out = []
        for r in range(world):
            with open(os.path.join(tmp_dir, f"rank{r}.json")) as f:
                out.append(json.load(f))
        _RESULTS[world, device] = out
    return _RESULTS[world, device]


@pytest.fixture(scope="module", params=[2, 4], ids=["world2", "world4"])
def ep_run(request, tmp_path_factory):
    world = request.param
    return world, _run(world, str(tmp_path_factory.mktemp(f"ep{world}")))


@pytest.mark.parametrize("case", list(CASES))
def test_ep_case(ep_run, case):
    world, results = ep_run
    bad = {}
    for r, res in enumerate(results):
        verdict = res["cases"].get(case, "not run (an earlier case failed on this rank)")
        if verdict != "ok":
            bad[r] = verdict
    assert not bad, f"world {world}, case {case}:\n" + "\n".join(
        f"rank {r}: {v}" for r, v in bad.items()
    )


def test_ep_dispatch_bytes(ep_run):
    """NVFP4 rows on the wire: > 3x fewer dispatch bytes than bf16 rows; e4m3 rows with
    one fp32 scale: 2H / (H + 4); the same combine in every mode."""
    _, results = ep_run
    tot = {m: sum(res["bytes"][m]["dispatch"] for res in results) for m in MODES}
    comb = {m: sum(res["bytes"][m]["combine"] for res in results) for m in MODES}
    assert tot["w4a16"] > 0
    for m in ("w4a4-token", "w4a4-static", "w4a4-tensor"):
        assert tot["w4a16"] / tot[m] > 3.0, (m, tot)
        assert comb[m] == comb["w4a16"]
    assert tot["w4a16"] / tot["w4a4-token"] == pytest.approx(2 * H / (H / 2 + H / 16 + 4))
    assert tot["w4a16"] / tot["w4a8"] == pytest.approx(2 * H / (H + 4))
    assert comb["w4a8"] == comb["w4a16"]


# ----------------------------------------------------------------------------- in-process


def test_wire_row_bytes():
    assert wire_row_bytes(7168, "w4a16") == 14336
    assert wire_row_bytes(7168, "w4a4", "per_token") == 3584 + 448 + 4
    assert wire_row_bytes(7168, "w4a4", "static") == 3584 + 448
    assert wire_row_bytes(7168, "w4a8") == 7168 + 4
    assert 14336 / wire_row_bytes(7168, "w4a4", "per_token") > 3.5


@pytest.mark.parametrize("mode", MODES)
def test_compute_route_rows_matches_reference(mode):
    """Rows in any order, padding rows included, give the reference route rows bit for bit."""
    from fp4moe.nvfp4 import global_from_amax, quantize_blocks
    from fp4moe.reference import route_rows_reference

    full = _full_experts()
    m, act = resolve_mode(mode)
    x = random_x(11, H, seed=3)
    ids = torch.stack([torch.randperm(E_TOTAL)[:K] for _ in range(11)]).to(torch.int32)
    y_ref = route_rows_reference(x, ids, full, mode=m, act_scale=act)
    order = torch.randperm(11 * K)
    tok, slot = order // K, order % K
    row_expert = torch.cat([ids[tok, slot].long(), torch.tensor([-1, -1])])
    xr = torch.cat([x[tok], torch.zeros(2, H, dtype=torch.bfloat16)])
    if m == "w4a16":
        rows = xr
    elif m == "w4a8":
        rows = E4M3Rows.quantize(xr)  # what the home rank sends
    else:
        if act == "per_token":
            g = global_from_amax(xr.abs().amax(dim=-1))
        elif act == "static":
            g = full.a13_scale[row_expert.clamp(min=0)]
        else:
            g = global_from_amax(x.abs().amax()).expand(xr.shape[0]).contiguous()
        c, s = quantize_blocks(xr, g)
        rows = fp4moe.NVFP4Tensor(c, s, g)
    y = compute_route_rows(rows, row_expert, full, mode=m, act_scale=act)
    _bitwise(y[: 11 * K], y_ref[tok, slot], f"{mode} route rows")


def test_w4a8_wire_rows_round_trip():
    """W4A8 rows packed as the home rank sends them (e4m3 bytes, then the fp32 scale) read
    back bit for bit; a zero row has scale 1."""
    from fp4moe.expert_rows import pack_rows, unpack_rows

    x = torch.cat([random_x(5, H, seed=4), torch.zeros(1, H, dtype=torch.bfloat16)])
    sent = E4M3Rows.quantize(x)
    wire = pack_rows([sent.values, sent.scales])
    assert wire.dtype == torch.uint8 and tuple(wire.shape) == (6, wire_row_bytes(H, "w4a8"))
    got = unpack_rows(wire, H, "w4a8")
    assert isinstance(got, E4M3Rows) and got.values.dtype == torch.float8_e4m3fn
    assert torch.equal(got.values.view(torch.uint8), sent.values.view(torch.uint8))
    assert torch.equal(got.scales, sent.scales) and float(got.scales[5]) == 1.0


def test_ep_needs_initialized_group():
    if dist.is_initialized():
        pytest.skip("a process group is already initialized in this process")
    full = _full_experts()
    with pytest.raises(RuntimeError, match="init_process_group"):
        EPMoELayer(full, gate_weight=_gate())


# the cases that make sense on one rank (the others need a second rank to disagree with)
ONE_RANK = ("router_modes", "fixed_capacity", "phase_inference", "shapes", "split_steps",
            "cuda_graph")  # fmt: skip


@pytest.mark.gpu
def test_ep_nccl_one_gpu(tmp_path):
    """NCCL at world size 1 on one GPU, the Triton backend: the collectives, both dispatch
    paths and the CUDA-graph replay of the fixed path, bitwise as the single-process
    layer (the two-GPU test below needs a machine with two)."""
    results = _run(1, str(tmp_path), device="cuda", cases=ONE_RANK)
    bad = {c: v for c in ONE_RANK if (v := results[0]["cases"].get(c, "not run")) != "ok"}
    assert not bad, "\n".join(f"{c}: {v}" for c, v in bad.items())
    assert results[0].get("graph") == ["w4a16", "w4a4-token", "w4a4-static"]


@pytest.mark.gpu
def test_ep_nccl_gpu(tmp_path):
    """Two GPUs, NCCL, the Triton backend: every case bitwise as the single-process layer
    (same GEMM tile configs at these sizes), and CUDA-graph replay of the fixed path."""
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 CUDA GPUs")
    results = _run(2, str(tmp_path), device="cuda")
    bad = {
        (r, case): v
        for r, res in enumerate(results)
        for case in CASES
        if (v := res["cases"].get(case, "not run")) != "ok"
    }
    assert not bad, "\n".join(f"rank {r}, {c}: {v}" for (r, c), v in bad.items())
    assert results[0].get("graph") == ["w4a16", "w4a4-token", "w4a4-static"]
