"""The seconds that round-to-round choices read (`budget: auto`'s tree size and rests, `lookup: true`'s way).

Greedy: the clock measured now (a choice changes the speed, never the tokens). Sampling: a tree's shape
decides which random numbers are drawn and what they are compared with, so a choice that read this run's
clock would give the same seed other tokens on the next run. There the choices read this machine's
calibration instead: per kind of time, its mean over a sampled generation of the same target, method and
setting, kept on disk (round-times.json). Without one, the Generator first runs a short sampled generation of
its own to measure it (api.Generator._clock); kept if the machine was quiet, from then on, the first run
included, a seed fixes the tokens.
"""
from __future__ import annotations

from collections import defaultdict
from pathlib import Path

from .disk import LoadWatch, cache_root, keep_if_quiet, read_table

MIN_SAMPLES = 3   # a kind measured fewer times is not kept (a choice that reads it falls back, below)


def calibration_file() -> Path:
    return cache_root() / "round-times.json"


class Clock:
    """clock(kind, measured seconds) -> the seconds a choice reads: `measured`, or the calibrated mean of
    `kind` (fixed). Every reading is also summed, for calibrate()."""

    def __init__(self, key: str | None = None, sampling: bool = False):
        self.key = key   # the target, method and setting this calibration belongs to (None: never kept)
        self.means: dict[str, float] | None = None
        if sampling and key is not None:
            entry = read_table(calibration_file()).get(key)
            if isinstance(entry, dict) and entry and all(isinstance(v, float) for v in entry.values()):
                self.means = entry
        self.sampling = sampling
        self.sums: dict[str, float] = defaultdict(float)
        self.counts: dict[str, int] = defaultdict(int)

    @property
    def fixed(self) -> bool:
        """Choices read the calibration, not this run's clock."""
        return self.means is not None

    def __call__(self, kind: str, measured: float, default: float | None = None) -> float:
        self.sums[kind] += measured
        self.counts[kind] += 1
        return self.value(kind, default) if self.fixed else measured

    def value(self, kind: str, default: float | None = None) -> float:
        """The calibrated seconds of `kind`; a kind the calibration never saw reads as `default` (a caller's
        estimate from fixed data), else the mean of the kinds it did: the same on every run."""
        assert self.means is not None
        if kind in self.means:
            return self.means[kind]
        return default if default is not None else sum(self.means.values()) / len(self.means)

    def calibrate(self, watch: LoadWatch) -> None:
        """After a sampled generation measured on this clock: keep its means (if the machine was quiet) and
        read them from now on, as the next run will."""
        if not self.sampling or self.fixed or self.key is None:
            return
        means = {k: self.sums[k] / n for k, n in self.counts.items() if n >= MIN_SAMPLES}
        if means:
            keep_if_quiet(watch, calibration_file(), self.key, means, "round times")
            if not watch.busy:
                self.means = means
