"""Property tests (hypothesis): whatever a user types as an option value, and whatever YAML a preset holds,
treegen answers with success or ONE short usage line, never a traceback."""
from __future__ import annotations

import tempfile
from pathlib import Path

import click
import pytest
import yaml
from click.testing import CliRunner
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from treegen.cli import cli
from treegen.validate import SAMPLING, OptionError

FLAGS = {"max_new_tokens": "--max-new-tokens", "temperature": "--temperature", "top_k": "--top-k",
         "top_p": "--top-p", "min_p": "--min-p", "seed": "--seed"}
SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])

typed = st.one_of(
    st.text(st.characters(blacklist_characters="\x00"), max_size=30),
    st.integers(min_value=-(2**70), max_value=2**70).map(str),
    st.floats(allow_nan=True, allow_infinity=True).map(repr),
    st.sampled_from(["", " ", "1e3", "0x10", "1_000", "-0", "+1", "١٢", "inf", "-inf", "nan", "1" * 5000]),
)


def stop_before_loading(*a, **k):
    raise click.exceptions.Exit(0)   # the value passed every check: that is all this test needs to know


def assert_one_line(result) -> None:
    assert "Traceback" not in result.output
    assert result.stderr.startswith("treegen: error: ") and result.stderr.count("\n") == 1, result.stderr[:500]
    assert len(result.stderr.encode()) < 400, result.stderr[:500]


@pytest.mark.parametrize("name", sorted(FLAGS))
@SETTINGS
@given(text=typed)
def test_any_typed_value_is_accepted_or_one_usage_line(name, text, monkeypatch):
    monkeypatch.setattr("treegen.cli_options.load_generator", stop_before_loading)
    result = CliRunner().invoke(cli, ["complete", "-p", "x", f"{FLAGS[name]}={text}"])
    try:
        SAMPLING[name].parse(text)
        valid = True
    except OptionError:
        valid = False
    assert result.exit_code == (0 if valid else 2), (text, result.output)   # the flag and the spec agree
    if not valid:
        assert_one_line(result)


scalars = st.one_of(st.none(), st.booleans(), st.integers(min_value=-(2**80), max_value=2**80),
                    st.floats(allow_nan=True), st.text(max_size=40), st.dates())
values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(
    st.text(max_size=12), inner, max_size=4), max_leaves=12)
keys = st.sampled_from(["description", "target", "drafter", "method", "method_options", "sampling", "other"])
sampling = st.dictionaries(st.sampled_from(list(SAMPLING) + ["n", "temp", "typo"]), scalars, max_size=4)
method_options = st.dictionaries(st.sampled_from(["budget", "top_k", "draft_len", "branches", "nope"]), scalars,
                                 max_size=3)
documents = st.fixed_dictionaries(
    {"method": st.sampled_from(["ar", "pld", "ddtree", "dflash", "nosuch"]) | scalars},
    optional={"sampling": sampling | values, "method_options": method_options | values, "description": scalars,
              "target": scalars, "drafter": scalars}) | st.dictionaries(keys, values, max_size=5)


def show(text: str):
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "p.yaml"
        path.write_text(text, encoding="utf-8")
        return CliRunner().invoke(cli, ["presets", "show", str(path)])


@SETTINGS
@given(doc=documents)
def test_any_preset_document_shows_or_fails_in_one_short_line(doc):
    result = show(yaml.safe_dump(doc, allow_unicode=True))
    assert result.exit_code in (0, 2), result.output
    if result.exit_code:
        assert_one_line(result)


@SETTINGS
@given(text=st.text(max_size=200) | st.builds(lambda a, b: f"x: &{a} [1]\ny: *{a}\nmethod: ar\n{b}",
                                                 st.from_regex(r"[a-z]{1,8}", fullmatch=True), st.text(max_size=20)))
def test_any_preset_text_shows_or_fails_in_one_short_line(text):
    result = show(text)
    assert result.exit_code in (0, 2), result.output
    if result.exit_code:
        assert_one_line(result)
