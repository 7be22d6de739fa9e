"""The DFlash block-diffusion drafter (z-lab layout): Qwen3 decoder layers whose keys/values are the
target's fused hidden features followed by the block, with bidirectional attention inside the block.

It has no embedding and no lm_head: it embeds with the target's embed_tokens and scores with its lm_head.
Only the projected context K/V are cached across rounds; block K/V are recomputed every round.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from ..engine import fused, kernels, matmul
from ..engine.cache import room
from ..engine.fast_decoder import Projections, weights_version
from ..engine.matmul import product
from ..engine.q4 import Q4Weight
from ..engine.rope import RopeTable, per_forward


@dataclass(frozen=True)
class DFlashConfig:
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    num_target_layers: int
    target_layer_ids: tuple[int, ...]
    mask_token_id: int
    vocab_size: int
    block_size: int = 16
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    max_position_embeddings: int = 40960
    hidden_act: str = "silu"
    extra: dict = field(default_factory=dict, compare=False)  # config.json fields kept for the round trip


def default_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> tuple[int, ...]:
    """Evenly spread over the target, skipping the first and the last few layers (z-lab's rule); a target
    too shallow for that rule gets an even spread over all its layers."""
    if num_draft_layers == 1:
        return (num_target_layers // 2,)
    span = num_target_layers - 4
    if span < num_draft_layers - 1:
        span, first = num_target_layers - 1, 0
    else:
        first = 1
    return tuple(round(first + i * span / (num_draft_layers - 1)) for i in range(num_draft_layers))


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight, self.eps = nn.Parameter(torch.ones(dim)), eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not torch.is_grad_enabled() and x.dtype == self.weight.dtype and kernels.ops_usable(x, x.shape[-1]):
            return kernels.rms_norm(x, self.weight, self.eps)   # drafting: one compiled call, not eight ops
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


class Rotary(nn.Module):
    def __init__(self, head_dim: int, theta: float):
        super().__init__()
        # fp32 whatever the drafter's dtype: not a buffer, so that module.to(bf16) cannot round it (a bf16
        # frequency is off by up to 0.4%: radians of phase by position 1000)
        self.inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim)
        self.tables: dict[torch.dtype, RopeTable] = {}   # drafting's cos / sin by dtype

    def forward(self, positions: torch.Tensor, dtype: torch.dtype):
        """positions [b, L] -> (cos, sin) [b, 1, L, head_dim] for broadcasting over heads; drafting on a CPU
        looks them up (engine/rope.py), training makes them."""
        if self.inv_freq.device != positions.device:
            self.inv_freq = self.inv_freq.to(positions.device)
        if positions.device.type == "cpu" and not torch.is_grad_enabled():
            return tuple(t[:, None] for t in self.table(dtype)(positions))
        emb = per_forward(positions, self.inv_freq)[:, None]
        return emb.cos().to(dtype), emb.sin().to(dtype)

    def table(self, dtype: torch.dtype) -> RopeTable:
        """Drafting's cos / sin table in `dtype` on the CPU."""
        table = self.tables.get(dtype)
        if table is None:
            table = self.tables[dtype] = RopeTable(self.inv_freq, dtype)
        return table


def rope(x: torch.Tensor, cos_sin) -> torch.Tensor:
    cos, sin = cos_sin
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


class Stacked:
    """Several projections of one input as one product over their stacked weights (the verify forward's
    Projections; drafting: one call instead of two or three), made again when a weight changes (a cast, or a
    drafter trained after it drafted). form: the product's (engine/matmul.product; DFlashDrafter.quantize_products)."""

    def __init__(self, *linears: nn.Linear):
        self.linears, self.versions, self.projections = linears, None, None
        self.form = "float"

    def __call__(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        versions = [(m.weight.data_ptr(), m.weight._version, m.weight.dtype, self.form) for m in self.linears]
        if versions != self.versions:
            weights = [m.weight.detach() for m in self.linears]
            self.projections = Projections(weights, lambda *w: product(torch.cat(w), self.form), fuse=True)
            self.versions = versions
        return self.projections(x)


def lean(x: torch.Tensor, head_dim: int) -> bool:
    """Drafting (no autograd) one block on a CPU where the compiled norms and rotary embedding serve."""
    return not torch.is_grad_enabled() and x.shape[0] == 1 and kernels.ops_usable(x, head_dim)


class ContextKV:
    """Per-layer projected context keys/values in buffers that double when full (engine/cache.room); each
    round appends its new context and writes its block's K/V right after it, where the next round overwrites
    them (never kept)."""

    def __init__(self, num_layers: int):
        self.keys: list[torch.Tensor | None] = [None] * num_layers
        self.values: list[torch.Tensor | None] = [None] * num_layers
        self.lengths = [0] * num_layers

    @property
    def length(self) -> int:
        return self.lengths[0]

    def extend(self, layer: int, k_ctx, v_ctx, k_blk, v_blk) -> tuple[torch.Tensor, torch.Tensor]:
        """Append the context's [1, KV, n, D] keys / values; -> the whole context's, then the block's."""
        end = self.lengths[layer] + k_ctx.shape[-2] + k_blk.shape[-2]
        keys, values = self.write(layer, torch.cat([k_ctx, k_blk], dim=-2), torch.cat([v_ctx, v_blk], dim=-2),
                                  k_ctx.shape[-2])
        return keys[..., :end, :], values[..., :end, :]

    def buffers(self, rows: int, like: torch.Tensor) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Every layer's key and value buffers with room for `rows` more positions, for a writer that fills them
        itself (engine/fused.py) and then calls advance(). like: [1, KV, *, D] of the buffers' dtype."""
        for i, length in enumerate(self.lengths):
            self.keys[i] = room(self.keys[i], like, length, length + rows)
            self.values[i] = room(self.values[i], like, length, length + rows)
        return self.keys, self.values

    def advance(self, new_context: int) -> None:
        self.lengths = [length + new_context for length in self.lengths]

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor, new_context: int):
        """k / v [1, KV, rows, D]: the new context's rows then the block's, written after the cached context
        (the block's to be overwritten next round) -> the layer's key and value buffers [1, KV, capacity, D]."""
        start = self.lengths[layer]
        end = start + k.shape[-2]
        keys = self.keys[layer] = room(self.keys[layer], k, start, end)
        values = self.values[layer] = room(self.values[layer], v, start, end)
        keys[..., start:end, :], values[..., start:end, :] = k, v
        self.lengths[layer] = start + new_context
        return keys, values


class Attention(nn.Module):
    def __init__(self, c: DFlashConfig):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        self.q_proj = nn.Linear(c.hidden_size, c.num_attention_heads * c.head_dim, bias=False)
        self.k_proj = nn.Linear(c.hidden_size, c.num_key_value_heads * c.head_dim, bias=False)
        self.v_proj = nn.Linear(c.hidden_size, c.num_key_value_heads * c.head_dim, bias=False)
        self.o_proj = nn.Linear(c.num_attention_heads * c.head_dim, c.hidden_size, bias=False)
        self.q_norm = RMSNorm(c.head_dim, c.rms_norm_eps)
        self.k_norm = RMSNorm(c.head_dim, c.rms_norm_eps)
        self.qkv, self.kv = Stacked(self.q_proj, self.k_proj, self.v_proj), Stacked(self.k_proj, self.v_proj)
        self.out = Stacked(self.o_proj)
        self.stacked_heads = (self.heads, self.kv_heads, self.kv_heads)

    def _kv(self, x: torch.Tensor, cos_sin):
        b, n, _ = x.shape
        k = self.k_norm(self.k_proj(x).view(b, n, self.kv_heads, self.head_dim)).transpose(1, 2)
        v = self.v_proj(x).view(b, n, self.kv_heads, self.head_dim).transpose(1, 2)
        return rope(k, cos_sin), v

    def forward(self, x, ctx, rope_x, rope_ctx, cache: ContextKV | None, layer: int, mask):
        if lean(x, self.head_dim) and x.dtype == self.q_proj.weight.dtype:
            return self.drafting(x, ctx, rope_x, rope_ctx, cache, layer, mask)
        b, q_len, _ = x.shape
        q = self.q_norm(self.q_proj(x).view(b, q_len, self.heads, self.head_dim)).transpose(1, 2)
        k_ctx, v_ctx = self._kv(ctx, rope_ctx)
        k_blk, v_blk = self._kv(x, rope_x)
        if cache is not None:
            k, v = cache.extend(layer, k_ctx, v_ctx, k_blk, v_blk)
        else:
            k, v = torch.cat([k_ctx, k_blk], dim=-2), torch.cat([v_ctx, v_blk], dim=-2)
        out = F.scaled_dot_product_attention(rope(q, rope_x), k, v, attn_mask=mask,
                                             enable_gqa=self.heads != self.kv_heads)
        return self.o_proj(out.transpose(1, 2).reshape(b, q_len, -1))

    def drafting(self, x, ctx, rope_x, rope_ctx, cache: ContextKV | None, layer: int, mask):
        """forward() for one block without autograd: the block's q/k/v and the context's k/v one product each,
        norms and rotary embedding one compiled call each, rotated before the heads move to dim 1."""
        q_len, c_len, d = x.shape[1], ctx.shape[1], self.head_dim
        q, k_blk, v_blk = (t.view(1, q_len, heads, d) for t, heads in zip(self.qkv(x), self.stacked_heads))
        q, k_blk = kernels.rms_norm(q, self.q_norm.weight, self.q_norm.eps), \
            kernels.rms_norm(k_blk, self.k_norm.weight, self.k_norm.eps)
        cos_x, sin_x = (t.reshape(q_len, d) for t in rope_x)
        q, k_blk = kernels.rope_(q, cos_x, sin_x), kernels.rope_(k_blk, cos_x, sin_x)
        k_ctx, v_ctx = (t.view(1, c_len, self.kv_heads, d) for t in self.kv(ctx))
        if c_len:
            k_ctx = kernels.rms_norm(k_ctx, self.k_norm.weight, self.k_norm.eps)
            k_ctx = kernels.rope_(k_ctx, *(t.reshape(c_len, d) for t in rope_ctx))
        k_ctx, v_ctx, k_blk, v_blk = (t.transpose(1, 2) for t in (k_ctx, v_ctx, k_blk, v_blk))
        if cache is not None:
            k, v = cache.extend(layer, k_ctx, v_ctx, k_blk, v_blk)
        else:
            k, v = torch.cat([k_ctx, k_blk], dim=-2), torch.cat([v_ctx, v_blk], dim=-2)
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k, v, attn_mask=mask,
                                             enable_gqa=self.heads != self.kv_heads)
        return self.out(out.transpose(1, 2).reshape(1, q_len, -1))[0]

    def lean(self, h: torch.Tensor, ctx: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: ContextKV,
             layer: int) -> torch.Tensor:
        """drafting() in fewer, compiled steps (DFlashDrafter.lean_pass): the new context's and the block's rows
        in one q/k/v product where the context is short, k's norm and rotary embedding one call over all of
        them, written straight into the cache, and the block's attention by the compiled kernel (every block
        row sees the whole context and the whole block). cos / sin [context rows + block rows, D]."""
        c, n, d = ctx.shape[1], h.shape[1], self.head_dim
        if c <= n:   # a round's few new context rows: one call (their q is computed and dropped)
            q, k, v = self.qkv(torch.cat([ctx, h], dim=1) if c else h)
            q = q[:, c:]
        else:        # the prompt's rows on the first round: no q for them
            q, k_blk, v_blk = self.qkv(h)
            k_ctx, v_ctx = self.kv(ctx)
            k, v = torch.cat([k_ctx, k_blk], dim=1), torch.cat([v_ctx, v_blk], dim=1)
        q = kernels.rms_norm(q.reshape(1, n, self.heads, d), self.q_norm.weight, self.q_norm.eps)
        k = kernels.rms_norm(k.reshape(1, c + n, self.kv_heads, d), self.k_norm.weight, self.k_norm.eps)
        q, k = kernels.rope_(q, cos[c:], sin[c:]), kernels.rope_(k, cos, sin)
        keys, values = cache.write(layer, k.transpose(1, 2), v.reshape(1, c + n, self.kv_heads, d).transpose(1, 2), c)
        past = cache.lengths[layer]
        own, count = block_rows(n)
        out = kernels.attend(q[0].transpose(0, 1), keys[0], values[0], past, own, count, d ** -0.5)
        return self.out(out.view(1, n, -1).to(h.dtype))[0]


@functools.cache
@functools.cache   # read only: drafting asks for the same few sizes every round
def block_rows(n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The compiled attention's per-row key lists for a block that sees itself whole: every row, rows 0..n-1."""
    return torch.arange(n).repeat(n, 1).contiguous(), torch.full((n,), n, dtype=torch.long)


class MLP(nn.Module):
    def __init__(self, c: DFlashConfig):
        super().__init__()
        self.gate_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.up_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.down_proj = nn.Linear(c.intermediate_size, c.hidden_size, bias=False)
        self.gate_up, self.down = Stacked(self.gate_proj, self.up_proj), Stacked(self.down_proj)

    def forward(self, x):
        if not torch.is_grad_enabled() and x.device.type == "cpu":   # drafting: gate and up one product
            gate, up = self.gate_up(x)
            return self.down(F.silu(gate) * up)[0]
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Layer(nn.Module):
    def __init__(self, c: DFlashConfig):
        super().__init__()
        self.self_attn, self.mlp = Attention(c), MLP(c)
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)

    def forward(self, x, ctx, rope_x, rope_ctx, cache, layer, mask):
        x = x + self.self_attn(self.input_layernorm(x), ctx, rope_x, rope_ctx, cache, layer, mask)
        return x + self.mlp(self.post_attention_layernorm(x))


class DFlashDrafter(nn.Module):
    """forward(block embeddings, context features) -> block hidden states (before the target's lm_head)."""

    def __init__(self, config: DFlashConfig):
        super().__init__()
        self.config = config
        self.layers = nn.ModuleList(Layer(config) for _ in range(config.num_hidden_layers))
        self.fc = nn.Linear(len(config.target_layer_ids) * config.hidden_size, config.hidden_size, bias=False)
        self.fc_product = Stacked(self.fc)
        self.hidden_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary = Rotary(config.head_dim, config.rope_theta)
        self._stack: fused.FusedStack | None = None   # compiled_stack(), laid out for these weights' versions
        self._stack_fc: torch.Tensor | None = None     # fc in the stack's layout, made with it
        self._stack_version: tuple | None = None
        self._params: list[nn.Parameter] | None = None

    def quantize_products(self, form: str = "int8") -> None:
        """Drafting's products in `form` (engine/matmul.product): int8 (a quarter of fp32's bytes a pass, where
        a CPU has no fast bf16) or 4-bit blocks (beside a q4 target); drafts only propose, so this changes what
        is drafted, never what is generated."""
        for module in self.modules():
            for value in vars(module).values():
                if isinstance(value, Stacked):
                    value.form = form

    def project_context(self, features: torch.Tensor) -> torch.Tensor:
        """[.., T, k*H] target features -> [.., T, H] context hidden states."""
        if not torch.is_grad_enabled() and features.device.type == "cpu":   # drafting: the measured product
            return self.hidden_norm(self.fc_product(features)[0])
        return self.hidden_norm(self.fc(features))

    def forward(self, block: torch.Tensor, block_pos: torch.Tensor, ctx: torch.Tensor, ctx_pos: torch.Tensor,
                cache: ContextKV | None = None, mask: torch.Tensor | None = None, normed: bool = True) -> torch.Tensor:
        """block [b, Q, H] embeddings at block_pos [b, Q]; ctx [b, C, H] projected context at ctx_pos.

        With a cache, ctx holds only the new context rows and the cached ones are attended too.
        mask: None (every query sees all keys) or bool/additive [b, 1, Q, C_total + Q].
        normed=False returns the states before the final norm (heads such as TreeFlash's add to them first).
        """
        if mask is None and cache is not None and self.lean_usable(block):
            return self.lean_pass(block, block_pos, ctx, ctx_pos, cache, normed)
        rope_x, rope_ctx = self.rotary(block_pos, block.dtype), self.rotary(ctx_pos, block.dtype)
        x = block
        for i, layer in enumerate(self.layers):
            x = layer(x, ctx, rope_x, rope_ctx, cache, i, mask)
        return self.norm(x) if normed else x

    def lean_usable(self, block: torch.Tensor) -> bool:
        """Drafting one block on a CPU where the compiled norms, rotary embedding and attention all serve."""
        c = self.config
        return lean(block, c.head_dim) and kernels.usable(block, c.head_dim) \
            and kernels.ops_usable(block, c.hidden_size) and block.dtype == self.fc.weight.dtype

    def compiled_stack(self, block: torch.Tensor) -> fused.FusedStack | None:
        """The layers as one compiled call (engine/fused.py) for bf16 drafting on AVX512-BF16 (its products as
        4-bit blocks in that form), laid out again when a weight changes (a cast, a training step); None where
        it does not serve (int8 products, shapes)."""
        c, form = self.config, self.fc_product.form
        blocks = form == matmul.BLOCKS
        if block.dtype != torch.bfloat16 or form == matmul.INT8 or not fused.available(blocks) \
                or not fused.shapes_fit(c.hidden_size, c.num_attention_heads, c.num_key_value_heads, c.head_dim,
                                        c.intermediate_size):
            return None
        if self._params is None:   # walking the modules each pass costs more than the check itself
            self._params = list(self.parameters())
        params = self._params
        version = weights_version(params) + (form,)
        if self._stack_version != version:
            if any(p.dtype != torch.bfloat16 for p in params):
                return None
            pack = (lambda w: Q4Weight.quantize(w).packed) if blocks else fused.pack
            layers = []
            for layer in self.layers:
                attn, mlp = layer.self_attn, layer.mlp
                layers.append(fused.LayerWeights(
                    layer.input_layernorm.weight.detach(),
                    pack(torch.cat([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight])),
                    pack(attn.o_proj.weight), layer.post_attention_layernorm.weight.detach(),
                    pack(torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight])), pack(mlp.down_proj.weight),
                    attn.q_norm.weight.detach(), attn.k_norm.weight.detach()))
            self._stack_fc = pack(self.fc.weight)   # the drafting pass's context projection (fused.FusedStack.draft)
            self._stack = fused.FusedStack(layers, self.norm.weight.detach(), hidden=c.hidden_size,
                                           heads=c.num_attention_heads, kv_heads=c.num_key_value_heads,
                                           dim=c.head_dim, inter=c.intermediate_size, eps=c.rms_norm_eps,
                                           scale=c.head_dim ** -0.5)
            self._stack_version = version
        return self._stack

    def context_in(self, embed: torch.Tensor) -> fused.ContextIn:
        """What the compiled stack's drafting pass reads besides the layers (after compiled_stack())."""
        return fused.ContextIn(self._stack_fc, self.hidden_norm.weight.detach(), embed, self.config.mask_token_id)

    def lean_pass(self, block, block_pos, ctx, ctx_pos, cache: ContextKV, normed: bool) -> torch.Tensor:
        """forward() for drafting (lean_usable): Attention.lean per layer. Drafts only propose, so its bits
        need not be forward()'s (tests/test_dflash.py holds the two close)."""
        positions = torch.cat([ctx_pos, block_pos], dim=-1)
        cos, sin = (t.reshape(positions.shape[-1], -1) for t in self.rotary(positions, block.dtype))
        stack = self.compiled_stack(block)
        if stack is not None:   # every layer in one compiled call
            c, n, d = ctx.shape[1], block.shape[1], self.config.head_dim
            like = block.new_empty(1, self.config.num_key_value_heads, 0, d)
            keys, values = cache.buffers(c + n, like)
            own, count = block_rows(n)
            out, _ = stack(block[0], keys, values, cache.length, cos, sin, own, count,
                           context=ctx[0] if c else None, normed=normed)
            cache.advance(c)
            return out[None]
        x = block
        for i, layer in enumerate(self.layers):
            x = x + layer.self_attn.lean(layer.input_layernorm(x), ctx, cos, sin, cache, i)
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        return self.norm(x) if normed else x
