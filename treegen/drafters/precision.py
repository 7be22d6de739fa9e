"""The drafter's compute precision (the `dtype` option of every method with a drafter).

Drafts only propose: verification runs the target at its own precision, so a drafter in another dtype
changes what is drafted, never what is generated (T=0 output equals the target's greedy output; at T > 0
the laws drafts were drawn from are what verification divides by, in whatever precision they came)."""
from __future__ import annotations

import torch

from ..loading import DTYPES
from . import defaults as D


def native_bf16() -> bool:
    """A CPU with bf16 dot-product instructions (AVX512-BF16 or AMX): there bf16 matmuls of a few rows
    ran 3.6x faster than fp32 (docs/methods.md); without them, slower."""
    return torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()


def draft_dtype(name: str, target) -> torch.dtype:
    """`auto`: bf16 for an fp32 target on a CPU with native bf16, else the target's own dtype."""
    weight = target.get_input_embeddings().weight
    if name != D.DTYPE:
        return DTYPES[name]
    if weight.device.type == "cpu" and weight.dtype == torch.float32 and native_bf16():
        return torch.bfloat16
    return weight.dtype
