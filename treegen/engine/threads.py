"""How many threads a CPU run uses. OpenMP's threads wait for each other at every op; on a machine where other
work holds cores, a thread that waits for a busy core stalls the rest (tens of times slower, not a little).
So without --threads a run takes only the cores nobody else is using, and says so when that is fewer."""
from __future__ import annotations

import os

from .disk import busy_cores


def free_cores() -> tuple[int, int]:
    """(threads to use, cores on the machine): the cores other processes leave free now, at least one."""
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cores = os.cpu_count() or 1
    busy = busy_cores()
    return max(1, min(cores, round(cores - busy))), cores


def choose(requested: int | None, device_type: str = "cpu") -> str | None:
    """Set torch's thread count for a CPU run; a line to show when the machine's load chose fewer threads."""
    import torch

    if requested:
        torch.set_num_threads(requested)
        return None
    if device_type != "cpu" or os.environ.get("OMP_NUM_THREADS"):
        return None
    threads, cores = free_cores()
    if threads < torch.get_num_threads():
        torch.set_num_threads(threads)
        return (f"other processes are using {cores - threads} of {cores} cores: running on {threads} "
                f"thread{'s' if threads > 1 else ''} (--threads N to choose)")
    return None
