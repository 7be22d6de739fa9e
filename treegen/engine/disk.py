"""Measurements of this machine kept on disk between runs: one JSON table per kind, in the cache folder
($TREEGEN_CACHE, $XDG_CACHE_HOME/treegen or ~/.cache/treegen). Delete a file to measure again."""
from __future__ import annotations

import json
import os
from pathlib import Path


def cache_root() -> Path:
    root = os.environ.get("TREEGEN_CACHE") or Path(os.environ.get("XDG_CACHE_HOME") or "~/.cache") / "treegen"
    return Path(root).expanduser()


def read_table(path: Path) -> dict:
    """The table, or {} when missing or unreadable (it is measured again then)."""
    try:
        table = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return table if isinstance(table, dict) else {}


def write_entry(path: Path, key: str, value) -> None:
    """table[key] = value, written atomically: two processes measuring at once never leave a half file."""
    table = read_table(path)
    table[key] = value
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(table, indent=1))
        tmp.replace(path)
    except OSError:
        pass  # a read-only cache only costs a measurement next time
