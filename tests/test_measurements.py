"""The measurement tables (engine/disk.py): writers in several processes lose no entry; a measurement taken
while other processes held the CPU is used but not kept; a run on a busy machine takes the free cores only
(engine/threads.py)."""
from __future__ import annotations

import multiprocessing
import os
import subprocess
import sys
import time

import pytest

from treegen.engine import disk, threads


def write_many(path: str, prefix: str, count: int) -> None:
    for i in range(count):
        disk.write_entry(disk.Path(path), f"{prefix}{i}", i)


def test_writers_in_several_processes_lose_no_entry(tmp_path):
    path = tmp_path / "table.json"
    ctx = multiprocessing.get_context("spawn")
    workers = [ctx.Process(target=write_many, args=(str(path), f"p{w}-", 40)) for w in range(3)]
    for w in workers:
        w.start()
    for w in workers:
        w.join(60)
    assert len(disk.read_table(path)) == 120


def hog(seconds: float) -> subprocess.Popen:
    """A bounded busy loop on every core (it stops by itself)."""
    code = f"import time\nend = time.time() + {seconds}\nwhile time.time() < end: pass"
    return [subprocess.Popen([sys.executable, "-c", code]) for _ in range(os.cpu_count() or 1)]


@pytest.mark.skipif(not os.path.exists("/proc/stat"), reason="reads /proc")
def test_a_measurement_on_a_busy_machine_is_not_kept(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(disk, "BUSY_SHARE", 0.15)
    path = tmp_path / "table.json"
    procs = hog(3.0)
    try:
        time.sleep(0.3)
        with disk.LoadWatch() as watch:
            time.sleep(0.5)   # a measurement that waits while the others run
    finally:
        for p in procs:
            p.wait()
    assert watch.busy
    disk.keep_if_quiet(watch, path, "key", 1, "a test table")
    assert disk.read_table(path) == {}
    assert "not kept" in capsys.readouterr().err
    with disk.LoadWatch() as quiet:
        pass
    quiet.share = 0.0
    disk.keep_if_quiet(quiet, path, "key", 1, "a test table")
    assert disk.read_table(path) == {"key": 1}


def test_one_tick_of_another_process_in_an_instant_measurement_is_not_a_busy_machine(monkeypatch):
    """/proc counts CPU time in 10 ms ticks: a tick that lands inside a 1 ms measurement is not 500% load."""
    monkeypatch.setattr(disk, "BUSY_SHARE", 0.15)
    readings = iter([(100.0, 1.0), (100.01, 1.0)])   # (every process, this one): another took one tick
    monkeypatch.setattr(disk, "cpu_seconds", lambda: next(readings))
    with disk.LoadWatch() as watch:
        pass
    assert not watch.busy and watch.share <= 0.1


def test_a_busy_machine_is_named_and_the_thread_count_kept(monkeypatch):
    import torch

    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        monkeypatch.setattr(disk, "BUSY_SHARE", 0.15)
        monkeypatch.setattr(disk, "busy_cores", lambda seconds=0.2: 64.0)
        monkeypatch.setattr(threads.os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)
        line = threads.choose(None)
        assert "--threads 1" in line and torch.get_num_threads() == 2   # said, not changed: same bits
        assert threads.choose(3) is None and torch.get_num_threads() == 3   # asked for: kept
        assert threads.choose(None, "cuda") is None                        # not a CPU run
        monkeypatch.setattr(disk, "busy_cores", lambda seconds=0.2: 0.0)
        torch.set_num_threads(2)
        assert threads.choose(None) is None
    finally:
        torch.set_num_threads(before)


def test_the_tuner_copies_no_weight_that_would_not_fit(monkeypatch):
    import torch

    from treegen.engine import matmul

    weight = torch.zeros(256, 128)
    assert matmul.applies(weight)
    monkeypatch.setattr(matmul, "free_bytes", lambda: 4 * weight.numel() * weight.element_size())
    assert not matmul.applies(weight)                       # 4 timing copies > a quarter of free memory
    row = matmul.RowMatmul(weight)
    assert (row.form, row.chunk, row.pieces) == ("linear", 1, 1)   # F.linear, row by row: no copy, still exact


def test_notices_raised_while_a_reply_streams_wait_for_its_end(capsys):
    """A first run's measurement notice, raised mid-reply, prints after the reply on its own line (chat and
    complete stream inside held_notices), not between two of its words."""
    with disk.held_notices():
        disk.notice("treegen: a notice")
        with disk.held_notices():   # nested: held until the outermost ends
            disk.notice("treegen: another")
        assert capsys.readouterr().err == ""
    assert capsys.readouterr().err == "treegen: a notice\ntreegen: another\n"
    disk.notice("treegen: now")
    assert capsys.readouterr().err == "treegen: now\n"
