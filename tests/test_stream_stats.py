"""StreamDecoder (text deltas that never split a UTF-8 character) and Stats (acceptance numbers)."""
from __future__ import annotations

from itertools import pairwise

import pytest
import torch
from conftest import tiny_qwen3
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from treegen.api import StreamDecoder
from treegen.drafters import build_drafter
from treegen.engine.generate import GenerationConfig, Round, generate
from treegen.engine.stats import Stats

TEXT = st.text(alphabet=st.sampled_from(list("ab x=\n():") + ["é", "ü", "中", "文", "😀", "🙂", "\u00a0"]),
               max_size=40)


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


def stream(tokenizer, ids: list[int], sizes: list[int]) -> list[str]:
    decoder, deltas, i, k = StreamDecoder(tokenizer), [], 0, 0
    while i < len(ids):
        n = sizes[k % len(sizes)] if sizes else 1
        deltas.append(decoder.push(ids[i:i + n]))
        i, k = i + n, k + 1
    return deltas


def test_multibyte_characters_split_across_tokens(tokenizer):
    text = "x = 'é中😀'\nprint(x)  # 文🙂"
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert len(ids) > len(text), "the byte-level tokenizer should split these characters into bytes"
    deltas = stream(tokenizer, ids, [1])
    assert "".join(deltas) == tokenizer.decode(ids) == text
    assert all("\ufffd" not in d for d in deltas), "a delta carried half a character"
    assert "" in deltas, "some pushes must have waited for the rest of a character"


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=TEXT, sizes=st.lists(st.integers(1, 4), max_size=5), eos_at=st.integers(0, 60))
def test_deltas_concatenate_to_the_decoded_ids(tokenizer, text, sizes, eos_at):
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    ids = ids[:eos_at] + [tokenizer.eos_token_id] + ids[eos_at:]  # special tokens are skipped, as in decode
    deltas = stream(tokenizer, ids, sizes)
    assert "".join(deltas) == tokenizer.decode(ids, skip_special_tokens=True) == text
    assert all("\ufffd" not in d for d in deltas)


@given(text=TEXT, cut=st.integers(1, 3))
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
def test_flush_emits_a_character_cut_off_by_the_end(tokenizer, text, cut):
    ids = tokenizer(text + "😀", add_special_tokens=False)["input_ids"][:-cut]  # 1-3 of its 4 bytes
    decoder = StreamDecoder(tokenizer)
    deltas = [decoder.push([i]) for i in ids]
    assert "".join(deltas) == text, "push() must hold back the incomplete character"
    assert text + decoder.flush() == tokenizer.decode(ids)
    assert decoder.flush() == ""


def _round(index, tokens, accepted, drafted=0, finish=None):
    return Round(index, tokens, drafted, accepted, accepted, 0.01, 0.02, 0.005, finish)


def test_stats_numbers_by_hand():
    stats = Stats()
    for r in (_round(0, [5], 0), _round(1, [1, 2, 3], 2, drafted=6), _round(2, [4], 0, drafted=4),
              _round(3, [6, 7], 1, drafted=2, finish="length")):
        stats.add(r)
    assert (stats.rounds, stats.new_tokens, stats.accepted_drafts, stats.drafted) == (3, 7, 3, 12)
    assert stats.mean_accepted_length == pytest.approx(2.0)            # (3 drafts + 3 bonus) / 3 rounds
    assert stats.acceptance_per_position == pytest.approx([2 / 3, 1 / 3])
    assert stats.finish == "length"
    d = stats.to_dict()
    assert d["accept_histogram"] == {"0": 1, "1": 1, "2": 1} and d["mean_tree_size"] == pytest.approx(4.0)
    assert d["accepted_per_round"] == pytest.approx(1.0) and d["tree_used"] == pytest.approx(3 / 12)
    assert d["time_split_s"]["prefill"] == pytest.approx(0.02)
    assert d["time_split_s"]["draft"] == pytest.approx(0.03)


def test_rounds_without_a_draft_count_apart():
    """An auto budget's resting rounds (no draft verified) lower tokens a round, not tokens a drafting round."""
    stats = Stats()
    for r in (_round(0, [5], 0), _round(1, [1, 2, 3], 2, drafted=6), _round(2, [4], 0), _round(3, [6], 0)):
        stats.add(r)
    assert stats.mean_accepted_length == pytest.approx(5 / 3) and stats.drafting_rounds == 1
    assert stats.drafting_length == pytest.approx(3.0)
    assert stats.to_dict()["drafting_length"] == pytest.approx(3.0)


def test_stats_of_no_rounds():
    stats = Stats()
    stats.add(_round(0, [5], 0, finish="eos"))
    assert stats.rounds == 0 and stats.mean_accepted_length == 0.0 and stats.acceptance_per_position == []
    assert stats.to_dict()["mean_tree_size"] == 0.0


def test_stats_of_a_real_generation():
    model = tiny_qwen3(vocab=64)
    stats = Stats()
    prompt = torch.tensor([3, 4, 5, 6] * 6)
    for r in generate(model, build_drafter("pld", model), prompt, GenerationConfig(40)):
        stats.add(r)
    assert stats.new_tokens == 40 and stats.finish == "length"
    assert stats.new_tokens - 1 == pytest.approx(stats.mean_accepted_length * stats.rounds)
    per_pos = stats.acceptance_per_position
    assert all(a >= b for a, b in pairwise(per_pos)), "acceptance at depth k+1 needs depth k"
    assert sum(per_pos) == pytest.approx(stats.accepted_drafts / stats.rounds)
