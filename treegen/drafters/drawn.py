"""Drawn trees at T > 0 (`draw_shape: tree`): every expanded node's children are the first draws, without
replacement, from that node's own law (a method conditions it on the node's token, or not), and the engine
verifies each node's drawn children by recursive rejection sampling (engine/verify.py). `draw_shape: chain`
(base.with_siblings) expands only the chain of first draws.

Shape, fixed before anything is drawn: the anchor gets widths[0] children; a node at depth d whose ranks
along its path sum to s (rank: its place in its parent's draw order, 0 = first) gets widths[d] >> s. So the
chain of first draws keeps the full widths (16, 8, 4, ...) and later draws get half as many per rank.

Exact: how many children a node gets depends on the shape and on tokens above it (how big its law's
support is, and so how much of `budget` the nodes before it in breadth-first order took), never on its own
children's draws; each depth's draws are independent of every shallower depth's and of the verifier's
coins, so given the path so far a node's children are its law's first draws. Nodes of one depth may even
share draws (ddtree's: one marginal a depth): at most one of them is on the path.
"""
from __future__ import annotations

import functools
from collections.abc import Callable
from typing import NamedTuple

import torch

from ..engine.drafter import DraftState
from ..engine.tree import DraftTree, drawn_shape, widths
from .base import race, sampled_chain


class Level(NamedTuple):
    """One depth's draws: for each of F parents, its law's first W draws in order."""
    tokens: torch.Tensor   # [F, W]
    logq: torch.Tensor     # [F, W] (-inf: past the law's support)
    q: object              # [F, V] each parent's law (or what drawn_tree's `stack` turns into those rows)


def first_draws(q: torch.Tensor, state: DraftState, width: int) -> Level:
    """[F, V] laws -> each one's first `width` draws without replacement (the exponential race)."""
    logq = q.log()
    keys = race(logq, state).topk(min(width, q.shape[-1]), dim=-1)
    return Level(keys.indices, logq.gather(1, keys.indices), q)


def drawn_tree(expand: Callable[..., Level], anchor: int, depth: int, draws: int, budget: int | None, device,
               stack: Callable[[list], torch.Tensor] = torch.cat, shared: bool = False) -> DraftTree:
    """Depth by depth: expand(d, parent tokens [F], width, up) gives the draws of the F parents whose children
    sit at depth index d (d = 0: the anchor alone; up [F]: each parent's own parent among the previous
    call's, for a method whose state follows the path), each parent's law becoming a row of DraftTree.q
    (stack: the levels' q -> those rows, made once at the end). shared: every parent of a depth draws from
    one law (expand's q is that one row [1, V]), and its nodes all name that row."""
    nodes = drawn_shape(tuple(widths(draws, depth)), 1 << 30)
    room = budget or 1 << 30   # counts kept nodes: a slot past its law's support leaves its place to the next
    tokens: list[int] = []     # per shape slot: its token (None: dropped past its law's support)
    scores: list[float] = []
    law: list[int] = []
    laws = []
    rows = 0
    start = 0
    where: dict[int, int] = {-1: 0}   # node -> its place among the parents of the last expand call
    for d in range(depth):
        end = start
        while end < len(nodes) and nodes[end][1] == d:
            end += 1
        parents = [p for p in dict.fromkeys(n[0] for n in nodes[start:end]) if p < 0 or tokens[p] is not None]
        if not parents:
            break
        ids = torch.tensor([anchor if p < 0 else tokens[p] for p in parents], device=device)
        up = torch.tensor([where[nodes[p][0]] if p >= 0 else 0 for p in parents], device=device)
        level = expand(d, ids, max(n[2] for n in nodes[start:end]) + 1, up)
        laws.append(level.q)
        drawn, logq = level.tokens.tolist(), level.logq.tolist()
        where = {p: f for f, p in enumerate(parents)}
        for parent, _, j in nodes[start:end]:
            f = where.get(parent)
            ok = room > 0 and f is not None and j < len(logq[f]) and logq[f][j] != float("-inf")
            room -= ok
            tokens.append(drawn[f][j] if ok else None)
            scores.append(logq[f][j] + (scores[parent] if parent >= 0 else 0.0) if ok else 0.0)
            law.append(rows + (0 if shared else f) if ok else -1)
        rows += 1 if shared else len(parents)
        start = end
    return _as_tree(nodes[:len(tokens)], tokens, scores, law, stack(laws) if laws else None, device)


def _as_tree(nodes, tokens, scores, law, q, device) -> DraftTree:
    """Shape slots (dropped ones: token None) -> a DraftTree with dense indices."""
    kept = [i for i, t in enumerate(tokens) if t is not None]
    if not kept:
        return DraftTree.empty(device)
    index = {old: new for new, old in enumerate(kept)}
    parents = [index[nodes[i][0]] if nodes[i][0] >= 0 else -1 for i in kept]
    depths = [nodes[i][1] + 1 for i in kept]
    as_long = functools.partial(torch.tensor, dtype=torch.long, device=device)
    return DraftTree(as_long([tokens[i] for i in kept]), as_long(parents), as_long(depths),
                     torch.tensor([scores[i] for i in kept], device=device), q, as_long([law[i] for i in kept]))


def marginal_spine(logits: torch.Tensor, state: DraftState, draws: int, budget: int | None,
                   shape: str) -> DraftTree:
    """ddtree's and d2sd's drawn part from [D, V] marginal logits: a drawn tree, or a chain with siblings."""
    if shape == "tree":
        return drawn_marginal_tree(logits, state, draws, budget)
    return sampled_chain(logits, state, draws, budget)


def drawn_marginal_tree(logits: torch.Tensor, state: DraftState, draws: int, budget: int | None) -> DraftTree:
    """ddtree's and d2sd's drawn tree from [D, V] marginal logits: every node of depth d draws its children
    from the marginal law of depth d+1, whatever its token, so one race a depth serves them all, and one
    row of q a depth is their law."""
    level = first_draws(state.sampler.probs(logits), state, draws)

    def expand(d: int, parents: torch.Tensor, width: int, up: torch.Tensor) -> Level:
        f = len(parents)
        return Level(level.tokens[d:d + 1].expand(f, -1), level.logq[d:d + 1].expand(f, -1), level.q[d:d + 1])

    return drawn_tree(expand, -1, logits.shape[0], draws, budget, logits.device, shared=True)
