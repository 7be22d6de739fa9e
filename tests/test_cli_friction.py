"""What a user coming from llama.cpp, mlx_lm or ollama expects: -p TEXT, -m, --max-tokens, --method-option,
--verbose, --threads, a word when the model ends at once, and a chat that a closed pipe ends quietly."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from click.testing import CliRunner

from treegen.cli import cli

THIS_CHECKOUT = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}  # not an installed copy


def invoke(*args, input=None):
    return CliRunner().invoke(cli, [str(a) for a in args], input=input)


def record_of(result) -> dict:
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


def test_inline_prompt_model_alias_and_max_tokens(tiny_model_dir):
    inline = record_of(invoke("complete", "-p", "def add(a, b):", "-m", tiny_model_dir, "--max-tokens", 4,
                              "--method", "ar", "--stats-json", "-"))
    piped = record_of(invoke("complete", "--target", tiny_model_dir, "-n", 4, "--method", "ar", "--stats-json", "-",
                             input="def add(a, b):"))
    assert inline["token_ids"] == piped["token_ids"] and inline["max_new_tokens"] == 4


def test_a_missing_file_hints_at_p():
    result = invoke("complete", "def fib(n):")
    assert result.exit_code == 2 and "-p TEXT" in result.stderr


def test_method_option_over_the_preset(tiny_model_dir, tmp_path):
    preset = tmp_path / "mine.yaml"
    preset.write_text(f"target: {tiny_model_dir}\nmethod: pld\nmethod_options: {{draft_len: 4, branches: 2}}\n")
    rec = record_of(invoke("complete", "-p", "x = 1\nx = 1\n", "--preset", preset, "--method-option", "draft_len=6",
                           "-n", 3, "--stats-json", "-"))
    assert rec["method_options"]["draft_len"] == 6 and rec["method_options"]["branches"] == 2


def test_verbose_and_threads(tiny_model_dir):
    result = invoke("complete", "-p", "x", "-m", tiny_model_dir, "-n", 2, "--verbose", "--threads", 1)
    assert result.exit_code == 0, result.output
    assert "method pld" in result.stderr and "loaded" in result.stderr   # auto resolved before loading


def test_the_model_ending_at_once_is_said(tiny_model_dir, monkeypatch):
    import treegen.api

    monkeypatch.setattr(treegen.api, "eos_ids", lambda model, tok: frozenset(range(10_000)))   # every token
    result = invoke("complete", "-p", "x\n", "-m", tiny_model_dir, "-n", 5, "--method", "ar")
    assert result.exit_code == 0
    assert "finished at once: the model produced its end-of-sequence token" in result.stderr


def test_chat_into_a_closed_pipe_is_quiet(tiny_model_dir, tmp_path):
    script = (f"set -o pipefail; printf 'hello\\nagain\\n' | {sys.executable} -m treegen chat --target {tiny_model_dir} "
              f"-n 300 --method ar --quiet 2> err.txt | head -c 10 > out.txt")
    done = subprocess.run(["bash", "-c", script], cwd=tmp_path, timeout=120, check=False, env=THIS_CHECKOUT)
    assert done.returncode == 0, (tmp_path / "err.txt").read_text()
    assert len((tmp_path / "out.txt").read_bytes()) == 10 and (tmp_path / "err.txt").read_text() == ""


def test_demo_names_on_the_command_line(tmp_path):
    from treegen.assets import DEMO_DRAFTER

    result = invoke("complete", "-p", "def f(x):", "--method", "dflash", "--drafter", "demo/dflash", "-n", 3,
                    "--stats-json", "-")
    assert record_of(result)["drafter"] == str(DEMO_DRAFTER.resolve())
