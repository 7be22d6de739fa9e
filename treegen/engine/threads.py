"""How many threads a CPU run uses. OpenMP's threads wait for each other at every op; on a machine where other
work holds cores, a thread that waits for a busy core stalls the rest (tens of times slower, not a little).
The thread count is not changed behind the user's back (a row's bits may depend on it, and the same command
must give the same tokens every run): a run on a busy machine says so and names --threads."""
from __future__ import annotations

import os

from . import disk


def free_cores() -> tuple[int, int]:
    """(cores other processes leave free now, at least one; cores this process may use)."""
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cores = os.cpu_count() or 1
    busy = disk.busy_cores()
    if busy <= disk.BUSY_SHARE * cores:   # a passing blip, not a held core
        return cores, cores
    return max(1, min(cores, round(cores - busy))), cores


def choose(requested: int | None, device_type: str = "cpu") -> str | None:
    """Set torch's thread count for a CPU run (--threads); a line to show when other processes hold cores
    this run's threads would wait for."""
    import torch

    if requested:
        torch.set_num_threads(requested)
        return None
    if device_type != "cpu":
        return None
    free, cores = free_cores()
    if free < torch.get_num_threads():
        return (f"other processes are using {cores - free} of {cores} cores: with {torch.get_num_threads()} "
                f"threads this run may be many times slower; --threads {free} avoids the wait")
    return None
