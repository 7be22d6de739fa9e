"""The `treegen` command: complete, chat, presets, info, and the train and bench groups.

Exit codes: 0 success (a closed output pipe included), 1 a runtime error (one line `treegen: error: ...`,
the traceback only with --debug), 2 a usage error (one line), 130 interrupted. torch and transformers are
imported inside the commands, so `treegen --help` stays fast.
"""
from __future__ import annotations

import json
import os
import sys
from contextlib import closing
from pathlib import Path

import click

from . import __version__
from . import presets as presets_mod
from .bench.cli import bench
from .cli_errors import Interrupted, check_output_path, clip, guarded
from .cli_options import common_options, notice, setup
from .exit import end
from .train.cli import train
from .validate import shown_path


def error_line(message: str) -> None:
    click.echo(f"treegen: error: {clip(message)}", err=True)   # one line, however the message was written


class TreegenGroup(click.Group):
    """Every failure ends as one line on stderr and an exit code, in CliRunner as from the shell."""

    def main(self, args=None, prog_name=None, complete_var=None, standalone_mode=True, **extra):
        try:
            code = super().main(args, "treegen", complete_var, standalone_mode=False, **extra)  # any launcher
        except click.exceptions.NoArgsIsHelpError as err:  # bare `treegen`: the help, as git and llm do
            click.echo(err.ctx.get_help())
            code = 0
        except click.UsageError as err:
            hint = f" (see '{err.ctx.command_path} --help')" if err.ctx else ""
            error_line(clip(f"{err.format_message()}{hint}"))
            code = err.exit_code
        except Interrupted:
            click.echo("treegen: interrupted", err=True)
            code = 130
        except click.ClickException as err:
            error_line(clip(err.format_message()))
            code = err.exit_code
        except click.Abort:
            click.echo("treegen: interrupted", err=True)
            code = 130
        except BrokenPipeError:   # the reader left (`treegen --help | head`): done, quietly
            quiet_stdout()
            code = 0
        code = code if isinstance(code, int) else 0
        if standalone_mode:
            end(code)
        return code


def quiet_stdout() -> None:
    """stdout pointed at /dev/null, so that the interpreter's last flush meets no closed pipe."""
    import os

    try:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    except (OSError, ValueError):   # no real file descriptor (CliRunner)
        pass


# ---- the group ------------------------------------------------------------------------------------------

@click.group(cls=TreegenGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, "--version", prog_name="treegen")
def cli():
    """Exact, fast generation with speculative draft trees.

    \b
    cat prompt.txt | treegen complete > out.txt
    treegen complete prompt.txt --preset pld -n 128 --stats-json stats.json
    treegen chat --target Qwen/Qwen3-8B --system "Be brief."

    Exit status: 0 done (also when the reader of stdout goes away), 1 an error (one line on stderr;
    --debug adds the traceback), 2 a usage error, 130 interrupted.
    """


cli.add_command(train)
cli.add_command(bench)


# ---- complete -------------------------------------------------------------------------------------------

def stdin_is_terminal() -> bool:
    from .ui import is_terminal

    return is_terminal(sys.stdin)


def read_prompt(file: str | None, inline: str | None = None) -> str:
    """The prompt as text: -p TEXT, a file, or stdin; any problem is a usage error, found before loading."""
    ctx = click.get_current_context(silent=True)
    if inline is not None and file is not None:
        raise click.UsageError("give the prompt as FILE or as -p TEXT, not both", ctx)
    if inline is not None:
        return checked_prompt(inline.encode("utf-8", "surrogateescape"), "-p")
    if file is None and stdin_is_terminal():
        raise click.UsageError("give a prompt: -p TEXT, a FILE, or - to read it from stdin", ctx)
    where = "stdin" if file in (None, "-") else file
    try:
        data = read_stdin_bytes() if file in (None, "-") else Path(file).expanduser().read_bytes()
    except IsADirectoryError:
        raise click.UsageError(f"{shown_path(file)} is a folder, not a prompt file", ctx) from None
    except OSError as err:
        hint = "" if Path(file).suffix or "/" in file else " (to give the text itself: -p TEXT)"
        raise click.UsageError(f"cannot read the prompt from {shown_path(file)}: {err.strerror or err}{hint}",
                               ctx) from None
    return checked_prompt(data, where)


def read_stdin_bytes() -> bytes:
    buffer = getattr(sys.stdin, "buffer", None)
    return buffer.read() if buffer is not None else sys.stdin.read().encode("utf-8", "surrogateescape")


def checked_prompt(data: bytes, where: str) -> str:
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as err:
        raise click.UsageError(f"the prompt ({shown_path(where)}) is not valid UTF-8 (byte {err.start})") from None
    if not text:
        raise click.UsageError(f"the prompt is empty ({shown_path(where)})")
    return text


class Transcript:
    """What a completion produced, gathered round by round."""

    def __init__(self):
        self.parts, self.token_ids, self.stats = [], [], None

    def add(self, chunk) -> None:
        self.parts.append(chunk.text)
        self.token_ids.extend(chunk.round.tokens)
        self.stats = chunk.stats

    @property
    def text(self) -> str:
        return "".join(self.parts)


def stats_record(cfg, gen, prompt_ids: list[int], out: Transcript) -> dict:
    """The --stats-json object: what ran, on what, what came out, and the numbers."""
    from .drafters import check_options, get_method
    from .engine.stats import Stats
    from .loading import check_source

    stats = out.stats or Stats()
    return {
        "treegen_version": __version__, "method": gen.method,
        "method_options": check_options(get_method(gen.method), dict(gen.method_options)),
        "preset": cfg.name, "preset_path": str(cfg.path) if cfg.path else None,
        "target": check_source(gen.target),
        "drafter": absolute(gen.drafter) if get_method(gen.method).needs_drafter else None,
        "prompt_tokens": len(prompt_ids), "prompt_token_ids": prompt_ids,
        "token_ids": out.token_ids, "text": out.text, **stats.to_dict(), **cfg.sampling.resolved(),
        "seed_drawn": cfg.seed_drawn,
    }


def shown_summary(cfg, gen, prompt_ids, out: Transcript) -> str:
    """The end summary; the seed with it whenever the run sampled."""
    from .ui import summary

    values = cfg.sampling.resolved()
    seed = values["seed"] if values["temperature"] else None
    return summary(out.stats, method=gen.method, prompt_tokens=len(prompt_ids), seed=seed, seed_drawn=cfg.seed_drawn)


def absolute(path: str | None) -> str | None:
    """A local path made absolute; a hub id (or None) as it is."""
    return str(Path(path).resolve()) if path and Path(path).exists() else path


def write_json(dest: str, record: dict) -> None:
    text = json.dumps(record, ensure_ascii=False)
    if dest == "-":
        try:
            sys.stdout.write(text + "\n")
            sys.stdout.flush()
        except BrokenPipeError:
            silence_stdout()
    else:
        write_atomically(Path(dest).expanduser(), text + "\n")


def write_atomically(path: Path, text: str) -> None:
    """A temp file then a rename: a kill mid-write never leaves half a file (a FIFO or device is written as is)."""
    if path.exists() and not path.is_file():
        path.write_text(text, encoding="utf-8")
        return
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        tmp.write_text(text, encoding="utf-8")
        tmp.replace(path)
    finally:
        tmp.unlink(missing_ok=True)


def silence_stdout() -> None:
    """After the reader closed the pipe: point stdout at /dev/null so the exit flush stays quiet."""
    try:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    except (OSError, ValueError, AttributeError):  # not a real file (tests)
        pass


@cli.command()
@click.argument("file", required=False)
@click.option("-p", "--prompt", "inline", metavar="TEXT", help="The prompt itself, instead of FILE or stdin.")
@common_options
@click.option("--stats-json", "stats_json", metavar="PATH|-",
              help="Write the run's statistics as one JSON object to PATH; with -, the JSON goes to stdout "
                   "instead of the text (the text is in its 'text' field).")
@guarded
def complete(file, inline, stats_json, **kw):
    """Continue the prompt: -p TEXT, FILE, or - / a pipe for stdin.

    The generated text goes to stdout exactly, flushed as each round commits; the summary goes to
    stderr. On a terminal (unless --no-live) each round's tokens are tinted, a status line shows the
    round's acceptance, and a final newline is added. Ctrl-C stops with status 130, the text so far
    written, the summary and the --stats-json record too (finish: interrupted).
    """
    from .ui import NullView, make_view, quiet_keys

    check_output_path(stats_json, "--stats-json")
    prompt = read_prompt(file, inline)
    cfg, gen = setup(kw)
    prompt_ids = gen.encode(prompt)
    live = not kw["no_live"]
    view = NullView() if stats_json == "-" else make_view(sys.stdout, live=live, color=kw["color"])
    with quiet_keys(sys.stdin if live else None):
        out, stop = show_stream(view, gen.stream(prompt_ids, **cfg.sampling.given()))
    if stop == "interrupted":
        interrupted(cfg, gen, prompt_ids, out, stats_json, kw["quiet"])
    if stop is None:
        report(cfg, gen, prompt_ids, out, stats_json, kw["quiet"])


def show_stream(view, chunks) -> tuple[Transcript, str | None]:
    """Stream into the view; (what came, None or why it stopped early: "pipe" or "interrupted")."""
    from .engine.disk import held_notices

    out = Transcript()
    with held_notices():   # a measurement's notice waits for the text's end instead of splitting it
        try:
            with closing(chunks):
                for chunk in chunks:
                    out.add(chunk)
                    view.update(chunk)
            view.close()
        except BrokenPipeError:  # the reader is gone (`| head`): stop quietly
            silence_stdout()
            return out, "pipe"
        except KeyboardInterrupt:
            view.close()
            return out, "interrupted"
    return out, None


def report(cfg, gen, prompt_ids, out: Transcript, stats_json, quiet: bool) -> None:
    if out.stats is not None and out.stats.finish == "eos" and len(out.token_ids) == 1:
        notice("finished at once: the model produced its end-of-sequence token", quiet)
    if not quiet and out.stats is not None:
        click.echo(shown_summary(cfg, gen, prompt_ids, out), err=True)
    if stats_json:
        write_json(stats_json, stats_record(cfg, gen, prompt_ids, out))


def interrupted(cfg, gen, prompt_ids, out: Transcript, stats_json, quiet: bool) -> None:
    """Ctrl-C: the text so far is out already; the summary and JSON record still come; then exit 130."""
    if out.stats is not None:
        out.stats.finish = "interrupted"
        if not quiet:
            click.echo(shown_summary(cfg, gen, prompt_ids, out), err=True)
    if stats_json:
        write_json(stats_json, stats_record(cfg, gen, prompt_ids, out))
    raise Interrupted()


# ---- chat -----------------------------------------------------------------------------------------------

@cli.command()
@common_options
@click.option("--system", help="A system prompt for the conversation.")
@guarded
def chat(system, **kw):
    """Talk with the target, with its chat template (a plain one for base models).

    Commands: /help /clear /stats /set /save /exit. Ctrl-C stops the current reply (what came so far stays in
    the history); Ctrl-D leaves. A closed stdout (`| head`) ends the session quietly.
    """
    from .chat import ChatREPL, valid_utf8

    if system is not None and not valid_utf8(system):
        raise click.UsageError("--system is not valid UTF-8")
    if kw.get("max_new_tokens") == 0:
        raise click.UsageError("--max-new-tokens must be >= 1 in a chat (a reply of no tokens says nothing)")
    cfg, gen = setup({**kw, "chat": True})
    repl = ChatREPL(gen, cfg.sampling.resolved(), system=system, live=not kw["no_live"], quiet=kw["quiet"],
                    color=kw["color"])
    try:
        repl.run()
    except BrokenPipeError:  # the reader is gone (`| head`): leave quietly, as complete does
        silence_stdout()


# ---- presets --------------------------------------------------------------------------------------------

@cli.group("presets", invoke_without_command=True)
@click.pass_context
def presets_group(ctx):
    """List the presets (the default), or show one."""
    if ctx.invoked_subcommand is None:
        ctx.invoke(presets_list)


@presets_group.command("list")
def presets_list():
    """Every preset found, with the model pair it runs (demo, smollm2, or its target) and its description."""
    found = presets_mod.available()
    width = max((len(n) for n in found), default=0)
    pairs = {name: presets_mod.pair_of(path) for name, path in found.items()}
    pair_width = max((len(p) for p in pairs.values()), default=0)
    for name, path in found.items():
        try:
            line = presets_mod.load(str(path)).description
        except presets_mod.PresetError as err:
            line = f"(invalid: {clip(str(err))})"
        click.echo(f"{name:<{width}}  {pairs[name]:<{pair_width}}  {line}")
    if not found:
        click.echo("no presets found in " + ", ".join(map(str, presets_mod.search_dirs())), err=True)


@presets_group.command("show")
@click.argument("name")
@guarded
def presets_show(name):
    """Print preset NAME (or a .yaml path) resolved: absolute paths and every default filled in."""
    from .drafters import MethodError

    try:
        text = presets_mod.to_yaml(presets_mod.load(name))
    except (presets_mod.PresetError, MethodError) as err:  # what complete would refuse, refused here too
        raise click.UsageError(clip(str(err))) from None
    click.echo(text, nl=False)


# ---- info -----------------------------------------------------------------------------------------------

@cli.command()
@guarded
def info():
    """Versions, the compute device, the installed models and the default preset."""
    import platform

    import torch
    import transformers

    from .assets import DEMO_DRAFTER, DEMO_TARGET, SMOLLM2_INSTALL, default_pair, smollm2_gguf
    from .drafters import METHODS
    from .drafters.precision import auto_words
    from .engine import kernels
    from .loading import auto_weights, resolve_device, resolve_dtype
    from .policy import default_preset

    cuda = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none"
    gguf = smollm2_gguf()
    pair = default_pair()
    rows = [("treegen", __version__), ("python", platform.python_version()), ("torch", torch.__version__),
            ("transformers", transformers.__version__), ("cuda device", cuda),
            # what --dtype auto loads here, and whether --dtype int8 / q4 have their compiled products
            ("dtype auto", auto_weights(resolve_device("auto"))),
            ("drafter auto", f"{auto_words(resolve_dtype('auto', torch.device('cpu')))} on the CPU"),
            ("int8 product", f"compiled (row_int8.c, {build})" if (build := kernels.int8_build())
             else "torch (no C compiler found)"),
            ("q4 product", "compiled (row_q4.c, AVX512-VNNI)" if kernels.q4_library() is not None
             else "torch (no AVX512-VNNI, or no C compiler found)"),
            ("demo target", _present(DEMO_TARGET)), ("demo drafter", _present(DEMO_DRAFTER)),
            ("smollm2", f"{gguf} (installed)" if gguf else f"not installed ({SMOLLM2_INSTALL})"),
            # what chat and complete run without --target / --preset
            ("default", f"{default_preset(pair).name} (the {pair} pair)"),
            ("methods", ", ".join(sorted(METHODS))), ("presets", ", ".join(presets_mod.available()) or "none")]
    for key, value in rows:
        click.echo(f"{key:<13} {value}")


def _present(path: Path) -> str:
    return f"{path} ({'present' if path.exists() else 'missing'})"


def main(argv=None):
    cli.main(args=argv, prog_name="treegen")


if __name__ == "__main__":
    main()
