"""`d2sd`: a DFlash draft, then a variable-prefix (VP) drafter re-drafts from its K likeliest rejection points.

Round: the first drafter's greedy chain d_1..d_{B-1} with confidences c_k = max_v p_k(v). The chance that
exactly i drafts are accepted is r(i) = prod_{k<=i} c_k * (1 - c_{i+1}); the K largest pick the branch
points. Branch i is [anchor, d_1..d_i, MASK...] of B2 positions; the VP-drafter drafts the masked ones of
all branches in ONE pass (each branch sees the shared context K/V and its own block). The chain and the
K branches (with B2 > B the chain is replaced by its VP extension to B2) merge into one prefix tree,
verified by the engine in one target forward. Both drafts are deterministic, so verification is lossless.

`branch: token` (ours, the default) spends the K branches on (position, alternative token) pairs instead:
the gain of branching to token a at depth i+1 is reach(i) * q_{i+1}(a) (q: the first drafter's marginal),
so where the target is uncertain (sampling, unfamiliar text) several alternatives share one depth; each
branch shows its alternative to the VP-drafter as part of the visible prefix, which drafts what follows it.
On the demo pair at T=0 and K 4 it accepts 1.30x / 1.44x dflash's (unseen code / prose) against the
paper's rule's 1.21x / 1.28x (`branch: point`), whose one alternative per position cannot catch a miss at
depth 1, where most rounds end.
"""
from __future__ import annotations

import sys
from pathlib import Path

import torch

from ..engine.drafter import BuildClock
from ..engine.tree import DraftTree, merge_paths
from ..models.checkpoint import CheckpointError
from ..models.vp_drafter import is_variable_prefix
from . import defaults as D
from .base import DraftState, Drawing, with_spine
from .dflash import DFlashBlock, load_block
from .drawn import marginal_spine


def reach(conf: torch.Tensor) -> torch.Tensor:
    """prod_{j<=i} c_j, i = 0..B-2: the chance that the first draft's first i tokens are all accepted."""
    return torch.cat([conf.new_ones(1), conf.cumprod(0)[:-1]])


def rejection_points(conf: torch.Tensor, k: int) -> torch.Tensor:
    """conf [B-1] first-draft confidences -> the k accepted-draft counts i (sorted) with the largest
    r(i) = prod_{j<=i} c_j * (1 - c_{i+1}), i = 0..B-2."""
    return torch.topk(reach(conf) * (1 - conf), min(k, conf.numel())).indices.sort().values


def alternative_points(probs: torch.Tensor, conf: torch.Tensor,
                       k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """probs [B-1, V] first-draft marginals (argmax = the draft), conf their maxima -> the k (point i,
    alternative token a, q_{i+1}(a)) with the largest reach(i) * q_{i+1}(a), a not the draft, by point."""
    width = min(k, probs.shape[-1] - 1)
    top = probs.topk(width + 1, dim=-1)                      # rank 0 is the draft itself
    gain = (reach(conf)[:, None] * top.values[:, 1:]).flatten()
    best = gain.topk(min(k, gain.numel())).indices.sort().values
    return best // width, top.indices[:, 1:].flatten()[best], top.values[:, 1:].flatten()[best]


class D2SDDrafter(BuildClock):
    name = "d2sd"

    def __init__(self, first: DFlashBlock, vp: DFlashBlock, k: int = D.D2SD_K, b2: int = D.D2SD_B2,
                 budget: int = D.D2SD_BUDGET, skip_rejected: bool = D.D2SD_SKIP_REJECTED,
                 branch: str = D.D2SD_BRANCH, *, drawing: Drawing | None = None):
        check_options(first.block_size, k, b2, budget, branch)
        if vp.target_layer_ids != first.target_layer_ids:
            raise CheckpointError(f"the VP-drafter reads target layers {list(vp.target_layer_ids)}, the DFlash "
                                  f"drafter {list(first.target_layer_ids)}: they must read the same features")
        self.first, self.vp = first, vp
        self.k, self.b2, self.budget = k, b2 or first.block_size, budget
        self.skip_rejected, self.branch = skip_rejected, branch
        self.target_layer_ids = first.target_layer_ids
        drawing = drawing or Drawing()
        self.sample = drawing.sample   # at T > 0 a chain drawn from the marginals goes first
        self.draws = drawing.draws     # and its drawn children per depth (base.with_siblings)
        self.draw_shape = drawing.shape   # or a whole drawn tree (drafters/drawn.py)

    def cast(self, dtype: torch.dtype) -> None:
        """Both drafters in `dtype`, sharing one copy of the target's embedding and lm_head."""
        self.first.cast(dtype)
        self.vp.cast(dtype, like=self.first)

    def restrict_vocab(self, frequent: torch.Tensor) -> None:
        """The `vocab` option (drafters/vocab.py): one head over the subset, both drafters read it."""
        self.first.restrict(frequent)
        self.vp.lm_head, self.vp.vocab = self.first.lm_head, self.first.vocab

    def begin(self, prompt, features) -> None:
        self.first.begin(features, prompt)
        self.vp.begin(features)

    def commit(self, tokens, features) -> None:
        self.first.commit(features, tokens)
        self.vp.commit(features)

    def propose(self, state: DraftState) -> DraftTree:
        anchor = int(state.tokens[-1])
        if state.max_depth < 1:  # nothing fits; both caches still take the context
            self.first.hidden(anchor)
            self.vp.run(state.tokens[-1:].view(1, 1))
            return DraftTree.empty(state.tokens.device)
        marginal = self.first.marginal(anchor, self.first.block_size - 1)   # over the head's columns
        probs = torch.softmax(marginal.logits, dim=-1)
        column = marginal.logits.argmax(dim=-1)   # from the logits: no tie that a softmax's rounding makes
        conf = probs.gather(-1, column[:, None])[:, 0]                         # [B-1]
        draft = marginal.tokens(column)
        if self.branch == "token":
            points, alts, alt_probs = alternative_points(probs, conf, self.k)
            alts = marginal.tokens(alts)
        else:
            points = rejection_points(conf, self.k)
            alts, alt_probs = torch.full_like(points, -1), torch.ones_like(points, dtype=conf.dtype)
        if self.b2 > self.first.block_size:  # the chain itself is re-drafted too: its extension to B2
            points = torch.cat([points, points.new_tensor([conf.numel()])])
            alts, alt_probs = torch.cat([alts, alts.new_tensor([-1])]), torch.cat([alt_probs, alt_probs.new_ones(1)])
        tokens, scores = self.branches(anchor, draft, conf, points, alts, alt_probs)
        lengths = torch.full((tokens.shape[0],), tokens.shape[1], device=tokens.device)
        if self.b2 == self.first.block_size:  # the first draft is a path of its own, listed first
            tokens, scores = torch.cat([draft[None], tokens]), torch.cat([conf.log().cumsum(0)[None], scores])
            lengths = torch.cat([lengths.new_tensor([draft.numel()]), lengths])
        if not (self.sample and state.sampling):
            with self.building(tokens.device):
                return keep_best(merge_paths(tokens, lengths, scores), self.budget)
        # drawn first; the branches catch the residual draws
        spine = marginal_spine(marginal.widen(marginal.logits), state, self.draws, self.budget or None,
                               self.draw_shape)
        with self.building(tokens.device):
            budget = max(self.budget - len(spine), 1) if self.budget else 0
            return with_spine(spine, keep_best(merge_paths(tokens, lengths, scores), budget))

    def branches(self, anchor: int, draft: torch.Tensor, conf: torch.Tensor, points: torch.Tensor,
                 alts: torch.Tensor, alt_probs: torch.Tensor):
        """[P, B2-1] tokens of each branch (its first points[p] drafts, then its alternative alts[p] if >= 0,
        then the VP-drafter's) and their path scores (cumulative log probability of whichever drafter made
        each token), from ONE VP pass."""
        b2, device = self.b2, draft.device
        pos = torch.arange(b2 - 1, device=device)[None]
        seen = pos < points[:, None]                                            # [P, B2-1] kept first drafts
        alt = (pos == points[:, None]) & (alts >= 0)[:, None]                   # the alternative, shown too
        pad = b2 - 1 - draft.numel()
        first = torch.nn.functional.pad(draft, (0, pad))[None]
        mask_id = self.vp.model.config.mask_token_id
        body = torch.where(alt, alts[:, None], torch.where(seen, first, mask_id))
        ids = torch.cat([torch.full_like(body[:, :1], anchor), body], dim=1)    # [P, B2]
        vp = self.vp.scores(self.vp.run(ids)[:, 1:])                          # [P, B2-1, n columns]
        logits = vp.logits
        if self.skip_rejected and self.branch == "point":  # branch i presumes d_{i+1} rejected: not again
            at = (pos == points[:, None]) & (points < draft.numel())[:, None]
            column_ids = vp.tokens(torch.arange(logits.shape[-1], device=device))
            logits = logits.masked_fill(at[..., None] & (column_ids == first[..., None]), -torch.inf)
        vp_col = logits.argmax(dim=-1)
        vp_conf = torch.softmax(logits, dim=-1).gather(-1, vp_col[..., None])[..., 0]
        vp_tok = vp.tokens(vp_col)
        tokens = torch.where(alt, alts[:, None], torch.where(seen, first, vp_tok))
        first_conf = torch.nn.functional.pad(conf, (0, pad), value=1.0)[None]
        probs = torch.where(alt, alt_probs[:, None].to(vp_conf.dtype), torch.where(seen, first_conf, vp_conf))
        scores = probs.log().cumsum(dim=1)
        return tokens, scores


def keep_best(tree: DraftTree, budget: int) -> DraftTree:
    """The `budget` best-scored nodes (0: all). Scores only fall along a path and ties keep the earlier
    node, parents come first, so the kept set is closed under parents."""
    if not budget or len(tree) <= budget:
        return tree
    order = torch.sort(-tree.scores, stable=True).indices[:budget].sort().values
    remap = torch.full((len(tree),), -1, dtype=torch.long, device=tree.tokens.device)
    remap[order] = torch.arange(budget, device=order.device)
    parents = tree.parents[order]
    parents = torch.where(parents >= 0, remap[parents.clamp(min=0)], parents)
    return DraftTree(tree.tokens[order], parents, tree.depth[order], tree.scores[order])


def check_options(block_size: int, k: int, b2: int, budget: int, branch: str = D.D2SD_BRANCH) -> None:
    if branch not in D.D2SD_BRANCHES:
        raise ValueError(f"d2sd branch must be one of {', '.join(D.D2SD_BRANCHES)}, got {branch!r}")
    if k < 1:
        raise ValueError(f"d2sd k (branches) must be >= 1, got {k}")
    if b2 and b2 < block_size:
        raise ValueError(f"d2sd b2 must be 0 (the drafter's block, {block_size}) or >= {block_size}, got {b2}")
    if b2 > D.D2SD_MAX_B2:
        raise ValueError(f"d2sd b2 must be <= {D.D2SD_MAX_B2}, got {b2}")
    if budget < 0:
        raise ValueError(f"d2sd budget must be >= 0 (0: no cap), got {budget}")


def build_d2sd(target, drafter_path: str, vp_drafter: str | None, k: int, b2: int, budget: int,
               skip_rejected: bool, branch: str = D.D2SD_BRANCH, drawing: Drawing | None = None) -> D2SDDrafter:
    if vp_drafter is not None and not isinstance(vp_drafter, str):
        raise ValueError(f"d2sd vp_drafter must be a folder, hub id or demo/NAME, got {vp_drafter!r}")
    check_options(1, k, b2, budget, branch)  # the ranges that need no checkpoint, before anything loads
    first = load_block(target, drafter_path)
    vp_path = resolve_vp(drafter_path, vp_drafter)
    if vp_path == drafter_path:  # its own context cache over the same weights
        vp = DFlashBlock(first.model, target)
    else:
        try:
            vp = load_block(target, vp_path)
        except CheckpointError as err:  # say which of the two drafters it is
            raise CheckpointError(f"VP-drafter {vp_path}: {err}") from err
    if not is_variable_prefix(vp.model.config):
        print(f"treegen: note: d2sd's VP-drafter {vp_path} is a plain DFlash drafter (no "
              f"dflash_config.variable_prefix); it runs losslessly but was not trained on visible prefixes",
              file=sys.stderr)
    return D2SDDrafter(first, vp, k, b2, budget, skip_rejected, branch, drawing=drawing)


def resolve_vp(drafter_path: str, vp_drafter: str | None) -> str:
    """vp_drafter as given (PAIR/NAME: a shipped checkpoint); unset: a shipped pair's VP-drafter with that pair's
    DFlash drafter, else the DFlash drafter itself (no VP-drafters are published)."""
    from ..assets import ASSETS, PAIRS, pair_asset

    if vp_drafter:
        return str(pair_asset(vp_drafter) or vp_drafter)
    for pair in PAIRS:
        shipped = ASSETS / pair / "vp-drafter"
        if Path(drafter_path).resolve() == (ASSETS / pair / "dflash").resolve() and shipped.exists():
            return str(shipped)
    return drafter_path
