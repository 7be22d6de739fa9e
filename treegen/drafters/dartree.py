"""`dartree`: Domino's correction head extended from a chain to a tree, training-free.

One backbone pass gives z and the base logits; each depth's candidate support is its top-`candidates` base
tokens. Depth by depth, ALL frontier parents x the support are scored in one batch:
    logit = base[c] + W2[c] . SiLU(W_z z_d + W_s s_parent),  log-softmax over the support,
path score = parent's + child's log-prob; the kept children get their GRU states from one batched cell.
Variants: `fixed` keeps ceil(remaining budget / remaining depths) children per depth, verified as built;
`pruned` keeps `width` per depth, then the global top-`budget` by path score + depth_bonus x depth (prefix-
closed: the adjusted score only falls along a path, and a stable sort puts a parent before a tied child).
"""
from __future__ import annotations

import math

import torch

from ..engine.tree import DraftTree
from . import defaults as D
from .base import Drawing, with_siblings, with_spine
from .dflash import DFlashBlock
from .domino import HeadDrafter
from .drawn import Level, drawn_tree, first_draws

VARIANTS = D.DARTREE_VARIANTS


class DARTreeDrafter(HeadDrafter):
    name = "dartree"

    def __init__(self, block: DFlashBlock, head, budget: int = D.DARTREE_BUDGET,
                 candidates: int = D.DARTREE_CANDIDATES, width: int = D.DARTREE_WIDTH,
                 depth_bonus: float = D.DARTREE_DEPTH_BONUS, variant: str = D.DARTREE_VARIANT, *,
                 drawing: Drawing | None = None):
        for name, value in (("budget", budget), ("candidates", candidates), ("width", width)):
            if value < 1:
                raise ValueError(f"dartree {name} must be >= 1, got {value}")
        if variant not in VARIANTS:
            raise ValueError(f"dartree variant must be one of {', '.join(VARIANTS)}, got {variant!r}")
        if depth_bonus > 0:
            raise ValueError(f"dartree depth_bonus must be <= 0 (a bonus for depth could keep a child without "
                             f"its parent), got {depth_bonus}")
        super().__init__(block, head, drawing=drawing)
        self.budget, self.candidates, self.width = budget, candidates, width
        self.depth_bonus, self.variant = float(depth_bonus), variant

    def quota(self, remaining: int, depths_left: int) -> int:
        if self.variant == "fixed":
            return math.ceil(remaining / depths_left)
        return self.width

    def draft(self, anchor: torch.Tensor, z: torch.Tensor, base: torch.Tensor) -> DraftTree:
        if self.law is None:
            return self.grow(anchor, z, base, self.nodes)
        if self.draw_shape == "tree":   # drawn first: a tree, each node's law from its own GRU state
            spine = self.drawn_tree(anchor, z, base)
        else:                           # or Domino's drawn chain with its siblings
            spine = with_siblings(self.chain(anchor, z, base), self.law, self.draws, self.budget)
        return with_spine(spine, self.grow(anchor, z, base, self.beside(spine)))

    def drawn_tree(self, anchor: torch.Tensor, z: torch.Tensor, base: torch.Tensor) -> DraftTree:
        """T > 0 with `draw_shape: tree`: depth by depth, each expanded node's GRU state (its parent's, stepped
        on its token, in one batched cell) gives its corrected law over the whole vocabulary, as Domino's
        chain does, and its children are that law's first draws."""
        t, pure = self.tables, self.prefix_len(z.shape[0])
        z_proj = z @ t.w_z.T
        states: list[torch.Tensor] = []

        def expand(d: int, prev: torch.Tensor, width: int, up: torch.Tensor) -> Level:
            states.append(t.root_state(prev) if d == 0 else t.gru_step(prev, states[-1][up]))
            logits = base[d:d + 1].expand(len(prev), -1)
            if d >= pure:
                logits = logits + (t.hidden_part(z_proj[d:d + 1], states[-1]) @ t.w2.T).float()
            return first_draws(self.law.sampler.probs(logits), self.law, width)

        return drawn_tree(expand, int(anchor[0]), z.shape[0], self.draws, self.budget, z.device)

    def grow(self, anchor: torch.Tensor, z: torch.Tensor, base: torch.Tensor, budget: int) -> DraftTree:
        t, depth = self.tables, z.shape[0]
        pure = self.prefix_len(depth)
        support = min(self.candidates, base.shape[-1])
        cand_base, cand_ids = base.topk(support, dim=-1)             # [D, C]
        prefix_logp = cand_base[:pure] - base[:pure].logsumexp(-1, keepdim=True)  # full-vocabulary normaliser
        z_proj = z @ t.w_z.T                                          # [D, E]: the z part, once per depth
        w2_rows = t.w2[cand_ids]                                      # [D, C, E]: only the candidates' rows
        h = t.root_state(anchor)                                      # [F=1, G]
        parent = torch.full((1,), -1, dtype=torch.long, device=z.device)
        score = torch.zeros(1, device=z.device)
        tokens, parents, scores, depths = [], [], [], []
        made, remaining = 0, budget
        for d in range(depth):
            quota = self.quota(remaining, depth - d)
            if quota < 1:
                break
            if d < pure:
                logp = prefix_logp[d].expand(len(parent), -1)
            else:  # every frontier parent x every candidate at once
                mid = t.hidden_part(z_proj[d:d + 1], h)              # [F, E]
                logp = torch.log_softmax(cand_base[d] + (mid @ w2_rows[d].T).float(), dim=-1)
            path = (score[:, None] + logp).flatten()
            top = path.topk(min(quota, path.numel()))
            rows = torch.div(top.indices, support, rounding_mode="floor")
            kept = cand_ids[d][top.indices % support]
            tokens.append(kept), parents.append(parent[rows]), scores.append(top.values)
            depths.append(torch.full_like(kept, d + 1))
            parent = torch.arange(made, made + len(kept), device=z.device)
            score, made, remaining = top.values, made + len(kept), remaining - len(kept)
            if d + 1 < depth:
                h = t.gru_step(kept, h[rows])                         # the children's states, one batched cell
        with self.building(z.device):
            tree = DraftTree(torch.cat(tokens), torch.cat(parents), torch.cat(depths), torch.cat(scores))
            return self.prune(tree, budget) if self.variant == "pruned" else tree

    def prune(self, tree: DraftTree, budget: int) -> DraftTree:
        """The global top-`budget` of the width-limited supertree by score + depth_bonus x depth."""
        if len(tree) <= budget:
            return tree
        adjusted = tree.scores + self.depth_bonus * tree.depth
        order = torch.sort(adjusted, descending=True, stable=True).indices  # ties: lower index (parent) first
        keep = order[:budget].sort().values                   # original order: parents before children
        remap = torch.full((len(tree),), -1, dtype=torch.long, device=keep.device)
        remap[keep] = torch.arange(len(keep), device=keep.device)
        parents = tree.parents[keep]
        parents = torch.where(parents >= 0, remap[parents.clamp(min=0)], parents)
        return DraftTree(tree.tokens[keep], parents, tree.depth[keep], tree.scores[keep])
