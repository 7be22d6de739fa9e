"""Bad input fails early with a clear message; limits end generation cleanly; runs are reproducible."""
from __future__ import annotations

import pytest
import torch
from conftest import tiny_qwen3

from treegen.drafters import build_drafter
from treegen.engine.cache import CacheError
from treegen.engine.generate import GenerationConfig, PromptTooLong, generate
from treegen.engine.sampling import Sampler

VOCAB = 64
CONTEXT = 40


@pytest.fixture(scope="module")
def model():
    return tiny_qwen3(vocab=VOCAB, max_pos=CONTEXT)


def tokens(model, drafter, prompt, config) -> tuple[list[int], list]:
    rounds = list(generate(model, drafter, torch.as_tensor(prompt), config))
    return [t for r in rounds for t in r.tokens], rounds


def test_empty_prompt(model):
    with pytest.raises(ValueError, match="prompt is empty"):
        generate(model, build_drafter("ar", model), torch.tensor([], dtype=torch.long), GenerationConfig(4))


@pytest.mark.parametrize("length", [CONTEXT, CONTEXT + 7])
def test_prompt_longer_than_context(model, length):
    config = GenerationConfig(4, context_length=CONTEXT)
    with pytest.raises(PromptTooLong, match=f"prompt is {length} tokens.*context holds {CONTEXT}"):
        generate(model, build_drafter("ar", model), torch.zeros(length, dtype=torch.long), config)


def test_max_new_tokens_zero_gives_no_rounds(model):
    assert list(generate(model, build_drafter("pld", model), torch.tensor([1, 2]), GenerationConfig(0))) == []


def test_negative_max_new_tokens():
    with pytest.raises(ValueError, match="max_new_tokens must be >= 0"):
        GenerationConfig(-1)


@pytest.mark.parametrize("kwargs, message", [
    ({"temperature": -0.1}, "temperature must be >= 0"),
    ({"temperature": float("nan")}, "temperature must be >= 0"),
    ({"temperature": 1.0, "top_p": 0.0}, r"top-p must be in \(0, 1\]"),
    ({"temperature": 1.0, "top_p": 1.5}, r"top-p must be in \(0, 1\]"),
    ({"temperature": 1.0, "top_p": -0.2}, r"top-p must be in \(0, 1\]"),
    ({"temperature": 1.0, "top_k": -1}, "top-k must be >= 0"),
    ({"temperature": 1.0, "min_p": -0.1}, r"min-p must be in \[0, 1\)"),
    ({"temperature": 1.0, "min_p": 1.0}, r"min-p must be in \[0, 1\)"),
])
def test_bad_sampler_settings(kwargs, message):
    with pytest.raises(ValueError, match=message) as err:
        Sampler(**kwargs)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("method", ["ar", "pld"])
@pytest.mark.parametrize("prompt_len", [CONTEXT - 1, CONTEXT - 2, CONTEXT - 9, 5])
def test_context_limit_stops_cleanly(model, method, prompt_len):
    """Generation that reaches the context ends with finish == "context": no position past the limit."""
    positions = []
    decoder = model.get_decoder()   # every target step runs it (with or without the lm_head over all rows)
    forward = decoder.forward

    def spy(*args, **kwargs):
        ids, pos = kwargs["input_ids"], kwargs.get("position_ids")
        positions.append(int(pos.max()) if pos is not None else ids.shape[1] - 1)
        return forward(*args, **kwargs)

    prompt = ([3, 9, 27, 17] * CONTEXT)[:prompt_len]  # repeats: pld proposes deep chains near the limit
    decoder.forward = spy
    try:
        out, rounds = tokens(model, build_drafter(method, model), prompt,
                             GenerationConfig(1000, context_length=CONTEXT))
    finally:
        del decoder.forward
    assert len(prompt) + len(out) == CONTEXT
    assert rounds[-1].finish == "context" and all(r.finish is None for r in rounds[:-1])
    assert max(positions) < CONTEXT
    ref = model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=len(out), eos_token_id=None,
                         pad_token_id=0)[0, prompt_len:].tolist()
    assert out == ref


def test_sliding_window_cache_is_refused():
    from transformers import Qwen3Config, Qwen3ForCausalLM

    cfg = Qwen3Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=8, use_sliding_window=True,
                      sliding_window=4, max_window_layers=0, layer_types=["sliding_attention"] * 2)
    model = Qwen3ForCausalLM(cfg).eval()
    with pytest.raises(CacheError, match="sliding-window"):
        tokens(model, build_drafter("ar", model), [1, 2, 3], GenerationConfig(3))


def test_same_seed_same_output(model):
    prompt = [5, 6, 7, 5, 6, 7, 5, 6]
    drafter = build_drafter("pld", model)
    config = GenerationConfig(24, Sampler(temperature=1.0, top_k=20), seed=123)
    first, _ = tokens(model, drafter, prompt, config)
    again, _ = tokens(model, drafter, prompt, config)
    assert first == again
    others = {tuple(tokens(model, drafter, prompt, GenerationConfig(24, Sampler(1.0, 20), seed=s))[0])
              for s in range(4)}
    assert len(others) > 1, "different seeds should give different samples"


def test_greedy_runs_are_identical(model):
    prompt = [1, 2, 3, 1, 2, 3]
    for method in ("ar", "pld"):
        runs = {tuple(tokens(model, build_drafter(method, model), prompt, GenerationConfig(20))[0])
                for _ in range(3)}
        assert len(runs) == 1


def test_closing_the_stream_early(model):
    """A consumer may stop after any round; the generator closes without error."""
    rounds = generate(model, build_drafter("pld", model), torch.tensor([1, 2, 1, 2]), GenerationConfig(50))
    first = next(rounds)
    assert first.index == 0 and len(first.tokens) == 1
    rounds.close()
    assert list(rounds) == []
