"""Running the bench: each target loaded once, every contestant warmed up, then repeats x prompts x
contestants interleaved (each prompt runs every contestant in turn), so machine drift hits all alike."""
from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from ..engine.stats import Stats
from .defaults import DEFAULT_REPEATS, DEFAULT_SEED, WARMUP_TOKENS
from .methods import MethodSpec
from .prompts import Prompt


@dataclass(frozen=True)
class Settings:
    max_new_tokens: int
    temperature: float
    repeats: int = DEFAULT_REPEATS
    seed: int = DEFAULT_SEED

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def seed_for(self, prompt: int, repeat: int, prompts: int) -> int | None:
        """One seed per (prompt, repeat), the same for every contestant; none needed when greedy."""
        return None if self.greedy else self.seed + repeat * prompts + prompt


@dataclass(frozen=True)
class Output:
    tokens: list[int]
    stats: Stats          # peers fill only new_tokens and wall_time: transformers reports no rounds


@dataclass(frozen=True)
class Run:
    label: str
    prompt: int           # index into the prompt list
    repeat: int
    output: Output
    other_cores: float | None = None   # cores other processes kept busy while it ran (load.py)


class BenchInterrupted(Exception):
    """Ctrl-C during the runs: the runs that finished, every contestant's on the same prompts."""

    def __init__(self, runs: list[Run]):
        super().__init__("interrupted")
        self.runs = runs


def complete_groups(runs: list[Run], contestants: int) -> list[Run]:
    """The runs of every (repeat, prompt) that all contestants finished: a table over them compares like with
    like (each prompt has its baseline)."""
    done: dict = {}
    for r in runs:
        done.setdefault((r.repeat, r.prompt), []).append(r)
    return [r for group in done.values() if len(group) == contestants for r in group]


class Contestant(Protocol):
    label: str
    has_rounds: bool      # whether its Stats carry rounds (acceptance numbers)
    chat: bool            # whether prompts go in as chat messages
    target: str | None    # the target it runs on; its identity and speedup are checked against that `ar`

    def encode(self, text: str) -> list[int]: ...

    def run(self, ids: list[int], max_new_tokens: int, temperature: float, seed: int | None) -> Output: ...


def encode_for(generator, text: str, chat: bool) -> list[int]:
    """A prompt's ids: one user message in the target's chat template (chat), or the text as it is."""
    if chat:
        from ..chat import ChatFormat

        text = ChatFormat(generator.tokenizer).render([{"role": "user", "content": text}])
    return generator.encode(text)


class TreegenContestant:
    """One method (or preset) on a shared, already loaded target. It runs the engine's round loop itself:
    token ids out, no text decoding per round, timed like the peers' generate() (prompt already on the
    device), so only the decoding methods differ."""
    has_rounds = True
    chat = False          # prompts as chat messages (set by the session for every contestant alike)

    def __init__(self, spec: MethodSpec, generator):
        self.spec, self.generator = spec, generator
        self.label, self.target = spec.label, spec.target

    def encode(self, text: str) -> list[int]:
        return encode_for(self.generator, text, self.chat)

    def run(self, ids, max_new_tokens, temperature, seed) -> Output:
        import torch

        from ..engine.generate import generate

        g = self.generator
        config = g.config(max_new_tokens=max_new_tokens, temperature=temperature, seed=seed)
        prompt, stats, tokens = torch.tensor(ids, device=g.model.device), Stats(), []
        t0 = time.perf_counter()
        for r in generate(g.model, g.draft_model, prompt, config):
            stats.add(r)
            tokens.extend(r.tokens)
        stats.wall_time = time.perf_counter() - t0
        return Output(tokens, stats)


def load_contestants(specs: list[MethodSpec], load: dict) -> tuple[list[TreegenContestant], dict]:
    """(a contestant per spec, {target: its loaded Generator}); each target is loaded once, for all."""
    from ..api import Generator

    targets: dict = {}
    out = []
    for spec in specs:
        if spec.target not in targets:
            targets[spec.target] = Generator(target=spec.target, method="ar", **load)
        generator = targets[spec.target].with_method(spec.method, spec.drafter, dict(spec.options))
        out.append(TreegenContestant(spec, generator))
    return out, targets


def warm_up(contestants: list[Contestant], prompt: Prompt, settings: Settings) -> None:
    for c in contestants:
        c.run(c.encode(prompt.text), WARMUP_TOKENS, settings.temperature, settings.seed_for(0, 0, 1))


def run_all(contestants: list[Contestant], prompts: list[Prompt], settings: Settings,
            on_run: Callable[[Run], None] | None = None) -> list[Run]:
    """Every contestant on every prompt, `repeats` times, interleaved; the runs in the order they ran. Each
    (repeat, prompt) group starts one contestant further along, so each takes every place in a group in
    turn, first included (the machine's state after a run is part of the next one's time).
    Ctrl-C raises BenchInterrupted with the (repeat, prompt) groups every contestant finished."""
    from .load import other_cores, sample

    runs: list[Run] = []
    try:
        warm_up(contestants, prompts[0], settings)
        encoded = {(c.label, i): c.encode(p.text) for c in contestants for i, p in enumerate(prompts)}
        for repeat in range(settings.repeats):
            for i in range(len(prompts)):
                seed = settings.seed_for(i, repeat, len(prompts))
                turn = (repeat * len(prompts) + i) % len(contestants)
                for c in contestants[turn:] + contestants[:turn]:
                    before = sample()
                    out = c.run(encoded[c.label, i], settings.max_new_tokens, settings.temperature, seed)
                    runs.append(Run(c.label, i, repeat, out, other_cores(before, sample())))
                    if on_run is not None:
                        on_run(runs[-1])
    except KeyboardInterrupt:
        raise BenchInterrupted(complete_groups(runs, len(contestants))) from None
    return runs
