"""The Drafter protocol lives in the engine (treegen.engine.drafter); drafters import it from here too.
Also: drawing a chain from draft laws, for the chain methods' `sample: true` at T > 0."""
import torch

from ..engine.drafter import Drafter, DraftState
from ..engine.tree import DraftTree

__all__ = ["DraftState", "Drafter", "draw", "sampled_chain", "with_spine"]


def draw(logits: torch.Tensor, state: DraftState) -> tuple[torch.Tensor, torch.Tensor]:
    """[D, V] draft logits -> (tokens [D], their laws q [D, V]): q is the target's sampling rule (temperature,
    top-k, top-p, min-p) applied to the draft logits, so the drafts are shaped like the target's draws."""
    q = state.sampler.probs(logits)
    return torch.multinomial(q, 1, generator=state.generator).squeeze(-1), q


def sampled_chain(logits: torch.Tensor, state: DraftState) -> DraftTree:
    """A chain whose every position is drawn from its own law (given the context only: DFlash's marginals)."""
    tokens, q = draw(logits, state)
    logq = q.gather(1, tokens[:, None])[:, 0].clamp_min(1e-30).log()
    return DraftTree.chain(tokens, logq.cumsum(0), q)


def with_spine(spine: DraftTree, rest: DraftTree) -> DraftTree:
    """A sampled chain first, then a deterministic tree under the same anchor: at each depth the spine's
    draft is tried by speculative sampling, the tree's children on the residual draw (engine/verify.py)."""
    shift = len(spine)
    parents = torch.where(rest.parents >= 0, rest.parents + shift, rest.parents)
    scores = None if spine.scores is None or rest.scores is None else torch.cat([spine.scores, rest.scores])
    return DraftTree(torch.cat([spine.tokens, rest.tokens]), torch.cat([spine.parents, parents]),
                     torch.cat([spine.depth, rest.depth]), scores, spine.q)
