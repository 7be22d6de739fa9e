"""`ar`: no drafts. Plain decoding through the same loop; the baseline of every speedup."""
from __future__ import annotations

from ..engine.tree import DraftTree
from .base import Drafter, DraftState


class ARDrafter(Drafter):
    name = "ar"

    def begin(self, prompt, features) -> None:
        pass

    def propose(self, state: DraftState) -> DraftTree:
        return DraftTree.empty(state.tokens.device)

    def commit(self, tokens, features) -> None:
        pass
