"""engine/clock.py: when sampling, round-to-round choices (`budget: auto`'s sizes and rests, `lookup: true`'s
ways) read this machine's calibration, not this run's clock, so a seed fixes the tokens however the rounds'
times come out; greedy runs read the clock (their tokens never depend on it)."""
from __future__ import annotations

import itertools
import random

import pytest

from treegen import Generator
from treegen.engine import clock as C
from treegen.engine.disk import LoadWatch


def noisy_clock(monkeypatch, seed: int) -> None:
    """time.perf_counter as a busy machine shows it: every reading late by a random 0-50 ms."""
    rng, now = random.Random(seed), itertools.count()

    def perf_counter() -> float:
        return next(now) * 1e-3 + rng.random() * 0.05
    import treegen.api
    import treegen.drafters.lookup
    import treegen.engine.generate

    for module in (treegen.engine.generate, treegen.drafters.lookup, treegen.api):
        monkeypatch.setattr(module.time, "perf_counter", perf_counter)


@pytest.mark.parametrize("preset", [("treeflash", "demo/treeflash", {"budget": "auto"}),
                                    ("ddtree", "demo/dflash", {"budget": "auto", "lookup": True})],
                         ids=["treeflash-auto", "ddtree-auto-lookup"])
def test_a_seed_fixes_the_tokens_whatever_the_clock_reads(preset, monkeypatch):
    method, drafter, options = preset
    prompt = "def fibonacci(n):\n    if n < 2:\n        return n\n"
    calibrating = Generator(target="demo", method=method, drafter=drafter, method_options=options)
    monkeypatch.setattr(LoadWatch, "busy", property(lambda self: False))
    calibrating.generate(prompt, max_new_tokens=96, temperature=0.8, seed=3)   # leaves the calibration
    outputs = []
    for run in range(3):
        with monkeypatch.context() as m:
            noisy_clock(m, run)
            g = Generator(target="demo", method=method, drafter=drafter, method_options=options)
            clock = g._clock(g.config(temperature=0.8).sampler)
            assert clock.fixed
            outputs.append(g.generate(prompt, max_new_tokens=48, temperature=0.8, seed=11).token_ids)
    assert outputs[0] == outputs[1] == outputs[2]


def test_the_first_sampled_run_calibrates_before_it_generates(monkeypatch):
    """Without a calibration on disk, a Generator measures one with a short sampled run of its own before the
    first sampled generation: that generation's tokens are already those every later run gives."""
    monkeypatch.setattr(LoadWatch, "busy", property(lambda self: False))
    prompt, options = "import os\n\ndef walk(path):\n", {"budget": "auto", "draws": 4}
    outputs = []
    for run in range(2):
        with monkeypatch.context() as m:
            noisy_clock(m, 10 + run)
            g = Generator(target="demo", method="ddtree", drafter="demo/dflash", method_options=options)
            outputs.append(g.generate(prompt, max_new_tokens=40, temperature=0.9, seed=5).token_ids)
            assert g._clock(g.config(temperature=0.9).sampler).fixed
    assert outputs[0] == outputs[1]


def test_greedy_reads_the_clock_and_keeps_nothing():
    clock = C.Clock("key", sampling=False)
    assert not clock.fixed and clock("draft", 0.25) == 0.25
    watch = LoadWatch()
    with watch:
        pass
    clock.calibrate(watch)
    assert not C.calibration_file().exists() or "key" not in C.read_table(C.calibration_file())


def test_a_calibration_is_kept_once_and_read_after(monkeypatch):
    monkeypatch.setattr(LoadWatch, "busy", property(lambda self: False))
    key = "test-calibration-key"
    clock = C.Clock(key, sampling=True)
    readings = [0.5] + [0.1, 0.3] * C.MIN_SAMPLES
    assert not clock.fixed and clock("draft", 0.5) == 0.5   # measured until calibrated
    for seconds in readings[1:]:
        clock("draft", seconds)
    clock("other", 1.0)                                     # too few readings to keep
    mean = sum(readings) / len(readings)
    watch = LoadWatch()
    with watch:
        pass
    clock.calibrate(watch)
    assert clock.fixed and clock("draft", 9.0) == pytest.approx(mean)
    assert clock.value("never-seen") == pytest.approx(mean)  # the mean of what it kept: the same every run
    again = C.Clock(key, sampling=True)
    assert again.fixed and again.means == clock.means


def test_a_busy_machine_keeps_no_calibration(monkeypatch):
    monkeypatch.setattr(LoadWatch, "busy", property(lambda self: True))
    clock = C.Clock("busy-key", sampling=True)
    for seconds in (0.1, 0.2, 0.3) * C.MIN_SAMPLES:
        clock("draft", seconds)
    watch = LoadWatch()
    with watch:
        pass
    clock.calibrate(watch)
    assert not clock.fixed and not C.Clock("busy-key", sampling=True).fixed
