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

from typing import NamedTuple

import torch

from ..engine.fused import TokenHalf
from ..engine.matmul import tune_linears, tuned_product
from ..engine.q4 import Q4Weight
from ..engine.tree import DraftTree, widths
from ..models.treeflash import TreeFlashModel, fits, load_treeflash
from . import defaults as D
from .base import Drawing, draw, inverse_cdf, law_chain, race, with_siblings, with_spine
from .best_first import best_first
from .dflash import BlockDrafter, DFlashBlock
from .drawn import Level, drawn_tree, first_draws
from .precision import float_dtype
from .select import gathered_logits, top_k
from .vocab import Scores


class Scored(NamedTuple):
    top_m: torch.Tensor            # [D, m] each depth's marginal top-m: the next depth's candidate previous tokens
    support: torch.Tensor | None   # [D, s] each depth's scored tokens; None = the whole vocabulary
    logits: torch.Tensor           # [D, m, s or V] the head's conditional logits per (depth, candidate)
    columns: torch.Tensor | None = None   # [D, s] the support's columns of the marginal's Scores
    share: torch.Tensor | None = None     # [D] log P(support) under the marginal (at temperature 1)


def default_support(device: torch.device) -> int:
    """Measured (docs/methods.md): on a CPU the full-vocabulary rows cost more than a target step."""
    return D.TREEFLASH_SUPPORT_CPU if device.type == "cpu" else 0


def default_top_m(device: torch.device) -> int:
    """Measured (docs/ablations/treeflash-top-m.md): on a CPU the head's rows for 16 candidates a depth cost
    more time than their extra accepted tokens save."""
    return D.TREEFLASH_TOP_M_CPU if device.type == "cpu" else D.TREEFLASH_TOP_M


class TreeFlashDrafter(BlockDrafter):
    name = "treeflash"

    def __init__(self, block: DFlashBlock, model: TreeFlashModel, budget: int = D.TREEFLASH_BUDGET,
                 top_m: int | None = None, top_k: int = D.TREEFLASH_TOP_K,
                 temperature: float = D.TREEFLASH_TEMPERATURE, support: int | None = None, *,
                 drawing: Drawing | None = None):
        top_m = default_top_m(block.lm_head.weight.device) if top_m is None else top_m
        for name, value in (("budget", budget), ("top_m", top_m), ("top_k", top_k)):
            if value < 1:
                raise ValueError(f"treeflash {name} must be >= 1, got {value}")
        if not temperature > 0:
            raise ValueError(f"treeflash temperature must be > 0, got {temperature}")
        if support is not None and (isinstance(support, bool) or not isinstance(support, int)):
            raise ValueError(f"treeflash support must be an integer (0 = full vocabulary), got {support!r}")
        if support is not None and support != 0 and support < top_k:
            raise ValueError(f"treeflash support must be 0 (full vocabulary) or >= top_k ({top_k}), got {support}")
        super().__init__(block, drawing=drawing)
        self.model = model
        vocab = block.lm_head.weight.shape[0]
        self.budget, self.temperature = budget, float(temperature)
        self.top_m, self.top_k = min(top_m, vocab), min(top_k, vocab)
        support = default_support(block.lm_head.weight.device) if support is None else support
        self.support = min(support, vocab)
        self.table: torch.Tensor | None = None
        self.make_table()

    def make_table(self) -> None:
        """On a CPU a [V, 2I] table of the head's token half saves most of its work (64 MB for the demo pair)."""
        embed = self.block.embed.weight
        vocab, rows = embed.shape[0], 2 * self.model.ar_approximation.d.weight.shape[1]
        if embed.device.type == "cpu" and vocab * rows <= D.TREEFLASH_TABLE_MAX:
            with torch.no_grad():
                self.table = self.model.ar_approximation.token_part(embed)   # [V, 2I]

    def cast(self, dtype: torch.dtype) -> None:
        self.model.to(float_dtype(dtype))   # the head and the backbone (block.model)
        super().cast(dtype)
        tune_linears(self.model.ar_approximation, form=self.block.form)
        self.model.ar_approximation.form = self.block.form   # its ug halves too
        self.make_table()

    def draft(self, anchor: int, depth: int) -> DraftTree:
        depth = min(depth, self.budget)   # no node of a tree of `budget` nodes lies deeper (as ddtree)
        passed = self.block.compiled_marginal(anchor, depth, states=True)   # one compiled call, where it serves
        if passed is None:
            hidden = self.block.hidden(anchor, normed=False, length=depth + 1)[1:]   # [D, H] before the final norm
            parts = self.parts(hidden)
        else:
            marginal, (hidden, normed) = passed
            parts = self.parts_of(marginal, normed)
        if self.law is not None:   # drawn drafts: laws over the whole vocabulary (verification divides by them)
            parts = (Scores(parts[0].widen(parts[0].logits)), parts[1])
        grown = self.law is not None and self.draw_shape == "tree"
        # a drawn tree takes most of the budget: the tables only feed its tail and a few deterministic nodes
        scored = self.scored(hidden, anchor, parts, min(self.top_m, D.TREEFLASH_DRAWN_TOP_M) if grown else None)
        tables = self.tables(hidden, anchor, parts, scored)
        if self.law is None:
            with self.building(hidden.device):
                return best_first(*tables, self.nodes)
        # sampling: drafts drawn from the head's conditional laws first, the tree on the residual draws
        if grown:
            spine = self.drawn_tree(hidden, anchor, parts, scored)
        else:
            spine = with_siblings(self.drawn_chain(hidden, anchor, parts, scored), self.law, self.draws,
                                  self.budget)
        with self.building(hidden.device):
            return with_spine(spine, best_first(*tables, self.beside(spine)))

    @torch.no_grad()
    def parts(self, hidden: torch.Tensor) -> tuple[Scores, torch.Tensor]:
        """[D, H] backbone states before the final norm -> the marginal's Scores (over the head's columns) and
        the head's state half [D, 2I]: what the tables and the drawn chain both start from, made once a round."""
        normed = self.model.model.norm(hidden)
        return self.parts_of(self.block.scores(normed), normed)

    def parts_of(self, marginal: Scores, normed: torch.Tensor) -> tuple[Scores, torch.Tensor]:
        """parts() from the marginal's Scores and the states after the final norm [D, H]."""
        if marginal.logits.shape[-1] < max(self.top_m, self.support):   # fewer kept tokens than it ranks
            marginal = Scores(marginal.widen(marginal.logits))
        return marginal, self.model.ar_approximation.state_part(normed)

    def drawn_chain(self, hidden: torch.Tensor, anchor: int, parts: tuple[torch.Tensor, torch.Tensor],
                    scored: Scored | None = None) -> DraftTree:
        """T > 0: depth by depth, the head conditioned on the token drawn just before (the anchor at depth 1),
        scored as the tables are (over the support, or the whole vocabulary), and a draw from that law. A
        short sequential loop, one [1, H] row a step: each law depends on the previous draw (linked_chain
        replaces it under a plain temperature with a support)."""
        head, final_norm = self.model.ar_approximation, self.model.model.norm
        marginal, state = parts[0].logits, parts[1]                                  # [D, V], [D, 2I]
        logp = torch.log_softmax(marginal, dim=-1)
        if self.support and self.law.sampler.plain:
            return law_chain(*self.linked_chain(scored or self.scored(hidden, anchor, parts), logp))
        support = marginal.topk(self.support, dim=-1).indices if self.support else None   # [D, s]
        prev = torch.tensor([anchor], device=hidden.device)
        tokens, laws = [], []
        for d in range(hidden.shape[0]):
            row = final_norm(hidden[d:d + 1] + head.combine(self.token_part(prev), state[d:d + 1]))
            prev, law = draw(self.conditional(row, None if support is None else support[d], logp[d]), self.law)
            tokens.append(prev), laws.append(law)
        return law_chain(torch.cat(tokens), torch.cat(laws))

    def linked_chain(self, scored: Scored, logp: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The drawn chain from the tables' own conditional logits, under a plain temperature t: at depth d
        the law is row r of depth d's [m, s] logits when the previous draw is depth d-1's r-th marginal
        candidate (depth 0: the anchor's row), else the marginal itself (an extra row). Each row's law
        splits into the support's part and the rest (which no row changes); one set of random numbers per
        depth draws a token for EVERY row at once, and following the drawn rows is a walk over a [D, m+1]
        table on the host: no head step, no per-depth device work.

        Exact: depth d's numbers are independent of the earlier depths' draws, so given the row that the
        previous draw picks, the token is a draw from that row's law; q is the picked rows' laws."""
        top_m, support, logits = scored.top_m, scored.support, scored.logits
        depth, m, s = logits.shape
        t, gen = self.law.sampler.temperature, self.law.generator
        share = logp.gather(1, support).logsumexp(-1)                                   # [D] log P(support)
        rows = torch.cat([logits.float(), logp.gather(1, support)[:, None]], 1)        # [D, m+1, s]
        cond = rows.log_softmax(-1) + share[:, None, None]                              # mixed log-probs, inside
        scaled = cond / t
        z_in = scaled.logsumexp(-1)                                                     # [D, m+1]
        rest = (logp / t).scatter(1, support, -torch.inf)                               # [D, V]
        rest_draw, z_rest = inverse_cdf(rest, self.law)                                 # [D], [D]
        noise = race(torch.zeros(depth, 1, s, device=logp.device), self.law)           # [D, 1, s]: -log E
        log_u = torch.rand(depth, 1, device=logp.device, generator=gen).log()
        inside = support.gather(1, (scaled + noise).argmax(-1))                         # [D, m+1]
        drawn = torch.where(log_u < z_in - torch.logaddexp(z_in, z_rest[:, None]), inside, rest_draw[:, None])
        match = drawn[..., None] == top_m[:, None, :]                                   # [D, m+1, m]
        nxt = torch.where(match.any(-1), match.int().argmax(-1), m)                     # the row it picks next
        nxt_h = nxt.tolist()
        picked, r = [], 0
        for d in range(depth):
            picked.append(r)
            r = nxt_h[d][r]
        picked = torch.tensor(picked, device=logp.device)
        steps = torch.arange(depth, device=logp.device)
        mixed = logp.scatter(1, support, cond[steps, picked])
        return drawn[steps, picked], self.law.sampler.probs(mixed)

    def drawn_tree(self, hidden: torch.Tensor, anchor: int, parts: tuple[torch.Tensor, torch.Tensor],
                   scored: Scored) -> DraftTree:
        """T > 0 with `draw_shape: tree`: depth by depth, every expanded node's children are drawn from the head
        conditioned on that node's own token (any token, not only the tables' top-m candidates: its token
        half is a row of the table), scored over the support as the tables are, or the whole vocabulary."""
        head, final_norm = self.model.ar_approximation, self.model.model.norm
        marginal, state = parts[0].logits, parts[1]                                  # [D, V], [D, 2I]
        logp = torch.log_softmax(marginal, dim=-1)

        def states(d: int, prev: torch.Tensor) -> torch.Tensor:
            delta = head.combine(self.token_part(prev), state[d:d + 1].expand(len(prev), -1))
            return final_norm(hidden[d:d + 1] + delta)                             # [F, H]

        if scored.support is not None and self.law.sampler.plain:
            expand, stack = self.support_draws(states, scored, logp)
            return drawn_tree(expand, anchor, hidden.shape[0], self.draws, self.budget, hidden.device, stack)

        def expand(d: int, prev: torch.Tensor, width: int, up: torch.Tensor) -> Level:
            support = None if scored.support is None else scored.support[d]
            return first_draws(self.law.sampler.probs(self.conditional(states(d, prev), support, logp[d])),
                               self.law, width)

        return drawn_tree(expand, anchor, hidden.shape[0], self.draws, self.budget, hidden.device)

    def support_draws(self, states, scored: Scored, logp: torch.Tensor):
        """The drawn tree's expand and stack under a plain temperature t over a support: a node's law is its
        support part (its own) and the rest (the marginal's, the same for every node of a depth), so the
        rest's best keys of the race are drawn once for every depth up front, and each expansion only
        scores its nodes' support rows and picks their first draws among those keys and the rest's. Past
        the branching depths (one node, one draw a depth) the chain reads the tables instead: the law of
        its previous token's row there (the marginal's for a token outside the top-m), drawn up front. The
        laws themselves ([N, V]) are made once, for the nodes that were expanded."""
        top_m, support = scored.top_m, scored.support
        t, (depth, s) = self.law.sampler.temperature, support.shape
        share = logp.gather(1, support).logsumexp(-1)                                  # [D] log P(support)
        rest = (logp / t).scatter(1, support, -torch.inf)                              # [D, V]
        z_rest = rest.logsumexp(-1)
        start = next((d for d, w in enumerate(widths(self.draws, depth)) if w == 1 and d > 0), depth)
        noise = race(torch.zeros(depth, s, device=logp.device), self.law)             # [D, s]: a depth's nodes share it
        best = race(rest[:start], self.law).topk(min(self.draws, rest.shape[-1]), dim=-1)   # [start, W]
        rows = self.block.lm_head.weight[support]                                      # [D, s, H]
        outside = self.outside(support)
        tail = self.tail_draws(scored, logp, share, z_rest, rest, noise, start) if start < depth else None
        candidates = [{tok: r for r, tok in enumerate(row)} for row in top_m.tolist()]

        def expand(d: int, prev: torch.Tensor, width: int, up: torch.Tensor) -> Level:
            if d >= start:   # the shape is one node, one draw a depth from here on
                r = candidates[d - 1].get(int(prev[0]), top_m.shape[1])                # the parent's row at depth d
                return Level(tail[0][d, r:r + 1, None], tail[1][d, r:r + 1, None], (d, tail[2][d, r:r + 1]))
            f = len(prev)
            inside = ((states(d, prev) @ rows[d].T).float() + outside[d]).log_softmax(-1)
            inside = (inside + share[d]) / t                                                  # [F, s]
            norm = torch.logaddexp(inside.logsumexp(-1), z_rest[d])
            keys = torch.cat([inside + noise[d], best.values[d].expand(f, -1)], -1).topk(width, dim=-1)
            ids = torch.cat([support[d].expand(f, -1), best.indices[d].expand(f, -1)], -1).gather(1, keys.indices)
            base = torch.cat([inside, rest[d, best.indices[d]].expand(f, -1)], -1).gather(1, keys.indices)
            return Level(ids, base - norm[:, None], (d, inside))

        def stack(levels: list) -> torch.Tensor:
            at = torch.tensor([d for d, inside in levels for _ in range(len(inside))], device=logp.device)
            inside = torch.cat([inside for _, inside in levels])
            return torch.softmax((logp[at] / t).scatter(1, support[at], inside), dim=-1)

        return expand, stack

    def tail_draws(self, scored: Scored, logp, share, z_rest, rest, noise, start: int):
        """(tokens [D, m+1], log q [D, m+1], support parts [D, m+1, s]): one draw for every row of the tables at
        depths >= start, where the drawn tree is a chain. The rest's race winner is a draw from the rest's law
        whose key is z_rest + Gumbel noise, independent of which token won (Gumbel-max), so one uniform for
        each draws it (inverse_cdf) instead of a race over the vocabulary."""
        t = self.law.sampler.temperature
        rows = torch.cat([scored.logits.float(), logp.gather(1, scored.support)[:, None]], 1)    # [D, m+1, s]
        inside = (rows.log_softmax(-1) + share[:, None, None]) / t
        norm = torch.logaddexp(inside.logsumexp(-1), z_rest[:, None])                          # [D, m+1]
        key, at = (inside + noise[:, None]).max(-1)
        rest_token, _ = inverse_cdf(rest[start:], self.law)
        rest_token = torch.cat([rest_token.new_zeros(start), rest_token])[:, None]             # [D, 1]
        rest_key = z_rest[:, None] + race(torch.zeros_like(z_rest[:, None]), self.law)
        outside = rest_key > key                                                                # the rest wins the race
        tokens = torch.where(outside, rest_token, scored.support.gather(1, at))
        base = torch.where(outside, rest.gather(1, rest_token), inside.gather(2, at[..., None])[..., 0])
        return tokens, base - norm, inside

    def conditional(self, rows: torch.Tensor, support: torch.Tensor | None, logp: torch.Tensor) -> torch.Tensor:
        """[F, H] corrected states -> [F, V] log-probs: the full vocabulary's, or the marginal's `logp` [V] with
        the support's share of it spread by the conditional (as score() does: no token loses all its mass)."""
        if support is None:
            return self.block.lm_head(rows).float()
        cond = (rows @ self.block.lm_head.weight.index_select(0, support).T).float() + self.outside(support)
        cond = cond.log_softmax(-1)
        out = logp.expand(len(rows), -1).clone()
        out[:, support] = cond + logp[support].logsumexp(-1)
        return out

    @torch.no_grad()
    def scored(self, hidden: torch.Tensor, anchor: int, parts: tuple[torch.Tensor, torch.Tensor],
               m: int | None = None) -> Scored:
        """The head on every (depth, candidate previous token) pair at once: each depth's marginal top-m
        (depth 0's one candidate is the anchor; m: top_m unless given) and the conditional logits over the
        support."""
        depth, m = hidden.shape[0], m or self.top_m
        head, final_norm = self.model.ar_approximation, self.model.model.norm
        marginal, state = parts
        # one top-k serves both (with the row's log-sum-exp: the support's share of the mass)
        top = top_k(marginal.logits, max(m, self.support))
        columns = top.columns                                                        # [D, max(m, s)]
        ranked = marginal.tokens(columns)
        top_m = ranked[:, :m]                                                        # [D, m]
        prev = torch.cat([torch.tensor([anchor], device=hidden.device), top_m[:-1].flatten()])
        pos = torch.arange(depth, device=hidden.device).repeat_interleave(m)[m - 1:]
        compiled = self.compiled_head(hidden) if self.support and state.dtype == torch.bfloat16 else None
        if compiled is not None:   # the rows below in one compiled call
            stack, token_half, d = compiled
            support = ranked[:, :self.support]
            outside = None if self.block.vocab is None else self.outside(support)
            rows = stack.treeflash_head(pos, prev, token_half, state.contiguous(), d, hidden.contiguous(), support,
                                        self.block.lm_head.weight, outside)
            logits = torch.cat([rows[:1].expand(m, -1), rows[1:]]).view(depth, m, -1)
            share = top.values[:, :self.support].logsumexp(-1) - top.lse
            return Scored(top_m, support, logits, columns[:, :self.support], share)
        delta = head.combine(self.token_part(prev), state.index_select(0, pos))
        states = final_norm(hidden.index_select(0, pos) + delta)                    # [1 + (D-1)m, H]
        states = torch.cat([states[:1].expand(m, -1), states[1:]]).view(depth, m, -1)
        if not self.support:
            return Scored(top_m, None, self.block.lm_head(states).float())
        support = ranked[:, :self.support]                                           # [D, s]
        logits = gathered_logits(states, self.block.lm_head.weight, support) + self.outside(support)[:, None]
        share = top.values[:, :self.support].logsumexp(-1) - top.lse
        return Scored(top_m, support, logits, columns[:, :self.support], share)      # [D, m, s]

    def compiled_head(self, hidden: torch.Tensor) -> tuple | None:
        """(the drafter's compiled stack, how it makes a token's half, the head's last product) where scored()'s
        rows can run as one compiled call: drafting through the compiled pass (4-bit blocks on a CPU) with
        the head's products in that form; None elsewhere. Resolved once per pass (a generation)."""
        drafting = self.block.compiled_pass()
        key = (id(drafting), id(self.table))
        if self.__dict__.get("_head_key") == key:
            return self._head
        self._head_key, self._head = key, None
        head = self.model.ar_approximation
        token, d = head.halves()[0], tuned_product(head.d)
        weights = (self.block.lm_head.weight, self.block.embed.weight, head.norm.weight)
        if drafting is None or type(d) is not Q4Weight or hidden.dtype != torch.bfloat16 \
                or any(w.dtype != torch.bfloat16 or not w.is_contiguous() for w in weights):
            return None
        if self.table is None and type(token) is not Q4Weight:
            return None
        if self.table is not None and (self.table.dtype != torch.bfloat16 or not self.table.is_contiguous()):
            return None
        half = TokenHalf(self.table, weights[1].detach(), weights[2].detach(),
                         None if self.table is not None else token.packed)
        self._head = drafting[0], half, d.packed
        return self._head

    def outside(self, support: torch.Tensor) -> torch.Tensor:
        """-inf for support tokens outside the drafter's vocabulary (the `vocab` option), else 0: the support
        is gathered rows of the whole head, and a token the head does not score is never drafted."""
        if self.block.vocab is None:
            return torch.zeros(support.shape, device=support.device)
        return self.block.vocab.penalty(support)

    @torch.no_grad()
    def tables(self, hidden: torch.Tensor, anchor: int, parts: tuple[torch.Tensor, torch.Tensor] | None = None,
               scored: Scored | None = None):
        """Per (depth, candidate previous token): conditional top-k log-probs, tokens, next-depth links.
        `parts`, `scored`: this round's, if the caller made them already."""
        parts = parts or self.parts(hidden)
        scored = scored or self.scored(hidden, anchor, parts)
        top_m = scored.top_m
        logp, tokens = self.top(scored, parts[0])
        match = tokens[..., None] == top_m[:, None, None, :]                         # [D, m, k, m]
        links = torch.where(match.any(-1), match.int().argmax(-1), -1)
        links[-1] = -1                                                               # the block ends here
        return logp, tokens, links

    def token_part(self, prev: torch.Tensor) -> torch.Tensor:
        """The head's token half for these ids: rows of the table where there is one."""
        if self.table is not None:
            return self.table.index_select(0, prev)
        return self.model.ar_approximation.token_part(self.block.embed.weight.index_select(0, prev))

    def top(self, scored: Scored, marginal: Scores):
        """The conditional logits [D, m, s or V] -> the top-k (log-probs at the drafter temperature, tokens)."""
        t, logits, support = self.temperature, scored.logits, scored.support
        if support is None:
            top = torch.log_softmax(logits / t, dim=-1).topk(self.top_k, dim=-1)
            return top.values, top.indices
        # the support keeps the marginal's share of the mass: log P(S) - logsumexp over S of the conditional
        if t == 1.0 and scored.share is not None:
            share = scored.share
        else:
            scaled = marginal.logits / t
            share = scaled.gather(1, scored.columns).logsumexp(-1) - scaled.logsumexp(-1)
        top = top_k(logits if t == 1.0 else logits / t, self.top_k)                  # [D, m, k], lse [D, m]
        logp = top.values - top.lse[..., None] + share[:, None, None]
        return logp, support[:, None, :].expand_as(logits).gather(2, top.columns)


def load_treeflash_block(target, drafter_path: str) -> tuple[DFlashBlock, TreeFlashModel]:
    """A published-layout TreeFlash checkpoint in the target's dtype and device, refused if it does not fit."""
    weight = target.get_input_embeddings().weight
    model = load_treeflash(drafter_path, dtype=weight.dtype, device=weight.device)
    fits(model, target)
    return DFlashBlock(model.model, target), model
