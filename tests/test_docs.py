"""The docs state what the data says: every generated table and value in README.md and docs/*.md matches the
bench JSON in docs/benchmarks/, a changed JSON number makes the check fail, and "= ar" is re-checked from
the runs' token digests."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from treegen.bench import docs as D
from treegen.bench import pages as P

ROOT = Path(__file__).resolve().parents[1]


def test_the_docs_are_generated_from_the_current_json():
    problems = D.stale(D.Data(ROOT))
    assert not problems, "\n".join(problems) + "\nrun: python -m treegen.bench.docs"


@pytest.fixture
def copy(tmp_path):
    """README.md and docs/ (markdown and JSON) in a scratch root."""
    shutil.copy(ROOT / "README.md", tmp_path / "README.md")
    shutil.copytree(ROOT / "docs", tmp_path / "docs", ignore=shutil.ignore_patterns("*.png"))
    return tmp_path


def test_a_changed_json_number_makes_the_check_fail(copy):
    data = D.Data(copy)
    row = P.lookup(data.benches, data.tables, "demo/thirdparty-code/T0", "treeflash-lookup")
    path = copy / "docs" / "benchmarks" / row.bench.name
    record = json.loads(path.read_text())
    record["methods"]["treeflash-lookup"]["tokens_per_second"] *= 1.5
    path.write_text(json.dumps(record))
    problems = D.stale(D.Data(copy))
    assert "README.md is stale" in problems and "docs/benchmarks.md is stale" in problems
    assert D.main(["--root", str(copy)]) == 0 and D.stale(D.Data(copy)) == []   # regenerating fixes it


def test_a_superseded_json_and_a_stray_page_are_reported(copy):
    (copy / "docs" / "benchmarks" / "old.json").write_text(json.dumps(
        {"date": "2000-01-01", "target": "x/demo/target", "prompts_source": "prose", "temperature": 0.0,
         "methods": {"ar": {"method": "ar", "preset": None, "kind": "treegen"}}}))
    (copy / "docs" / "ablations" / "stray.md").write_text("# x\n")
    problems = D.stale(D.Data(copy))
    assert any("old.json: no page shows it" in p for p in problems)
    assert "docs/ablations/stray.md is no page of pages.yaml" in problems


def bench(runs: list[tuple[str, str, int, str]], temperature: float = 0.0) -> P.Bench:
    methods = {label: {"method": label, "baseline": "ar", "identical_to_ar": True} for label, *_ in runs}
    return P.Bench("x.json", {"temperature": temperature, "methods": methods,
                              "runs": [{"label": a, "prompt": b, "repeat": c, "tokens_sha256": d}
                                       for a, b, c, d in runs]})


def test_identity_is_rechecked_from_the_digests():
    same = bench([("ar", "p", 0, "aa"), ("ar", "q", 0, "bb"), ("pld", "p", 0, "aa"), ("pld", "q", 0, "bb")])
    assert same.identity("pld") == "yes ✓"
    wrong = bench([("ar", "p", 0, "aa"), ("ar", "q", 0, "bb"), ("pld", "p", 0, "aa"), ("pld", "q", 0, "bc")])
    assert wrong.identity("pld") == "**NO** (1 prompts)"      # the bench said identical; the tokens say not
    assert bench([("ar", "p", 0, "aa")], temperature=1.0).identity("ar") == "n/a"


def test_each_label_comes_from_the_newest_run_that_measured_it():
    def b(name, date, labels):
        return P.Bench(name, {"date": date, "target": "/x/demo/target", "prompts_source": "prose",
                              "temperature": 0.0, "methods": {l: {"method": l, "preset": None} for l in labels}})

    old, new = b("old.json", "2026-01-01", ["ar", "pld", "dflash"]), b("new.json", "2026-02-01", ["ar", "pld"])
    rows = P.current_tables([new, old], [])[("demo", "prose", 0.0)]
    assert [(r.label, r.bench.name) for r in rows] == [("ar", "new.json"), ("pld", "new.json"),
                                                       ("dflash", "old.json")]
    assert P.current_tables([new, old], ["new.json"])[("demo", "prose", 0.0)][0].bench.name == "old.json"
    assert [r.label for r in P.current_tables([new, old], [], {"new.json": ["pld"]})[("demo", "prose", 0.0)]] == \
        ["ar", "pld", "dflash"] and P.current_tables([new, old], [], {"*.json": ["pld"]})[("demo", "prose", 0.0)][1].label == "dflash"


def test_a_bad_marker_names_the_document():
    data = D.Data(ROOT)
    with pytest.raises(ValueError, match="x.md: .*no current row 'warp'"):
        D.fill("<!-- v demo/prose/T0 warp tokens_per_second -->1<!-- /v -->", data, "x.md")
    with pytest.raises(ValueError, match="unknown generated block 'nope'"):
        D.fill("<!-- begin nope -->\n<!-- end nope -->", data, "x.md")
