"""`treegen` through click's CliRunner on the tiny target: output streams, JSON statistics, presets, errors."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from treegen.cli import cli

PROMPT = "def add(a, b):\n    return a + b\n\ndef add(a, b):\n"


@pytest.fixture
def prompt_file(tmp_path):
    path = tmp_path / "prompt.txt"
    path.write_text(PROMPT)
    return path


def invoke(*args, input=None):
    return CliRunner().invoke(cli, [str(a) for a in args], input=input)


def complete_json(target, *args, input=None):
    """Run complete with --stats-json -; (the record, the result)."""
    result = invoke("complete", *args, "--target", target, "--stats-json", "-", input=input)
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout), result


def test_complete_from_a_file(tiny_model_dir, prompt_file, tmp_path):
    stats = tmp_path / "stats.json"
    result = invoke("complete", prompt_file, "--target", tiny_model_dir, "-n", 12, "--stats-json", stats)
    assert result.exit_code == 0, result.output
    record = json.loads(stats.read_text())
    assert result.stdout == record["text"]        # stdout carries the text and nothing else
    assert "mean acceptance length" in result.stderr and "rounds reaching depth" in result.stderr


def test_complete_from_stdin(tiny_model_dir):
    record, result = complete_json(tiny_model_dir, "-", "-n", 5, input=PROMPT)
    assert record["new_tokens"] == 5 and result.stderr.count("\n") >= 5   # the summary went to stderr


def test_stats_json_fields_are_present_and_consistent(tiny_model_dir, prompt_file):
    from transformers import AutoTokenizer

    record, _ = complete_json(tiny_model_dir, prompt_file, "--method", "pld", "-n", 24)
    for key in ("method", "preset", "target", "drafter", "prompt_token_ids", "token_ids", "text", "new_tokens",
                "rounds", "mean_accepted_length", "acceptance_per_position", "mean_tree_size", "wall_time_s",
                "tokens_per_second", "time_split_s", "temperature", "seed"):
        assert key in record, key
    assert {"draft", "build", "verify", "other"} <= set(record["time_split_s"])
    assert record["method"] == "pld" and record["target"] == str(Path(tiny_model_dir).resolve())
    assert len(record["token_ids"]) == record["new_tokens"] == 24 and record["finish"] == "length"
    # each decode round commits mean_accepted_length tokens on average; the prefill adds one; only the
    # last round can be cut short (by at most its drafts, draft_len = 10)
    committed = record["mean_accepted_length"] * record["rounds"] + 1
    assert 0 <= committed - record["new_tokens"] <= record["method_options"]["draft_len"] + 1e-9
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    assert record["prompt_token_ids"] == tok(PROMPT, add_special_tokens=False)["input_ids"]
    assert record["text"] == tok.decode(record["token_ids"], skip_special_tokens=True)


def test_methods_agree_at_temperature_zero(tiny_model_dir, prompt_file):
    ar, _ = complete_json(tiny_model_dir, prompt_file, "--method", "ar", "-n", 16)
    pld, _ = complete_json(tiny_model_dir, prompt_file, "--preset", "pld", "-n", 16)
    assert ar["token_ids"] == pld["token_ids"] and pld["preset"] == "pld"


def test_flags_override_the_preset(tiny_model_dir, prompt_file, tmp_path):
    (tmp_path / "models").mkdir()
    (tmp_path / "models" / "tiny").symlink_to(tiny_model_dir)
    preset = tmp_path / "mine.yaml"
    preset.write_text("description: test\ntarget: ./models/tiny\nmethod: pld\nmethod_options: {draft_len: 4}\n"
                      "sampling: {temperature: 0.9, top_k: 5, seed: 7, max_new_tokens: 6}\n")
    result = invoke("complete", prompt_file, "--preset", preset, "-n", 4, "--seed", 8, "--stats-json", "-")
    assert result.exit_code == 0, result.output
    record = json.loads(result.stdout)
    assert record["target"] == str(Path(tiny_model_dir).resolve())          # from the preset, resolved
    assert (record["max_new_tokens"], record["seed"]) == (4, 8)               # flags win
    assert (record["temperature"], record["top_k"]) == (0.9, 5)               # the preset's, not overridden
    assert record["method_options"]["draft_len"] == 4 and record["new_tokens"] == 4
    assert record["preset_path"] == str(preset.resolve())


def test_keyboard_interrupt_exits_130_after_flushing(tiny_model_dir, prompt_file, monkeypatch, tmp_path):
    from treegen import api

    push, calls = api.StreamDecoder.push, []

    def push_then_interrupt(self, ids):
        calls.append(ids)
        if len(calls) == 4:
            raise KeyboardInterrupt
        return push(self, ids)

    monkeypatch.setattr(api.StreamDecoder, "push", push_then_interrupt)
    stats = tmp_path / "s.json"
    result = invoke("complete", prompt_file, "--target", tiny_model_dir, "-n", 50, "--stats-json", stats)
    assert result.exit_code == 130 and result.stderr.endswith("\ntreegen: interrupted\n")
    assert "finish = interrupted" in result.stderr   # Ctrl-C still gives the summary of what came
    record = json.loads(stats.read_text())
    assert result.stdout == record["text"] and record["finish"] == "interrupted" and len(record["token_ids"]) >= 3


# name -> (arguments with {tmp} and {target} filled in, exit code, a phrase the one error line says)
BAD = {
    "missing prompt file": ("complete {tmp}/none.txt --target {target}", 2, "cannot read the prompt"),
    "empty prompt": ("complete {tmp}/empty.txt --target {target}", 2, "the prompt is empty"),
    "unknown method": ("complete {tmp}/p.txt --target {target} --method warp", 2, "unknown method 'warp'"),
    "unknown preset": ("complete {tmp}/p.txt --preset nope", 2, "unknown preset 'nope'"),
    "malformed preset": ("complete {tmp}/p.txt --preset {tmp}/bad.yaml", 2, "malformed YAML"),
    "unknown preset key": ("complete {tmp}/p.txt --preset {tmp}/typo.yaml", 2, "sampling.temprature"),
    "bad target folder": ("complete {tmp}/p.txt --target {tmp}/nowhere", 2, "no such folder"),
    "prompt too long": ("complete {tmp}/long.txt --target {target}", 1, "context holds 512"),
    "negative temperature": ("complete {tmp}/p.txt --target {target} --temp -1", 2, "temperature must be a number >= 0"),
    "two quantizations": ("complete {tmp}/p.txt --target {target} --load-in-8bit --load-in-4bit", 2,
                          "choose one"),
    "json folder missing": ("complete {tmp}/p.txt --target {target} --stats-json {tmp}/no/s.json", 2,
                            "does not exist"),
    "preset show unknown": ("presets show nope", 2, "unknown preset"),
    "not an integer": ("complete {tmp}/p.txt --target {target} --top-k many", 2, "--top-k"),
    "unknown option": ("complete {tmp}/p.txt --bogus", 2, "No such option"),
    "unknown command": ("completer", 2, "No such command"),
}


def bad_files(tmp: Path) -> None:
    (tmp / "p.txt").write_text(PROMPT)
    (tmp / "empty.txt").write_text("")
    (tmp / "bad.yaml").write_text("method: [ar\n")
    (tmp / "typo.yaml").write_text("method: ar\nsampling: {temprature: 1}\n")
    (tmp / "long.txt").write_text(" ".join(f"x{i}" for i in range(600)))


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_input_fails_in_one_line(case, tiny_model_dir, tmp_path):
    bad_files(tmp_path)
    template, code, phrase = BAD[case]
    result = invoke(*template.format(tmp=tmp_path, target=tiny_model_dir).split())
    assert result.exit_code == code, result.output
    assert result.stderr.startswith("treegen: error: ") and result.stderr.count("\n") == 1, result.stderr
    assert phrase in result.stderr and "Traceback" not in result.output
    assert result.stdout == ""


def test_missing_demo_target_is_one_line(prompt_file, monkeypatch, tmp_path):
    import treegen.assets

    monkeypatch.setattr(treegen.assets, "DEMO_TARGET", tmp_path / "no-demo")
    result = invoke("complete", prompt_file)
    assert result.exit_code == 1 and "demo target is not installed" in result.stderr
    assert result.stderr.count("\n") == 1


def test_no_prompt_on_a_terminal_is_a_usage_error(monkeypatch, tiny_model_dir):
    monkeypatch.setattr("treegen.cli.stdin_is_terminal", lambda: True)
    result = invoke("complete", "--target", tiny_model_dir)
    assert result.exit_code == 2 and result.stderr.count("\n") == 1 and "give a prompt" in result.stderr


def test_debug_shows_the_traceback(prompt_file, tmp_path):
    (tmp_path / "nowhere").mkdir()
    (tmp_path / "nowhere" / "config.json").write_text("{}")   # a folder transformers cannot load
    result = invoke("complete", prompt_file, "--target", tmp_path / "nowhere", "--debug")
    assert result.exit_code == 1 and "Traceback" in result.stderr
    assert result.stderr.rstrip().splitlines()[-1].startswith("treegen: error: ")


def test_presets_list_and_show():
    listed = invoke("presets")
    assert listed.exit_code == 0 and "pld" in listed.stdout and "prompt lookup" in listed.stdout
    assert invoke("presets", "list").stdout == listed.stdout
    shown = invoke("presets", "show", "pld")
    assert shown.exit_code == 0 and "method: pld" in shown.stdout and "max_new_tokens:" in shown.stdout


def test_version_and_info():
    from treegen import __version__

    assert __version__ in invoke("--version").stdout
    info = invoke("info")
    assert info.exit_code == 0 and "transformers" in info.stdout and "demo target" in info.stdout
    assert "default " in info.stdout and " pair)" in info.stdout   # what chat and complete run by default
    assert "drafter auto " in info.stdout   # what a drafter's `dtype: auto` drafts in here


def test_chat_through_the_cli(tiny_model_dir):
    result = invoke("chat", "--target", tiny_model_dir, "-n", 4, "--system", "Be brief.",
                    input="hello\n/stats\n")
    assert result.exit_code == 0, result.output
    assert "no chat template" in result.stderr and "conversation: 2 messages (1 reply)" in result.stderr
