"""load_target: local folders in fp32 / bf16, bitsandbytes 4- and 8-bit on the CPU, and one-line LoadErrors."""
from __future__ import annotations

import json
import shutil
import warnings

import pytest
import torch
from transformers import AutoConfig

from treegen.drafters import build_drafter
from treegen.engine.generate import GenerationConfig, generate
from treegen.loading import LoadError, context_length, eos_ids, load_target, load_tokenizer, native_bf16


def one_line_load_error(name: str, match: str, **kwargs) -> str:
    with pytest.raises(LoadError, match=match) as err:
        load_target(name, **kwargs)
    assert "\n" not in str(err.value)
    return str(err.value)


def run(model, prompt: list[int], n: int = 8) -> list[int]:
    rounds = generate(model, build_drafter("pld", model), torch.tensor(prompt), GenerationConfig(n))
    return [t for r in rounds for t in r.tokens]


AUTO_CPU = torch.bfloat16 if native_bf16() else torch.float32   # auto on this CPU


@pytest.mark.parametrize("dtype, torch_dtype", [("fp32", torch.float32), ("auto", AUTO_CPU),
                                                ("bf16", torch.bfloat16)])
def test_local_folder_loads(tiny_model_dir, dtype, torch_dtype):
    model, tok = load_target(str(tiny_model_dir), dtype=dtype, device="cpu")
    assert model.dtype == torch_dtype and model.device.type == "cpu" and not model.training
    assert tok.eos_token_id in eos_ids(model, tok)
    assert context_length(model) == model.config.max_position_embeddings
    ids = tok("def add(a, b):", add_special_tokens=False)["input_ids"]
    out = run(model, ids)
    assert len(out) == 8 and all(0 <= t < model.config.vocab_size for t in out)


def test_fp32_load_matches_transformers_greedy(tiny_model_dir):
    model, tok = load_target(str(tiny_model_dir), dtype="fp32", device="cpu")
    ids = tok("for i in range(10):", add_special_tokens=False)["input_ids"]
    ref = model.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=12, eos_token_id=None,
                         pad_token_id=0)[0, len(ids):].tolist()
    assert run(model, ids, 12) == ref


def test_missing_folder(tmp_path):
    one_line_load_error(str(tmp_path / "nowhere"), "no such folder")
    one_line_load_error("./no-such-dir", "no such folder")


def test_folder_without_config(tmp_path):
    (tmp_path / "weights.bin").write_bytes(b"")
    one_line_load_error(str(tmp_path), "no config.json")


def test_folder_of_a_non_causal_model(tmp_path):
    from transformers import ViTConfig, ViTModel

    ViTModel(ViTConfig(hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32,
                       image_size=8, patch_size=4)).save_pretrained(tmp_path)
    one_line_load_error(str(tmp_path), "not a causal language model")


def test_folder_with_config_but_no_weights(tmp_path, tiny_model_dir):
    (tmp_path / "config.json").write_text((tiny_model_dir / "config.json").read_text())
    one_line_load_error(str(tmp_path), f"cannot load {tmp_path}")


@pytest.mark.parametrize("config_text, match", [("{not json", "not a valid JSON"),
                                                  ('{"model_type": "no_such_arch"}', "not a causal language model")])
def test_folder_with_a_bad_config(tmp_path, config_text, match):
    (tmp_path / "config.json").write_text(config_text)
    one_line_load_error(str(tmp_path), match)


def test_corrupt_or_mismatched_weights(tmp_path, tiny_model_dir):
    for name in ("config.json", "model.safetensors"):
        (tmp_path / name).write_bytes((tiny_model_dir / name).read_bytes())
    (tmp_path / "model.safetensors").write_bytes(b"not a safetensors file" * 8)
    one_line_load_error(str(tmp_path), "cannot load the weights")
    (tmp_path / "model.safetensors").write_bytes((tiny_model_dir / "model.safetensors").read_bytes())
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "hidden_size": 64, "head_dim": 16}))
    one_line_load_error(str(tmp_path), "cannot load the weights")


def test_folder_without_a_tokenizer(tmp_path, tiny_model_dir):
    """transformers 5 would quietly hand back an empty one-token tokenizer here."""
    for name in ("config.json", "model.safetensors"):
        (tmp_path / name).write_bytes((tiny_model_dir / name).read_bytes())
    one_line_load_error(str(tmp_path), "no tokenizer files", device="cpu")


def test_hub_id_offline(monkeypatch):
    import huggingface_hub.constants

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)  # read once, at import
    message = one_line_load_error("no-such-org/no-such-model-xyz", "no-such-org/no-such-model-xyz is not in the local hub cache")
    assert "hub" in message


def test_tokenizer_errors(tmp_path):
    with pytest.raises(LoadError, match="no such folder"):
        load_tokenizer(str(tmp_path / "missing"))


def test_bad_dtype_and_device(tiny_model_dir):
    one_line_load_error(str(tiny_model_dir), "unknown dtype 'int3'", dtype="int3", device="cpu")
    one_line_load_error(str(tiny_model_dir), "unknown device", device="tpu-ish")
    if not torch.cuda.is_available():
        one_line_load_error(str(tiny_model_dir), "no CUDA device", device="cuda")
    one_line_load_error(str(tiny_model_dir), "choose one of", device="cpu", load_in_8bit=True, load_in_4bit=True)


@pytest.fixture(scope="module")
def wide_model_dir(tiny_model_dir, tmp_path_factory):
    """The tiny target at hidden size 64: bitsandbytes 0.50.2's CPU 4-bit kernel needs every input width to
    hold a whole 64-wide quantisation block (at 32 it fails reshaping the block scales)."""
    from conftest import tiny_qwen3

    out = tmp_path_factory.mktemp("wide-target")
    shutil.copytree(tiny_model_dir, out, dirs_exist_ok=True)
    model = tiny_qwen3(vocab=AutoConfig.from_pretrained(tiny_model_dir).vocab_size, hidden=64)
    model.save_pretrained(out)
    return out


@pytest.mark.parametrize("bits", [4, 8])
def test_bitsandbytes_on_cpu(wide_model_dir, bits):
    """bitsandbytes 0.50 has CPU kernels: 4-bit (nf4) and 8-bit load and decode through the engine."""
    pytest.importorskip("bitsandbytes")
    import bitsandbytes as bnb

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # 8-bit casts fp32 inputs to fp16, with a warning per call
        model, tok = load_target(str(wide_model_dir), device="cpu", load_in_4bit=bits == 4,
                                 load_in_8bit=bits == 8)
        layer = (bnb.nn.Linear4bit if bits == 4 else bnb.nn.Linear8bitLt)
        assert isinstance(model.model.layers[0].self_attn.q_proj, layer)
        ids = tok("import os\n", add_special_tokens=False)["input_ids"]
        out = run(model, ids, 10)
    assert len(out) == 10 and all(0 <= t < model.config.vocab_size for t in out)


def test_hub_id_unreachable_fails_at_once(monkeypatch):
    """No network: one line at once, not the hub client's minutes of retries."""
    import socket

    import huggingface_hub.constants

    def refuse(*a, **k):
        raise OSError(101, "Network is unreachable")

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(socket, "create_connection", refuse)
    message = one_line_load_error("no-such-org/no-such-model-xyz", "cannot be reached")
    assert "Network is unreachable" in message
