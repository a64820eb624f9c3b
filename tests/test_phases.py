"""PhaseConfig, PhasePolicy, serving_phase and MoELayer: precision by serving phase over one
prepared copy of the experts (the weights are shared, never copied or converted)."""

from __future__ import annotations

import dataclasses
import itertools

import pytest
import torch

import fp4moe
from fp4moe import MoELayer, PhaseConfig, PhasePolicy, PreparedExperts, RouterConfig
from fp4moe.moe import ACT_SCALES, MODES
from fp4moe.phases import PHASES, serving_phase
from testing import assert_close_moe, random_moe_weights, random_routes, random_x, rel_err

E, H, I, K = 8, 64, 32, 2  # noqa: E741 (the contract's names)
EXPERT_KEYS = ("w13_codes", "w13_scales", "w13_global", "w2_codes", "w2_scales", "w2_global",
               "a13_scale", "a2_scale")  # fmt: skip

# every accepted policy string -> (mode, act_scale, fused_finalize)
SPECS = {
    "w4a16": ("w4a16", "per_token", False),
    "w4a8": ("w4a8", "per_token", False),
    "w4a4-token": ("w4a4", "per_token", False),
    "w4a4-tensor": ("w4a4", "per_tensor", False),
    "w4a4-static": ("w4a4", "static", False),
}
SPECS.update({s + "+fused": (m, a, True) for s, (m, a, _) in list(SPECS.items())})


# ----------------------------------------------------------------------------- helpers


def _experts(e=E, *, seed=0, device="cpu", static=True) -> PreparedExperts:
    w13, w2 = random_moe_weights(e, H, I, seed=seed)
    # calibrated for random_x inputs (amax ~100 into FC1, up to ~1500 into FC2)
    scales = dict(a13_scale=torch.full((e,), 128 / 2688), a2_scale=2048 / 2688) if static else {}
    return fp4moe.prepare_experts(w13.to(device), w2.to(device), **scales)


def _gate(e_total=E, *, seed=1, device="cpu") -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(e_total, H, generator=g) / H**0.5).to(device)


def _x(t, *, seed, device="cpu") -> torch.Tensor:
    return random_x(t, H, seed=seed).to(device)


def _ref(x2d, ids, w, experts, cfg: PhaseConfig) -> torch.Tensor:
    return fp4moe.moe(
        x2d, ids, w, experts, mode=cfg.mode, act_scale=cfg.act_scale, backend="reference"
    )


def _expert_tensors(experts: PreparedExperts) -> dict[str, torch.Tensor]:
    out = {f.name: getattr(experts, f.name) for f in dataclasses.fields(experts)}
    return {k: v for k, v in out.items() if v is not None}


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().view(torch.uint8)


@pytest.fixture(scope="module", autouse=True)
def _one_cpu_thread():
    """These shapes are tiny: one intra-op thread is fastest, and several threads spinning
    against other work on a loaded machine made this file 20x slower."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def experts(device) -> PreparedExperts:
    """E=8 experts with calibrated static activation scales (every mode runs)."""
    return _experts(device=device)


@pytest.fixture(scope="module")
def gate(device) -> torch.Tensor:
    return _gate(device=device)


# ----------------------------------------------------------------------------- PhaseConfig


@pytest.mark.parametrize("spec", list(SPECS))
def test_phase_config_parse_and_str_round_trip(spec):
    cfg = PhaseConfig.parse(spec)
    assert (cfg.mode, cfg.act_scale, cfg.fused_finalize) == SPECS[spec]
    assert str(cfg) == spec
    assert PhaseConfig.parse(str(cfg)) == cfg
    assert PhaseConfig.parse(cfg) is cfg
    assert PhaseConfig(*SPECS[spec]) == cfg


@pytest.mark.parametrize(
    "mode,act_scale,fused",
    list(itertools.product(MODES, ACT_SCALES, (False, True))),
    ids=lambda v: str(v),
)
def test_phase_config_constructed_round_trips(mode, act_scale, fused):
    if mode != "w4a4" and act_scale != "per_token":  # W4A16, W4A8: no activation scale
        with pytest.raises(ValueError, match="act_scale"):
            PhaseConfig(mode, act_scale, fused)
        return
    cfg = PhaseConfig(mode, act_scale, fused)
    assert PhaseConfig.parse(str(cfg)) == cfg
    assert PhaseConfig(cfg.name, fused_finalize=fused) == cfg  # the mode name alone
    if mode == "w4a16":
        assert cfg == PhaseConfig("w4a16", fused_finalize=fused)


@pytest.mark.parametrize(
    "spec",
    ["", "w8a8", "W4A16", "W4A8", "w4a8-token", "w4a8+atomic", "w4a4", "w4a4-", "w4a4-row",
     "w4a4-per_token", "w4a16-token", "w4a16+atomic", "w4a4-token+fused+fused", "w4a4-token+",
     "w4a16+", " w4a16", "w4a16 ", "w4a4_token", "+fused"],
    ids=repr,
)  # fmt: skip
def test_phase_config_bad_string(spec):
    with pytest.raises(ValueError, match="policy"):
        PhaseConfig.parse(spec)


@pytest.mark.parametrize("spec", [None, 3, b"w4a16", ("w4a16",), {"mode": "w4a16"}], ids=repr)
def test_phase_config_bad_type(spec):
    with pytest.raises(TypeError, match="policy"):
        PhaseConfig.parse(spec)
    with pytest.raises(TypeError, match="policy"):
        PhasePolicy(prefill=spec)


@pytest.mark.parametrize(
    "kwargs,exc,field",
    [
        ({"mode": "w8a8"}, ValueError, "mode"),
        ({"mode": "W4A4"}, ValueError, "mode"),
        ({"mode": "w4a4", "act_scale": "per_row"}, ValueError, "act_scale"),
        ({"mode": "w4a16", "act_scale": "token"}, ValueError, "act_scale"),
        ({"mode": "w4a16", "act_scale": "static"}, ValueError, "act_scale"),
        ({"mode": "w4a4-token", "act_scale": "static"}, ValueError, "act_scale"),
        ({"mode": "w4a4-per_token"}, ValueError, "mode"),
        ({"mode": "w4a16", "fused_finalize": "yes"}, TypeError, "fused_finalize"),
    ],
    ids=["mode", "mode-case", "act_scale", "act_scale-w4a16", "static-w4a16",
         "name-contradicted", "old-name", "fused_finalize"],
)  # fmt: skip
def test_phase_config_bad_field(kwargs, exc, field):
    with pytest.raises(exc, match=field):
        PhaseConfig(**kwargs)


def test_phase_config_is_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        PhaseConfig().mode = "w4a4"


# ----------------------------------------------------------------------------- PhasePolicy


def test_policy_defaults():
    p = PhasePolicy()
    assert p.prefill == PhaseConfig("w4a4", "per_token") and str(p.prefill) == "w4a4-token"
    assert p.decode == PhaseConfig("w4a16") and str(p.decode) == "w4a16"
    assert p.decode_max_tokens == 64 and p.backend == "auto"
    assert PHASES == ("prefill", "decode")


def test_policy_parses_strings_and_configs():
    hopper = PhasePolicy(prefill="w4a8+fused", decode="w4a16")
    assert hopper.prefill == PhaseConfig("w4a8", fused_finalize=True) != PhaseConfig("w4a16")
    assert (hopper.prefill.mode, hopper.prefill.act_scale) == ("w4a8", "per_token")
    assert str(hopper.prefill) == "w4a8+fused" and hopper.prefill.name == "w4a8"
    p = PhasePolicy(prefill="w4a4-static+fused", decode=PhaseConfig("w4a4", "per_tensor"))
    assert p.prefill == PhaseConfig("w4a4", "static", True)
    assert p.decode == PhaseConfig("w4a4", "per_tensor")
    assert p == PhasePolicy(prefill=p.prefill, decode="w4a4-tensor")
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.decode = "w4a16"


def test_policy_single_and_coerce():
    s = PhasePolicy.single("w4a4-tensor", backend="reference")
    assert s.prefill == s.decode == PhaseConfig("w4a4", "per_tensor")
    assert s.backend == "reference" and s.decode_max_tokens == 64
    p = PhasePolicy(decode_max_tokens=3)
    assert PhasePolicy.coerce(p) is p
    assert PhasePolicy.coerce("w4a16+fused") == PhasePolicy.single("w4a16+fused")
    cfg = PhaseConfig("w4a4", "static")
    assert PhasePolicy.coerce(cfg) == PhasePolicy(prefill=cfg, decode=cfg)
    with pytest.raises(ValueError, match="policy"):
        PhasePolicy.coerce("fp8")
    with pytest.raises(TypeError, match="policy"):
        PhasePolicy.coerce(4)


def test_policy_explicit_phase_wins():
    p = PhasePolicy(decode_max_tokens=8)
    assert p.phase_of(1, "prefill") == "prefill" and p.select(1, "prefill") is p.prefill
    assert p.phase_of(10_000, "decode") == "decode" and p.select(10_000, "decode") is p.decode
    with serving_phase("decode"):
        assert p.phase_of(1, "prefill") == "prefill"


@pytest.mark.parametrize("threshold", [0, 1, 64, 300])
def test_policy_threshold_boundary(threshold):
    p = PhasePolicy(decode_max_tokens=threshold)
    assert p.phase_of(threshold) == "decode"  # T == threshold is decode
    assert p.select(threshold) is p.decode
    assert p.phase_of(threshold + 1) == "prefill"
    assert p.select(threshold + 1) is p.prefill
    assert p.phase_of(0) == "decode"


def test_serving_phase_context_nests_and_restores():
    p = PhasePolicy(decode_max_tokens=4)
    assert p.phase_of(2) == "decode" and p.phase_of(100) == "prefill"
    with serving_phase("prefill"):
        assert p.phase_of(2) == "prefill" and p.select(2) is p.prefill
        with serving_phase("decode"):
            assert p.phase_of(100) == "decode" and p.select(100) is p.decode
            with serving_phase(None):  # back to the threshold inside the block
                assert p.phase_of(2) == "decode" and p.phase_of(100) == "prefill"
            assert p.phase_of(2) == "decode"
        assert p.phase_of(100) == "prefill" and p.phase_of(2) == "prefill"
        with pytest.raises(RuntimeError), serving_phase("decode"):
            raise RuntimeError("boom")
        assert p.phase_of(2) == "prefill"  # restored after an exception too
    assert p.phase_of(2) == "decode" and p.phase_of(100) == "prefill"


@pytest.mark.parametrize("phase", ["train", "Prefill", "", 1], ids=repr)
def test_bad_phase(phase):
    p = PhasePolicy()
    with pytest.raises(ValueError, match="phase"):
        p.phase_of(4, phase)
    with pytest.raises(ValueError, match="phase"):
        p.select(4, phase)
    with pytest.raises(ValueError, match="phase"), serving_phase(phase):
        pass


@pytest.mark.parametrize(
    "kwargs,exc,field",
    [
        ({"backend": "cuda"}, ValueError, "backend"),
        ({"backend": None}, ValueError, "backend"),
        ({"decode_max_tokens": -1}, ValueError, "decode_max_tokens"),
        ({"decode_max_tokens": 2.0}, TypeError, "decode_max_tokens"),
        ({"decode_max_tokens": True}, TypeError, "decode_max_tokens"),
        ({"decode_max_tokens": "64"}, TypeError, "decode_max_tokens"),
    ],
    ids=["backend", "backend-none", "threshold-negative", "threshold-float", "threshold-bool",
         "threshold-str"],
)  # fmt: skip
def test_policy_bad_arguments(kwargs, exc, field):
    with pytest.raises(exc, match=field):
        PhasePolicy(**kwargs)


def test_policy_single_bad_backend():
    with pytest.raises(ValueError, match="backend"):
        PhasePolicy.single("w4a16", backend="cutlass")


# ----------------------------------------------------------------------------- MoELayer: numerics


@pytest.mark.parametrize("spec", list(SPECS))
def test_layer_equals_moe_reference(experts, gate, device, spec):
    """The layer's output is fp4moe.moe on fp32 router logits, bit for bit."""
    layer = MoELayer(experts, RouterConfig(top_k=K), gate_weight=gate,
                     policy=PhasePolicy.single(spec, backend="reference"))  # fmt: skip
    cfg = PhaseConfig.parse(spec)
    for t, phase in ((5, None), (70, None), (3, "prefill"), (90, "decode")):
        x = _x(t, seed=t, device=device)
        ids, w = fp4moe.route(x.float() @ gate.float().T, K, method="softmax")
        got_ids, got_w = layer.route(x)
        assert torch.equal(got_ids, ids) and torch.equal(got_w, w)
        assert got_ids.dtype == torch.int32 and got_w.dtype == torch.float32
        out = layer(x, phase)
        assert out.dtype == torch.bfloat16 and out.shape == x.shape
        assert torch.equal(out, _ref(x, ids, w, experts, cfg)), (t, phase)
        assert rel_err(out, _ref(x, ids, w, experts, PhaseConfig("w4a16"))) < 0.3  # sane


@pytest.mark.parametrize("prefill", ["w4a4-token", "w4a8"])
def test_layer_prefill_and_decode_run_their_own_config(experts, gate, device, prefill):
    policy = PhasePolicy(prefill=prefill, decode="w4a16", backend="reference")
    layer = MoELayer(experts, RouterConfig(top_k=K), gate_weight=gate, policy=policy)
    x = _x(12, seed=3, device=device)
    ids, w = layer.route(x)
    pre, dec = layer(x, "prefill"), layer(x, "decode")
    assert torch.equal(pre, _ref(x, ids, w, experts, policy.prefill))
    assert torch.equal(dec, _ref(x, ids, w, experts, policy.decode))
    assert not torch.equal(pre, dec)  # the phase really changed the mode
    assert rel_err(pre, dec) < 0.3  # same weights: only the activation precision differs
    with serving_phase("prefill"):
        assert torch.equal(layer(x), pre)
    assert torch.equal(layer(x), dec)  # 12 <= 64 tokens: decode


def test_layer_3d_input(experts, gate, device):
    layer = MoELayer(experts, RouterConfig(top_k=K), gate_weight=gate,
                     policy=PhasePolicy(backend="reference"))  # fmt: skip
    x = _x(2 * 7, seed=11, device=device)
    x3 = x.reshape(2, 7, H)
    for phase in PHASES:
        out3 = layer(x3, phase)
        assert out3.shape == (2, 7, H) and out3.dtype == torch.bfloat16
        assert torch.equal(out3.reshape(14, H), layer(x, phase))
    # a single token [H] keeps its shape too
    assert torch.equal(layer(x[0], "decode"), layer(x[:1], "decode")[0])


def test_layer_empty_batch(experts, gate, device):
    layer = MoELayer(experts, gate_weight=gate, policy=PhasePolicy(backend="reference"))
    out = layer(_x(0, seed=0, device=device).reshape(0, 3, H))
    assert out.shape == (0, 3, H) and out.dtype == torch.bfloat16


def test_layer_routes_path(experts, device):
    """Precomputed (ids, weights): no gate weight needed, masked routes allowed."""
    layer = MoELayer(experts, RouterConfig(top_k=3), policy=PhasePolicy(backend="reference"))
    assert layer.gate_weight is None
    x = _x(9, seed=4, device=device)
    ids, w = random_routes(9, 3, E, seed=4, masked_frac=0.3)
    ids, w = ids.to(device), w.to(device)
    for phase in PHASES:
        out = layer(x, phase, routes=(ids, w))
        assert torch.equal(out, _ref(x, ids, w, experts, getattr(layer.policy, phase)))
    with pytest.raises(ValueError, match="router_logits"):  # neither routes nor a gate
        layer(x)


@pytest.mark.parametrize(
    "router",
    [RouterConfig("softmax", 2), RouterConfig("softmax", 3, renormalize=False),
     RouterConfig("topk_softmax", 2)],
    ids=["softmax-renorm", "softmax-raw", "topk_softmax"],
)  # fmt: skip
def test_layer_router_logits_path(experts, device, router):
    layer = MoELayer(experts, router, policy=PhasePolicy(backend="reference"))
    x = _x(10, seed=5, device=device)
    g = torch.Generator().manual_seed(5)
    logits = torch.randn(10, E, generator=g).to(device)
    ids, w = fp4moe.route(logits, router.top_k, method=router.method,
                          renormalize=router.renormalize)  # fmt: skip
    got_ids, got_w = layer.route(x, logits)
    assert torch.equal(got_ids, ids) and torch.equal(got_w, w)
    out = layer(x, "prefill", router_logits=logits)
    assert torch.equal(out, _ref(x, ids, w, experts, layer.policy.prefill))
    # [B, S, E] logits with [B, S, H] tokens
    out3 = layer(x.reshape(2, 5, H), "prefill", router_logits=logits.reshape(2, 5, E))
    assert torch.equal(out3.reshape(10, H), out)
    # bf16 logits are fine (routing is done in fp32)
    layer(x, "decode", router_logits=logits.bfloat16())


def test_layer_router_logits_shape_errors(experts, gate, device):
    layer = MoELayer(experts, gate_weight=gate, policy=PhasePolicy(backend="reference"))
    x = _x(4, seed=0, device=device)
    for bad in (torch.zeros(4, E + 1), torch.zeros(3, E), torch.zeros(E)):
        with pytest.raises(ValueError, match="router_logits"):
            layer(x, router_logits=bad.to(device))
    with pytest.raises(TypeError, match="router_logits"):
        layer(x, router_logits=[[0.0] * E] * 4)
    assert layer.stats.calls == {"prefill": 0, "decode": 0}


def test_layer_sigmoid_grouped(experts, device):
    """DeepSeek-style routing: correction bias, groups, scaling factor."""
    router = RouterConfig("sigmoid_grouped", top_k=3, n_group=4, topk_group=2,
                          scaling_factor=2.5)  # fmt: skip
    gate = _gate(seed=7, device=device)
    bias = (torch.randn(E, generator=torch.Generator().manual_seed(8)) * 0.3).to(device)
    layer = MoELayer(experts, router, gate_weight=gate.bfloat16(), correction_bias=bias,
                     policy=PhasePolicy(backend="reference"))  # fmt: skip
    x = _x(40, seed=9, device=device)
    logits = x.float() @ gate.bfloat16().float().T
    ids, w = fp4moe.route(logits, 3, method="sigmoid_grouped", correction_bias=bias,
                          n_group=4, topk_group=2, scaling_factor=2.5)  # fmt: skip
    got_ids, got_w = layer.route(x)
    assert torch.equal(got_ids, ids) and torch.equal(got_w, w)
    # the bias changes the choice of experts, not only the weights
    plain, _ = fp4moe.route(logits, 3, method="sigmoid_grouped", n_group=4, topk_group=2,
                            scaling_factor=2.5)  # fmt: skip
    assert not torch.equal(plain, ids)
    # at most topk_group=2 groups of 2 experts a token
    assert ((ids.long() // 2).sort(dim=1).values.diff(dim=1) != 0).sum(dim=1).max() <= 1
    torch.testing.assert_close(w.sum(dim=1), torch.full_like(w[:, 0], 2.5))
    for phase in PHASES:
        out = layer(x, phase)
        assert torch.equal(out, _ref(x, ids, w, experts, getattr(layer.policy, phase)))
    assert set(layer.state_dict()) == {"gate_weight", "correction_bias", *EXPERT_KEYS}


@pytest.mark.parametrize("start", [0, 2, 4], ids=lambda s: f"experts{s}-{s + 3}")
def test_layer_expert_range_masks_other_experts(device, start):
    """A rank holding experts start..start+3 of 8 computes with local ids, others masked."""
    local = _experts(4, seed=start, device=device)
    gate = _gate(device=device)
    layer = MoELayer(local, RouterConfig(top_k=3), gate_weight=gate,
                     expert_range=(start, start + 4),
                     policy=PhasePolicy(backend="reference"))  # fmt: skip
    assert layer.num_experts_total == 8 and layer.expert_range == (start, start + 4)
    x = _x(30, seed=start + 1, device=device)
    gids, w = fp4moe.route(x.float() @ gate.float().T, 3, method="softmax")
    ids = fp4moe.local_expert_ids(gids, start, start + 4)
    got_ids, got_w = layer.route(x)
    assert torch.equal(got_ids, ids) and torch.equal(got_w, w)
    assert (ids < 0).any() and (ids >= 0).any() and int(ids.max()) < 4
    for phase in PHASES:
        out = layer(x, phase)
        assert torch.equal(out, _ref(x, ids, w, local, getattr(layer.policy, phase)))


def test_expert_parallel_ranks_add_up(device):
    """Two ranks of 4 experts add up to the 8-expert layer (within bf16 rounding)."""
    w13, w2 = random_moe_weights(8, H, I, seed=21)
    full = fp4moe.prepare_experts(w13.to(device), w2.to(device))
    halves = [fp4moe.prepare_experts(w13[s : s + 4].to(device), w2[s : s + 4].to(device))
              for s in (0, 4)]  # fmt: skip
    gate = _gate(seed=22, device=device)
    policy = PhasePolicy(prefill="w4a16", backend="reference")
    x = _x(24, seed=23, device=device)
    ref = MoELayer(full, RouterConfig(top_k=3), gate_weight=gate, policy=policy)(x)
    parts = [
        MoELayer(ex, RouterConfig(top_k=3), gate_weight=gate, policy=policy,
                 expert_range=(s, s + 4))(x)
        for ex, s in zip(halves, (0, 4), strict=True)
    ]  # fmt: skip
    total = parts[0].float() + parts[1].float()
    assert rel_err(total, ref.float()) < 1e-2


def test_expert_range_errors(device):
    ex = _experts(4, device=device, static=False)
    gate = _gate(device=device)
    for bad in ((0, 3), (6, 10), (-1, 3), (2, 4)):
        with pytest.raises(ValueError, match="expert_range"):
            MoELayer(ex, gate_weight=gate, expert_range=bad)
    with pytest.raises(ValueError, match="expert_range"):  # no gate: E_total is E
        MoELayer(ex, expert_range=(4, 8))


# ----------------------------------------------------------------------------- MoELayer: errors


@pytest.mark.parametrize("phase", PHASES)
def test_static_phase_needs_calibrated_scales(device, phase):
    plain = _experts(device=device, static=False)
    policy = PhasePolicy(**{phase: "w4a4-static"}, backend="reference")
    with pytest.raises(ValueError, match="a13_scale") as info:
        MoELayer(plain, policy=policy)
    assert phase in str(info.value) and "policy" in str(info.value)
    # W4A16 has no activation scale: PhaseConfig("w4a16", "static") is refused, not ignored
    with pytest.raises(ValueError, match="act_scale"):
        PhaseConfig("w4a16", "static")
    # experts swapped after construction: the call names act_scale and counts nothing
    layer = MoELayer(_experts(device=device), gate_weight=_gate(device=device), policy=policy)
    layer.experts = plain
    with pytest.raises(ValueError, match="act_scale"):
        layer(_x(3, seed=0, device=device), phase)
    assert layer.stats.calls == {"prefill": 0, "decode": 0}


def test_layer_bad_x(experts, gate, device):
    layer = MoELayer(experts, gate_weight=gate, policy=PhasePolicy(backend="reference"))
    x = _x(4, seed=0, device=device)
    for dtype in (torch.float32, torch.float16):
        with pytest.raises(TypeError, match=r"x: expected torch\.bfloat16"):
            layer(x.to(dtype))
    with pytest.raises(TypeError, match="x"):
        layer(x.tolist())
    with pytest.raises(ValueError, match="x: expected"):  # hidden size of another model
        layer(torch.zeros(4, H + 32, dtype=torch.bfloat16, device=device))
    with pytest.raises(ValueError, match="x: expected"):
        layer(torch.zeros((), dtype=torch.bfloat16, device=device))
    assert layer.stats.calls == {"prefill": 0, "decode": 0}


def test_layer_bad_gate_weight(experts):
    for bad in (torch.zeros(E, H + 32), torch.zeros(E * H), torch.zeros(2, E, H)):
        with pytest.raises(ValueError, match="gate_weight"):
            MoELayer(experts, gate_weight=bad.to(experts.device))
    with pytest.raises(TypeError, match="gate_weight"):
        MoELayer(experts, gate_weight=[[0.0] * H] * E)


@pytest.mark.parametrize("bad", [None, "experts.safetensors", {"w13_codes": torch.zeros(1)}],
                         ids=["none", "path", "dict"])  # fmt: skip
def test_layer_experts_must_be_prepared(bad):
    with pytest.raises(TypeError, match="experts"):
        MoELayer(bad)


def test_layer_bad_router_and_policy(experts, gate):
    with pytest.raises(TypeError, match="router"):
        MoELayer(experts, {"method": "softmax"})
    with pytest.raises(ValueError, match="policy"):
        MoELayer(experts, policy="w8a8")
    with pytest.raises(TypeError, match="policy"):
        MoELayer(experts, policy=8)
    with pytest.raises(ValueError, match="correction_bias"):  # would be silently ignored
        MoELayer(experts, gate_weight=gate, correction_bias=torch.zeros(E).to(gate.device))
    layer = MoELayer(experts, RouterConfig("sigmoid_grouped", 2), gate_weight=gate,
                     correction_bias=torch.zeros(E + 1).to(gate.device))  # fmt: skip
    with pytest.raises(ValueError, match="correction_bias"):  # wrong length, caught by route
        layer.route(_x(2, seed=0, device=gate.device))


@pytest.mark.parametrize(
    "kwargs,field",
    [
        ({"method": "top2"}, "method"),
        ({"top_k": 0}, "top_k"),
        ({"top_k": True}, "top_k"),
        ({"n_group": 2}, "n_group"),
        ({"topk_group": 2}, "topk_group"),
        ({"scaling_factor": 2.5}, "scaling_factor"),
    ],
    ids=["method", "top_k-zero", "top_k-bool", "n_group-softmax", "topk_group-softmax",
         "scaling-softmax"],
)  # fmt: skip
def test_router_config_errors(kwargs, field):
    with pytest.raises(ValueError, match=field):
        RouterConfig(**kwargs)


# ----------------------------------------------------------------------------- one copy of weights


def test_phase_switches_never_touch_the_weights(experts, gate, device):
    """prefill (W4A4 per-token) -> decode (W4A16) -> prefill: same storage, same bits."""
    layer = MoELayer(experts, RouterConfig(top_k=K), gate_weight=gate,
                     policy=PhasePolicy(backend="reference"))  # fmt: skip
    before = {k: (v.data_ptr(), _bits(v).clone()) for k, v in _expert_tensors(experts).items()}
    assert set(before) >= {"w13_codes", "w13_scales", "w13_global", "w2_codes", "w2_scales",
                           "w2_global", "a13_scale", "a2_scale"}  # fmt: skip

    def check():
        assert layer.experts is experts
        now = _expert_tensors(layer.experts)
        assert set(now) == set(before)
        for k, (ptr, bits) in before.items():
            assert now[k].data_ptr() == ptr, f"{k} was reallocated"
            assert torch.equal(_bits(now[k]), bits), f"{k} changed"

    xp, xd = _x(80, seed=1, device=device), _x(4, seed=2, device=device)
    first = layer(xp)  # 80 > 64 tokens: prefill
    check()
    layer(xd)  # decode
    check()
    again = layer(xp, "prefill")
    check()
    assert torch.equal(first, again)
    assert layer.stats.calls == {"prefill": 2, "decode": 1}


def test_state_dict_holds_the_expert_tensors_themselves(experts, gate):
    layer = MoELayer(experts, gate_weight=gate)
    sd = layer.state_dict()
    assert set(sd) == {"gate_weight", *EXPERT_KEYS}
    assert not list(layer.parameters())
    # the expert entries are the prepared tensors (no copy); the router is the layer's own
    for k, t in _expert_tensors(experts).items():
        assert sd[k].data_ptr() == t.data_ptr() and sd[k].dtype == t.dtype, k
    assert sd["gate_weight"].dtype == torch.float32 and torch.equal(sd["gate_weight"], gate)
    assert sd["gate_weight"].data_ptr() != gate.data_ptr()
    # loading a state dict copies into the buffers: a round trip through another layer
    other = MoELayer(_experts(seed=5), gate_weight=torch.zeros_like(gate))
    other.load_state_dict(sd)
    for k, t in _expert_tensors(experts).items():
        assert torch.equal(_bits(getattr(other.experts, k)), _bits(t)), k
    assert torch.equal(other.gate_weight, gate)
    with pytest.raises(RuntimeError, match="w13_codes"):
        other.load_state_dict({k: v for k, v in sd.items() if k != "w13_codes"})


def test_layer_moves_with_the_module(experts, gate):
    """.to(device) moves the experts (meta: the one other device every machine has);
    layer.experts follows, and the layer refuses experts of another shape."""
    layer = MoELayer(experts, gate_weight=gate)
    moved = layer.to("meta")
    assert moved is layer and layer.experts.device.type == "meta"
    assert all(t.device.type == "meta" for t in _expert_tensors(layer.experts).values())
    for f in ("w13_scales", "w2_scales"):  # rows still 16 bytes apart (a move copies them)
        assert getattr(layer, f).stride(1) == 16 == getattr(experts, f).stride(1), f
    assert layer.gate_weight.device.type == "meta"
    assert experts.device.type == "cpu"  # the caller's object is not changed
    layer.to_empty(device="cpu")
    assert layer.experts.device.type == "cpu"
    layer.experts = experts  # assigning replaces the buffers
    assert layer.experts is experts and layer.w13_codes is experts.w13_codes
    with pytest.raises(ValueError, match="experts"):
        layer.experts = _experts(4)
    with pytest.raises(TypeError, match="experts"):
        layer.experts = experts.to_linear()


def test_module_to_dtype_leaves_experts_alone(experts, gate, device):
    """model.to(torch.bfloat16) (usual for HF models) converts the router, not the experts."""
    layer = MoELayer(experts, RouterConfig(top_k=K), gate_weight=gate,
                     policy=PhasePolicy(backend="reference"))  # fmt: skip
    before = {k: (v.data_ptr(), v.dtype) for k, v in _expert_tensors(experts).items()}
    layer.to(torch.bfloat16)
    assert layer.gate_weight.dtype == torch.bfloat16
    x = _x(6, seed=6, device=device)
    ids, w = fp4moe.route(x.float() @ gate.bfloat16().float().T, K, method="softmax")
    assert torch.equal(layer(x, "prefill"), _ref(x, ids, w, experts, layer.policy.prefill))
    now = _expert_tensors(layer.experts)
    assert {k: (v.data_ptr(), v.dtype) for k, v in now.items()} == before


def test_layers_with_different_policies_share_storage(experts, gate):
    a = MoELayer(experts, gate_weight=gate, policy="w4a16")
    b = MoELayer(experts, gate_weight=gate, policy=PhasePolicy(prefill="w4a4-static+fused",
                                                               decode="w4a4-tensor"))  # fmt: skip
    assert a.policy != b.policy
    assert a.experts is b.experts is experts
    ta, tb = _expert_tensors(a.experts), _expert_tensors(b.experts)
    assert {k: v.data_ptr() for k, v in ta.items()} == {k: v.data_ptr() for k, v in tb.items()}
    assert a.gate_weight.data_ptr() != b.gate_weight.data_ptr()  # routers are per layer


def test_memory_report(experts, gate):
    layer = MoELayer(experts, gate_weight=gate)
    rep = layer.memory_report()
    assert rep["expert_bytes"] == experts.nbytes()
    assert rep["copies_of_expert_weights"] == 1
    assert rep["bf16_expert_bytes"] == E * 3 * H * I * 2
    assert rep["router_bytes"] == E * H * 4
    assert 3 * rep["expert_bytes"] < rep["bf16_expert_bytes"]  # NVFP4: ~4.5 bits a weight
    # codes (half a byte a weight) and block scales (one byte per 16) dominate
    assert rep["expert_bytes"] >= E * 3 * H * I * (1 / 2 + 1 / 16)
    bias = MoELayer(experts, RouterConfig("sigmoid_grouped"), gate_weight=gate,
                    correction_bias=torch.zeros(E).to(gate.device)).memory_report()  # fmt: skip
    assert bias["router_bytes"] == E * H * 4 + E * 4
    assert bias["expert_bytes"] == rep["expert_bytes"]


# ----------------------------------------------------------------------------- stats, repr


def test_stats_count_calls_and_tokens_per_phase(experts, gate, device):
    layer = MoELayer(experts, gate_weight=gate,
                     policy=PhasePolicy(decode_max_tokens=8, backend="reference"))  # fmt: skip
    assert layer.stats.calls == {"prefill": 0, "decode": 0}
    assert layer.stats.tokens == {"prefill": 0, "decode": 0}
    layer(_x(20, seed=1, device=device))  # threshold: prefill
    layer(_x(8, seed=2, device=device))  # T == threshold: decode
    layer(_x(3, seed=3, device=device).reshape(1, 3, H))
    with serving_phase("prefill"):
        layer(_x(2, seed=4, device=device))
        layer(_x(5, seed=5, device=device), "decode")  # explicit phase beats the context
    with serving_phase("decode"):
        layer(_x(30, seed=6, device=device))
    assert layer.stats.calls == {"prefill": 2, "decode": 4}
    assert layer.stats.tokens == {"prefill": 22, "decode": 46}
    other = MoELayer(experts, gate_weight=gate)  # counters are per layer
    assert other.stats.calls == {"prefill": 0, "decode": 0}


def test_repr_names_the_policy(experts):
    text = repr(MoELayer(experts, RouterConfig(top_k=K), policy=PhasePolicy(decode="w4a4-tensor")))
    assert "prefill=w4a4-token" in text and "decode=w4a4-tensor" in text
    assert f"experts={E} of {E}" in text and "top2" in text


# ----------------------------------------------------------------------------- GPU


@pytest.mark.gpu
def test_phase_switching_keeps_gpu_memory_flat():
    """DeepSeek-like layer on CUDA, alternating prefill (T=256) and decode (T=4) ten times:
    no memory growth, no second copy of the experts, finite outputs."""
    e, h, i, k = 8, 2048, 512, 2
    w13, w2 = random_moe_weights(e, h, i, seed=0)
    experts = fp4moe.prepare_experts(w13.cuda(), w2.cuda())
    del w13, w2
    g = torch.Generator().manual_seed(1)
    gate = (torch.randn(e, h, generator=g) / h**0.5).cuda()
    layer = MoELayer(experts, RouterConfig(top_k=k), gate_weight=gate)  # backend auto: Triton
    xs = {"prefill": random_x(256, h, seed=2).cuda(), "decode": random_x(4, h, seed=3).cuda()}
    ptrs = {n: t.data_ptr() for n, t in _expert_tensors(experts).items()}

    for phase, x in xs.items():  # warm-up round (compiles, caches workspaces)
        out = layer(x, phase)
        cfg = getattr(layer.policy, phase)
        ids, w = layer.route(x)
        assert_close_moe(out, _ref(x, ids, w, experts, cfg), cfg.mode, what=phase)
        del out, ids, w
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    slack = 1 << 20  # 1 MiB; one more copy of the experts would be ~14 MiB
    assert experts.nbytes() > 8 * slack

    for step in range(10):
        for phase, x in xs.items():
            out = layer(x, phase)
            assert bool(torch.isfinite(out).all()), (step, phase)
            del out
            torch.cuda.synchronize()
            mem = torch.cuda.memory_allocated()
            assert abs(mem - base) <= slack, f"step {step} {phase}: {mem - base:+d} bytes"
    assert {n: t.data_ptr() for n, t in _expert_tensors(experts).items()} == ptrs
    assert layer.stats.calls == {"prefill": 11, "decode": 11}
    assert layer.stats.tokens == {"prefill": 11 * 256, "decode": 11 * 4}


def test_memory_report_workspaces():
    """Workspace bytes are reported per phase, from the planner's plans, and grow with the
    tokens of a call."""
    from fp4moe.backend import H200, plan_call, workspace_bytes

    g = torch.Generator().manual_seed(0)
    ex = fp4moe.prepare_experts(
        torch.randn(4, 64, 64, generator=g), torch.randn(4, 64, 32, generator=g)
    )
    layer = fp4moe.MoELayer(ex, fp4moe.RouterConfig("softmax", 2), gate_weight=torch.randn(4, 64))
    rep = layer.memory_report(num_tokens=512)
    assert rep["prefill_workspace_tokens"] == 512
    assert rep["decode_workspace_tokens"] == layer.policy.decode_max_tokens
    # the layer holds every expert: every route valid, so 512 tokens (256 rows an expert)
    # take the decoded-weights path, whose bf16 weights the report counts
    opt = layer.triton_options
    assert opt.valid_fraction == 1.0

    def ws(t, mode, **kw):
        return workspace_bytes(plan_call(t, 2, 4, 64, 32, mode=mode, target=H200, **kw))

    prefill = ws(512, "w4a4", options=opt)
    assert plan_call(512, 2, 4, 64, 32, options=opt, target=H200).fc1.kernel == "triton-dense"
    assert rep["prefill_workspace_bytes"] == prefill > ws(512, "w4a4")
    assert rep["decode_workspace_bytes"] == ws(64, "w4a16", options=opt)
    # holding 4 of 32 experts (expert parallelism by masking): 1/8 of the routes valid
    ep = fp4moe.MoELayer(ex, fp4moe.RouterConfig("softmax", 2), gate_weight=torch.randn(32, 64),
                         expert_range=(8, 12))  # fmt: skip
    assert ep.triton_options.valid_fraction == 4 / 32
    assert ws(1024, "w4a16") > ws(512, "w4a16")
    # a W4A8 prefill: its own plan's workspace
    hopper = fp4moe.MoELayer(ex, fp4moe.RouterConfig("softmax", 2), gate_weight=torch.randn(4, 64),
                             policy=PhasePolicy(prefill="w4a8", decode="w4a16"))  # fmt: skip
    rep8 = hopper.memory_report(num_tokens=512)
    assert rep8["prefill_workspace_bytes"] == ws(512, "w4a8", options=opt) > 0
    assert rep8["decode_workspace_bytes"] == rep["decode_workspace_bytes"]


@pytest.mark.gpu
def test_workspace_estimate_matches_cuda_allocations():
    """The estimate is within 25 % of the peak extra memory of one Triton call."""
    from fp4moe.backend import workspace_bytes
    from fp4moe.backend.launch import moe_triton

    e, h, i, t, k = 8, 2048, 512, 1024, 4
    g = torch.Generator(device="cuda").manual_seed(0)
    ex = fp4moe.prepare_experts(
        torch.randn(e, 2 * i, h, device="cuda", generator=g) * 0.05,
        torch.randn(e, h, i, device="cuda", generator=g) * 0.05,
    )
    x = torch.randn(t, h, device="cuda", generator=g).to(torch.bfloat16)
    ids = torch.stack([torch.randperm(e, device="cuda")[:k] for _ in range(t)]).to(torch.int32)
    w = torch.rand(t, k, device="cuda")
    for mode in ("w4a16", "w4a4"):
        moe_triton(x, ids, w, ex, mode=mode)  # compile
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        moe_triton(x, ids, w, ex, mode=mode)
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - base
        est = workspace_bytes(fp4moe.plan(ex, t, k, mode=mode))
        assert 0.75 * peak <= est <= 1.25 * peak, (mode, est, peak)
