"""A decoder stack's forward as one compiled call (row_decoder.c): bf16 on a CPU with AVX512-BF16.

Why: a one-row step of a small model is mostly the Python-side calls each layer makes around its compiled
products (views, splits, allocations, ctypes calls). The compiled stack makes the same steps in the same order
(row_matmul.c's products, row_ops.c's norms and rotary embedding, row_attention.c's attention), one call a
forward. Every step computes each row alone in a fixed order, so a row's bits are the same whether the forward
carries it alone or inside a tree (tests/test_fused.py; tests/test_row_invariance.py covers the engine's use).
Two users: the target's verify forward (engine/fast_decoder.py) and the DFlash drafter's pass
(models/dflash.py), whose new context rows only add keys and values; for drafting, `draft` also makes those
rows from the target's features and scores the block with the head in the same call (drafters/dflash.py).
"""
from __future__ import annotations

import ctypes
import weakref
from dataclasses import dataclass

import torch

from . import kernels

_ptr, _i64 = ctypes.c_void_p, ctypes.c_int64


class _Layer(ctypes.Structure):
    _fields_ = [(name, _ptr) for name in ("norm1", "qkv", "o", "norm2", "gate_up", "down", "q_norm", "k_norm",
                                          "keys", "values")] + [("kv_stride", _i64)]


class _Shape(ctypes.Structure):
    _fields_ = [("hidden", _i64), ("heads", _i64), ("kv_heads", _i64), ("dim", _i64), ("inter", _i64),
                ("eps", ctypes.c_float), ("scale", ctypes.c_float), ("threads", ctypes.c_int), ("q4", ctypes.c_int)]


@dataclass(frozen=True)
class LayerWeights:
    """One layer's weights: norms as they are (bf16), products laid out by kernels.row_matmul_pack or, all of
    them, as 4-bit blocks by engine/q4.py (uint8) (q, k, v stacked; gate, up stacked)."""
    norm1: torch.Tensor
    qkv: torch.Tensor
    o: torch.Tensor
    norm2: torch.Tensor
    gate_up: torch.Tensor
    down: torch.Tensor
    q_norm: torch.Tensor | None = None
    k_norm: torch.Tensor | None = None


def available(q4: bool = False) -> bool:
    lib = kernels.decoder_library()
    return lib is not None and (not q4 or bool(lib.decoder_q4_available()))


def shapes_fit(hidden: int, heads: int, kv_heads: int, dim: int, inter: int) -> bool:
    """Shapes the compiled steps take: products in whole 64s of outputs, the attention's and ops' dims."""
    q, kv = heads * dim, kv_heads * dim
    return (hidden % 64 == 0 and (q + 2 * kv) % 64 == 0 and (2 * inter) % 64 == 0 and dim % 16 == 0
            and dim <= 512 and heads % kv_heads == 0)


def pack(weight: torch.Tensor) -> torch.Tensor:
    return kernels.row_matmul_pack(weight.detach().to(torch.bfloat16))


class FusedStack:
    """stack(x [rows, H], keys, values, past, cos, sin, own, count) -> [rows, H]: every layer in one call.

    keys / values: each layer's cache buffers [1, KV, capacity, D] with room for past + context + rows
    positions; this call writes its rows' keys and values at past.. (the caller moves the cache's length)."""

    def __init__(self, layers: list[LayerWeights], final_norm: torch.Tensor | None, *, hidden: int, heads: int,
                 kv_heads: int, dim: int, inter: int, eps: float, scale: float):
        self.layers, self.final_norm = layers, final_norm   # kept alive: the table holds their addresses
        q4 = layers[0].qkv.dtype == torch.uint8
        self.shape = _Shape(hidden, heads, kv_heads, dim, inter, eps, scale, 1, int(q4))
        self.table = (_Layer * len(layers))()
        for row, w in zip(self.table, layers):
            for name in ("norm1", "qkv", "o", "norm2", "gate_up", "down", "q_norm", "k_norm"):
                tensor = getattr(w, name)
                form = torch.uint8 if q4 and name in ("qkv", "o", "gate_up", "down") else torch.bfloat16
                assert tensor is None or (tensor.dtype == form and tensor.is_contiguous())
                setattr(row, name, None if tensor is None else tensor.data_ptr())
        self.checked: tuple[list, list] | None = None   # weak references to the buffers holds() last passed
        self.bound: tuple[list, list] | None = None     # ... and to those the table points into
        self.kernel = kernels.decoder_library().decoder_bf16
        self.drafting = kernels.decoder_library().draft_bf16
        self.heading = kernels.decoder_library().treeflash_head_bf16
        self.hidden = hidden

    def holds(self, keys: list[torch.Tensor], values: list[torch.Tensor]) -> bool:
        """Whether the stack writes into these cache buffers (buffers_fit), checked once per set of buffers."""
        if not same(self.checked, (keys, values)):
            if not buffers_fit(keys, values, self.shape.kv_heads, self.shape.dim):
                return False
            self.checked = refs(keys, values)
        return True

    def bind(self, keys: list[torch.Tensor], values: list[torch.Tensor], context: torch.Tensor | None):
        """The layers' cache buffers and this call's thread count into the table -> (context rows, context)."""
        if not same(self.bound, (keys, values)):   # buffers change only when they grow: a step rebinds none
            for row, k, v in zip(self.table, keys, values):
                row.keys, row.values, row.kv_stride = k.data_ptr(), v.data_ptr(), k.stride(1)
            self.bound = refs(keys, values)
        self.shape.threads = torch.get_num_threads()
        if context is None:
            return 0, None
        return context.shape[0], context.contiguous()

    def __call__(self, x: torch.Tensor, keys: list[torch.Tensor], values: list[torch.Tensor], past: int,
                 cos: torch.Tensor, sin: torch.Tensor, own: torch.Tensor, count: torch.Tensor,
                 context: torch.Tensor | None = None, states: bool = False, normed: bool = True):
        """-> (out [rows, H], every layer's states [layers + 1, rows, H] or None). context [c, H]: rows whose
        keys and values only are made (written before the rows'), seen by every row."""
        rows = x.shape[0]
        x = x.contiguous()
        own, count = own.contiguous(), count.contiguous()
        c, context = self.bind(keys, values, context)
        out = torch.empty(rows, self.hidden, dtype=torch.bfloat16)
        kept = torch.empty(len(self.layers) + 1, rows, self.hidden, dtype=torch.bfloat16) if states else None
        norm = self.final_norm if normed else None
        self.kernel(ctypes.byref(self.shape), _i64(len(self.layers)), self.table,
                    None if norm is None else _ptr(norm.data_ptr()), _i64(past), _i64(c),
                    None if not c else _ptr(context.data_ptr()), _i64(rows), _ptr(x.data_ptr()),
                    None if kept is None else _ptr(kept.data_ptr()), _ptr(out.data_ptr()), _ptr(cos.data_ptr()),
                    _ptr(sin.data_ptr()), _ptr(own.data_ptr()), _ptr(count.data_ptr()), _i64(own.shape[1]))
        return out, kept

    def draft(self, keys: list[torch.Tensor], values: list[torch.Tensor], past: int, cos: torch.Tensor,
              sin: torch.Tensor, own: torch.Tensor, count: torch.Tensor, context: torch.Tensor | None,
              context_in: ContextIn, anchor: int, rows: int, head: torch.Tensor, head_q8: bool,
              extra: torch.Tensor | None, states: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        """A DFlash drafting pass in one call (row_decoder.c's draft_bf16): context [c, k*H] target features
        (their keys and values written at past..), the block [anchor, mask...] of `rows` rows, then the head
        (blocks [groups, blocks, bytes]: Q8_0 where head_q8, else the stack's form) and `extra` bf16 rows [e, H]
        over rows 1.. -> (fp32 logits [rows - 1, head outputs + e], with `states` rows 1.. before and after the
        final norm [2, rows - 1, H] bf16, else None). cos / sin: the table's rows from position `past` on."""
        c, context = self.bind(keys, values, context)
        head_n, extra_n = head.shape[0] * 32, 0 if extra is None else extra.shape[0]
        logits = torch.empty(rows - 1, head_n + extra_n)
        kept = torch.empty(2, rows - 1, self.hidden, dtype=torch.bfloat16) if states else None
        fc, norm, embed = context_in.fc, context_in.norm, context_in.embed
        self.drafting(ctypes.byref(self.shape), _i64(len(self.layers)), self.table, _ptr(self.final_norm.data_ptr()),
                      _i64(past), _i64(c), None if not c else _ptr(context.data_ptr()),
                      _i64(0 if not c else context.shape[1]), _ptr(fc.data_ptr()), _ptr(norm.data_ptr()),
                      _ptr(embed.data_ptr()), _i64(anchor), _i64(context_in.mask_id), _i64(rows),
                      _ptr(cos.data_ptr()), _ptr(sin.data_ptr()), _ptr(own.data_ptr()), _ptr(count.data_ptr()),
                      _i64(own.shape[1]), _ptr(head.data_ptr()), ctypes.c_int(int(head_q8)), _i64(head_n),
                      None if not extra_n else _ptr(extra.data_ptr()), _i64(extra_n), _ptr(logits.data_ptr()),
                      None if kept is None else _ptr(kept.data_ptr()))
        return logits, kept


    def treeflash_head(self, pos: torch.Tensor, prev: torch.Tensor, token_half: TokenHalf, state_half: torch.Tensor,
                       d: torch.Tensor, hidden: torch.Tensor, support: torch.Tensor, lm_head: torch.Tensor,
                       outside: torch.Tensor | None) -> torch.Tensor:
        """TreeFlash's head in one call (row_decoder.c's treeflash_head_bf16): row r conditions block depth
        pos[r] on token prev[r] -> fp32 logits [R, s] over that depth's support [D, s] (lm_head [V, H] rows,
        plus outside [D, s] where given). state_half [D, 2I] and hidden [D, H] (before the final norm) bf16;
        d: the head's last product in the stack's form."""
        rows, s = pos.shape[0], support.shape[1]
        logits = torch.empty(rows, s)
        pos, prev, support = pos.contiguous(), prev.contiguous(), support.contiguous()
        table = token_half.table
        self.shape.threads = torch.get_num_threads()
        self.heading(ctypes.byref(self.shape), _i64(rows), _ptr(pos.data_ptr()), _ptr(prev.data_ptr()),
                     None if table is None else _ptr(table.data_ptr()), _ptr(token_half.embed.data_ptr()),
                     _ptr(token_half.norm.data_ptr()), None if token_half.product is None else
                     _ptr(token_half.product.data_ptr()), _ptr(state_half.data_ptr()), _ptr(d.data_ptr()),
                     _ptr(hidden.data_ptr()), _ptr(self.final_norm.data_ptr()), _ptr(support.data_ptr()), _i64(s),
                     _ptr(lm_head.data_ptr()), None if outside is None else _ptr(outside.data_ptr()),
                     _ptr(logits.data_ptr()))
        return logits


@dataclass(frozen=True)
class TokenHalf:
    """How TreeFlash's head makes a token's half of its first product: a row of `table` [V, 2I] bf16 where
    there is one, else that half (`product`, in the stack's form) over the token's embedding [V, H] after the
    head's norm."""
    table: torch.Tensor | None
    embed: torch.Tensor
    norm: torch.Tensor
    product: torch.Tensor | None


@dataclass(frozen=True)
class ContextIn:
    """What a DFlash drafting pass reads besides its stack: fc laid out as the stack's products, the hidden
    norm over its output, the token embedding table [V, H] bf16 and the mask token's id."""
    fc: torch.Tensor
    norm: torch.Tensor
    embed: torch.Tensor
    mask_id: int


def refs(keys: list[torch.Tensor], values: list[torch.Tensor]) -> tuple[list, list]:
    return [weakref.ref(k) for k in keys], [weakref.ref(v) for v in values]


def same(kept: tuple[list, list] | None, buffers: tuple[list, list]) -> bool:
    """Whether `buffers` are the very tensors kept by weak reference (a freed one never matches: its object is
    gone, whatever address or id a new one takes), so the cache's memory is never held here."""
    return kept is not None and all(len(a) == len(b) and all(r() is t for r, t in zip(a, b))
                                    for a, b in zip(kept, buffers))


def buffers_fit(keys: list[torch.Tensor], values: list[torch.Tensor], kv_heads: int, dim: int) -> bool:
    """Cache buffers the compiled stack writes into: bf16 [1, KV, capacity, D], positions D apart."""
    return all(k.dtype == torch.bfloat16 and k.dim() == 4 and k.shape[1] == kv_heads and k.shape[3] == dim
               and k.stride(3) == 1 and k.stride(2) == dim and v.stride() == k.stride() and v.dtype == k.dtype
               for k, v in zip(keys, values))
