"""What a valid value is, defined once: the sampling options (their types, ranges and defaults) and the names
of models. The click flags, a preset's `sampling:` block, chat's `/set` and Generator.config() all check with
these; nothing here imports torch or click, so a bad value is refused before anything loads.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

MAX_SHOWN = 40          # characters of a bad value quoted back in an error line


class OptionError(ValueError):
    """A value out of range or of the wrong type; one line naming the option and what it must be."""


def shown(value: Any) -> str:
    """repr(value), cut short: an error line never repeats a huge value."""
    try:
        text = repr(value)
    except ValueError:  # an integer too long to print
        return f"an integer of {value.bit_length()} bits"
    return text if len(text) <= MAX_SHOWN else text[:MAX_SHOWN - 5] + "...'" * isinstance(value, str) + "..."


def key_name(key: Any) -> str:
    """A mapping key for an error line: as is when it is a short string, else shown()."""
    return key if isinstance(key, str) and len(key) <= MAX_SHOWN and key.isprintable() else shown(key)


def did_you_mean(name: Any, known) -> str:
    """' (did you mean X?)' for the closest known name, or ''."""
    import difflib

    if not isinstance(name, str):
        return ""
    close = difflib.get_close_matches(name, list(known), n=1, cutoff=0.6)
    return f" (did you mean {close[0]}?)" if close else ""


def shown_path(path: Any, limit: int = 120) -> str:
    """A path for an error line: whole if short, else its end (where the file's name is)."""
    text = str(path)
    return text if len(text) <= limit else "..." + text[-(limit - 3):]


@dataclass(frozen=True)
class Spec:
    """One sampling option: a Python type, an inclusive/exclusive range, the API default, a help text."""
    name: str
    kind: type                      # int or float
    default: Any
    low: float | None = None
    high: float | None = None
    low_open: bool = False          # low itself excluded
    high_open: bool = False
    allowed: tuple = ()             # values outside the range that are accepted too (seed -1)
    meaning: str = ""               # what the special values mean, for the help and the error

    def describe(self) -> str:
        """The valid values in words: 'a number in (0, 1]', 'an integer >= 0'."""
        what = "an integer" if self.kind is int else "a number"
        if self.low is not None and self.high is not None:
            rng = f"{'(' if self.low_open else '['}{fmt(self.low)}, {fmt(self.high)}{')' if self.high_open else ']'}"
            text = f"{what} in {rng}"
        elif self.low is not None:
            text = f"{what} {'>' if self.low_open else '>='} {fmt(self.low)}"
        else:
            text = what
        extra = ", ".join(f"{v}" for v in self.allowed)
        return f"{extra} or {text}" if extra else text

    def parse(self, text: str, label: str | None = None) -> Any:
        """A typed string (a flag, /set) made a value and checked."""
        label = label or self.name
        try:
            value = int(text.strip()) if self.kind is int else float(text.strip())
        except (ValueError, AttributeError):
            raise OptionError(f"{label} must be {self.describe()}, got {shown(text)}") from None
        return self.check(value, label)

    def check(self, value: Any, label: str | None = None) -> Any:
        """A value (from YAML, the API or parse()) of the right type and in range, or one OptionError line."""
        label = label or self.name
        numeric = int if self.kind is int else (int, float)
        if isinstance(value, bool) or not isinstance(value, numeric):
            raise OptionError(f"{label} must be {self.describe()}, got {shown(value)}")
        if value in self.allowed:
            return value
        if not math.isfinite(value) or not self.in_range(value):
            raise OptionError(f"{label} must be {self.describe()}{self.meaning_text()}, got {shown(value)}")
        return self.kind(value)

    def in_range(self, value: float) -> bool:
        if self.low is not None and (value < self.low or (self.low_open and value == self.low)):
            return False
        return not (self.high is not None and (value > self.high or (self.high_open and value == self.high)))

    def meaning_text(self) -> str:
        return f" ({self.meaning})" if self.meaning else ""


def fmt(x: float) -> str:
    if x == MAX_SEED:
        return "2**64 - 1"
    return str(int(x)) if float(x).is_integer() else f"{x:g}"


MAX_TOKENS = 2**31 - 1   # anything more is no limit in practice; bounded so it stays a machine integer
MAX_SEED = 2**64 - 1     # the widest seed torch.Generator.manual_seed takes

SAMPLING: dict[str, Spec] = {s.name: s for s in (
    Spec("max_new_tokens", int, 256, 0, MAX_TOKENS, meaning="0 = generate nothing"),
    Spec("temperature", float, 0.0, 0, None, meaning="0 = greedy; finite"),
    Spec("top_k", int, 0, 0, None, meaning="0 = off"),
    Spec("top_p", float, 1.0, 0, 1, low_open=True, meaning="1 = off"),
    Spec("min_p", float, 0.0, 0, 1, high_open=True, meaning="0 = off"),
    Spec("seed", int, None, 0, MAX_SEED, allowed=(-1,), meaning="-1 = a fresh random seed"),
)}
ALIASES = {"n": "max_new_tokens", "temp": "temperature", "max_tokens": "max_new_tokens"}


def check_sampling(values: dict[str, Any], label=lambda key: key) -> dict[str, Any]:
    """Every key known and every value valid (None = not set, left to the layer below); a new dict."""
    out = {}
    for key, value in values.items():
        name = ALIASES.get(key, key)
        if name not in SAMPLING:
            raise OptionError(f"{label(key)}: unknown sampling option; expected one of {', '.join(SAMPLING)}")
        out[name] = None if value is None else SAMPLING[name].check(value, label(key))
    return out


def draw_seed() -> int:
    """A fresh seed for a sampled run without one, short enough to type back as --seed."""
    import secrets

    return secrets.randbits(32)


def effective_seed(seed: int | None) -> int | None:
    """-1 (as in llama.cpp) and None both mean: no fixed seed, a fresh random draw each run."""
    return None if seed in (None, -1) else seed


# ---- model names: a local folder or an OWNER/NAME hub id --------------------------------------------------

HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*$")


def looks_like_path(name: str) -> bool:
    return name.startswith((".", "/", "~")) or name.count("/") > 1 or "\\" in name or name.endswith("/")


def check_source(name: str, what: str = "model", needs_config: bool = True) -> str:
    """An existing folder (absolute), or something shaped like a hub id (OWNER/NAME); else one line."""
    if not name or not name.strip():
        raise OptionError(f"the {what} name is empty")
    path = Path(name).expanduser()
    if path.exists():
        if needs_config and not names_gguf(path) and path.is_dir() and not (path / "config.json").exists():
            raise OptionError(f"{name}: no config.json (nor one .gguf file) in this folder, so it is not a "
                              f"transformers model")
        return str(path.resolve())
    if name.lower().endswith(".gguf"):
        raise OptionError(f"{shown_path(name)}: no such .gguf file")
    if looks_like_path(name):
        raise OptionError(f"{shown(name)}: no such folder")
    if not HUB_ID.match(name):
        raise OptionError(f"{shown(name)}: no such folder, and not a hub id (those are OWNER/NAME)")
    return name


def names_gguf(path: Path) -> bool:
    """Whether a target path names a GGUF file (loaded through treegen.gguf); one that is not GGUF is refused."""
    from .gguf import GGUFError, check_magic, gguf_file

    try:
        file = gguf_file(path)
        if file is not None:
            check_magic(file)
    except GGUFError as err:
        raise OptionError(str(err)) from None
    return file is not None


def hub_problem(name: str, timeout: float = 3.0) -> str | None:
    """Why hub id `name` cannot be had now (not cached, and offline or the hub unreachable), or None.
    Asked before loading, so a missing network fails at once rather than after minutes of retries."""
    import socket
    from urllib.parse import urlparse

    from huggingface_hub import constants, try_to_load_from_cache

    if isinstance(try_to_load_from_cache(name, "config.json"), str):
        return None
    if constants.HF_HUB_OFFLINE:
        return f"{name} is not in the local hub cache, and HF_HUB_OFFLINE is set"
    host = urlparse(constants.ENDPOINT).hostname or "huggingface.co"
    try:
        socket.create_connection((host, 443), timeout=timeout).close()
    except OSError as err:
        return f"{name} is not in the local hub cache, and the hub ({host}) cannot be reached: {err.strerror or err}"
    return None
