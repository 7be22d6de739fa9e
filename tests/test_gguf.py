"""GGUF targets: a tiny llama GGUF written here (f32 tensors, a byte-level BPE vocabulary) is converted once
into the cache, read from the cache after, and decodes exactly; bad files and a missing gguf package give one
line and a non-zero exit; an interrupted conversion leaves nothing behind."""
from __future__ import annotations

import contextlib
import os
import shutil
import signal
import sys

import numpy as np
import pytest
import torch
from click.testing import CliRunner

from treegen.cli import cli
from treegen.drafters import build_drafter
from treegen.engine.generate import GenerationConfig, generate
from treegen.loading import LoadError, load_target

gguf = pytest.importorskip("gguf")

MERGES = ["Ġ t", "Ġ a", "h e", "i n", "Ġt he", "r e", "o n", "Ġ s", "e r", "a t", "d e", "Ġ f"]
HIDDEN, FFN, LAYERS, HEADS, KV_HEADS = 64, 128, 2, 4, 2
TEXT = "the cat sat on the mat in the sun"


def write_gguf(path, seed: int = 0, architecture: str = "llama") -> None:
    """A tiny llama as llama.cpp writes one: no output.weight, so the embeddings are tied."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    rng = np.random.default_rng(seed)
    tokens = list(bytes_to_unicode().values()) + [m.replace(" ", "") for m in MERGES] + ["<|endoftext|>"]
    eos = len(tokens) - 1
    w = gguf.GGUFWriter(str(path), architecture)
    w.add_name("tiny")
    w.add_context_length(256)
    w.add_embedding_length(HIDDEN)
    w.add_block_count(LAYERS)
    w.add_feed_forward_length(FFN)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    w.add_rope_dimension_count(HIDDEN // HEADS)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(len(tokens))
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types([1] * eos + [3])     # 3: control, so <|endoftext|> is a special token
    w.add_token_merges(MERGES)
    w.add_bos_token_id(eos)
    w.add_eos_token_id(eos)

    def tensor(name, *shape, mean=0.0, scale=0.1):
        w.add_tensor(name, (mean + rng.standard_normal(shape) * scale).astype(np.float32))

    kv = KV_HEADS * HIDDEN // HEADS
    tensor("token_embd.weight", len(tokens), HIDDEN, scale=1.0)
    for i in range(LAYERS):
        tensor(f"blk.{i}.attn_norm.weight", HIDDEN, mean=1.0)
        tensor(f"blk.{i}.attn_q.weight", HIDDEN, HIDDEN)
        tensor(f"blk.{i}.attn_k.weight", kv, HIDDEN)
        tensor(f"blk.{i}.attn_v.weight", kv, HIDDEN)
        tensor(f"blk.{i}.attn_output.weight", HIDDEN, HIDDEN)
        tensor(f"blk.{i}.ffn_norm.weight", HIDDEN, mean=1.0)
        tensor(f"blk.{i}.ffn_gate.weight", FFN, HIDDEN)
        tensor(f"blk.{i}.ffn_up.weight", FFN, HIDDEN)
        tensor(f"blk.{i}.ffn_down.weight", HIDDEN, FFN)
    tensor("output_norm.weight", HIDDEN, mean=1.0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    path = tmp_path_factory.mktemp("gguf") / "tiny.gguf"
    write_gguf(path)
    return path


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """A fresh cache for each test: the GGUF folders it holds are the test's to inspect."""
    monkeypatch.setenv("TREEGEN_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache" / "gguf"


def logits(model, tok) -> torch.Tensor:
    ids = tok(TEXT, add_special_tokens=False, return_tensors="pt")["input_ids"]
    with torch.no_grad():
        return model(ids).logits


def refuse(*args, **kwargs):
    raise AssertionError("converted again, though the cache holds this file")


def test_first_load_converts_then_the_cache_is_read(tiny_gguf, cache, monkeypatch, capsys):
    from transformers import AutoModelForCausalLM

    model, tok = load_target(str(tiny_gguf), dtype="fp32", device="cpu")
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "converting tiny.gguf once into" in err and "(first load only)" in err
    (folder,) = [p for p in cache.iterdir() if p.is_dir()]
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= {p.name for p in folder.iterdir()}
    assert "quantization_config" not in (folder / "config.json").read_text()
    assert model.config.tie_word_embeddings and model.lm_head.weight is model.model.embed_tokens.weight
    first = logits(model, tok)

    monkeypatch.setattr("treegen.gguf.convert", refuse)
    monkeypatch.setattr("treegen.gguf.read_header", refuse)   # the tensor types are kept in the folder
    again, tok2 = load_target(str(tiny_gguf), dtype="fp32", device="cpu")
    assert capsys.readouterr().err == ""
    assert torch.equal(logits(again, tok2), first)
    # and what transformers itself reads from the GGUF file
    direct = AutoModelForCausalLM.from_pretrained(str(tiny_gguf.parent), gguf_file=tiny_gguf.name,
                                                  dtype=torch.float32).eval()
    assert torch.equal(logits(direct, tok2), first)


def test_a_folder_without_its_tensor_types_reads_them_once(tiny_gguf, cache, monkeypatch):
    from treegen import gguf

    load_target(str(tiny_gguf), dtype="fp32", device="cpu")
    (folder,) = [p for p in cache.iterdir() if p.is_dir()]
    types = gguf.tensor_types(tiny_gguf, folder)
    (folder / gguf.TYPES_FILE).unlink()   # converted before the types were kept
    assert gguf.tensor_types(tiny_gguf, folder) == types
    monkeypatch.setattr("treegen.gguf.read_header", refuse)
    assert gguf.tensor_types(tiny_gguf, folder) == types


def test_a_changed_file_is_converted_again(tiny_gguf, cache, tmp_path, capsys):
    path = tmp_path / "model.gguf"
    shutil.copy(tiny_gguf, path)
    before = logits(*load_target(str(path), dtype="fp32", device="cpu"))
    write_gguf(path, seed=1)
    capsys.readouterr()
    after = logits(*load_target(str(path), dtype="fp32", device="cpu"))
    assert "converting model.gguf" in capsys.readouterr().err
    assert not torch.equal(before, after) and len([p for p in cache.iterdir() if p.is_dir()]) == 2


def test_a_folder_holding_one_gguf_is_a_target(tiny_gguf, cache, tmp_path):
    folder = tmp_path / "only"
    folder.mkdir()
    shutil.copy(tiny_gguf, folder / "tiny.gguf")
    model, _ = load_target(str(folder), dtype="fp32", device="cpu")
    assert model.config.model_type == "llama"
    shutil.copy(tiny_gguf, folder / "other.gguf")
    with pytest.raises(LoadError, match="holds 2 .gguf files"):
        load_target(str(folder), dtype="fp32", device="cpu")


@pytest.mark.parametrize("method", ["ar", "pld"])
def test_greedy_through_the_engine_is_transformers_greedy(tiny_gguf, cache, method):
    model, tok = load_target(str(tiny_gguf), dtype="fp32", device="cpu")
    ids = tok(TEXT + " " + TEXT, add_special_tokens=False)["input_ids"]
    rounds = generate(model, build_drafter(method, model), torch.tensor(ids), GenerationConfig(24))
    ours = [t for r in rounds for t in r.tokens]
    ref = model.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=24, eos_token_id=None,
                         pad_token_id=0)[0, len(ids):].tolist()
    assert ours == ref


def test_an_interrupted_conversion_leaves_no_folder(tiny_gguf, cache, monkeypatch):
    def interrupted(*args, **kwargs):   # the model is already written into the temporary folder
        (tmp,) = [p for p in cache.iterdir() if p.name.endswith(".tmp")]
        assert (tmp / "model.safetensors").exists()
        raise KeyboardInterrupt

    monkeypatch.setattr("treegen.gguf.load_gguf_tokenizer", interrupted)
    with pytest.raises(KeyboardInterrupt):
        load_target(str(tiny_gguf), dtype="fp32", device="cpu")
    assert [p.name for p in cache.iterdir() if p.suffix != ".lock"] == ["index.json"]


def test_an_architecture_transformers_cannot_read(cache, tmp_path):
    path = tmp_path / "odd.gguf"
    write_gguf(path, architecture="nosucharch")
    with pytest.raises(LoadError, match="odd.gguf: transformers cannot read this GGUF .architecture nosucharch, "
                                        "tensor types F32.") as err:
        load_target(str(path), dtype="fp32", device="cpu")
    assert "\n" not in str(err.value) and not any(p.is_dir() for p in cache.iterdir())


def complete(target) -> object:
    return CliRunner().invoke(cli, ["complete", "--target", str(target), "--method", "ar", "-n", "4", "-p", "hi"])


def one_line(result, code: int, phrase: str) -> None:
    assert result.exit_code == code, (result.exit_code, result.output)
    assert "Traceback" not in result.output and result.stdout == "", result.output
    assert result.stderr.startswith("treegen: error: ") and result.stderr.count("\n") == 1, result.stderr
    assert phrase in result.stderr, result.stderr


def test_cli_a_file_that_is_not_gguf(tmp_path, cache):
    path = tmp_path / "fake.gguf"
    path.write_text('{"not": "a model"}')
    one_line(complete(path), 2, "fake.gguf: not a GGUF file")


def test_cli_a_truncated_gguf(tiny_gguf, tmp_path, cache):
    path = tmp_path / "cut.gguf"
    path.write_bytes(tiny_gguf.read_bytes()[:200_000])
    one_line(complete(path), 1, "cut.gguf: not a readable GGUF file (")
    assert [p.name for p in cache.iterdir() if p.suffix != ".lock"] == ["index.json"]


def test_cli_without_the_gguf_package(tiny_gguf, cache, monkeypatch):
    monkeypatch.setitem(sys.modules, "gguf", None)   # `import gguf` raises ImportError
    one_line(complete(tiny_gguf), 1, "needs the gguf package: pip install 'gguf>=0.10'")


def test_cli_runs_a_gguf_target(tiny_gguf, cache):
    result = CliRunner().invoke(cli, ["complete", "--target", str(tiny_gguf), "--method", "ar", "-n", "4",
                                      "-p", "the cat", "--quiet"])
    assert result.exit_code == 0, result.output
    assert result.stderr == ""    # --quiet: not even the one-time conversion notice
    loud = CliRunner().invoke(cli, ["complete", "--target", str(tiny_gguf), "--method", "ar", "-n", "4",
                                    "-p", "the cat", "--quiet"])
    assert loud.exit_code == 0 and loud.stderr == ""   # converted already: the cache is read


def test_the_conversion_notice_is_said_once_without_quiet(tiny_gguf, cache):
    args = ["complete", "--target", str(tiny_gguf), "--method", "ar", "-n", "4", "-p", "the cat"]
    first, second = CliRunner().invoke(cli, args), CliRunner().invoke(cli, args)
    assert first.exit_code == second.exit_code == 0
    assert "converting tiny.gguf once" in first.stderr and "converting" not in second.stderr


RANK_SCRIPT = """
import os, sys, torch, torch.distributed as dist
dist.init_process_group("gloo")
os.environ["TREEGEN_CACHE"] = os.path.join(sys.argv[2], f"rank{dist.get_rank()}")   # each rank converts
from treegen.loading import load_target
model, tok = load_target(sys.argv[1], dtype="fp32", device="cpu")
ids = tok("the cat sat on the mat", add_special_tokens=False, return_tensors="pt")["input_ids"]
with torch.no_grad():
    torch.save(model(ids).logits, os.path.join(sys.argv[2], f"logits{dist.get_rank()}.pt"))
dist.destroy_process_group()
"""


def test_every_rank_of_a_torchrun_job_converts_a_whole_folder(tiny_gguf, tmp_path):
    # transformers' save_pretrained writes no weights outside rank 0; a rank converting its own cache must
    import subprocess

    script = tmp_path / "rank.py"
    script.write_text(RANK_SCRIPT)
    job = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                            str(script), str(tiny_gguf), str(tmp_path)], stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, text=True, start_new_session=True,
                           env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        _, err = job.communicate(timeout=300)
    finally:   # a hung rank must not outlive the test
        with contextlib.suppress(ProcessLookupError):
            os.killpg(job.pid, signal.SIGKILL)
    assert job.returncode == 0, err[-2000:]
    for rank in (0, 1):
        (folder,) = [p for p in (tmp_path / f"rank{rank}" / "gguf").iterdir() if p.is_dir()]
        assert {"config.json", "model.safetensors", "tokenizer.json"} <= {p.name for p in folder.iterdir()}
    assert torch.equal(torch.load(tmp_path / "logits0.pt"), torch.load(tmp_path / "logits1.pt"))
