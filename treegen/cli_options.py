"""The options every generating command shares (simonw/llm style decorators), and turning them into a
config and a loaded Generator. Every option defaults to None, "not given", so the preset and then the API
decide: no default value is written here."""
from __future__ import annotations

import functools
import os
import re
import sys
import time
import traceback
from contextlib import contextmanager, nullcontext
from pathlib import Path

import click

from . import presets as presets_mod
from .validate import SAMPLING, OptionError, Spec, check_sampling, check_source, shown, shown_path


class Failure(click.ClickException):
    """A runtime error the user can act on: one line, exit status 1."""
    exit_code = 1


class Interrupted(click.ClickException):
    exit_code = 130

    def __init__(self):
        super().__init__("interrupted")


# errors whose message is written for the user (matched by name: importing loading.py would import torch)
KNOWN_ERRORS = ("LoadError", "CheckpointError", "CacheError", "ValueError", "OSError")
MAX_LINE = 300   # an error line is a line: whatever the value that caused it, it is cut here


def clip(text: str) -> str:
    """One line, at most MAX_LINE characters, whatever the message."""
    text = " ".join(line.strip() for line in str(text).splitlines() if line.strip())
    return text if len(text) <= MAX_LINE else text[:MAX_LINE - 3] + "..."


def one_line(err: BaseException, debug: bool = False) -> str:
    lines = str(err).strip().splitlines()
    text = clip(lines[0] if lines else "")
    if text and any(c.__name__ in KNOWN_ERRORS for c in type(err).__mro__):
        return text
    return f"{type(err).__name__}: {text}" + ("" if debug else " (--debug shows the traceback)")


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
        raise Failure(one_line(err, debug)) from err


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
                          "docs/gguf.md). Default: the shipped demo target."),
        click.option("--drafter", metavar="HUB_ID|PATH", help="Drafter checkpoint: folder, hub id, or demo/NAME "
                     "(a shipped demo-pair checkpoint, e.g. demo/dflash)."),
        click.option("--method", callback=check_method_name,
                     help="Drafting method (ar, pld, ...; default: the best the drafter allows)."),
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


def check_output_path(path: str | None, flag: str) -> None:
    """An output file that cannot be written is a usage error found before the run, not after it."""
    if path in (None, "-"):
        return
    if not path.strip():
        raise click.UsageError(f"{flag} needs a file path (or - for stdout)")
    p = Path(path).expanduser()
    parent = p.resolve().parent
    if p.is_dir():
        raise click.UsageError(f"{flag} {shown_path(path)}: is a folder; give a file path")
    if not parent.is_dir():
        raise click.UsageError(f"{flag} {shown_path(path)}: the folder {shown_path(parent)} does not exist")
    if not os.access(parent, os.W_OK) or (p.exists() and not os.access(p, os.W_OK)):
        raise click.UsageError(f"{flag} {shown_path(path)}: not writable")


# ---- training commands --------------------------------------------------------------------------------------

def check_training_inputs(source: str | None, data: list[str], out: Path, resume: bool,
                          needs_config: bool = True) -> None:
    """What a training run names, checked before anything loads: a usage error (exit 2) otherwise."""
    from .train.data import DataError, load_stream, read_data

    try:
        if source is not None:
            check_source(source, "target", needs_config=needs_config)
        streams = [load_stream(d) for d in data if d.endswith(".pt")]
        texts = read_data([d for d in data if not d.endswith(".pt")]) if len(streams) < len(data) else []
    except (OptionError, DataError, OSError) as err:
        raise click.UsageError(clip(str(err))) from None
    if not any(t.strip() for t in texts) and not any(len(s) for s in streams):
        raise click.UsageError(f"--data {clip(', '.join(data))}: the training text is empty")
    if out.exists() and not out.is_dir():
        raise click.UsageError(f"--out {shown_path(out)}: is a file, not a folder")
    if resume and not out.is_dir():
        raise click.UsageError(f"--resume: {shown_path(out)} does not exist, so there is nothing to resume")


@contextmanager
def new_folder(out: Path):
    """A run that fails leaves no empty output folder behind (a folder that existed before is kept)."""
    existed = out.exists()
    try:
        yield
    except BaseException:
        if not existed and out.is_dir():
            for folder in sorted([out, *out.rglob("*")], key=lambda p: len(p.parts), reverse=True):
                if folder.is_dir() and not any(folder.iterdir()):
                    folder.rmdir()
        raise


@contextmanager
def stop_signals():
    """Ctrl-C or SIGTERM asks a training run to stop after the current step, with a checkpoint; a second
    Ctrl-C stops at once."""
    import signal

    from .train.common import STOP

    def ask(signum, frame):
        if STOP.is_set() and signum == signal.SIGINT:
            raise KeyboardInterrupt
        STOP.set()
        print(f"treegen: {signal.Signals(signum).name}: stopping after this step (Ctrl-C again: now)",
              file=sys.stderr, flush=True)

    STOP.clear()
    saved = {sig: signal.signal(sig, ask) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, handler in saved.items():
            signal.signal(sig, handler)
        STOP.clear()
