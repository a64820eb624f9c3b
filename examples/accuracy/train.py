"""Train the tiny byte-level Qwen3-MoE of the accuracy report on the Jargon File.

Plain PyTorch loop, fp32 master weights, AdamW, warmup then cosine decay, seeded; the
saved weights are bf16 (the baseline of the report). Run get_corpus.py first.

Usage: python examples/accuracy/train.py [--steps 1500] [--out examples/accuracy]
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from tinymoe import CONFIG, DATA, MODEL_CONFIG, WEIGHTS, encode, make_config


def batches(data: torch.Tensor, batch: int, seq: int, gen: torch.Generator):
    while True:
        starts = torch.randint(0, data.numel() - seq - 1, (batch,), generator=gen)
        rows = torch.stack([data[s : s + seq + 1] for s in starts.tolist()])
        yield rows[:, :-1], rows[:, 1:]


@torch.no_grad()
def heldout_loss(model, data: torch.Tensor, seq: int, n: int) -> float:
    """Mean next-byte loss over the first n windows of the held-out text (fp32 model)."""
    model.eval()
    total, count = 0.0, 0
    for w in range(n):
        s = w * seq
        if s + seq + 1 > data.numel():
            break
        x = data[s : s + seq + 1]
        out = model(input_ids=x[None, :-1])
        loss = torch.nn.functional.cross_entropy(out.logits[0].float(), x[1:], reduction="sum")
        total += loss.item()
        count += seq
    model.train()
    return total / count


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", type=Path, default=DATA)
    ap.add_argument("--weights", type=Path, default=WEIGHTS)
    ap.add_argument("--config", type=Path, default=CONFIG)
    ap.add_argument("--steps", type=int, default=1500)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--warmup", type=int, default=100)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--log-every", type=int, default=50)
    args = ap.parse_args(argv)

    from safetensors.torch import save_file
    from transformers import Qwen3MoeForCausalLM

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    train = encode((args.data / "train.txt").read_text(encoding="ascii"))
    held = encode((args.data / "heldout.txt").read_text(encoding="ascii"))
    cfg = make_config(output_router_logits=True)
    cfg._attn_implementation = "sdpa"
    model = Qwen3MoeForCausalLM(cfg)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"train {train.numel()} bytes, held-out {held.numel()} bytes, {n_params} parameters")

    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
        lr=args.lr, betas=(0.9, 0.95),
    )  # fmt: skip

    def lr_at(step: int) -> float:
        if step < args.warmup:
            return args.lr * (step + 1) / args.warmup
        frac = (step - args.warmup) / max(1, args.steps - args.warmup)
        return args.lr * (0.05 + 0.95 * 0.5 * (1 + math.cos(math.pi * frac)))

    gen = torch.Generator().manual_seed(args.seed)
    it = batches(train, args.batch, args.seq, gen)
    t0 = time.perf_counter()
    model.train()
    for step in range(args.steps):
        for g in opt.param_groups:
            g["lr"] = lr_at(step)
        x, y = next(it)
        out = model(input_ids=x, labels=None)
        lm = torch.nn.functional.cross_entropy(out.logits.reshape(-1, 256).float(), y.reshape(-1))
        loss = lm + cfg.router_aux_loss_coef * out.aux_loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if step % args.log_every == 0 or step == args.steps - 1:
            el = time.perf_counter() - t0
            print(
                f"step {step:5d}  loss {lm.item():.4f} ({lm.item() / math.log(2):.3f} bits/byte)"
                f"  aux {out.aux_loss.item():.3f}  lr {lr_at(step):.2e}  {el:7.1f} s",
                flush=True,
            )
    train_s = time.perf_counter() - t0
    hl = heldout_loss(model, held, args.seq, 64)
    print(f"trained {args.steps} steps in {train_s:.0f} s; held-out (fp32, 64 windows) "
          f"loss {hl:.4f}, perplexity {math.exp(hl):.3f}")  # fmt: skip

    state = {k: v.detach().to(torch.bfloat16).contiguous() for k, v in model.state_dict().items()
             if k != "lm_head.weight"}  # fmt: skip
    meta = {
        "format": "fp4moe.examples.accuracy.tiny-moe",
        "steps": str(args.steps), "batch": str(args.batch), "seq": str(args.seq),
        "lr": str(args.lr), "seed": str(args.seed), "train_seconds": f"{train_s:.0f}",
        "corpus": "jargon-text 4.4.7-4.1 (Debian), glossary entries i % 10 != 0",
    }  # fmt: skip
    save_file(state, str(args.weights), metadata=meta)
    args.config.write_text(json.dumps(MODEL_CONFIG, indent=2) + "\n")
    size = args.weights.stat().st_size
    print(f"wrote {args.weights} ({size / 1e6:.2f} MB) and {args.config}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
