"""Showing a generation: plain text for pipes, a tinted live view for terminals, and the end summary.

The live view keeps only the current (unfinished) line and a status line in rich's live area; every line
that is finished is printed above it for good, so scrollback and long outputs behave like plain text.
"""
from __future__ import annotations

import sys
import time
from contextlib import contextmanager
from typing import TextIO

TINTS = ("cyan", "yellow", "magenta")   # one per round, cycling, so the size of each round shows
REFRESH_S = 0.05                         # at most 20 redraws a second, however fast rounds come
# control characters a model may emit would drive the terminal; the live view shows their symbols instead
VISIBLE_CONTROLS = {c: 0x2400 + c for c in range(32) if chr(c) not in "\n\t"} | {0x7F: 0x2421}


class PlainView:
    """Text only, written and flushed as each round commits; a BrokenPipeError reaches the caller. On a
    terminal the text ends with a newline, so the shell's prompt does not land on its last line."""

    def __init__(self, out: TextIO, end: str = ""):
        self.out, self.end, self.closed, self.last = out, end, False, ""

    def update(self, chunk) -> None:
        if chunk.text:
            self.out.write(chunk.text)
            self.out.flush()
            self.last = chunk.text[-1]

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            end = self.end or ("\n" if self.last not in ("", "\n") and is_terminal(self.out) else "")
            self.out.write(end)
            self.out.flush()


class NullView:
    """Shows nothing (stdout carries JSON instead)."""

    def update(self, chunk) -> None:
        pass

    def close(self) -> None:
        pass


class LiveView:
    """Each round's text in its own tint, with a status line under it while generating.

    The live area is the unfinished part of the current line (always shorter than the terminal is wide:
    full rows are printed above for good) and one status line, so it always fits the screen."""

    def __init__(self, console):
        from rich.live import Live
        from rich.text import Text

        self.console, self.line, self.shown, self.tinted = console, Text(), 0.0, 0
        self.live = Live(console=console, auto_refresh=False, transient=True, vertical_overflow="crop",
                         redirect_stdout=False, redirect_stderr=False)
        self.live.start()
        self.closed = False

    def update(self, chunk) -> None:
        if chunk.text:  # the tint changes with every round that shows something
            text = expand_tabs(chunk.text.translate(VISIBLE_CONTROLS), self.line.plain)
            self.line.append(text, style=TINTS[self.tinted % len(TINTS)])
            self.tinted += 1
            self._print_finished_lines()
        now = time.perf_counter()
        if chunk.finish or now - self.shown >= REFRESH_S:
            self.shown = now
            self.live.update(self._area(status_line(chunk)), refresh=True)

    def _print_finished_lines(self) -> None:
        cut = self.line.plain.rfind("\n")
        if cut >= 0:
            self.console.print(self.line[:cut], soft_wrap=True)
            self.line = self.line[cut + 1:]
        width = max(self.console.width, 2)
        while True:  # whole rows of a long line go above too: the live area never wraps
            cut = row_end(self.line.plain, width)
            if cut is None:
                return
            self.console.print(self.line[:cut], soft_wrap=True)
            self.line = self.line[cut:]

    def _area(self, status: str):
        from rich.console import Group
        from rich.text import Text

        return Group(self.line, Text(status, style="dim", no_wrap=True, overflow="ellipsis"))

    def close(self) -> None:
        """Stop the live area and leave the last line on screen, ending with a newline."""
        if not self.closed:
            self.closed = True
            self.live.stop()
            self.console.print(self.line, soft_wrap=True)


def row_end(text: str, width: int) -> int | None:
    """Index where the first full terminal row of text ends, or None when text fits in one row."""
    from rich.cells import get_character_cell_size

    cells = 0
    for i, ch in enumerate(text):
        cells += get_character_cell_size(ch)
        if cells > width:
            return max(i, 1)
    return None


def expand_tabs(text: str, before: str, size: int = 8) -> str:
    """Tabs as the spaces they would take after `before` (the line so far), so widths are known exactly."""
    if "\t" not in text:
        return text
    col, out = len(before), []
    for ch in text:
        if ch == "\t":
            out.append(" " * (size - col % size))
            col += size - col % size
        else:
            out.append(ch)
            col = 0 if ch == "\n" else col + 1
    return "".join(out)


@contextmanager
def quiet_keys(stream):
    """While a reply streams, keys typed on the terminal are not echoed into the live view, and are dropped
    after it (Ctrl-C still interrupts). A no-op when `stream` is not a terminal."""
    if stream is None or not is_terminal(stream):
        yield
        return
    import termios

    fd = stream.fileno()
    saved = termios.tcgetattr(fd)
    quiet = list(saved)
    quiet[3] &= ~(termios.ECHO | termios.ICANON)
    termios.tcsetattr(fd, termios.TCSANOW, quiet)
    try:
        yield
    finally:
        termios.tcsetattr(fd, termios.TCSANOW, saved)
        termios.tcflush(fd, termios.TCIFLUSH)


def status_line(chunk) -> str:
    r, s = chunk.round, chunk.stats
    return (f"round {r.index} | accepted {r.accepted}/{r.drafted} | mean acceptance length "
            f"{s.mean_accepted_length:.2f} | {s.tokens_per_second:.1f} tok/s")


def is_terminal(stream: TextIO) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False


def make_view(out: TextIO | None = None, *, live: bool = True, end: str = "", color: bool | None = None):
    """The live view when `out` is a terminal and live is wanted, else plain text. color None: tints unless
    NO_COLOR is set; True/False: --color/--no-color."""
    out = out or sys.stdout
    if live and is_terminal(out):
        from rich.console import Console

        console = Console(file=out, highlight=False, emoji=False, markup=False,
                          no_color=None if color is None else not color)
        if not console.is_dumb_terminal:
            return LiveView(console)
    return PlainView(out, end)


# ---- the end-of-run summary, in the manner of llama.cpp's server ------------------------------------------

def _ms(seconds: float) -> str:
    return f"{seconds * 1000:10.2f} ms"


def _timing(seconds: float, tokens: int) -> str:
    rate = ""
    if tokens and seconds:
        rate = f" ({seconds * 1000 / tokens:8.2f} ms per token, {tokens / seconds:8.2f} tokens per second)"
    return f"{_ms(seconds)} / {tokens:5d} tokens{rate}"


def time_split(split: dict[str, float], wall: float) -> str:
    def part(name):
        share = f" ({split[name] / wall:.0%})" if wall else ""
        return f"{name} {split[name] * 1000:.1f} ms{share}"

    return " | ".join(part(name) for name in split)


def summary(stats, *, method: str, prompt_tokens: int, prefills: int = 1) -> str:
    """Aligned lines: times, acceptance, per-position acceptance, the time split. `prefills`: generations
    summed in `stats` (a chat session), each of whose first token came with its prompt eval."""
    d = stats.to_dict()
    rate = stats.accepted_drafts / stats.drafted if stats.drafted else 0.0
    rows = [
        ("method", f"{method}, finish = {stats.finish}"),
        ("prompt eval time", _timing(stats.time_prefill, prompt_tokens - stats.prompt_reused)
         + (f", {stats.prompt_reused} more reused from the last turn" if stats.prompt_reused else "")),
        # as llama.cpp's "eval time": after the prompt eval, whose forward also gives the first token
        ("eval time", _timing(max(stats.wall_time - stats.time_prefill, 0.0), max(stats.new_tokens - prefills, 0))),
        ("total time", f"{_ms(stats.wall_time)} / {stats.new_tokens:5d} tokens"),
        ("rounds", f"{stats.rounds}, mean acceptance length = {stats.mean_accepted_length:.2f} tokens/round, "
                   + f"mean tree size = {d['mean_tree_size']:.1f}"),
        ("draft acceptance rate", f"{rate:.2f} ({stats.accepted_drafts} accepted / {stats.drafted} drafted)"),
        ("acceptance per position", " ".join(f"{p:.2f}" for p in d["acceptance_per_position"]) or "-"),
        ("time split", time_split(d["time_split_s"], stats.wall_time)),
    ]
    if stats.ways:   # lookup: true
        rows.append(("rounds by way", " | ".join(f"{way} {n / stats.rounds:.0%}" for way, n in sorted(stats.ways.items()))))
    width = max(len(label) for label, _ in rows)
    return "\n".join(f"{label:>{width}} = {value}" for label, value in rows)
