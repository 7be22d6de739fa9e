"""Held-out acceptance: run a drafter through the real engine on held-out prompts and read the stats."""
from __future__ import annotations

import torch

from ..engine.generate import GenerationConfig, generate
from ..engine.sampling import Sampler
from ..engine.stats import Stats


def heldout_prompts(stream: torch.Tensor, n: int, prompt_len: int, seed: int = 0) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, len(stream) - prompt_len - 1, (n,), generator=gen).tolist()
    return [stream[s:s + prompt_len].long() for s in starts]


def acceptance(target, drafter, prompts: list[torch.Tensor], max_new_tokens: int = 64,
               temperature: float = 0.0, seed: int = 0) -> Stats:
    """Totals over all prompts (mean_accepted_length is tokens per decode round, bonus included)."""
    total = Stats()
    cfg = GenerationConfig(max_new_tokens, Sampler(temperature), seed)
    for prompt in prompts:
        for r in generate(target, drafter, prompt, cfg):
            total.add(r)
    return total
