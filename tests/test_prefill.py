"""The prefill (engine/prefill.py): in chunks, the last row's logits only, the requested layers only."""
from __future__ import annotations

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from treegen.assets import DEMO_DRAFTER, DEMO_TARGET
from treegen.drafters import build_drafter
from treegen.engine.cache import new_cache
from treegen.engine.generate import GenerationConfig, generate
from treegen.engine.prefill import DEFAULT_CHUNK
from treegen.engine.target import TargetStep
from treegen.loading import eos_ids, load_target, load_tokenizer

DEMO_LAYERS = (1, 3, 5)   # the demo drafter's; 5 is the last layer (transformers gives its normed output)


@pytest.fixture(scope="module")
def demo():
    return load_target(str(DEMO_TARGET), dtype="fp32", device="cpu")[0]


def largest_allocation(run) -> tuple[int, object]:
    """(bytes of the largest single allocation torch's profiler saw while `run` ran, run's result)."""
    with torch.inference_mode(), profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        result = run()
    return max(e.self_cpu_memory_usage for e in prof.events()), result


def old_prefill(model, ids, layer_ids):
    """The eager prefill as it was: every row's logits, every layer's hidden states."""
    out = model(input_ids=ids, cache=new_cache(model), use_cache=True, output_hidden_states=True)
    return out.logits[0, -1:], torch.cat([out.hidden_states[i + 1][0] for i in layer_ids], dim=-1)


def test_long_prompt_gpu_prefill_allocates_no_prompt_by_vocabulary(demo):
    """4,096 tokens through the eager (GPU) branch on the CPU: no allocation as large as [chunk, vocabulary]
    (the old way makes [prompt, vocabulary]: seen here too, so the profiler does see such a tensor), and the
    drafter's features are those the old way gave, bit for bit."""
    n, vocab = 4096, demo.config.vocab_size
    ids = torch.randint(vocab, (1, n), generator=torch.Generator().manual_seed(0))
    old_bytes, (old_last, old_feats) = largest_allocation(lambda: old_prefill(demo, ids, DEMO_LAYERS))
    assert old_bytes >= n * vocab * 4
    step = TargetStep(demo, DEMO_LAYERS, lazy=False)
    assert not step.lazy and step.prefill_chunk == DEFAULT_CHUNK < n   # two chunks
    new_bytes, (logits, feats) = largest_allocation(
        lambda: step(ids, torch.arange(n)[None], None, new_cache(demo)))
    assert new_bytes < DEFAULT_CHUNK * vocab * 4 and new_bytes < old_bytes / 3
    assert len(logits) == 1 and logits.eager
    assert torch.equal(feats, old_feats)
    torch.testing.assert_close(logits.row(-1), old_last)   # one row through the lm_head, not 4,096
    assert int(logits.row(-1).argmax()) == int(old_last.argmax())


@pytest.mark.parametrize("lazy", [False, True])
def test_chunks_fill_the_same_cache_and_features(qwen3, lazy):
    """Chunked or whole, eager or lazy: the same features, last row and cache (to rounding: row blocks of
    another size may sum in another order)."""
    n, layers = 23, (0, 1)
    ids = torch.randint(qwen3.config.vocab_size, (1, n), generator=torch.Generator().manual_seed(1))
    pos = torch.arange(n)[None]
    with torch.inference_mode():
        ref_last, ref_feats = old_prefill(qwen3, ids, layers)
        whole_cache = new_cache(qwen3)
        TargetStep(qwen3, layers, lazy=lazy, prefill_chunk=n)(ids, pos, None, whole_cache)
        for chunk in (1, 5, n + 3):
            cache = new_cache(qwen3)
            logits, feats = TargetStep(qwen3, layers, lazy=lazy, prefill_chunk=chunk)(ids, pos, None, cache)
            torch.testing.assert_close(feats, ref_feats)
            torch.testing.assert_close(logits.row(-1), ref_last)
            assert cache.get_seq_length() == n
            for a, b in zip(cache.layers, whole_cache.layers):
                torch.testing.assert_close(a.keys, b.keys)
                torch.testing.assert_close(a.values, b.values)


def test_no_layers_no_features(qwen3):
    ids = torch.arange(9)[None]
    with torch.inference_mode():
        logits, feats = TargetStep(qwen3, (), lazy=False, prefill_chunk=4)(ids, torch.arange(9)[None], None,
                                                                          new_cache(qwen3))
    assert feats is None and len(logits) == 1


def test_chunk_must_be_positive():
    with pytest.raises(ValueError, match="prefill_chunk"):
        GenerationConfig(prefill_chunk=0)


def test_llama_prefill_in_chunks():
    """Another architecture through the same chunks (the cache carries the positions between them)."""
    from conftest import tiny_llama

    model = tiny_llama()
    ids = torch.randint(96, (1, 17), generator=torch.Generator().manual_seed(2))
    with torch.inference_mode():
        ref_last, ref_feats = old_prefill(model, ids, (0,))
        logits, feats = TargetStep(model, (0,), lazy=False, prefill_chunk=4)(ids, torch.arange(17)[None], None,
                                                                             new_cache(model))
    torch.testing.assert_close(feats, ref_feats)
    torch.testing.assert_close(logits.row(-1), ref_last)


@pytest.mark.parametrize("method", ["ar", "dflash", "ddtree"])
def test_generation_unchanged_by_chunks(demo, method):
    """A prompt prefilled 7 rows at a time generates what the whole prompt does, with every method."""
    tokenizer = load_tokenizer(str(DEMO_TARGET))
    prompt = torch.tensor(tokenizer("import os\nimport sys\n\n\ndef main(argv):\n")["input_ids"])
    ref = demo.generate(prompt[None], max_new_tokens=32, do_sample=False)[0, prompt.numel():].tolist()
    drafter = build_drafter(method, demo, str(DEMO_DRAFTER) if method != "ar" else None)
    for chunk in (7, DEFAULT_CHUNK):
        config = GenerationConfig(32, eos_token_ids=eos_ids(demo, tokenizer), prefill_chunk=chunk)
        tokens = [t for r in generate(demo, drafter, prompt, config) for t in r.tokens]
        assert tokens == ref[:len(tokens)] and (len(tokens) == 32 or tokens[-1] in config.eos_token_ids)


@pytest.mark.parametrize("dtype", ["bf16", "q4"])
def test_the_lean_prefill_gives_chunks_the_bits_of_the_whole_prompt(dtype):
    """Where the compiled stack serves, the prompt runs through it (engine/target.py, a chunk as a chain), and
    its rows are row-invariant: in chunks of any size the cache, the features and the last row are the whole
    prompt's, bit for bit (a chat turn prefilled on top of the last turn's cache computes what a fresh prompt
    would)."""
    model = load_target(str(DEMO_TARGET), dtype=dtype, device="cpu")[0]
    n = 45
    ids = torch.randint(model.config.vocab_size, (1, n), generator=torch.Generator().manual_seed(3))
    pos = torch.arange(n)[None]
    with torch.inference_mode():
        whole_cache = new_cache(model)
        step = TargetStep(model, DEMO_LAYERS, prefill_chunk=n)
        if step.fast is None or step.fast.stack is None:
            pytest.skip("the compiled stack needs AVX512-BF16 (and AVX512-VNNI for q4)")
        whole, whole_feats = step(ids, pos, None, whole_cache)
        for chunk in (1, 7, 16):
            cache = new_cache(model)
            logits, feats = TargetStep(model, DEMO_LAYERS, prefill_chunk=chunk)(ids, pos, None, cache)
            assert torch.equal(feats, whole_feats) and torch.equal(logits.row(-1), whole.row(-1))
            for a, b in zip(cache.layers, whole_cache.layers):
                assert torch.equal(a.keys[..., :n, :], b.keys[..., :n, :])
                assert torch.equal(a.values[..., :n, :], b.values[..., :n, :])
