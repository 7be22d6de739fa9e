"""`ddtree`: marginal tree drafting. From one DFlash pass, take each depth's top-k marginal tokens and grow
the tree best-first: a node's score is the sum of its path's marginal log-probs; keep the best `budget`."""
from __future__ import annotations

import torch

from ..engine.tree import DraftTree
from . import defaults as D
from .base import DraftState, Drawing, with_spine
from .best_first import marginal_tree
from .dflash import BlockDrafter, DFlashBlock
from .drawn import marginal_spine
from .select import top_k


class DDTreeDrafter(BlockDrafter):
    name = "ddtree"

    def __init__(self, block: DFlashBlock, budget: int = D.DDTREE_BUDGET, top_k: int = D.DDTREE_TOP_K,
                 sampled_budget: int = D.DDTREE_SAMPLED_BUDGET, *, drawing: Drawing | None = None):
        if budget < 1:
            raise ValueError(f"ddtree budget must be >= 1, got {budget}")
        if sampled_budget < 0:
            raise ValueError(f"ddtree sampled_budget must be >= 0 (0: the budget), got {sampled_budget}")
        super().__init__(block, drawing=drawing)
        self.budgets = (budget, sampled_budget or budget)   # greedy rounds, rounds at T > 0
        self.budget = budget
        self.top_k = top_k or max(self.budgets)  # no node can rank below `budget` among its siblings

    def propose(self, state: DraftState) -> DraftTree:
        # at T > 0 a node is accepted with the target's probability of its token, not only when it is the
        # argmax, so a sibling brings more there and a round may verify another number of nodes
        self.budget = self.budgets[state.sampling]
        return super().propose(state)

    def draft(self, anchor: int, depth: int) -> DraftTree:
        if self.law is not None:
            return super().draft(anchor, depth)
        # greedy: no node of `nodes` ranks lower among its siblings, nor lies deeper; one pass a depth ranks
        # its top tokens and gives the log-sum-exp that makes them log-probs
        nodes = self.nodes
        scores = self.block.marginal(anchor, min(depth, nodes))
        top = top_k(scores.logits, min(self.top_k, nodes))
        with self.building(scores.logits.device):
            return marginal_tree(top.values - top.lse[:, None], scores.tokens(top.columns), nodes)

    def tree(self, logp: torch.Tensor) -> DraftTree:
        if self.law is None:   # no node of `nodes` ranks lower among its siblings, nor lies deeper
            nodes = self.nodes
            top = torch.topk(logp[:nodes], min(self.top_k, nodes, logp.shape[-1]), dim=-1)
            return marginal_tree(top.values, top.indices, nodes)
        spine = marginal_spine(logp, self.law, self.draws, self.budget, self.draw_shape)
        nodes = self.beside(spine)
        top = torch.topk(logp[:nodes], min(self.top_k, nodes, logp.shape[-1]), dim=-1)
        return with_spine(spine, marginal_tree(top.values, top.indices, nodes))
