"""Showing a generation: plain text for pipes, a tinted live view for terminals, and the end summary.

The live view writes the text as it comes and lets the terminal wrap it: no newline is ever added, so a
copied line is the model's line and a resize reflows it without redrawing anything. The status line sits
on the screen's last row, outside a scroll region that holds the text (as apt's progress bar does).
"""
from __future__ import annotations

import sys
import time
from contextlib import contextmanager
from typing import TextIO

TINTS = (("cyan", 36), ("yellow", 33), ("magenta", 35))   # one per round, cycling, so each round's size shows
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
    """Each round's text in its own tint, written as it comes; a status line on the last row while generating.

    The text is never redrawn (nothing is duplicated by a resize, nothing is cut); only the status row is,
    with the cursor saved and restored around it. A terminal under 3 rows gets the tinted text alone."""

    def __init__(self, console):
        self.console, self.out = console, console.file
        self.color = console.color_system is not None and not console.no_color
        self.shown, self.tinted, self.last, self.closed = 0.0, 0, "", False
        self.cells = 0   # terminal cells the current line has taken so far
        self.rows = console.height if console.height >= 3 else 0   # 0: no status row
        self.resized, self.saved_winch = False, None
        if self.rows:
            self._watch_resizes()
            self._reserve()

    def update(self, chunk) -> None:
        if chunk.text:  # the tint changes with every round that shows something
            text = chunk.text.translate(VISIBLE_CONTROLS)   # tabs stay tabs: the terminal knows its columns
            code = TINTS[self.tinted % len(TINTS)][1]
            self._write(f"\x1b[{code}m{text}\x1b[0m" if self.color else text)
            self.tinted += 1
            self.last = text[-1]
            self.cells = line_cells(text, self.cells)
        now = time.perf_counter()
        # at the right margin the terminal holds a pending wrap, which a cursor save/restore loses (the next
        # character would overwrite the last one): the status waits for the next round there
        at_margin = self.cells > 0 and self.cells % max(self.console.width, 1) == 0
        if self.rows and not at_margin and (chunk.finish or self.resized or now - self.shown >= REFRESH_S):
            self.shown = now
            if self.resized:
                self._resize()
            self._status(status_line(chunk, self.console.width - 1))

    def _reserve(self) -> None:
        """A free row under the cursor (IND scrolls when the cursor is on the last row, RI comes back up,
        the column kept), then a scroll region of every row but the last; the cursor stays where it was."""
        self._write(f"\x1bD\x1bM\x1b7\x1b[1;{self.rows - 1}r\x1b8")

    def _status(self, text: str) -> None:
        self._write(f"\x1b7\x1b[{self.rows};1H\x1b[2K\x1b[2m{text}\x1b[0m\x1b8")

    def _resize(self) -> None:
        """Whatever is below the cursor is the old status row (the text ends at the cursor): erase it, then
        reserve the new last row."""
        self.resized = False
        self.rows = self.console.height if self.console.height >= 3 else 0
        self._write("\x1b[J\x1b7\x1b[r\x1b8")
        if self.rows:
            self._reserve()

    def _write(self, codes: str) -> None:
        self.out.write(codes)
        self.out.flush()

    def _watch_resizes(self) -> None:
        import signal
        import threading

        if threading.current_thread() is threading.main_thread() and hasattr(signal, "SIGWINCH"):
            self.saved_winch = signal.signal(signal.SIGWINCH, self._on_resize)

    def _on_resize(self, signum, frame) -> None:
        self.resized = True
        if callable(self.saved_winch):
            self.saved_winch(signum, frame)

    def close(self) -> None:
        """The scroll region back to the whole screen, the status row cleared, and a final newline."""
        if self.closed:
            return
        self.closed = True
        if self.rows:
            import signal

            signal.signal(signal.SIGWINCH, self.saved_winch or signal.SIG_DFL)
            self._write(f"\x1b7\x1b[r\x1b[{self.rows};1H\x1b[2K\x1b8")
        self._write("" if self.last in ("", "\n") else "\n")


def line_cells(text: str, cells: int) -> int:
    """The cells the current line takes after `text` (tabs to the next multiple of 8, wide characters 2)."""
    from rich.cells import get_character_cell_size

    for ch in text:
        if ch == "\n":
            cells = 0
        elif ch == "\t":
            cells += 8 - cells % 8
        else:
            cells += get_character_cell_size(ch)
    return cells


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


def status_line(chunk, width: int = 80) -> str:
    """tokens/s first, then the round, its acceptance and the mean acceptance length, as many as fit."""
    r, s = chunk.round, chunk.stats
    parts = [f"{s.tokens_per_second:.1f} tok/s", f"round {r.index}", f"accepted {r.accepted}/{r.drafted}",
             f"{s.mean_accepted_length:.2f} tokens/round"]
    return fitted(parts, " | ", width)


def fitted(parts: list[str], sep: str, width: int, more: str = "") -> str:
    """The leading parts that fit in `width` columns (the first always), `more` marking any left out."""
    line = parts[0]
    for i, part in enumerate(parts[1:], 1):
        tail = more if i < len(parts) - 1 else ""
        if len(line) + len(sep) + len(part) + len(tail) > width:
            return line + more
        line += sep + part
    return line


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


def time_split(split: dict[str, float], wall: float, width: int) -> str:
    """Each part's time and share when that fits the width, else its share alone."""
    share = {name: f"{split[name] / wall:.0%}" if wall else "-" for name in split}
    full = " | ".join(f"{name} {split[name] * 1000:.1f} ms ({share[name]})" for name in split)
    return full if len(full) <= width else ", ".join(f"{name} {share[name]}" for name in split)


def terminal_width() -> int:
    import shutil

    return shutil.get_terminal_size((80, 24)).columns


def summary(stats, *, method: str, prompt_tokens: int, prefills: int = 1, seed: int | None = None,
            seed_drawn: bool = False, finish: str | None = None, width: int | None = None) -> str:
    """Aligned lines: times, acceptance (per round, by depth, the share of the tree used), the time split,
    each at most `width` columns where it can be (the terminal's by default). `prefills`: generations summed
    in `stats` (a chat session), each of whose first token came with its prompt eval. `seed`: shown when
    sampling; `finish`: instead of the stats' own (a session's mix)."""
    d = stats.to_dict()
    rows = [
        ("method", f"{method}, finish = {finish or stats.finish}"),
        ("prompt eval time", _timing(stats.time_prefill, prompt_tokens - stats.prompt_reused)
         + (f", {stats.prompt_reused} more reused from the last turn" if stats.prompt_reused else "")),
        # as llama.cpp's "eval time": after the prompt eval, whose forward also gives the first token
        ("eval time", _timing(max(stats.wall_time - stats.time_prefill, 0.0), max(stats.new_tokens - prefills, 0))),
        ("total time", f"{_ms(stats.wall_time)} / {stats.new_tokens:5d} tokens"),
        ("rounds", f"{stats.rounds}, mean acceptance length = {stats.mean_accepted_length:.2f} tokens/round"),
        ("accepted per round", accepted_text(stats, d)),
        ("rounds reaching depth", None),
        ("time split", None),
    ]
    if stats.ways:   # lookup: true
        rows.append(("rounds by way", " | ".join(f"{way} {n / stats.rounds:.0%}" for way, n in sorted(stats.ways.items()))))
    if seed is not None:
        rows.append(("seed", f"{seed} (drawn: --seed {seed} repeats this run)" if seed_drawn else str(seed)))
    label = max(len(name) for name, _ in rows)
    room = (width or terminal_width()) - label - 3
    reached = [f"{k}: {p:.2f}" for k, p in enumerate(d["acceptance_per_position"], 1)] or ["-"]
    rows = [(name, fitted(reached, ", ", room, ", ...") if name == "rounds reaching depth" else
             time_split(d["time_split_s"], stats.wall_time, room) if name == "time split" else value)
            for name, value in rows]
    return "\n".join(f"{name:>{label}} = {value}" for name, value in rows)


def accepted_text(stats, d: dict) -> str:
    """Drafted tokens accepted a round, out of the nodes drafted, and the share of the tree they are."""
    if not stats.drafted:
        return "- (nothing drafted: plain decoding)"
    return (f"{d['accepted_per_round']:.2f} of {d['mean_tree_size']:.1f} drafted nodes "
            f"({d['tree_used']:.1%} of the tree)")
