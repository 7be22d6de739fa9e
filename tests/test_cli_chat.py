"""`treegen chat` in a real terminal (pexpect): two turns, /stats, Ctrl-C mid-reply, /exit."""
from __future__ import annotations

import json
import os
import shutil
import signal
import sys

import pexpect
import pytest


@pytest.fixture
def long_context_target(tiny_model_dir, tmp_path):
    """The tiny target with room for a reply long enough to be interrupted for sure."""
    folder = tmp_path / "tiny-long"
    shutil.copytree(tiny_model_dir, folder)
    config = json.loads((folder / "config.json").read_text())
    config["max_position_embeddings"] = 8192
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def default_sigint() -> None:
    """A shell starts a background job (`pytest ... &`) with SIGINT ignored, and a child inherits that: Python
    then installs no KeyboardInterrupt handler and Ctrl-C does nothing. A terminal user's chat has the default."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def test_chat_session_in_a_terminal(long_context_target):
    env = {**os.environ, "TERM": "xterm-256color", "COLUMNS": "120", "LINES": "40"}
    child = pexpect.spawn(sys.executable, ["-m", "treegen.cli", "chat", "--target", str(long_context_target),
                                           "-n", "6", "--method", "pld", "--system", "Be brief."],
                          env=env, encoding="utf-8", timeout=90, dimensions=(40, 120), preexec_fn=default_sigint)
    try:
        child.expect_exact("Ctrl-D to exit")
        for message in ("hello there", "and once more"):
            child.expect_exact(">>> ")
            child.sendline(message)
        child.expect_exact(">>> ")
        child.sendline("/stats")
        child.expect_exact("conversation: 4 messages (2 replies)")
        child.expect_exact("mean acceptance length")
        child.expect_exact(">>> ")
        child.sendline("/set n 5000")
        child.expect_exact("(max_new_tokens = 5000)")
        child.expect_exact(">>> ")
        child.sendline("now a long one")
        child.expect(r"round \d+ \| accepted")   # the live status line: the reply is streaming
        child.sendintr()
        child.expect_exact("(reply stopped; what came so far stays in the history)")
        child.expect_exact(">>> ")
        child.sendline("/stats")
        child.expect_exact("conversation: 6 messages (3 replies)")   # the stopped reply was kept
        child.expect_exact(">>> ")
        child.sendline("/exit")
        child.expect(pexpect.EOF)
    finally:
        child.close(force=True)
    assert child.exitstatus == 0
    assert "Traceback" not in (child.before or "")


def spawn_chat(target, *flags, dimensions=(30, 100)):
    env = {**os.environ, "TERM": "xterm-256color", "COLUMNS": str(dimensions[1]), "LINES": str(dimensions[0])}
    return pexpect.spawn(sys.executable, ["-m", "treegen.cli", "chat", "--target", str(target), *flags], env=env,
                         encoding="utf-8", timeout=90, dimensions=dimensions, preexec_fn=default_sigint)


PASTE = "Summarize this in one sentence:\ndef add(a, b):\n    return a + b\nprint(add(1, 2))\n"


@pytest.mark.parametrize("bracketed", [False, True])
def test_a_pasted_block_is_one_message_and_a_huge_value_leaves_the_session_intact(long_context_target, tmp_path,
                                                                                  bracketed):
    saved = tmp_path / "talk.json"
    child = spawn_chat(long_context_target, "-n", "4", "--method", "pld")
    try:
        child.expect_exact("Ctrl-D to exit")
        child.expect_exact(">>> ")
        child.send(f"\x1b[200~{PASTE}\x1b[201~" if bracketed else PASTE)   # the whole block at once, as a terminal pastes
        if bracketed:   # readline holds a bracketed paste in the line until Enter, as bash does
            child.sendline("")
        child.expect_exact(">>> ")
        child.sendline("/set n 2147483647")                     # the largest valid value: taken, bounded by the context
        child.expect_exact("(max_new_tokens = 2147483647)")
        child.expect_exact(">>> ")
        child.sendline("/set top_k 99999999999")
        child.expect_exact("(top_k = 99999999999)")
        child.expect_exact(">>> ")
        child.sendline("/set n 4")
        child.expect_exact(">>> ")
        child.sendline("and then?")
        child.expect_exact(">>> ")
        child.sendline(f"/save {saved}")
        child.expect_exact("(saved 4 messages")
        child.sendline("/exit")
        child.expect(pexpect.EOF)
    finally:
        child.close(force=True)
    assert child.exitstatus == 0
    messages = json.loads(saved.read_text())
    assert [m["role"] for m in messages] == ["user", "assistant", "user", "assistant"]
    assert messages[0]["content"] == PASTE.strip() and messages[2]["content"] == "and then?"


def test_a_huge_budget_is_refused_before_loading_in_a_terminal(long_context_target):
    child = spawn_chat(long_context_target, "--method", "treeflash", "--drafter", "demo/treeflash",
                       "--method-option", "budget=100000000", "-n", "8")
    try:
        child.expect(pexpect.EOF)
    finally:
        child.close(force=True)
    lines = [line for line in child.before.splitlines() if line.strip()]
    assert child.exitstatus == 2 and len(lines) == 1, child.before
    assert lines[0].startswith("treegen: error: method 'treeflash' option 'budget' must be <= 2048")
