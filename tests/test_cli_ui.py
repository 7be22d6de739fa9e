"""The live view and the end summary, rendered into a fake terminal."""
from __future__ import annotations

import io

from rich.console import Console

from treegen.api import Chunk
from treegen.engine.generate import Round
from treegen.engine.stats import Stats
from treegen.ui import TINTS, LiveView, PlainView, summary


def chunks(texts):
    stats = Stats()
    for i, text in enumerate(texts):
        r = Round(i, [i], 3, 3, 1 if i else 0, 0.001, 0.01, 0.001, "length" if i == len(texts) - 1 else None)
        stats.add(r)
        stats.wall_time += 0.012
        yield Chunk(text, r, stats, r.finish)


def test_live_view_tints_rounds_and_keeps_finished_lines():
    out = io.StringIO()
    view = LiveView(Console(file=out, force_terminal=True, color_system="standard", width=80))
    for chunk in chunks(["def f", "(x):\n", "    return\x1b x", ""]):
        view.update(chunk)
    view.close()
    text = out.getvalue()
    assert text.count("\x1b[36m") >= 1 and "\x1b[33m" in text and "\x1b[35m" in text  # cyan, yellow, magenta
    assert "\x1b x" not in text and "\u241b x" in text   # a raw ESC from the model is shown, not obeyed
    assert "round 3 | accepted 1/3" in text and text.endswith("\n")
    assert text.count("\n") == 2                         # the model's own newline and the final one
    assert len(TINTS) >= 2


def test_plain_view_is_the_exact_text():
    out = io.StringIO()
    view = PlainView(out)
    for chunk in chunks(["a\x1b", "b\n", "c"]):
        view.update(chunk)
    view.close()
    assert out.getvalue() == "a\x1bb\nc"


def test_summary_in_the_manner_of_llama_cpp():
    *_, last = chunks(["a", "bc", "de"])
    text = summary(last.stats, method="pld", prompt_tokens=7)
    assert "prompt eval time" in text and "/     7 tokens" in text
    assert "rounds = 2, mean acceptance length = 2.00" in text
    assert "rounds reaching depth = 1: 1.00" in text and "verify" in text and "draft" in text
    assert "accepted per round = 1.00 of 3.0 drafted nodes (33.3% of the tree)" in text
    assert len({line.index(" = ") for line in text.splitlines()}) == 1   # the = signs line up
