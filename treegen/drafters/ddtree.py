"""`ddtree`: marginal tree drafting. From one DFlash pass, take each depth's top-k marginal tokens and grow
the tree best-first: a node's score is the sum of its path's marginal log-probs; keep the best `budget`."""
from __future__ import annotations

import heapq

import torch

from ..engine.tree import DraftTree
from . import defaults as D
from .dflash import BlockDrafter, DFlashBlock


def best_first(logp: torch.Tensor, tokens: torch.Tensor, budget: int) -> DraftTree:
    """logp, tokens: [D, K] per-depth top-k (descending). The `budget` best path prefixes, parents first.

    A popped node (depth d, rank r) pushes its next sibling (d, r+1) and its first child (d+1, 0); since
    ranks are sorted, this visits prefixes in order of score, so the result is the exact top-`budget`.
    """
    depth_n, k = logp.shape
    lp, tok = logp.tolist(), tokens.tolist()  # one host copy of a [D, K] table, then a small heap
    heap = [(-lp[0][0], 0, 0, -1, 0.0)]
    out_tok, out_par, out_depth, out_score = [], [], [], []
    while heap and len(out_tok) < budget:
        neg, d, r, parent, base = heapq.heappop(heap)
        node = len(out_tok)
        out_tok.append(tok[d][r]), out_par.append(parent), out_depth.append(d + 1), out_score.append(-neg)
        if r + 1 < k:
            heapq.heappush(heap, (-(base + lp[d][r + 1]), d, r + 1, parent, base))
        if d + 1 < depth_n:
            heapq.heappush(heap, (neg - lp[d + 1][0], d + 1, 0, node, -neg))
    dev = logp.device
    return DraftTree(torch.tensor(out_tok, device=dev), torch.tensor(out_par, device=dev),
                     torch.tensor(out_depth, device=dev), torch.tensor(out_score, device=dev))


class DDTreeDrafter(BlockDrafter):
    name = "ddtree"

    def __init__(self, block: DFlashBlock, budget: int = D.DDTREE_BUDGET, top_k: int = D.DDTREE_TOP_K):
        if budget < 1:
            raise ValueError(f"ddtree budget must be >= 1, got {budget}")
        super().__init__(block)
        self.budget = budget
        self.top_k = top_k or budget  # no node can rank below `budget` among its siblings

    def tree(self, logp: torch.Tensor) -> DraftTree:
        top = torch.topk(logp, min(self.top_k, logp.shape[-1]), dim=-1)
        return best_first(top.values, top.indices, self.budget)
