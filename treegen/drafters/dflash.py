"""`dflash`: one drafter pass over [anchor, MASK x (B-1)] proposes a chain of B-1 tokens (argmax of each
position's marginal). DFlashBlock is the one-pass runner that the tree methods share."""
from __future__ import annotations

import torch

from ..engine.drafter import BuildClock
from ..engine.matmul import BLOCKS, tune_linears, tuned_product
from ..engine.prefill import input_device
from ..engine.q4 import Q4Weight, Q8Weight
from ..engine.tree import DraftTree
from ..models.checkpoint import check_fits, load_dflash
from ..models.dflash import ContextKV, DFlashDrafter, block_rows
from .base import DraftState, Drawing, sampled_chain
from .precision import embedding_on, float_dtype, head_on, plain_head, product_form, readable_head
from .vocab import DraftHead, Scores

_UNRESOLVED = object()


class DFlashBlock:
    """The drafter, its context K/V cache, and the target's embedding and lm_head it borrows."""

    def __init__(self, model: DFlashDrafter, target):
        self.model = model
        self.embed = target.get_input_embeddings()
        self.lm_head = readable_head(target.get_output_embeddings(), self.embed.weight.dtype)
        self.block_size = model.config.block_size
        self.cache = ContextKV(model.config.num_hidden_layers)
        self.pending: torch.Tensor | None = None  # target features not yet projected into the cache
        self.vocab: DraftHead | None = None       # the head over a subset of the vocabulary (drafters/vocab.py)
        self.form = "float"                       # its products' form (engine/matmul.product)
        self._pass = _UNRESOLVED                  # compiled_pass() of this generation
        self._like: torch.Tensor | None = None    # the drafter's cache dtype and shape, for the compiled pass

    @property
    def target_layer_ids(self) -> tuple[int, ...]:
        return self.model.config.target_layer_ids

    @property
    def device(self) -> torch.device:
        """Where the drafter runs: where load_block put it, the device of the target's input embedding,
        where the engine gathers the target's features too (engine/prefill.py)."""
        return self.model.fc.weight.device

    def cast(self, dtype: torch.dtype, like: DFlashBlock | None = None) -> None:
        """The drafter in `dtype`, reading the target's embedding and lm_head on its own device in `dtype`:
        the target's weights where they are so, else copies (another dtype, another GPU of a device map,
        offloaded: drafters/precision.py); the target keeps its modules and their device hooks. `like`: a
        block already cast whose embedding and lm_head to share. Then its matmuls tuned (INT8: fp32 weights,
        int8 products; BLOCKS: bf16 weights, 4-bit block products)."""
        self.form, dtype = product_form(dtype), float_dtype(dtype)
        self.model.to(dtype)
        if like is not None:   # already in `dtype`, its lm_head its own (and tuned) whatever the dtype
            self.embed, self.lm_head, self.vocab = like.embed, like.lm_head, like.vocab
        else:
            tied = self.lm_head.weight is self.embed.weight
            self.embed = embedding_on(self.embed, self.device, dtype)
            self.lm_head = head_on(self.lm_head, self.device, dtype, self.embed.weight if tied else None)
        tune_linears(self.model, self.lm_head, form=self.form)
        self.model.quantize_products(self.form)
        self._pass = _UNRESOLVED

    def restrict(self, frequent: torch.Tensor) -> None:
        """Score only the frequent tokens and the context's (after cast: the head it wraps is the cast one).
        A head that is not a plain Linear (a quantized module kept as the target's own) scores them all."""
        if plain_head(self.lm_head):
            self.lm_head = self.vocab = DraftHead(self.lm_head, frequent, self.form)
            self._pass = _UNRESOLVED

    def begin(self, features: torch.Tensor, prompt: torch.Tensor | None = None) -> None:
        self.cache = ContextKV(self.model.config.num_hidden_layers)
        self.pending = features
        self._pass = _UNRESOLVED   # weights may have changed since the last generation (a cast, training)
        if self.vocab is not None and prompt is not None:   # d2sd's second drafter shares the first's head
            self.vocab.reset()
            self.vocab.admit(prompt)

    def commit(self, features: torch.Tensor, tokens: torch.Tensor | None = None) -> None:
        self.pending = features if self.pending is None else torch.cat([self.pending, features])
        if self.vocab is not None and tokens is not None:
            self.vocab.admit(tokens)

    def hidden(self, anchor: int, normed: bool = True, length: int | None = None) -> torch.Tensor:
        """[L, H] drafter states of the block [anchor, MASK...] (L: the block size, or `length` if shorter: a
        round that drafts fewer depths runs fewer mask rows, which changes its drafts a little, never what
        verification keeps); folds the pending context into the cache. normed=False: before the final norm."""
        length = self.block_size if length is None else max(1, min(length, self.block_size))
        ids = torch.full((1, length), self.model.config.mask_token_id, device=self.device)
        ids[0, 0] = anchor
        return self.run(ids, normed)[0]

    def run(self, blocks: torch.Tensor, normed: bool = True) -> torch.Tensor:
        """[P, L] block token ids (each starting at the anchor's position) -> [P, L, H] states, from ONE
        batch-1 pass of P*L queries: each block sees the whole context (cached once) and itself only, so
        P branches share the context K/V without copying it. Folds the pending context into the cache."""
        n, length = blocks.shape
        device, past, fc = self.device, self.cache.length, self.model.fc.weight
        new = self.pending if self.pending is not None else fc.new_zeros(0, fc.shape[1])
        start = past + new.shape[0]  # the anchor's position: context is every committed token before it
        block_pos = torch.arange(start, start + length, device=device)
        block_pos = (block_pos.repeat(n) if n > 1 else block_pos)[None]
        ctx_pos = torch.arange(past, start, device=device)[None]
        ctx = self.model.project_context(new.to(device=device, dtype=fc.dtype))[None]
        mask = None
        if n > 1:  # block-diagonal over the branches, all of the context
            branch = torch.arange(n, device=device).repeat_interleave(length)
            mask = torch.cat([torch.ones(n * length, start, dtype=torch.bool, device=device),
                              branch[:, None] == branch[None, :]], dim=1)[None, None]
        embedded = self.embed(blocks.reshape(1, -1)).to(device)   # a target's embedding hook may move it
        out = self.model(embedded, block_pos, ctx, ctx_pos, self.cache, mask, normed)
        self.pending = None
        return out.view(n, length, -1)

    def scores(self, states: torch.Tensor) -> Scores:
        """The head's fp32 logits of [..., H] states: over the kept tokens with a restricted vocabulary."""
        if self.vocab is None:
            return Scores(self.lm_head(states).float())
        scores = self.vocab.scores(states)
        return Scores(scores.logits.float(), scores.ids, scores.vocab_size)

    def marginal(self, anchor: int, depth: int) -> Scores:
        """Scores of block positions 1..depth, each conditioned on the context only."""
        passed = self.compiled_marginal(anchor, depth)
        if passed is None:
            return self.scores(self.hidden(anchor, length=depth + 1)[1:1 + depth])
        return passed[0]

    def compiled_marginal(self, anchor: int, depth: int, states: bool = False) \
            -> tuple[Scores, torch.Tensor | None] | None:
        """marginal()'s Scores from one compiled call (fused.FusedStack.draft: context projection, stack, head)
        where it serves, else None; with `states`, block rows 1..depth before and after the final norm too
        ([2, depth, H]: TreeFlash's head reads both). The same steps as hidden() then scores(), so the same bits
        but for the context tokens' extra head rows (tests/test_draft_pass.py)."""
        drafting = self.compiled_pass()
        if drafting is None:
            return None
        stack, context_in, head, head_q8 = drafting
        rows = max(1, min(depth + 1, self.block_size))
        new, past = self.pending, self.cache.length
        c = 0 if new is None else new.shape[0]
        if c:
            new = new.to(dtype=torch.bfloat16)
        cos, sin = self.model.rotary.table(torch.bfloat16).upto(past + c + rows)
        keys, values = self.cache.buffers(c + rows, self._like)
        own, count = block_rows(rows)
        extra = None if self.vocab is None else self.vocab.extra_rows
        logits, kept = stack.draft(keys, values, past, cos[past:], sin[past:], own, count, new if c else None,
                                   context_in, anchor, rows, head, head_q8, extra, states)
        self.cache.advance(c)
        self.pending = None
        if self.vocab is None:
            return Scores(logits), kept
        return Scores(logits, self.vocab.ids, self.vocab.kept.shape[0]), kept

    def compiled_pass(self) -> tuple | None:
        """(the compiled stack, what its drafting pass reads, the head's blocks, whether they are Q8_0) for this
        generation, resolved on its first round: drafting on a CPU in 4-bit blocks (the stack's and the head's
        forms, drafters/precision.py), over a restricted vocabulary (drafters/vocab.py: Q8_0 rows) or the whole
        one (4-bit blocks); None elsewhere, and with autograd on (training)."""
        if torch.is_grad_enabled():
            return None
        if self._pass is not _UNRESOLVED:
            return self._pass
        self._pass = None
        embed = self.embed.weight
        head = self.vocab.product if self.vocab is not None else tuned_product(self.lm_head)
        if (type(head) not in (Q8Weight, Q4Weight) or self.form != BLOCKS or self.device.type != "cpu"
                or embed.dtype != torch.bfloat16 or embed.device.type != "cpu" or not embed.is_contiguous()
                or (self.vocab is not None and self.vocab.extra_rows.dtype != torch.bfloat16)):
            return None
        c = self.model.config
        probe = embed.new_empty(1, 1, c.hidden_size)
        stack = self.model.compiled_stack(probe) if self.model.lean_usable(probe) else None
        if stack is not None:
            self._like = embed.new_empty(1, c.num_key_value_heads, 0, c.head_dim)
            self._pass = (stack, self.model.context_in(embed.detach()), head.packed, type(head) is Q8Weight)
        return self._pass

    def marginal_logits(self, anchor: int, depth: int) -> torch.Tensor:
        """[depth, V] logits of the marginal, -inf for the tokens the head does not score."""
        scores = self.marginal(anchor, depth)
        return scores.widen(scores.logits)


class BlockDrafter(BuildClock):
    """A method that drafts from one DFlash pass per round; subclasses turn the marginals into a tree."""
    name = "block"

    def __init__(self, block: DFlashBlock, *, drawing: Drawing | None = None):
        drawing = drawing or Drawing()
        self.block = block
        self.target_layer_ids = block.target_layer_ids
        self.sample, self.law = drawing.sample, None   # `sample`; this round's law, if drawing
        self.widest = drawing.draws              # drawn children at depth 1, with `sample` (base.with_siblings)
        self.draws_cap: int | None = None        # this round's cap on them from the engine (budget: auto), if any
        self.draw_shape = drawing.shape          # a drawn chain with siblings, or a drawn tree (drafters/drawn.py)
        self.max_nodes: int | None = None        # this round's cap from the engine (budget: auto), if any

    @property
    def draws(self) -> int:
        """This round's drawn children at depth 1: the `draws` option, or the engine's cap if smaller (set
        before anything is drawn, from earlier rounds: the shape never depends on this round's draws)."""
        return self.widest if self.draws_cap is None else max(1, min(self.widest, self.draws_cap))

    @draws.setter
    def draws(self, value: int) -> None:
        self.widest = value

    @property
    def capped(self) -> int:
        """The budget, or the engine's cap if smaller."""
        return self.budget if self.max_nodes is None else min(self.budget, self.max_nodes)

    @property
    def nodes(self) -> int:
        """This round's deterministic tree size: the budget, or the engine's cap if smaller (a tree with
        drawn nodes keeps its budget: how many draws are verified is the engine's choice, by depth)."""
        return self.budget if self.law is not None else self.capped

    def beside(self, spine: DraftTree) -> int:
        """Deterministic nodes to build beside a drawn spine (T > 0): the budget's rest, within the engine's cap
        (the trim keeps them by score, beside the draws it keeps by depth and rank)."""
        return max(self.capped - len(spine), 1)

    def cast(self, dtype: torch.dtype) -> None:
        """Drafting in `dtype` (the `dtype` option: drafters/precision.py)."""
        self.block.cast(dtype)

    def restrict_vocab(self, frequent: torch.Tensor) -> None:
        """The `vocab` option (drafters/vocab.py)."""
        self.block.restrict(frequent)

    def begin(self, prompt, features) -> None:
        self.block.begin(features, prompt)

    def commit(self, tokens, features) -> None:
        self.block.commit(features, tokens)

    def sampling(self, state: DraftState) -> DraftState | None:
        """The round's state when its drafts are drawn (`sample` and T > 0), else None."""
        return state if self.sample and state.sampling else None

    def propose(self, state: DraftState) -> DraftTree:
        self.law, self.max_nodes, self.draws_cap = self.sampling(state), state.max_nodes, state.max_draws
        depth = min(self.block.block_size - 1, state.max_depth)
        if depth < 1:  # nothing fits; the context still has to reach the drafter's cache
            self.block.hidden(int(state.tokens[-1]))
            return DraftTree.empty(state.tokens.device)
        return self.draft(int(state.tokens[-1]), depth)

    def draft(self, anchor: int, depth: int) -> DraftTree:
        """The tree from this round's one drafter pass; by default, from the marginals alone. Built over the
        head's columns (a restricted vocabulary: its kept tokens only, the rest never drafted), then its
        tokens mapped back and its draws' laws widened with zeros (verification divides by them over the
        whole vocabulary): the same laws the whole row gives, for the columns' share of the work."""
        scores = self.block.marginal(anchor, depth)
        logp = torch.log_softmax(scores.logits, dim=-1)
        with self.building(logp.device):
            return scores.on_vocab(self.tree(logp))

    def tree(self, logp: torch.Tensor) -> DraftTree:
        """[depth, n] marginal log-probs (column j: a token) -> the draft tree over columns."""
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
    """Load a z-lab-layout drafter in the target's dtype, on its input device (engine/prefill.py: where the
    engine gathers the features the drafter reads), refusing one that does not fit."""
    weight = target.get_input_embeddings().weight
    model = load_dflash(drafter_path, dtype=weight.dtype, device=input_device(target))
    check_fits(model.config, target)
    return DFlashBlock(model, target)
