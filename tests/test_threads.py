"""Thread counts on a busy machine (engine/threads.py): a greedy generation may take fewer threads only where
this model's logits were checked to be the same bits with them; the tokens never change with the count."""
from __future__ import annotations

import pytest
import torch
from conftest import tiny_qwen3

from treegen.engine import threads


@pytest.fixture
def two_threads():
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


def test_the_check_compares_real_forwards_and_is_kept(tmp_path, monkeypatch, two_threads):
    monkeypatch.setenv("TREEGEN_CACHE", str(tmp_path))
    model = tiny_qwen3(hidden=64).to(torch.bfloat16)
    assert threads.neutral_counts(model) == (1, 2)
    assert (tmp_path / "threads.json").exists()
    calls = []
    monkeypatch.setattr(threads, "forward_logits", lambda *a: calls.append(a))
    assert threads.neutral_counts(model) == (1, 2) and not calls   # read back, not checked again


def test_a_count_whose_bits_differ_is_not_allowed(tmp_path, monkeypatch, two_threads):
    monkeypatch.setenv("TREEGEN_CACHE", str(tmp_path))
    real = threads.forward_logits
    monkeypatch.setattr(threads, "forward_logits",
                        lambda model, t, *a: [x + (t == 1) for x in real(model, t, *a)])
    assert threads.neutral_counts(tiny_qwen3(hidden=64)) == (2,)


def test_a_greedy_generation_takes_the_free_cores(monkeypatch, two_threads):
    monkeypatch.setattr(threads, "free_cores", lambda seconds=0.2, busy=None: (1, 2))
    plan = threads.ThreadPlan((1, 2))
    with plan.fitting(True) as chosen:
        assert chosen == 1 and torch.get_num_threads() == 1
    assert torch.get_num_threads() == 2
    with plan.fitting(False) as chosen:       # sampled with a drafter: its laws are not covered by the check
        assert chosen == 2
    with threads.ThreadPlan((2,)).fitting(True) as chosen:
        assert chosen == 2


def test_only_drawn_drafts_keep_a_sampled_run_at_its_threads():
    """At T > 0 verification draws every token from the target unless drafts were drawn from a drafter's laws
    (`sample`): without those the tokens follow from the target's logits, so a busy machine's fewer threads
    (the same logits) give the same tokens."""
    from treegen.drafters import get_method

    assert get_method("ddtree").draws_drafts({}) and get_method("dflash").draws_drafts({"sample": True})
    assert not get_method("ddtree").draws_drafts({"budget": 2, "sample": False})
    assert not get_method("ar").draws_drafts({}) and not get_method("pld").draws_drafts({})


def test_greedy_tokens_are_the_same_with_one_thread_and_two(two_threads):
    from treegen.drafters import build_drafter
    from treegen.engine.generate import GenerationConfig, generate

    model = tiny_qwen3(hidden=64).to(torch.bfloat16)
    prompt = torch.arange(3, 40) % model.config.vocab_size
    outputs = []
    for count in (2, 1):
        torch.set_num_threads(count)
        drafter = build_drafter("pld", model, None, {})
        outputs.append([t for r in generate(model, drafter, prompt, GenerationConfig(max_new_tokens=40))
                        for t in r.tokens])
    assert outputs[0] == outputs[1]


def test_the_demo_pair_on_a_busy_machine_gives_the_quiet_tokens(monkeypatch, tmp_path, two_threads):
    """A greedy generation takes one thread when other work holds a core, and commits the same tokens."""
    from treegen import Generator

    monkeypatch.setenv("TREEGEN_CACHE", str(tmp_path))
    gen = Generator(method="treeflash")
    assert gen.thread_plan.allowed == (1, 2)
    quiet = gen.generate("def parse(line):\n    ", max_new_tokens=40).token_ids
    seen = []
    monkeypatch.setattr(threads, "free_cores", lambda seconds=0.2, busy=None: (1, 2))
    for chunk in gen.stream("def parse(line):\n    ", max_new_tokens=40):
        seen.append(torch.get_num_threads())
    assert set(seen) == {1} and torch.get_num_threads() == 2
    assert gen.generate("def parse(line):\n    ", max_new_tokens=40).token_ids == quiet
    assert Generator(method="ar", adapt_threads=False).thread_plan.allowed == ()


def test_a_chat_message_reads_the_load_sampled_while_it_waited(monkeypatch, two_threads):
    """Between generations /proc is read in the background, so the next generation takes its thread count from
    that window at once; the first (or one right after another) waits out one sample."""
    import time

    from treegen.engine import disk

    clock = {"total": 0.0}
    monkeypatch.setattr(disk, "cpu_seconds", lambda: (clock["total"], 0.0))
    waited = []
    monkeypatch.setattr(disk, "busy_cores", lambda seconds=0.2: waited.append(seconds) or 0.0)
    plan = threads.ThreadPlan((1, 2))
    with plan.fitting(True) as chosen:
        assert chosen == 2 and waited == [threads.GENERATION_SAMPLE]   # nothing kept yet: one sample waited out
    time.sleep(4 * threads.GENERATION_SAMPLE)   # the chat waits for its user
    clock["total"] = 1e6       # and now another process holds every core
    with plan.fitting(True) as chosen:
        assert chosen == 1 and len(waited) == 1   # the background window saw it; nothing waited
    with plan.fitting(True):
        assert len(waited) == 2   # right after a generation no window is kept yet: a sample
