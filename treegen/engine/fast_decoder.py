"""A lean decoder forward for Qwen3 and Llama targets on a CPU, without the module calls, hooks, output
recording and mask preparation around transformers' ops. Two paths:
- invariant (the engine's): row-invariant projections and attention (engine/matmul.py, engine/invariant.py),
  and the norms and rotary embedding as one compiled call each (engine/row_ops.c) where the kernels build;
- plain: transformers' torch ops in the same order on the same shapes (bit for bit the same hidden states
  and cache, tested); one departure, also bit for bit the same: several query rows attend through SDPA's
  grouped-query path instead of a repeated copy of the keys and values.

Why: on a small target much of a one-row step through transformers is per-op Python around ~40 small ops a
layer, not the matrix multiplies; this path drops it (docs/benchmarks.md: ar against hf-generate). It
serves the verify forwards, which always come with the engine's explicit 4D additive mask, and, where the
compiled stack serves, the prompt's (engine/target.py gives each chunk of it as a chain).
"""
from __future__ import annotations

import weakref
from collections.abc import Sequence

import torch
import torch.nn.functional as F

from . import fused, invariant, kernels
from .cache import step_buffers
from .forms import OWN, own_weight
from .int8 import Int8Weight
from .matmul import Matmul, RowMatmul, matmul_for
from .q4 import Q4Weight
from .rope import RopeTable

ARCHITECTURES = ("qwen3", "llama")
_built: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()   # model -> (weights' version, invariant, decoder)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    dtype = x.dtype
    x = x.to(torch.float32)
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x.to(dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def plain_linear(module) -> bool:
    """An unquantised nn.Linear without bias (what the lean path multiplies by directly)."""
    return type(module) is torch.nn.Linear and module.bias is None and module.weight.dtype.is_floating_point


def lean_linear(module) -> bool:
    """A linear layer the lean path multiplies by directly: a plain one, or one of treegen's own forms."""
    return plain_linear(module) or type(module) in OWN


def weight_of(module) -> torch.Tensor | Int8Weight | Q4Weight:
    own = own_weight(module)
    return module.weight if own is None else own


def products(make):
    """make(*float weights) -> a product; treegen's own forms are their own product, stacked (row-invariant
    already); weights of mixed forms (a projection whose shape no block fits beside ones that took blocks)
    each their own product, side by side."""
    def own(x) -> bool:
        return isinstance(x, (Int8Weight, Q4Weight))

    def product(*w):
        if len({type(x) for x in w}) > 1:
            parts = [x if own(x) else make(x) for x in w]
            return lambda x: torch.cat([part(x) for part in parts], dim=-1)
        return type(w[0]).stack(*w) if own(w[0]) else make(*w)
    return product


def supported(model) -> bool:
    """A Qwen3 / Llama causal LM on the CPU with default RoPE, SiLU, no biases, no quantisation."""
    config = getattr(model, "config", None)
    if config is None or getattr(config, "model_type", None) not in ARCHITECTURES or model.device.type != "cpu":
        return False
    if model.training:   # transformers applies attention dropout then
        return False
    rope = getattr(config, "rope_parameters", None) or {}
    if rope.get("rope_type", "default") != "default" or config.hidden_act != "silu":
        return False
    if getattr(config, "_attn_implementation", None) != "sdpa":
        return False
    try:
        decoder = model.get_decoder()
        layers = list(decoder.layers)
        if getattr(decoder.rotary_emb, "attention_scaling", 1.0) != 1.0:
            return False
        linears = [m for layer in layers for m in (*_attention(layer.self_attn), *_mlp(layer.mlp))]
    except (AttributeError, NotImplementedError, TypeError):
        return False
    sliding = any(t != "full_attention" for t in getattr(config, "layer_types", None) or ())
    return bool(layers) and not sliding and all(lean_linear(m) for m in linears)


def _attention(attn):
    return attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj


def _mlp(mlp):
    return mlp.gate_proj, mlp.up_proj, mlp.down_proj


class Projections:
    """Several projections of one input (q, k, v; gate, up): one RowMatmul over their stacked weights (one
    call instead of several, row-invariant like any RowMatmul), or each alone (transformers' kernels)."""

    def __init__(self, weights, make, fuse: bool):
        self.sizes = [w.shape[0] for w in weights]
        self.parts = [make(*weights)] if fuse else [make(w) for w in weights]

    def __call__(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        if len(self.parts) == 1:
            return self.parts[0](x).split(self.sizes, dim=-1)
        return tuple(part(x) for part in self.parts)


def decoder_for(model, invariant: bool = True) -> FastDecoder:
    """The model's FastDecoder, built once and kept as long as the model while its weights stay the same
    tensors at the same version (a cast or an in-place change builds it again): building one stacks and lays
    out every layer's products (for 4-bit blocks, copies of the q, k, v and gate, up blocks side by side)."""
    version = weights_version((*model.parameters(), *model.buffers()))
    kept = _built.get(model)
    if kept is None or kept[:2] != (version, invariant):
        kept = _built[model] = (version, invariant, FastDecoder(model, invariant))
    return kept[2]


def weights_version(tensors) -> tuple:
    """What a layout built from these tensors depends on: each one's storage, version and dtype (a cast, a
    move or an in-place change gives another)."""
    return tuple((t.data_ptr(), t._version, t.dtype) for t in tensors)


class FastDecoder:
    """decoder(ids, positions, mask, cache) -> (last hidden state [1, n, H], hidden states as transformers
    returns them: the embeddings, each layer's output, the last replaced by its final norm).
    invariant: row-invariant projections and attention (the engine's); else transformers' own kernels."""

    def __init__(self, model, invariant: bool = True):
        config = model.config
        self.invariant = invariant
        mm = products((lambda *w: matmul_for(model, *w)) if invariant else Matmul.plain)
        decoder = model.get_decoder()
        self.eps, self.head_dim = config.rms_norm_eps, config.head_dim if getattr(config, "head_dim", None) \
            else config.hidden_size // config.num_attention_heads
        self.groups = config.num_attention_heads // config.num_key_value_heads
        self.scale = decoder.layers[0].self_attn.scaling
        self.embed, self.norm = decoder.embed_tokens.weight, decoder.norm.weight
        self.rope = RopeTable(decoder.rotary_emb.inv_freq, self.embed.dtype)
        self.layers = []
        for layer in decoder.layers:
            attn = layer.self_attn
            qk_norm = (attn.q_norm.weight, attn.k_norm.weight) if hasattr(attn, "q_norm") else None
            q, k, v, o = (weight_of(m) for m in _attention(attn))
            gate, up, down = (weight_of(m) for m in _mlp(layer.mlp))
            self.layers.append((layer.input_layernorm.weight, Projections((q, k, v), mm, invariant), mm(o),
                                qk_norm, layer.post_attention_layernorm.weight,
                                Projections((gate, up), mm, invariant), mm(down)))
        self.stack = self.compiled_stack(config) if invariant else None

    def compiled_stack(self, config) -> fused.FusedStack | None:
        """Every layer in one compiled call (engine/fused.py) where every product took the compiled bf16 form
        (a weight whose measurement chose another keeps the per-layer path), or every one is 4-bit blocks, and
        the shapes fit."""
        q4 = isinstance(self.layers[0][2], Q4Weight)
        if not fused.available(q4) or self.embed.dtype != torch.bfloat16:
            return None
        heads, kv = config.num_attention_heads, config.num_key_value_heads
        if not fused.shapes_fit(config.hidden_size, heads, kv, self.head_dim, config.intermediate_size):
            return None
        weights = []
        for norm1, qkv, wo, qk_norm, norm2, gate_up, wd in self.layers:
            products = (*qkv.parts, wo, *gate_up.parts, wd)
            if len(products) != 4 or not all(isinstance(p, Q4Weight) if q4 else
                                             isinstance(p, RowMatmul) and p.packed is not None for p in products):
                return None
            q_norm, k_norm = qk_norm or (None, None)
            weights.append(fused.LayerWeights(norm1, qkv.parts[0].packed, wo.packed, norm2, gate_up.parts[0].packed,
                                              wd.packed, q_norm, k_norm))
        return fused.FusedStack(weights, self.norm, hidden=config.hidden_size, heads=heads, kv_heads=kv,
                                dim=self.head_dim, inter=config.intermediate_size, eps=self.eps, scale=self.scale)

    def __call__(self, ids, positions, mask, cache) -> tuple[torch.Tensor, Sequence[torch.Tensor]]:
        x = F.embedding(ids, self.embed)
        cos, sin = (t[:, None] for t in self.rope(positions))
        if self.stack is not None and ids.shape[0] == 1:
            done = self.compiled(x, cos, sin, mask, cache)
            if done is not None:
                return done
        # the invariant path's norms and rotary embedding: one compiled call each (row_ops.c), where built
        compiled = self.invariant and ids.shape[0] == 1 and kernels.ops_usable(x, self.head_dim) \
            and kernels.ops_usable(x, x.shape[-1])
        norm = kernels.rms_norm if compiled else rms_norm
        hidden = [x]
        order = invariant.tree_order(mask) if self.invariant else None
        for i, (norm1, qkv, wo, qk_norm, norm2, gate_up, wd) in enumerate(self.layers):
            x = x + self.attention(norm(x, norm1, self.eps), qkv, wo, qk_norm, cos, sin, mask, order,
                                   cache.layers[i], compiled)
            gate, up = gate_up(norm(x, norm2, self.eps))
            x = x + wd(F.silu(gate) * up)
            hidden.append(x)
        hidden[-1] = norm(x, self.norm, self.eps)
        return hidden[-1], hidden

    def compiled(self, x, cos, sin, mask, cache) -> tuple[torch.Tensor, Sequence[torch.Tensor]] | None:
        """__call__ through the compiled stack, or None where the cache is not one it writes into."""
        n, layers = x.shape[1], cache.layers
        past = layers[0].get_seq_length()
        like = x.new_empty(1, self.stack.shape.kv_heads, 0, self.head_dim)   # a prompt's forward starts the cache
        buffers = step_buffers(layers, past + n, like)
        if buffers is None:
            return None
        keys, values = buffers
        if not self.stack.holds(keys, values):
            return None
        _, own, count = invariant.tree_order(mask)
        last, states = self.stack(x[0], keys, values, past, cos.view(n, -1), sin.view(n, -1), own, count,
                                  states=True)
        for layer in layers:
            layer.advance(past + n)
        return last[None], states[:, None]   # indexes as the list transformers returns, without 31 objects made

    def attention(self, h, qkv, wo, qk_norm, cos, sin, mask, order, layer, compiled=False) -> torch.Tensor:
        batch, n, _ = h.shape
        shape = (batch, n, -1, self.head_dim)
        q, k, v = (t.view(shape) for t in qkv(h))
        if compiled:   # rotated in place before the heads move to dim 1 (cos / sin [n, D])
            if qk_norm is not None:
                q, k = kernels.rms_norm(q, qk_norm[0], self.eps), kernels.rms_norm(k, qk_norm[1], self.eps)
            table_cos, table_sin = cos.view(n, -1), sin.view(n, -1)
            q, k = kernels.rope_(q, table_cos, table_sin), kernels.rope_(k, table_cos, table_sin)
            q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        else:
            if qk_norm is not None:
                q, k = rms_norm(q, qk_norm[0], self.eps), rms_norm(k, qk_norm[1], self.eps)
            q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
            q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
        keys, values = layer.update(k, v)
        if self.invariant:
            out = invariant.attention(q, keys, values, order, self.scale)
            return wo(out.transpose(1, 2).reshape(batch, n, -1))
        if n == 1:   # transformers packs one query's heads by key/value group instead of repeating K/V
            q = q.reshape(batch, q.shape[1] // self.groups, self.groups, self.head_dim)
        # several rows: transformers repeats K/V per query head; SDPA's own grouped-query path gives the same
        # bits without copying the whole cache every layer (tests/test_fast_decoder.py holds it to that)
        gqa = n > 1 and self.groups > 1
        out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=self.scale, enable_gqa=gqa)
        out = out.reshape(batch, -1, n, self.head_dim).transpose(1, 2).contiguous()
        return wo(out.reshape(batch, n, -1).contiguous())

