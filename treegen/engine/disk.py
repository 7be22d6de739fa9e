"""Measurements of this machine kept on disk between runs: one JSON table per kind, in the cache folder
($TREEGEN_CACHE, $XDG_CACHE_HOME/treegen or ~/.cache/treegen). Delete a file to measure again.

A measurement is kept only if the machine was quiet while it ran (LoadWatch): on a busy machine OpenMP's
threads wait for cores other work holds, and a table written then would slow every later run."""
from __future__ import annotations

import json
import os
import sys
import time
from contextlib import contextmanager
from pathlib import Path

# other processes' share of the machine above which a measurement is not kept
BUSY_SHARE = float(os.environ.get("TREEGEN_BUSY_SHARE") or 0.15)
# the shortest window a share is taken over: /proc counts CPU time in ticks (10 ms), so one tick of another
# process inside a 1 ms measurement would read as most of the machine
MIN_WINDOW = 0.1


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


@contextmanager
def locked(path: Path):
    """An exclusive lock beside the table (fcntl; none where it does not exist): two processes writing the
    table at once each add their entry, neither loses the other's."""
    try:
        import fcntl
    except ImportError:
        yield
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_suffix(path.suffix + ".lock"), "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def write_entry(path: Path, key: str, value) -> None:
    """table[key] = value: read, changed and replaced atomically under the table's lock."""
    try:
        with locked(path):
            table = read_table(path)
            table[key] = value
            tmp = path.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_text(json.dumps(table, indent=1))
            tmp.replace(path)
    except OSError:
        pass  # a read-only cache only costs a measurement next time


def cpu_seconds() -> tuple[float, float] | None:
    """(every process's CPU seconds, this process's), from /proc; None where there is no /proc."""
    try:
        ticks = os.sysconf("SC_CLK_TCK")
        total = sum(int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:4])
        own = Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()
        return total / ticks, (int(own[11]) + int(own[12])) / ticks
    except (OSError, ValueError, IndexError):
        return None


def other_seconds(start: tuple[float, float] | None, end: tuple[float, float] | None) -> float:
    """CPU seconds other processes used between two cpu_seconds() readings (0 where either is missing)."""
    if start is None or end is None:
        return 0.0
    return max((end[0] - start[0]) - (end[1] - start[1]), 0.0)


class LoadWatch:
    """Other processes' share of the machine's CPU while a block runs (Linux /proc; 0 elsewhere)."""

    def __enter__(self):
        self.start, self.t0, self.share = cpu_seconds(), time.perf_counter(), 0.0
        return self

    def __exit__(self, *exc) -> None:
        wall = max(time.perf_counter() - self.t0, MIN_WINDOW)
        self.share = other_seconds(self.start, cpu_seconds()) / (wall * (os.cpu_count() or 1))

    @property
    def busy(self) -> bool:
        return self.share > BUSY_SHARE


def keep_if_quiet(watch: LoadWatch, path: Path, key: str, value, what: str) -> None:
    """Write the measurement unless the machine was busy while it ran; then say so, once per kind (not with
    --quiet: the CLI sets `silent`)."""
    if not watch.busy:
        write_entry(path, key, value)
        return
    if what not in _told and not silent:
        _told.add(what)
        notice(f"treegen: other processes used {watch.share:.0%} of the CPU while measuring {what}; "
               "this run uses it, but it is not kept (it is measured again next time)")


_told: set[str] = set()
silent = False   # the caller asked for no notices (treegen --quiet)
_held: list[str] | None = None   # inside held_notices(): notices wait for its end


def notice(text: str) -> None:
    """A line on stderr, or held until a streaming reply ends (held_notices) so it never splits the reply."""
    if _held is not None:
        _held.append(text)
    else:
        print(text, file=sys.stderr, flush=True)


@contextmanager
def held_notices():
    """The notices raised inside (a first run's measurements, a busy machine's) print after it, each on its
    own line: a reply streamed to the same terminal stays whole."""
    global _held
    outer, _held = _held, []
    try:
        yield
    finally:
        held, _held = _held, outer
        for text in held:
            notice(text)


def busy_cores(seconds: float = 0.2) -> float:
    """Cores other processes keep busy now (a short sample; 0 where there is no /proc)."""
    start = cpu_seconds()
    time.sleep(seconds)
    return other_seconds(start, cpu_seconds()) / seconds
