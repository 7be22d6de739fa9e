"""Which standard-library files no shipped model was trained on: the stdlib-heldout prompt set is built from
them. The split is a pure function of a file's path relative to the stdlib root (held out when
sha1(relpath) % 20 == 0), the same rule the trainers use to leave these files out (train/corpus.py; a test
checks the two agree), kept here so that bench/ does not import train/.
"""
from __future__ import annotations

import hashlib
import sysconfig
from pathlib import Path

HELDOUT_MODULUS = 20
MAX_FILE_BYTES = 400_000  # generated tables: skipped by training, so skipped here too


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def is_heldout(relpath: str) -> bool:
    return int(hashlib.sha1(relpath.encode()).hexdigest(), 16) % HELDOUT_MODULUS == 0


def heldout_files(root: Path | None = None) -> list[Path]:
    """Sorted held-out .py files of the running interpreter's stdlib (site-packages is not the stdlib)."""
    root = root or stdlib_root()
    out = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        if rel.startswith(("site-packages/", "dist-packages/")) or path.stat().st_size > MAX_FILE_BYTES:
            continue
        if is_heldout(rel):
            out.append(path)
    return out
