"""Shared pieces of the accuracy example: the model config, byte encoding, loading."""

from __future__ import annotations

import json
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
DATA = HERE / "data"
WEIGHTS = HERE / "tiny-moe.safetensors"
CONFIG = HERE / "tiny-moe.config.json"

# The tiny Qwen3-MoE: byte vocabulary (no tokenizer), 4 layers, every MLP a sparse MoE block
# of 8 SwiGLU experts, top-2 with renormalized weights. H and I are multiples of 32 (NVFP4).
MODEL_CONFIG = dict(
    vocab_size=256,
    hidden_size=128,
    intermediate_size=128,
    moe_intermediate_size=128,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=4,
    head_dim=32,
    num_experts=8,
    num_experts_per_tok=2,
    norm_topk_prob=True,
    decoder_sparse_step=1,
    max_position_embeddings=1024,
    rope_theta=10000.0,
    tie_word_embeddings=True,
    router_aux_loss_coef=0.01,
    bos_token_id=None,
    eos_token_id=None,
    pad_token_id=None,
)


def encode(text: str) -> torch.Tensor:
    """Bytes of the text as int64 token ids (the vocabulary is the 256 byte values)."""
    return torch.frombuffer(bytearray(text.encode("utf-8")), dtype=torch.uint8).long()


def decode(ids) -> str:
    return bytes(int(i) for i in ids).decode("utf-8", errors="replace")


def make_config(**overrides):
    from transformers import Qwen3MoeConfig

    return Qwen3MoeConfig(**{**MODEL_CONFIG, **overrides})


def load_model(weights: Path = WEIGHTS, config: Path = CONFIG, dtype=torch.bfloat16):
    """The shipped (or a freshly trained) tiny MoE, in eval mode, in ``dtype``."""
    from safetensors.torch import load_file
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    cfg = Qwen3MoeConfig(**json.loads(Path(config).read_text()))
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model = Qwen3MoeForCausalLM(cfg)
    state = load_file(str(weights))
    missing, unexpected = model.load_state_dict(state, strict=False)
    # lm_head.weight is tied to the embedding and not stored.
    missing = [k for k in missing if k != "lm_head.weight"]
    if missing or unexpected:
        raise ValueError(f"{weights}: missing {missing}, unexpected {unexpected}")
    model.tie_weights()
    return model.to(dtype).eval()
