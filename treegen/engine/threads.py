"""How many threads a CPU run uses. OpenMP's threads wait for each other at every op; on a machine where other
work holds cores, a thread that waits for a busy core stalls the rest (tens of times slower, not a little).
A greedy generation, and a sampled one whose drafts are not drawn from a drafter model's laws (plain decoding,
prompt lookup, `sample: false`), takes only the free cores, and only thread counts with which this model's
logits were checked to be the same bits (the same command gives the same tokens every run, busy or not);
--threads fixes the count; a sampled run drawing drafts keeps it and says so on a busy machine."""
from __future__ import annotations

import os
import threading
import time
from collections import deque
from contextlib import contextmanager

from . import disk


def free_cores(seconds: float = 0.2, busy: float | None = None) -> tuple[int, int]:
    """(cores other processes leave free now, at least one; cores this process may use), from a sample of
    `seconds` (or the cores `busy` already measured)."""
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cores = os.cpu_count() or 1
    busy = disk.busy_cores(seconds) if busy is None else busy
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
        return (f"other processes are using {cores - free} of {cores} cores: greedy runs and plain decoding take "
                f"the free ones (the same tokens); a sampled run drawing drafts from a drafter keeps "
                f"{torch.get_num_threads()} threads and may be many times slower (--threads {free} avoids the wait)")
    return None


GENERATION_SAMPLE = 0.05   # seconds of /proc a generation's thread count reads (waited for where none is kept)


class LoadMonitor:
    """Other processes' CPU use, read from /proc in the background while no generation runs (a chat waiting for
    its user), so that the next generation finds a recent window of GENERATION_SAMPLE seconds instead of waiting
    one out. Paused while a generation runs: it never wakes among the generation's threads."""

    def __init__(self, period: float = GENERATION_SAMPLE):
        self.period = period
        self.readings: deque = deque(maxlen=4)   # (perf_counter, disk.cpu_seconds()) every period, newest last
        self.idle = threading.Event()
        self.thread: threading.Thread | None = None

    def busy_cores(self) -> float:
        """Cores other processes kept busy over the latest window of one to two periods; a blocking sample of a
        period where none is kept (the first generation, or one right after another)."""
        now_t, now = time.perf_counter(), disk.cpu_seconds()
        for t, reading in reversed(self.readings):
            if now_t - t >= self.period:
                return disk.other_seconds(reading, now) / (now_t - t)
        return disk.busy_cores(self.period)

    def pause(self) -> None:
        self.idle.clear()
        self.readings.clear()   # the next window starts after this generation: the load then, not during it

    def resume(self) -> None:
        if self.thread is None:
            self.thread = threading.Thread(target=self._sample, name="treegen-load", daemon=True)
            self.thread.start()
        self.idle.set()

    def _sample(self) -> None:
        while True:
            self.idle.wait()
            self.readings.append((time.perf_counter(), disk.cpu_seconds()))
            time.sleep(self.period)


def candidate_counts(cores: int) -> tuple[int, ...]:
    """The thread counts a busy machine may fall back to: one, half the cores, all of them."""
    return tuple(sorted({1, max(1, cores // 2), cores}))


class ThreadPlan:
    """The thread counts one run's generations may use where their tokens follow from the target's logits
    alone (greedy, or sampled without drafts drawn from a drafter model's laws). `allowed` holds only counts
    with which this model's logits were checked to be the same bits as with all of them (neutral_counts), so
    taking fewer threads when other work holds cores changes the speed, never the tokens. Sampled generations
    whose drafts are drawn keep the run's count: those laws come from the drafter, whose bits that check does
    not cover."""

    def __init__(self, allowed: tuple[int, ...] = ()):
        self.allowed = tuple(sorted(allowed))
        self.load = LoadMonitor()

    @contextmanager
    def fitting(self, covered: bool):
        """For one generation whose tokens the check covers (`covered`: greedy, or no drawn drafts): the most
        allowed threads that fit in the cores other processes leave free; else the run's count."""
        import torch

        before = torch.get_num_threads()
        fitting = [t for t in self.allowed if t <= before]
        if not covered or len(fitting) < 2:
            yield before
            return
        free, _ = free_cores(busy=self.load.busy_cores())
        self.load.pause()
        chosen = max([t for t in fitting if t <= free] or [min(fitting)])
        torch.set_num_threads(chosen)
        try:
            yield chosen
        finally:
            torch.set_num_threads(before)
            self.load.resume()


def neutral_counts(model, prompt_rows: int = 48, steps: int = 6, tree_rows: int = 16) -> tuple[int, ...]:
    """The candidate thread counts with which the engine's own forwards of this model (the prompt's prefill,
    one-row decoding steps and a tree verify) give the logits they give with all threads, bit for bit;
    checked once per model, dtype, thread count and host on random tokens, kept on disk. Only the full
    count where it cannot be checked (not a CPU run, a busy machine)."""
    import torch

    cores = torch.get_num_threads()
    if model.device.type != "cpu" or cores < 2:
        return (cores,)
    path, key = disk.cache_root() / "threads.json", neutral_key(model)
    saved = disk.read_table(path).get(key)
    if isinstance(saved, list) and all(isinstance(t, int) for t in saved) and cores in saved:
        return tuple(saved)
    from . import kernels

    kernels.build_all()   # a first run's compiler is not other work
    with disk.LoadWatch() as watch:
        reference = forward_logits(model, cores, prompt_rows, steps, tree_rows)
        counts = [cores] + [t for t in candidate_counts(cores) if t != cores and
                            all(torch.equal(a, b) for a, b in
                                zip(forward_logits(model, t, prompt_rows, steps, tree_rows), reference))]
    disk.keep_if_quiet(watch, path, key, sorted(counts), "the thread counts that keep the logits' bits")
    return tuple(sorted(counts))


def neutral_key(model) -> str:
    import torch

    from . import kernels
    from .matmul import machine

    name = getattr(model.config, "_name_or_path", "") or type(model).__name__
    return (f"{name}|{model.dtype}|threads={torch.get_num_threads()}|torch={torch.__version__}"
            f"|{torch.backends.cpu.get_cpu_capability()}|{machine()}|kernels={kernels.tag()}")


def forward_logits(model, threads: int, prompt_rows: int, steps: int, tree_rows: int) -> list:
    """With `threads` threads: the last prompt row's logits, each decoding step's and every tree row's."""
    import torch

    from .cache import new_cache
    from .target import TargetStep
    from .tree import DraftTree, verification_inputs

    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        gen = torch.Generator().manual_seed(0)
        vocab = model.config.vocab_size
        ids = torch.randint(vocab, (1, prompt_rows + steps), generator=gen)
        siblings = DraftTree(torch.randint(vocab, (tree_rows - 1,), generator=gen),
                             torch.arange(-1, tree_rows - 2) // 2)   # a binary tree: rows share parents
        step, cache, out = TargetStep(model), new_cache(model), []
        with torch.inference_mode():
            logits, _ = step.prefill(ids[:, :prompt_rows], torch.arange(prompt_rows)[None], cache)
            out.append(logits.row(0).clone())
            for i in range(prompt_rows, prompt_rows + steps):
                logits, _ = step(*verification_inputs(int(ids[0, i]), DraftTree.empty(), i, model.dtype), cache)
                out.append(logits.row(0).clone())
            logits, _ = step(*verification_inputs(int(ids[0, -1]), siblings, prompt_rows + steps, model.dtype),
                             cache)
            logits.project_all()
            out.extend(logits.row(r).clone() for r in range(tree_rows))
        return out
    finally:
        torch.set_num_threads(before)
