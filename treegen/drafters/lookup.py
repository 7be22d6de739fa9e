"""`lookup: true` (any method with a drafter): each round is routed, by measurement, to one of three ways
of drafting: prompt lookup's drafts alone where the text so far repeats (an n-gram match; no drafter pass),
the method's own tree, or no drafts at all (plain decoding through the same loop; no drafter pass).

Why: on a CPU the drafter pass is a third of a tree round. Where text repeats (code that reuses its own
names, a reply that quotes the prompt) a lookup round commits as much for the price of a small verify; where
a drafter does poorly (a target it was not trained well for) plain decoding is the faster round. Rates are
measured, not assumed (when sampling, on the engine's calibrated clock: engine/clock.py): committed tokens
per second from proposal to commit, per context (the matched n-gram's length, or no match) and way, decayed
so the choice follows the text; each way runs TRIES rounds in a context first, and a losing way runs again
after RETRY_EVERY rounds without it. Skipped drafter passes lose nothing: the drafter folds the features of
every committed token into its next pass.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

from ..engine.clock import Clock
from ..engine.drafter import Drafter, sync
from ..engine.tree import DraftTree
from .base import DraftState
from .pld import PromptLookupDrafter, trie

TRIES = 3          # rounds each way runs in a context before rates decide
RETRY_EVERY = 24   # rounds of a context after which a losing way runs once more (the text may have changed)
PLAIN_MARGIN = 1.15  # plain decoding is chosen only this much faster than drafting: a drafter left idle
                     # folds more context on its next pass, a cost the plain rounds' own times do not show
WEIGHT = 0.2       # weight of the latest round in a way's running rate (a plain mean over the first rounds)


@dataclass
class Arm:
    """One way of drafting in one context."""
    tokens: float = 0.0    # running mean of committed tokens per round
    seconds: float = 0.0   # running mean of round time
    rounds: int = 0
    idle: int = 0          # rounds of its context since it last ran

    @property
    def rate(self) -> float:
        """Tokens per second: a ratio of means (a mean of per-round ratios would overrate quick rounds)."""
        return self.tokens / self.seconds if self.seconds else 0.0

    def observe(self, tokens: int, seconds: float) -> None:
        self.rounds += 1
        w = max(WEIGHT, 1 / self.rounds)
        self.tokens += w * (tokens - self.tokens)
        self.seconds += w * (seconds - self.seconds)


class LookupFirst(Drafter):
    """Wraps a drafter: routes each round to lookup, the drafter's tree, or plain decoding (see above)."""

    def __init__(self, inner: Drafter, lookup: PromptLookupDrafter | None = None):
        self.inner, self.lookup = inner, lookup or PromptLookupDrafter()
        self.name = inner.name
        self.target_layer_ids = inner.target_layer_ids
        self.arms: dict[tuple[str, str], Arm] = {}   # (context, way) -> its running rate
        self.pending: tuple[tuple[str, str], float] | None = None   # this round's arm, and when it started
        self.device = None
        self.way: str | None = None   # how the last proposal drafted (the engine puts it in the Round)
        self.first = True      # the next proposal is the generation's first
        self.clock: Clock | None = None   # the engine's (engine/clock.py: fixed when sampling), from the proposal

    @property
    def draw_shape(self) -> str:   # the engine's auto budget costs a drawn part by it
        return self.inner.draw_shape

    @property
    def t_build(self) -> float:   # the engine reads the tree build time of the last proposal
        return self.inner.t_build if self.way == "tree" else 0.0

    @t_build.setter
    def t_build(self, value: float) -> None:
        self.inner.t_build = value

    def forget(self) -> None:
        self.arms.clear()
        self.inner.forget()

    def begin(self, prompt, features) -> None:
        self.pending, self.device, self.first = None, prompt.device, True
        self.inner.begin(prompt, features)

    def commit(self, tokens, features) -> None:
        if self.pending is not None:
            arm, t0 = self.pending
            sync(self.device)
            seconds = time.perf_counter() - t0
            if self.clock is not None:
                seconds = self.clock(f"way:{arm[1]}", seconds)
            self.arms[arm].observe(len(tokens), seconds)
        self.inner.commit(tokens, features)

    def propose(self, state: DraftState) -> DraftTree:
        t0 = time.perf_counter()
        self.clock = state.clock
        n, conts = self.lookup.match(state)
        context = f"match{n}" if conts else "none"   # a 3-gram match predicts more than a 1-gram
        way = self.choose(context, ("lookup", "tree", "plain") if conts else ("tree", "plain"))
        # the first pass after a prefill folds the whole prompt in: no way's typical round, so it rates none
        self.pending = None if self.first else ((context, way), t0)
        self.way, self.first = way, False
        if way == "lookup":
            return trie(conts, state.tokens.device)
        return self.inner.propose(state) if way == "tree" else DraftTree.empty(state.tokens.device)

    def choose(self, context: str, ways: tuple[str, ...]) -> str:
        """This round's way: each runs TRIES rounds in a context first, then the fastest, a slower one again
        once it has not run for RETRY_EVERY rounds of this context."""
        arms = {way: self.arms.setdefault((context, way), Arm()) for way in ways}
        untried = [way for way in ways if arms[way].rounds < TRIES]
        stale = [way for way in ways if arms[way].idle >= RETRY_EVERY]
        def worth(way: str) -> float:
            return arms[way].rate / (PLAIN_MARGIN if way == "plain" else 1.0)
        way = (untried or stale or [max(ways, key=worth)])[0]
        for each, arm in arms.items():
            arm.idle = 0 if each == way else arm.idle + 1
        return way
