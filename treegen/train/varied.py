"""Varied training prompts for the demo pair: code, prose and chat-like text that no benchmark set uses.

    python -m treegen.train.varied --out /work/train/varied [--regenerate 3072]

The shipped demo drafter first learned the target's continuations of stdlib prompts only, and its
acceptance fell by a third on other code. These texts widen what it sees, never touching what the bench
measures on: code from installed packages outside `bench.prompts.THIRDPARTY_PACKAGES` (and not treegen),
prose from the Python reference's topics (`pydoc_data.topics`, too large for either stdlib split) and the
.md/.rst/.txt files those packages ship (never a package description: the `prose` set reads those), and
chat-like turns built from their docstrings. --regenerate continues random 64-token windows of each kind
with the demo target itself (half greedy, half at T=1) into one token stream for `treegen train`.
"""
from __future__ import annotations

import argparse
import ast
import hashlib
import json
import site
import sys
from pathlib import Path

from ..exit import end
from .common import leave, runtime_from, runtime_options

KINDS = ("code", "prose", "chat")
SHARE = {"code": 0.5, "prose": 0.25, "chat": 0.25}   # of the regenerated rows
MAX_CHARS_PER_PACKAGE = 1_500_000                      # so that torch and transformers do not drown the rest
MAX_FILE_BYTES = 200_000
PROMPT_LEN, GEN_LEN = 64, 192                          # the demo drafter's recipe
SKIPPED = {"treegen", "__pycache__"}


def excluded() -> set[str]:
    from ..bench.prompts import THIRDPARTY_PACKAGES

    return set(THIRDPARTY_PACKAGES) | SKIPPED


def packages(root: Path | None = None) -> list[Path]:
    """Top-level package folders of site-packages that the benchmark sets never read, sorted."""
    root = root or Path(site.getsitepackages()[0])
    skip = excluded()
    return sorted(p for p in root.iterdir() if p.is_dir() and p.name not in skip and "." not in p.name
                  and not p.name.startswith("_distutils"))


def _stable(path: Path) -> str:
    return hashlib.sha1(path.as_posix().encode()).hexdigest()


def capped(files: list[Path], root: Path) -> list[str]:
    """Texts of a package's files in a stable pseudo-random order (by path) until its character cap."""
    texts, total = [], 0
    for f in sorted(files, key=lambda p: _stable(p.relative_to(root))):
        if f.stat().st_size > MAX_FILE_BYTES:
            continue
        try:
            text = f.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        texts.append(text)
        total += len(text)
        if total >= MAX_CHARS_PER_PACKAGE:
            break
    return texts


def own_files(root: Path, suffixes: tuple[str, ...]) -> list[Path]:
    """A package's files, without the copies of other packages it vendors (pip and torch carry rich,
    pygments and packaging, which the bench measures on)."""
    return [p for p in root.rglob("*") if p.suffix in suffixes
            and not any("vendor" in part for part in p.relative_to(root).parts)]


def code_texts(roots: list[Path]) -> list[str]:
    return [t for root in roots for t in capped(own_files(root, (".py",)), root)]


def prose_texts(roots: list[Path]) -> list[str]:
    from pydoc_data.topics import topics

    texts = list(topics.values())
    for root in roots:
        docs = [p for p in own_files(root, (".md", ".rst", ".txt")) if "LICENSE" not in p.name.upper()]
        texts.extend(t for t in capped(docs, root) if len(t) > 400)
    return texts


def docstrings(text: str) -> list[tuple[str, str]]:
    """(name, docstring) of every documented function and class of a module's source."""
    try:
        tree = ast.parse(text)
    except (SyntaxError, ValueError):
        return []
    found = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and not node.name.startswith("_"):
            doc = ast.get_docstring(node)
            if doc and len(doc) > 80:
                found.append((node.name, doc))
    return found


QUESTIONS = ("What does `{name}` do?", "Can you explain `{name}`?", "How do I use {name}?",
             "I am reading some code that calls {name}. What is it for?", "Write a short note on `{name}`.")


def chat_texts(code: list[str]) -> list[str]:
    """Turns of a chat: a question about a documented name, its docstring as the answer."""
    turns = []
    for text in code:
        for name, doc in docstrings(text):
            question = QUESTIONS[int(_stable(Path(name)), 16) % len(QUESTIONS)].format(name=name)
            turns.append(f"User: {question}\nAssistant: {doc.strip()}\n")
    return turns


def build(root: Path | None = None) -> dict[str, list[str]]:
    roots = packages(root)
    code = code_texts(roots)
    return {"code": code, "prose": prose_texts(roots), "chat": chat_texts(code)}


def write(texts: dict[str, list[str]], out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    for kind, items in texts.items():
        with open(out / f"{kind}.jsonl", "w", encoding="utf-8") as f:
            f.writelines(json.dumps({"text": text}) + "\n" for text in items)


def regenerate_all(out: Path, rows: int, batch: int, log, rt) -> None:
    """One int32 stream of [rows, 256] windows: each kind's share, continued by the demo target (its batches
    shared among torchrun's ranks; the main rank writes)."""
    import torch

    from ..assets import DEMO_TARGET
    from ..loading import load_target
    from .data import read_stream, regenerate

    target, tok = load_target(str(DEMO_TARGET), dtype=rt.target_dtype, device=str(rt.device))
    parts = []
    for i, kind in enumerate(KINDS):
        part = out / f"regen-{kind}.pt"
        if not part.exists():  # each kind is saved when done, so a rerun resumes at the next one
            stream = read_stream([str(out / f"{kind}.jsonl")], tok)
            n = int(rows * SHARE[kind]) // batch * batch
            got = regenerate(target, stream, n, PROMPT_LEN, GEN_LEN, temperatures=(0.0, 1.0), batch=batch,
                             seed=100 + i, log=lambda m, k=kind: log(f"{k}: {m}"), rt=rt).flatten().to(torch.int32)
            if rt.main:
                torch.save(got, part)
            parts.append(got)
        else:
            parts.append(torch.load(part))
    if rt.main:
        torch.save(torch.cat(parts), out / "regen.pt")
    log(f"wrote {out / 'regen.pt'}: {sum(len(p) for p in parts)} tokens")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--regenerate", type=int, default=0, help="rows of target continuations to write")
    parser.add_argument("--batch", type=int, default=64)
    runtime_options(parser)
    args = parser.parse_args(argv)
    rt = runtime_from(args)

    @rt.log
    def log(msg):
        print(msg, file=sys.stderr, flush=True)

    if rt.main and not all((args.out / f"{k}.jsonl").exists() for k in KINDS):
        texts = build()
        write(texts, args.out)
        for kind, items in texts.items():
            log(f"{kind}: {len(items)} texts, {sum(map(len, items))} characters")
    rt.barrier()   # the texts are written before any rank reads them
    if args.regenerate:
        regenerate_all(args.out, args.regenerate, args.batch, log, rt)
    leave()
    return 0


if __name__ == "__main__":
    end(main())
