"""generate(): the round loop every method shares, as a generator of Round events.

A round: the drafter proposes a tree under the anchor; ONE target forward scores [anchor; tree] with an
ancestor mask; verification walks the tree; the cache is compacted to the accepted path; the drafter
is told what was committed. Prefill is round 0 and commits the first token.
"""
from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass, field, fields

import torch

from .budget import AutoBudget, VerifyCost
from .cache import check_compactable, compact, new_cache
from .clock import Clock
from .drafter import Drafter, DraftState, sync
from .prefill import DEFAULT_CHUNK, input_device
from .prefix import PrefixCache
from .sampling import Sampler
from .target import Logits, TargetStep
from .tree import DraftTree, verification_inputs
from .verify import Verdict, verify_tree

DEFAULT_MAX_NEW_TOKENS = 256


class PromptTooLong(ValueError):
    pass


@dataclass(frozen=True)
class GenerationConfig:
    max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS
    sampler: Sampler = field(default_factory=Sampler)
    seed: int | None = None
    eos_token_ids: frozenset[int] = frozenset()
    context_length: int | None = None  # positions the target can attend over; None = unbounded
    verify_cost: VerifyCost | None = None  # set: `budget: auto`, each tree trimmed to its best size here
    prefill_chunk: int = DEFAULT_CHUNK     # prompt rows per prefill forward (engine/prefill.py)
    budget: AutoBudget | None = None       # with verify_cost: one carried from earlier generations (else a new one)
    clock: Clock | None = None             # what round-to-round choices read as seconds (engine/clock.py)

    def __post_init__(self):
        if self.max_new_tokens < 0:
            raise ValueError(f"max_new_tokens must be >= 0, got {self.max_new_tokens}")
        if self.prefill_chunk < 1:
            raise ValueError(f"prefill_chunk must be >= 1, got {self.prefill_chunk}")


@dataclass(frozen=True)
class Round:
    index: int              # 0 is the prefill
    tokens: list[int]       # tokens committed this round, after truncation at EOS / limits
    drafted: int            # nodes in the verified tree
    depth: int              # depth of that tree
    accepted: int           # draft tokens accepted (before truncation); committed = accepted + 1
    t_draft: float          # the drafter's neural passes
    t_verify: float         # the target forward
    t_commit: float         # the verify walk, cache compaction and bookkeeping
    finish: str | None = None  # "eos" | "length" | "context" on the last round
    t_build: float = 0.0    # the tree build: best-first / merge, dedup, budget trim, mask and positions
    reused: int = 0         # round 0: prompt tokens whose cache rows came from the last generation (not prefilled)
    way: str | None = None  # how a routing drafter drafted this round (lookup: true: lookup, tree or plain)


class _Loop:
    """The state of one generation: target cache, committed ids, and the step functions of a round."""

    def __init__(self, model, drafter: Drafter, prompt: torch.Tensor, config: GenerationConfig,
                 prefix: PrefixCache | None = None):
        self.model, self.drafter, self.config = model, drafter, config
        self.device = prompt.device
        self.step = TargetStep(model, tuple(drafter.target_layer_ids), prefill_chunk=config.prefill_chunk)
        self.cache = new_cache(model)
        self.prefix, self.reused = prefix, 0
        self.features: list[torch.Tensor] = []   # with a prefix cache: the target features of every cached row
        self.consistent = False   # the cache holds exactly the rows of tokens[:-1] (between rounds)
        self.tokens = prompt.clone()   # committed ids; the last is the anchor, whose KV is not cached yet
        self.prompt_len = prompt.numel()
        self.auto = None
        if config.budget is not None:
            self.auto = config.budget.next_generation()
        elif config.verify_cost is not None:
            self.auto = AutoBudget.for_sampler(config.verify_cost, config.sampler, config.clock)
        self.t_tree = self.t_mask = self.t_walk = 0.0   # this round's tree build, mask build, verify walk
        self.proposed = True   # whether the drafter ran this round (not resting)
        self.way: str | None = None
        self.generator = None
        if config.seed is not None:
            self.generator = torch.Generator(self.device).manual_seed(config.seed)

    @property
    def past_len(self) -> int:
        return self.tokens.numel() - 1

    def target_forward(self, ids, positions, mask) -> tuple[Logits, torch.Tensor | None]:
        return self.step(ids, positions, mask, self.cache)

    @property
    def key(self) -> tuple:
        return id(self.model), self.step.layer_ids

    def prefill(self) -> list[int]:
        """The prompt's forward (only the part a prefix cache does not hold) and the first token."""
        kept = None
        if self.prefix is not None:
            cache, self.reused, kept = self.prefix.take(self.key, self.tokens)
            self.cache = cache if cache is not None else self.cache
        positions = torch.arange(self.reused, self.tokens.numel(), device=self.device)[None]
        logits, feats = self.target_forward(self.tokens[self.reused:].view(1, -1), positions, None)
        check_compactable(self.cache)
        first = int(self.config.sampler.sample(logits.row(-1), self.generator)[0])
        if kept is not None:
            feats = torch.cat([kept, feats])
        self.log_features(feats)
        self.drafter.begin(self.tokens, feats)
        return [first]

    def log_features(self, feats: torch.Tensor | None) -> None:
        if self.prefix is not None and feats is not None:
            self.features.append(feats)

    def release(self) -> None:
        """Hand the cache to the prefix cache for the next prompt, if it is whole."""
        if self.prefix is not None and self.consistent:
            feats = torch.cat(self.features) if self.features else None
            self.prefix.keep(self.key, self.cache, self.tokens[:-1], feats)

    def room(self) -> int:
        """Deepest tree the limits allow: committed tokens never pass the context or max_new_tokens."""
        left = self.config.max_new_tokens - self.generated
        if self.config.context_length is not None:
            left = min(left, self.config.context_length - self.tokens.numel())
        return left - 1

    @property
    def generated(self) -> int:
        return self.tokens.numel() - self.prompt_len

    def draft(self) -> DraftTree:
        self.proposed = not (self.auto is not None and self.auto.resting())
        if not self.proposed:
            self.t_tree, self.way = 0.0, None
            return DraftTree.empty(self.device)
        self.drafter.t_build = 0.0   # a proposal that builds no tree reports none
        t0 = time.perf_counter()
        room = self.room()
        cap, draws, deepest = (self.auto.cap(), self.auto.draw_cap(), self.auto.depth_cap()) \
            if self.auto is not None else (None, None, None)
        tree = self.drafter.propose(DraftState(self.tokens, room if deepest is None else min(room, deepest),
                                               self.config.sampler, self.generator, cap, self.config.clock, draws))
        self.way = self.drafter.way
        sync(self.device)
        t1 = time.perf_counter()
        tree = tree.dedup().truncate_depth(room) if len(tree) else tree
        tree = on_device(tree, self.device)   # a drafter on another GPU than the target's inputs (device maps)
        if self.auto is not None:
            tree = self.auto.trim(tree, t1 - t0, self.drafter.draw_shape)
        self.t_tree = self.drafter.t_build + time.perf_counter() - t1
        return tree

    def verify(self, tree: DraftTree) -> tuple[Verdict, torch.Tensor | None]:
        t0 = time.perf_counter()
        ids, pos, mask = verification_inputs(int(self.tokens[-1]), tree, self.past_len, self.model.dtype)
        sync(self.device)
        t1 = time.perf_counter()
        self.t_mask = t1 - t0
        logits, feats = self.target_forward(ids, pos, mask)
        sync(self.device)
        t2 = time.perf_counter()
        verdict = verify_tree(tree, logits, self.config.sampler, self.generator)
        self.t_walk = time.perf_counter() - t2 - logits.seconds  # rows projected on demand count as verify
        return verdict, feats

    def commit(self, verdict: Verdict, feats: torch.Tensor | None) -> None:
        rows = [0] + [i + 1 for i in verdict.path]
        compact(self.cache, self.past_len, rows)
        feats = None if feats is None else kept_rows(feats, rows)
        self.log_features(feats)
        self.drafter.commit(verdict.tokens, feats)

    def append(self, tokens: list[int]) -> tuple[list[int], str | None]:
        """Commit tokens to the sequence, cut at the first EOS or a limit; say why generation ends, if it does."""
        tokens = tokens[:self.config.max_new_tokens - self.generated]  # first, so an EOS past the cut is not "eos"
        finish = None
        for i, tok in enumerate(tokens):
            if tok in self.config.eos_token_ids:
                tokens, finish = tokens[:i + 1], "eos"
                break
        self.tokens = torch.cat([self.tokens, torch.tensor(tokens, dtype=torch.long, device=self.device)])
        if finish is None and self.generated >= self.config.max_new_tokens:
            finish = "length"
        if finish is None and self.room() < 0:
            finish = "context"
        return tokens, finish


def kept_rows(feats: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """feats[rows] (ascending rows): a view where they are the first ones (a chain's accepted path), else one
    index_select; a list index would go through advanced indexing, several times the cost for a few rows."""
    if rows[-1] == len(rows) - 1:
        return feats[:len(rows)]
    return feats.index_select(0, torch.tensor(rows, device=feats.device))


def on_device(tree: DraftTree, device: torch.device) -> DraftTree:
    """The tree's tensors on `device` (the same tree when they are there already)."""
    if tree.tokens.device == device:
        return tree
    moved = {f.name: getattr(tree, f.name) for f in fields(tree)}
    return DraftTree(**{k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in moved.items()})


def generate(model, drafter: Drafter, prompt_ids: torch.Tensor, config: GenerationConfig,
             prefix: PrefixCache | None = None) -> Iterator[Round]:
    """Yield one Round per target forward until EOS, max_new_tokens or the context limit. `prefix`: start
    from the cache rows it holds for this prompt's first tokens, and leave this generation's there."""
    prompt = prompt_ids.flatten().long().to(input_device(model))   # a device map's first device, not meta
    if prompt.numel() == 0:
        raise ValueError("the prompt is empty: give at least one token")
    limit = config.context_length
    if limit is not None and prompt.numel() >= limit:
        raise PromptTooLong(f"the prompt is {prompt.numel()} tokens; the target's context holds {limit}, "
                            f"leaving no room to generate")
    if config.max_new_tokens == 0:
        return _nothing()   # a generator like any other (close() and all), that yields no round
    return _rounds(_Loop(model, drafter, prompt, config, prefix))


def _nothing() -> Iterator[Round]:
    yield from ()


@torch.inference_mode()  # torch enters and leaves the mode around each step of a generator
def _rounds(loop: _Loop) -> Iterator[Round]:
    try:
        yield from _steps(loop)
    finally:   # also when the consumer stops early: a whole cache is still worth keeping
        loop.release()


def _steps(loop: _Loop) -> Iterator[Round]:
    t0 = time.perf_counter()
    tokens, finish = loop.append(loop.prefill())
    loop.consistent = True
    sync(loop.device)
    yield Round(0, tokens, 0, 0, 0, 0.0, time.perf_counter() - t0, 0.0, finish, reused=loop.reused)
    index = 0
    while finish is None:
        index += 1
        loop.consistent = False
        t0 = time.perf_counter()
        tree = loop.draft()
        sync(loop.device)
        t1 = time.perf_counter()
        verdict, feats = loop.verify(tree)
        t2 = time.perf_counter()
        if loop.auto is not None:
            loop.auto.observe(tree, verdict.path)
        loop.commit(verdict, feats)
        tokens, finish = loop.append(verdict.tokens)
        loop.consistent = True
        sync(loop.device)
        t3 = time.perf_counter()
        if loop.auto is not None:
            loop.auto.round_done(len(verdict.tokens), t3 - t0, loop.proposed)
        depth = int(tree.depth.max()) if len(tree) else 0
        tree_s, mask_s, walk_s = loop.t_tree, loop.t_mask, loop.t_walk
        yield Round(index, tokens, len(tree), depth, len(verdict.path), t1 - t0 - tree_s, t2 - t1 - mask_s - walk_s,
                    t3 - t2 + walk_s, finish, tree_s + mask_s, way=loop.way)
