"""Drafting methods, by name. Each implements treegen.drafters.base.Drafter; options are checked here."""
from __future__ import annotations

import inspect
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ..validate import did_you_mean, shown
from . import defaults as D


class MethodError(ValueError):
    """An unknown method, or options it does not take; the message is one line for the user."""


@dataclass(frozen=True)
class Method:
    name: str
    description: str
    build: Callable[..., Any]   # build(target_model, drafter_path[, drawing], **options) -> Drafter
    needs_drafter: bool = False
    tree: bool = False          # drafts a tree: at T > 0 its drawn chain gets drawn siblings (`draws`)

    @property
    def options(self) -> dict[str, Any]:
        """The options build() takes, with their defaults."""
        params = inspect.signature(self.build).parameters.values()
        options = {p.name: p.default for p in params if p.kind is p.KEYWORD_ONLY}
        if self.needs_drafter:   # any drafter's method can take prompt-lookup rounds (drafters/lookup.py)
            options["lookup"] = D.LOOKUP
            options["sample"] = D.SAMPLE   # and, at T > 0, put a chain drawn from its laws first (base.py)
            # with that many drawn children at depth 1, halving with depth: trees only, by default
            options["draws"] = D.TREE_DRAWS if self.tree else D.DRAWS
            if self.tree:   # and whether the drawn children get drawn children (drafters/drawn.py)
                options["draw_shape"] = D.DRAW_SHAPE
            options["dtype"] = D.DTYPE   # the drafter's precision, whatever the target's (drafters/precision.py)
            options["vocab"] = D.VOCAB   # the tokens its head scores (drafters/vocab.py)
        return options

    def draws_drafts(self, options: dict[str, Any]) -> bool:
        """Whether, at T > 0, its drafts are drawn from a drafter model's laws (`sample`). Where they are not,
        verification draws every token from the target alone (one uniform a row, as plain decoding), so the
        tokens follow from the target's logits whatever was drafted."""
        return self.needs_drafter and bool(options.get("sample", D.SAMPLE))


def _ar(target, drafter_path):
    from .ar import ARDrafter
    return ARDrafter()


def _pld(target, drafter_path, *, max_ngram: int = D.PLD_MAX_NGRAM, min_ngram: int = D.PLD_MIN_NGRAM,
         draft_len: int = D.PLD_DRAFT_LEN, branches: int = D.PLD_BRANCHES):
    from .pld import PromptLookupDrafter
    return PromptLookupDrafter(max_ngram, min_ngram, draft_len, branches)


# a drafter's method's builder also takes the Drawing (its `sample`, `draws`, `draw_shape` options)
def _dflash(target, drafter_path, drawing):
    from .dflash import DFlashChainDrafter, load_block
    return DFlashChainDrafter(load_block(target, drafter_path), drawing=drawing)


def _ddtree(target, drafter_path, drawing, *, budget: int = D.DDTREE_BUDGET, top_k: int = D.DDTREE_TOP_K,
            sampled_budget: int = D.DDTREE_SAMPLED_BUDGET):
    from .ddtree import DDTreeDrafter
    from .dflash import load_block
    return DDTreeDrafter(load_block(target, drafter_path), budget, top_k, sampled_budget, drawing=drawing)


def _treeflash(target, drafter_path, drawing, *, budget: int = D.TREEFLASH_BUDGET, top_m: int | None = None,
               top_k: int = D.TREEFLASH_TOP_K, temperature: float = D.TREEFLASH_TEMPERATURE,
               support: int | None = None):
    from .treeflash import TreeFlashDrafter, load_treeflash_block
    return TreeFlashDrafter(*load_treeflash_block(target, drafter_path), budget, top_m, top_k, temperature, support,
                            drawing=drawing)


def _domino(target, drafter_path, drawing):
    from .domino import DominoDrafter, load_head_block
    return DominoDrafter(*load_head_block(target, drafter_path), drawing=drawing)


def _dartree(target, drafter_path, drawing, *, budget: int = D.DARTREE_BUDGET,
             candidates: int = D.DARTREE_CANDIDATES, width: int = D.DARTREE_WIDTH,
             depth_bonus: float = D.DARTREE_DEPTH_BONUS, variant: str = D.DARTREE_VARIANT):
    from .dartree import DARTreeDrafter
    from .domino import load_head_block
    return DARTreeDrafter(*load_head_block(target, drafter_path), budget, candidates, width, depth_bonus, variant,
                          drawing=drawing)


def _d2sd(target, drafter_path, drawing, *, vp_drafter: str | None = None, k: int = D.D2SD_K, b2: int = D.D2SD_B2,
          budget: int = D.D2SD_BUDGET, skip_rejected: bool = D.D2SD_SKIP_REJECTED, branch: str = D.D2SD_BRANCH):
    from .d2sd import build_d2sd
    return build_d2sd(target, drafter_path, vp_drafter, k, b2, budget, skip_rejected, branch, drawing)


METHODS: dict[str, Method] = {}


def register(method: Method) -> None:
    METHODS[method.name] = method


register(Method("ar", "plain decoding, no drafts (the baseline of every speedup)", _ar))
register(Method("pld", "prompt lookup: n-gram matches in the text so far, as a chain or a tree", _pld))
register(Method("dflash", "DFlash block diffusion: one drafter pass, a chain of B-1 tokens", _dflash, True))
register(Method("ddtree", "marginal tree from one DFlash pass, best-first to a node budget", _ddtree, True, True))
register(Method("treeflash", "TreeFlash: each depth conditioned on the token before it by a small head, one pass",
                _treeflash, True, True))
register(Method("domino", "DFlash pass + Domino's GRU correction head along the chain", _domino, True))
register(Method("dartree", "Domino's head grown into a tree, all parents of a depth scored at once", _dartree, True,
                True))
register(Method("d2sd", "DFlash chain plus K re-drafts by a variable-prefix drafter from its likeliest "
                        "rejection points, merged into one tree", _d2sd, True, True))


def get_method(name: str) -> Method:
    if name not in METHODS:
        raise MethodError(f"unknown method {shown(name)}{did_you_mean(name, METHODS)}; known: "
                          f"{', '.join(sorted(METHODS))}")
    return METHODS[name]


def check_options(method: Method, options: dict[str, Any]) -> dict[str, Any]:
    """Unknown keys and wrong types fail with the key named and what was expected."""
    known = method.options
    for key, value in options.items():
        if key == "budget" and value == D.AUTO and key in known:
            continue
        if key not in known:
            raise MethodError(f"method {method.name!r} has no option {shown(key)}{did_you_mean(key, known)}; "
                              f"it takes: {', '.join(sorted(known)) or 'none'}")
        if not _type_ok(value, known[key]):
            raise MethodError(f"method {method.name!r} option {key!r} must be {type(known[key]).__name__}, "
                              f"got {shown(value)}")
        choices = D.CHOICES.get((method.name, key), D.CHOICES.get((None, key)))
        if choices is not None and value not in choices:
            raise MethodError(f"method {method.name!r} option {key!r} must be one of {', '.join(choices)}, "
                              f"got {shown(value)}")
        check_range(method.name, key, value)
    merged = {**known, **options}
    if merged.get("sampled_budget") and merged.get("budget") == D.AUTO:
        raise MethodError(f"method {method.name!r} option 'sampled_budget' needs a fixed budget; "
                          f"budget: auto sizes every round's tree")
    if method.name == "pld" and merged["min_ngram"] > merged["max_ngram"]:
        raise MethodError(f"method 'pld' option 'min_ngram' ({merged['min_ngram']}) must be <= max_ngram "
                          f"({merged['max_ngram']})")
    return merged


def check_range(method: str, key: str, value: Any) -> None:
    """A number within the option's bounds (defaults.MINIMUM / MAXIMUM) and finite, or one line."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return
    low = D.MINIMUM.get((method, key), D.MINIMUM.get((None, key)))
    high = D.MAXIMUM.get((method, key), D.MAXIMUM.get((None, key)))
    if isinstance(value, float) and not math.isfinite(value):
        raise MethodError(f"method {method!r} option {key!r} must be a finite number, got {shown(value)}")
    if low is not None and value < low:
        raise MethodError(f"method {method!r} option {key!r} must be >= {low}, got {shown(value)}")
    if high is not None and value > high:
        raise MethodError(f"method {method!r} option {key!r} must be <= {high}, got {shown(value)}")


def auto_budget(options: dict | None) -> bool:
    """`budget: auto` asked for: the engine picks each round's tree size (GenerationConfig.verify_cost)."""
    return (options or {}).get("budget") == D.AUTO


def _type_ok(value: Any, default: Any) -> bool:
    if default is None:
        return True
    if isinstance(default, bool) or isinstance(value, bool):
        return isinstance(value, bool) and isinstance(default, bool)
    if isinstance(default, float):
        return isinstance(value, (int, float))
    return isinstance(value, type(default))


def build_drafter(name: str, target, drafter_path: str | None = None, options: dict | None = None):
    method = get_method(name)
    if method.needs_drafter and not drafter_path:
        raise MethodError(f"method {name!r} needs a drafter checkpoint (--drafter PATH)")
    options = check_options(method, dict(options or {}))
    if auto_budget(options):  # the drafter drafts its ceiling; the engine trims each round (engine/budget.py)
        options["budget"] = D.AUTO_CEILING
    lookup, dtype = options.pop("lookup", False), options.pop("dtype", D.DTYPE)
    if method.needs_drafter:
        from .base import Drawing
        from .precision import draft_dtype
        from .vocab import load_vocab

        drawing = Drawing(options.pop("sample"), options.pop("draws"), options.pop("draw_shape", D.DRAW_SHAPE))
        frequent = load_vocab(drafter_path) if options.pop("vocab", D.VOCAB) == "auto" else None
        drafter = method.build(target, drafter_path, drawing, **options)
        drafter.cast(draft_dtype(dtype, target))
        if frequent is not None:
            drafter.restrict_vocab(frequent)
    else:
        drafter = method.build(target, drafter_path, **options)
    if lookup:
        from .lookup import LookupFirst
        drafter = LookupFirst(drafter)
    return drafter


__all__ = ["METHODS", "Method", "MethodError", "auto_budget", "build_drafter", "check_options", "get_method", "register"]
