"""The terminal: the live area always fits the screen, typed keys are not echoed into a reply, a plain
view ends with a newline on a terminal, the summary's eval time excludes the prefill, --color/--no-color."""
from __future__ import annotations

import io
import os
import pty
import termios

from rich.console import Console
from test_cli_ui import chunks  # the same fake stream of rounds

from treegen.engine.stats import Stats
from treegen.ui import LiveView, PlainView, expand_tabs, make_view, quiet_keys, row_end, summary


def test_a_line_taller_than_the_screen_keeps_the_live_area_in_it():
    out = io.StringIO()
    console = Console(file=out, force_terminal=True, color_system="standard", width=20, height=5)
    view = LiveView(console)
    widest = 0
    for chunk in chunks(["x" * 7] * 40 + ["\t", "ab\tc", "\u4e2d" * 15, ""]):   # 280+ columns, no newline
        view.update(chunk)
        widest = max(widest, console.measure(view.line).maximum)
    view.close()
    assert widest <= 20                                     # the unfinished line never wraps in the live area
    assert "..." not in out.getvalue()                      # never rich's overflow ellipsis
    shown = "".join(c for c in out.getvalue() if c in "x")
    assert shown.count("x") >= 280                          # every character reached the screen


def test_row_end_and_tabs():
    assert row_end("abc", 5) is None and row_end("abcdef", 5) == 5
    assert row_end("\u4e2d\u4e2d\u4e2d", 5) == 2            # wide characters take two cells
    assert expand_tabs("a\tb", "") == "a       b" and expand_tabs("\tb", "xyz") == "     b"


def test_keys_typed_during_a_reply_are_not_echoed():
    leader, follower = pty.openpty()
    try:
        with os.fdopen(os.dup(follower), "r") as stream:
            before = termios.tcgetattr(follower)[3]
            with quiet_keys(stream):
                during = termios.tcgetattr(follower)[3]
            after = termios.tcgetattr(follower)[3]
    finally:
        os.close(leader)
        os.close(follower)
    assert before & termios.ECHO and not during & termios.ECHO and during & termios.ISIG
    assert after == before


def test_quiet_keys_is_a_no_op_off_a_terminal():
    with quiet_keys(io.StringIO()):
        pass
    with quiet_keys(None):
        pass


class Terminal(io.StringIO):
    def isatty(self):
        return True


def test_plain_view_on_a_terminal_ends_with_a_newline():
    out = Terminal()
    view = PlainView(out)
    for chunk in chunks(["a", "b"]):
        view.update(chunk)
    view.close()
    assert out.getvalue() == "ab\n"
    pipe = io.StringIO()
    view = PlainView(pipe)
    for chunk in chunks(["a", "b"]):
        view.update(chunk)
    view.close()
    assert pipe.getvalue() == "ab"                           # a pipe gets the exact text


def test_color_flags():
    live = make_view(Terminal(), color=False)
    assert isinstance(live, LiveView) and live.console.no_color
    live.close()
    os.environ["NO_COLOR"] = "1"
    try:
        forced = make_view(Terminal(), color=True)
        assert not forced.console.no_color
        forced.close()
    finally:
        del os.environ["NO_COLOR"]


def test_eval_time_excludes_the_prefill():
    stats = Stats(rounds=4, new_tokens=9, time_prefill=1.0, wall_time=3.0)
    text = summary(stats, method="pld", prompt_tokens=7)
    eval_line = next(line for line in text.splitlines() if line.strip().startswith("eval time"))
    assert "2000.00 ms /     8 tokens" in eval_line and "4.00 tokens per second" in eval_line
    assert "3000.00 ms /     9 tokens" in text                # total time, prefill included
