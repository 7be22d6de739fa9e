"""The demo corpus: Python standard-library sources of the running interpreter, split by file.

The split is a pure function of each file's path relative to the stdlib root, so every machine with
the same Python version gets the same split: a file is held out when sha1(relpath) % 20 == 0 (5%).
"""
from __future__ import annotations

import hashlib
import sysconfig
from pathlib import Path

HELDOUT_MODULUS = 20
MAX_FILE_BYTES = 400_000  # a few generated tables dwarf everything else; they teach nothing


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def is_heldout(relpath: str) -> bool:
    return int(hashlib.sha1(relpath.encode()).hexdigest(), 16) % HELDOUT_MODULUS == 0


def stdlib_files(split: str, root: Path | None = None) -> list[Path]:
    """Sorted .py files of one split ("train" or "heldout"); site-packages is not the stdlib."""
    if split not in ("train", "heldout"):
        raise ValueError(f"split must be 'train' or 'heldout', not {split!r}")
    root = root or stdlib_root()
    out = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        if rel.startswith(("site-packages/", "dist-packages/")) or path.stat().st_size > MAX_FILE_BYTES:
            continue
        if is_heldout(rel) == (split == "heldout"):
            out.append(path)
    return out


def read_texts(paths: list[Path]) -> list[str]:
    texts = []
    for path in paths:
        try:
            texts.append(path.read_text(encoding="utf-8"))
        except (UnicodeDecodeError, OSError):
            continue
    return texts
