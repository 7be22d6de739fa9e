"""YAML presets: a target, a drafter, a method with its options, and sampling defaults, as one frozen config.

A preset file (presets/NAME.yaml):

    description: prompt lookup on the demo target      # one line, shown by `treegen presets`
    target: null              # hub id or folder; null = the shipped demo target
    drafter: null             # folder, hub id or null
    method: pld               # a name from treegen.drafters.METHODS (required)
    method_options: {}        # passed to the method, checked with treegen.drafters.check_options
    sampling: {}              # temperature, top_k, top_p, min_p, max_new_tokens, seed; null = the API default

Relative paths resolve against the preset file's folder; a value that names no existing file and does not
look like a path (`./x`, `/x`, `~/x`, `a/b/c`) is taken as a hub id. Names are looked up in, first wins:
$TREEGEN_PRESET_PATH (os.pathsep-separated folders), the checkout's top-level presets/, and the packaged
treegen/assets/presets (a symlink to presets/ in the checkout, real files in a wheel).
"""
from __future__ import annotations

import functools
import os
from collections.abc import Mapping
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from types import MappingProxyType
from typing import Any

from .validate import (
    HUB_ID,
    SAMPLING,
    OptionError,
    check_sampling,
    did_you_mean,
    key_name,
    looks_like_path,
    shown,
    shown_path,
)

PACKAGE = Path(__file__).resolve().parent
CHECKOUT_PRESETS = PACKAGE.parent / "presets"
PACKAGED_PRESETS = PACKAGE / "assets" / "presets"
ENV_PATH = "TREEGEN_PRESET_PATH"
SUFFIXES = (".yaml", ".yml")


class PresetError(ValueError):
    """A preset that cannot be used; the message is one line naming the file and the key."""


@dataclass(frozen=True)
class Sampling:
    """Sampling values; None means "not set here" so the layer below (preset, then the API) decides."""
    temperature: float | None = None
    top_k: int | None = None
    top_p: float | None = None
    min_p: float | None = None
    max_new_tokens: int | None = None
    seed: int | None = None

    def given(self) -> dict[str, Any]:
        """Only the values set, as keyword arguments for Generator.stream()."""
        return {f.name: getattr(self, f.name) for f in fields(self) if getattr(self, f.name) is not None}

    def merged(self, overrides: Mapping[str, Any]) -> Sampling:
        """A new Sampling where every non-None override wins."""
        return replace(self, **{k: v for k, v in overrides.items() if v is not None})

    def resolved(self) -> dict[str, Any]:
        """Every value, the API's defaults filling what is not set."""
        return {**api_defaults(), **self.given()}


def api_defaults() -> dict[str, Any]:
    """The sampling defaults of Generator.config(), defined once in treegen.validate."""
    return {name: spec.default for name, spec in SAMPLING.items()}


@dataclass(frozen=True)
class Preset:
    name: str | None = None             # file stem; None = no preset (the API's defaults)
    path: Path | None = None
    description: str = ""
    target: str | None = None           # None = the shipped demo target
    drafter: str | None = None
    method: str | None = None           # None = the API's default ("auto")
    method_options: Mapping[str, Any] = field(default_factory=lambda: MappingProxyType({}))  # read-only
    sampling: Sampling = Sampling()
    seed_drawn: bool = False            # sampling.seed was drawn for this run (none was given)

    def with_flags(self, *, target=None, drafter=None, method=None, method_options=None, **sampling) -> Preset:
        """A new config with the command-line values that were given (not None) over this preset's."""
        given = {"target": target, "drafter": drafter, "method": method}
        changes = {k: v for k, v in given.items() if v is not None}
        options = dict(self.method_options)
        if method is not None and method != self.method:
            options = {}  # the preset's options belong to its own method
        changes["method_options"] = MappingProxyType({**options, **(method_options or {})})
        return replace(self, **changes, sampling=self.sampling.merged(sampling))


# ---- finding presets -------------------------------------------------------------------------------------

def search_dirs() -> list[Path]:
    """Folders that hold named presets, in lookup order, each once."""
    env = [Path(p).expanduser() for p in os.environ.get(ENV_PATH, "").split(os.pathsep) if p]
    checkout = [CHECKOUT_PRESETS] if (PACKAGE.parent / "pyproject.toml").exists() else []
    out: list[Path] = []
    for d in env + checkout + [PACKAGED_PRESETS]:
        if d.is_dir() and d.resolve() not in [o.resolve() for o in out]:
            out.append(d)
    return out


def available() -> dict[str, Path]:
    """Preset name -> file; an earlier folder shadows a later one."""
    found: dict[str, Path] = {}
    for d in search_dirs():
        for f in sorted(d.iterdir()):
            if f.suffix in SUFFIXES and f.is_file():
                found.setdefault(f.stem, f.resolve())
    return dict(sorted(found.items()))


def find(name_or_path: str) -> Path:
    """A preset name (ar, pld, ...) or a path to a YAML file."""
    if is_path(name_or_path):
        path = Path(name_or_path).expanduser()
        if not path.is_file():
            raise PresetError(f"{name_or_path}: no such preset file")
        return path.resolve()
    known = available()
    if name_or_path not in known:
        raise PresetError(f"unknown preset {shown(name_or_path)}{did_you_mean(name_or_path, known)}; "
                          f"`treegen presets` lists the {len(known)} known (or give a path to a .yaml file)")
    return known[name_or_path]


def is_path(name_or_path: str) -> bool:
    """Whether --preset names a file rather than a preset."""
    return name_or_path.endswith(SUFFIXES) or os.sep in name_or_path or "/" in name_or_path


def on_pair(name: str, pair: str | None) -> str:
    """A preset name as the pair in use reads it: on smollm2, `dflash` is smollm2-dflash when that preset
    exists (so --preset dflash and --method dflash run the same pair); any other name, or a path, as given."""
    from .assets import SMOLLM2

    if pair == SMOLLM2 and not is_path(name) and not name.startswith(f"{SMOLLM2}-"):
        own = f"{SMOLLM2}-{name}"
        if own in available():
            return own
    return name


def pair_of(path: Path) -> str:
    """The model pair a preset file names, for listings: demo, smollm2 (marked when not installed), or its
    target as written; '?' when the file cannot be read."""
    from .assets import SMOLLM2, smollm2_gguf

    try:
        target = read_yaml(path).get("target")
    except PresetError:
        return "?"
    if target in (None, "demo"):
        return "demo"
    if target == SMOLLM2:
        return SMOLLM2 if smollm2_gguf() is not None else f"{SMOLLM2} (not installed)"
    return str(target)


def load(name_or_path: str) -> Preset:
    path = find(name_or_path)
    return parse(read_yaml(path), path)


MAX_BYTES = 1_000_000   # a preset is a few lines; anything this big is not one


def read_yaml(path: Path) -> dict:
    import yaml

    try:
        if path.stat().st_size > MAX_BYTES:
            raise PresetError(f"{path}: {path.stat().st_size} bytes, too large for a preset")
        data = yaml.load(path.read_text(encoding="utf-8"), Loader=no_alias_loader())
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark else ""
        raise PresetError(f"{path}: malformed YAML{where}: {getattr(err, 'problem', None) or err}") from err
    except RecursionError:
        raise PresetError(f"{path}: nested too deeply to be a preset") from None
    except ValueError as err:  # e.g. an integer of thousands of digits
        raise PresetError(f"{path}: a value cannot be read: {str(err)[:80]}") from None
    except (OSError, UnicodeDecodeError) as err:
        raise PresetError(f"{path}: cannot read: {err}") from err
    if not isinstance(data, dict):
        raise PresetError(f"{path}: expected a mapping of keys (description, method, ...), "
                          f"got {type(data).__name__}")
    return data


@functools.lru_cache(maxsize=1)
def no_alias_loader():
    import yaml

    class Loader(yaml.SafeLoader):
        """SafeLoader that refuses aliases: a few hundred bytes of nested aliases expand to gigabytes."""

        def compose_node(self, parent, index):
            if self.check_event(yaml.AliasEvent):
                event = self.peek_event()
                raise yaml.composer.ComposerError(
                    None, None, f"aliases (*{str(event.anchor)[:20]}) are not allowed in a preset", event.start_mark)
            return super().compose_node(parent, index)

    return Loader


# ---- validation ------------------------------------------------------------------------------------------

TOP_KEYS = {"description": "a string", "target": "a hub id, a path or null", "drafter": "a hub id, a path or null",
            "method": "a method name", "method_options": "a mapping", "sampling": "a mapping"}
# what each expectation accepts; None (null) is accepted wherever a value may be left to the API
ACCEPTS = {"a string": (str,), "a hub id, a path or null": (str, type(None)), "a method name": (str,),
           "a mapping": (dict, type(None))}


def check_keys(data: dict, expected: dict[str, str], path: Path, prefix: str = "") -> None:
    """Every key known and every value of the expected type, or one line saying which and what."""
    for key, value in data.items():
        if key not in expected:
            raise PresetError(f"{path}: {prefix}{key_name(key)}: unknown key; expected one of {', '.join(expected)}")
        ok = isinstance(value, ACCEPTS[expected[key]]) and not isinstance(value, bool)
        if not ok:
            raise PresetError(f"{path}: {prefix}{key}: expected {expected[key]}, got {shown(value)}")


def checked_sampling(data: dict, path: Path) -> Sampling:
    """The sampling block, every value checked by the same definition the flags and /set use."""
    try:
        values = check_sampling(data.get("sampling") or {}, label=lambda key: f"sampling.{key_name(key)}")
    except OptionError as err:
        raise PresetError(f"{path}: {err}") from None
    return Sampling(**values)


def parse(data: dict, path: Path) -> Preset:
    check_keys(data, TOP_KEYS, path)
    if "method" not in data:
        raise PresetError(f"{path}: method: missing; expected a method name (one of {', '.join(method_names())})")
    base = path.parent
    return Preset(
        name=path.stem, path=path, description=(data.get("description") or "").strip().split("\n")[0],
        target=resolve_source(data.get("target"), base, path, "target"),
        drafter=resolve_source(data.get("drafter"), base, path, "drafter"),
        method=data["method"], method_options=checked_options(data, path),
        sampling=checked_sampling(data, path))


def method_names() -> list[str]:
    from .drafters import METHODS

    return sorted(METHODS)


def checked_options(data: dict, path: Path) -> Mapping[str, Any]:
    """The method exists and takes these options; kept as written (the method fills its own defaults)."""
    from .drafters import MethodError, check_options, get_method

    options = dict(data.get("method_options") or {})
    try:
        method = get_method(data["method"])
    except MethodError as err:
        raise PresetError(f"{path}: method: {err}") from err
    if not all(isinstance(k, str) for k in options):
        raise PresetError(f"{path}: method_options: keys must be option names, got {shown(list(options))}")
    try:
        check_options(method, options)
    except MethodError as err:
        raise PresetError(f"{path}: method_options: {err}") from err
    return MappingProxyType(options)


def resolve_source(value: str | None, base: Path, path: Path, key: str) -> str | None:
    """An existing file/folder becomes absolute (relative to the preset); a path that is missing fails.
    Shipped names (`demo`, `smollm2`, `demo/NAME`, `smollm2/NAME`: assets.named_checkpoint) resolve wherever
    the package is installed."""
    if value is None:
        return None
    from .assets import NotInstalled, named_checkpoint
    try:
        found = named_checkpoint(value, key)
    except NotInstalled as err:
        raise PresetError(f"{path}: {key}: {err}") from None
    if found is not None:
        return str(found)
    candidate = Path(value).expanduser()
    candidate = candidate if candidate.is_absolute() else base / candidate
    if candidate.exists():
        return str(candidate.resolve())
    if looks_like_path(value) or value.lower().endswith(".gguf"):
        raise PresetError(f"{path}: {key}: {shown_path(candidate)} does not exist; expected a file or folder, "
                          f"or a hub id")
    if not HUB_ID.match(value):
        raise PresetError(f"{path}: {key}: {shown(value)} is no folder here, and not a hub id (OWNER/NAME)")
    return value


# ---- showing ---------------------------------------------------------------------------------------------

def resolved_dict(preset: Preset) -> dict[str, Any]:
    """What the preset amounts to: absolute paths, the method's option defaults and the API's sampling defaults."""
    from .drafters import check_options, get_method

    options = dict(preset.method_options)
    if preset.method not in (None, "auto"):
        options = check_options(get_method(preset.method), options)
    from .assets import DEMO_TARGET

    return {"description": preset.description, "target": preset.target or (str(DEMO_TARGET) if DEMO_TARGET.exists() else None),
            "drafter": preset.drafter, "method": preset.method, "method_options": options, "sampling": preset.sampling.resolved()}


def to_yaml(preset: Preset) -> str:
    import yaml

    header = f"# {preset.path}\n"
    return header + yaml.safe_dump(resolved_dict(preset), sort_keys=False, allow_unicode=True)
