"""DraftTree: a flat token tree rooted at the anchor, and the target-side views of it.

Row 0 of every verification input is the anchor (the last committed token); node i of the tree is
row i + 1. parents[i] == -1 means node i hangs from the anchor. Parents always come before
children (parents[i] < i), so one left-to-right pass sees every ancestor first.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class DraftTree:
    tokens: torch.Tensor                # [n] long: the drafted token of each node
    parents: torch.Tensor               # [n] long: parent node index, -1 for a child of the anchor
    depth: torch.Tensor | None = None   # [n] long: 1 for children of the anchor; derived if omitted
    scores: torch.Tensor | None = None  # [n] float: the drafter's path log-prob, if it has one
    # [L, V] float: the laws drafts were drawn from, verified by speculative sampling (engine/verify.py)
    q: torch.Tensor | None = None
    # [n] long: the row of q node i was drawn from, -1 for a deterministic node. Drawn nodes come first; the
    # drawn children of one parent share one law and are listed in draw order, without replacement. With q
    # and no law: the first L nodes are a chain, node i drawn from q[i] given the nodes before it.
    law: torch.Tensor | None = None

    def __post_init__(self):
        if self.tokens.shape != self.parents.shape or self.tokens.dim() != 1:
            raise ValueError("DraftTree tokens and parents must be 1-D tensors of one length")
        if self.q is not None:
            self._check_laws()
        if self.depth is None:  # frozen dataclass: set the derived field once, here
            object.__setattr__(self, "depth", node_depths(self.parents.tolist(), self.parents.device))

    def _check_laws(self) -> None:
        n, s = len(self.tokens), self.q.shape[0]
        if self.q.dim() != 2:
            raise ValueError("DraftTree q must be [L, V]: one law per row")
        if self.law is None:
            if s > n:
                raise ValueError("DraftTree q must be [s, V], s <= n: one law per sampled node")
            if not torch.equal(self.parents[:s].cpu(), torch.arange(-1, s - 1)):
                raise ValueError("DraftTree q: the sampled nodes must be the first s, as a chain")
            law = torch.cat([torch.arange(s), torch.full((n - s,), -1)]).to(self.tokens.device)
            object.__setattr__(self, "law", law)
            return
        law = self.law.tolist()
        drawn = sum(1 for i in law if i >= 0)
        if len(law) != n or any(i >= 0 for i in law[drawn:]) or max(law, default=-1) >= s:
            raise ValueError("DraftTree law must be [n], the drawn nodes first, each a row of q")
        shared: dict[int, int] = {}
        for parent, i in zip(self.parents[:drawn].tolist(), law[:drawn]):
            if shared.setdefault(parent, i) != i:
                raise ValueError("DraftTree law: the drawn children of one parent must share one law")

    @property
    def drawn(self) -> int:
        """How many nodes (the first ones) were drawn from a law; 0 for a deterministic tree."""
        return 0 if self.law is None else int((self.law >= 0).sum())

    @classmethod
    def empty(cls, device="cpu") -> DraftTree:
        none = torch.empty(0, dtype=torch.long, device=device)
        return cls(none, none.clone())

    @classmethod
    def chain(cls, tokens: torch.Tensor, scores: torch.Tensor | None = None,
              q: torch.Tensor | None = None) -> DraftTree:
        tokens = tokens.long().flatten()
        idx = torch.arange(len(tokens), device=tokens.device)
        return cls(tokens, idx - 1, idx + 1, scores, q)

    def __len__(self) -> int:
        return self.tokens.numel()

    def dedup(self) -> DraftTree:
        """The same root paths as a trie: a node whose parent already has a child with its token is merged
        into that earlier twin, its children moving under it (the first stays: a drawn chain's node wins
        over a deterministic twin and takes the twin's subtree). Order is kept, parents before children."""
        parents, tokens = self.parents.tolist(), self.tokens.tolist()
        keep, node_of, first = [], {}, {}   # kept old indices; old index -> new index; (new parent, token) -> new
        for i, (p, t) in enumerate(zip(parents, tokens)):
            key = (node_of[p] if p >= 0 else -1, t)
            if key not in first:
                first[key] = len(keep)
                keep.append(i)
            node_of[i] = first[key]
        if len(keep) == len(tokens):
            return self
        idx = torch.tensor(keep, dtype=torch.long, device=self.tokens.device)
        new_parents = torch.tensor([node_of[parents[i]] if parents[i] >= 0 else -1 for i in keep],
                                   dtype=torch.long, device=self.tokens.device)
        scores = None if self.scores is None else self.scores[idx]
        law = None if self.law is None else self.law[idx]   # drawn nodes come first: they are never the twin
        return DraftTree(self.tokens[idx], new_parents, self.depth[idx], scores, self.q, law)

    def truncate_depth(self, max_depth: int) -> DraftTree:
        """Keep the nodes no deeper than max_depth (a prefix-closed subset, so parents stay valid)."""
        if len(self) == 0 or int(self.depth.max()) <= max_depth:
            return self
        return self.select(self.depth <= max_depth)

    def head(self, n: int) -> DraftTree:
        """The first n nodes: prefix-closed as they stand (parents come before children), no renumbering."""
        if n >= len(self):
            return self
        scores = None if self.scores is None else self.scores[:n]
        law = None if self.law is None else self.law[:n]
        return DraftTree(self.tokens[:n], self.parents[:n], self.depth[:n], scores, self.q, law)

    def select(self, keep: torch.Tensor) -> DraftTree:
        """The nodes where keep [n] bool is set, plus any ancestor of theirs that is not, renumbered."""
        if self.tokens.device.type == "cpu":
            return self._select_on_host(keep.tolist())
        return self._select_on_device(keep)

    def _select_on_device(self, keep: torch.Tensor) -> DraftTree:
        keep = keep.clone()
        for _ in range(int(self.depth.max()) if len(self) else 0):  # close upwards, one level a step
            parents = self.parents[keep & (self.parents >= 0)]
            if bool(keep[parents].all()):
                break
            keep[parents] = True
        idx = keep.nonzero().flatten()
        remap = torch.full((len(self),), -1, dtype=torch.long, device=self.tokens.device)
        remap[idx] = torch.arange(len(idx), device=self.tokens.device)
        parents = self.parents[idx]
        parents = torch.where(parents >= 0, remap[parents.clamp(min=0)], parents)
        scores = None if self.scores is None else self.scores[idx]
        law = None if self.law is None else self.law[idx]
        return DraftTree(self.tokens[idx], parents, self.depth[idx], scores, self.q, law)

    def _select_on_host(self, keep: list[bool]) -> DraftTree:
        """select() for a tree in host memory: a few dozen nodes walked in Python cost less than a dozen
        tensor ops. Children come after their parents, so one backward pass closes `keep` upwards."""
        parents = self.parents.tolist()
        for i in range(len(parents) - 1, -1, -1):
            if keep[i] and parents[i] >= 0:
                keep[parents[i]] = True
        kept = [i for i, k in enumerate(keep) if k]
        if len(kept) == len(parents):
            return self
        new = {old: n for n, old in enumerate(kept)}
        idx = torch.tensor(kept, dtype=torch.long)
        scores = None if self.scores is None else self.scores[idx]
        law = None if self.law is None else self.law[idx]
        return DraftTree(self.tokens[idx], torch.tensor([new.get(parents[i], -1) for i in kept], dtype=torch.long),
                         self.depth[idx], scores, self.q, law)


def widths(draws: int, depth: int) -> list[int]:
    """Drawn children per depth: `draws` at depth 1, half as many at each next depth, at least 1."""
    return [max(draws >> d, 1) for d in range(depth)]


@functools.lru_cache(maxsize=64)
def drawn_shape(counts: tuple[int, ...], budget: int) -> tuple[tuple[int, int, int], ...]:
    """A drawn tree's shape (drafters/drawn.py), fixed before anything is drawn: (parent, depth index, rank)
    of each node in breadth-first order, at most `budget`; the anchor gets counts[0] children, a node whose
    ranks along its path sum to s gets counts[d] >> s."""
    nodes: list[tuple[int, int, int]] = []
    frontier = [(-1, 0)]   # (node, rank sum)
    for d, w in enumerate(counts):
        nxt = []
        for node, s in frontier:
            for j in range(w >> s):
                if len(nodes) == budget:
                    return tuple(nodes)
                nodes.append((node, d, j))
                nxt.append((len(nodes) - 1, s + j))
        frontier = nxt
    return tuple(nodes)


def node_depths(parents: list[int], device="cpu") -> torch.Tensor:
    depth: list[int] = []
    for i, p in enumerate(parents):
        if not -1 <= p < i:  # a drafter bug: say so, rather than an IndexError or a wrong mask
            raise ValueError(f"DraftTree node {i} has parent {p}; parents must come before children")
        depth.append(1 if p < 0 else depth[p] + 1)
    return torch.tensor(depth, dtype=torch.long, device=device)


HOST_ROWS = 32   # a tree this small in host memory: its mask and inputs from Python lists, not tensor ops


def ancestor_matrix(tree: DraftTree) -> torch.Tensor:
    """[n+1, n+1] bool: row r may attend to column c (c is r, an ancestor of r, or the anchor)."""
    if tree.tokens.device.type == "cpu" and len(tree) <= HOST_ROWS:
        return _ancestors_on_host(tree)
    return _ancestors_on_device(tree)


def _ancestors_on_device(tree: DraftTree) -> torch.Tensor:
    n, device = len(tree), tree.tokens.device
    up = torch.cat([torch.zeros(1, dtype=torch.long, device=device), tree.parents + 1])  # row -> parent row
    rows = torch.arange(n + 1, device=device)
    allowed = torch.zeros(n + 1, n + 1, dtype=torch.bool, device=device)
    cur = rows
    for _ in range(int(tree.depth.max()) + 1 if n else 1):  # walk every row up to the anchor at once
        allowed[rows, cur] = True
        cur = up[cur]
    return allowed


def _ancestors_on_host(tree: DraftTree) -> torch.Tensor:
    """ancestor_matrix for a few dozen nodes: a walk over lists costs less than a dozen tensor ops (plain
    decoding and most rounds build a mask every step)."""
    return _ancestors_of_shape(tuple(tree.parents.tolist())).clone()


@functools.lru_cache(maxsize=1024)
def _ancestors_of_shape(parents: tuple[int, ...]) -> torch.Tensor:
    """A small tree's ancestor matrix by its shape (parents): rounds repeat a few shapes. Shared: read only."""
    n = len(parents)
    seen = [[0]]   # per row: the rows it sees (the anchor, its ancestors, itself); parents come first
    for i, p in enumerate(parents):
        seen.append(seen[p + 1] + [i + 1])
    allowed = [False] * (n + 1) ** 2
    for r, cols in enumerate(seen):
        for c in cols:
            allowed[r * (n + 1) + c] = True
    return torch.tensor(allowed).view(n + 1, n + 1)


@functools.lru_cache(maxsize=1024)
def _hidden_of_shape(parents: tuple[int, ...]) -> torch.Tensor:
    """~_ancestors_of_shape: the cells a small tree's mask closes. Shared: read only."""
    return ~_ancestors_of_shape(parents)


def verification_inputs(anchor: int, tree: DraftTree, past_len: int, dtype: torch.dtype):
    """input_ids [1, n+1], position_ids [1, n+1] and the additive 4D mask [1, 1, n+1, past_len+n+1]: the
    committed positions open to every row, the tree's block its ancestor matrix."""
    device, n = tree.tokens.device, len(tree)
    mask = torch.zeros(1, 1, n + 1, past_len + n + 1, dtype=dtype, device=device)
    if device.type == "cpu" and n <= HOST_ROWS:   # lists, and the closed cells by the tree's shape
        both = torch.tensor([[anchor] + tree.tokens.tolist(), [past_len] + [past_len + d for d in tree.depth.tolist()]])
        ids, positions = both[:1], both[1:]
        if n:   # a lone anchor sees everything
            mask[0, 0, :, past_len:].masked_fill_(_hidden_of_shape(tuple(tree.parents.tolist())),
                                                  torch.finfo(dtype).min)
        return ids, positions, mask
    ids = torch.cat([torch.tensor([anchor], device=device), tree.tokens]).view(1, -1)
    positions = (past_len + torch.cat([torch.zeros(1, dtype=torch.long, device=device), tree.depth])).view(1, -1)
    if n:
        mask[0, 0, :, past_len:].masked_fill_(~ancestor_matrix(tree), torch.finfo(dtype).min)
    return ids, positions, mask


def merge_paths(tokens: torch.Tensor, lengths: torch.Tensor, scores: torch.Tensor | None = None) -> DraftTree:
    """One prefix tree from P token sequences under the anchor: equal prefixes become one node.

    tokens [P, L]; lengths [P] (path p is tokens[p, :lengths[p]]); scores [P, L] per-token path scores
    (a shared node keeps the best). Nodes are listed path by path, so path 0 is a chain and parents come
    first. Tensor ops over [P, P, L] comparisons (D2SD: P <= 9, L <= 31), one host sync (the nonzero).
    """
    n_paths, length = tokens.shape
    device = tokens.device
    valid = torch.arange(length, device=device)[None] < lengths[:, None]                      # [P, L]
    same = (tokens[:, None] == tokens[None]) & valid[:, None] & valid[None]                 # [P, P, L]
    same = same.long().cumprod(dim=-1).bool()            # equal through position j: one node
    first = same.long().argmax(dim=1)                     # [P, L] the first path holding each node
    own = (first == torch.arange(n_paths, device=device)[:, None]) & valid
    index = own.flatten().long().cumsum(0).view(n_paths, length) - 1
    node = index.gather(0, first)                         # [P, L] node index of (p, j)
    parents = torch.cat([torch.full((n_paths, 1), -1, device=device, dtype=torch.long), node[:, :-1]], dim=1)
    depth = torch.arange(1, length + 1, device=device).expand(n_paths, -1)
    keep = own.flatten().nonzero().flatten()
    best = None
    if scores is not None:
        best = scores[None].expand(n_paths, -1, -1).masked_fill(~same, -torch.inf).amax(dim=1).flatten()[keep]
    return DraftTree(tokens.flatten()[keep].long(), parents.flatten()[keep], depth.flatten()[keep], best)
