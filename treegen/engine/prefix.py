"""PrefixCache: the target's KV cache (and the drafter's context features) left by one generation, taken by
the next whose prompt starts with the same tokens, so that only the new suffix is prefilled.

A chat turn's prompt is the previous prompt, the reply and the new message: without this every turn would
prefill the whole conversation again (on a CPU, seconds per turn). The reused rows are the rows the previous
generation cached, so the next generation decodes exactly as if its prefix had been prefilled: the same
verification, the same losslessness. A generation that ends mid-round (an exception in a forward) leaves
nothing behind: the cache may hold rows of a half-done round.
"""
from __future__ import annotations

import torch


class PrefixCache:
    def __init__(self):
        self.clear()

    def clear(self) -> None:
        self.cache = None
        self.ids: torch.Tensor | None = None        # [n] the tokens whose rows the cache holds
        self.features: torch.Tensor | None = None   # [n, k*H] their target features (None: the drafter takes none)
        self.key: tuple | None = None                # the model and the feature layers the rows were made for

    def take(self, key: tuple, prompt: torch.Tensor) -> tuple[object | None, int, torch.Tensor | None]:
        """(cache, n, features[:n]) for the longest common prefix n of the kept tokens and `prompt`, at most
        all but the prompt's last token (whose forward gives the first token's logits); (None, 0, None) when
        nothing is shared. The kept state is handed over: the caller's generation owns it now."""
        cache, ids, features, same = self.cache, self.ids, self.features, key == self.key
        self.clear()
        if cache is None or not same:
            return None, 0, None
        n = min(len(ids), prompt.numel() - 1)
        differ = (ids[:n].to(prompt.device) != prompt[:n]).nonzero()
        n = int(differ[0]) if len(differ) else n
        if n == 0:
            return None, 0, None
        total = cache.get_seq_length()
        if total > n:
            cache.crop(n - total)
        return cache, n, None if features is None else features[:n]

    def keep(self, key: tuple, cache, ids: torch.Tensor, features: torch.Tensor | None) -> None:
        """Hold a finished generation's cache: rows for `ids` [n], with their features [n, k*H] or None."""
        self.cache, self.ids, self.features, self.key = cache, ids, features, key
