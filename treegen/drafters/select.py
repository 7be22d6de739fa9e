"""Drafting's selections: per-row top-k with the row's log-sum-exp, and logits over gathered weight rows. On a
CPU each is one compiled call (engine/row_select.c); elsewhere, or without the build, torch's ops. Both forms
rank the same tokens up to ties and last bits; drafts are only ranked by them, so either keeps a round exact,
and each repeats its own numbers run to run."""
from __future__ import annotations

from typing import NamedTuple

import torch

from ..engine import kernels

MAX_WIDTH = 4096   # row_select.c's largest state width


class Top(NamedTuple):
    values: torch.Tensor    # [..., k] fp32, largest first
    columns: torch.Tensor   # [..., k] long
    lse: torch.Tensor       # [...] log(sum(exp(row)))


def compiled(x: torch.Tensor) -> bool:
    return x.device.type == "cpu" and kernels.select_library() is not None


def top_k(x: torch.Tensor, k: int) -> Top:
    """x [..., n] -> its k largest values a row (k <= n), their columns and the row's log-sum-exp, in fp32.
    The compiled form puts the lower column first among equal values."""
    n = x.shape[-1]
    k = min(k, n)
    if not compiled(x) or k < 1:
        x = x.float()
        top = x.topk(k, dim=-1)
        return Top(top.values, top.indices, x.logsumexp(-1))
    flat = x.reshape(-1, n).float()
    if flat.stride(-1) != 1:
        flat = flat.contiguous()
    rows = flat.shape[0]
    values = torch.empty(rows, k)
    columns = torch.empty(rows, k, dtype=torch.long)
    lse = torch.empty(rows)
    kernels.select_library().top_k_lse_f32(flat.data_ptr(), rows, n, flat.stride(0), k, values.data_ptr(),
                                            columns.data_ptr(), lse.data_ptr())
    lead = x.shape[:-1]
    return Top(values.view(*lead, k), columns.view(*lead, k), lse.view(lead))


def gathered_logits(states: torch.Tensor, weight: torch.Tensor, support: torch.Tensor) -> torch.Tensor:
    """states [G, m, H], weight [V, H], support [G, s] token ids -> [G, m, s] fp32: group g's states against
    the weight rows of its own support tokens (gathered rows and a batched product, in one pass)."""
    groups, m, width = states.shape
    s = support.shape[-1]
    if not (compiled(states) and weight.device.type == "cpu" and weight.dtype in (torch.float32, torch.bfloat16)
            and width % 16 == 0 and width <= MAX_WIDTH and weight.stride(-1) == 1):
        rows = weight.index_select(0, support.flatten()).view(groups, s, width)
        return torch.bmm(states, rows.to(states.dtype).transpose(1, 2)).float()
    flat = states.float().contiguous()
    support = support.contiguous()
    out = torch.empty(groups, m, s)
    lib = kernels.select_library()
    fn = lib.gathered_dot_bf16 if weight.dtype == torch.bfloat16 else lib.gathered_dot_f32
    fn(flat.data_ptr(), groups, m, width, weight.data_ptr(), weight.stride(0), support.data_ptr(), s,
       out.data_ptr(), torch.get_num_threads())
    return out
