"""The published bench JSON (docs/benchmarks/*.json) read back: which file is current for each pair, prompt set
and temperature, each row's source, and "= ar" re-checked from the runs' token digests where they have them.

A current table holds, for each label, the row of the newest file that ran it (newest by the file's `date`);
a row is a shipped method or preset or a peer (an ablation's own preset files go to their ablation page). A
file listed in pages.yaml's `not_current` (other settings than the pair's defaults: a dtype, a subset of
prompts) is shown only on its ablation page. New files need no registration: the next regeneration puts
their rows first.
"""
from __future__ import annotations

import fnmatch
import json
from dataclasses import dataclass
from pathlib import Path

MANIFEST = "pages.yaml"
PEER = "peer"


@dataclass(frozen=True)
class Bench:
    """One JSON file."""
    name: str            # the file name, e.g. packed-t0-thirdparty-code.json
    data: dict
    plot: str | None = None   # the PNG `--plot` wrote beside it, if any

    @property
    def date(self) -> str:
        return self.data.get("date", "")

    @property
    def key(self) -> tuple[str, str, float]:
        return pair_of(self.data.get("target", "")), prompt_set(self.data), float(self.data.get("temperature", 0))

    @property
    def methods(self) -> dict:
        return self.data.get("methods", {})

    def baseline(self, label: str) -> str:
        return self.methods[label].get("baseline", "ar")

    def identity(self, label: str) -> str:
        """yes / NO / n/a: from the token digests when the runs carry them (re-checked), else the bench's own."""
        if float(self.data.get("temperature", 0)) != 0:
            return "n/a"
        digests = digests_of(self.data.get("runs", []))
        if digests:
            base = self.baseline(label)
            ref = {p: d for (lab, p, r), d in digests.items() if lab == base and r == 0}
            wrong = {p for (lab, p, _), d in digests.items() if lab == label and ref.get(p) != d}
            return f"**NO** ({len(wrong)} prompts)" if wrong else "yes ✓"
        same = self.methods[label].get("identical_to_ar")
        return "n/a" if same is None else ("yes" if same else "**NO**")


def digests_of(runs: list[dict]) -> dict:
    """{(label, prompt, repeat): digest} for runs that carry one."""
    return {(r["label"], r["prompt"], r["repeat"]): r["tokens_sha256"] for r in runs if r.get("tokens_sha256")}


def pair_of(target: str) -> str:
    """demo, smollm2 or the target's own name."""
    if "smollm2" in target.lower():
        return "smollm2"
    path = Path(target)
    if path.name == "target" and path.parent.name == "demo":
        return "demo"
    return path.name or target


def prompt_set(data: dict) -> str:
    source = str(data.get("prompts_source", ""))
    return Path(source).stem if source.endswith((".jsonl", ".txt")) else source


def load_all(folder: Path) -> list[Bench]:
    """Every bench JSON in the folder (not train-*.json, the training logs), newest first."""
    out = []
    for path in sorted(folder.glob("*.json")):
        if path.name.startswith("train-"):
            continue
        data = json.loads(path.read_text(encoding="utf-8"))
        if isinstance(data, dict) and "methods" in data:
            png = path.with_suffix(".png")
            out.append(Bench(path.name, data, png.name if png.exists() else None))
    return sorted(out, key=lambda b: (b.date, b.name), reverse=True)


@dataclass(frozen=True)
class SideBySide:
    """One record of another engine beside treegen on the same GGUF (python -m treegen.bench.llamacpp): not a
    bench JSON; listed under pages.yaml's `side_by_side`, it gets its own table after its pair's tables."""
    name: str
    data: dict

    @property
    def pair(self) -> str:
        return pair_of(self.data.get("gguf", ""))


def load_side_by_side(folder: Path, patterns: list[str]) -> list[SideBySide]:
    """The files pages.yaml lists under `side_by_side`, newest first."""
    out = [SideBySide(path.name, json.loads(path.read_text(encoding="utf-8")))
           for path in sorted(folder.glob("*.json")) if matches(path.name, patterns)]
    return sorted(out, key=lambda s: (s.data.get("date", ""), s.name), reverse=True)


def other_json(folder: Path, benches: list[Bench]) -> set[str]:
    """JSON files of the folder that are neither bench JSON nor training logs (train-*.json)."""
    known = {b.name for b in benches}
    return {p.name for p in folder.glob("*.json") if p.name not in known and not p.name.startswith("train-")}


def manifest(folder: Path) -> dict:
    import yaml

    path = folder / MANIFEST
    return yaml.safe_load(path.read_text(encoding="utf-8")) if path.exists() else {}


def matches(name: str, patterns: list[str]) -> bool:
    return any(fnmatch.fnmatch(name, p) for p in patterns)


def shipped(bench: Bench, label: str) -> bool:
    """A peer, a method by its name, or a preset from the shipped presets folder."""
    m = bench.methods[label]
    if m.get("kind") == PEER:
        return True
    preset = m.get("preset")
    return (preset is None and label == m.get("method")) or (preset is not None and Path(preset).parent.name == "presets")


@dataclass(frozen=True)
class Row:
    label: str
    bench: Bench

    @property
    def m(self) -> dict:
        return self.bench.methods[self.label]


def current_tables(benches: list[Bench], not_current: list[str],
                   superseded: dict[str, list[str]] | None = None) -> dict[tuple, list[Row]]:
    """{(pair, set, T): rows}, each label's row from the newest file that ran it, in method order; `superseded`:
    {file pattern: labels whose rows there ran something other than what ships now (an older checkpoint)}."""
    tables: dict[tuple, dict[str, Row]] = {}
    for b in benches:                                   # newest first: the first row of a label wins
        if matches(b.name, not_current):
            continue
        rows = tables.setdefault(b.key, {})
        gone = {label for pattern, labels in (superseded or {}).items() if matches(b.name, [pattern]) for label in labels}
        for label in b.methods:
            if label not in rows and label not in gone and shipped(b, label):
                rows[label] = Row(label, b)
    return {k: sorted(v.values(), key=order) for k, v in sorted(tables.items(), key=lambda kv: table_order(kv[0]))}


FAMILIES = ("ar", "pld", "dflash", "ddtree", "treeflash", "domino", "dartree", "d2sd")
SETS = ("thirdparty-code", "prose", "stdlib-heldout", "chat", "code-chat")


def order(row: Row) -> tuple:
    """Baselines, then the methods from chain to tree, then the peers; presets after their method."""
    m = row.m
    if m.get("kind") == PEER:
        return (len(FAMILIES) + 1, row.label)
    method = m.get("method", "")
    family = FAMILIES.index(method) if method in FAMILIES else len(FAMILIES)
    return (family, 0 if row.label.removeprefix("smollm2-") == method else 1, row.label)


def table_order(key: tuple) -> tuple:
    pair, name, temperature = key
    return (pair != "demo", pair, SETS.index(name) if name in SETS else len(SETS), name, temperature)


def used_files(benches: list[Bench], tables: dict[tuple, list[Row]], pages: list[dict]) -> set[str]:
    """The files some page shows: a current table's rows, or an ablation page."""
    used = {row.bench.name for rows in tables.values() for row in rows}
    for page in pages:
        used |= {b.name for b in benches if matches(b.name, page.get("files", []))}
    return used


def lookup(benches: list[Bench], tables: dict, source: str, label: str) -> Row:
    """A row named by a doc: SOURCE is a file name, or a current table's key `pair/set/T` (the newest row)."""
    if source.endswith(".json"):
        bench = next((b for b in benches if b.name == source), None)
        if bench is None or label not in bench.methods:
            raise KeyError(f"{source}: no row {label!r}")
        return Row(label, bench)
    pair, name, temperature = source.split("/")
    rows = tables.get((pair, name, float(temperature.lstrip("T"))), [])
    row = next((r for r in rows if r.label == label), None)
    if row is None:
        raise KeyError(f"{source}: no current row {label!r}")
    return row


def field(row: Row, path: str, benches: list[Bench] | None = None):
    """A dotted field of a row (speedup_vs_ar.median, mean_accepted_length, ...), `vs:OTHER`: this row's
    tokens/s over OTHER's in the same file, or `share:PHASE`: the percent of its time split PHASE took."""
    if path.startswith("share:"):
        split = row.m["time_split_s"]
        return 100 * split[path[6:]] / sum(split.values())
    if path.startswith("vs:"):
        other = path[3:]
        if other not in row.bench.methods:
            raise KeyError(f"{row.bench.name}: no row {other!r} to compare {row.label} with")
        return row.m["tokens_per_second"] / row.bench.methods[other]["tokens_per_second"]
    value = row.m
    for part in path.split("."):
        value = value[part]
    return value
