"""The best-first tree builder every tree method shares.

A method hands over sorted child tables per (depth, row): log-probs [D, R, K] (descending along K), tokens
[D, R, K], and links [D, R, K]: the row at depth d+1 whose table holds the children of a node that chose
child k of (d, r), or -1 when that node is a leaf. The root's children are row 0 of depth 0. DDTree is
R = 1 with every link 0 (all nodes of a depth share one marginal); TreeFlash links a token to its own
conditional row. Siblings come from one row of one table, so they are distinct tokens by construction.
"""
from __future__ import annotations

import heapq

import torch

from ..engine.tree import DraftTree

SMALL = 256   # entries a table may have to be read as host lists (a DDTree round's few depths x top-k)


def host_tables(logp: torch.Tensor, tokens: torch.Tensor, links: torch.Tensor):
    """The three tables flattened on the host, in one device-to-host copy (ids < 2**24 are exact in fp32), read
    entry by entry: large ones as arrays, since the walk touches a few rows of many (a full tolist() cost
    more than the walk); small ones as lists, which index faster and cost less to make."""
    tables = torch.stack([logp.float(), tokens.float(), links.float()]).detach().cpu().flatten(1)
    if logp.numel() > SMALL:
        return tuple(tables.numpy())
    return tuple(tables.tolist())   # the walk reads each entry it uses through int() / float()


def best_first(logp: torch.Tensor, tokens: torch.Tensor, links: torch.Tensor, budget: int) -> DraftTree:
    """The `budget` best path prefixes over linked child tables, parents first.

    A node's score is the sum of the log-probs on its path. A popped node (d, r, k) pushes its next
    sibling (d, r, k+1) and, if linked, its first child (d+1, link, 0); since each table is sorted, pops
    come in order of score, so the result is exactly the top-`budget` prefixes; a prefix of log-prob -inf
    (a token the drafter's head does not score) is never one, so fewer may come back.
    """
    return _walk(*host_tables(logp, tokens, links), logp.shape, budget, logp.device)


def _walk(lp, tok, link, shape: tuple[int, int, int], budget: int, dev: torch.device) -> DraftTree:
    """best_first's heap over the flat host tables (lp, tok, link: sequences indexed (d * rows + r) * k + rank)."""
    depth_n, rows, k = shape
    at = lambda d, r, rank: (d * rows + r) * k + rank   # the flat tables' index of an entry
    heap = [(-float(lp[0]), 0, 0, 0, -1, 0.0)]  # (-score, depth, row, rank, parent node, parent score)
    out_tok, out_par, out_depth, out_score = [], [], [], []
    while heap and len(out_tok) < budget:
        neg, d, r, rank, parent, base = heapq.heappop(heap)
        if neg == float("inf"):   # popped in order of score: every node left is impossible too
            break
        node, here = len(out_tok), at(d, r, rank)
        out_tok.append(int(tok[here])), out_par.append(parent), out_depth.append(d + 1), out_score.append(-neg)
        if rank + 1 < k:
            heapq.heappush(heap, (-(base + float(lp[here + 1])), d, r, rank + 1, parent, base))
        nxt = int(link[here])
        if d + 1 < depth_n and nxt >= 0:
            heapq.heappush(heap, (neg - float(lp[at(d + 1, nxt, 0)]), d + 1, nxt, 0, node, -neg))
    if not out_tok:
        return DraftTree.empty(dev)
    tokens, parents, depths = torch.tensor([out_tok, out_par, out_depth], device=dev)   # one host-to-device copy
    return DraftTree(tokens, parents, depths, torch.tensor(out_score, device=dev))


def marginal_tree(logp: torch.Tensor, tokens: torch.Tensor, budget: int) -> DraftTree:
    """DDTree's case: per-depth top-k [D, K], one row per depth, every node continues at the next depth. A
    small one on the host (a fixed small tree's round) goes to the walk as plain lists: no tables to stack."""
    shape = (logp.shape[0], 1, logp.shape[1])
    if logp.numel() <= SMALL and logp.device.type == "cpu":
        return _walk(logp.flatten().tolist(), tokens.flatten().tolist(), [0] * logp.numel(), shape, budget,
                     logp.device)
    logp, tokens = logp[:, None], tokens[:, None]
    return best_first(logp, tokens, torch.zeros_like(tokens), budget)
