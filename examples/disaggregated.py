"""Disaggregated serving on one prepared NVFP4 copy: a prefill worker in W4A4 and a decode
worker in W4A16 (by default), both opening the same saved prepared-experts files.

    python3 examples/disaggregated.py            # or: fp4moe demo --disaggregated
    python3 examples/disaggregated.py --prefill w4a8   # the Hopper policy's prefill

1. The main process builds a small Qwen3-MoE model (a real architecture, scaled down,
   random weights), converts it with ``fp4moe.integrations.hf.convert``, and saves the
   prepared experts of every layer (``PreparedExperts.save``) and the dense weights.
2. Two worker processes join a torch.distributed group (gloo on CPU, NCCL with two GPUs).
   Each builds the model skeleton, loads the dense weights and opens the SAME expert files
   with ``fp4moe.load_experts`` (no conversion, no second format): rank 0 runs the prompt
   in W4A4 (per-token scales; ``--prefill``: any mode name of ``fp4moe.modes``) and sends
   the KV cache and the first token; rank 1 continues greedily in W4A16 (``--decode``).
3. The main process checks that the decode worker produced exactly what one process
   running the same policy produces (same tokens, bitwise the same last logits), and
   reports the bytes handed over.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

PREFILL = "w4a4-token"
DECODE = "w4a16"


def tiny_config(vocab: int = 256):
    from transformers import Qwen3MoeConfig

    return Qwen3MoeConfig(
        vocab_size=vocab, hidden_size=128, intermediate_size=256, moe_intermediate_size=64,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
        num_experts=8, num_experts_per_tok=2, norm_topk_prob=True, decoder_sparse_step=1,
        max_position_embeddings=512, tie_word_embeddings=False,
    )  # fmt: skip


def build_model(seed: int, device: str):
    from transformers import Qwen3MoeForCausalLM

    torch.manual_seed(seed)
    model = Qwen3MoeForCausalLM(tiny_config()).to(torch.bfloat16).eval()
    return model.to(device)


def policy(prefill: str = PREFILL, decode: str = DECODE):
    """The phase policy of both workers (mode names of ``fp4moe.modes``)."""
    import fp4moe

    return fp4moe.PhasePolicy(prefill=prefill, decode=decode)


def save_prepared(model, folder: str) -> list[str]:
    """Save each converted layer's PreparedExperts and the dense weights; returns paths."""
    from safetensors.torch import save_file

    from fp4moe.integrations.hf import moe_layers

    paths = []
    for i, (name, layer) in enumerate(sorted(moe_layers(model).items())):
        path = os.path.join(folder, f"experts-{i}.safetensors")
        layer.experts.save(path)
        paths.append((name, path))
    experts = tuple(f"{name}.experts." for name, _ in paths)  # in the files above
    dense = {
        k: v.detach().cpu().contiguous()
        for k, v in model.state_dict().items()
        if not k.startswith(experts)
    }
    save_file(dense, os.path.join(folder, "dense.safetensors"))
    with open(os.path.join(folder, "experts.json"), "w") as f:
        json.dump(paths, f)
    return [p for _, p in paths]


def open_worker_model(folder: str, device: str, seed: int, phases=None):
    """The model skeleton, its dense weights, and the saved experts opened as they are,
    under the phase policy ``phases`` (default ``policy()``)."""
    from safetensors.torch import load_file

    import fp4moe
    from fp4moe.integrations.hf import convert, moe_layers

    model = build_model(seed + 1, device)  # different random init: everything is loaded
    convert(model, phases if phases is not None else policy())
    with open(os.path.join(folder, "experts.json")) as f:
        paths = dict(json.load(f))
    dense = load_file(os.path.join(folder, "dense.safetensors"), device="cpu")
    missing = model.load_state_dict(dense, strict=False).missing_keys
    if any(not k.startswith(tuple(f"{n}.experts." for n in paths)) for k in missing):
        raise RuntimeError(f"dense.safetensors lacks {missing[0]!r}")
    for name, layer in moe_layers(model).items():
        layer.experts = fp4moe.load_experts(paths[name], device=device)
    return model


def _call(model, input_ids, cache):
    """One forward with a KV cache; transformers >= 5.2 names it ``cache``, older
    versions ``past_key_values``. Returns (cache, last logits)."""
    import inspect

    name = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    kw = {name: cache} if cache is not None else {}
    out = model(input_ids=input_ids, use_cache=True, **kw)
    new = out["cache"] if "cache" in out else out["past_key_values"]
    return new, out.logits[:, -1]


@torch.no_grad()
def prefill(model, prompt: torch.Tensor):
    import fp4moe

    with fp4moe.serving_phase("prefill"):
        return _call(model, prompt, None)


@torch.no_grad()
def decode(model, cache, first: torch.Tensor, steps: int):
    """Greedy steps from ``first`` [B, 1]; returns (tokens [B, steps + 1], last logits)."""
    import fp4moe

    toks = [first]
    logits = None
    with fp4moe.serving_phase("decode"):
        for _ in range(steps):
            cache, logits = _call(model, toks[-1], cache)
            toks.append(logits.argmax(-1, keepdim=True))
    return torch.cat(toks, 1), logits


def _send(t: torch.Tensor, dst: int, device: str) -> int:
    raw = t.contiguous().view(torch.uint8).reshape(-1)
    # NCCL moves device tensors only (the header is built on the host); gloo host tensors.
    dist.send(raw.to(device) if dist.get_backend() == "nccl" else raw.cpu(), dst)
    return raw.numel()


def _recv(shape, dtype, src: int, device: str) -> torch.Tensor:
    n = torch.Size(shape).numel() * torch.empty(0, dtype=dtype).element_size()
    nccl = dist.get_backend() == "nccl"
    buf = torch.empty(n, dtype=torch.uint8, device=device if nccl else "cpu")
    dist.recv(buf, src)
    return buf.view(dtype).reshape(shape).to(device)


def worker(rank: int, world: int, addr: str, folder: str, args: dict) -> None:
    backend = "nccl" if args["nccl"] else "gloo"
    dist.init_process_group(backend, init_method=addr, rank=rank, world_size=world)
    device = f"cuda:{rank}" if args["nccl"] else args["device"]
    if device.startswith("cuda"):  # "cuda" alone: both workers share the current GPU
        torch.cuda.set_device(torch.device(device).index or 0)
    model = open_worker_model(folder, device, args["seed"], policy(*args["modes"]))
    result = {}
    if rank == 0:  # prefill worker
        prompt = torch.tensor(args["prompt"], device=device)
        t0 = time.perf_counter()
        cache, logits = prefill(model, prompt)
        first = logits.argmax(-1, keepdim=True)
        result["prefill_s"] = time.perf_counter() - t0
        layers = [(layer.keys, layer.values) for layer in cache.layers]
        header = torch.tensor([len(layers), *layers[0][0].shape], dtype=torch.int64)
        sent = _send(header, 1, device) + _send(first.to(torch.int64), 1, device)
        for k, v in layers:
            sent += _send(k, 1, device) + _send(v, 1, device)
        result["bytes_sent"] = sent
        result["kv_dtype"] = str(layers[0][0].dtype)
    else:  # decode worker
        from transformers import DynamicCache

        header = _recv((5,), torch.int64, 0, device).tolist()
        n_layers, shape = header[0], header[1:]
        b = shape[0]
        first = _recv((b, 1), torch.int64, 0, device)
        cache = DynamicCache()
        for i in range(n_layers):
            k = _recv(shape, torch.bfloat16, 0, device)
            v = _recv(shape, torch.bfloat16, 0, device)
            cache.update(k, v, i)
        t0 = time.perf_counter()
        toks, logits = decode(model, cache, first, args["steps"])
        result["decode_s"] = time.perf_counter() - t0
        result["tokens"] = toks.cpu().tolist()
        torch.save(logits.float().cpu(), os.path.join(folder, "decode_logits.pt"))
    with open(os.path.join(folder, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)
    dist.barrier()
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(*, steps: int = 8, prompt_len: int = 12, batch: int = 2, seed: int = 0,
        device: str | None = None, folder: str | None = None, prefill_mode: str = PREFILL,
        decode_mode: str = DECODE) -> dict:  # fmt: skip
    """Run the example; returns a report dict (raises if the decode worker disagrees).
    ``prefill_mode`` / ``decode_mode``: the workers' modes (names of ``fp4moe.modes``)."""
    from fp4moe.integrations.hf import convert

    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    nccl = torch.cuda.device_count() >= 2
    own = folder is None
    tmp = tempfile.TemporaryDirectory() if own else None
    folder = tmp.name if own else folder
    try:
        phases = policy(prefill_mode, decode_mode)  # a bad mode name fails here, first
        model = convert(build_model(seed, device), phases)
        save_prepared(model, folder)
        del model
        g = torch.Generator().manual_seed(seed)
        prompt = torch.randint(0, 256, (batch, prompt_len), generator=g)

        # One process, the same policy, the same files: the sequence to reproduce.
        single = open_worker_model(folder, device, seed, phases)
        cache, logits = prefill(single, prompt.to(device))
        ref_toks, ref_logits = decode(single, cache, logits.argmax(-1, keepdim=True), steps)
        del single

        args = {"prompt": prompt.tolist(), "steps": steps, "seed": seed, "device": device,
                "nccl": nccl, "modes": (prefill_mode, decode_mode)}  # fmt: skip
        addr = f"tcp://127.0.0.1:{_free_port()}"
        mp.start_processes(worker, args=(2, addr, folder, args), nprocs=2, join=True,
                           start_method="spawn")  # fmt: skip
        with open(os.path.join(folder, "rank0.json")) as f:
            r0 = json.load(f)
        with open(os.path.join(folder, "rank1.json")) as f:
            r1 = json.load(f)
        dec_logits = torch.load(os.path.join(folder, "decode_logits.pt"))
        same_tokens = r1["tokens"] == ref_toks.cpu().tolist()
        same_logits = torch.equal(dec_logits, ref_logits.float().cpu())
        report = {
            "backend": "nccl" if nccl else "gloo", "device": device, "batch": batch,
            "prompt_tokens": prompt_len, "decode_steps": steps,
            "prefill_policy": str(phases.prefill), "decode_policy": str(phases.decode),
            "kv_bytes_handed_over": r0["bytes_sent"], "kv_dtype": r0["kv_dtype"],
            "prefill_s": r0["prefill_s"], "decode_s": r1["decode_s"],
            "tokens": r1["tokens"], "matches_single_process": same_tokens and same_logits,
            "expert_files": sorted(f for f in os.listdir(folder) if f.startswith("experts-")),
        }  # fmt: skip
        if not report["matches_single_process"]:
            raise RuntimeError(
                f"decode worker diverged from one process: tokens equal {same_tokens}, "
                f"last logits bitwise equal {same_logits}"
            )
        return report
    finally:
        if tmp is not None:
            tmp.cleanup()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--steps", type=int, default=8, help="decode steps after the prompt")
    p.add_argument("--prompt-len", type=int, default=12)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda if present)")
    p.add_argument("--prefill", default=PREFILL, help=f"prefill mode (default {PREFILL})")
    p.add_argument("--decode", default=DECODE, help=f"decode mode (default {DECODE})")
    args = p.parse_args(argv)
    rep = run(steps=args.steps, prompt_len=args.prompt_len, batch=args.batch, seed=args.seed,
              device=args.device, prefill_mode=args.prefill,
              decode_mode=args.decode)  # fmt: skip
    print(f"prefill worker ({rep['prefill_policy']}) -> decode worker "
          f"({rep['decode_policy']}) over {rep['backend']}, device {rep['device']}")  # fmt: skip
    print(f"  both opened the same prepared files: {', '.join(rep['expert_files'])}")
    print(
        f"  handed over: KV cache and first token, {rep['kv_bytes_handed_over']} bytes "
        f"({rep['kv_dtype']}), batch {rep['batch']} x {rep['prompt_tokens']} prompt tokens"
    )
    print(f"  prefill {rep['prefill_s'] * 1e3:.1f} ms, {rep['decode_steps']} decode steps "
          f"{rep['decode_s'] * 1e3:.1f} ms")  # fmt: skip
    print(
        f"  continues exactly as one process with the same policy: {rep['matches_single_process']}"
    )
    print(f"  tokens: {rep['tokens']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
