"""The seam between the engine and every method: propose a tree, then learn what was committed."""
from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Protocol

import torch

from .clock import Clock
from .sampling import Sampler
from .tree import DraftTree


@dataclass(frozen=True)
class DraftState:
    tokens: torch.Tensor   # [L] every committed token (prompt + generated); the last one is the anchor
    max_depth: int         # deepest node worth drafting: the limits (context, max_new_tokens), budget: auto's cap
    sampler: Sampler | None = None                 # the target's sampling law (a drafter may sample by it)
    generator: torch.Generator | None = None       # the generation's random stream (None: torch's global one)
    max_nodes: int | None = None   # budget: auto's most nodes it could verify this round (None: no cap)
    clock: Clock | None = None     # the seconds a drafter's own choices read (engine/clock.py; None: measured)
    max_draws: int | None = None   # budget: auto's most drawn children at depth 1 worth drawing (None: no cap)

    @property
    def sampling(self) -> bool:
        return self.sampler is not None and not self.sampler.greedy


class Drafter(Protocol):
    """Every member the engine reads. The optional ones have defaults, which a drafter takes by subclassing
    Drafter; the engine reads each member directly, never probing for it."""
    name: str
    # target decoder layers whose outputs the drafter wants as context features (empty: none)
    target_layer_ids: tuple[int, ...] = ()
    # the shape of the drawn part of a tree at T > 0, "chain" or "tree": `budget: auto` costs that part by it
    draw_shape: str = "chain"
    # how the last proposal drafted, for a drafter that routes its rounds (lookup, tree, plain); in the Round
    way: str | None = None
    # seconds the last proposal spent building its tree apart from the neural passes (BuildClock); the engine
    # sets it to 0 before each propose(), so a proposal that builds no tree reports none
    t_build: float = 0.0

    def begin(self, prompt: torch.Tensor, features: torch.Tensor | None) -> None:
        """After prefill: the prompt ids [P] and their target features [P, k*H] (None if none asked)."""

    def propose(self, state: DraftState) -> DraftTree:
        """A draft tree under the anchor; the engine deduplicates siblings and truncates to max_depth."""

    def commit(self, tokens: list[int], features: torch.Tensor | None) -> None:
        """The round's committed tokens (accepted drafts + bonus) and the target features of the rows
        that were accepted (the anchor and the accepted drafts; the bonus has none yet)."""

    def forget(self) -> None:
        """Drop what earlier generations taught it from round times (a router's rates): the engine calls it
        after a calibration run, whose choices read a clock the runs after it do not (engine/clock.py)."""


def sync(device: torch.device) -> None:
    """Wait for queued GPU work, so that a timer reads what ran before it (a no-op on the CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class BuildClock(Drafter):
    """For drafters: times the host-side tree build of the last proposal apart from the neural passes
    before it, into t_build, which the engine reads after each propose()."""

    @contextmanager
    def building(self, device: torch.device) -> Iterator[None]:
        sync(device)
        t0 = time.perf_counter()
        try:
            yield
        finally:
            sync(device)
            self.t_build = time.perf_counter() - t0
