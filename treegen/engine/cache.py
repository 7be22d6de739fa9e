"""The target's KV cache: checked once for compactability, then compacted to each round's accepted path."""
from __future__ import annotations

import torch


class CacheError(RuntimeError):
    pass


def new_cache(model):
    from transformers import DynamicCache

    return DynamicCache(config=model.config)


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
    if keep_rows != list(range(len(keep_rows))):
        src = torch.tensor([past_len + r for r in keep_rows], device=cache.layers[0].keys.device)
        for layer in cache.layers:
            layer.keys[..., past_len:new_len, :] = layer.keys.index_select(-2, src)
            layer.values[..., past_len:new_len, :] = layer.values.index_select(-2, src)
    if total > new_len:
        cache.crop(new_len - total)
