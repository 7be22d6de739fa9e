"""Tiny real transformers models built in the test process: no network, no downloads."""
from __future__ import annotations

import pytest
import torch


def tiny_qwen3(vocab: int = 96, hidden: int = 32, layers: int = 2, seed: int = 0, max_pos: int = 512):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(seed)
    cfg = Qwen3Config(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden,
                      num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                      head_dim=hidden // 4, max_position_embeddings=max_pos, tie_word_embeddings=False,
                      attn_implementation="sdpa")
    return Qwen3ForCausalLM(cfg).eval()


def tiny_llama(vocab: int = 96, hidden: int = 32, layers: int = 2, seed: int = 0, max_pos: int = 512):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden,
                      num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=max_pos, attn_implementation="sdpa")
    return LlamaForCausalLM(cfg).eval()


@pytest.fixture(scope="session")
def qwen3():
    return tiny_qwen3()


@pytest.fixture(scope="session")
def llama():
    return tiny_llama()
