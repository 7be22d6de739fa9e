"""One `treegen bench` run, from the parsed options to the table, the JSON, the plot and the exit status."""
from __future__ import annotations

import sys
from pathlib import Path

from ..cli_errors import Failure, Interrupted
from ..cli_options import loading_notice
from .load import sample
from .methods import MethodSpec, baseline_of, default_methods, local, resolve, split_list
from .metrics import Result, result
from .prompts import DEFAULT_PROMPTS, Prompt, load_prompts
from .runner import BenchInterrupted, Run, Settings


def run_bench(kw: dict, command: str) -> None:
    """Everything cheap is checked before any model loads; the outputs are written before a mismatch fails."""
    for flag, dest in (("--json", kw["json_path"]), ("--plot", kw["plot_path"])):
        check_dest(flag, dest)
    prompts = load_prompts(kw["prompts"] or DEFAULT_PROMPTS, kw["limit"])
    names = split_list(kw["methods"]) if kw["methods"] else default_methods(kw["target"], kw["drafter"])
    specs = resolve(names, kw["target"], kw["drafter"])
    check_demo_target(specs)
    if kw["plot_path"]:
        check_plotting()
    settings = make_settings(kw)
    if kw["threads"]:
        set_threads(kw["threads"])
    contestants = load_all(specs, kw)
    for c in contestants:
        c.chat = chat_prompts(kw)
    before, interrupted = sample(), False
    try:
        runs = run_with_progress(contestants, prompts, settings, kw["quiet"])
    except BenchInterrupted as stop:
        if not stop.runs:
            raise Interrupted() from None
        runs, interrupted = stop.runs, True
    results = summarize_all(contestants, specs, runs, prompts, settings)
    info = {**meta(kw, command, specs), "model": model_name(contestants),
            "load": load_record(before, runs), "interrupted": interrupted}
    write_outputs(kw, results, runs, prompts, settings, info)
    if interrupted:
        raise Interrupted()
    fail_on_mismatch(results, kw["allow_mismatch"])


def load_record(before, runs: list[Run]) -> dict:
    """How busy the machine was with other work while the bench ran (load.py): the JSON keeps it."""
    import os

    from .load import BUSY_CORES, load_average, other_cores

    per_run = [r.other_cores for r in runs if r.other_cores is not None]
    busy = other_cores(before, sample())
    return {"cores": os.cpu_count(), "other_cores": None if busy is None else round(busy, 3),
            "load_average_after": load_average(), "runs": len(runs),
            "disturbed_runs": sum(x > BUSY_CORES for x in per_run) if per_run else None}


def model_name(contestants) -> str:
    """The first target's model class and size, so a table of the demo target names the model it ran."""
    generator = getattr(contestants[0], "generator", None) if contestants else None
    model = getattr(generator, "model", None)
    if model is None:
        return ""
    from ..engine.forms import parameters, weight_form

    params = parameters(model)
    size = f"{params / 1e9:.1f}B" if params >= 1e9 else f"{params / 1e6:.1f}M"
    return f"{type(model).__name__}, {size} parameters, {weight_form(model)} weights"


def chat_prompts(kw: dict) -> bool:
    """--chat / --plain as given; otherwise chat messages for the built-in chat sets only."""
    from .prompts import CHAT_SETS

    return kw["chat"] if kw.get("chat") is not None else kw["prompts"] in CHAT_SETS


def check_dest(flag: str, dest: str | None) -> None:
    if dest and not Path(dest).resolve().parent.is_dir():
        raise Failure(f"{flag} {dest}: the folder {Path(dest).resolve().parent} does not exist")


def check_demo_target(specs: list[MethodSpec]) -> None:
    from ..assets import DEMO_TARGET

    if any(s.target is None for s in specs) and not DEMO_TARGET.exists():
        raise Failure(f"the shipped demo target is not installed ({DEMO_TARGET} is missing); "
                      f"pass --target HUB_ID|PATH or presets that name one")


def check_plotting() -> None:
    """matplotlib missing: say so now, not after the run."""
    plot = plot_module()
    try:
        plot.pyplot()
    except plot.PlotError as err:
        raise Failure(str(err)) from err


def plot_module():
    from . import plot

    return plot


def make_settings(kw: dict) -> Settings:
    """-n and --temperature for every method alike (a preset's sampling section is not used: the methods
    must be compared on the same settings); what is not given is the API's default."""
    from ..presets import api_defaults

    defaults = api_defaults()
    given = {"max_new_tokens": kw["max_new_tokens"], "temperature": kw["temperature"]}
    values = {k: defaults[k] if v is None else v for k, v in given.items()}
    return Settings(values["max_new_tokens"], float(values["temperature"]), kw["repeats"], kw["seed"])


def set_threads(threads: int) -> None:
    import torch

    torch.set_num_threads(threads)


def load_kwargs(kw: dict) -> dict:
    return {k: kw[k] for k in ("device", "dtype") if kw.get(k)}


def load_all(specs: list[MethodSpec], kw: dict) -> list:
    """The methods, then the peers on the first method's target (loaded already: shared, not reloaded)."""
    from transformers.utils import logging as hf_logging

    from .peers import hf_peers
    from .runner import load_contestants

    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()  # generate()'s notices about generation_config would drown the table
    with loading_notice(", ".join(dict.fromkeys(s.target or "the demo target" for s in specs)), kw["quiet"]):
        contestants, targets = load_contestants(specs, load_kwargs(kw))
        if kw["peers"]:
            first = specs[0].target
            contestants += hf_peers(targets[first], first, local(kw["hf_assistant"]), load_kwargs(kw))
    return contestants


def run_with_progress(contestants, prompts: list[Prompt], settings: Settings, quiet: bool) -> list[Run]:
    from ..ui import is_terminal
    from .runner import run_all

    if quiet or not is_terminal(sys.stderr):
        return run_all(contestants, prompts, settings)
    from rich.console import Console
    from rich.progress import Progress

    with Progress(console=Console(stderr=True), transient=True) as progress:
        task = progress.add_task("bench", total=settings.repeats * len(prompts) * len(contestants))

        def advance(run: Run) -> None:
            progress.update(task, advance=1, description=f"repeat {run.repeat + 1} · {prompts[run.prompt].id} · "
                                                         f"{run.label}")
        return run_all(contestants, prompts, settings, advance)


def summarize_all(contestants, specs: list[MethodSpec], runs: list[Run], prompts: list[Prompt],
                  settings: Settings) -> list[Result]:
    ids, categories = [p.id for p in prompts], [p.category for p in prompts]
    out = []
    for c in contestants:
        base = baseline_of(c.target, specs).label
        mine, theirs = [r for r in runs if r.label == c.label], [r for r in runs if r.label == base]
        out.append(result(c.label, info(c, base), mine, theirs, c.has_rounds, settings.greedy, ids, categories))
    return out


def info(contestant, baseline: str) -> dict:
    """What a row ran: method and options (their defaults filled in), preset, target, drafter."""
    spec = getattr(contestant, "spec", None)
    if spec is None:
        extra = {k: getattr(v, "name_or_path", v) for k, v in contestant.extra.items()}
        return {"kind": "peer", "method": contestant.label, "generate_kwargs": extra,
                "target": target_name(contestant.target), "baseline": baseline}
    from ..drafters import check_options, get_method

    return {"kind": "treegen", "method": spec.method,
            "method_options": check_options(get_method(spec.method), dict(spec.options)), "preset": spec.preset,
            "target": target_name(spec.target), "drafter": spec.drafter, "baseline": baseline}


def target_name(target: str | None) -> str:
    from ..assets import DEMO_TARGET

    return str(DEMO_TARGET) if target is None else target


def meta(kw: dict, command: str, specs: list[MethodSpec]) -> dict:
    source = kw["prompts"] or DEFAULT_PROMPTS
    path = Path(source).expanduser()
    drafter = next((s.drafter for s in specs if s.drafter), None)
    return {"command": command, "target": target_name(specs[0].target), "drafter": drafter,
            "prompts_source": str(path.resolve()) if path.is_file() else source, "limit": kw["limit"],
            "chat_template": chat_prompts(kw)}


def write_outputs(kw: dict, results: list[Result], runs: list[Run], prompts: list[Prompt], settings: Settings,
                  meta_: dict) -> None:
    from rich.console import Console

    from ..ui import is_terminal
    from .report import record, show, write_json

    title = table_title(meta_, prompts, runs, settings)
    show(results, title, Console(file=sys.stdout, width=None if is_terminal(sys.stdout) else 160),
         single=settings.repeats == 1)
    warn(results, meta_["load"])
    if kw["json_path"]:
        write_json(kw["json_path"], record({**meta_, "warnings": load_warnings(results, meta_["load"])}, settings,
                                           prompts, results, runs))
    if kw["plot_path"]:
        plot_module().plot(results, kw["plot_path"], title)


def table_title(meta_: dict, prompts: list[Prompt], runs: list[Run], settings: Settings) -> str:
    """The target by name (the shipped pairs: their name and the model class and size), what ran, and how
    much of it when Ctrl-C cut the run short."""
    from ..assets import target_label

    name = target_label(meta_["target"])
    name = Path(name).name if Path(name).is_absolute() else name
    model = f" ({meta_['model']})" if meta_.get("model") else ""
    done = len({r.prompt for r in runs})
    shown = plural(len(prompts), "prompt") if done == len(prompts) else f"{done} of {plural(len(prompts), 'prompt')}"
    cut = " (interrupted: the runs that finished)" if meta_.get("interrupted") else ""
    return (f"{name}{model}: {shown} x {plural(settings.repeats, 'repeat')}, n={settings.max_new_tokens}, "
            f"T={settings.temperature:g}{cut}")


def load_warnings(results: list[Result], load: dict) -> list[str]:
    from .load import warnings

    return warnings(results, load)


def warn(results: list[Result], load: dict) -> None:
    """Signs of a disturbed measurement, on stderr (even with --quiet: a wrong number is worse than noise)."""
    for line in load_warnings(results, load):
        print(f"treegen: warning: {line}", file=sys.stderr)


def plural(count: int, noun: str) -> str:
    return f"{count} {noun}{'s' * (count != 1)}"


def fail_on_mismatch(results: list[Result], allowed: bool) -> None:
    wrong = [r.label for r in results if r.failed_identity]
    if wrong and not allowed:
        raise Failure(f"at T=0 the output of {', '.join(wrong)} differs from ar's (the lines in red above); "
                      f"--allow-mismatch exits 0 anyway")
