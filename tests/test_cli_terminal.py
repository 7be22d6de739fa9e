"""The terminal: the live area always fits the screen, typed keys are not echoed into a reply, a plain
view ends with a newline on a terminal, the summary's eval time excludes the prefill, --color/--no-color."""
from __future__ import annotations

import io
import os
import pty
import re
import termios

from rich.console import Console
from test_cli_ui import chunks  # the same fake stream of rounds

from treegen.engine.stats import Stats
from treegen.ui import LiveView, PlainView, make_view, quiet_keys, status_line, summary

ESCAPES = re.compile(r"\x1b(\[[0-9;?]*[A-Za-z]|[78DME])")


def shown_text(raw: str) -> str:
    """What a terminal keeps of the output: the text without escape sequences and without the status rows
    (each drawn between a cursor save and restore)."""
    return ESCAPES.sub("", re.sub(r"\x1b7.*?\x1b8", "", raw, flags=re.DOTALL))


def test_a_long_line_is_written_whole_for_the_terminal_to_wrap():
    out = io.StringIO()
    console = Console(file=out, force_terminal=True, color_system="standard", width=20, height=5)
    view = LiveView(console)
    for chunk in chunks(["x" * 7] * 40 + ["\t", "ab\tc", "\u4e2d" * 15, ""]):   # 280+ columns, no newline
        view.update(chunk)
    view.close()
    raw = out.getvalue()
    assert shown_text(raw) == "x" * 280 + "\t" + "ab\tc" + "\u4e2d" * 15 + "\n"   # no newline added mid-line
    assert "\x1b[1;4r" in raw and raw.rstrip("\n").endswith("\x1b8")         # text above the status row
    assert "\x1b[r" in raw.split("\x1b[1;4r")[-1]                               # the scroll region given back


def test_a_resize_redraws_the_status_row_only():
    out = io.StringIO()
    console = Console(file=out, force_terminal=True, color_system="standard", width=30, height=6)
    view = LiveView(console)
    stream = chunks(["one ", "two ", "three", ""])
    view.update(next(stream))
    view.resized = True            # as SIGWINCH would say
    for chunk in stream:
        view.update(chunk)
    view.close()
    raw = out.getvalue()
    assert shown_text(raw) == "one two three\n"      # nothing written twice
    assert raw.count("\x1b[J") == 1 and raw.count("\x1b[1;5r") == 2


def test_no_status_is_drawn_at_the_right_margin():
    """There a terminal holds a pending wrap that a cursor save/restore loses: the next character would
    overwrite the row's last one."""
    out = io.StringIO()
    console = Console(file=out, force_terminal=True, color_system=None, width=10, height=6)
    view = LiveView(console)
    stream = chunks(["x" * 10, "\u4e2d" * 5, "\t\tab", "y" * 4, ""])
    view.update(next(stream))
    view.shown = 0.0
    assert out.getvalue().endswith("x" * 10)               # a full row: no status after it
    view.update(next(stream))
    assert out.getvalue().endswith("\u4e2d" * 5)            # two full rows of wide characters: none either
    view.update(next(stream))
    assert out.getvalue().endswith("\x1b8")                 # 18 cells: the status comes
    for chunk in stream:
        view.update(chunk)
    view.close()


def test_status_line_keeps_tokens_per_second_first():
    *_, last = chunks(["a", "bc", "de"])
    wide, narrow = status_line(last, 80), status_line(last, 30)
    assert wide.startswith(f"{last.stats.tokens_per_second:.1f} tok/s | round 2 | accepted 1/3")
    assert narrow.startswith(wide[:wide.index(" |")]) and len(narrow) <= 30


def test_summary_lines_fit_80_columns_where_they_can():
    stats = Stats(rounds=40, new_tokens=120, accepted_drafts=80, drafted=2560, time_prefill=0.0123,
                  time_draft=0.4567, time_build=0.0456, time_verify=1.2345, wall_time=1.8)
    for depth in range(1, 17):
        stats.accept_histogram[depth] = 2
    text = summary(stats, method="treeflash", prompt_tokens=9, width=80)
    split = next(line for line in text.splitlines() if "time split" in line)
    depths = next(line for line in text.splitlines() if "reaching depth" in line)
    assert len(split) <= 80 and "verify 69%" in split
    assert len(depths) <= 80 and depths.endswith(", ...")
    assert "2.00 of 64.0 drafted nodes (3.1% of the tree)" in text


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
