"""`treeflash`: a marginal tree whose every depth is conditioned on the token chosen just before it.

From ONE DFlash pass: (1) each depth's marginal top-m tokens are the candidate previous tokens of the next
depth (depth 1's is the anchor); (2) the SwiGLU head runs on every (depth, candidate) pair at once and
gives a conditional top-k per pair; (3) a chosen token continues at its own row of the next depth if it
is in that depth's marginal top-m, else it is a leaf; best-first over these linked tables to `budget`.

Scoring: `support=0` scores each pair over the whole vocabulary ((D * m) lm_head rows); `support=s` only
over each depth's marginal top-s tokens (s lm_head rows per depth), normalised so that the support keeps
the marginal's share of the mass: with a zero head both give exactly the marginal log-probs (ddtree).
"""
from __future__ import annotations

import torch

from ..engine.tree import DraftTree
from ..models.treeflash import TreeFlashModel, fits, load_treeflash
from . import defaults as D
from .base import draw, law_chain, race, with_siblings, with_spine
from .best_first import best_first
from .dflash import BlockDrafter, DFlashBlock


def default_support(device: torch.device) -> int:
    """Measured (docs/methods.md): on a CPU the full-vocabulary rows cost more than a target step."""
    return D.TREEFLASH_SUPPORT_CPU if device.type == "cpu" else 0


class TreeFlashDrafter(BlockDrafter):
    name = "treeflash"

    def __init__(self, block: DFlashBlock, model: TreeFlashModel, budget: int = D.TREEFLASH_BUDGET,
                 top_m: int = D.TREEFLASH_TOP_M, top_k: int = D.TREEFLASH_TOP_K,
                 temperature: float = D.TREEFLASH_TEMPERATURE, support: int | None = None):
        for name, value in (("budget", budget), ("top_m", top_m), ("top_k", top_k)):
            if value < 1:
                raise ValueError(f"treeflash {name} must be >= 1, got {value}")
        if not temperature > 0:
            raise ValueError(f"treeflash temperature must be > 0, got {temperature}")
        if support is not None and (isinstance(support, bool) or not isinstance(support, int)):
            raise ValueError(f"treeflash support must be an integer (0 = full vocabulary), got {support!r}")
        if support is not None and support != 0 and support < top_k:
            raise ValueError(f"treeflash support must be 0 (full vocabulary) or >= top_k ({top_k}), got {support}")
        super().__init__(block)
        self.model = model
        vocab = block.lm_head.weight.shape[0]
        self.budget, self.temperature = budget, float(temperature)
        self.top_m, self.top_k = min(top_m, vocab), min(top_k, vocab)
        support = default_support(block.lm_head.weight.device) if support is None else support
        self.support = min(support, vocab)
        rows = 2 * model.ar_approximation.d.weight.shape[1]
        # on a CPU a [V, 2I] table of the token half saves most of the head's work (64 MB for the demo pair)
        self.table: torch.Tensor | None = None
        if block.embed.weight.device.type == "cpu" and vocab * rows <= D.TREEFLASH_TABLE_MAX:
            with torch.no_grad():
                self.table = model.ar_approximation.token_part(block.embed.weight)   # [V, 2I]

    def draft(self, anchor: int, depth: int) -> DraftTree:
        hidden = self.block.hidden(anchor, normed=False)[1:1 + depth]   # [D, H] before the final norm
        parts = self.parts(hidden)
        tables = self.tables(hidden, anchor, parts)
        if self.law is None:
            with self.building(hidden.device):
                return best_first(*tables, self.budget)
        # sampling: a chain drawn from the head's conditional laws first, the tree on the residual draws
        spine = with_siblings(self.drawn_chain(hidden, anchor, parts), self.law, self.draws, self.budget)
        with self.building(hidden.device):
            return with_spine(spine, best_first(*tables, max(self.budget - len(spine), 1)))

    @torch.no_grad()
    def parts(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """[D, H] backbone states before the final norm -> the marginal logits [D, V] and the head's state half
        [D, 2I]: what the tables and the drawn chain both start from, made once a round."""
        normed = self.model.model.norm(hidden)
        return self.block.lm_head(normed).float(), self.model.ar_approximation.state_part(normed)

    def drawn_chain(self, hidden: torch.Tensor, anchor: int, parts: tuple[torch.Tensor, torch.Tensor]) -> DraftTree:
        """T > 0: depth by depth, the head conditioned on the token drawn just before (the anchor at depth 1),
        scored as the tables are (over the support, or the whole vocabulary), and a draw from that law. A
        short sequential loop, one [1, H] row a step: each law depends on the previous draw."""
        head, final_norm = self.model.ar_approximation, self.model.model.norm
        marginal, state = parts                                                      # [D, V], [D, 2I]
        support = marginal.topk(self.support, dim=-1).indices if self.support else None   # [D, s]
        logp = torch.log_softmax(marginal, dim=-1)
        prev = torch.tensor([anchor], device=hidden.device)

        def corrected(d: int, prev: torch.Tensor) -> torch.Tensor:   # [1, H]: depth d given the previous token
            return final_norm(hidden[d:d + 1] + head.combine(self.token_part(prev), state[d:d + 1]))
        if support is not None and self.law.sampler.plain:
            tokens, q = self.raced_chain(corrected, prev, support, logp)
        else:
            tokens, laws = [], []
            for d in range(hidden.shape[0]):
                prev, law = draw(self.conditional(corrected(d, prev), None if support is None else support[d],
                                                  logp[d]), self.law)
                tokens.append(prev), laws.append(law)
            tokens, q = torch.cat(tokens), torch.cat(laws)
        return law_chain(tokens, q)

    def raced_chain(self, corrected, prev: torch.Tensor, support: torch.Tensor, logp: torch.Tensor):
        """drawn_chain's loop under a plain temperature t, where q_d is softmax(l_d / t) of the mixed log-probs
        l_d: split q_d into the support's part and the rest. The rest does not depend on the previous draw,
        so its draw, and every random number, are made for all depths before the loop; a step is then a few
        [s]-sized ops with no host sync (pick the support's draw with probability Z_support / Z)."""
        depth, s = support.shape
        t, gen = self.law.sampler.temperature, self.law.generator
        rows = self.block.lm_head.weight.index_select(0, support.flatten()).view(depth, s, -1)   # [D, s, H]
        share = logp.gather(1, support).logsumexp(-1)                                   # [D] log P(support)
        rest = (logp / t).scatter(1, support, -torch.inf)                               # [D, V]
        z_rest = rest.logsumexp(-1)
        rest_draw = race(rest, self.law).argmax(-1)                                     # [D]
        noise = race(torch.zeros(depth, s, device=logp.device), self.law)             # [D, s]: -log E
        log_u = torch.rand(depth, device=logp.device, generator=gen).log()
        tokens, conds = [], []
        for d in range(depth):
            cond = (rows[d] @ corrected(d, prev)[0]).float().log_softmax(-1)           # [s]
            scaled = (cond + share[d]) / t
            z_in = scaled.logsumexp(-1)
            inside = support[d, (scaled + noise[d]).argmax()]
            prev = torch.where(log_u[d] < z_in - torch.logaddexp(z_in, z_rest[d]), inside, rest_draw[d]).view(1)
            tokens.append(prev), conds.append(cond)
        mixed = logp.scatter(1, support, torch.stack(conds) + share[:, None])
        return torch.cat(tokens), self.law.sampler.probs(mixed)

    def conditional(self, row: torch.Tensor, support: torch.Tensor | None, logp: torch.Tensor) -> torch.Tensor:
        """[1, H] corrected state -> [1, V] log-probs: the full vocabulary's, or the marginal's `logp` [V] with
        the support's share of it spread by the conditional (as score() does: no token loses all its mass)."""
        if support is None:
            return self.block.lm_head(row).float()
        cond = (row @ self.block.lm_head.weight.index_select(0, support).T)[0].float().log_softmax(-1)
        out = logp.clone()
        out[support] = cond + logp[support].logsumexp(-1)
        return out[None]

    @torch.no_grad()
    def tables(self, hidden: torch.Tensor, anchor: int, parts: tuple[torch.Tensor, torch.Tensor] | None = None):
        """Per (depth, candidate previous token): conditional top-k log-probs, tokens, next-depth links.
        `parts`: this round's parts(hidden), if the caller made them already."""
        depth, m = hidden.shape[0], self.top_m
        head, final_norm = self.model.ar_approximation, self.model.model.norm
        marginal, state = parts or self.parts(hidden)
        top_m = marginal.topk(m, dim=-1).indices                                     # [D, m]
        # depth 0 has one candidate (the anchor); depth j > 0 has depth j-1's top-m
        prev = torch.cat([torch.tensor([anchor], device=hidden.device), top_m[:-1].flatten()])
        pos = torch.arange(depth, device=hidden.device).repeat_interleave(m)[m - 1:]
        delta = head.combine(self.token_part(prev), state.index_select(0, pos))
        states = final_norm(hidden.index_select(0, pos) + delta)                    # [1 + (D-1)m, H]
        states = torch.cat([states[:1].expand(m, -1), states[1:]]).view(depth, m, -1)
        logp, tokens = self.score(states, marginal)
        match = tokens[..., None] == top_m[:, None, None, :]                         # [D, m, k, m]
        links = torch.where(match.any(-1), match.int().argmax(-1), -1)
        links[-1] = -1                                                               # the block ends here
        return logp, tokens, links

    def token_part(self, prev: torch.Tensor) -> torch.Tensor:
        """The head's token half for these ids: rows of the table where there is one."""
        if self.table is not None:
            return self.table.index_select(0, prev)
        return self.model.ar_approximation.token_part(self.block.embed.weight.index_select(0, prev))

    def score(self, states: torch.Tensor, marginal: torch.Tensor):
        """states [D, m, H] -> the conditional top-k (log-probs at the drafter temperature, tokens) [D, m, k]."""
        t, weight = self.temperature, self.block.lm_head.weight
        if not self.support:
            logp = torch.log_softmax(self.block.lm_head(states).float() / t, dim=-1)
            top = logp.topk(self.top_k, dim=-1)
            return top.values, top.indices
        support = marginal.topk(self.support, dim=-1).indices                        # [D, s]
        rows = weight.index_select(0, support.flatten()).view(*support.shape, -1)   # [D, s, H]
        logits = torch.bmm(states, rows.transpose(1, 2)).float() / t                # [D, m, s]
        # the support keeps the marginal's share of the mass: log P(S) - logsumexp over S of the conditional
        share = torch.log_softmax(marginal / t, dim=-1).gather(1, support).logsumexp(-1)
        logp = logits - logits.logsumexp(-1, keepdim=True) + share[:, None, None]
        top = logp.topk(self.top_k, dim=-1)
        return top.values, support[:, None, :].expand_as(logits).gather(2, top.indices)


def load_treeflash_block(target, drafter_path: str) -> tuple[DFlashBlock, TreeFlashModel]:
    """A published-layout TreeFlash checkpoint in the target's dtype and device, refused if it does not fit."""
    weight = target.get_input_embeddings().weight
    model = load_treeflash(drafter_path, dtype=weight.dtype, device=weight.device)
    fits(model, target)
    return DFlashBlock(model.model, target), model
