"""`dflash`: one drafter pass over [anchor, MASK x (B-1)] proposes a chain of B-1 tokens (argmax of each
position's marginal). DFlashBlock is the one-pass runner that the tree methods share."""
from __future__ import annotations

import torch

from ..engine.drafter import BuildClock
from ..engine.matmul import tune_linears
from ..engine.tree import DraftTree
from ..models.checkpoint import check_fits, load_dflash
from ..models.dflash import ContextKV, DFlashDrafter
from . import defaults as D
from .base import DraftState, sampled_chain


class DFlashBlock:
    """The drafter, its context K/V cache, and the target's embedding and lm_head it borrows."""

    def __init__(self, model: DFlashDrafter, target):
        self.model = model
        self.embed = target.get_input_embeddings()
        self.lm_head = target.get_output_embeddings()
        self.block_size = model.config.block_size
        self.cache = ContextKV(model.config.num_hidden_layers)
        self.pending: torch.Tensor | None = None  # target features not yet projected into the cache

    @property
    def target_layer_ids(self) -> tuple[int, ...]:
        return self.model.config.target_layer_ids

    def cast(self, dtype: torch.dtype, like: DFlashBlock | None = None) -> None:
        """The drafter in `dtype`, with its own copies of the target's embedding and lm_head (the target
        keeps its weights); `like`: a block already cast whose copies to share. Then its matmuls tuned."""
        self.model.to(dtype)
        if like is not None:   # already in `dtype`, its lm_head its own (and tuned) whatever the dtype
            self.embed, self.lm_head = like.embed, like.lm_head
        elif self.embed.weight.dtype != dtype:
            if type(self.lm_head) is not torch.nn.Linear or self.lm_head.bias is not None:
                raise ValueError(f"a drafter dtype other than the target's needs a plain lm_head, not "
                                 f"{type(self.lm_head).__name__}")
            tied = self.lm_head.weight is self.embed.weight
            self.embed = torch.nn.Embedding.from_pretrained(self.embed.weight.detach().to(dtype))
            weight = self.embed.weight if tied else torch.nn.Parameter(self.lm_head.weight.detach().to(dtype), False)
            self.lm_head = own_linear(weight)
        elif type(self.lm_head) is torch.nn.Linear and self.lm_head.bias is None:
            self.lm_head = own_linear(self.lm_head.weight)   # the target's weight, not its module
        tune_linears(self.model, self.lm_head)

    def begin(self, features: torch.Tensor) -> None:
        self.cache = ContextKV(self.model.config.num_hidden_layers)
        self.pending = features

    def commit(self, features: torch.Tensor) -> None:
        self.pending = features if self.pending is None else torch.cat([self.pending, features])

    def hidden(self, anchor: int, normed: bool = True) -> torch.Tensor:
        """[B, H] drafter states of the block [anchor, MASK...]; folds the pending context into the cache.
        normed=False: before the drafter's final norm."""
        ids = torch.full((1, self.block_size), self.model.config.mask_token_id, device=self.embed.weight.device)
        ids[0, 0] = anchor
        return self.run(ids, normed)[0]

    def run(self, blocks: torch.Tensor, normed: bool = True) -> torch.Tensor:
        """[P, L] block token ids (each starting at the anchor's position) -> [P, L, H] states, from ONE
        batch-1 pass of P*L queries: each block sees the whole context (cached once) and itself only, so
        P branches share the context K/V without copying it. Folds the pending context into the cache."""
        n, length = blocks.shape
        device, past = self.embed.weight.device, self.cache.length
        new = self.pending if self.pending is not None else self.embed.weight.new_zeros(0, self.model.fc.in_features)
        start = past + new.shape[0]  # the anchor's position: context is every committed token before it
        block_pos = torch.arange(start, start + length, device=device).repeat(n)[None]
        ctx_pos = torch.arange(past, start, device=device)[None]
        ctx = self.model.project_context(new.to(self.embed.weight.dtype))[None]
        mask = None
        if n > 1:  # block-diagonal over the branches, all of the context
            branch = torch.arange(n, device=device).repeat_interleave(length)
            mask = torch.cat([torch.ones(n * length, start, dtype=torch.bool, device=device),
                              branch[:, None] == branch[None, :]], dim=1)[None, None]
        out = self.model(self.embed(blocks.reshape(1, -1)), block_pos, ctx, ctx_pos, self.cache, mask, normed)
        self.pending = None
        return out.view(n, length, -1)

    def marginal_logits(self, anchor: int, depth: int) -> torch.Tensor:
        """[depth, V] logits of block positions 1..depth, each conditioned on the context only."""
        return self.lm_head(self.hidden(anchor)[1:1 + depth]).float()


def own_linear(weight: torch.nn.Parameter) -> torch.nn.Linear:
    """A bias-free Linear of the drafter's own over `weight` (shared, not copied): tuning its forward
    (engine/matmul.py) must never touch a module of the target's."""
    linear = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=False, device="meta")
    linear.weight = weight
    return linear


class BlockDrafter(BuildClock):
    """A method that drafts from one DFlash pass per round; subclasses turn the marginals into a tree."""
    name = "block"

    def __init__(self, block: DFlashBlock):
        self.block = block
        self.target_layer_ids = block.target_layer_ids
        self.sample, self.law = D.SAMPLE, None   # `sample` (set by build_drafter); this round's law, if drawing
        self.draws = D.DRAWS                     # drawn children per depth, with `sample` (base.with_siblings)
        self.draw_shape = D.DRAW_SHAPE           # a drawn chain with siblings, or a drawn tree (drafters/drawn.py)
        self.max_nodes: int | None = None        # this round's cap from the engine (budget: auto), if any

    @property
    def nodes(self) -> int:
        """This round's deterministic tree size: the budget, or the engine's cap if smaller (a tree with
        drawn nodes keeps its budget: how many draws are verified is the engine's choice, by depth)."""
        if self.max_nodes is None or self.law is not None:
            return self.budget
        return min(self.budget, self.max_nodes)

    def cast(self, dtype: torch.dtype) -> None:
        """Drafting in `dtype` (the `dtype` option: drafters/precision.py)."""
        self.block.cast(dtype)

    def begin(self, prompt, features) -> None:
        self.block.begin(features)

    def commit(self, tokens, features) -> None:
        self.block.commit(features)

    def sampling(self, state: DraftState) -> DraftState | None:
        """The round's state when its drafts are drawn (`sample` and T > 0), else None."""
        return state if self.sample and state.sampling else None

    def propose(self, state: DraftState) -> DraftTree:
        self.law, self.max_nodes = self.sampling(state), state.max_nodes
        depth = min(self.block.block_size - 1, state.max_depth)
        if depth < 1:  # nothing fits; the context still has to reach the drafter's cache
            self.block.hidden(int(state.tokens[-1]))
            return DraftTree.empty(state.tokens.device)
        return self.draft(int(state.tokens[-1]), depth)

    def draft(self, anchor: int, depth: int) -> DraftTree:
        """The tree from this round's one drafter pass; by default, from the marginals alone."""
        logp = torch.log_softmax(self.block.marginal_logits(anchor, depth), dim=-1)
        with self.building(logp.device):
            return self.tree(logp)

    def tree(self, logp: torch.Tensor) -> DraftTree:
        """[depth, V] marginal log-probs -> the draft tree."""
        raise NotImplementedError


class DFlashChainDrafter(BlockDrafter):
    """The argmax chain; with `sample` and T > 0 a chain drawn from the marginals, verified by
    speculative sampling (accepts x with min(1, p/q), where argmax drafts are accepted with p(x) alone)."""
    name = "dflash"

    def tree(self, logp: torch.Tensor) -> DraftTree:
        if self.law is not None:
            return sampled_chain(logp, self.law, self.draws)
        best = logp.max(dim=-1)
        return DraftTree.chain(best.indices, best.values.cumsum(0))


def load_block(target, drafter_path: str) -> DFlashBlock:
    """Load a z-lab-layout drafter in the target's dtype and device, refusing one that does not fit."""
    weight = target.get_input_embeddings().weight
    model = load_dflash(drafter_path, dtype=weight.dtype, device=weight.device)
    check_fits(model.config, target)
    return DFlashBlock(model, target)
