"""The drafter's vocabulary (the `vocab` option of every method with a drafter): its lm_head over the tokens a
target's replies use most, plus every token of the context, instead of the whole vocabulary.

A large vocabulary makes the head the drafter's biggest product (SmolLM2: 49,152 rows of 576, for every
block position). The frequent tokens ship with a drafter (`draft_vocab.safetensors` beside its config:
`ids`, the token ids in order of frequency in its training data, written by `treegen train`); the context's
tokens are added as they come, so text copied from the prompt stays draftable. Tokens outside get logit
-inf: never drafted, probability 0 in a drawn draft's law. Drafts only propose, so this changes what is
drafted, never what is generated (T=0 output is the target's greedy output; at T > 0 verification divides by
the law the draft was drawn from)."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from ..engine.matmul import product
from . import defaults as D

VOCAB_FILE = "draft_vocab.safetensors"
DRAFT_VOCAB = D.DRAFT_VOCAB


def frequent_tokens(tokens: torch.Tensor, vocab: int, size: int = DRAFT_VOCAB) -> torch.Tensor:
    """The `size` most frequent ids of a token stream (ties by id), most frequent first; only ids that occur."""
    counts = torch.bincount(tokens.flatten().long(), minlength=vocab)[:vocab]
    order = torch.sort(-counts, stable=True).indices
    return order[:min(size, int((counts > 0).sum()))]


def save_vocab(folder: str | Path, ids: torch.Tensor) -> None:
    from safetensors.torch import save_file

    save_file({"ids": ids.to(torch.int64).contiguous()}, str(Path(folder) / VOCAB_FILE))


def load_vocab(folder: str | Path | None) -> torch.Tensor | None:
    """The drafter's frequent token ids, or None where it ships none (a folder without the file, a hub id)."""
    if folder is None or not (Path(folder) / VOCAB_FILE).is_file():
        return None
    from safetensors.torch import load_file

    return load_file(str(Path(folder) / VOCAB_FILE))["ids"].long()


@dataclass(frozen=True)
class Scores:
    """A head's logits over some of the vocabulary: column j scores token ids[j] (ids None: the whole vocabulary,
    column j token j). Drafters that only rank tokens work on the columns and map the winners back: a softmax
    or top-k over 8,192 columns instead of a 49,152-wide row that is mostly -inf."""
    logits: torch.Tensor             # [..., n]
    ids: torch.Tensor | None = None  # [n] long
    vocab_size: int = 0

    def tokens(self, columns: torch.Tensor) -> torch.Tensor:
        return columns if self.ids is None else self.ids[columns]

    def widen(self, values: torch.Tensor, fill: float = float("-inf")) -> torch.Tensor:
        """[..., n] values of the columns -> [..., V], `fill` for the tokens the head does not score (-inf for
        logits, 0 for probabilities: the laws that drawn drafts come from are verified over the whole
        vocabulary)."""
        if self.ids is None:
            return values
        out = values.new_full((*values.shape[:-1], self.vocab_size), fill)
        out[..., self.ids] = values
        return out

    def on_vocab(self, tree):
        """A DraftTree built over the columns -> over token ids (its draft laws, if any, widened)."""
        if self.ids is None:
            return tree
        return dataclasses.replace(tree, tokens=self.tokens(tree.tokens),
                                   q=None if tree.q is None else self.widen(tree.q, 0.0))


class DraftHead(torch.nn.Module):
    """The drafter's lm_head over a subset of the vocabulary: `scores(x)` -> Scores over the kept tokens,
    `head(x)` -> [..., V] logits, -inf outside. The frequent tokens' rows are one product (copied once, in
    the layout engine/matmul.py measures fastest here); the context's other tokens, a few hundred at most, a
    second small one, remade when `admit` brings new ones. `weight` is the whole head's (drafters that
    gather rows of it read any token)."""

    def __init__(self, lm_head, frequent: torch.Tensor, form: str = "float"):
        super().__init__()
        self.full = lm_head
        weight = lm_head.weight.detach()
        self.kept = torch.zeros(weight.shape[0], dtype=torch.bool, device=weight.device)
        self.frequent = frequent.to(weight.device)
        self.kept[self.frequent] = True
        self.frequent_rows = weight.index_select(0, self.frequent)
        self.product = product(self.frequent_rows, form, head=True)
        self.base = self.kept.clone()
        self.extra = self.frequent.new_zeros(0)
        self.extra_rows = weight.new_zeros(0, weight.shape[1])
        self.ids = self.frequent   # the columns of scores(): the frequent tokens, then the context's others
        self.frequent_ids = frozenset(self.frequent.tolist())
        self.known = set(self.frequent_ids)   # kept's ids on the host: a round's few tokens are checked there

    @property
    def weight(self) -> torch.Tensor:
        return self.full.weight

    def reset(self) -> None:
        """Back to the frequent tokens alone (a new generation's context starts empty)."""
        self.kept.copy_(self.base)
        self.extra = self.frequent.new_zeros(0)
        self.extra_rows = self.extra_rows[:0]
        self.ids = self.frequent
        self.known = set(self.frequent_ids)

    def admit(self, tokens: torch.Tensor) -> None:
        """Make the context's tokens (ids [n] or a list) draftable."""
        if isinstance(tokens, list) and all(t in self.known for t in tokens):
            return   # a round's committed tokens, all kept already: no device work
        tokens = torch.as_tensor(tokens, dtype=torch.long).flatten().to(self.kept.device)
        new = tokens[~self.kept[tokens]].unique()
        if len(new):
            self.known.update(new.tolist())
            self.kept[new] = True
            self.extra = torch.cat([self.extra, new])
            self.extra_rows = torch.cat([self.extra_rows, self.full.weight.detach().index_select(0, new)])
            self.ids = torch.cat([self.frequent, self.extra])

    def penalty(self, ids: torch.Tensor) -> torch.Tensor:
        """0 for the ids it scores, -inf for the others: for drafters that score gathered rows of `weight`."""
        return torch.where(self.kept[ids], 0.0, float("-inf"))

    def scores(self, x: torch.Tensor) -> Scores:
        logits = self.product(x)
        if len(self.extra):
            logits = torch.cat([logits, F.linear(x, self.extra_rows)], dim=-1)
        return Scores(logits, self.ids, self.kept.shape[0])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scores = self.scores(x)
        return scores.widen(scores.logits)
