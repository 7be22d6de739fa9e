"""`pld`: prompt lookup. The last n tokens are searched for in everything committed so far; what followed
each earlier match is proposed. One match gives a chain; several distinct continuations give a tree."""
from __future__ import annotations

import torch

from ..engine.tree import DraftTree
from . import defaults as D
from .base import Drafter, DraftState


class PromptLookupDrafter(Drafter):
    name = "pld"

    def __init__(self, max_ngram: int = D.PLD_MAX_NGRAM, min_ngram: int = D.PLD_MIN_NGRAM,
                 draft_len: int = D.PLD_DRAFT_LEN, branches: int = D.PLD_BRANCHES):
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"pld needs 1 <= min_ngram <= max_ngram, got {min_ngram}, {max_ngram}")
        if draft_len < 1 or branches < 1:
            raise ValueError("pld draft_len and branches must be >= 1")
        self.max_ngram, self.min_ngram, self.draft_len, self.branches = max_ngram, min_ngram, draft_len, branches

    def begin(self, prompt, features) -> None:
        pass

    def commit(self, tokens, features) -> None:
        pass

    def propose(self, state: DraftState) -> DraftTree:
        _, conts = self.match(state)
        return trie(conts, state.tokens.device) if conts else DraftTree.empty(state.tokens.device)

    def match(self, state: DraftState) -> tuple[int, list[list[int]]]:
        """(n, continuations) for the longest n-gram of the text's end seen before it; (0, []) if none."""
        length = min(self.draft_len, state.max_depth)
        if length >= 1:
            for n in range(self.max_ngram, self.min_ngram - 1, -1):
                conts = continuations(state.tokens, n, length, self.branches)
                if conts:
                    return n, conts
        return 0, []


def continuations(tokens: torch.Tensor, n: int, length: int, limit: int) -> list[list[int]]:
    """Distinct continuations (up to `length` tokens) of earlier occurrences of the last n tokens, newest first."""
    if tokens.numel() <= n:
        return []
    windows = tokens[:-1].unfold(0, n, 1)  # every n-gram that has at least one token after it
    starts = ((windows == tokens[-n:]).all(dim=1).nonzero().flatten() + n).flip(0).tolist()
    seq, out = tokens.tolist(), []
    for s in starts:
        cont = seq[s:s + length]
        if cont not in out:
            out.append(cont)
        if len(out) == limit:
            break
    return out


def trie(sequences: list[list[int]], device) -> DraftTree:
    """Merge sequences that share prefixes into one tree (parents before children)."""
    index: dict[tuple[int, int], int] = {}
    tokens, parents = [], []
    for seq in sequences:
        node = -1
        for tok in seq:
            if (node, tok) not in index:
                index[(node, tok)] = len(tokens)
                tokens.append(tok)
                parents.append(node)
            node = index[(node, tok)]
    return DraftTree(torch.tensor(tokens, dtype=torch.long, device=device),
                     torch.tensor(parents, dtype=torch.long, device=device))
