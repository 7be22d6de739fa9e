"""`budget: auto`: each round, verify the tree size that maximises expected tokens per second here.

    expected tokens(n) = 1 + sum of the acceptance probabilities of the n best nodes (path-score order)
    seconds(n)         = drafting time + the round's other work (running means) + the target's forward
                         time for n + 1 rows (as the engine runs it: engine/target.py)
The forward time per row count is measured once per model, dtype, device and thread count (VerifyCost) and
cached on disk; a node's acceptance probability (its whole path accepted) is calibrated online from this
generator's own rounds (carried from generation to generation), with exp(path log-prob) as the prior, i.e. a
perfectly calibrated drafter.
The drafter proposes its largest tree; trimming it to a prefix-closed top-n keeps verification exact.
"""
from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from . import kernels
from .clock import Clock
from .disk import LoadWatch, cache_root, keep_if_quiet, read_table
from .forms import weight_form
from .matmul import RowMatmul, machine, say
from .tree import DraftTree, drawn_shape, widths

MEASURED_ROWS = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 96, 128)
SCORE_FLOOR, BIN_WIDTH = -16.0, 0.5   # path log-probs below the floor share the last bin
PRIOR_WEIGHT = 4.0                    # the exp(score) prior counts as this many observed nodes per bin
FORGET = 0.995                        # per round: recent rounds count more (the text changes as it goes)
MAX_REST = 64                         # most rounds of plain decoding before drafting is tried again (a try
                                      # that does not pay costs several plain rounds, so tries stay rare)
REST_MARGIN = 0.9                     # rest only when drafting rounds run below this share of plain speed
REST_WINDOW = 0.2                     # weight of the latest drafting round in the running rate
REST_AFTER = 4                        # drafting rounds seen before the running rate is trusted
CAP_WINDOW, CAP_FLOOR = 8, 32         # cap(): rounds it looks back over, the least it asks for
DEPTH_FLOOR = 4                       # depth_cap(): the least depth it asks for
PRIOR_DECAY = 0.6                     # a drawn child's prior acceptance, rank by rank (DrawnRanks)
TABLE_ROWS = 512                      # VerifyCost's precomputed row counts (a round's trees are smaller)


@dataclass(frozen=True)
class VerifyCost:
    """Seconds of one target forward with `rows` query rows over a few hundred cached positions."""
    rows: tuple[int, ...]
    seconds: tuple[float, ...]

    def __post_init__(self):   # the table as arrays once, and its value at every row count a round asks for
        object.__setattr__(self, "xs", np.array(self.rows, dtype=np.float32))
        object.__setattr__(self, "ys", np.array(self.seconds, dtype=np.float32))
        object.__setattr__(self, "by_rows", self.interpolate(np.arange(TABLE_ROWS + 1)))

    def __call__(self, rows) -> np.ndarray:
        """Piecewise-linear in the row counts (an array or tensor); linear extrapolation past the last
        measurement. Whole row counts up to TABLE_ROWS read a table made once (the same values): the trim
        asks every round, and even NumPy's per-call cost is most of a small array's."""
        rows = np.asarray(rows)
        if rows.dtype.kind in "iu" and rows.size and 0 <= rows.min() and rows.max() <= TABLE_ROWS:
            return self.by_rows[rows]
        return self.interpolate(rows)

    def at(self, rows: int) -> float:
        """One row count's seconds, as a float."""
        return float(self.by_rows[rows]) if 0 <= rows <= TABLE_ROWS else float(self.interpolate([rows])[0])

    def interpolate(self, rows) -> np.ndarray:
        xs, ys = self.xs, self.ys
        rows = np.maximum(np.asarray(rows, dtype=np.float32), xs[0])
        i = np.clip(np.searchsorted(xs, rows), 1, len(xs) - 1)
        x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
        return y0 + (rows - x0) * (y1 - y0) / (x1 - x0)

    @classmethod
    def measure(cls, model, rows: tuple[int, ...] | None = None, context: int = 256, repeats: int = 5) -> VerifyCost:
        from .cache import new_cache
        from .target import TargetStep
        from .tree import verification_inputs

        rows = rows or MEASURED_ROWS
        device, vocab = model.device, model.get_input_embeddings().weight.shape[0]
        gen = torch.Generator().manual_seed(0)
        cache, step = new_cache(model), TargetStep(model)
        ids = torch.randint(vocab, (1, context), generator=gen).to(device)
        inputs = {n: verification_inputs(int(ids[0, -1]), DraftTree.chain(
            torch.randint(vocab, (n - 1,), generator=gen).to(device)), context, model.dtype) for n in rows}
        times: dict[int, list[float]] = {n: [] for n in rows}
        with torch.inference_mode():
            model(input_ids=ids, cache=cache, use_cache=True)
            for _ in range(repeats + 1):  # round-robin over the sizes: a passing load hits them all alike
                for n in rows:
                    t0 = time.perf_counter()
                    logits, _ = step(*inputs[n], cache)
                    if step.lazy and n > 1 and not logits.whole:   # as a round's forward projects a tree's rows (target.Projection)
                        logits.project_all()
                    logits.row(0)
                    if device.type == "cuda":
                        torch.cuda.synchronize(device)
                    times[n].append(time.perf_counter() - t0)
                    cache.crop(-n)
        return cls(tuple(rows), steady([times[n][1:] for n in rows]))   # the first pass warms up

    @property
    def plausible(self) -> bool:
        """Non-decreasing in the row count, as every measurement is made (a cache entry that is not was
        written by an older version, perhaps on a busy machine: measure again)."""
        return all(a <= b for a, b in zip(self.seconds, self.seconds[1:]))


def steady(samples: list[list[float]]) -> tuple[float, ...]:
    """Per size (ascending), its fastest sample: other work on the machine only ever adds time; then a
    running max, since a bigger forward never costs less: one busy moment cannot make a size look cheap."""
    fastest = torch.tensor([min(s) for s in samples], dtype=torch.float64)
    return tuple(fastest.cummax(0).values.tolist())


def cache_file() -> Path:
    return cache_root() / "verify-cost.json"


def cost_key(model) -> str:
    name = getattr(model.config, "_name_or_path", "") or type(model).__name__
    from .target import TargetStep

    step = TargetStep(model)   # what one verify forward computes (engine/target.py)
    step = ("lazy" if step.lazy else "eager") + ("+fast" if step.fast is not None else "") + \
        (f"+mm:{step.head.form}" if isinstance(step.head, RowMatmul) else "")
    device = torch.cuda.get_device_name(model.device) if model.device.type == "cuda" else machine()
    return (f"{name}|{weight_form(model)}|{model.dtype}|{model.device}|{device}|threads={torch.get_num_threads()}"
            f"|torch={torch.__version__}|{step}+invariant+rows|kernels={kernels.tag()}")


def verify_cost(model, path: Path | None = None) -> VerifyCost:
    """The cached measurement for this model and setting, measured (a second or so) and saved if missing."""
    path, key = path or cache_file(), cost_key(model)
    entry = read_table(path).get(key)
    if isinstance(entry, dict) and len(entry.get("rows", ())) == len(entry.get("seconds", ())) >= 2:
        cached = VerifyCost(tuple(entry["rows"]), tuple(entry["seconds"]))
        if cached.plausible:
            return cached
    say("measuring the target's forward time per tree size for budget: auto (once per machine and setting)")
    t0 = time.perf_counter()
    kernels.build_all()
    with LoadWatch() as watch:
        cost = VerifyCost.measure(model)
    say(f"measured in {time.perf_counter() - t0:.1f} s; kept in {path}")
    keep_if_quiet(watch, path, key, {"rows": list(cost.rows), "seconds": list(cost.seconds)}, "the verify cost")
    return cost


class AcceptanceModel:
    """P(a node's path is accepted) by path log-prob bin, counts decayed per round, exp(score) prior."""

    def __init__(self):
        bins = int(-SCORE_FLOOR / BIN_WIDTH) + 1
        centers = -(np.arange(bins, dtype=np.float32) + 0.5) * BIN_WIDTH
        self.prior = np.exp(centers)
        self.drafted = np.zeros(bins, dtype=np.float32)
        self.accepted = np.zeros(bins, dtype=np.float32)

    def bins(self, scores) -> np.ndarray:
        """scores: host values (an array, or a CPU tensor). Two ufuncs, not np.clip: its Python-side checks
        cost more than the clipping of a round's few dozen scores."""
        return np.minimum(np.maximum(-host(scores) / BIN_WIDTH, 0), len(self.prior) - 1).astype(np.int64)

    def probability(self, scores) -> np.ndarray:
        b = self.bins(scores)
        return (self.accepted[b] + PRIOR_WEIGHT * self.prior[b]) / (self.drafted[b] + PRIOR_WEIGHT)

    def observe(self, scores, accepted) -> None:
        self.drafted *= FORGET
        self.accepted *= FORGET
        b = self.bins(scores)
        np.add.at(self.drafted, b, 1.0)
        np.add.at(self.accepted, b, host(accepted))


def host(values) -> np.ndarray:
    """fp32 host values of a tensor (any device) or an array."""
    if isinstance(values, torch.Tensor):
        values = values.detach().float().cpu().numpy()
    return np.asarray(values, dtype=np.float32)


class AutoBudget:
    """Per generator and sampler (carried from one generation to the next: next_generation): trims each
    proposed tree to the size with the best expected tokens per second, and when drafting rounds have been
    running slower than plain decoding (the drafter's pass costs more than its drafts bring, e.g. sampling
    from a flat distribution), rests: rounds without drafting, 1, 2, 4 ..
    MAX_REST at a time, trying again after each rest. The drafter still receives every commit. Resting is
    for sampling only: at T=0 on a CPU it cost 10-20% (a prompt's slow stretches are short); at T=1 it is
    what keeps the auto presets near plain decoding (docs/benchmarks.md)."""

    def __init__(self, cost: VerifyCost, rests: bool = True, clock: Clock | None = None):
        self.cost, self.model, self.rests = cost, AcceptanceModel(), rests
        self.clock = clock or Clock()   # the seconds its choices read (engine/clock.py: fixed when sampling)
        self.ranks = DrawnRanks()     # drawn nodes' acceptance by depth and rank (trim_drawn)
        self.t_draft: float | None = None
        self.overhead = 0.0           # a round's seconds besides drafting and the forward (trim, walk, commit)
        self.verified: int | None = None   # nodes the last trim kept
        self.rest, self.backoff = 0, 1
        self.catching_up = False   # the round after a rest folds the skipped context: not a typical pass
        self.first_pass = True     # a generation's first pass folds its prompt: not a typical one either
        self.tokens = self.seconds = 0.0   # running means over drafting rounds
        self.rounds = 0
        self.chosen: deque[int] = deque(maxlen=CAP_WINDOW)   # sizes kept by the last rounds' trims
        self.widths: deque[int] = deque(maxlen=CAP_WINDOW)   # drawn widths kept by the last rounds' trims
        self.depths: deque[int] = deque(maxlen=CAP_WINDOW)   # deepest nodes kept by the last rounds' trims
        self.one_row = cost.at(1)   # seconds of a one-row forward
        self.plain_seconds: float | None = None   # running mean of resting rounds' seconds (plain decoding here)

    @classmethod
    def for_sampler(cls, cost: VerifyCost, sampler, clock: Clock | None = None) -> AutoBudget:
        """A new budget for generations with this sampler: it rests when sampling only (see above)."""
        return cls(cost, rests=not sampler.greedy, clock=clock)

    def choose(self, scores, expected: float = 1.0, rows: int = 0) -> int:
        """How many of the nodes (scores sorted best first: an array or tensor) to verify, beside `rows` nodes
        kept already that bring `expected` tokens a round (the bonus token included)."""
        accepted = self.model.probability(scores).cumsum()
        gains = np.float32(expected) + np.concatenate([np.zeros(1, np.float32), accepted])
        seconds = (self.t_draft or 0.0) + self.overhead + self.cost(rows + np.arange(len(scores) + 1) + 1)
        return int((gains / seconds).argmax())

    def cap(self) -> int | None:
        """The most nodes worth building this round: twice the largest size kept in the last CAP_WINDOW
        rounds (at least CAP_FLOOR), so a drafter stops building nodes the trim would drop (their best-first
        order is the trim's order); None until the window is full."""
        if len(self.chosen) < CAP_WINDOW:
            return None
        return max(CAP_FLOOR, 2 * max(self.chosen))

    def depth_cap(self) -> int | None:
        """The deepest node worth drafting this round: twice the deepest the last CAP_WINDOW trims kept (at
        least DEPTH_FLOOR), so a block drafter scores only the depths the trim could keep; None until then."""
        if len(self.depths) < CAP_WINDOW:
            return None
        return max(DEPTH_FLOOR, 2 * max(self.depths))

    def draw_cap(self) -> int | None:
        """The most drawn children at depth 1 worth drawing this round: twice the widest the last CAP_WINDOW
        trims kept (at least 2), so a drafter stops drawing what trim_drawn would drop; None until then."""
        if len(self.widths) < CAP_WINDOW:
            return None
        return max(2, 2 * max(self.widths))

    def round_done(self, tokens: int, seconds: float, drafted: bool) -> None:
        """After each round (drafted: the drafter ran, whatever the trim kept): the running tokens/s of
        drafting rounds against plain decoding's (`plain`); below REST_MARGIN of it, rest (longer each
        time it stays below, back to 1 once drafting pays)."""
        if not drafted:   # a resting round (plain decoding, measured); the next drafting round is the catch-up
            seconds, last = self.clock("plain", seconds, self.one_row + self.overhead), self.plain_seconds
            self.plain_seconds = seconds if last is None else last + REST_WINDOW * (seconds - last)
            return
        verified, self.verified = self.verified, None
        if verified is not None and not self.catching_up:   # the rest of the round: what no size changes
            other = seconds - (self.t_draft or 0.0) - self.cost.at(verified + 1)
            self.overhead = max(0.0, self.overhead + 0.2 * (self.clock("other", other, 0.0) - self.overhead))
        if self.clock.fixed:   # the round as the calibration prices it, not as this run's clock read it
            seconds = (self.t_draft or 0.0) + self.overhead + self.cost.at(verified + 1) \
                if verified is not None else self.clock("round", seconds, self.one_row + self.overhead)
        if self.catching_up:
            self.catching_up = False
            return
        if not self.rests:
            return
        w = REST_WINDOW if self.rounds else 1.0
        self.tokens += w * (tokens - self.tokens)
        self.seconds += w * (seconds - self.seconds)
        self.rounds += 1
        if self.not_paying():
            self.rest, self.backoff = self.backoff, min(2 * self.backoff, MAX_REST)
        else:
            self.rest, self.backoff = 0, 1

    def next_generation(self) -> AutoBudget:
        """Carried into another generation of the same generator and sampler (a chat's next turn, a bench's
        next prompt): what it learned (calibration, drafting and overhead times, the drafting rate and its
        backoff) stays, so the new generation neither re-probes nor re-learns; the round-to-round state goes."""
        self.rest, self.catching_up, self.verified, self.first_pass = 0, False, None, True
        if self.rests and self.not_paying():
            self.rest = self.backoff   # drafting did not pay when the last generation ended: start resting
        return self

    def not_paying(self) -> bool:
        """Enough drafting rounds seen, and their running rate below REST_MARGIN of plain decoding's."""
        return self.rounds >= REST_AFTER and self.tokens / self.seconds < REST_MARGIN * self.plain

    @property
    def plain(self) -> float:
        """Tokens/s of plain decoding here: measured in resting rounds once there were some, else a one-row
        forward plus the round's other work (what a drafting round spends besides drafting and its forward)."""
        return 1.0 / (self.plain_seconds if self.plain_seconds is not None else self.one_row + self.overhead)

    def resting(self) -> bool:
        """Whether this round skips drafting (plain decoding through the same loop)."""
        if self.rest > 0:
            self.rest -= 1
            self.catching_up = True
            return True
        return False

    def trim(self, tree: DraftTree, t_draft: float, shape: str = "chain") -> DraftTree:
        """shape: the drafter's `draw_shape` (the drawn part's nominal nodes a depth, for the cost)."""
        if tree.scores is None or len(tree) == 0:
            return tree  # a method without path scores keeps its own size (prompt-lookup rounds too)
        if self.t_draft is None:    # the first pass folds the whole prompt: not a typical one
            self.t_draft = self.clock.value("draft", self.one_row) if self.clock.fixed else t_draft
        elif not (self.catching_up or self.first_pass):  # nor is a pass folding a rest's (or a prompt's) context
            self.t_draft = 0.8 * self.t_draft + 0.2 * self.clock("draft", t_draft, self.one_row)
        self.first_pass = False
        if tree.drawn:
            return self.trim_drawn(tree, shape)
        # stable: on equal scores the lower index (a parent before its child) comes first
        scores = host(tree.scores)
        if bool((scores[1:] <= scores[:-1]).all()):   # best-first already (a heap walk's order): a prefix
            size = self.choose(scores)
            kept = tree.head(size)
            self.keep_choice(size, int(kept.depth.max()) if size else 0)
            return kept
        order = np.argsort(-scores, kind="stable")
        size = self.choose(scores[order])
        keep = np.zeros(len(tree), dtype=bool)
        keep[order[:size]] = True
        self.keep_choice(size, int(host(tree.depth)[keep].max()) if size else 0)
        return tree.select(torch.from_numpy(keep).to(tree.tokens.device))

    def keep_choice(self, size: int, deepest: int) -> None:
        self.chosen.append(size)
        self.verified = size
        self.depths.append(deepest)

    def trim_drawn(self, tree: DraftTree, shape: str = "chain") -> DraftTree:
        """A tree with drawn nodes (T > 0). Whether a drawn node is verified must not depend on which token
        was drawn (a draft kept for being likely is no longer a draw from q), nor on anything that does (the
        deterministic nodes: dedup merges those equal to a draw). So first the drawn part's width W and depth
        L, from earlier rounds' acceptance by depth and rank and the nominal shapes alone: a drawn node is kept
        if it lies at depth <= L and its rank is within the shape of W draws at depth 1 (a prefix of each
        parent's draw order: its law's first draws, as verification needs); then the deterministic nodes
        outside every dropped drawn node's subtree by score, as above."""
        depth, drawn = tree.depth.cpu().numpy(), tree.law.cpu().numpy() >= 0
        parents, is_drawn = tree.parents.tolist(), drawn.tolist()
        max_l = int(depth[drawn].max())
        # depth 1's draws: their count depends on the context alone (deeper laws may depend on the draws)
        first = int((drawn & (depth == 1)).sum())
        hazard = self.ranks.hazard()
        best, width, length, gain = -1.0, first, 0, 1.0
        for w in draw_widths(first):
            reach = self.ranks.reached(max_l, w, hazard)
            expected = 1 + np.concatenate([np.zeros(1), reach.cumsum()])      # [L+1]
            nominal = np.concatenate([[0], np.cumsum(nominal_counts(w, max_l, shape))])
            rate = expected / ((self.t_draft or 0.0) + self.cost(nominal + 1))
            if float(rate.max()) > best:
                best, width, length = float(rate.max()), w, int(rate.argmax())
                gain = float(expected[length])
        self.widths.append(width if length else 0)
        keep = np.array(within_shape(parents, is_drawn, depth.tolist(), width, length), dtype=bool)
        det = np.flatnonzero(~drawn & open_nodes(parents, is_drawn, keep.tolist()))
        scores = host(tree.scores)[det]
        order = np.argsort(-scores, kind="stable")
        keep[det[order[:self.choose(scores[order], gain, int(keep.sum()))]]] = True
        self.verified = int(keep.sum())
        self.chosen.append(self.verified)
        self.depths.append(int(depth[keep].max()) if self.verified else 0)
        return tree.select(torch.from_numpy(keep).to(tree.tokens.device))

    def observe(self, tree: DraftTree, path: list[int]) -> None:
        if tree.scores is None or len(tree) == 0:
            return
        accepted = np.zeros(len(tree), dtype=np.float32)
        accepted[path] = 1.0
        if not tree.drawn:
            self.model.observe(tree.scores, accepted)
            return
        drawn = (tree.law >= 0).cpu().numpy()
        self.model.observe(host(tree.scores)[~drawn], accepted[~drawn])
        self.ranks.observe(tree, path)


class DrawnRanks:
    """P(the path takes the drawn child of rank r at depth d | it reached that child's parent and the drawn
    children of ranks < r were rejected there), counts decayed per round like AcceptanceModel's, with a prior
    that shrinks by PRIOR_DECAY a rank. From them, the drawn tokens a round expects for any width."""

    def __init__(self, max_depth: int = 64, max_rank: int = 64, prior: float = 0.5):
        self.tried = np.zeros((max_depth + 1, max_rank))
        self.passed = np.zeros((max_depth + 1, max_rank))
        self.prior = prior * PRIOR_DECAY ** np.arange(max_rank)

    def hazard(self) -> np.ndarray:
        """[depth, rank] each drawn child's acceptance given its turn came (the prior where little was seen)."""
        return (self.passed + PRIOR_WEIGHT * self.prior) / (self.tried + PRIOR_WEIGHT)

    def reached(self, max_depth: int, first: int, hazard: np.ndarray | None = None) -> np.ndarray:
        """[max_depth] P(the path holds a drawn node at depth 1 .. max_depth), with `first` draws at depth 1
        and half as many each depth after (the chain of first draws' widths)."""
        hazard = self.hazard() if hazard is None else hazard
        last = hazard.shape[0] - 1
        passes = [1 - np.prod(1 - hazard[min(d, last), :w]) for d, w in enumerate(widths(first, max_depth), start=1)]
        return np.cumprod(passes)

    def observe(self, tree: DraftTree, path: list[int]) -> None:
        self.tried *= FORGET
        self.passed *= FORGET
        law, parents = tree.law.tolist(), tree.parents.tolist()
        children: dict[int, list[int]] = {}   # parent -> its drawn children in draw order (= index order)
        for i, p in enumerate(parents):
            if law[i] >= 0:
                children.setdefault(p, []).append(i)
        node = -1
        for d, child in enumerate([*path, None], start=1):
            tried = children.get(node, [])
            if not tried or d >= len(self.tried):
                return
            if child in tried:
                rank = tried.index(child)
                if rank < self.tried.shape[1]:
                    self.tried[d, :rank + 1] += 1
                    self.passed[d, rank] += 1
                node = child
                continue
            self.tried[d, :min(len(tried), self.tried.shape[1])] += 1   # every drawn child was rejected
            return


def draw_widths(first: int) -> list[int]:
    """The drawn part's depth-1 widths trim_drawn weighs: `first` and each halving of it, down to 1."""
    out = [first]
    while out[-1] > 1:
        out.append(out[-1] // 2)
    return out


def within_shape(parents: list[int], drawn: list[bool], depth: list[int], width: int, length: int) -> list[bool]:
    """Per node: a drawn node at depth <= length whose rank among its parent's drawn children is within the
    shape of `width` draws at depth 1 (engine/tree.drawn_shape: a node whose drawn ancestors' ranks sum to s
    gets max(width >> d, 1) >> s children), its drawn parent kept too. Ranks and shapes depend on the
    laws' supports, never on the draws."""
    keep: list[bool] = []
    rank_sum: list[int] = []
    seen: dict[int, int] = {}   # parent -> drawn children so far (the next one's rank)
    for i, p in enumerate(parents):
        s = rank_sum[p] if p >= 0 else 0
        if not drawn[i]:
            keep.append(False)
            rank_sum.append(s)
            continue
        rank = seen.get(p, 0)
        seen[p] = rank + 1
        room = max(width >> (depth[i] - 1), 1) >> s
        keep.append(depth[i] <= length and rank < room and (p < 0 or not drawn[p] or keep[p]))
        rank_sum.append(s + rank)
    return keep


def open_nodes(parents: list[int], drawn: list[bool], kept: list[bool]) -> np.ndarray:
    """[n] per node: no drawn ancestor-or-self was dropped (a deterministic node there may be kept)."""
    out: list[bool] = []
    for i, p in enumerate(parents):
        out.append((p < 0 or out[p]) and (not drawn[i] or kept[i]))
    return np.array(out, dtype=bool)


def nominal_counts(first: int, depth: int, shape: str) -> list[int]:
    """Drawn nodes a depth before anything is drawn: a chain with its siblings, or a drawn tree's shape."""
    counts = widths(first, depth)
    if shape != "tree":
        return counts
    per_depth = [0] * depth
    for _, d, _ in drawn_shape(tuple(counts), 1 << 30):
        per_depth[d] += 1
    return per_depth


