"""Benchmark prompts: a JSONL file, a text file of blank-line-separated prompts, or a built-in set by name.

JSONL: one object a line, {"prompt": "...", "id": "...", "category": "..."}; only "prompt" is required.
Built-in sets live in treegen/bench/prompts/NAME.jsonl; `python -m treegen.bench.prompts [NAME]` rebuilds
them (the files are committed, so runs need no corpus): stdlib-heldout from the held-out split of the demo
corpus; thirdparty-code and prose from installed packages that no shipped model trained on (their code, and
the prose of their package descriptions), so acceptance is measured off the training distribution too; chat
(math, writing, reasoning) and code-chat (write, explain, fix code) are hand-written requests to a chat model.
"""
from __future__ import annotations

import ast
import json
import re
import sys
from dataclasses import dataclass
from itertools import chain, zip_longest
from pathlib import Path

BUILTIN_DIR = Path(__file__).resolve().parent / "prompts"
DEFAULT_PROMPTS = "stdlib-heldout"
CHAT_SETS = ("chat", "code-chat")   # built-in sets written as requests to a chat model (bench --chat by default)
DEFAULT_CATEGORY = "default"
BLANK_LINES = re.compile(r"\n(?:[ \t]*\n)+")

# stdlib-heldout: how many prompts of each kind, and the sizes that suit the demo target (trained on
# 256-token windows: a prompt much longer leaves too little trained context for the continuation)
STDLIB_KINDS = {"function": 8, "class": 6, "module": 6}
MIN_CHARS, MAX_CHARS = 120, 900
MAX_IMPORT_LINES = 6
SKIPPED_DIRS = ("encodings/",)  # generated codec tables: one long literal each
BUILT_WITH_PYTHON = "3.11"       # the held-out split (and so the committed file) depends on the stdlib
# third-party packages: pure-Python code the demo pair never saw (it trained on the stdlib alone)
THIRDPARTY_PACKAGES = ("click", "rich", "yaml", "jinja2", "packaging", "networkx", "fsspec", "tqdm",
                       "huggingface_hub", "markdown_it", "pygments", "sympy", "mpmath", "hypothesis")
PROSE_COUNT, PROSE_CHARS = 14, (240, 700)


class PromptError(ValueError):
    """Prompts that cannot be read; one line naming the file (and line) and what is wrong."""


@dataclass(frozen=True)
class Prompt:
    id: str
    text: str
    category: str = DEFAULT_CATEGORY


def builtin_names() -> list[str]:
    return sorted(p.stem for p in BUILTIN_DIR.glob("*.jsonl"))


def load_prompts(source: str, limit: int | None = None) -> list[Prompt]:
    """A file (JSONL when it ends in .jsonl, blank-line-separated text otherwise) or a built-in set name."""
    path = Path(source).expanduser()
    if not path.is_file():
        if source not in builtin_names():
            raise PromptError(f"--prompts {source}: no such file, nor a built-in set "
                              f"(built-in: {', '.join(builtin_names())})")
        path = BUILTIN_DIR / f"{source}.jsonl"
    prompts = read_prompts(path)
    prompts = prompts[:limit] if limit is not None else prompts
    if not prompts:
        raise PromptError(f"{path}: no prompts in this file")
    return prompts


def read_prompts(path: Path) -> list[Prompt]:
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as err:
        raise PromptError(f"{path}: cannot read: {getattr(err, 'strerror', None) or err}") from err
    prompts = parse_jsonl(text, path) if path.suffix == ".jsonl" else parse_text(text)
    check_unique_ids(prompts, path)
    return prompts


def parse_text(text: str) -> list[Prompt]:
    """Prompts separated by one or more blank lines; each keeps its inner lines as written."""
    blocks = [b for b in BLANK_LINES.split(text.strip("\n")) if b.strip()]
    return [Prompt(str(i), block) for i, block in enumerate(blocks, 1)]


def parse_jsonl(text: str, path: Path) -> list[Prompt]:
    prompts = []
    for number, line in enumerate(text.splitlines(), 1):
        if line.strip():
            prompts.append(parse_record(line, f"{path}:{number}", str(number)))
    return prompts


def parse_record(line: str, where: str, default_id: str) -> Prompt:
    try:
        record = json.loads(line)
    except json.JSONDecodeError as err:
        raise PromptError(f"{where}: not valid JSON ({err.msg} at column {err.colno})") from err
    if not isinstance(record, dict):
        raise PromptError(f"{where}: expected an object with a \"prompt\" key, got {type(record).__name__}")
    prompt = record.get("prompt")
    if not isinstance(prompt, str) or not prompt:
        raise PromptError(f"{where}: \"prompt\" must be a non-empty string")
    for key in ("id", "category"):
        if key in record and not isinstance(record[key], (str, int)):
            raise PromptError(f"{where}: \"{key}\" must be a string")
    return Prompt(str(record.get("id", default_id)), prompt, str(record.get("category", DEFAULT_CATEGORY)))


def check_unique_ids(prompts: list[Prompt], path: Path) -> None:
    seen: set[str] = set()
    for p in prompts:
        if p.id in seen:
            raise PromptError(f"{path}: prompt id {p.id!r} appears twice")
        seen.add(p.id)


# ---- the stdlib-heldout set --------------------------------------------------------------------------------

def build_stdlib_heldout() -> list[Prompt]:
    """Deterministic prompts from held-out stdlib files, kinds interleaved (so --limit keeps a mix)."""
    from .stdlib_split import heldout_files, stdlib_root

    root = stdlib_root()
    per_file = [file_candidates(path, path.relative_to(root).as_posix()) for path in heldout_files(root)]
    chosen = [spread(first_per_file(per_file, kind), count) for kind, count in STDLIB_KINDS.items()]
    return [p for p in chain.from_iterable(zip_longest(*chosen)) if p is not None]


def file_candidates(path: Path, rel: str) -> list[Prompt]:
    """Every prompt one file offers: its head, and each documented top-level function and class."""
    if rel.startswith(SKIPPED_DIRS):
        return []
    try:
        source = path.read_text(encoding="utf-8")
        tree = ast.parse(source)
    except (OSError, UnicodeDecodeError, SyntaxError, ValueError):
        return []
    lines = source.splitlines()
    found = [module_head(tree, lines, rel)]
    context = import_context(tree, lines)
    for node in tree.body:
        found.append(documented_definition(node, lines, context, rel))
    return [p for p in found if p is not None and MIN_CHARS <= len(p.text) <= MAX_CHARS]


def module_head(tree: ast.Module, lines: list[str], rel: str) -> Prompt | None:
    """The file up to its leading imports (docstring included): the model goes on with the first code."""
    end = None
    for node in tree.body[1:] if ast.get_docstring(tree) is not None else tree.body:
        if not isinstance(node, (ast.Import, ast.ImportFrom)):
            break
        end = node.end_lineno
    if end is None:
        return None
    return Prompt(f"module:{rel}", "\n".join(lines[:end]) + "\n", "module")


def import_context(tree: ast.Module, lines: list[str]) -> str:
    """The file's top-level imports, as written: what a function's body may use."""
    imports = [n for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom))]
    text = [line for n in imports for line in lines[n.lineno - 1:n.end_lineno]][:MAX_IMPORT_LINES]
    return "\n".join(text) + "\n\n\n" if text else ""


def documented_definition(node: ast.stmt, lines: list[str], context: str, rel: str) -> Prompt | None:
    """A function's or class's header through its docstring, after the file's imports."""
    kinds = {ast.FunctionDef: "function", ast.AsyncFunctionDef: "function", ast.ClassDef: "class"}
    kind = kinds.get(type(node))
    if kind is None or ast.get_docstring(node) is None:
        return None
    start = min([node.lineno] + [d.lineno for d in node.decorator_list])
    text = context + "\n".join(lines[start - 1:node.body[0].end_lineno]) + "\n"
    return Prompt(f"{kind}:{rel}:{node.name}", text, kind)


def first_per_file(per_file: list[list[Prompt]], kind: str) -> list[Prompt]:
    """One prompt of this kind from each file that has one, so no single file dominates the set."""
    return [next(p for p in ps if p.category == kind) for ps in per_file if any(p.category == kind for p in ps)]


def spread(items: list[Prompt], count: int) -> list[Prompt]:
    """count items evenly spaced over the list (all of them when there are fewer)."""
    if len(items) <= count:
        return items
    return [items[i * len(items) // count] for i in range(count)]


# ---- sets off the training distribution ---------------------------------------------------------------------

def build_thirdparty_code() -> list[Prompt]:
    """Like stdlib-heldout, over the installed third-party packages' sources (one prompt per file at most)."""
    import importlib.util

    per_package = []
    for name in THIRDPARTY_PACKAGES:
        spec = importlib.util.find_spec(name)
        if spec is None or spec.origin is None:
            continue
        root = Path(spec.origin).parent
        per_package.append([file_candidates(f, f"{name}/{f.relative_to(root).as_posix()}")
                            for f in sorted(root.rglob("*.py")) if "test" not in f.relative_to(root).as_posix()])
    chosen = []
    for kind, count in STDLIB_KINDS.items():  # packages in turn, so no large package dominates
        options = [spread(first_per_file(files, kind), 2) for files in per_package]
        mixed = [p for p in chain.from_iterable(zip_longest(*options)) if p is not None]
        chosen.append(mixed[:count])
    return [p for p in chain.from_iterable(zip_longest(*chosen)) if p is not None]


def build_prose() -> list[Prompt]:
    """English prose: the first plain paragraph of each installed package's description (no code, lists,
    headings or markup), one per package, spread over the alphabet."""
    import importlib.metadata

    found = []
    for dist in sorted(importlib.metadata.distributions(), key=lambda d: d.metadata["Name"].lower()):
        text = dist.metadata.get_payload() or dist.metadata.get("Description") or ""
        para = next((p for p in BLANK_LINES.split(text) if is_prose(p)), None)
        if para is not None:
            found.append(Prompt(f"prose:{dist.metadata['Name'].lower()}", " ".join(para.split()), "prose"))
    return spread(found, PROSE_COUNT)


def is_prose(paragraph: str) -> bool:
    text = paragraph.strip()
    lo, hi = PROSE_CHARS
    if not lo <= len(text) <= hi or text[0] in "#`|-*>< [!=.:_+@0123456789" or not text.endswith("."):
        return False
    letters = sum(c.isalpha() or c.isspace() for c in text)
    return letters / len(text) > 0.9 and text.count("`") == 0 and not any(w in text for w in ("http", "::", "License"))


BUILDERS = {"stdlib-heldout": build_stdlib_heldout, "thirdparty-code": build_thirdparty_code,
            "prose": build_prose}


def write_jsonl(prompts: list[Prompt], path: Path) -> None:
    lines = [json.dumps({"id": p.id, "category": p.category, "prompt": p.text}, ensure_ascii=False)
             for p in prompts]
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")


def main(argv: list[str] | None = None) -> int:
    for name in (argv if argv is not None else sys.argv[1:]) or list(BUILDERS):
        out = BUILTIN_DIR / f"{name}.jsonl"
        prompts = BUILDERS[name]()
        write_jsonl(prompts, out)
        print(f"wrote {len(prompts)} prompts to {out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
