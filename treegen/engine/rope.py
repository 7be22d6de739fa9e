"""The rotary embedding's cos / sin per position, made once and looked up (on a CPU a forward of a few rows
otherwise spends more on these six small ops than on some of its products).

Each position's values come from the same elementwise ops the per-forward form runs (angle = position *
inv_freq in fp32, the two halves side by side, cos and sin, then the dtype), on pieces of PIECE positions: a
piece's 64-wide rows fill whole vectors and stay under torch's threading grain, so a position's bits are
those a forward of any row count would make for it.
"""
from __future__ import annotations

import torch

PIECE = 256   # positions made per piece (x head_dim values: one thread, whole vectors)


class RopeTable:
    """table(positions [..., n]) -> (cos, sin) [..., n, head_dim] in `dtype`, grown as positions come."""

    def __init__(self, inv_freq: torch.Tensor, dtype: torch.dtype):
        self.inv_freq, self.dtype = inv_freq.to(torch.float), dtype
        width = 2 * inv_freq.shape[0]
        self.cos = torch.empty(0, width, dtype=dtype, device=inv_freq.device)
        self.sin = torch.empty(0, width, dtype=dtype, device=inv_freq.device)

    def __call__(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        need = int(positions.max()) + 1 if positions.numel() else 0
        if need > self.cos.shape[0]:
            self.grow(need)
        return self.cos[positions], self.sin[positions]

    def upto(self, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The whole (cos, sin) tables [>= end, head_dim], position p at row p."""
        if end > self.cos.shape[0]:
            self.grow(end)
        return self.cos, self.sin

    def grow(self, need: int) -> None:
        start, end = self.cos.shape[0], max(need, 2 * self.cos.shape[0])
        cos, sin = [self.cos], [self.sin]
        for first in range(start, end, PIECE):
            angles = per_forward(torch.arange(first, min(first + PIECE, end), device=self.inv_freq.device),
                                 self.inv_freq)
            cos.append(angles.cos().to(self.dtype))
            sin.append(angles.sin().to(self.dtype))
        self.cos, self.sin = torch.cat(cos), torch.cat(sin)


def per_forward(positions: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    """[..., n] positions -> [..., n, head_dim] fp32 angles, as transformers' rotary embedding makes them."""
    freqs = positions[..., None].float() * inv_freq.to(torch.float)
    return torch.cat((freqs, freqs), dim=-1)
