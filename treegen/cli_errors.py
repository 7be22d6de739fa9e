"""One line and an exit status for every failure a command can meet: the error types, the `--debug` guard
around each command, and checks of output paths made before anything loads."""
from __future__ import annotations

import functools
import os
import traceback
from contextlib import contextmanager
from pathlib import Path

import click

from .validate import shown_path


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
