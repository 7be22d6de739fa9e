"""Was the machine quiet? Timings taken while other processes compete for the cores are not timings of the
methods (OpenMP threads spin-wait for a busy core: 10-50x slower, unevenly across methods).

Two signs, both cheap: the CPU time other processes used while a run was timed (from /proc/stat, the whole
machine's busy time, less this process's own CPU time), and a result that cannot be right (a method faster
than ar by more than its tokens per round allow: each round costs at least about one plain step).
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass

BUSY_CORES = 0.25        # other processes using more than a quarter of a core on average: a disturbed run
PLAUSIBLE_MARGIN = 1.5   # a speedup above 1.5x the tokens a round is a timing artefact, not the method


@dataclass(frozen=True)
class Sample:
    wall: float
    own_cpu: float            # this process's CPU seconds, every thread
    machine_busy: float | None  # busy CPU seconds of the whole machine since boot (None: no /proc/stat)


def machine_busy() -> float | None:
    """Seconds every core of the machine spent busy since boot (user, nice, system, irq, softirq, steal)."""
    try:
        with open("/proc/stat", encoding="ascii") as f:
            fields = f.readline().split()
    except OSError:
        return None
    if not fields or fields[0] != "cpu":
        return None
    ticks = [int(x) for x in fields[1:9]] + [0] * 8
    user, nice, system, _idle, _iowait, irq, softirq, steal = ticks[:8]
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


def sample() -> Sample:
    return Sample(time.perf_counter(), time.process_time(), machine_busy())


def other_cores(before: Sample, after: Sample) -> float | None:
    """How many cores other processes kept busy on average between two samples (None where unknown)."""
    wall = after.wall - before.wall
    if before.machine_busy is None or after.machine_busy is None or wall <= 0:
        return None
    others = (after.machine_busy - before.machine_busy) - (after.own_cpu - before.own_cpu)
    return max(0.0, others / wall)


def load_average() -> list[float] | None:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except (OSError, AttributeError):
        return None


def implausible(label: str, speedup: float, tokens_per_round: float | None) -> bool:
    """A speedup no method can reach with these tokens a round; plain generate() counts as one a round."""
    rate = tokens_per_round if tokens_per_round is not None else (1.0 if label == "hf-generate" else None)
    return rate is not None and speedup > PLAUSIBLE_MARGIN * max(rate, 1.0)


def warnings(results, load: dict) -> list[str]:
    """One line per sign that the timings were disturbed; empty on a quiet machine."""
    out = []
    busy = load.get("other_cores")
    if busy is not None and busy > BUSY_CORES:
        out.append(f"other processes kept {busy:.2f} of {load.get('cores')} cores busy during the bench: its "
                   f"tokens/s and speedups are not reliable (measure on a quiet machine)")
    if load.get("disturbed_runs"):
        out.append(f"{load['disturbed_runs']} of {load['runs']} runs were timed while other processes used "
                   f"more than {BUSY_CORES} of a core")
    for r in results:
        s = r.overall
        if implausible(r.label, s.speedup_vs_ar.median, s.mean_accepted_length):
            per_round = "" if s.mean_accepted_length is None else f" with {s.mean_accepted_length:.2f} tokens a round"
            out.append(f"{r.label} measured {s.speedup_vs_ar.median:.2f}x ar{per_round}: not possible on a "
                       f"quiet machine; the timings were disturbed")
    return out
