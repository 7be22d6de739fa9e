"""A DFlash drafter sized for a target, its weights drawn at random: where training starts (train/dflash.py)
and what the GPU check times in the published layouts (bench/gpu_check.py)."""
from __future__ import annotations

import torch

from ..models.dflash import DFlashConfig, DFlashDrafter, default_target_layer_ids


def untrained_dflash(target, mask_token_id: int, num_layers: int, block_size: int,
                     target_layer_ids: tuple[int, ...] | None = None, intermediate_size: int | None = None,
                     seed: int = 0) -> DFlashDrafter:
    """The target's widths, heads and vocabulary; `num_layers` layers reading `target_layer_ids` (None: z-lab's
    default spread); every matrix drawn from N(0, 0.02) under `seed`."""
    t = target.config
    ids = target_layer_ids or default_target_layer_ids(t.num_hidden_layers, num_layers)
    config = DFlashConfig(
        hidden_size=t.hidden_size, intermediate_size=intermediate_size or t.intermediate_size,
        num_hidden_layers=num_layers, num_attention_heads=t.num_attention_heads,
        num_key_value_heads=t.num_key_value_heads, head_dim=getattr(t, "head_dim", None)
        or t.hidden_size // t.num_attention_heads, num_target_layers=t.num_hidden_layers,
        target_layer_ids=tuple(ids), mask_token_id=mask_token_id, vocab_size=t.vocab_size,
        block_size=block_size, rms_norm_eps=t.rms_norm_eps,
        rope_theta=float((getattr(t, "rope_parameters", None) or {}).get("rope_theta", 10000.0)),
        max_position_embeddings=t.max_position_embeddings)
    torch.manual_seed(seed)
    model = DFlashDrafter(config)
    for _, p in model.named_parameters():
        if p.dim() == 2:
            torch.nn.init.normal_(p, std=0.02)
    return model
