"""The bench's outputs: the JSON record (the machine output) and the rich table (for people)."""
from __future__ import annotations

import hashlib
import json
import platform
from dataclasses import asdict
from datetime import datetime, timezone
from pathlib import Path

from .metrics import Result, Summary, by_category
from .prompts import Prompt
from .runner import Run, Settings

POSITIONS_SHOWN = 6     # acceptance by draft position in the table; the JSON has them all
SUMMARY_FIELDS = ("mean_accepted_length", "drafting_length", "drafting_share", "acceptance_per_position", "mean_tree_size", "tokens_per_second",
                  "speedup_vs_ar", "identical_to_ar", "time_split_s", "new_tokens", "wall_time_s", "prompts", "runs")


# ---- JSON ------------------------------------------------------------------------------------------------

def summary_dict(s: Summary) -> dict:
    d = asdict(s)
    return {k: d[k] for k in SUMMARY_FIELDS}


def result_dict(r: Result) -> dict:
    return {**r.info, **summary_dict(r.overall), "mismatches": [asdict(m) for m in r.overall.mismatches],
            "categories": {c: summary_dict(s) for c, s in r.categories.items()}}


def machine() -> dict:
    import torch

    cuda = torch.cuda.is_available()
    return {"platform": platform.platform(), "processor": platform.processor() or platform.machine(),
            "cpu": cpu_model(), "cpu_capability": torch.backends.cpu.get_cpu_capability(),   # e.g. AVX2, AVX512
            "python": platform.python_version(), "torch": torch.__version__,
            "transformers": transformers_version(), "device": torch.cuda.get_device_name(0) if cuda else "cpu",
            "threads": torch.get_num_threads()}


def cpu_model() -> str:
    """The CPU's model name and its matrix extensions (two runs' tokens/s compare only on one kind of CPU)."""
    try:
        info = Path("/proc/cpuinfo").read_text(encoding="utf-8", errors="replace")
    except OSError:
        return platform.processor() or platform.machine()
    name = next((line.split(":", 1)[1].strip() for line in info.splitlines() if line.startswith("model name")), "")
    flags = set(next((line.split(":", 1)[1].split() for line in info.splitlines() if line.startswith("flags")), []))
    extras = [f for f in ("avx512f", "amx_bf16") if f in flags]
    return " ".join([name or platform.machine(), *(f"+{f}" for f in extras)])


def transformers_version() -> str:
    import transformers

    return transformers.__version__


def token_digest(tokens: list[int]) -> str:
    """The generated ids as a short digest: two runs' outputs are equal exactly when their digests are (to a
    1 in 2^64 chance), so "= ar" can be re-checked from the JSON alone."""
    return hashlib.sha256(",".join(map(str, tokens)).encode("ascii")).hexdigest()[:16]


def run_dict(run: Run, prompts: list[Prompt]) -> dict:
    stats = run.output.stats
    return {"label": run.label, "prompt": prompts[run.prompt].id, "repeat": run.repeat,
            "new_tokens": stats.new_tokens, "wall_time_s": stats.wall_time,
            "tokens_per_second": stats.tokens_per_second, "tokens_sha256": token_digest(run.output.tokens),
            "other_cores": None if run.other_cores is None else round(run.other_cores, 3)}


def record(meta: dict, settings: Settings, prompts: list[Prompt], results: list[Result], runs: list[Run]) -> dict:
    """Everything a later reader needs: what ran where, the numbers per method and category, every run."""
    from .. import __version__

    return {"treegen_version": __version__, **meta,
            "date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "machine": machine(),
            "n": settings.max_new_tokens, "temperature": settings.temperature, "repeats": settings.repeats,
            "seed": settings.seed, "prompt_count": len(prompts),
            "categories": list(dict.fromkeys(p.category for p in prompts)),
            "methods": {r.label: result_dict(r) for r in results},
            "runs": [run_dict(run, prompts) for run in runs]}


def write_json(path: str, data: dict) -> None:
    Path(path).write_text(json.dumps(data, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")


# ---- the table -------------------------------------------------------------------------------------------

def fmt(value: float | None, spec: str = ".2f") -> str:
    return "" if value is None else format(value, spec)


def positions(rates: list[float] | None) -> str:
    if not rates:
        return ""
    shown = " ".join(f"{r:.2f}".lstrip("0") if r < 1 else "1" for r in rates[:POSITIONS_SHOWN])
    return shown + (" …" if len(rates) > POSITIONS_SHOWN else "")


def split(s: Summary) -> str:
    """draft / build / verify / other as percent of wall time: the drafter's neural passes, the tree build
    (best-first or merge, dedup, trim, mask), the target forwards (the prefill included), the rest."""
    t = s.time_split_s
    if not t or not s.wall_time_s:
        return ""
    parts = (t["draft"], t.get("build", 0.0), t["verify"] + t["prefill"], t["other"])
    return "/".join(f"{100 * p / s.wall_time_s:.0f}" for p in parts)


def identity(s: Summary) -> str:
    if s.identical_to_ar is None:
        return "[dim]n/a[/dim]"
    if s.identical_to_ar:
        return "[green]yes[/green]"
    prompts = len({m.prompt for m in s.mismatches})
    return f"[bold red]NO ({prompts} prompt{'s' * (prompts != 1)})[/bold red]"


def speed(s: Summary, single: bool = False) -> str:
    """The median ratio, and the range over repeats when there are several (one repeat has no range)."""
    x = s.speedup_vs_ar
    return f"{x.median:.2f}x" if single else f"{x.median:.2f}x ({x.min:.2f}-{x.max:.2f})"


def accepted(s: Summary) -> str:
    """Tokens a round; where more than 5% of rounds verified no draft (auto budgets rest when drafting would not pay),
    also the tokens a round that did, and their share: "1.54 (2.72 in 31%)"."""
    if s.drafting_share is None or s.drafting_share > 0.95 or not s.drafting_length:
        return fmt(s.mean_accepted_length)
    return f"{s.mean_accepted_length:.2f} ({s.drafting_length:.2f} in {s.drafting_share:.0%})"


def row(label: str, s: Summary, single: bool = False) -> list[str]:
    return [label, accepted(s), positions(s.acceptance_per_position), fmt(s.mean_tree_size, ".1f"),
            fmt(s.tokens_per_second, ".1f"), speed(s, single), split(s), identity(s)]


def table(results: list[Result], title: str, single: bool = False):
    from rich.table import Table

    t = Table(title=title, title_justify="left")
    for name, justify in (("prompts", "left"), ("method", "left"), ("accept len", "right"),
                          ("accept by position", "left"), ("tree", "right"), ("tok/s", "right"),
                          ("speedup vs ar" if single else "speedup vs ar (range)", "right"),
                          ("draft/build/verify/other %", "right"), ("= ar", "left")):
        t.add_column(name, justify=justify)
    for category, summaries in by_category(results).items():
        for i, (label, s) in enumerate(summaries.items()):
            t.add_row(f"{category} ({s.prompts})" if i == 0 else "", *row(label, s, single))
        t.add_section()
    return t


def mismatch_lines(results: list[Result]) -> list[str]:
    lines = []
    for r in results:
        if r.differs:
            m, count = r.overall.mismatches[0], len({x.prompt for x in r.overall.mismatches})
            line = (f"{r.label}: output differs from ar at T=0 on {count} prompt(s); first: prompt {m.prompt}, "
                    f"repeat {m.repeat}, token {m.first_difference}")
            lines.append(f"[yellow]{line} (transformers' kernels round differently: a near-tie can go the other "
                         "way)[/yellow]" if r.peer else f"[bold red]{line}[/bold red]")
    return lines


def show(results: list[Result], title: str, console, single: bool = False) -> None:
    """The table; `single`: one repeat, so the speedup column shows one value, not a range."""
    console.print(table(results, title, single))
    for line in mismatch_lines(results):
        console.print(line)
