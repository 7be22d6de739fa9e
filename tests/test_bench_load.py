"""The bench under load and cut short: disturbed timings are named, Ctrl-C keeps what finished, every run
carries a digest of its tokens, and one repeat shows no range."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from treegen.bench import load as L
from treegen.bench import prompts as P
from treegen.bench.metrics import Speedup
from treegen.bench.report import run_dict, speed, token_digest
from treegen.bench.runner import BenchInterrupted, Output, Run, Settings, complete_groups, run_all
from treegen.engine.stats import Stats


class Stopper:
    """A contestant that raises KeyboardInterrupt on its n-th timed run (the warm-up is run 0)."""
    has_rounds, chat, target = False, False, None

    def __init__(self, label, stop_at=None):
        self.label, self.stop_at, self.calls = label, stop_at, 0

    def encode(self, text):
        return [1]

    def run(self, ids, max_new_tokens, temperature, seed):
        self.calls += 1
        if self.calls == self.stop_at:
            raise KeyboardInterrupt
        return Output([7] * max_new_tokens, Stats(new_tokens=max_new_tokens, wall_time=0.01))


def test_ctrl_c_keeps_the_prompts_every_contestant_finished():
    contestants = [Stopper("ar"), Stopper("pld", stop_at=4)]   # warm-up, p0, p1, then Ctrl-C on p2
    prompts = [P.Prompt(str(i), "x") for i in range(4)]
    with pytest.raises(BenchInterrupted) as stop:
        run_all(contestants, prompts, Settings(3, 0.0, repeats=1))
    assert sorted((r.label, r.prompt) for r in stop.value.runs) == [("ar", 0), ("ar", 1), ("pld", 0), ("pld", 1)]


def test_ctrl_c_in_the_warm_up_keeps_nothing():
    with pytest.raises(BenchInterrupted) as stop:
        run_all([Stopper("ar", stop_at=1)], [P.Prompt("a", "x")], Settings(3, 0.0))
    assert stop.value.runs == []


def test_complete_groups_drop_a_half_finished_prompt():
    out = Output([1], Stats())
    runs = [Run("ar", 0, 0, out), Run("x", 0, 0, out), Run("ar", 1, 0, out)]
    assert [(r.label, r.prompt) for r in complete_groups(runs, 2)] == [("ar", 0), ("x", 0)]


def test_every_run_in_the_json_carries_its_tokens_digest_and_load():
    run = Run("ar", 0, 0, Output([5, 6, 7], Stats(new_tokens=3, wall_time=0.5)), other_cores=0.12345)
    d = run_dict(run, [P.Prompt("p", "x")])
    assert d["tokens_sha256"] == token_digest([5, 6, 7]) != token_digest([5, 6, 8])
    assert len(d["tokens_sha256"]) == 16 and d["other_cores"] == 0.123
    assert token_digest([1, 23]) != token_digest([12, 3])   # ids are separated, not concatenated


def test_one_repeat_shows_one_value_not_a_range():
    s = SimpleNamespace(speedup_vs_ar=Speedup(1.5, 1.5, 1.5))
    assert speed(s, single=True) == "1.50x" and speed(s) == "1.50x (1.50-1.50)"


def test_other_cores_from_machine_busy_time():
    before, after = L.Sample(10.0, 1.0, 100.0), L.Sample(12.0, 3.0, 104.0)   # 4 s busy, 2 s of them ours
    assert L.other_cores(before, after) == pytest.approx(1.0)
    assert L.other_cores(L.Sample(0, 0, None), after) is None
    assert L.other_cores(L.Sample(0, 0, 0.0), L.Sample(1, 2, 1.0)) == 0.0   # never negative


def result(label, speedup, tau):
    overall = SimpleNamespace(speedup_vs_ar=Speedup(speedup, speedup, speedup), mean_accepted_length=tau)
    return SimpleNamespace(label=label, overall=overall)


def test_warnings_name_a_busy_machine_and_an_impossible_speedup():
    quiet = {"cores": 2, "other_cores": 0.02, "runs": 10, "disturbed_runs": 0}
    ok = [result("ar", 1.0, 1.0), result("treeflash", 2.4, 3.1), result("hf-pld", 1.4, None)]
    assert L.warnings(ok, quiet) == []
    busy = {"cores": 2, "other_cores": 1.4, "runs": 10, "disturbed_runs": 7}
    lines = L.warnings([result("smollm2-pld", 5.04, 1.03), result("hf-generate", 3.8, None)], busy)
    assert "1.40 of 2 cores" in lines[0] and "7 of 10 runs" in lines[1]
    assert any("smollm2-pld measured 5.04x ar with 1.03 tokens a round" in x for x in lines)
    assert any(x.startswith("hf-generate measured 3.80x") for x in lines)


def test_machine_busy_reads_proc_stat_or_says_unknown():
    value = L.machine_busy()
    assert value is None or value > 0


def test_the_stdlib_split_is_the_trainers():
    train_corpus = pytest.importorskip("treegen.train.corpus")
    from treegen.bench.stdlib_split import heldout_files

    assert heldout_files() == train_corpus.stdlib_files("heldout")
