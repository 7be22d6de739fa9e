"""The Drafter protocol lives in the engine (treegen.engine.drafter); drafters import it from here too.
Also: drawing a chain from draft laws (`sample: true` at T > 0), with `draws` children per depth."""
import itertools
from dataclasses import dataclass

import torch

from ..engine.drafter import Drafter, DraftState
from ..engine.tree import DraftTree, widths
from . import defaults as D

__all__ = ["DraftState", "Drafter", "Drawing", "draw", "inverse_cdf", "law_chain", "race", "sampled_chain", "widths",
           "with_siblings", "with_spine"]


@dataclass(frozen=True)
class Drawing:
    """How a drafter with draft laws drafts at T > 0: the `sample`, `draws` and `draw_shape` options."""
    sample: bool = D.SAMPLE   # a chain drawn from the draft laws first (speculative sampling)
    draws: int = D.DRAWS      # drawn children at depth 1 (with_siblings), halving with depth
    shape: str = D.DRAW_SHAPE  # the drawn part: "chain" (with its siblings) or "tree" (drafters/drawn.py)


def draw(logits: torch.Tensor, state: DraftState) -> tuple[torch.Tensor, torch.Tensor]:
    """[D, V] draft logits -> (tokens [D], their laws q [D, V]): q is the target's sampling rule (temperature,
    top-k, top-p, min-p) applied to the draft logits, so the drafts are shaped like the target's draws."""
    q = state.sampler.probs(logits)
    return race(q.log(), state).argmax(-1), q


def race(logq: torch.Tensor, state: DraftState) -> torch.Tensor:
    """log q - log E, E ~ Exp(1) per entry: the largest is a draw from q, the k largest the first k draws
    without replacement (the exponential race). E = -log(1 - U) with U uniform on float32's grid, moved
    to each step's midpoint so that E is never 0; torch's exponential_ and multinomial cost 6x more on a
    CPU (2 ms for 15 x 8192)."""
    u = torch.rand(logq.shape, generator=state.generator, device=logq.device) + 2.0 ** -25
    return logq - torch.log(-torch.log1p(-u)).to(logq.dtype)


def inverse_cdf(logits: torch.Tensor, state: DraftState) -> tuple[torch.Tensor, torch.Tensor]:
    """One draw per row of [D, V] logits from one uniform a row (the race needs V of them: 5x the time of
    these few passes on a CPU), and each row's logsumexp, which the CDF has on the way.
    side="right" never returns a zero-probability token."""
    top = logits.amax(-1, keepdim=True)
    cdf = (logits - top).exp().cumsum(-1)
    total = cdf[:, -1:]
    u = torch.rand(cdf.shape[0], 1, generator=state.generator, device=cdf.device, dtype=cdf.dtype) * total
    draws = torch.searchsorted(cdf, u, right=True)[:, 0].clamp_max(cdf.shape[1] - 1)
    return draws, (total.log() + top)[:, 0]


def sampled_chain(logits: torch.Tensor, state: DraftState, draws: int = 1, budget: int | None = None) -> DraftTree:
    """A chain whose every position is drawn from its own law (given the context only: DFlash's marginals),
    with siblings drawn beside it (with_siblings)."""
    return with_siblings(law_chain(*draw(logits, state)), state, draws, budget)


def law_chain(tokens: torch.Tensor, q: torch.Tensor) -> DraftTree:
    """Drawn tokens [D] and the laws [D, V] they came from, as a chain scored by its path log q."""
    logq = q.gather(1, tokens[:, None])[:, 0].clamp_min(1e-30).log()
    return DraftTree.chain(tokens, logq.cumsum(0), q)


def with_siblings(chain: DraftTree, state: DraftState, draws: int, budget: int | None = None) -> DraftTree:
    """A drawn chain (node i from q[i]) plus, at each depth, its later draws without replacement from the same
    law: an exponential race among the tokens the chain did not take (given the first arrival, the rest race
    on afresh), so node i and its siblings are q's first draws in order (engine/verify.py tries them so).
    `budget`: the depths whose draws fit in it, at least one (a cut by depth and counts: never by the draws)."""
    if len(chain) == 0:
        return chain
    q = chain.q
    support = (q > 0).sum(-1).tolist()   # a law's support bounds its draws: a count that ignores the drafts
    extra = [min(w, s) - 1 for w, s in zip(widths(draws, len(chain)), support)]
    if budget is not None:
        extra[0] = min(extra[0], budget - 1)
        fit = sum(1 for total in itertools.accumulate(1 + k for k in extra) if total <= budget)
        if fit < len(chain):
            chain, extra = chain.truncate_depth(max(fit, 1)), extra[:max(fit, 1)]
    if max(extra) < 1:
        return chain
    last = max(d for d, k in enumerate(extra) if k > 0) + 1   # race only the depths that draw more
    rest = q[:last].clone()
    rest.scatter_(1, chain.tokens[:last, None], 0.0)
    order = race(rest.log(), state).topk(max(extra), dim=-1)   # [D, k]: the next arrivals, in order
    depths = [d for d, k in enumerate(extra) for _ in range(k)]
    tokens = order.indices[depths, [j for k in extra for j in range(k)]]
    laws = torch.tensor(depths, dtype=torch.long, device=tokens.device)
    parents = laws - 1
    scores = None
    if chain.scores is not None:   # a sibling's path score: its parent's, plus its own log q
        prior = torch.cat([chain.scores.new_zeros(1), chain.scores[:-1]])[laws]
        scores = torch.cat([chain.scores, prior + q[laws, tokens].clamp_min(1e-30).log()])
    return DraftTree(torch.cat([chain.tokens, tokens]), torch.cat([chain.parents, parents]),
                     torch.cat([chain.depth, laws + 1]), scores, q, torch.cat([chain.law, laws]))


def with_spine(spine: DraftTree, rest: DraftTree) -> DraftTree:
    """A drawn spine first, then a deterministic tree under the same anchor: at each depth the spine's
    drafts are tried by rejection sampling, the tree's children on the residual draw (engine/verify.py)."""
    shift = len(spine)
    parents = torch.where(rest.parents >= 0, rest.parents + shift, rest.parents)
    scores = None if spine.scores is None or rest.scores is None else torch.cat([spine.scores, rest.scores])
    law = torch.cat([spine.law, torch.full_like(rest.tokens, -1)])
    return DraftTree(torch.cat([spine.tokens, rest.tokens]), torch.cat([spine.parents, parents]),
                     torch.cat([spine.depth, rest.depth]), scores, spine.q, law)
