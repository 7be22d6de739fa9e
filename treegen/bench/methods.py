"""What --methods names: method names, preset names or preset files, each with a unique label.

A name that is both a method and a preset (ar, pld, dflash, ddtree) is the method, with its default options
on --target / --drafter; give the preset's path to use the file. --target and --drafter override a preset's
(as everywhere in the CLI). Every target gets an `ar` run, the baseline of its speedups and identity checks.
"""
from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from types import MappingProxyType

from .. import presets as presets_mod

BASELINE = "ar"


class MethodSpecError(ValueError):
    """A --methods entry that cannot run; one line naming the entry."""


@dataclass(frozen=True)
class MethodSpec:
    label: str                     # the row's name in the table, the plot and the JSON
    method: str
    target: str | None             # None = the shipped demo target
    drafter: str | None
    options: Mapping = field(default_factory=lambda: MappingProxyType({}))
    preset: str | None = None      # the preset file it came from, if any

    @property
    def is_baseline(self) -> bool:
        return self.method == BASELINE


def default_methods(target: str | None, drafter: str | None) -> list[str]:
    """Every registered method; those that need a drafter only when there is one."""
    from ..drafters import METHODS

    have = drafter or pair_drafter(target)
    return [name for name, m in METHODS.items() if have or not m.needs_drafter]


def split_list(text: str) -> list[str]:
    names = [n.strip() for n in text.split(",")]
    if not all(names):
        raise MethodSpecError(f"--methods {text!r}: an empty name; give a comma-separated list like ar,pld")
    repeated = [n for n, c in Counter(names).items() if c > 1]
    if repeated:
        raise MethodSpecError(f"--methods: {repeated[0]!r} is listed twice")
    return names


def resolve(names: list[str], target: str | None, drafter: str | None) -> list[MethodSpec]:
    """The specs, labels made unique, each checked (method, options, drafter) before anything loads."""
    specs = unique_labels([resolve_one(n, target, drafter) for n in names])
    for spec in specs:
        check(spec)
    return with_baselines(specs)


def resolve_one(name: str, target: str | None, drafter: str | None) -> MethodSpec:
    from ..drafters import METHODS

    if name in METHODS:
        uses = METHODS[name].needs_drafter  # others ignore a drafter: the JSON should not claim one
        return MethodSpec(name, name, local(target), local(drafter or pair_drafter(target, name)) if uses else None)
    try:
        preset = presets_mod.load(name)
    except presets_mod.PresetError as err:
        raise MethodSpecError(unknown_message(name, err)) from err
    preset = preset.with_flags(target=target, drafter=drafter)
    return MethodSpec(preset.name, preset.method, local(preset.target), local(preset.drafter),
                      preset.method_options, str(preset.path))


def pair_drafter(target: str | None, method: str | None = None) -> str | None:
    """On a shipped pair's target, the checkpoint the method reads (the DFlash drafter for most), if installed."""
    from ..assets import pair_drafter_for, pair_of_target

    shipped = pair_drafter_for(pair_of_target(target), method)
    return str(shipped) if shipped is not None else None


def local(source: str | None) -> str | None:
    """An existing path made absolute, so ./x and /abs/x are one target (loaded once); a hub id as is."""
    return str(Path(source).expanduser().resolve()) if source and Path(source).expanduser().exists() else source


def unknown_message(name: str, err: presets_mod.PresetError) -> str:
    from ..drafters import METHODS

    if name.endswith(presets_mod.SUFFIXES) or "/" in name:
        return f"--methods: {err}"  # a path: the preset's own message says what is wrong with the file
    presets = ", ".join(presets_mod.available()) or "none"
    return f"--methods: unknown method or preset {name!r}; methods: {', '.join(METHODS)}; presets: {presets}"


def unique_labels(specs: list[MethodSpec]) -> list[MethodSpec]:
    """Two presets with one file name (a/x.yaml, b/x.yaml) become x and x#2."""
    seen: Counter = Counter()
    out = []
    for spec in specs:
        seen[spec.label] += 1
        out.append(spec if seen[spec.label] == 1 else replace(spec, label=f"{spec.label}#{seen[spec.label]}"))
    return out


def check(spec: MethodSpec) -> None:
    from ..drafters import MethodError, check_options, get_method

    try:
        method = get_method(spec.method)
        check_options(method, dict(spec.options))
    except MethodError as err:
        raise MethodSpecError(f"--methods {spec.label}: {err}") from err
    if method.needs_drafter and not spec.drafter:
        raise MethodSpecError(f"--methods {spec.label}: method {spec.method!r} needs a drafter "
                              f"(--drafter PATH, or a preset that names one)")


def with_baselines(specs: list[MethodSpec]) -> list[MethodSpec]:
    """An `ar` first for every target that has none listed, so each speedup has its own baseline."""
    have = {s.target for s in specs if s.is_baseline}
    missing = [t for t in dict.fromkeys(s.target for s in specs) if t not in have]
    labels = {s.label for s in specs}
    added = [MethodSpec(baseline_label(t, labels, len(missing)), BASELINE, t, None) for t in missing]
    return added + specs


def baseline_label(target: str | None, labels: set[str], count: int) -> str:
    """`ar`, or `ar@TARGET` when several targets each need one."""
    return BASELINE if count == 1 and BASELINE not in labels else f"{BASELINE}@{Path(target or 'demo').name}"


def baseline_of(target: str | None, specs: list[MethodSpec]) -> MethodSpec:
    """The first `ar` on this target."""
    return next(s for s in specs if s.is_baseline and s.target == target)
