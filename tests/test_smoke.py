import torch

from treegen.drafters import build_drafter
from treegen.engine.generate import GenerationConfig, generate


def test_ar_matches_hf_greedy(qwen3):
    prompt = torch.arange(10) % 7
    ref = qwen3.generate(prompt[None], max_new_tokens=12, do_sample=False)[0, 10:].tolist()
    out = [t for r in generate(qwen3, build_drafter("ar", qwen3), prompt, GenerationConfig(12)) for t in r.tokens]
    assert out == ref
