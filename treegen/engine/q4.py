"""4-bit weights (`--dtype q4`): the target's decoder linears as Q4_1 blocks, the layout of a GGUF file's Q4_1
tensors (32 consecutive inputs of one output share an fp16 scale d and minimum m: w = d * q + m, q in 0..15),
its lm_head as Q8_0 blocks (w = d * q, q in -127..127: a GGUF's usual form of the token embedding), the rest
(embedding, norms) in bf16.

Why: decoding a token reads every weight once, so on a CPU a step costs about the bytes it reads; these blocks
read 5 bits a weight where bf16 reads 16. The product is row_q4.c: each row of x is quantized per block of 32
to int8 on entry (as llama.cpp does for these blocks), the inner sums are exact integers (AVX512-VNNI), and a
row's bits are the same alone or inside a tree. Elsewhere (no VNNI, an accelerator) the same arithmetic runs
in torch: the same integers, its own float rounding, so exactness holds within each device.

A GGUF (the SmolLM2 file: Q4_1 layers, a Q8_0 embedding) is loaded in fp32 and its blocks found again
exactly: the dequantized values of a block are d * q + m (or d * q), so its minimum and range (or largest
magnitude) give back d, m and q (tests/test_q4.py checks every tensor of the file). These ARE the loaded weights: plain decoding, every method's verify and
transformers' own generate() all multiply by them, so exactness holds against them.
"""
from __future__ import annotations

import torch
from torch import nn

from . import kernels

NAME = "q4"
GROUP, BLOCK = 32, 32          # outputs a packed group holds; inputs a scale covers (row_q4.c)
NIBBLES = GROUP * BLOCK // 2   # bytes of 4-bit values in one (group, block)
BYTES = NIBBLES + 4 * GROUP    # then d[32] and m[32] as fp16
Q8_VALUES = GROUP * BLOCK      # Q8_0: bytes of values in one (group, block), then d[32] fp16, 128 * sum(q) [32] int32


def fits(n: int, k: int) -> bool:
    return n % GROUP == 0 and k % BLOCK == 0


def quantize_blocks(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """[N, K] -> q [N, K] uint8 in 0..15, d and m [N, K/32] fp16: per block, m the minimum and d the range / 15,
    both rounded to fp16 first, q = round((w - m) / d)."""
    n, k = weight.shape
    blocks = weight.detach().float().reshape(n, k // BLOCK, BLOCK)
    low, high = blocks.amin(-1), blocks.amax(-1)
    d, m = ((high - low) / 15).half(), low.half()
    step = d.float()
    inverse = torch.where(step > 0, 1 / step, torch.zeros_like(step))
    q = torch.round((blocks - m.float()[..., None]) * inverse[..., None]).clamp(0, 15).to(torch.uint8)
    return q.reshape(n, k), d, m


def pack(q: torch.Tensor, d: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """q [N, K], d / m [N, K/32] -> [N/32, K/32, BYTES] uint8 as row_q4.c streams it (its header: the layout)."""
    n, k = q.shape
    groups, blocks = n // GROUP, k // BLOCK
    # (group, half, lane, block, high, vector, byte) -> (group, block, half, vector, lane, byte, high)
    parts = q.view(groups, 2, 16, blocks, 2, 4, 4).permute(0, 3, 1, 5, 2, 6, 4)
    nibbles = (parts[..., 0] | (parts[..., 1] << 4)).reshape(groups, blocks, NIBBLES)
    scales = [s.view(groups, GROUP, blocks).permute(0, 2, 1).contiguous().view(torch.uint8) for s in (d, m)]
    return torch.cat([nibbles, *scales], dim=-1).contiguous()


def unpack(packed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """pack's inverse: -> q [N, K] uint8, d and m [N, K/32] fp16."""
    groups, blocks, _ = packed.shape
    nibbles = packed[..., :NIBBLES].reshape(groups, blocks, 2, 4, 16, 4)
    parts = torch.stack([nibbles & 15, nibbles >> 4], dim=-1)   # (group, block, half, vector, lane, byte, high)
    q = parts.permute(0, 2, 4, 1, 6, 3, 5).reshape(groups * GROUP, blocks * BLOCK)

    def scale(start: int) -> torch.Tensor:
        values = packed[..., start:start + 2 * GROUP].contiguous().view(torch.float16)   # [groups, blocks, 32]
        return values.permute(0, 2, 1).reshape(groups * GROUP, blocks)
    return q, scale(NIBBLES), scale(NIBBLES + 2 * GROUP)


def quantize_q8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[N, K] -> q [N, K] int8 in -127..127, d [N, K/32] fp16: per block, d the largest magnitude / 127 rounded
    to fp16 first, q = round(w / d)."""
    n, k = weight.shape
    blocks = weight.detach().float().reshape(n, k // BLOCK, BLOCK)
    d = (blocks.abs().amax(-1) / 127).half()
    step = d.float()
    inverse = torch.where(step > 0, 1 / step, torch.zeros_like(step))
    q = torch.round(blocks * inverse[..., None]).clamp(-127, 127).to(torch.int8)
    return q.reshape(n, k), d


def pack_q8(q: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    """q [N, K] int8, d [N, K/32] -> [N/32, K/32, Q8_VALUES + 192] uint8 as row_q4.c streams it."""
    n, k = q.shape
    groups, blocks = n // GROUP, k // BLOCK
    # (group, half, lane, block, vector, byte) -> (group, block, half, vector, lane, byte)
    values = q.view(groups, 2, 16, blocks, 8, 4).permute(0, 3, 1, 4, 2, 5).reshape(groups, blocks, Q8_VALUES)
    offset = 128 * q.view(n, blocks, BLOCK).sum(-1, dtype=torch.int32)

    def side(t: torch.Tensor) -> torch.Tensor:   # [N, K/32] -> its bytes, [groups, blocks, 32 * size]
        return t.view(groups, GROUP, blocks).permute(0, 2, 1).contiguous().view(torch.uint8)
    return torch.cat([values.view(torch.uint8), side(d), side(offset)], dim=-1).contiguous()


def unpack_q8(packed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """pack_q8's inverse: -> q [N, K] int8, d [N, K/32] fp16."""
    groups, blocks, _ = packed.shape
    values = packed[..., :Q8_VALUES].contiguous().view(torch.int8).view(groups, blocks, 2, 8, 16, 4)
    q = values.permute(0, 2, 4, 1, 3, 5).reshape(groups * GROUP, blocks * BLOCK)
    d = packed[..., Q8_VALUES:Q8_VALUES + 2 * GROUP].contiguous().view(torch.float16)
    return q, d.permute(0, 2, 1).reshape(groups * GROUP, blocks)


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [R, K] -> a [R, K/32, 32] (integers in -127..127, as fp32), e and t [R, K/32]: row_q4_quantize's."""
    blocks = x.float().reshape(x.shape[0], -1, BLOCK)
    top = blocks.abs().amax(-1)
    inverse = torch.where(top > 0, 127 / top, torch.zeros_like(top))
    a = torch.round(blocks * inverse[..., None])
    e = top / 127
    return a, e, e * a.sum(-1)


CHUNK_BYTES = 1 << 28   # the torch product's [blocks, rows, N] sums kept under this: a long prompt in pieces


def reference_product(x: torch.Tensor, q: torch.Tensor, d: torch.Tensor, m: torch.Tensor | None = None):
    """row_q4.c's product in torch on any device: the same quantized rows and exact integer sums (each below
    2^24, so exact in fp32, TF32 inputs included), its own rounding where the blocks are added. x [R, K],
    q [N, K], d and m [N, K/32] (m None: Q8_0 blocks) -> [R, N] fp32."""
    n, blocks = d.shape
    weights = q.float().view(n, blocks, BLOCK).permute(1, 2, 0)   # [blocks, 32, N]
    scale, low = d.float().t()[:, None, :], None if m is None else m.float().t()[:, None, :]
    out = []
    for part in x.split(max(1, CHUNK_BYTES // (4 * blocks * n))):
        a, e, t = quantize_rows(part)
        scaled = torch.matmul(a.transpose(0, 1), weights) * (scale * e.t()[:, :, None])   # [blocks, rows, N]
        if low is not None:
            scaled = scaled + low * t.t()[:, :, None]
        out.append(scaled.sum(0))
    return torch.cat(out)


class Q4Weight:
    """An [N, K] weight as packed Q4_1 blocks (pack's layout), multiplied by row_q4.c on a CPU that has it."""
    Q8 = False   # row_q4.c's product for these blocks

    def __init__(self, packed: torch.Tensor):
        self.packed = packed
        self.bound = None   # the kernel bound to this weight, made on its first CPU call

    @classmethod
    def quantize(cls, weight: torch.Tensor) -> Q4Weight:
        return cls(pack(*quantize_blocks(weight)))

    @classmethod
    def stack(cls, *weights: Q4Weight) -> Q4Weight:
        """Several weights of one input as one (q, k and v; gate and up): whole groups side by side, so every
        output keeps its bits."""
        return weights[0] if len(weights) == 1 else cls(torch.cat([w.packed for w in weights]))

    @property
    def shape(self) -> tuple[int, int]:
        return (self.packed.shape[0] * GROUP, self.packed.shape[1] * BLOCK)

    def parts(self, device: torch.device | None = None):
        """q [N, K], d and m [N, K/32] (m None for Q8_0 blocks), on `device` (None: where the blocks are)."""
        return unpack(self.packed if device is None else self.packed.to(device))

    def dequantized(self, dtype: torch.dtype) -> torch.Tensor:
        """The weight these blocks stand for, [N, K] in `dtype`."""
        q, d, m = self.parts()
        n, k = q.shape
        w = q.float().view(n, -1, BLOCK) * d.float()[..., None]
        if m is not None:
            w = w + m.float()[..., None]
        return w.reshape(n, k).to(dtype)

    def reference(self, x: torch.Tensor) -> torch.Tensor:
        return reference_product(x, *self.parts(x.device))

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        n, k = self.shape
        if x.device.type == "cpu" and x.dtype == torch.bfloat16 and kernels.q4_library() is not None:
            if self.bound is None:
                self.bound = kernels.q4_matmul_bound(self.packed, self.Q8)
            return self.bound(x)
        return self.reference(x.reshape(-1, k)).to(x.dtype).view(*x.shape[:-1], n)


class Q8Weight(Q4Weight):
    """An [N, K] weight as packed Q8_0 blocks (pack_q8's layout): the q4 form's lm_head."""
    Q8 = True

    @classmethod
    def quantize(cls, weight: torch.Tensor) -> Q8Weight:
        return cls(pack_q8(*quantize_q8(weight)))

    def parts(self, device: torch.device | None = None):
        return (*unpack_q8(self.packed if device is None else self.packed.to(device)), None)


class BlockLinear(nn.Module):
    """A bias-free nn.Linear whose weight is a Q4Weight or Q8Weight: what transformers' forward calls, and what
    the engine's lean forward multiplies by directly (engine/fast_decoder.py)."""

    def __init__(self, weight: Q4Weight):
        super().__init__()
        self.out_features, self.in_features = weight.shape
        # a buffer, the one copy (uint8: a model-wide .to(dtype) leaves it, fp16 scales included, as it is)
        self.register_buffer("packed", weight.packed, persistent=False)
        self._weight = weight

    @property
    def blocks(self) -> Q4Weight:
        if self._weight.packed is not self.packed:   # moved (.to(device)): bind afresh
            self._weight = type(self._weight)(self.packed)
        return self._weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.blocks(x)

    def extra_repr(self) -> str:
        kind = "q8_0" if self._weight.Q8 else "q4_1"
        return f"in_features={self.in_features}, out_features={self.out_features}, {kind} blocks of 32"


def quantize(model) -> int:
    """The model's bias-free decoder Linear layers whose shapes fit replaced by Q4_1 blocks, its lm_head by
    Q8_0 blocks (a tied one leaves the embedding its float rows: a lookup reads one a token), in place;
    -> how many."""
    head = model.get_output_embeddings()
    count = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if (type(child) is nn.Linear and child.bias is None and child.weight.device.type != "meta"
                    and fits(*child.weight.shape)):
                form = Q8Weight if child is head else Q4Weight
                setattr(parent, name, BlockLinear(form.quantize(child.weight)))
                count += 1
    return count


def is_q4(model) -> bool:
    return any(type(m) is BlockLinear for m in model.modules())


def parameters(model) -> int:
    """The weights the model's block layers stand for (buffers, not parameters); a tied lm_head counts once,
    as in the float model."""
    count = sum(m.out_features * m.in_features for m in model.modules() if type(m) is BlockLinear)
    head = model.get_output_embeddings()
    if type(head) is BlockLinear and getattr(model.config, "tie_word_embeddings", False):
        count -= head.out_features * head.in_features
    return count
