"""One target forward over [anchor; tree]: the decoder over every row, the lm_head only where it is read.

On a GPU the lm_head over all n+1 rows is one small GEMM, so every row's logits are made at once and the
verify walk reads them with one host sync. On a CPU the lm_head is the widest matrix of a small target
(vocabulary x hidden: 40% of a 65-row step of the demo target), and the walk reads only the rows on its
path (accepted drafts + 1), so rows can be projected one at a time as the walk reaches them. But between
two rounds the decoder's weights push the lm_head's out of the CPU's caches, so each row projected alone
pays a cold read of the whole [V, H] matrix (1.4 ms on the demo target, 3x a warm row): a walk of 6 rows
pays 6. `Projection` decides per forward, from measured costs, whether to project every row in one pass
(one cold read plus a little compute per row) or only the rows the walk reads.
"""
from __future__ import annotations

import time
from typing import ClassVar

import torch

from . import fast_decoder, prefill
from .fast_decoder import plain_linear
from .matmul import matmul_for
from .tree import DraftTree, verification_inputs

LEAN_CHUNK = 512   # prompt rows per lean forward: its causal tables ([rows, rows] ancestors) stay small

# config fields of architectures whose logits are not just lm_head(hidden): those keep the model's forward
LOGIT_TRANSFORMS = ("final_logit_softcapping", "logit_scale", "logits_scaling", "output_multiplier_scale")


class Logits:
    """The target's logits of a forward's rows, made on demand (lazy) or all at once."""

    def __init__(self, hidden: torch.Tensor | None, lm_head=None, full: torch.Tensor | None = None):
        self.hidden, self.lm_head, self.full = hidden, lm_head, full
        self.made: dict[int, torch.Tensor] = {}
        self.seconds = 0.0   # spent projecting rows on demand: target compute, though the walk asks for it
        self.read: set[int] = set()   # rows the walk asked for
        self.whole = False            # every row projected in one pass (Projection's choice)

    def project_all(self) -> None:
        """Project every row now, in one pass (part of the forward's time); the walk still reads them row
        by row, so it draws the same random numbers either way."""
        with torch.inference_mode():
            rows = self.lm_head(self.hidden)
        self.made, self.whole = {i: rows[i:i + 1] for i in range(len(rows))}, True

    @property
    def eager(self) -> bool:
        return self.full is not None

    def __len__(self) -> int:
        return len(self.full) if self.full is not None else len(self.hidden)

    def row(self, i: int) -> torch.Tensor:
        """[1, V] logits of row i (negative counts from the end)."""
        i = i % len(self)
        self.read.add(i)
        if self.full is not None:
            return self.full[i:i + 1]
        if i not in self.made:
            t0 = time.perf_counter()
            with torch.inference_mode():  # also when read outside the round that made the hidden states
                self.made[i] = self.lm_head(self.hidden[i:i + 1])
            self.seconds += time.perf_counter() - t0
        return self.made[i]


def lazy_logits_supported(model) -> bool:
    """A transformers causal LM whose logits are lm_head(decoder output), nothing more."""
    config = getattr(model, "config", None)
    config = getattr(config, "text_config", None) or config
    if config is None or any(getattr(config, name, None) not in (None, 1, 1.0) for name in LOGIT_TRANSFORMS):
        return False
    try:
        return model.get_output_embeddings() is not None and model.get_decoder() is not None
    except (AttributeError, NotImplementedError):
        return False


class TargetStep:
    """Runs the target over rows with a cache; returns their Logits and the requested layers' features."""

    def __init__(self, model, layer_ids: tuple[int, ...] = (), lazy: bool | None = None,
                 prefill_chunk: int = prefill.DEFAULT_CHUNK):
        self.model, self.layer_ids = model, tuple(layer_ids)
        self.prefill_chunk, self.feature_device = prefill_chunk, prefill.input_device(model)   # engine/prefill.py
        if lazy is None:
            lazy = model.device.type == "cpu"
        # the lean paths read weights directly: none may be offloaded behind a device hook (on meta)
        self.lazy = lazy and lazy_logits_supported(model) and prefill.in_memory(model)
        self.head = self.projection = None
        if self.lazy:
            head = model.get_output_embeddings()
            self.head = matmul_for(model, head.weight) if plain_linear(head) else head   # engine/matmul.py (int8: its own)
            self.projection = Projection(self.head, key=id(head))
        self.fast = fast_decoder.decoder_for(model) if self.lazy and fast_decoder.supported(model) else None

    def __call__(self, ids, positions, mask, cache) -> tuple[Logits, torch.Tensor | None]:
        if mask is None:   # the prompt (causal): in chunks, its last row's logits only (engine/prefill.py)
            return self.prefill(ids, positions, cache)
        args = {"input_ids": ids, "position_ids": positions, "attention_mask": mask, "cache": cache,
                "use_cache": True, "output_hidden_states": prefill.hidden_selection(self.layer_ids)}
        if not self.lazy:
            out = self.model(**args)
            logits, hidden = Logits(None, full=out.logits[0]), out.hidden_states
        else:
            if self.fast is not None and mask is not None:   # a verify forward (the prefill is causal, unmasked)
                last, hidden = self.fast(ids, positions, mask, cache)
            else:
                out = self.model.get_decoder()(**args)
                last, hidden = out.last_hidden_state, out.hidden_states
            logits = Logits(last[0], self.head)
            self.projection.prepare(logits)
        return logits, prefill.features(hidden, self.layer_ids, self.feature_device)

    def prefill(self, ids, positions, cache) -> tuple[Logits, torch.Tensor | None]:
        """The prompt's forward: Logits of its last row alone, and the requested layers of every row. Where the
        lean decoder runs the whole stack as one compiled call, the prompt runs through it too (a chunk is a
        chain: each row sees the cache and the rows before it), so a prompt costs its rows' products and not
        transformers' per-op work; elsewhere transformers' forward (in fp32, plain decoding then equals
        transformers' own generate() bit for bit: tests/test_bench.py)."""
        if self.fast is not None and self.fast.stack is not None:
            forward, chunk = self.lean_rows, min(self.prefill_chunk, LEAN_CHUNK)
        else:
            forward = prefill.decoder_rows(self.model) if self.lazy else prefill.model_rows(self.model)
            chunk = self.prefill_chunk
        last, feats = prefill.run_chunks(forward, ids, positions, cache, self.layer_ids, chunk, self.feature_device)
        if not self.lazy:
            return Logits(None, full=last), feats
        logits = Logits(last, self.head)
        self.projection.prepare(logits)
        return logits, feats

    def lean_rows(self, ids, positions, cache, hidden) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """prefill.ChunkForward through the lean decoder: the chunk's rows as a chain under its first token."""
        tokens = ids[0]
        rows, _, mask = verification_inputs(int(tokens[0]), DraftTree.chain(tokens[1:]), cache.get_seq_length(),
                                            self.model.dtype)
        last, states = self.fast(rows, positions, mask, cache)
        return last[0, -1:], states


class Projection:
    """Per forward: project all rows at once, or each row as the walk reads it (CPU, lazy logits).

    Lazy pays a (one cold read of the lm_head) per row read; all-at-once pays a once plus b per other row.
    So all at once wins when a * (rows read - 1) > b * (rows - 1). a is measured on the rows projected
    alone, b once per lm_head (warm rows), rows read is a slow running mean over the rounds that had rows to
    choose from, kept across generations: a round's rows read is close to independent of the round before,
    so a fast mean would turn lazy after a few rejected rounds and pay a second cold read on the next accept.
    """

    WEIGHT = 0.1          # of the latest round in the running mean of rows read
    _warm: ClassVar[dict[int, float]] = {}   # id(lm_head module) -> b, seconds per extra warm row
    _cold: ClassVar[dict[int, float]] = {}   # id(lm_head module) -> a, seconds per row projected alone
    _reads: ClassVar[dict[int, float]] = {}  # id(lm_head module) -> running mean of rows read per round

    def __init__(self, lm_head, key: int):
        self.lm_head, self.key = lm_head, key
        self.last: Logits | None = None
        self.forwards = 0

    @property
    def reads(self) -> float:
        """Rows read per round: lazy until rounds show more."""
        return self._reads.get(self.key, 1.0)

    def prepare(self, logits: Logits) -> None:
        self.learn()
        self.last, self.forwards = logits, self.forwards + 1
        rows = len(logits)
        known = rows > 1 and self.forwards > 1 and self.key in self._cold
        if known and self._cold[self.key] * (self.reads - 1) > self.extra_row() * (rows - 1):
            logits.project_all()

    def learn(self) -> None:
        """Fold in what the last forward's walk read: a round with rows to choose from (not the prefill, which
        reads one row of many, nor a round of one row)."""
        last = self.last
        if last is None or not last.read:
            return
        if self.forwards > 1 and len(last) > 1:
            reads = self._reads.get(self.key)
            self._reads[self.key] = len(last.read) if reads is None else \
                reads + self.WEIGHT * (len(last.read) - reads)
        if not last.whole:   # rows projected alone: each paid a cold read
            a = last.seconds / len(last.made)
            old = self._cold.get(self.key)
            self._cold[self.key] = a if old is None else old + self.WEIGHT * (a - old)

    def extra_row(self) -> float:
        if self.key not in self._warm:
            self._warm[self.key] = warm_row_seconds(self.lm_head, self.last.hidden)
        return self._warm[self.key]


def warm_row_seconds(lm_head, hidden: torch.Tensor, rows: int = 32, repeats: int = 5) -> float:
    """b: the lm_head's time per extra row with its weight in cache (fastest of a few passes), between two
    rows and `rows` (one row may take another kernel: engine/matmul.py). hidden: any rows, for their width."""
    x = hidden.new_zeros(rows, hidden.shape[-1])
    best = [float("inf"), float("inf")]   # 2 rows, `rows` rows
    with torch.inference_mode():
        for _ in range(repeats):
            for i, n in enumerate((2, rows)):
                t0 = time.perf_counter()
                lm_head(x[:n])
                best[i] = min(best[i], time.perf_counter() - t0)
    return max(best[1] - best[0], 0.0) / (rows - 2)
