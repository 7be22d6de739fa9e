"""Row-invariant attention: a row's output has the same bits whether the forward carries it alone (plain
decoding) or inside a tree of up to 64 rows, so a tree round can never pick another token than plain decoding.

SDPA is not row-invariant on a CPU (its kernels block queries and keys by the shapes they are given), so each
row is computed over its own key sequence in plain-decoding order (the committed context, then its ancestors,
then itself), cut into blocks of BLOCK keys at fixed absolute positions:

    scores  = q . k per key                   one small matmul per block family (K = head_dim)
    probs   = exp(s - max) / sum              max is exact; sums run block by block (fixed_sum), padding adds 0
    output  = sum over blocks of probs @ v    one matmul per block (K = BLOCK), partials summed by fixed_sum

Those matmuls must themselves give a row the same bits for any row count: `invariant_kernels` checks it once
per dtype and grouping; where they do not (fp32 on the CPUs measured), every row is computed alone, as
plain decoding computes it: exact, only slower. On a CPU with a C compiler, engine/kernels.py's compiled
kernel serves instead (a fixed summation order per (row, head) by construction, and far fewer ops a layer).
"""
from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from . import kernels

BLOCK = 64          # keys per block; also the chunk of every fixed-position sum


def fixed_sum(x: torch.Tensor) -> torch.Tensor:
    """Sum over the last dim in chunks of BLOCK at fixed positions: trailing zeros never change a bit."""
    while True:
        pad = -x.shape[-1] % BLOCK
        if pad:
            x = F.pad(x, (0, pad))
        x = x.view(*x.shape[:-1], -1, BLOCK).sum(-1)
        if x.shape[-1] == 1:
            return x[..., 0]


def ancestors_in_order(seen: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """seen [n, n] bool (row i sees row j of this forward, itself included; parents come first) ->
    index [n, m] of each row's ancestors then itself, in depth order, and valid [n, m]."""
    n = seen.shape[1]
    cols = torch.arange(n, device=seen.device)
    count = seen.sum(1)
    index = torch.where(seen, cols, n + cols).argsort(dim=1)[:, :int(count.max())]
    valid = torch.arange(index.shape[1], device=seen.device) < count[:, None]
    return index, valid


def row_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, past: int, seen: torch.Tensor,
                  scale: float) -> torch.Tensor:
    """q [KV, G, n, D] (query heads grouped by their key/value head), keys / values [KV, past + n, D] (the cache
    after this forward's rows were added), seen [n, n] -> [KV, G, n, D]."""
    kv, groups, n, dim = q.shape
    index, valid = ancestors_in_order(seen)
    start = past // BLOCK * BLOCK                  # the first block not wholly committed
    head = past - start                            # committed keys in that block
    span = head + index.shape[1]
    tail_len = span + (-span % BLOCK)
    own_k, own_v = keys[:, past:][:, index], values[:, past:][:, index]            # [KV, n, m, D]

    def tail(x, own):
        shared = x[:, start:past, None].transpose(1, 2).expand(kv, n, head, dim)
        return F.pad(torch.cat([shared, own], dim=2), (0, 0, 0, tail_len - span))  # [KV, n, T, D]

    tail_k, tail_v = tail(keys, own_k), tail(values, own_v)
    live = torch.cat([valid.new_ones(n, head), valid, valid.new_zeros(n, tail_len - span)], dim=1)   # [n, T]

    # scores: whole committed blocks shared by every row, then each row's own tail
    scores = [(q.reshape(kv, groups * n, dim) @ keys[:, :start].transpose(-1, -2)).view(kv, groups, n, start)]
    scores.append((q.permute(0, 2, 1, 3) @ tail_k.transpose(-1, -2)).permute(0, 2, 1, 3))   # [KV, G, n, T]
    s = (torch.cat(scores, dim=-1) * scale).float()
    s[..., start:] = s[..., start:].masked_fill(~live, float("-inf"))
    e = torch.exp(s - s.amax(-1, keepdim=True))
    probs = (e / fixed_sum(e)[..., None]).to(values.dtype)

    blocks_c, blocks_t = start // BLOCK, tail_len // BLOCK
    pc = probs[..., :start].reshape(kv, groups, n, blocks_c, BLOCK).permute(0, 3, 1, 2, 4)
    part_c = pc.reshape(kv, blocks_c, groups * n, BLOCK) @ values[:, :start].view(kv, blocks_c, BLOCK, dim)
    pt = probs[..., start:].reshape(kv, groups, n, blocks_t, BLOCK).permute(0, 2, 3, 1, 4)  # [KV, n, bt, G, B]
    part_t = pt @ tail_v.view(kv, n, blocks_t, BLOCK, dim)                                 # [KV, n, bt, G, D]
    parts = torch.cat([part_c.view(kv, blocks_c, groups, n, dim), part_t.permute(0, 2, 3, 1, 4)], dim=1)
    return fixed_sum(parts.float().permute(0, 2, 3, 4, 1)).to(values.dtype)


def plain_rows(q, keys, values, past: int, seen: torch.Tensor, scale: float) -> torch.Tensor:
    """Every row alone, exactly as plain decoding computes it: the committed context, then its ancestors as
    committed keys, then itself as the one new row."""
    rows = []
    for i in range(q.shape[2]):
        own = ancestors_in_order(seen[i:i + 1])[0][0]
        k_i = torch.cat([keys[:, :past], keys[:, past:][:, own]], dim=1)
        v_i = torch.cat([values[:, :past], values[:, past:][:, own]], dim=1)
        one = torch.ones(1, 1, dtype=torch.bool, device=seen.device)
        rows.append(row_attention(q[:, :, i:i + 1], k_i, v_i, past + len(own) - 1, one, scale))
    return torch.cat(rows, dim=2)


@functools.cache
def invariant_kernels(dtype: torch.dtype, groups: int, dim: int, threads: int) -> bool:
    """Whether row_attention over many rows gives each row the bits plain_rows gives it, for this dtype,
    grouping and thread count (checked once on random data: a kernel's summation order depends on shapes)."""
    gen = torch.Generator().manual_seed(0)
    n = 64
    parents = [-1] + [i // 2 for i in range(n - 1)]          # a binary tree: 6 levels, many siblings
    seen = torch.eye(n, dtype=torch.bool)
    for i, p in enumerate(parents):
        if p >= 0:
            seen[i] |= seen[p]
    with torch.inference_mode():
        for past, rows in ((37, n), (130, 17), (64, 5)):
            q = torch.randn(2, groups, rows, dim, generator=gen).to(dtype)
            k = torch.randn(2, past + rows, dim, generator=gen).to(dtype)
            v = torch.randn(2, past + rows, dim, generator=gen).to(dtype)
            tree = seen[:rows, :rows]
            if not torch.equal(row_attention(q, k, v, past, tree, 0.125), plain_rows(q, k, v, past, tree, 0.125)):
                return False
    return True


def tree_order(mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """From the engine's additive mask [1, 1, n, past + n]: which rows each row sees, and each row's
    ancestors then itself in depth order with their count (the same for every layer of a forward). A small
    tree's comes from a table by its shape: rounds repeat a few shapes, and this runs before every forward."""
    n = mask.shape[2]
    if n == 1 and mask.device.type == "cpu":   # a lone row sees itself (plain decoding's every step)
        return _order_of_shape(1, b"\x01")
    seen = mask[0, 0, :, mask.shape[3] - n:] == 0
    if n > SHAPES_ROWS or seen.device.type != "cpu":
        return seen, *_order(seen)
    return _order_of_shape(n, seen.numpy().tobytes())


SHAPES_ROWS = 32   # trees this small take their order from _order_of_shape


def _order(seen: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    own, valid = ancestors_in_order(seen)
    return own, valid.sum(1)


@functools.lru_cache(maxsize=256)
def _order_of_shape(n: int, shape: bytes) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """tree_order for seen [n, n] given as its bytes (read only: every forward of that shape shares them)."""
    seen = torch.frombuffer(bytearray(shape), dtype=torch.bool).view(n, n)
    return seen, *_order(seen)


def attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, order, scale: float) -> torch.Tensor:
    """q [1, H, n, D], keys / values [1, KV, past + n, D], order = tree_order(mask) -> [1, H, n, D], each
    row's bits independent of the other rows."""
    _, heads, n, dim = q.shape
    kv = keys.shape[1]
    past = keys.shape[2] - n
    seen, own, count = order
    if kernels.usable(q, dim):   # the compiled kernel: one job per (row, head), fixed summation order
        out = kernels.attend(q[0], keys[0], values[0], past, own, count, scale)
        return out.to(values.dtype).transpose(0, 1)[None]
    q = q[0].view(kv, heads // kv, n, dim)
    if n == 1 or invariant_kernels(q.dtype, heads // kv, dim, torch.get_num_threads()):
        out = row_attention(q, keys[0], values[0], past, seen, scale)
    else:
        out = plain_rows(q, keys[0], values[0], past, seen, scale)
    return out.reshape(1, heads, n, dim)
