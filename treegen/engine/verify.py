"""Lossless verification of a draft tree against the target's logits, in one pass over the tree.

Rule (deterministic drafts, every tree method):
  at each node draw ONE token y from the target's processed distribution (argmax at T=0);
  descend into the child whose token is y; if no child holds y, y is the bonus token and the round ends.
The drafts only decide which draws get used, never what is drawn, so the output is the target's own.

Rule (T > 0, a node whose children x_1..x_k were drawn from a law q without replacement: recursive
rejection sampling, then the above):
  accept x_j with probability min(1, p_j(x_j) / q_j(x_j)), q_j being q without x_1..x_j-1 (the law x_j
  was drawn from), p_1 = p; if rejected, p_j+1 = norm(max(p_j - q_j, 0)); after k rejections draw y from
  p_k+1 instead of p and go on as above (descend into any child equal to y, or end with y).
Either way the token taken at a node is distributed as p, so the output is the target's own.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .sampling import Sampler, draw
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
    """The walk when some nodes were drawn from laws (T > 0): at each node its drawn children are tried in
    draw order (recursive rejection sampling), then a draw from what is left of p is matched to any child."""
    tokens, law = tree.tokens.tolist(), tree.law.tolist()
    children: dict[tuple[int, int], int] = {}
    drawn: dict[int, list[int]] = {}   # parent -> its drawn children, in draw order
    for i, (parent, token) in enumerate(zip(tree.parents.tolist(), tokens)):
        children[(parent, token)] = i
        if law[i] >= 0:
            drawn.setdefault(parent, []).append(i)
    path, node = [], -1
    while True:
        p = sampler.probs(logits.row(node + 1))[0]
        tried = drawn.get(node, [])
        q = tree.q[law[tried[0]]].to(torch.float32) if tried else None
        child, p = _try_drawn(p, q, [tokens[i] for i in tried], generator)
        if child is None:
            y = int(draw(p, generator))
            if (node, y) not in children:
                return Verdict(path, [tokens[i] for i in path] + [y], y)
            node = children[(node, y)]
        else:
            node = tried[child]
        path.append(node)


def _try_drawn(p: torch.Tensor, q: torch.Tensor | None, drafts: list[int], generator):
    """Drafts x_1..x_k drawn from q without replacement, tried against p in turn: x_j came from q_j (q without
    x_1..x_j-1, renormalised), so accept it with probability min(1, p_j(x_j) / q_j(x_j)); on a rejection the
    target becomes p_j+1 = norm(max(p_j - q_j, 0)). -> (the accepted draft's position, p) or (None, p_k+1)."""
    for j, x in enumerate(drafts):
        if j:
            q = q.clone()
            q[drafts[j - 1]] = 0.0
            q = q / q.sum()
        if torch.rand((), generator=generator, device=p.device) * q[x] < p[x]:   # u < p(x) / q(x)
            return j, p
        residual = (p - q).clamp_min(0)
        if residual.sum() <= 0:   # p == q up to rounding: nothing left to correct
            return None, p
        p = residual / residual.sum()
    return None, p
