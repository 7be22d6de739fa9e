"""docs/cli.md is made from the commands' --help; it must match what they say now."""
from treegen.cli_docs import DOC, render


def test_cli_md_is_current():
    assert DOC.exists() and DOC.read_text(encoding="utf-8") == render(), \
        "docs/cli.md is out of date: run `python -m treegen.cli_docs`"
