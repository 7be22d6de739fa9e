"""The Python API the CLI is built on:

    from treegen import Generator
    g = Generator()                                # the shipped demo pair, best method
    print(g.generate("def fib(n):", max_new_tokens=64).text)
    for chunk in g.stream("import os\\n", temperature=0.8, seed=1):
        print(chunk.text, end="", flush=True)
    prefix = PrefixCache()                         # multi-turn: each prompt that extends the last one
    g.generate(turn1, prefix=prefix)               # prefills only its new tokens (treegen chat does this)
"""
from __future__ import annotations

import copy
import json
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

from .drafters import auto_budget, build_drafter, get_method
from .engine.budget import AutoBudget
from .engine.clock import Clock
from .engine.disk import LoadWatch
from .engine.forms import weight_form
from .engine.generate import GenerationConfig, Round, generate
from .engine.prefill import DEFAULT_CHUNK
from .engine.prefix import PrefixCache
from .engine.sampling import Sampler
from .engine.stats import Stats
from .engine.threads import ThreadPlan, neutral_counts
from .loading import DEFAULT_ATTN, DEFAULT_DEVICE, DEFAULT_DTYPE, context_length, eos_ids, load_target
from .validate import SAMPLING, check_sampling, effective_seed


@dataclass(frozen=True)
class Chunk:
    """One round as the user sees it: the text it added and the round's numbers."""
    text: str
    round: Round
    stats: Stats             # running totals, shared and updated in place as the stream goes on
    finish: str | None = None


@dataclass
class Completion:
    text: str
    token_ids: list[int]
    prompt_token_ids: list[int]
    stats: Stats
    finish: str | None = None


class StreamDecoder:
    """Turns token ids into text deltas without re-decoding everything or splitting a UTF-8 character."""

    def __init__(self, tokenizer):
        self.tokenizer, self.ids, self.prefix, self.read = tokenizer, [], 0, 0

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def push(self, ids: list[int]) -> str:
        self.ids.extend(ids)
        done = self._decode(self.ids[self.prefix:self.read])
        full = self._decode(self.ids[self.prefix:])
        if full.endswith("\ufffd"):
            return ""  # a multi-byte character is still incomplete
        self.prefix, self.read = self.read, len(self.ids)
        return full[len(done):]

    def flush(self) -> str:
        """At the end: whatever push() still holds back (a character cut off by the end), as decoded."""
        done = self._decode(self.ids[self.prefix:self.read])
        full = self._decode(self.ids[self.prefix:])
        self.prefix = self.read = len(self.ids)
        return full[len(done):]


CALIBRATION_TEXT = "The history of the printing press begins"   # engine/clock.py: what _calibrate generates from
CALIBRATION_TOKENS = 64


@dataclass
class Generator:
    """A loaded target (+ tokenizer) and a drafting method, ready to generate."""
    target: str | None = None            # hub id or folder; None = the shipped demo target
    method: str = "auto"                 # "auto" = the best method the drafter allows
    drafter: str | None = None
    method_options: dict = field(default_factory=dict)
    dtype: str = DEFAULT_DTYPE
    device: str = DEFAULT_DEVICE
    device_map: str | None = None
    load_in_8bit: bool = False
    load_in_4bit: bool = False
    attn_implementation: str = DEFAULT_ATTN
    prefill_chunk: int = DEFAULT_CHUNK   # prompt rows per prefill forward (engine/prefill.py)
    adapt_threads: bool = True           # greedy runs take only the free cores where that keeps the bits
    weights: str = field(init=False, default="")   # what the target's weights are as loaded: int8, bfloat16, ...
    budgets: dict = field(init=False, default_factory=dict, repr=False)   # `budget: auto`'s state per sampler
    clocks: dict = field(init=False, default_factory=dict, repr=False)    # per sampler: engine/clock.py

    def __post_init__(self):
        from .config import resolve_model

        model = resolve_model(self.target, self.drafter, self.method, self.method_options, self.dtype)
        self.target, self.drafter, self.method = model.target, model.drafter, model.method
        self.method_options = dict(model.method_options)
        self.model, self.tokenizer = load_target(
            self.target, dtype=self.dtype, device=self.device, device_map=self.device_map,
            load_in_8bit=self.load_in_8bit, load_in_4bit=self.load_in_4bit,
            attn_implementation=self.attn_implementation)
        self.weights = weight_form(self.model)
        self.draft_model = build_drafter(self.method, self.model, self.drafter, self.method_options)
        self.verify_cost = self._verify_cost()
        self.thread_plan = ThreadPlan(neutral_counts(self.model) if self.adapt_threads else ())

    def _verify_cost(self):
        """`budget: auto`: the target's forward time per row count, measured once per setting and cached."""
        from .engine.budget import verify_cost

        return verify_cost(self.model) if auto_budget(self.method_options) else None

    def with_method(self, method: str, drafter: str | None = None, method_options: dict | None = None) -> Generator:
        """Another method on this generator's loaded target, not loaded again (benchmarks compare methods so)."""
        from .assets import local_or_shipped
        from .policy import best_method

        other = copy.copy(self)
        other.drafter, other.method_options = local_or_shipped(drafter, "drafter"), dict(method_options or {})
        other.method = best_method(other.drafter) if method == "auto" else method
        other.draft_model = build_drafter(other.method, self.model, other.drafter, other.method_options)
        other.verify_cost, other.budgets, other.clocks = other._verify_cost(), {}, {}
        return other

    def encode(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            try:
                prompt.encode("utf-8")
            except UnicodeEncodeError:
                raise ValueError("the prompt is not valid UTF-8 text (it holds undecodable bytes)") from None
            return self.tokenizer(prompt, add_special_tokens=False)["input_ids"]
        return list(prompt)

    def config(self, *, max_new_tokens: int = SAMPLING["max_new_tokens"].default,
               temperature: float = SAMPLING["temperature"].default, top_k: int = SAMPLING["top_k"].default,
               top_p: float = SAMPLING["top_p"].default, min_p: float = SAMPLING["min_p"].default,
               seed: int | None = SAMPLING["seed"].default) -> GenerationConfig:
        """Checked by the same definitions as the CLI's flags (treegen.validate); seed -1 or None: random."""
        s = check_sampling({"max_new_tokens": max_new_tokens, "temperature": temperature, "top_k": top_k,
                            "top_p": top_p, "min_p": min_p, "seed": seed})
        sampler = Sampler(s["temperature"], s["top_k"], s["top_p"], s["min_p"])
        return GenerationConfig(s["max_new_tokens"], sampler, effective_seed(s["seed"]),
                                eos_ids(self.model, self.tokenizer), context_length(self.model), self.verify_cost,
                                self.prefill_chunk, self._budget(sampler), self._clock(sampler))

    def _budget(self, sampler: Sampler) -> AutoBudget | None:
        """`budget: auto`: one per sampler, carried from generation to generation (a chat's turns, a bench's
        prompts), so each starts with what the last ones learned of this drafter and machine."""
        if self.verify_cost is None:
            return None
        if sampler not in self.budgets:
            self.budgets[sampler] = AutoBudget.for_sampler(self.verify_cost, sampler, self._clock(sampler))
        return self.budgets[sampler]

    def _clock(self, sampler: Sampler) -> Clock:
        """The seconds this generator's round-to-round choices read with this sampler: measured when greedy,
        this machine's calibration when sampling (engine/clock.py), so that a seed fixes the tokens."""
        if sampler not in self.clocks:
            key = None
            if not sampler.greedy:
                from . import __version__
                from .engine.budget import cost_key

                options = json.dumps(self.method_options, sort_keys=True, default=str)
                key = f"{cost_key(self.model)}|{self.method}|{self.drafter}|{options}|treegen={__version__}"
            clock = self.clocks[sampler] = Clock(key, sampling=not sampler.greedy)
            if clock.sampling and not clock.fixed and self.timed_choices:
                self._calibrate(sampler)
        return self.clocks[sampler]

    @property
    def timed_choices(self) -> bool:
        """Whether the method makes choices from round times (`budget: auto`, `lookup: true`)."""
        return auto_budget(self.method_options) or bool(self.method_options.get("lookup"))

    def _calibrate(self, sampler: Sampler) -> None:
        """A short sampled generation of a fixed text that measures this setting's round times before the
        first sampled run uses them (engine/clock.py), so that run's tokens are what its seed gives on every
        later run too; the budget and the drafter's rates it trained on measured times are dropped."""
        from .engine.matmul import say

        say("measuring round times for sampled runs (once per machine and setting)")
        if self.verify_cost is not None:   # drafting every round: a resting budget would measure few passes
            self.budgets[sampler] = AutoBudget(self.verify_cost, rests=False, clock=self.clocks[sampler])
        self.generate(CALIBRATION_TEXT, max_new_tokens=CALIBRATION_TOKENS, temperature=sampler.temperature,
                      top_k=sampler.top_k, top_p=sampler.top_p, min_p=sampler.min_p, seed=0)
        self.budgets.pop(sampler, None)
        self.draft_model.forget()

    def stream(self, prompt: str | list[int], *, stop: tuple[str, ...] = (), prefix: PrefixCache | None = None,
               **sampling) -> Iterator[Chunk]:
        """Yield a Chunk per round; stops at EOS, max_new_tokens, the context limit or a stop string.
        `prefix` (a chat's turns): reuse the cache rows of the prompt's start that the last generation left."""
        ids = self.encode(prompt)
        config = self.config(**sampling)
        rounds = generate(self.model, self.draft_model, torch.tensor(ids), config, prefix)
        return self._chunks(rounds, stop, 0.0 if config.sampler.greedy else config.sampler.temperature, config.clock)

    def _chunks(self, rounds: Iterator[Round], stop: tuple[str, ...], temperature: float,
                clock: Clock) -> Iterator[Chunk]:
        decoder, stats, text = StreamDecoder(self.tokenizer), Stats(), ""
        watch = LoadWatch()
        try:
            # fewer threads on a busy machine, the same tokens (greedy, or no drafter laws whose bits could move)
            covered = temperature == 0 or not get_method(self.method).draws_drafts(self.method_options)
            with self.thread_plan.fitting(covered), watch:
                yield from self._rounds(rounds, decoder, stats, text, stop, time.perf_counter())
        finally:
            rounds.close()  # a consumer that stops early (Ctrl-C, closed pipe) frees the cache now
        clock.calibrate(watch)   # a sampled generation without a calibration leaves one (engine/clock.py)

    @staticmethod
    def _rounds(rounds: Iterator[Round], decoder: StreamDecoder, stats: Stats, text: str, stop: tuple[str, ...],
                t0: float) -> Iterator[Chunk]:
        for r in rounds:
            delta, finish = decoder.push(r.tokens), r.finish
            if finish:
                delta += decoder.flush()  # the text of the last round is final: hold nothing back
            cut = _stop_at(text, delta, stop)
            if cut is not None:
                delta, finish = delta[:cut], "stop"
            text += delta
            stats.add(r)
            stats.wall_time, stats.finish = time.perf_counter() - t0, finish
            yield Chunk(delta, r, stats, finish)
            if finish:
                return

    def generate(self, prompt: str | list[int], **kwargs) -> Completion:
        prompt_ids = self.encode(prompt)
        parts, token_ids, stats, finish = [], [], Stats(), None
        for chunk in self.stream(prompt_ids, **kwargs):
            parts.append(chunk.text)
            token_ids.extend(chunk.round.tokens)
            stats, finish = chunk.stats, chunk.finish
        return Completion("".join(parts), token_ids, prompt_ids, stats, finish)


def _stop_at(text: str, delta: str, stop: tuple[str, ...]) -> int | None:
    """Index into delta where the earliest stop string begins (the stop string itself is not emitted)."""
    best = None
    for s in stop:
        start = max(0, len(text) - len(s) + 1)
        pos = (text + delta).find(s, start)
        if pos != -1:
            cut = max(pos - len(text), 0)
            best = cut if best is None else min(best, cut)
    return best
