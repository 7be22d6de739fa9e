"""Lossless verification of a draft tree against the target's logits, in one pass over the tree.

Rule (deterministic drafts, every tree method):
  at each node draw ONE token y from the target's processed distribution (argmax at T=0);
  descend into the child whose token is y; if no child holds y, y is the bonus token and the round ends.
The drafts only decide which draws get used, never what is drawn, so the output is the target's own.

Rule (T > 0, a node whose first child x was drawn from a law q: speculative sampling, then the above):
  accept x with probability min(1, p(x) / q(x)); if rejected, draw y from norm(max(p - q, 0)) instead
  of from p, and go on as above (descend into a deterministic child equal to y, or end with y).
Either way the token taken at a node is distributed as p, so the output is the target's own.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .sampling import Sampler
from .target import Logits
from .tree import DraftTree


@dataclass(frozen=True)
class Verdict:
    path: list[int]     # accepted node indices, root to leaf (rows are index + 1)
    tokens: list[int]   # committed tokens: the accepted drafts, then the bonus token
    bonus: int


def verify_tree(tree: DraftTree, logits: Logits | torch.Tensor, sampler: Sampler,
                generator: torch.Generator | None = None) -> Verdict:
    """logits: the target's logits of the rows [n+1, V] (anchor first), eager or made as the walk reads
    them (engine/target.py). The tree must be sibling-deduplicated."""
    if isinstance(logits, torch.Tensor):
        logits = Logits(None, full=logits)
    if tree.q is not None and not sampler.greedy:
        return _walk_with_laws(tree, logits, sampler, generator)
    tokens, parents = tree.tokens.tolist(), tree.parents.tolist()
    children: dict[tuple[int, int], int] = {(p, t): i for i, (p, t) in enumerate(zip(parents, tokens))}
    draw = _draws(logits, sampler, generator)
    path, node = [], -1
    while (node, token := draw(node + 1)) in children:
        node = children[(node, token)]
        path.append(node)
    return Verdict(path, [tokens[i] for i in path] + [token], token)


def _draws(logits: Logits, sampler: Sampler, generator):
    """row -> the target's draw there. Eager logits: every row drawn at once, one host sync (unused rows
    cost a draw, never a bias); lazy ones: only the rows the walk reaches, each when it gets there."""
    if logits.eager:
        draws = sampler.sample(logits.full, generator).tolist()
        return draws.__getitem__
    return lambda row: int(sampler.sample(logits.row(row), generator)[0])


def _walk_with_laws(tree: DraftTree, logits: Logits, sampler: Sampler, generator) -> Verdict:
    """The walk when the first len(tree.q) nodes are a chain drawn from tree.q (T > 0)."""
    tokens, parents, sampled = tree.tokens.tolist(), tree.parents.tolist(), len(tree.q)
    children = {(p, t): i for i, (p, t) in enumerate(zip(parents, tokens)) if i >= sampled}
    path, node = [], -1
    while True:
        p = law = sampler.probs(logits.row(node + 1))[0]
        if node + 1 < sampled:   # the anchor or a chain node: its first child is the chain's next node
            q, x = tree.q[node + 1].to(torch.float32), tokens[node + 1]
            if torch.rand((), generator=generator, device=p.device) * q[x] < p[x]:   # u < p(x) / q(x)
                node += 1
                path.append(node)
                continue
            residual = (p - q).clamp_min(0)
            law = residual if residual.sum() > 0 else p   # p == q up to rounding: nothing left to correct
        y = int(torch.multinomial(law, 1, generator=generator))
        if (node, y) not in children:
            return Verdict(path, [tokens[i] for i in path] + [y], y)
        node = children[(node, y)]
        path.append(node)
