"""The options every generating command shares (simonw/llm style decorators), and turning them into a
config and a loaded Generator. Every option defaults to None, "not given", so the preset and then the API
decide: no default value is written here."""
from __future__ import annotations

import functools
import sys
import traceback
from contextlib import contextmanager

import click

from . import presets as presets_mod


class Failure(click.ClickException):
    """A runtime error the user can act on: one line, exit status 1."""
    exit_code = 1


class Interrupted(click.ClickException):
    exit_code = 130

    def __init__(self):
        super().__init__("interrupted")


# errors whose message is written for the user (matched by name: importing loading.py would import torch)
KNOWN_ERRORS = ("LoadError", "CheckpointError", "CacheError", "ValueError", "OSError")


def one_line(err: BaseException) -> str:
    lines = str(err).strip().splitlines()
    text = lines[0] if lines else ""
    if text and any(c.__name__ in KNOWN_ERRORS for c in type(err).__mro__):
        return text
    return f"{type(err).__name__}: {text} (--debug shows the traceback)"


@contextmanager
def failures(debug: bool):
    """Exceptions from the engine and loaders become one-line failures; --debug adds the traceback."""
    try:
        yield
    except (click.ClickException, click.exceptions.Exit, SystemExit):
        raise
    except KeyboardInterrupt:
        raise Interrupted() from None
    except Exception as err:
        if debug:
            traceback.print_exc()
        raise Failure(one_line(err)) from err


def guarded(f):
    """Add --debug and turn the command's failures into one-line errors."""
    @functools.wraps(f)
    def wrapper(*args, debug: bool, **kwargs):
        with failures(debug):
            return f(*args, **kwargs)
    return click.option("--debug", is_flag=True, help="Show tracebacks of errors.")(wrapper)


def _apply(f, options):
    for option in reversed(options):
        f = option(f)
    return f


def model_options(f):
    return _apply(f, [
        click.option("--preset", help="Preset name (see `treegen presets`) or path to a .yaml file; the flags "
                                      "below override its values (another --method drops its method_options)."),
        click.option("--target", help="Target model: hub id or folder (default: the shipped demo target)."),
        click.option("--drafter", help="Drafter checkpoint: folder or hub id."),
        click.option("--method", help="Drafting method (ar, pld, ...; default: the best the drafter allows)."),
        click.option("--device", help="auto, cpu, cuda or cuda:N."),
        click.option("--dtype", help="auto, fp32, fp16 or bf16."),
        click.option("--load-in-8bit", is_flag=True, default=None, help="Load the target in 8 bits (bitsandbytes)."),
        click.option("--load-in-4bit", is_flag=True, default=None, help="Load the target in 4 bits (bitsandbytes)."),
        click.option("--device-map", help="A transformers device_map, e.g. auto."),
    ])


def sampling_options(f):
    return _apply(f, [
        click.option("-n", "--max-new-tokens", type=int, help="Most tokens to generate."),
        click.option("--temperature", "--temp", "temperature", type=float, help="0 = greedy."),
        click.option("--top-p", type=float, help="Nucleus sampling mass (1 = off)."),
        click.option("--top-k", type=int, help="Keep the k likeliest tokens (0 = off)."),
        click.option("--min-p", type=float, help="Drop tokens below min-p times the top probability (0 = off)."),
        click.option("--seed", type=int, help="Random seed for sampling."),
    ])


def output_options(f):
    return _apply(f, [
        click.option("--quiet", is_flag=True, help="No summary or notices on stderr."),
        click.option("--no-live", "no_live", is_flag=True, help="Plain text even on a terminal."),
    ])


def common_options(f):
    return model_options(sampling_options(output_options(f)))


SAMPLING_FLAGS = ("temperature", "top_k", "top_p", "min_p", "max_new_tokens", "seed")
LOAD_FLAGS = ("device", "dtype", "device_map", "load_in_8bit", "load_in_4bit")


def resolve_config(kw: dict) -> presets_mod.Preset:
    """The preset (or none), with the flags that were given on top: a new object, the preset untouched."""
    base = presets_mod.load(kw["preset"]) if kw.get("preset") else presets_mod.Preset()
    return base.with_flags(target=kw.get("target"), drafter=kw.get("drafter"), method=kw.get("method"),
                           **{k: kw.get(k) for k in SAMPLING_FLAGS})


def load_kwargs(kw: dict) -> dict:
    return {k: kw[k] for k in LOAD_FLAGS if kw.get(k) not in (None, False)}


def check_runnable(cfg: presets_mod.Preset) -> None:
    """What can be checked before the (slow) model load: demo assets, method and options, sampling values."""
    from .assets import DEMO_TARGET
    from .drafters import check_options, get_method
    from .engine.generate import GenerationConfig
    from .engine.sampling import Sampler

    if cfg.target is None and not DEMO_TARGET.exists():
        raise Failure(f"the shipped demo target is not installed ({DEMO_TARGET} is missing); "
                      f"pass --target HUB_ID|PATH or a --preset that names one")
    if cfg.method not in (None, "auto"):
        check_options(get_method(cfg.method), dict(cfg.method_options))
    s = cfg.sampling.resolved()
    GenerationConfig(s["max_new_tokens"], Sampler(s["temperature"], s["top_k"], s["top_p"], s["min_p"]))


def load_generator(cfg: presets_mod.Preset, load: dict, quiet: bool):
    from transformers.utils import logging as hf_logging

    from .api import Generator

    hf_logging.disable_progress_bar()  # stderr is for treegen's own summary

    given = {k: v for k, v in {"target": cfg.target, "drafter": cfg.drafter, "method": cfg.method}.items()
             if v is not None}
    with loading_notice(cfg.target or "the demo target", quiet):
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


def setup(kw: dict):
    """(config, generator) from the flags: everything cheap is checked before the model loads."""
    cfg = resolve_config(kw)
    check_runnable(cfg)
    return cfg, load_generator(cfg, load_kwargs(kw), kw["quiet"])
