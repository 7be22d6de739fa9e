"""The target's KV cache: checked once for compactability, then compacted to each round's accepted path."""
from __future__ import annotations

import ctypes

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

MIN_CAPACITY = 256   # positions a layer's buffers start with; they double when full


class CacheError(RuntimeError):
    pass


def room(buffer: torch.Tensor | None, like: torch.Tensor, kept: int, end: int) -> torch.Tensor:
    """`buffer` [..., positions, D] if it holds `end` positions, else a new one of `like`'s dtype and device
    (twice the old size, at least MIN_CAPACITY) holding the old one's first `kept` positions: rows appended
    in place cost only themselves, and a full buffer doubles."""
    if buffer is not None and end <= buffer.shape[-2]:
        return buffer
    capacity = max(end, MIN_CAPACITY, 2 * (0 if buffer is None else buffer.shape[-2]))
    grown = like.new_empty(*like.shape[:-2], capacity, like.shape[-1])
    if buffer is not None and kept:
        grown[..., :kept, :] = buffer[..., :kept, :]
    return grown


class GrowingLayer(DynamicLayer):
    """transformers' DynamicLayer with its keys and values kept as views of buffers that double when full:
    a step copies its own rows in, where DynamicLayer concatenates the whole cache at every layer and step.
    Cropping shortens the view; anything that sets keys / values (offloading, batch selection) hands over
    a tensor that becomes the buffer."""

    def __init__(self, **kwargs):
        self._length = 0
        self._keys = self._values = None
        super().__init__(**kwargs)

    @property
    def keys(self):
        return None if self._keys is None else self._keys[..., :self._length, :]

    @keys.setter
    def keys(self, tensor):
        self._keys = tensor
        self._length = 0 if tensor is None or tensor.dim() < 2 else tensor.shape[-2]

    @property
    def values(self):
        return None if self._values is None else self._values[..., :self._length, :]

    @values.setter
    def values(self, tensor):
        self._values = tensor

    @property
    def started(self) -> bool:
        """Whether the layer holds buffers (made by its first update or buffers())."""
        return self.is_initialized and self._keys is not None and self._keys.dim() >= 2

    def update(self, key_states, value_states, *args, **kwargs):
        if not self.started:
            self.device, self.is_initialized = key_states.device, True
            self._keys = self._values = None
            self._length = 0
        start, end = self._length, self._length + key_states.shape[-2]
        self._keys = room(self._keys, key_states, start, end)
        self._values = room(self._values, value_states, start, end)
        self._keys[..., start:end, :] = key_states
        self._values[..., start:end, :] = value_states
        self._length = end
        return self.keys, self.values

    def get_seq_length(self) -> int:
        return self._length if self.is_initialized else 0

    def buffers(self, end: int, like: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The key and value buffers with room for `end` positions, for a writer that fills them itself and
        then moves the length (engine/fused.py); before the first update, new ones shaped, typed and placed
        as `like` [1, KV, 0, D] (None without it)."""
        if not self.started:
            if like is None:
                return None
            self.device, self.is_initialized, self._length = like.device, True, 0
            self._keys, self._values = room(None, like, 0, end), room(None, like, 0, end)
            return self._keys, self._values
        self._keys = room(self._keys, self._keys, self._length, end)
        self._values = room(self._values, self._values, self._length, end)
        return self._keys, self._values

    def advance(self, end: int) -> None:
        self._length = end

    def crop(self, tokens_to_remove: int) -> None:
        if tokens_to_remove > 0:
            raise ValueError(f"crop takes a negative count of positions to drop, not {tokens_to_remove}")
        if self.is_initialized:
            self._length = max(self._length + tokens_to_remove, 0)


def step_buffers(layers: list, end: int, like: torch.Tensor) -> tuple[list, list] | None:
    """Every layer's key and value buffers with room for `end` positions (GrowingLayer.buffers), or None where
    a layer is not a GrowingLayer or has none to give. The layers grow together, so a step finds room in all
    of them but at a doubling: then it reads the buffers without a call per layer."""
    if not all(type(layer) is GrowingLayer for layer in layers):
        return None
    keys, values = [layer._keys for layer in layers], [layer._values for layer in layers]
    if all(layer.started and end <= k.shape[-2] for layer, k in zip(layers, keys)):
        return keys, values
    buffers = [layer.buffers(end, like) for layer in layers]
    if any(b is None for b in buffers):
        return None
    return [b[0] for b in buffers], [b[1] for b in buffers]


def new_cache(model):
    """transformers' DynamicCache for the model's config, its full-attention layers growing in place."""
    cache = DynamicCache(config=model.config)
    cache.layers = [GrowingLayer() if type(layer) is DynamicLayer else layer for layer in cache.layers]
    return cache


def check_compactable(cache) -> None:
    """Tree verification rewrites cache rows in place; say up front which caches cannot take it."""
    for i, layer in enumerate(getattr(cache, "layers", [])):
        if getattr(layer, "is_sliding", False):
            raise CacheError(f"layer {i} uses a sliding-window cache; tree verification needs full KV rows")
        if not getattr(layer, "is_croppable", True) or not hasattr(layer, "keys"):
            raise CacheError(f"layer {i} has a {type(layer).__name__}, which cannot be compacted")


def cache_length(cache) -> int:
    return cache.get_seq_length()


def compact(cache, past_len: int, keep_rows: list[int]) -> None:
    """Keep the first past_len positions plus the verification rows keep_rows (ascending), drop the rest.

    Rows are offsets from past_len; an accepted path is a prefix of rows when the tree is a chain,
    in which case this is a plain crop.
    """
    total = cache_length(cache)
    new_len = past_len + len(keep_rows)
    if keep_rows != list(range(len(keep_rows))) and not compact_compiled(cache, past_len, keep_rows):
        src = torch.tensor([past_len + r for r in keep_rows], device=cache.layers[0].keys.device)
        for layer in cache.layers:
            layer.keys[..., past_len:new_len, :] = layer.keys.index_select(-2, src)
            layer.values[..., past_len:new_len, :] = layer.values.index_select(-2, src)
    if total > new_len:
        cache.crop(new_len - total)


def compact_compiled(cache, past_len: int, keep_rows: list[int]) -> bool:
    """compact()'s row moves as one compiled call over every layer's buffers (row_ops.c), where they are CPU
    GrowingLayer buffers of one shape (two tensor ops a layer otherwise); False where it does not serve."""
    from . import kernels

    layers = cache.layers
    if not layers or not all(type(layer) is GrowingLayer for layer in layers):
        return False
    first = layers[0]._keys
    if first is None or first.device.type != "cpu" or first.dim() != 4 or first.shape[0] != 1:
        return False
    shape, strides = first.shape, first.stride()
    buffers = [b for layer in layers for b in (layer._keys, layer._values)]
    if strides[3] != 1 or strides[2] != shape[3] or any(
            b is None or b.shape != shape or b.stride() != strides or b.dtype != first.dtype for b in buffers):
        return False
    lib = kernels.ops_library()
    if lib is None:
        return False
    pointers = (ctypes.c_void_p * len(buffers))(*(b.data_ptr() for b in buffers))
    keep = (ctypes.c_int64 * len(keep_rows))(*keep_rows)
    lib.compact_rows(pointers, len(buffers), shape[1], strides[1], shape[3], first.element_size(), past_len, keep,
                     len(keep_rows))
    return True
