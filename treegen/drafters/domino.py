"""`domino`: one DFlash backbone pass, then Domino's correction head walks the chain: at each position choose
the argmax of lm_head(z_i) + embed_proj([z_i; s_i]), embed it, step the GRU. HeadDrafter is the shared part
(loading, the backbone pass, the head's tables) that `dartree` extends to trees."""
from __future__ import annotations

import torch

from ..engine.matmul import tune_linears
from ..engine.tree import DraftTree
from ..models.domino import DominoHead, HeadTables, check_domino_fits, load_domino
from .base import DraftState, Drawing, draw, with_siblings
from .dflash import BlockDrafter, DFlashBlock
from .precision import float_dtype


class HeadDrafter(BlockDrafter):
    """One backbone pass per round gives z [D, H] and base logits [D, V]; subclasses draft from them."""
    name = "domino-head"

    def __init__(self, block: DFlashBlock, head: DominoHead, *, drawing: Drawing | None = None):
        super().__init__(block, drawing=drawing)
        self.head, self.head_model = head.config, head
        self.tables = HeadTables(head, block.embed.weight)
        self.max_drafts = self.head.drafts(block.block_size)

    def cast(self, dtype: torch.dtype) -> None:
        super().cast(dtype)
        self.head_model.to(float_dtype(dtype))
        tune_linears(self.head_model, form=self.block.form)
        self.tables = HeadTables(self.head_model, self.block.embed.weight)   # its vocabulary table too

    def propose(self, state: DraftState) -> DraftTree:
        self.law, self.max_nodes = self.sampling(state), state.max_nodes
        depth = min(self.max_drafts, state.max_depth)
        hidden = self.block.hidden(int(state.tokens[-1]))  # folds the new context into the cache either way
        if depth < 1:
            return DraftTree.empty(state.tokens.device)
        first = 0 if self.head.shift_label else 1  # the block position that predicts the first draft
        z = hidden[first:first + depth]
        anchor = state.tokens[-1:].to(z.device)
        return self.draft(anchor, z, self.block.lm_head(z).float())

    def draft(self, anchor: torch.Tensor, z: torch.Tensor, base: torch.Tensor) -> DraftTree:
        raise NotImplementedError

    def prefix_len(self, depth: int) -> int:
        """Drafts scored by the base logits alone (the published pure_draft_prefix_len), within depth."""
        return min(self.head.pure_draft_prefix_len, depth)

    def choose(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """[k, V] -> the drafts [k] (argmax, or drawn by this round's law) and their laws (None: argmax)."""
        if self.law is None:
            return logits.argmax(-1), None
        return draw(logits, self.law) if len(logits) else (logits.argmax(-1), logits.softmax(-1))

    def chain(self, anchor: torch.Tensor, z: torch.Tensor, base: torch.Tensor) -> DraftTree:
        """Domino's chain: choose, embed, GRU step; drawn (with its laws) when this round samples."""
        t, depth = self.tables, z.shape[0]
        pure = self.prefix_len(depth)
        z_proj = z @ t.w_z.T                     # the z part of embed_proj.0, once for every position
        logits = base.clone()
        first, law = self.choose(logits[:pure])
        chosen, laws = [first], [law]
        h = t.root_state(anchor)
        for i in range(pure):                    # the GRU reads the pure-prefix drafts too
            h = t.gru_step(first[i:i + 1], h)
        for i in range(pure, depth):             # the cheap sequential loop: choose, embed, GRU step
            logits[i] += (t.hidden_part(z_proj[i:i + 1], h) @ t.w2.T)[0].float()
            tok, law = self.choose(logits[i:i + 1])
            chosen.append(tok), laws.append(law)
            if i + 1 < depth:
                h = t.gru_step(tok, h)
        tokens = torch.cat(chosen)
        q = None if self.law is None else torch.cat(laws)
        logp = torch.log_softmax(logits, dim=-1) if q is None else q.clamp_min(1e-30).log()
        return DraftTree.chain(tokens, logp.gather(1, tokens[:, None])[:, 0].cumsum(0), q)


class DominoDrafter(HeadDrafter):
    """The corrected argmax chain; with `sample` and T > 0 each position is drawn from its corrected law,
    the GRU reading the drawn token, and the chain is verified by speculative sampling."""
    name = "domino"

    def draft(self, anchor: torch.Tensor, z: torch.Tensor, base: torch.Tensor) -> DraftTree:
        chain = self.chain(anchor, z, base)
        return chain if self.law is None else with_siblings(chain, self.law, self.draws)


def load_head_block(target, drafter_path: str) -> tuple[DFlashBlock, DominoHead]:
    """A Domino checkpoint in the target's dtype and device, refused when it does not fit the target."""
    weight = target.get_input_embeddings().weight
    backbone, head = load_domino(drafter_path, dtype=weight.dtype, device=weight.device)
    check_domino_fits(backbone, head, target)
    return DFlashBlock(backbone, target), head
