"""Training features: the states a data generator taps from its own forwards equal a plain forward's, and
a feature store is filled once, resumed, and read back by column."""
from __future__ import annotations

import random

import pytest
import torch
from conftest import tiny_llama

from treegen.train.chat_data import LayerTap, build_prompts
from treegen.train.dflash import target_features
from treegen.train.features import FeatureStore, FeatureWindows


def test_tapped_states_of_a_left_padded_generation_match_a_forward_of_each_row():
    model = tiny_llama(layers=3)
    prompts = [torch.tensor([5, 6, 7, 8, 9, 10]), torch.tensor([11, 12, 13])]
    ids = torch.full((2, 6), 0)
    mask = torch.zeros(2, 6, dtype=torch.long)
    for r, p in enumerate(prompts):
        ids[r, 6 - len(p):], mask[r, 6 - len(p):] = p, 1
    tap = LayerTap(model, (0, 1, 2))   # the last layer kept after the final norm, as its hidden_states entry
    try:
        got = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=5, do_sample=False, pad_token_id=0)
        feats = tap.features(got.shape[1])
    finally:
        tap.close()
    for r, p in enumerate(prompts):
        row = got[r, 6 - len(p):]
        ref = target_features(model, row[None], (0, 1, 2))[0]
        torch.testing.assert_close(feats[r, 6 - len(p):-1].float(), ref[:-1], atol=2e-3, rtol=2e-3)
        assert not feats[r, -1].any()   # the last token is never fed: zeros


def test_store_is_filled_once_resumed_and_read_by_column(tmp_path, monkeypatch):
    from treegen.train import features

    model = tiny_llama(layers=3)
    stream = torch.randint(3, 90, (200,), generator=torch.Generator().manual_seed(0)).to(torch.int32)
    windows = FeatureWindows(tmp_path, model, stream, 32, (0, 2), model.config.hidden_size, log=lambda m: None)
    ids, feats, allowed = windows(4, torch.Generator().manual_seed(1))
    assert allowed is None and ids.shape == (4, 32) and feats.shape == (4, 32, 2 * model.config.hidden_size)
    torch.testing.assert_close(feats, target_features(model, ids, (0, 2)), atol=1e-2, rtol=1e-2)

    monkeypatch.setattr(features, "fill", lambda *a, **k: pytest.fail("a filled store is not computed again"))
    one = FeatureWindows(tmp_path, model, stream, 32, (2,), model.config.hidden_size, log=lambda m: None)
    ids, feats, _ = one(2, torch.Generator().manual_seed(1))
    torch.testing.assert_close(feats, target_features(model, ids, (2,)), atol=1e-2, rtol=1e-2)


def test_an_interrupted_fill_resumes_where_it_stopped(tmp_path):
    model = tiny_llama(layers=2)
    stream = torch.randint(3, 90, (256,), generator=torch.Generator().manual_seed(0)).to(torch.int32)
    store = FeatureStore.create(tmp_path, stream, (1,), model.config.hidden_size)
    store.finish(64)  # as if killed after two 32-token windows
    reopened = FeatureStore.open(tmp_path, stream)
    assert reopened.done == 64 and FeatureStore.open(tmp_path, stream[:-1]) is None
    seen = []
    FeatureWindows(tmp_path, model, stream, 32, (1,), model.config.hidden_size, log=seen.append)
    assert FeatureStore.open(tmp_path, stream).done == 256 and any("6/8" in m or "8/8" in m for m in seen)


def test_training_prompts_are_distinct_and_never_a_benchmark_prompt():
    from treegen.bench.prompts import load_prompts

    prompts = build_prompts(60)
    assert len(prompts) == 60 == len(set(prompts)) and prompts == build_prompts(60)
    from treegen.bench.prompts import builtin_names

    bench = {p.text for name in builtin_names() for p in load_prompts(name)}
    assert not bench & set(prompts)
    other = build_prompts(60, seed=1)   # `chat_data --seed 1`: another set, for more data
    assert len(set(other)) == 60 and len(set(other) & set(prompts)) < 10 and not bench & set(other)
    narrow = build_prompts(600, seed=1, mix="templates")   # the earlier sets' families
    assert len(set(narrow)) == 600 and not bench & set(narrow) and narrow == build_prompts(600, 1, "templates")


def test_the_broad_mix_fills_every_family_and_keeps_code_near_its_share():
    from treegen.train.chat_prompts import advice_prompts, reasoning_prompts, word_problems, writing_prompts

    prompts = set(build_prompts(2000, seed=3))
    assert len(prompts) == 2000
    for family in (writing_prompts, advice_prompts, reasoning_prompts, word_problems):
        own = family(random.Random(3), 50)
        assert len(set(own)) > 25 and all("{" not in p for p in own)   # varied, every field filled
    code = sum(p.startswith(("Write a Python function", "Implement `", "How would I write", "Explain what this",
                             "Review this function", "Write a docstring")) for p in prompts)
    assert 0.1 < code / len(prompts) < 0.3   # 15% of the mix, more where other families repeat
    with pytest.raises(ValueError, match="unknown prompt mix"):
        build_prompts(10, mix="narrow")


def test_anchors_go_to_reply_positions_first(tmp_path):
    import numpy as np

    from treegen.train.chat_data import reply_start
    from treegen.train.dflash import sample_anchors

    header = [1, 7, 9]
    conv = torch.tensor([1, 5, 5, 2, 1, 7, 9, 40, 41, 42, 2])
    assert reply_start(conv, header) == 7 and reply_start(torch.tensor([3, 4]), header) == 2
    model = tiny_llama(layers=2)
    stream = torch.randint(3, 90, (128,), generator=torch.Generator().manual_seed(0)).to(torch.int32)
    store = FeatureStore.create(tmp_path, stream, (0,), model.config.hidden_size)
    allowed = np.zeros(128, dtype=bool)
    allowed[40:60] = True
    store.write_anchors(allowed)
    windows = FeatureWindows(tmp_path, model, stream, 64, (0,), model.config.hidden_size, log=lambda m: None)
    g = torch.Generator().manual_seed(0)
    for _ in range(5):
        _, _, mask = windows(2, g)
        anchors = sample_anchors(2, 64, 8, 4, g, mask)
        assert all(mask[r, anchors[r]].all() for r in range(2) if mask[r].sum() >= 9)


def test_heldout_windows_are_never_sampled_for_training(tmp_path):
    from types import SimpleNamespace

    from treegen.train.features import training_windows

    model = tiny_llama(layers=2)
    stream = torch.arange(320).to(torch.int32) % 90 + 3
    stream[256:] = 1   # the last two 32-token windows: a token no training window holds
    for cache in (None, str(tmp_path)):
        cfg = SimpleNamespace(batch=16, seq_len=32, feature_cache=cache, heldout_windows=2)
        windows = training_windows(model, SimpleNamespace(target_layer_ids=(1,), hidden_size=model.config.hidden_size),
                                   stream, cfg, log=lambda m: None)
        gen = torch.Generator().manual_seed(0)
        assert all(not (windows(gen)[0] == 1).any() for _ in range(20))
        kept, feats, _ = windows.heldout()
        assert kept.shape == (2, 32) and (kept == 1).all() and (feats is None) == (cache is None)


def test_windows_give_the_targets_last_layer_states_apart_for_a_soft_loss(tmp_path):
    """final=L-1: the store also keeps the last layer (filled into a store made without it), read apart from
    the drafter's columns; through the lm_head alone it is the target's own next-token law."""
    model = tiny_llama(layers=3)
    stream = torch.randint(3, 90, (160,), generator=torch.Generator().manual_seed(0)).to(torch.int32)
    FeatureWindows(tmp_path, model, stream, 32, (1,), model.config.hidden_size, log=lambda m: None)
    windows = FeatureWindows(tmp_path, model, stream, 32, (1,), model.config.hidden_size, log=lambda m: None,
                             final=2)
    starts = [0, 64]
    ids, feats = windows.ids(starts), windows.features(starts)
    assert feats.shape == (2, 32, model.config.hidden_size)
    law = model.get_output_embeddings()(windows.final(starts))
    torch.testing.assert_close(law, model(input_ids=ids).logits, atol=3e-2, rtol=3e-2)
    assert FeatureWindows(tmp_path, model, stream, 32, (1,), model.config.hidden_size,
                          log=lambda m: None).final(starts) is None
