"""The example sessions in README.md and docs/*.md, run for real so they cannot go stale.

    python -m treegen.bench.examples            run every example and write its output into the document
    python -m treegen.bench.examples --check    run them and exit 1 naming each that differs (tests/test_examples.py)

An example is an indented block between markers; its first line is the shell command, the rest its output
(stdout and stderr as a terminal shows them):

    <!-- example cpu=AVX2 -->        or <!-- example needs=smollm2 cpu=AVX2 --> (skipped without SmolLM2)
        $ printf 'def add(a, b):\\n/exit\\n' | treegen chat --target demo -n 24 --method dflash
        ...
    <!-- /example -->

Timings differ from run to run: on a line that speaks of time, numbers are compared as numbers, not values.
`cpu` names the kind of CPU the output was written on (its vector instructions, and native bf16): `--dtype
auto` loads other weights on another kind, and its kernels sum in another order, so a model's text is the
same run after run on one kind, not across kinds. On another kind an example must run and print, not the
same text; `cpu=any` marks an output no model computes (a listing, a usage error), the same text everywhere.
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = re.compile(r"<!-- example(?: needs=(\w+))?(?: cpu=([\w+]+))? -->\n(.*?)(<!-- /example -->)", re.DOTALL)
INDENT = "    "
TIMED = re.compile(r"time|tok/s|tokens per second")
NUMBER = re.compile(r"\d+(?:\.\d+)?")


@dataclass(frozen=True)
class Example:
    document: Path
    command: str
    output: str
    needs: str | None
    cpu: str | None = None   # the kind of CPU that wrote the output


ANY = "any"   # an example's output that does not depend on the CPU (a listing, a usage error): exact everywhere


def cpu_kind() -> str:
    """This CPU's kind as examples record it: torch's vector capability, and +bf16 with native bf16."""
    import torch

    from ..loading import native_bf16

    return torch.backends.cpu.get_cpu_capability() + ("+bf16" if native_bf16() else "")


def marker(needs: str | None, cpu: str) -> str:
    return "<!-- example" + (f" needs={needs}" if needs else "") + f" cpu={cpu} -->\n"


def parse(block: str) -> tuple[str, str]:
    lines = [line.removeprefix(INDENT) for line in block.rstrip("\n").splitlines()]
    if not lines or not lines[0].startswith("$ "):
        raise ValueError(f"an example starts with '$ COMMAND', not {lines[:1]!r}")
    return lines[0][2:], "\n".join(lines[1:])


def examples(root: Path = ROOT) -> list[Example]:
    out = []
    for path in [root / "README.md", *sorted((root / "docs").glob("*.md"))]:
        for m in EXAMPLE.finditer(path.read_text(encoding="utf-8")):
            command, output = parse(m.group(3))
            out.append(Example(path, command, output, m.group(1), m.group(2)))
    return out


def available(needs: str | None) -> bool:
    if needs is None:
        return True
    if needs == "smollm2":
        from ..assets import smollm2_gguf

        return smollm2_gguf() is not None
    return False


def run(command: str, timeout: float = 600) -> str:
    """The command in a scratch folder, stdout and stderr merged in the order written, 120 columns."""
    env = {key: value for key, value in os.environ.items() if key != "TREEGEN_PAIR"}   # as a user runs it
    env.update({"PYTHONUNBUFFERED": "1", "COLUMNS": "120", "NO_COLOR": "1", "TERM": "dumb"})
    with tempfile.TemporaryDirectory() as scratch:
        done = subprocess.run(["bash", "-c", command], check=False, cwd=scratch, env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True, timeout=timeout)
    return "\n".join(line.rstrip() for line in done.stdout.rstrip("\n").splitlines()
                     if not line.startswith(MACHINE_NOTICES))


# notices about the machine the example ran on (other processes' load, a first run's measuring), not the example
MACHINE_NOTICES = ("treegen: other processes are using", "treegen: other processes used", "treegen: measuring",
                   "treegen: converting")


def normal(text: str) -> str:
    """Timing lines with their numbers masked and their padding (it follows the numbers' widths) collapsed;
    trailing space dropped."""
    return "\n".join(" ".join(NUMBER.sub("N", line).split()) if TIMED.search(line) else line.rstrip()
                     for line in text.splitlines())


def same(documented: str, actual: str) -> bool:
    return normal(documented) == normal(actual)


def matches(example: Example, actual: str) -> bool:
    """The same output on the kind of CPU that wrote it (`cpu=any`: on every kind, an output no model's
    arithmetic writes); on another, some output and no traceback."""
    if example.cpu in (cpu_kind(), ANY):
        return same(example.output, actual)
    return bool(actual.strip()) and "Traceback" not in actual


def block(command: str, output: str) -> str:
    lines = [f"$ {command}", *output.splitlines()]
    return "".join((INDENT + line if line else "") + "\n" for line in lines)


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    check, failed = "--check" in args, []
    for path in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        text = path.read_text(encoding="utf-8")

        def refresh(m: re.Match, name: str = path.name, document: Path = path) -> str:
            command, output = parse(m.group(3))
            example = Example(document, command, output, m.group(1), m.group(2))
            if not available(example.needs):
                print(f"skipped (needs {example.needs}): {command}", file=sys.stderr)
                return m.group(0)
            actual = run(command)
            if not matches(example, actual):
                failed.append(f"{name}: {command}")
            kind = ANY if example.cpu == ANY else cpu_kind()
            return marker(example.needs, kind) + block(command, actual) + m.group(4)

        new = EXAMPLE.sub(refresh, text)
        if not check and new != text:
            path.write_text(new, encoding="utf-8")
            print(f"wrote {path.relative_to(ROOT)}")
    for line in failed:
        print(f"{'stale' if check else 'updated'}: {line}", file=sys.stderr)
    return 1 if check and failed else 0


if __name__ == "__main__":
    sys.exit(main())
