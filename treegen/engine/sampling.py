"""Samplers: the target's processed distribution, applied identically by plain decoding and by verification.

Order (as in transformers' generate): temperature, then top-k, then top-p, then min-p. Verification
draws from exactly this distribution, which is what makes every drafting method lossless.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from . import kernels

DEFAULT_TEMPERATURE = 0.0
DEFAULT_TOP_K = 0      # 0 = off
DEFAULT_TOP_P = 1.0    # 1 = off
DEFAULT_MIN_P = 0.0    # 0 = off


@dataclass(frozen=True)
class Sampler:
    temperature: float = DEFAULT_TEMPERATURE
    top_k: int = DEFAULT_TOP_K
    top_p: float = DEFAULT_TOP_P
    min_p: float = DEFAULT_MIN_P

    def __post_init__(self):
        if not self.temperature >= 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top-p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top-k must be >= 0 (0 = off), got {self.top_k}")
        if not 0 <= self.min_p < 1:
            raise ValueError(f"min-p must be in [0, 1), got {self.min_p}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def plain(self) -> bool:
        """Temperature alone: no top-k, top-p or min-p cut."""
        return self.top_k == 0 and self.top_p >= 1 and self.min_p == 0

    def probs(self, logits: torch.Tensor) -> torch.Tensor:
        """[..., V] logits -> [..., V] probabilities of the processed distribution (T > 0 only)."""
        return torch.softmax(self.filtered_logits(logits), dim=-1)

    def filtered_logits(self, logits: torch.Tensor) -> torch.Tensor:
        x = logits.float() / self.temperature
        if self.top_k and self.top_k < x.shape[-1]:
            kth = torch.topk(x, self.top_k, dim=-1).values[..., -1:]
            x = x.masked_fill(x < kth, -torch.inf)
        if self.top_p < 1:
            x = _top_p(x, self.top_p)
        if self.min_p > 0:
            p = torch.softmax(x, dim=-1)
            x = x.masked_fill(p < self.min_p * p.max(dim=-1, keepdim=True).values, -torch.inf)
        return x

    def sample(self, logits: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
        """One token per row of [rows, V] logits: argmax at T=0, else one draw from probs() (on a CPU one
        compiled pass over the logits: softmax_draw)."""
        if self.greedy:
            return argmax(logits)
        if self.plain:
            return softmax_draw(logits, self.temperature, generator)
        return softmax_draw(self.filtered_logits(logits), 1.0, generator)


def softmax_draw(logits: torch.Tensor, temperature: float, generator: torch.Generator | None = None,
                 u: torch.Tensor | None = None) -> torch.Tensor:
    """One index per row of [..., V] logits drawn from softmax(logits / temperature), one uniform a row. On a
    CPU one compiled call (row_select.c's sample_rows: the same inverse-CDF rule over the weights
    e^(x/t - max), in a fixed order), where torch's softmax, fp64 cumsum and search over a 49,152-token row
    cost a few percent of a small model's step; else, and for a row whose largest value is not finite, draw().
    u: the rows' uniforms ([rows, 1], fp64), else drawn from `generator` as draw() draws them."""
    rows = logits.reshape(-1, logits.shape[-1])
    if u is None:
        u = torch.rand(rows.shape[0], 1, generator=generator, device=rows.device, dtype=torch.float64)

    def reference(x: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
        return draw(torch.softmax(x.float() / temperature, dim=-1), u=uniforms)

    lib = kernels.select_library() if rows.device.type == "cpu" else None
    if lib is None or rows.dtype not in (torch.bfloat16, torch.float32) or rows.stride(-1) != 1 \
            or rows.shape[-1] == 0:
        return reference(rows, u).view(logits.shape[:-1])
    out = torch.empty(rows.shape[0], dtype=torch.long)
    blocks = torch.empty(-(-rows.shape[1] // 16), dtype=torch.float32)
    if lib.sample_rows(rows.data_ptr(), rows.shape[0], rows.shape[1], rows.stride(0),
                       int(rows.dtype == torch.bfloat16), temperature, u.data_ptr(), blocks.data_ptr(), out.data_ptr()):
        undecided = out < 0
        out[undecided] = reference(rows[undecided], u[undecided])
    return out.view(logits.shape[:-1])


def draw(probs: torch.Tensor, generator: torch.Generator | None = None, u: torch.Tensor | None = None) -> torch.Tensor:
    """One index per row of [..., V] probabilities (a row need not sum to 1): the first whose running sum
    (fp64) passes a uniform draw times the row's total, i.e. inverse-CDF sampling from one uniform a row:
    a few passes over the row, where torch.multinomial on a CPU costs a sizeable share of a small model's
    step. A zero-probability index is never drawn: its running sum equals the one before it."""
    rows = probs.reshape(-1, probs.shape[-1])
    cdf = rows.double().cumsum(-1)
    total = cdf[:, -1:]
    if u is None:   # [rows, 1] uniforms in [0, 1), fp64
        u = torch.rand(rows.shape[0], 1, generator=generator, device=rows.device, dtype=torch.float64)
    u = u * total
    # u < total; where rounding says otherwise, the last index with mass (cdf's first maximum)
    picked = torch.minimum(torch.searchsorted(cdf, u, right=True)[:, 0], cdf.argmax(-1))
    return picked.view(probs.shape[:-1])


def argmax(logits: torch.Tensor) -> torch.Tensor:
    """The first index of each row's largest logit. On a CPU one compiled pass (row_select.c), else through
    NumPy: torch's argmax over a vocabulary row is several times slower (bf16 more so), and every method's
    greedy step and walk pays it per row. The same rule (first maximum, NaN counted largest) on the same
    values: plain decoding and every walk run it alike."""
    if logits.device.type != "cpu":
        return logits.argmax(dim=-1)
    lib = kernels.select_library()
    if lib is not None and logits.dim() == 2 and logits.dtype in (torch.bfloat16, torch.float32) \
            and logits.stride(-1) == 1 and logits.shape[-1] > 0:   # one compiled pass, the same rule
        out = torch.empty(logits.shape[0], dtype=torch.long)
        lib.argmax_rows(logits.data_ptr(), logits.shape[0], logits.shape[1], logits.stride(0),
                        int(logits.dtype == torch.bfloat16), out.data_ptr())
        return out
    return torch.from_numpy(np.asarray(logits.detach().float().numpy().argmax(-1)))


def _top_p(x: torch.Tensor, top_p: float) -> torch.Tensor:
    """Keep the smallest prefix of tokens (by probability) whose mass reaches top_p; always the top one."""
    sorted_x, order = torch.sort(x, dim=-1, descending=True)
    cum = torch.softmax(sorted_x, dim=-1).cumsum(dim=-1)
    drop_sorted = (cum - torch.softmax(sorted_x, dim=-1)) >= top_p  # mass before this token already enough
    drop = drop_sorted.scatter(-1, order, drop_sorted)
    return x.masked_fill(drop, -torch.inf)
