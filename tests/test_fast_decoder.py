"""engine/fast_decoder.py: the lean CPU forward gives transformers' hidden states and cache bit for bit
(Qwen3 and Llama, one row and tree-shaped rows) with transformers' kernels, the same values up to rounding
with the row-invariant ones the engine uses (tests/test_row_invariance.py holds those to their own bits),
and is used only where it applies."""
from __future__ import annotations

import pytest
import torch
from conftest import tiny_llama, tiny_qwen3

from treegen.engine.cache import new_cache
from treegen.engine.fast_decoder import FastDecoder, supported
from treegen.engine.target import TargetStep
from treegen.engine.tree import DraftTree, verification_inputs

TREES = [DraftTree.empty(torch.device("cpu")),                                     # ar: one row
         DraftTree(torch.tensor([5, 6, 7, 8, 9]), torch.tensor([-1, -1, 0, 2, 2])),  # a tree
         DraftTree.chain(torch.arange(10, 25))]                                     # a 15-draft chain


def both(model, tree: DraftTree, context: int = 37, invariant: bool = False):
    ids = torch.arange(3, 3 + context)[None] % model.config.vocab_size
    caches = [new_cache(model), new_cache(model)]
    with torch.inference_mode():
        for cache in caches:
            model(input_ids=ids, cache=cache, use_cache=True)
        inputs = verification_inputs(7, tree, context, model.dtype)
        ref = model.get_decoder()(input_ids=inputs[0], position_ids=inputs[1], attention_mask=inputs[2],
                                  cache=caches[0], use_cache=True, output_hidden_states=True)
        last, hidden = FastDecoder(model, invariant=invariant)(*inputs, caches[1])
    return ref, (last, hidden), caches


@pytest.mark.parametrize("make", [tiny_qwen3, tiny_llama])
@pytest.mark.parametrize("tree", TREES, ids=["one-row", "tree", "chain"])
def test_bit_for_bit_with_transformers(make, tree):
    model = make()
    assert supported(model)
    ref, (last, hidden), (ref_cache, cache) = both(model, tree)
    assert torch.equal(ref.last_hidden_state, last)
    assert len(ref.hidden_states) == len(hidden)
    assert all(torch.equal(a, b) for a, b in zip(ref.hidden_states, hidden))
    for a, b in zip(ref_cache.layers, cache.layers):
        assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)


def test_the_demo_target_bit_for_bit():
    from transformers import AutoModelForCausalLM

    from treegen.assets import DEMO_TARGET

    model = AutoModelForCausalLM.from_pretrained(DEMO_TARGET, dtype=torch.float32).eval()
    for tree in TREES:
        ref, (last, hidden), _ = both(model, tree, context=120)
        assert torch.equal(ref.last_hidden_state, last) and torch.equal(ref.hidden_states[3], hidden[3])


@pytest.mark.parametrize("tree", TREES, ids=["one-row", "tree", "chain"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_row_invariant_kernels_change_only_rounding(tree, dtype):
    model = tiny_qwen3().to(dtype)
    ref, (last, hidden), _ = both(model, tree, invariant=True)
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(last, ref.last_hidden_state, rtol=tol, atol=tol)
    torch.testing.assert_close(hidden[1], ref.hidden_states[1], rtol=tol, atol=tol)


def test_where_it_applies():
    model = tiny_qwen3()
    assert TargetStep(model).fast is not None
    assert TargetStep(model, lazy=False).fast is None            # the eager (GPU-style) step keeps the model's
    model.config.rope_parameters = {**model.config.rope_parameters, "rope_type": "linear", "factor": 2.0}
    assert not supported(model)
    model = tiny_qwen3()
    model.model.layers[0].mlp.up_proj = torch.nn.Linear(32, 64, bias=True)
    assert not supported(model)                                   # a bias the lean path would drop
    model = tiny_qwen3()
    model.train()
    assert not supported(model)


def test_one_decoder_a_model_until_its_weights_change():
    """Every generation's TargetStep reads one built decoder (building lays out every product again); a cast
    or an in-place change to a weight builds a new one, which computes with the new weights."""
    from treegen.engine.fast_decoder import decoder_for

    model = tiny_qwen3()
    first = decoder_for(model)
    assert decoder_for(model) is first and TargetStep(model).fast is first
    assert decoder_for(model, invariant=False) is not first
    with torch.no_grad():
        model.model.layers[0].mlp.down_proj.weight.mul_(2)
    changed = decoder_for(model)
    assert changed is not first and decoder_for(model) is changed
    tree = TREES[1]
    _, (last, _), _ = both(model, tree, invariant=True)
    cache = new_cache(model)
    with torch.inference_mode():
        model(input_ids=torch.arange(3, 40)[None] % model.config.vocab_size, cache=cache, use_cache=True)
        again, _ = changed(*verification_inputs(7, tree, 37, model.dtype), cache)
    assert torch.equal(again, last)
    model.to(torch.bfloat16)
    assert decoder_for(model) is not changed
