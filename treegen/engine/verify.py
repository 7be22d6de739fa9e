"""Lossless verification of a draft tree against the target's logits, in one pass over the tree.

Rule (deterministic drafts, every method here):
  at each node draw ONE token y from the target's processed distribution (argmax at T=0);
  descend into the child whose token is y; if no child holds y, y is the bonus token and the round ends.
The drafts only decide which draws get used, never what is drawn, so the output is the target's own.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .sampling import Sampler
from .tree import DraftTree


@dataclass(frozen=True)
class Verdict:
    path: list[int]     # accepted node indices, root to leaf (rows are index + 1)
    tokens: list[int]   # committed tokens: the accepted drafts, then the bonus token
    bonus: int


def verify_tree(tree: DraftTree, logits: torch.Tensor, sampler: Sampler,
                generator: torch.Generator | None = None) -> Verdict:
    """logits: [n+1, V] target logits of the rows (anchor first). Tree must be sibling-deduplicated."""
    draws = sampler.sample(logits, generator)  # one per row: unused rows cost a draw, never a bias
    # the only host sync of a round: the draws and the tree shape, read together
    draws, tokens, parents = (t.tolist() for t in (draws, tree.tokens, tree.parents))
    children: dict[tuple[int, int], int] = {(p, t): i for i, (p, t) in enumerate(zip(parents, tokens))}
    path, node = [], -1
    while (node, draws[node + 1]) in children:
        node = children[(node, draws[node + 1])]
        path.append(node)
    bonus = draws[node + 1]
    return Verdict(path, [tokens[i] for i in path] + [bonus], bonus)
