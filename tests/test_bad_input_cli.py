"""The bad-input battery: every flag and chat command with out-of-range, wrong-type, empty, huge and non-UTF-8
values. Each ends in ONE line on stderr, no traceback, the documented exit code (2 = usage, found before
anything loads; 1 = runtime), and a chat session survives with its history."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from treegen.cli import cli

PROMPT = "def add(a, b):\n    return a + b\n"


def invoke(*args, input=None):
    return CliRunner().invoke(cli, [str(a) for a in args], input=input)


@pytest.fixture
def no_load(monkeypatch):
    """Usage errors must be found before the model loads: loading fails the test."""
    def refuse(*a, **k):
        raise AssertionError("the model was loaded before the usage error was found")
    monkeypatch.setattr("treegen.cli_options.load_generator", refuse)


def files(tmp: Path) -> None:
    (tmp / "p.txt").write_text(PROMPT)
    (tmp / "empty.txt").write_text("")
    (tmp / "latin1.txt").write_bytes(b"def f(\xff\xfe")
    (tmp / "folder").mkdir()
    (tmp / "model").mkdir()
    (tmp / "model" / "config.json").write_text("{}")
    bomb = "a: &a [x,x,x,x,x,x,x,x,x]\n" + "".join(
        f"{n}: &{n} [*{p},*{p},*{p},*{p},*{p},*{p},*{p},*{p},*{p}]\n" for p, n in zip("abcdef", "bcdefg"))
    (tmp / "bomb.yaml").write_text(bomb + "method: ar\ndescription: *g\n")
    (tmp / "budget.yaml").write_text("method: ddtree\ndrafter: demo\nmethod_options: {budget: -4}\n")
    (tmp / "top_p.yaml").write_text("method: ar\nsampling: {top_p: 5}\n")
    (tmp / "huge.yaml").write_text("method: ar\ndescription: " + "x" * 100_000 + "\nsampling: {seed: " + "9" * 5000 + "}\n")
    (tmp / "typo.yaml").write_text("method: ar\nsampling: {temprature: 1}\n")
    (tmp / "drafter-typo.yaml").write_text("method: treeflash\ndrafter: demo/treeflsh\n")
    (tmp / "huge-budget.yaml").write_text("method: ddtree\ndrafter: demo\nmethod_options: {budget: 100000000}\n")


# (arguments, a phrase of the one error line); every one exits 2 before anything loads
USAGE = {
    "n negative": ("-n -5", "must be an integer in [0"),
    "n not a number": ("-n many", "must be an integer"),
    "n huge": ("-n 99999999999999999999999", "must be an integer in [0"),
    "temperature negative": ("--temperature -1", "must be a number >= 0"),
    "temperature inf": ("--temperature inf", "must be a number >= 0"),
    "temperature nan": ("--temperature nan", "must be a number >= 0"),
    "temperature empty": ("--temperature=", "must be a number"),
    "top-p zero": ("--top-p 0", "in (0, 1]"),
    "top-p five": ("--top-p 5", "in (0, 1]"),
    "min-p two": ("--min-p 2", "in [0, 1)"),
    "top-k negative": ("--top-k -1", "must be an integer >= 0"),
    "top-k words": ("--top-k many", "must be an integer"),
    "seed overflow": ("--seed 99999999999999999999", "2**64 - 1"),
    "seed -2": ("--seed -2", "-1 or an integer"),
    "unknown method": ("--method nosuch", "unknown method 'nosuch'"),
    "unknown dtype": ("--dtype int4", "int4"),
    "unknown device": ("--device tpu", "tpu"),
    "unknown preset": ("--preset nope", "unknown preset 'nope'"),
    "missing prompt file": ("{tmp}/none.txt", "none.txt"),
    "empty prompt file": ("{tmp}/empty.txt", "the prompt is empty"),
    "non-UTF-8 prompt file": ("{tmp}/latin1.txt", "not valid UTF-8"),
    "prompt is a folder": ("{tmp}/folder", "folder"),
    "stats-json a folder": ("--stats-json {tmp}/folder", "--stats-json"),
    "stats-json under a file": ("--stats-json {tmp}/p.txt/s.json", "--stats-json"),
    "stats-json empty": ("--stats-json=", "--stats-json needs a file path"),
    "target empty": ("--target=", "empty"),
    "prompt empty inline": ("--prompt=", "the prompt is empty"),
    "target mistyped folder": ("--target nosuchdir", "no such folder"),
    "target path missing": ("--target ./no/such/dir", "no such folder"),
    "drafter path missing": ("--method dflash --drafter ./no/such/dir", "no such folder"),
    "drafter needed": ("--target {tmp}/model --method ddtree", "needs a drafter"),
    "yaml alias bomb": ("--preset {tmp}/bomb.yaml", "alias"),
    "preset budget -4": ("--preset {tmp}/budget.yaml", "budget"),
    "preset top_p 5": ("--preset {tmp}/top_p.yaml", "top_p"),
    "preset huge values": ("--preset {tmp}/huge.yaml", "cannot be read"),
    "preset typo": ("--preset {tmp}/typo.yaml", "sampling.temprature"),
    "method option unknown": ("--method pld --method-option nosuch=1", "no option 'nosuch'"),
    "method option range": ("--method ddtree --method-option budget=-4", "budget"),
    "method option type": ("--method pld --method-option draft_len=long", "draft_len"),
    "method option no =": ("--method pld --method-option draft_len", "KEY=VALUE"),
    "threads zero": ("--threads 0", "--threads"),
    "device map": ("--device-map foo", "--device-map"),
    "inline and file prompt": ("-p hi {tmp}/p.txt", "not both"),
    # size-like options are bounded: a huge one is refused before it can take the machine's memory
    "treeflash budget huge": ("--method treeflash --method-option budget=100000000", "'budget' must be <= 2048"),
    "ddtree budget huge": ("--method ddtree --method-option budget=99999", "'budget' must be <= 2048"),
    "ddtree top_k huge": ("--method ddtree --method-option top_k=10000000", "'top_k' must be <= 2048"),
    "treeflash top_m huge": ("--method treeflash --method-option top_m=100000", "'top_m' must be <= 256"),
    "dartree width huge": ("--method dartree --method-option width=100000", "'width' must be <= 1024"),
    "d2sd k huge": ("--method d2sd --method-option k=100000", "'k' must be <= 64"),
    "d2sd b2 huge": ("--method d2sd --method-option b2=100000", "'b2' must be <= 64"),
    "d2sd budget huge": ("--method d2sd --method-option budget=100000", "'budget' must be <= 2048"),
    "pld draft_len huge": ("--method pld --method-option draft_len=100000000", "'draft_len' must be <= 256"),
    "pld ngrams crossed": ("--method pld --method-option min_ngram=5 --method-option max_ngram=2", "min_ngram"),
    "draws huge": ("--method dflash --method-option draws=100000", "'draws' must be <= 256"),
    "option inf": ("--method treeflash --method-option temperature=inf", "finite"),
    "preset budget huge": ("--preset {tmp}/huge-budget.yaml", "huge-budget.yaml: method_options:"),
    "threads huge": ("--threads 100000", "--threads"),
    # names: the near one suggested, the shipped ones listed, the key and file named
    "preset near name": ("--preset treflash", "unknown preset 'treflash' (did you mean treeflash?); `treegen presets`"),
    "method near name": ("--method treflash", "(did you mean treeflash?)"),
    "option near name": ("--method pld --method-option draft_lenn=3", "(did you mean draft_len?)"),
    "shipped drafter typo": ("--method treeflash --drafter demo/treeflsh",
                             "demo/treeflsh: the demo pair ships no drafter named 'treeflsh' (did you mean demo/treeflash?)"),
    "smollm2 drafter typo": ("--method dflash --drafter smollm2/nope", "it ships: smollm2/dflash"),
    "preset drafter typo": ("--preset {tmp}/drafter-typo.yaml", "drafter-typo.yaml: drafter: demo/treeflsh: the demo"),
    "gguf file missing": ("--target nosuch.gguf", "nosuch.gguf: no such .gguf file"),
    "drafter unused": ("--method ar --drafter demo/dflash", "method ar drafts without a drafter; drop --drafter"),
    "4bit and 8bit": ("--load-in-4bit --load-in-8bit", "--load-in-4bit and --load-in-8bit: choose one"),
}


def one_line(result, code: int, phrase: str) -> None:
    assert result.exit_code == code, (result.exit_code, result.output)
    assert "Traceback" not in result.output, result.output
    assert result.stderr.startswith("treegen: error: ") and result.stderr.count("\n") == 1, result.stderr
    assert len(result.stderr) < 400, result.stderr[:400]
    assert phrase in result.stderr, result.stderr


@pytest.mark.parametrize("case", sorted(USAGE))
def test_complete_usage_errors_exit_2_before_loading(case, tmp_path, no_load):
    files(tmp_path)
    args, phrase = USAGE[case]
    given = args.startswith(("{tmp}", "-p", "--prompt"))   # the row names its own prompt
    args = args.format(tmp=tmp_path).split() + ([] if given else [str(tmp_path / "p.txt")])
    result = invoke("complete", *args)
    one_line(result, 2, phrase)
    assert result.stdout == ""


@pytest.mark.parametrize("flag", ["-n -1", "--temperature -2", "--top-p 7", "--seed x", "--method nosuch", "-n 0",
                                  "--method-option budget=100000000"])
def test_chat_usage_errors_exit_2_before_loading(flag, no_load):
    result = invoke("chat", *flag.split(), input="hello\n")
    one_line(result, 2, flag.split()[-1].split("=")[0] if "=" in flag else flag.split()[0].lstrip("-")[:4])


@pytest.mark.parametrize("value, phrase", [("bogus", "$TREEGEN_PAIR='bogus': expected one of demo, smollm2"),
                                           (" Demo ", None)])
def test_treegen_pair_is_checked_before_loading(value, phrase, tmp_path, monkeypatch, no_load):
    files(tmp_path)
    monkeypatch.setenv("TREEGEN_PAIR", value)
    result = invoke("complete", tmp_path / "p.txt")
    if phrase:
        one_line(result, 2, phrase)
    else:   # a valid value reaches the load (refused here by no_load)
        assert result.exit_code == 1 and "the model was loaded" in result.stderr


def test_non_utf8_system_prompt(no_load):
    one_line(invoke("chat", "--system", "be \udcff brief"), 2, "--system is not valid UTF-8")   # as argv decodes \xff


def test_non_utf8_stdin(no_load):
    result = CliRunner().invoke(cli, ["complete"], input=b"def f(\xff\xfe")
    one_line(result, 2, "not valid UTF-8")


@pytest.mark.parametrize("preset", ["bomb.yaml", "budget.yaml", "top_p.yaml", "huge.yaml"])
def test_presets_show_refuses_what_complete_refuses(preset, tmp_path):
    files(tmp_path)
    one_line(invoke("presets", "show", tmp_path / preset), 2, "")


def test_bench_json_pointing_at_a_folder(tmp_path, monkeypatch):
    monkeypatch.setattr("treegen.bench.session.run_bench", lambda *a: pytest.fail("ran before checking"))
    one_line(invoke("bench", "--json", tmp_path), 2, "--json")
    one_line(invoke("bench", "--plot", tmp_path / "x" / "p.png"), 2, "--plot")


def test_bare_treegen_prints_plain_help():
    result = invoke()
    assert result.exit_code == 0 and result.stdout.startswith("Usage: treegen") and result.stderr == ""


def test_debug_does_not_advertise_debug(tmp_path, monkeypatch):
    from treegen import cli_options

    def boom(*a, **k):
        raise KeyError("deep inside")
    monkeypatch.setattr(cli_options, "load_generator", boom)
    files(tmp_path)
    plain = invoke("complete", tmp_path / "p.txt")
    assert plain.exit_code == 1 and "--debug shows the traceback" in plain.stderr
    debug = invoke("complete", tmp_path / "p.txt", "--debug")
    assert debug.exit_code == 1 and "Traceback" in debug.stderr and "--debug shows" not in debug.stderr


# ---- runtime cases on the tiny target -----------------------------------------------------------------------

def test_zero_new_tokens_is_empty_output(tiny_model_dir, tmp_path):
    files(tmp_path)
    result = invoke("complete", tmp_path / "p.txt", "--target", tiny_model_dir, "-n", 0, "--stats-json", "-")
    assert result.exit_code == 0, result.output
    record = json.loads(result.stdout)
    assert record["token_ids"] == [] and record["text"] == ""


def test_ar_reports_no_drafter(tmp_path):
    files(tmp_path)
    result = invoke("complete", tmp_path / "p.txt", "--method", "ar", "-n", 2, "--stats-json", "-")
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["drafter"] is None


def test_truncated_drafter_names_the_file(tmp_path):
    import shutil

    from treegen.assets import DEMO_DRAFTER

    files(tmp_path)
    bad = tmp_path / "drafter"
    shutil.copytree(DEMO_DRAFTER, bad)
    weights = bad / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])
    result = invoke("complete", tmp_path / "p.txt", "--method", "dflash", "--drafter", bad, "-n", 2)
    one_line(result, 1, "model.safetensors")
    assert "corrupt or truncated" in result.stderr


def test_mps_on_a_machine_without_it(tmp_path):
    import torch

    if torch.backends.mps.is_available():
        pytest.skip("this machine has MPS")
    files(tmp_path)
    one_line(invoke("complete", tmp_path / "p.txt", "--device", "mps"), 1, "no MPS device")


def test_seed_minus_one_means_random(tiny_model_dir, tmp_path):
    files(tmp_path)
    args = ("complete", tmp_path / "p.txt", "--target", tiny_model_dir, "-n", 8, "--temp", 1.5, "--seed", -1,
            "--method", "ar", "--stats-json", "-")
    texts = {tuple(json.loads(invoke(*args).stdout)["token_ids"]) for _ in range(3)}
    assert len(texts) > 1   # three random 8-token draws at T=1.5 over ~300 tokens never all agree


# ---- chat: the session survives and keeps its history ----------------------------------------------------

def chat(tiny_model_dir, lines: bytes | str, *flags):
    return CliRunner().invoke(cli, ["chat", "--target", str(tiny_model_dir), "-n", "3", "--method", "ar",
                                    *map(str, flags)], input=lines)


SET_NONSENSE = ["/set top_p 5", "/set n -3", "/set temperature -2", "/set temperature inf", "/set seed 1e99",
                "/set top_k x", "/set min_p 1", "/set nosuch 1", "/set n", "/set seed 99999999999999999999", "/set n 0"]


def test_chat_set_nonsense_is_refused_at_set(tiny_model_dir):
    lines = "hello\n" + "\n".join(SET_NONSENSE) + "\nagain\n/stats\n"
    result = chat(tiny_model_dir, lines)
    assert result.exit_code == 0, result.output
    assert "Traceback" not in result.output and "treegen: error" not in result.stderr
    refusals = [ln for ln in result.stderr.splitlines() if ln.startswith("/set")]
    assert len(refusals) == len(SET_NONSENSE), result.stderr
    assert "conversation: 4 messages (2 replies)" in result.stderr


def test_chat_zero_tokens_is_refused_and_carries_on(tiny_model_dir):
    result = chat(tiny_model_dir, "/set n 0\nhello\n/set n 2\nagain\n/stats\n")
    assert result.exit_code == 0, result.output
    assert "max_new_tokens must be >= 1 in a chat" in result.stderr and "max_new_tokens stays 3" in result.stderr
    assert "conversation: 4 messages (2 replies)" in result.stderr


def test_chat_rejects_a_non_utf8_line_and_continues(tiny_model_dir):
    result = chat(tiny_model_dir, b"hello\n\xff\xfe\nagain\n/stats\n")
    assert result.exit_code == 0, result.output
    assert "not valid UTF-8" in result.stderr and "conversation: 4 messages (2 replies)" in result.stderr


def test_chat_message_longer_than_the_context_is_refused_and_the_session_goes_on(tiny_model_dir):
    result = chat(tiny_model_dir, "hello\n" + "word " * 2000 + "\nagain\n/stats\n")
    assert result.exit_code == 0, result.output
    assert "context holds 512" in result.stderr and "conversation: 4 messages (2 replies)" in result.stderr


def test_chat_counts_after_clear(tiny_model_dir):
    result = chat(tiny_model_dir, "hello\n/clear\n/stats\nagain\n/stats\n")
    assert "conversation: 0 messages (0 replies)" in result.stderr
    assert "conversation: 2 messages (1 reply)" in result.stderr


# ---- one definition ------------------------------------------------------------------------------------------

def test_the_api_checks_with_the_same_definition():
    from treegen.api import Generator
    from treegen.validate import OptionError

    bare = object.__new__(Generator)   # config() checks before it looks at the model
    for bad in ({"top_p": 5}, {"max_new_tokens": -3}, {"temperature": float("inf")}, {"seed": 2**64}):
        with pytest.raises(OptionError, match=next(iter(bad))):
            bare.config(**bad)


def test_the_defaults_are_the_engines():
    from treegen.engine import generate, sampling
    from treegen.validate import SAMPLING

    assert SAMPLING["max_new_tokens"].default == generate.DEFAULT_MAX_NEW_TOKENS
    assert (SAMPLING["temperature"].default, SAMPLING["top_k"].default, SAMPLING["top_p"].default,
            SAMPLING["min_p"].default) == (sampling.DEFAULT_TEMPERATURE, sampling.DEFAULT_TOP_K,
                                           sampling.DEFAULT_TOP_P, sampling.DEFAULT_MIN_P)


def test_ctrl_c_before_a_reply_streams_keeps_the_session():
    from test_chat import FakeGenerator, run_repl

    gen = FakeGenerator()
    calls = []

    def interrupted_once(*a, **k):
        calls.append(1)
        if len(calls) == 1:
            raise KeyboardInterrupt
        return FakeGenerator.stream(gen, *a, **k)

    gen.stream = interrupted_once
    repl, _, err = run_repl("first\nsecond\n", gen=gen)
    assert "(interrupted; the conversation is unchanged)" in err
    assert [t["role"] for t in repl.conversation.turns] == ["user", "assistant"]
    assert repl.conversation.turns[0]["content"] == "second"
