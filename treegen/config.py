"""A run's configuration, resolved in one pass and checked once, before anything loads.

resolve() turns a generating command's values into one frozen RunConfig: the pair in use (--target's, a
shipped --drafter's, else $TREEGEN_PAIR or the installed default), the preset (a name read as that pair's; on
SmolLM2 without one, its preset for --method or its default), the flags over the preset, shipped names made
paths, the method `auto` stands for with the checkpoint its pair ships for it, a drawn seed when sampling
without one, and how the target loads. check() finds every usage error in it. Generator resolves its
arguments with the same resolve_model(), so the API and the CLI run the same thing for the same names.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Any

from . import assets, presets
from .assets import PAIRS, SMOLLM2, SMOLLM2_FILE
from .drafters import METHODS, check_options, get_method
from .policy import best_method, default_preset
from .presets import Preset, Sampling
from .validate import OptionError, check_sampling, check_source, draw_seed, effective_seed, shown

SAMPLING_FLAGS = ("temperature", "top_k", "top_p", "min_p", "max_new_tokens", "seed")
LOAD_FLAGS = ("device", "dtype", "device_map", "load_in_8bit", "load_in_4bit", "prefill_chunk")


@dataclass(frozen=True)
class Model:
    """What a Generator loads, every name resolved: a target, a drafter (None: none), a concrete method."""
    target: str
    drafter: str | None
    method: str
    method_options: Mapping[str, Any]


@dataclass(frozen=True)
class RunConfig:
    """Everything a generating command runs with; nothing here is looked up again after resolve()."""
    target: str                           # a folder, a .gguf file or a hub id (the demo target's folder)
    drafter: str | None                   # the checkpoint the method reads (a shipped pair's by default)
    method: str
    method_options: Mapping[str, Any]     # read-only, as given (the method fills in its own defaults)
    sampling: Sampling
    seed_drawn: bool                      # sampling.seed was drawn for this run (none was given)
    name: str | None                      # the preset that was used (None: none)
    path: Path | None
    load: Mapping[str, Any]               # how the target loads: Generator's device, dtype, device_map, ...
    threads: int | None
    drafter_flag: str | None              # --drafter as typed: one the method does not use is refused


def resolve_model(target: str | None, drafter: str | None, method: str = "auto",
                  method_options: Mapping[str, Any] | None = None, dtype: str | None = None) -> Model:
    """Shipped names (demo, smollm2, PAIR/NAME) made paths; on a shipped pair (None: the demo pair) `auto`
    without a drafter is the pair's default preset's method (given options replace the preset's) and the
    drafter is the pair's checkpoint for the method; elsewhere `auto` is the best method the drafter allows.
    Raises assets.NotInstalled for a shipped name whose files are missing."""
    target, drafter = assets.local_or_shipped(target, "target"), assets.local_or_shipped(drafter, "drafter")
    options = dict(method_options or {})
    pair = assets.pair_of_target(target)
    if pair is not None:
        target = target or str(assets.DEMO_TARGET)
        if method == "auto" and not drafter:
            preset = default_preset(pair, dtype)
            method, options = preset.method, options or dict(preset.method_options)
        shipped = assets.pair_drafter_for(pair, method)
        drafter = drafter or (str(shipped) if shipped else None)
    if method == "auto":
        method = best_method(drafter)
    return Model(target, drafter, method, MappingProxyType(options))


def resolve(kw: Mapping[str, Any]) -> RunConfig:
    """The command line's values (click's keyword arguments; None = not given) as one RunConfig. Raises
    OptionError, presets.PresetError, drafters.MethodError or assets.NotInstalled, each one line."""
    if kw.get("load_in_4bit") and kw.get("load_in_8bit"):
        raise OptionError("--load-in-4bit and --load-in-8bit: choose one")
    if (dtype := (kw.get("dtype") or "").lower()) in ("int8", "q4") and (kw.get("load_in_4bit")
                                                                         or kw.get("load_in_8bit")):
        raise OptionError(f"--dtype {dtype} quantizes the weights itself: leave out --load-in-8bit / --load-in-4bit")
    kw = on_pair_in_use(kw)
    base = presets.load(kw["preset"]) if kw.get("preset") else Preset()
    given = base.with_flags(target=kw.get("target"), drafter=kw.get("drafter"), method=kw.get("method"),
                            method_options=dict(kw.get("method_option") or ()),
                            **{k: kw.get(k) for k in SAMPLING_FLAGS})
    model = resolve_model(given.target, given.drafter, given.method or "auto", given.method_options, kw.get("dtype"))
    sampling, drawn = given.sampling, False
    values = sampling.resolved()
    if not kw.get("chat") and values["temperature"] and effective_seed(values["seed"]) is None:
        # drawn here so the summary and the JSON can say how to repeat the run (chat draws one per reply)
        sampling, drawn = sampling.merged({"seed": draw_seed()}), True
    load = {k: kw[k].lower() if k == "dtype" else kw[k] for k in LOAD_FLAGS if kw.get(k) not in (None, False)}
    return RunConfig(target=model.target, drafter=model.drafter, method=model.method,
                     method_options=model.method_options, sampling=sampling, seed_drawn=drawn, name=given.name,
                     path=given.path, load=MappingProxyType(load), threads=kw.get("threads"),
                     drafter_flag=kw.get("drafter"))


def on_pair_in_use(kw: Mapping[str, Any]) -> dict[str, Any]:
    """The pair in use: --target's shipped pair, else a shipped --drafter's (smollm2/NAME runs on SmolLM2),
    else $TREEGEN_PAIR or the default pair. A preset name reads as that pair's (`dflash` on smollm2 is
    smollm2-dflash); without --preset, --target nor --drafter, SmolLM2 runs as its preset smollm2-METHOD
    (--method's, else its default preset, as the API's)."""
    env = assets.pair_env()
    kw = dict(kw)
    drafter_pair = str(kw.get("drafter") or "").partition("/")[0]
    if not kw.get("target") and drafter_pair in PAIRS and not Path(kw["drafter"]).exists():
        kw["target"] = drafter_pair
    pair = pair_of_name(kw["target"]) if kw.get("target") else (env or (SMOLLM2 if assets.smollm2_gguf() else "demo"))
    if kw.get("preset"):
        kw["preset"] = presets.on_pair(kw["preset"], pair)
    elif not kw.get("target") and not kw.get("drafter") and pair == SMOLLM2:
        wanted = f"{SMOLLM2}-{kw['method']}" if kw.get("method") else None
        kw["preset"] = wanted if wanted in presets.available() else default_preset(SMOLLM2, kw.get("dtype")).name
    return kw


def pair_of_name(target: str) -> str | None:
    """The shipped pair a --target names (demo, smollm2, or a path to either), or None."""
    if target == "demo":
        return "demo"
    if target in (SMOLLM2, SMOLLM2_FILE):
        return SMOLLM2
    path = Path(target).expanduser()
    if not path.exists():
        return None
    if path.resolve() == assets.DEMO_TARGET.resolve():
        return "demo"
    return SMOLLM2 if assets.pair_of_target(str(path)) == SMOLLM2 else None


def check(cfg: RunConfig) -> None:
    """What can be checked before the (slow) model load: sources, method and options, sampling values, and a
    --drafter the method would not use. Raises OptionError or drafters.MethodError (usage errors), or
    cli_errors.Failure when the shipped demo target itself is missing."""
    if Path(cfg.target) == assets.DEMO_TARGET and not assets.DEMO_TARGET.exists():
        from .cli_errors import Failure

        raise Failure(f"the shipped demo target is not installed ({assets.DEMO_TARGET} is missing); "
                      f"pass --target HUB_ID|PATH or a --preset that names one")
    check_source(cfg.target, "target")
    if cfg.drafter is not None:
        check_source(cfg.drafter, "drafter", needs_config=False)
    method = get_method(cfg.method)
    check_options(method, dict(cfg.method_options))
    if method.needs_drafter and cfg.drafter is None:
        raise OptionError(f"method {cfg.method!r} needs a drafter checkpoint (--drafter PATH)")
    check_sampling(cfg.sampling.given())
    if cfg.drafter_flag and not method.needs_drafter:
        users = ", ".join(name for name, m in sorted(METHODS.items()) if m.needs_drafter)
        raise OptionError(f"--drafter {shown(cfg.drafter_flag)}: method {cfg.method} drafts without a drafter; "
                          f"drop --drafter, or choose a method that uses one ({users})")
