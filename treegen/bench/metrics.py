"""From runs to numbers: per contestant and per prompt category, pooled over every round of every run.

Acceptance length is pooled (all accepted drafts + rounds over all rounds), not a mean of per-prompt means,
so long generations weigh as much as they cost. Tokens/s is total new tokens over total wall time. Speedup
vs ar: per repeat, tokens/s over the prompts; median over repeats of the contestant's / median of ar's,
with the range of the per-repeat ratios (the median ratio always lies inside it).
"""
from __future__ import annotations

import statistics
from collections import Counter
from dataclasses import dataclass, field, fields

from ..engine.stats import Stats
from .runner import Run

ALL = "all"   # the category that pools every prompt


@dataclass(frozen=True)
class Speedup:
    median: float
    min: float
    max: float


@dataclass(frozen=True)
class Mismatch:
    prompt: str           # the prompt's id
    repeat: int
    first_difference: int  # index of the first token that differs (or the shorter length)
    tokens: int
    baseline_tokens: int


@dataclass
class Summary:
    """One contestant on one category of prompts; acceptance fields are None for peers (no rounds)."""
    mean_accepted_length: float | None
    acceptance_per_position: list[float] | None
    mean_tree_size: float | None
    tokens_per_second: float
    speedup_vs_ar: Speedup
    identical_to_ar: bool | None          # None when sampling: identity is not expected at T > 0
    time_split_s: dict[str, float] | None
    new_tokens: int
    wall_time_s: float
    prompts: int
    runs: int
    mismatches: list[Mismatch] = field(default_factory=list)
    drafting_length: float | None = None      # tokens per round that verified a draft
    drafting_share: float | None = None       # the share of rounds that verified a draft


def pooled(stats: list[Stats]) -> Stats:
    """The sum of several generations' Stats, as if one long generation."""
    total = Stats()
    for s in stats:
        for f in fields(Stats):
            value = getattr(s, f.name)
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                setattr(total, f.name, getattr(total, f.name) + value)
        total.accept_histogram += Counter(s.accept_histogram)
        total.ways += Counter(s.ways)
    return total


def tokens_per_second(runs: list[Run]) -> float:
    wall = sum(r.output.stats.wall_time for r in runs)
    return sum(r.output.stats.new_tokens for r in runs) / wall if wall else 0.0


def per_repeat_rates(runs: list[Run]) -> list[float]:
    repeats = sorted({r.repeat for r in runs})
    return [tokens_per_second([r for r in runs if r.repeat == k]) for k in repeats]


def speedup(runs: list[Run], baseline: list[Run]) -> Speedup:
    mine, base = per_repeat_rates(runs), per_repeat_rates(baseline)
    ratios = [m / b if b else 0.0 for m, b in zip(mine, base)]
    middle = statistics.median(base)
    return Speedup(statistics.median(mine) / middle if middle else 0.0, min(ratios), max(ratios))


def mismatches(runs: list[Run], baseline: list[Run], prompt_ids: list[str]) -> list[Mismatch]:
    """Runs whose tokens differ from ar's first repeat on the same prompt (ar's own repeats included)."""
    reference = {r.prompt: r.output.tokens for r in baseline if r.repeat == 0}
    found = []
    for r in runs:
        mine, theirs = r.output.tokens, reference[r.prompt]
        if mine != theirs:
            first = next((i for i, (a, b) in enumerate(zip(mine, theirs)) if a != b), min(len(mine), len(theirs)))
            found.append(Mismatch(prompt_ids[r.prompt], r.repeat, first, len(mine), len(theirs)))
    return found


def summarize(runs: list[Run], baseline: list[Run], has_rounds: bool, greedy: bool,
              prompt_ids: list[str]) -> Summary:
    stats = pooled([r.output.stats for r in runs])
    record = stats.to_dict()
    wrong = mismatches(runs, baseline, prompt_ids) if greedy else []
    return Summary(
        mean_accepted_length=stats.mean_accepted_length if has_rounds else None,
        acceptance_per_position=stats.acceptance_per_position if has_rounds else None,
        mean_tree_size=record["mean_tree_size"] if has_rounds else None,
        tokens_per_second=tokens_per_second(runs), speedup_vs_ar=speedup(runs, baseline),
        identical_to_ar=(not wrong) if greedy else None,
        time_split_s=record["time_split_s"] if has_rounds else None,
        new_tokens=stats.new_tokens, wall_time_s=stats.wall_time, prompts=len({r.prompt for r in runs}),
        runs=len(runs), mismatches=wrong,
        drafting_length=stats.drafting_length if has_rounds else None,
        drafting_share=stats.drafting_rounds / stats.rounds if has_rounds and stats.rounds else None)


@dataclass
class Result:
    """One contestant: its summary over every prompt and per category."""
    label: str
    info: dict                       # method, preset, target, drafter, options: what ran
    overall: Summary
    categories: dict[str, Summary]

    @property
    def peer(self) -> bool:
        """transformers' own decoding (bench/peers.py): other kernels, so a near-tie may round the other way."""
        return self.label.startswith("hf-")

    @property
    def differs(self) -> bool:
        return self.overall.identical_to_ar is False

    @property
    def failed_identity(self) -> bool:
        """A treegen method whose T=0 output is not ar's: an exactness bug."""
        return self.differs and not self.peer


def categories_of(prompt_categories: list[str]) -> list[str]:
    return list(dict.fromkeys(prompt_categories))


def in_category(runs: list[Run], prompt_categories: list[str], category: str) -> list[Run]:
    return [r for r in runs if prompt_categories[r.prompt] == category]


def result(label: str, info: dict, runs: list[Run], baseline: list[Run], has_rounds: bool, greedy: bool,
           prompt_ids: list[str], prompt_categories: list[str]) -> Result:
    ran = {r.prompt for r in runs}    # all of them, unless Ctrl-C cut the bench short
    per_category = {c: summarize(in_category(runs, prompt_categories, c), in_category(baseline, prompt_categories, c),
                                 has_rounds, greedy, prompt_ids)
                    for c in categories_of([c for i, c in enumerate(prompt_categories) if i in ran])}
    return Result(label, info, summarize(runs, baseline, has_rounds, greedy, prompt_ids), per_category)


def by_category(results: list[Result]) -> dict[str, dict[str, Summary]]:
    """{category: {label: summary}}, `all` first (the only one when the prompts have one category)."""
    out = {ALL: {r.label: r.overall for r in results}}
    names = list(results[0].categories) if results else []
    if len(names) > 1:
        out.update({c: {r.label: r.categories[c] for r in results} for c in names})
    return out
