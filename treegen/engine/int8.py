"""Weight-only int8 (`--dtype int8`): the target's linear layers and lm_head kept as int8 with one fp32 scale per
output (symmetric, scale = max |w| / 127), the rest (embeddings, norms, attention) in the compute dtype.

Why: decoding a token reads every weight once, so on a CPU a step costs about the bytes it reads; int8 reads a
quarter of fp32's. The product is row_int8.c (each output one accumulator over k in order: a row's bits are
the same alone or inside a tree, on every path that runs it); elsewhere (an accelerator, no compiler) the int8
weight is widened to the input's dtype for F.linear. These ARE the loaded weights: plain decoding, every
method's verify and transformers' own generate() all multiply by them, so exactness holds against them.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from . import kernels

NAME = "int8"


class Int8Weight:
    """An [N, K] weight as int8 per output: q [N, K] (or packed for the kernel, kernels.int8_pack) and scale [N]."""

    def __init__(self, q: torch.Tensor, scale: torch.Tensor, packed: bool):
        self.q, self.scale, self.packed = q, scale, packed
        self.bound = None   # the kernel bound to this weight, made on its first CPU call

    @classmethod
    def quantize(cls, weight: torch.Tensor) -> Int8Weight:
        w = weight.detach().float()
        top = w.abs().amax(dim=1)
        scale = torch.where(top > 0, top / 127, torch.ones_like(top))
        q = torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8)
        return cls.of(q, scale)

    @classmethod
    def of(cls, q: torch.Tensor, scale: torch.Tensor) -> Int8Weight:
        """Packed for the kernel where it serves: a CPU weight with outputs in whole groups, the kernel built."""
        packs = q.device.type == "cpu" and q.shape[0] % kernels.INT8_GROUP == 0 and kernels.int8_library() is not None
        return cls(kernels.int8_pack(q) if packs else q.contiguous(), scale.float().contiguous(), packs)

    @classmethod
    def stack(cls, *weights: Int8Weight) -> Int8Weight:
        """Several weights of one input as one (q, k and v; gate and up): one call, the same bits per output."""
        if len(weights) == 1:
            return weights[0]
        if all(w.packed for w in weights):
            return cls(torch.cat([w.q for w in weights]), torch.cat([w.scale for w in weights]), True)
        return cls.of(torch.cat([w.plain() for w in weights]), torch.cat([w.scale for w in weights]))

    @property
    def shape(self) -> tuple[int, int]:
        return (len(self.scale), self.q.shape[1])

    def plain(self) -> torch.Tensor:
        """q as [N, K]."""
        return kernels.int8_unpack(self.q) if self.packed else self.q

    def dequantized(self, dtype: torch.dtype) -> torch.Tensor:
        """The weight these int8 values stand for, [N, K] in `dtype` (drafters read the target's lm_head so)."""
        return (self.plain().float() * self.scale[:, None]).to(dtype)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed and x.device.type == "cpu":
            if self.bound is None:
                self.bound = kernels.int8_matmul_bound(self.q, self.scale)
            return self.bound(x)
        return F.linear(x, self.plain().to(x.dtype)) * self.scale.to(x.dtype)


class Int8Linear(nn.Module):
    """A bias-free nn.Linear whose weight is an Int8Weight: what transformers' forward calls, and what the
    engine's lean forward multiplies by directly (engine/fast_decoder.py)."""

    def __init__(self, weight: Int8Weight):
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.packed = weight.packed
        # buffers, the one copy: .to(device) moves them, and the product is built from them on each call; the
        # fp32 scales kept as their int32 bits, so that a model-wide .to(dtype) cannot round them
        self.register_buffer("q", weight.q, persistent=False)
        self.register_buffer("scale_bits", weight.scale.view(torch.int32), persistent=False)

    @property
    def int8(self) -> Int8Weight:
        return Int8Weight(self.q, self.scale_bits.view(torch.float32), self.packed)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.int8(x)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int8 per output"


def quantize(model) -> int:
    """The model's bias-free Linear layers (decoder and lm_head) replaced by Int8Linear, in place; -> how many.
    A tied lm_head gets its own int8 copy: the embedding keeps its float rows (a lookup reads one a token)."""
    count = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is nn.Linear and child.bias is None and child.weight.device.type != "meta":
                setattr(parent, name, Int8Linear(Int8Weight.quantize(child.weight)))
                count += 1
    return count


def is_int8(model) -> bool:
    """Whether quantize() made the model's weights int8 (its lm_head says: quantize replaces it too)."""
    return isinstance(model.get_output_embeddings(), Int8Linear)
