"""engine/fused.py: the whole decoder stack as one compiled call (row_decoder.c, bf16 on AVX512-BF16). It computes
what the per-layer path computes (the same compiled steps in the same order; only the MLP's SiLU may round a
last bit another way), gives a row the same bits alone and inside a tree (the engine's exactness rests on it),
writes the cache the per-layer path writes, and steps aside where it does not apply."""
from __future__ import annotations

import pytest
import torch
from conftest import tiny_llama, tiny_qwen3
from test_row_invariance import check

from treegen.engine import fused
from treegen.engine.cache import new_cache
from treegen.engine.target import TargetStep
from treegen.engine.tree import DraftTree, verification_inputs

pytestmark = pytest.mark.skipif(not fused.available(), reason="the compiled stack is bf16 on AVX512-BF16")

TREES = [DraftTree.empty(torch.device("cpu")),
         DraftTree(torch.tensor([5, 6, 7, 8, 9]), torch.tensor([-1, -1, 0, 2, 2])),
         DraftTree.chain(torch.arange(10, 25))]


def forward(step: TargetStep, model, tree: DraftTree, context: int = 41):
    ids = torch.arange(3, 3 + context)[None] % model.config.vocab_size
    cache = new_cache(model)
    with torch.inference_mode():
        model(input_ids=ids, cache=cache, use_cache=True)
        last, hidden = step.fast(*verification_inputs(7, tree, context, model.dtype), cache)
    return last, hidden, cache


@pytest.mark.parametrize("make", [tiny_qwen3, tiny_llama], ids=["qwen3", "llama"])
@pytest.mark.parametrize("tree", TREES, ids=["one-row", "tree", "chain"])
def test_the_stack_computes_what_the_per_layer_path_computes(make, tree):
    model = make(hidden=64).to(torch.bfloat16)
    step = TargetStep(model)
    assert step.fast.stack is not None
    last, hidden, cache = forward(step, model, tree)
    step.fast.stack = None
    ref_last, ref_hidden, ref_cache = forward(step, model, tree)
    tol = {"rtol": 2e-2, "atol": 2e-2}   # a SiLU rounded another way moves a bf16 ulp
    torch.testing.assert_close(last, ref_last, **tol)
    assert len(hidden) == len(ref_hidden)
    for a, b in zip(hidden, ref_hidden):
        torch.testing.assert_close(a, b, **tol)
    for a, b in zip(cache.layers, ref_cache.layers):
        assert a.keys.shape == b.keys.shape
        torch.testing.assert_close(a.keys, b.keys, **tol)
        torch.testing.assert_close(a.values, b.values, **tol)


@pytest.mark.parametrize("make", [tiny_qwen3, tiny_llama], ids=["qwen3", "llama"])
def test_a_row_has_the_same_bits_alone_and_in_any_tree(make):
    model = make(hidden=64).to(torch.bfloat16)
    assert TargetStep(model).fast.stack is not None
    check(model)


def test_where_it_applies():
    assert TargetStep(tiny_qwen3(hidden=64)).fast.stack is None                            # fp32
    assert TargetStep(tiny_qwen3(hidden=32).to(torch.bfloat16)).fast.stack is None         # outputs not 64s
    from treegen.engine import int8

    model = tiny_llama(hidden=64).to(torch.bfloat16)
    int8.quantize(model)
    assert TargetStep(model).fast.stack is None                                            # int8 products


def test_a_cache_it_cannot_write_into_takes_the_per_layer_path():
    from transformers import DynamicCache

    model = tiny_qwen3(hidden=64).to(torch.bfloat16)
    step = TargetStep(model)
    ids = torch.arange(3, 40)[None]
    outs = []
    for cache in (DynamicCache(config=model.config), new_cache(model)):
        with torch.inference_mode():
            model(input_ids=ids, cache=cache, use_cache=True)
            outs.append(step.fast(*verification_inputs(7, TREES[1], 37, model.dtype), cache)[0])
        assert cache.get_seq_length() == 37 + 6
    torch.testing.assert_close(outs[0], outs[1], rtol=2e-2, atol=2e-2)


def test_steps_across_a_cache_that_grows_write_into_its_new_buffers():
    """The stack binds a layer's buffers once and rebinds when the cache grows into new ones (past
    MIN_CAPACITY positions): each step's logits are then those of a fresh forward over the same ids."""
    from treegen.engine.cache import MIN_CAPACITY

    model = tiny_llama(hidden=64).to(torch.bfloat16)
    step = TargetStep(model)
    ids = torch.arange(5, 5 + MIN_CAPACITY + 8) % model.config.vocab_size
    start = MIN_CAPACITY - 4
    cache = new_cache(model)
    with torch.inference_mode():
        step(ids[None, :start], torch.arange(start)[None], None, cache)
        grown = []
        for i in range(start, len(ids)):   # one-row steps across the buffers' doubling
            logits, _ = step(*verification_inputs(int(ids[i]), DraftTree.empty(), i, model.dtype), cache)
            grown.append(logits.row(0))
            assert cache.get_seq_length() == i + 1
        for i in (start, MIN_CAPACITY, len(ids) - 1):   # before, at and after the doubling, from scratch
            fresh = new_cache(model)
            step(ids[None, :i], torch.arange(i)[None], None, fresh)
            logits, _ = step(*verification_inputs(int(ids[i]), DraftTree.empty(), i, model.dtype), fresh)
            assert torch.equal(logits.row(0), grown[i - start])
