"""What a training command checks before it loads anything, and how it stops: usage errors for bad inputs,
no empty output folder left by a failed run, Ctrl-C / SIGTERM as "checkpoint after this step"."""
from __future__ import annotations

import sys
from contextlib import contextmanager
from pathlib import Path

import click

from ..cli_errors import clip
from ..validate import OptionError, check_source, shown_path


def check_training_inputs(source: str | None, data: list[str], out: Path, resume: bool,
                          needs_config: bool = True) -> None:
    """What a training run names, checked before anything loads: a usage error (exit 2) otherwise."""
    from .data import DataError, load_stream, read_data

    try:
        if source is not None:
            check_source(source, "target", needs_config=needs_config)
        for d in data:
            check_text_file(d)
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


SNIFF_BYTES = 8192   # enough of a file's start to tell text from a binary


def check_text_file(name: str) -> None:
    """A data file given as text (not a .pt stream, not a folder) must be UTF-8 text: a binary (an ELF, an
    archive, a model's weights) would be read as replacement characters and trained on."""
    path = Path(name).expanduser()
    if name.endswith(".pt") or not path.is_file():
        return
    with open(path, "rb") as f:
        head = f.read(SNIFF_BYTES)
    if b"\0" in head:
        raise click.UsageError(f"--data {shown_path(name)}: a binary file (NUL bytes), not training text")
    try:
        head.decode("utf-8")
    except UnicodeDecodeError as err:
        if err.start < len(head) - 3:   # not merely a character cut by the sniff's end
            raise click.UsageError(f"--data {shown_path(name)}: not UTF-8 text (byte {err.start}); training "
                                   f"text must be UTF-8") from None


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

    from .common import STOP, leave

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
        leave()   # under torchrun: every rank waits for the main rank's last writes
    finally:
        for sig, handler in saved.items():
            signal.signal(sig, handler)
        STOP.clear()
