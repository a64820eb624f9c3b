"""The transformer behind ``fp4moe demo``: a small MoE model generating with a phase policy.

A transformers MoE model (by default Qwen3-MoE, the architecture of Qwen3-30B-A3B, scaled
down, with random weights from a fixed seed) is converted once with
:func:`fp4moe.integrations.hf.convert`: every MoE block gets one prepared NVFP4 copy of its
experts. ``model.generate`` then runs greedily; the phase hooks installed by ``convert``
make the prompt pass prefill (W4A4 per-token by default) and every later step decode
(W4A16). For each phase the demo reports the tokens, the time in the model's forward calls,
and the agreement of the logits with the bf16 model, run teacher-forced on the same
generated sequences (relative error of the logits, top-1 agreement); then the bytes of the
expert weights, one copy for both phases, against two separate copies.

``fp4moe demo --disaggregated`` runs ``examples/disaggregated.py`` of the repository
(prefill and decode in two processes opening the same prepared expert files).

Needs transformers 5.x (``pip install -e ".[test]"`` installs it).
"""

from __future__ import annotations

import copy
import importlib
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from .integrations.hf_blocks import find_blocks
from .integrations.hf_load import dequantized_model, load_model, load_model_config
from .modes import relative_error
from .phases import PHASES, MoELayer, PhasePolicy

__all__ = [
    "ModelDemoConfig",
    "ModelDemoResult",
    "NotEnoughMemory",
    "available_bytes",
    "default_model_config",
    "demo_memory",
    "load_model_config",
    "render_disaggregated",
    "render_model_demo",
    "run_disaggregated",
    "run_model_demo",
]

# Where the default model comes from, for the report.
DEFAULT_MODEL = "the Qwen3-30B-A3B architecture scaled down"


def default_model_config():
    """The default demo model: transformers' Qwen3-MoE, scaled down.

    Qwen3-30B-A3B has 48 layers, H=2048, 128 experts (top-8) of I=768 and a 151936-token
    vocabulary; this one has 4 layers, H=256, 16 experts (top-2) of I=128 and 1024 tokens,
    the same code and routing (softmax top-k, renormalized)."""
    from transformers import Qwen3MoeConfig

    return Qwen3MoeConfig(
        vocab_size=1024, hidden_size=256, intermediate_size=512, moe_intermediate_size=128,
        num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
        num_experts=16, num_experts_per_tok=2, norm_topk_prob=True, decoder_sparse_step=1,
        max_position_embeddings=1024, tie_word_embeddings=False,
    )  # fmt: skip


@dataclass(frozen=True)
class ModelDemoConfig:
    """Settings of the transformer demo.

    model_config: None (the default model), a path (config.json or its directory) or a
        transformers config object. checkpoint: a local HF checkpoint directory (config.json
        plus safetensors) whose experts are NVFP4 (ModelOpt or compressed-tensors); its
        other weights are read as they are (bf16, or NVFP4 linears decoded to bf16).
    """

    model_config: Any = None
    checkpoint: str | None = None
    batch: int = 2
    prompt_len: int = 16
    new_tokens: int = 8
    seed: int = 0
    device: str = "cpu"
    backend: str = "auto"
    prefill: str = "w4a4-token"
    decode: str = "w4a16"

    def __post_init__(self) -> None:
        for name in ("batch", "prompt_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: expected at least 1, got {getattr(self, name)}")
        if self.new_tokens < 2:
            raise ValueError(
                f"new_tokens: expected at least 2 (one from prefill, then decode), "
                f"got {self.new_tokens}"
            )
        if self.model_config is not None and self.checkpoint is not None:
            raise ValueError("model_config and checkpoint: give one (a checkpoint has its config)")
        self.policy()  # parse the modes now

    def policy(self) -> PhasePolicy:
        return PhasePolicy(prefill=self.prefill, decode=self.decode, backend=self.backend)


@dataclass
class ModelDemoResult:
    config: ModelDemoConfig
    model: dict = field(default_factory=dict)  # what ran: architecture, sizes, source
    reference: str = ""
    backend: str = ""
    prepare_s: float = 0.0
    generate_s: float = 0.0
    rows: list[dict] = field(default_factory=list)  # one a phase
    memory: dict = field(default_factory=dict)
    shared_storage: dict = field(default_factory=dict)
    tokens: list[list[int]] = field(default_factory=list)  # prompt + generated, a sequence
    notes: list[str] = field(default_factory=list)
    seconds: float = 0.0

    def row(self, phase: str) -> dict:
        return next(r for r in self.rows if r["phase"] == phase)

    def to_json(self) -> dict:
        import transformers

        cfg = dict(self.config.__dict__)
        mc = cfg["model_config"]
        if isinstance(mc, os.PathLike):
            cfg["model_config"] = os.fspath(mc)
        elif mc is not None and not isinstance(mc, str):
            cfg["model_config"] = mc.to_dict()
        return {
            "config": cfg,
            "model": self.model,
            "reference": self.reference,
            "backend": self.backend,
            "prepare_s": self.prepare_s,
            "generate_s": self.generate_s,
            "phases": self.rows,
            "memory": self.memory,
            "shared_storage": self.shared_storage,
            "tokens": self.tokens,
            "notes": self.notes,
            "seconds": self.seconds,
            "torch": torch.__version__,
            "transformers": transformers.__version__,
        }


# ------------------------------------------------------------------------------ the models


def _build(config, seed: int) -> nn.Module:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config).to(torch.bfloat16).eval()


class NotEnoughMemory(ValueError):
    """The demo would need more memory than the machine has available (nothing was built)."""


def demo_memory(config, *, checkpoint: str | None = None) -> dict[str, int]:
    """Bytes the demo holds at once, from the model's shapes alone (the model is built on
    the meta device: nothing is allocated; an unsupported MoE block is refused here).

    Random weights: the bf16 model, its bf16 copy (the reference) and the NVFP4 experts.
    A checkpoint: the loaded model (dense weights in bf16, NVFP4 experts) and the reference
    (the same dense tensors, the experts decoded to bf16)."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    blocks = tuple(f"{name}.experts." for name, _ in find_blocks(model))
    expert = dense = 0
    for name, p in model.named_parameters():
        if name.startswith(blocks):
            expert += p.numel()
        else:
            dense += p.numel()
    del model
    nvfp4 = expert * 9 // 16  # 4 bits a weight and one e4m3 scale per 16 weights
    bf16_model = 2 * (dense + expert)
    if checkpoint is not None:
        parts = {"dense_bf16": 2 * dense, "experts_nvfp4": nvfp4,
                 "reference_experts_bf16": 2 * expert}  # fmt: skip
    else:
        parts = {"model_bf16": bf16_model, "reference_bf16": bf16_model, "experts_nvfp4": nvfp4}
    return {"total": sum(parts.values()), **parts}


def available_bytes(device: torch.device) -> int:
    """Memory available for new allocations on ``device`` (a CUDA device's free memory;
    the host's MemAvailable, or its physical memory where /proc is not there)."""
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def check_memory(needed: dict[str, int], device: torch.device) -> None:
    """Raise :class:`NotEnoughMemory`, saying how much is needed and for what, when
    ``needed["total"]`` exceeds what ``device`` has available."""
    have = available_bytes(device)
    if needed["total"] > have:
        parts = ", ".join(
            f"{k.replace('_', ' ')} {_gib(v)}" for k, v in needed.items() if k != "total"
        )
        raise NotEnoughMemory(
            f"this model needs about {_gib(needed['total'])} ({needed['total']} bytes: {parts}) "
            f"on {device}, which has {_gib(have)} available; nothing was built (a smaller "
            "--model-config, or a machine with more memory)"
        )


def _gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB"


def _describe(
    model: nn.Module, reference: nn.Module, layers: dict[str, MoELayer], source: str
) -> dict:
    cfg = model.config
    first = next(iter(layers.values()))
    ex = first.experts
    return {
        "source": source,
        "model_type": cfg.model_type,
        "class": type(model).__name__,
        "layers": int(cfg.num_hidden_layers),
        "moe_layers": len(layers),
        "hidden_size": ex.hidden_size,
        "experts": ex.num_experts,
        "top_k": first.router.top_k,
        "router": first.router.method,
        "expert_intermediate_size": ex.intermediate_size,
        "vocab_size": int(cfg.vocab_size),
        # Of the unconverted model: the converted one holds its experts outside parameters.
        "parameters": sum(p.numel() for p in reference.parameters()),
    }


# ------------------------------------------------------------------------------ the run


def _parameters(fn) -> set[str]:
    import inspect

    try:
        return set(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        return set()


class _Recorder:
    """Hooks on the converted model: per forward call, its phase (from the MoE layers'
    counters), wall time, input length, and logits."""

    def __init__(self, model: nn.Module, layer: MoELayer, device: torch.device) -> None:
        self.layer, self.device = layer, device
        self.calls: list[dict] = []
        self._t0 = 0.0
        self._before: dict[str, int] = {}
        self._n_in = 0
        self.handles = [
            model.register_forward_pre_hook(self.before, with_kwargs=True),
            model.register_forward_hook(self.after),
        ]

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def before(self, module, args, kwargs) -> None:
        ids = kwargs.get("input_ids", args[0] if args else None)
        self._n_in = int(ids.shape[-1]) if isinstance(ids, torch.Tensor) else 0
        self._before = dict(self.layer.stats.calls)
        self._sync()
        self._t0 = time.perf_counter()

    def after(self, module, args, output) -> None:
        self._sync()
        seconds = time.perf_counter() - self._t0
        ran = [p for p in PHASES if self.layer.stats.calls[p] > self._before[p]]
        if len(ran) != 1:
            raise AssertionError(f"a forward call ran MoE phases {ran}, expected exactly one")
        self.calls.append(
            {"phase": ran[0], "seconds": seconds, "n_in": self._n_in, "logits": output.logits}
        )

    def remove(self) -> None:
        for h in self.handles:
            h.remove()


def _storage(layers: dict[str, MoELayer]) -> dict[str, tuple]:
    return {
        name: (
            id(layer.experts),
            {k: (v.data_ptr(), tuple(v.shape)) for k, v in layer.experts.tensors().items()},
        )
        for name, layer in layers.items()
    }


def _agreement(logits: torch.Tensor, ref: torch.Tensor) -> tuple[float, int, int]:
    """(relative Frobenius error, top-1 matches, positions) of logits [N, V] vs ref [N, V]."""
    same = int((logits.argmax(-1) == ref.argmax(-1)).sum())
    return relative_error(logits, ref), same, int(logits.shape[0])


@torch.no_grad()
def run_model_demo(cfg: ModelDemoConfig) -> ModelDemoResult:
    """Convert once, generate with the phase policy, compare with bf16 (``fp4moe demo``)."""
    from transformers import GenerationConfig

    from .integrations.hf import convert, moe_layers

    start = time.perf_counter()
    device = torch.device(cfg.device)
    res = ModelDemoResult(config=cfg)
    policy = cfg.policy()

    if cfg.checkpoint is not None:
        config = load_model_config(cfg.checkpoint)
        source = f"checkpoint {cfg.checkpoint}"
    elif cfg.model_config is None:
        config, source = default_model_config(), DEFAULT_MODEL
    elif isinstance(cfg.model_config, (str, os.PathLike)):
        config, source = load_model_config(cfg.model_config), f"config {cfg.model_config}"
    else:
        config, source = cfg.model_config, "config object"
    check_memory(demo_memory(config, checkpoint=cfg.checkpoint), device)

    t0 = time.perf_counter()
    if cfg.checkpoint is not None:
        model = load_model(cfg.checkpoint, policy=cfg.policy(), device=device)
        res.prepare_s = time.perf_counter() - t0
        reference = dequantized_model(model)  # the checkpoint's experts, decoded
        res.reference = (
            "the same model in bf16 with the checkpoint's NVFP4 experts decoded to bf16 "
            "(unconverted MoE blocks)"
        )
    else:
        source += f", random weights (seed {cfg.seed})"
        model = _build(config, cfg.seed).to(device)
        reference = copy.deepcopy(model)  # the bf16 model: unconverted
        t0 = time.perf_counter()
        convert(model, cfg.policy())
        res.prepare_s = time.perf_counter() - t0
        res.reference = "the same model in bf16 before conversion (unquantized experts)"
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    layers = moe_layers(model)
    res.model = _describe(model, reference, layers, source)
    res.backend = (
        policy.backend
        if policy.backend != "auto"
        else "triton"
        if device.type == "cuda"
        else "reference"
    )

    # One copy for both phases: remember what every layer holds, check it after generating.
    before = _storage(layers)
    snapshot = {n: layer.experts.to_linear() for n, layer in layers.items()}

    g = torch.Generator().manual_seed(cfg.seed + 1)
    vocab = int(model.config.vocab_size)
    prompt = torch.randint(0, vocab, (cfg.batch, cfg.prompt_len), generator=g).to(device)
    # All logits of the prompt pass too (generate keeps only the last by default).
    keep = {"logits_to_keep": 0} if "logits_to_keep" in _parameters(model.forward) else {}

    def generate(new_tokens: int) -> torch.Tensor:
        gen = GenerationConfig(
            max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
            eos_token_id=None, pad_token_id=0,
        )  # fmt: skip
        mask = torch.ones_like(prompt)
        return model.generate(prompt, attention_mask=mask, generation_config=gen, **keep)

    # A short warm-up generate (one prefill and one decode call) first: on a GPU the first
    # calls compile the Triton kernels, which is not the speed of either phase.
    generate(2)
    stats0 = {n: (dict(layer.stats.calls), dict(layer.stats.tokens)) for n, layer in layers.items()}
    rec = _Recorder(model, next(iter(layers.values())), device)
    try:
        t0 = time.perf_counter()
        out = generate(cfg.new_tokens)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        res.generate_s = time.perf_counter() - t0
    finally:
        rec.remove()
    if out.shape[1] != cfg.prompt_len + cfg.new_tokens:
        raise AssertionError(f"generate returned {out.shape[1] - cfg.prompt_len} new tokens")
    res.tokens = out.cpu().tolist()

    # Teacher-forced bf16 reference on the generated sequences: logits of every position.
    ref_logits = reference(out[:, :-1]).logits  # [B, S + N - 1, V]
    pos = 0
    per_phase: dict[str, dict[str, Any]] = {
        p: {"calls": 0, "seconds": 0.0, "tokens": 0, "ours": [], "ref": []} for p in PHASES
    }
    for call in rec.calls:
        lg = call["logits"]
        n_out = lg.shape[1]
        first = pos + call["n_in"] - n_out
        acc = per_phase[call["phase"]]
        acc["calls"] += 1
        acc["seconds"] += call["seconds"]
        acc["tokens"] += call["n_in"] * cfg.batch
        acc["ours"].append(lg.reshape(-1, lg.shape[-1]))
        acc["ref"].append(ref_logits[:, first : first + n_out].reshape(-1, lg.shape[-1]))
        pos += call["n_in"]
    if pos != ref_logits.shape[1]:
        raise AssertionError(
            f"the forward calls fed {pos} positions, expected {ref_logits.shape[1]}"
        )

    for phase in PHASES:
        acc = per_phase[phase]
        pc = getattr(policy, phase)
        row = {"phase": phase, "mode": str(pc), "calls": acc["calls"], "tokens": acc["tokens"],
               "seconds": acc["seconds"]}  # fmt: skip
        row["tokens_per_s"] = acc["tokens"] / acc["seconds"] if acc["seconds"] > 0 else 0.0
        if acc["ours"]:
            rel, same, n = _agreement(torch.cat(acc["ours"]), torch.cat(acc["ref"]))
            row.update(logit_rel_error=rel, top1_agreement=same / n, top1_matches=same, positions=n)
        else:
            row.update(logit_rel_error=None, top1_agreement=None, top1_matches=0, positions=0)
        row["moe_layer_calls"] = {
            n: layer.stats.calls[phase] - stats0[n][0][phase] for n, layer in layers.items()
        }
        row["moe_layer_tokens"] = {
            n: layer.stats.tokens[phase] - stats0[n][1][phase] for n, layer in layers.items()
        }
        res.rows.append(row)

    # The phases shared one copy of the expert weights in every layer.
    after = _storage(layers)
    if after != before:
        raise AssertionError("the prepared experts of a layer were replaced while generating")
    for name, layer in layers.items():
        ran = {p: layer.stats.calls[p] - stats0[name][0][p] for p in PHASES}
        if not all(ran.values()):
            raise AssertionError(f"{name}: generate ran {ran} MoE calls, expected both phases")
        now = layer.experts.to_linear()
        if not all(torch.equal(now[k], v) for k, v in snapshot[name].items()):
            raise AssertionError(f"{name}: the prepared experts were modified while generating")
    del snapshot
    res.shared_storage = {
        "layers": len(layers),
        "same_object_and_pointers": True,
        "contents_unchanged": True,
        "both_phases_ran_on_every_layer": True,
    }

    reports = [layer.memory_report() for layer in layers.values()]
    one = sum(r["expert_bytes"] for r in reports)
    bf16 = sum(r["bf16_expert_bytes"] for r in reports)
    if one != sum(layer.experts.nbytes() for layer in layers.values()):
        raise AssertionError("memory_report and PreparedExperts.nbytes disagree")
    res.memory = {
        "one_shared_nvfp4_copy": one,
        "two_nvfp4_copies": 2 * one,
        "nvfp4_plus_bf16_copies": one + bf16,
        "bf16": bf16,
        "copies_of_expert_weights": max(r["copies_of_expert_weights"] for r in reports),
    }
    if device.type == "cpu" and res.backend == "reference":
        res.notes.append(
            "on the CPU the MoE layers run the reference backend (plain PyTorch, the numerics "
            "contract): these times are not the speed of the Triton kernels"
        )
    res.seconds = time.perf_counter() - start
    return res


# ------------------------------------------------------------------------------ the report


def _mib(n: int) -> str:
    return f"{n / 2**20:.2f} MiB"


def _wrap(text: str, indent: str = "  ") -> str:
    import textwrap

    return textwrap.fill(text, width=96, subsequent_indent=indent, break_on_hyphens=False)


def render_model_demo(res: ModelDemoResult) -> str:
    """The report ``fp4moe demo`` prints."""
    from .demo import format_table

    cfg, m = res.config, res.model
    dense = "" if m["moe_layers"] == m["layers"] else f" ({m['moe_layers']} with MoE)"
    lines = [
        _wrap(
            f"fp4moe demo: {m['class']}, {m['source']}: {m['layers']} layers{dense}, "
            f"H={m['hidden_size']}, {m['experts']} experts of I={m['expert_intermediate_size']} "
            f"({m['router']} top-{m['top_k']}), vocab {m['vocab_size']}, "
            f"{m['parameters'] / 1e6:.1f}M parameters; device {cfg.device}, MoE backend "
            f"{res.backend}"
        ),
        _wrap(
            f"prepared once: the experts of {m['moe_layers']} MoE layers "
            + (
                "read from the checkpoint's NVFP4 tensors"
                if cfg.checkpoint
                else "quantized to NVFP4"
            )
            + f" in {res.prepare_s:.2f} s (fp4moe.integrations.hf.convert)"
        ),
        _wrap(
            f"model.generate: batch {cfg.batch} x {cfg.prompt_len} random prompt tokens, "
            f"{cfg.new_tokens} new tokens, greedy, {res.generate_s:.2f} s (after a 2-token "
            "warm-up call); the phase of each forward call set by convert's hooks"
        ),
        "",
    ]
    table = []
    for r in res.rows:
        if r["positions"]:
            err = f"{r['logit_rel_error']:.4f}"
            top1 = f"{r['top1_agreement']:.3f} ({r['top1_matches']}/{r['positions']})"
        else:
            err = top1 = "-"
        table.append(
            [r["phase"], r["mode"], str(r["tokens"]), str(r["calls"]), f"{r['seconds']:.3f}",
             f"{r['tokens_per_s']:.1f}", err, top1]
        )  # fmt: skip
    headers = ["phase", "mode", "tokens", "calls", "time s", "tokens/s", "logit rel err",
               "top-1 agree"]  # fmt: skip
    lines += [format_table(headers, table, "llrrrrrr"), ""]
    mem = res.memory
    one = mem["one_shared_nvfp4_copy"]
    mem_rows = [
        ["one NVFP4 copy, shared by prefill and decode (fp4moe)", _mib(one), "1.00x"],
        [f"two NVFP4 copies: {res.rows[0]['mode']} for prefill, {res.rows[1]['mode']} for decode",
         _mib(mem["two_nvfp4_copies"]), f"{mem['two_nvfp4_copies'] / one:.2f}x"],
        ["NVFP4 for prefill plus bf16 for decode", _mib(mem["nvfp4_plus_bf16_copies"]),
         f"{mem['nvfp4_plus_bf16_copies'] / one:.2f}x"],
        ["bf16 (the reference model's experts)", _mib(mem["bf16"]), f"{mem['bf16'] / one:.2f}x"],
    ]  # fmt: skip
    lines += [
        _wrap(
            "tokens: fed to the model in the phase (prefill: the prompts; decode: one a "
            "sequence a step); time: in the model's forward calls."
        ),
        _wrap(
            f"agreement with {res.reference}, run teacher-forced on the generated sequences: "
            "logit rel err = ||logits - bf16 logits|| / ||bf16 logits|| over the phase's "
            "positions; top-1 agree = same argmax."
        ),
        "",
        format_table(
            [f"expert weights of {m['moe_layers']} MoE layers", "size", "vs one copy"],
            mem_rows,
            "lrr",
        ),
        _wrap(
            f"shared storage, checked: in every layer prefill ({res.rows[0]['mode']}) and "
            f"decode ({res.rows[1]['mode']}) read the same PreparedExperts (the same object "
            "and data pointers before and after generating, contents unchanged)."
        ),
    ]
    lines += [_wrap(f"note: {n}") for n in res.notes]
    lines.append(f"done in {res.seconds:.1f} s")
    return "\n".join(lines)


# ------------------------------------------------------------------------------ disaggregated


def _examples_dir() -> Path:
    return Path(__file__).resolve().parents[2] / "examples"


def run_disaggregated(
    *, steps: int = 7, prompt_len: int = 16, batch: int = 2, seed: int = 0,
    device: str | None = None,
) -> dict:  # fmt: skip
    """Run ``examples/disaggregated.py`` of the repository (its ``run()``); its report dict.

    The example lives in the source checkout, beside ``src/``; its two worker processes
    import it by name, so its folder is on ``sys.path`` while it runs."""
    folder = _examples_dir()
    if not (folder / "disaggregated.py").is_file():
        raise FileNotFoundError(
            f"{folder / 'disaggregated.py'} not found: --disaggregated runs the example of "
            "the repository checkout (an editable install, pip install -e .)"
        )
    added = str(folder) not in sys.path
    if added:
        sys.path.insert(0, str(folder))
    try:
        mod = importlib.import_module("disaggregated")
        return mod.run(steps=steps, prompt_len=prompt_len, batch=batch, seed=seed, device=device)
    finally:
        if added:
            sys.path.remove(str(folder))


def render_disaggregated(rep: dict) -> str:
    """The report of ``fp4moe demo --disaggregated``."""
    return "\n".join(
        [
            f"fp4moe demo --disaggregated: prefill worker ({rep['prefill_policy']}) -> decode "
            f"worker ({rep['decode_policy']}), two processes over {rep['backend']}, device "
            f"{rep['device']} (examples/disaggregated.py)",
            f"  both opened the same prepared expert files: {', '.join(rep['expert_files'])}",
            f"  handed over: the KV cache and the first token, {rep['kv_bytes_handed_over']} "
            f"bytes ({rep['kv_dtype']}), batch {rep['batch']} x {rep['prompt_tokens']} prompt "
            "tokens",
            f"  prefill {rep['prefill_s'] * 1e3:.1f} ms; {rep['decode_steps']} decode steps "
            f"{rep['decode_s'] * 1e3:.1f} ms",
            "  the decode worker continued exactly as one process with the same policy (same "
            f"tokens, bitwise the same last logits): {rep['matches_single_process']}",
            f"  tokens: {rep['tokens']}",
        ]
    )
