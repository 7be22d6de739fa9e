"""Per-generation statistics from Round events: acceptance length, per-position acceptance, time split."""
from __future__ import annotations

from collections import Counter
from dataclasses import asdict, dataclass, field

from .generate import Round


@dataclass
class Stats:
    rounds: int = 0                      # decode rounds (target forwards after the prefill)
    drafting_rounds: int = 0             # of those, rounds that verified a draft (not resting, not empty)
    new_tokens: int = 0                  # generated tokens, the prefill's first token included
    accepted_drafts: int = 0
    drafted: int = 0
    accept_histogram: Counter = field(default_factory=Counter)  # accepted drafts per round -> count
    time_prefill: float = 0.0
    time_draft: float = 0.0
    time_build: float = 0.0
    time_verify: float = 0.0
    time_commit: float = 0.0
    wall_time: float = 0.0
    finish: str | None = None
    prompt_reused: int = 0               # prompt tokens not prefilled: their cache rows were the last turn's
    ways: Counter = field(default_factory=Counter)  # rounds by how a routing drafter drafted (lookup: true)

    def add(self, r: Round) -> None:
        self.new_tokens += len(r.tokens)
        self.finish = r.finish or self.finish
        if r.index == 0:
            self.time_prefill += r.t_verify
            self.prompt_reused += r.reused
            return
        self.rounds += 1
        self.accepted_drafts += r.accepted
        self.drafted += r.drafted
        self.drafting_rounds += r.drafted > 0
        self.accept_histogram[r.accepted] += 1
        if r.way:
            self.ways[r.way] += 1
        self.time_draft += r.t_draft
        self.time_build += r.t_build
        self.time_verify += r.t_verify
        self.time_commit += r.t_commit

    @property
    def mean_accepted_length(self) -> float:
        """Tokens committed per decode round, bonus included (tau in the papers)."""
        return (self.accepted_drafts + self.rounds) / self.rounds if self.rounds else 0.0

    @property
    def drafting_length(self) -> float:
        """Tokens committed per round that verified a draft: what a tree brings when the drafter runs (a
        `budget: auto` run also has rounds without one, where drafting would not pay)."""
        return (self.accepted_drafts + self.drafting_rounds) / self.drafting_rounds if self.drafting_rounds else 0.0

    @property
    def acceptance_per_position(self) -> list[float]:
        """Fraction of decode rounds whose draft at depth k was accepted, k = 1 .. deepest accepted."""
        if not self.rounds or not self.accept_histogram:
            return []
        deepest = max(self.accept_histogram)
        return [sum(c for a, c in self.accept_histogram.items() if a >= k) / self.rounds
                for k in range(1, deepest + 1)]

    @property
    def accepted_per_round(self) -> float:
        """Drafted tokens accepted per decode round (tau - 1)."""
        return self.accepted_drafts / self.rounds if self.rounds else 0.0

    @property
    def tree_used(self) -> float:
        """The share of drafted nodes that were on an accepted path: how much of each tree paid."""
        return self.accepted_drafts / self.drafted if self.drafted else 0.0

    @property
    def tokens_per_second(self) -> float:
        return self.new_tokens / self.wall_time if self.wall_time else 0.0

    def to_dict(self) -> dict:
        d = asdict(self)
        d.pop("accept_histogram")
        d["ways"] = dict(sorted(self.ways.items()))
        for key in ("time_prefill", "time_draft", "time_build", "time_verify", "time_commit"):
            d.pop(key)
        other = max(self.wall_time - self.time_prefill - self.time_draft - self.time_build - self.time_verify, 0.0)
        d.update(
            mean_accepted_length=self.mean_accepted_length, drafting_length=self.drafting_length,
            acceptance_per_position=self.acceptance_per_position,   # = the share of rounds reaching depth k
            accepted_per_round=self.accepted_per_round, tree_used=self.tree_used,
            accept_histogram={str(k): v for k, v in sorted(self.accept_histogram.items())},
            mean_tree_size=self.drafted / self.rounds if self.rounds else 0.0,
            wall_time_s=self.wall_time, tokens_per_second=self.tokens_per_second,
            time_split_s={"prefill": self.time_prefill, "draft": self.time_draft, "build": self.time_build,
                          "verify": self.time_verify, "other": other})
        d.pop("wall_time")
        return d
