"""Train a small Qwen3-architecture causal LM from scratch (the demo target)."""
from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from .common import Schedule, fit, random_windows, runtime, sharded


@dataclass(frozen=True)
class TargetShape:
    hidden_size: int = 384
    num_hidden_layers: int = 6
    intermediate_size: int = 1024
    num_attention_heads: int = 6
    num_key_value_heads: int = 2
    head_dim: int = 64
    max_position_embeddings: int = 2048


def build_target(tokenizer, shape: TargetShape = TargetShape(), seed: int = 0):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(
        vocab_size=len(tokenizer), tie_word_embeddings=True, rms_norm_eps=1e-6,
        rope_parameters={"rope_theta": 10000.0, "rope_type": "default"},
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
        bos_token_id=None, **shape.__dict__)
    torch.manual_seed(seed)
    return Qwen3ForCausalLM(config)


def lm_loss(model, batch: torch.Tensor) -> torch.Tensor:
    logits = model(input_ids=batch[:, :-1]).logits
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1))


@torch.no_grad()
def perplexity(model, stream: torch.Tensor, seq_len: int = 256, max_windows: int = 200) -> float:
    """Held-out perplexity over consecutive non-overlapping windows."""
    model.eval()
    n = min(max_windows, (len(stream) - 1) // seq_len)
    losses = [lm_loss(model, stream[i * seq_len:(i + 1) * seq_len + 1].long()[None].to(model.device)).item()
              for i in range(n)]
    model.train()
    return math.exp(sum(losses) / max(len(losses), 1))


def train_target(model, train: torch.Tensor, out_dir: Path, *, batch: int = 16, seq_len: int = 256,
                 lr: float = 2e-3, max_steps: int = 3000, max_seconds: float = math.inf,
                 resume: bool = False, seed: int = 0, ckpt_every: int = 100, device: str = "auto",
                 precision: str = "auto"):
    rt = runtime(device, precision)
    rt.check_batch(batch)
    model.to(rt.device)
    out_dir.mkdir(parents=True, exist_ok=True)
    ckpt = out_dir / "train_state.pt"
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.1)
    gen = torch.Generator().manual_seed(seed)

    def draw(g):
        return {"ids": random_windows(train, batch, seq_len + 1, g)}

    def loss(part):
        return lm_loss(model, part["ids"]), ""

    return fit(model, opt, Schedule(lr, max_steps, max_seconds), gen, ckpt, sharded(rt, draw, loss, batch * seq_len),
               resume=resume, ckpt_every=ckpt_every, rt=rt)
