"""The shipped demo pair: it loads offline, drafts well, and every method is exact on it."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from treegen.assets import DEMO_DRAFTER, DEMO_TARGET
from treegen.drafters import build_drafter
from treegen.engine.generate import GenerationConfig, generate
from treegen.loading import eos_ids, load_target

PROMPTS = ["def fib(n):\n", "import os\nimport sys\n\n\ndef main(argv):\n",
           "class Stack:\n    \"\"\"A last-in, first-out stack.\"\"\"\n\n    def __init__(self):\n",
           "    for i in range(len(items)):\n        if"]


@pytest.fixture(scope="module")
def demo():
    return load_target(str(DEMO_TARGET), dtype="fp32", device="cpu")


def test_assets_are_the_published_layout():
    cfg = json.loads((DEMO_DRAFTER / "config.json").read_text())
    assert cfg["architectures"] == ["DFlashDraftModel"] and cfg["block_size"] == 16
    assert (DEMO_TARGET / "tokenizer.json").exists()


@pytest.mark.parametrize("method", ["pld", "dflash", "ddtree"])
def test_greedy_exact_on_demo(demo, method):
    model, tok = demo
    drafter = build_drafter(method, model, str(DEMO_DRAFTER))
    accepted = 0
    for text in PROMPTS:
        prompt = torch.tensor(tok(text)["input_ids"])
        ref = model.generate(prompt[None], max_new_tokens=48, do_sample=False)[0, prompt.numel():].tolist()
        rounds = list(generate(model, drafter, prompt, GenerationConfig(48, eos_token_ids=eos_ids(model, tok))))
        assert [t for r in rounds for t in r.tokens] == ref
        accepted += sum(r.accepted for r in rounds)
    if method != "pld":
        assert accepted > 0  # a trained drafter: verification really took drafted tokens


@pytest.mark.parametrize("method", ["dflash", "ddtree", "treeflash"])
def test_sampled_tokens_with_deterministic_drafts_are_plain_decodings(demo, method):
    """At T > 0 with drafts that are not drawn (`sample: false`), verification draws each token from the target
    with one uniform a row, as plain decoding does: the same seed gives plain decoding's tokens, whatever was
    drafted (what lets such a run take fewer threads on a busy machine: engine/threads.py)."""
    from treegen.assets import local_or_shipped
    from treegen.engine.sampling import Sampler

    model, tok = demo
    path = local_or_shipped("demo/treeflash", "drafter") if method == "treeflash" else str(DEMO_DRAFTER)
    drafter = build_drafter(method, model, path, {"sample": False} | ({} if method == "dflash" else {"budget": 8}))
    plain = build_drafter("ar", model, None)
    accepted = 0
    for seed, text in enumerate(PROMPTS):
        prompt = torch.tensor(tok(text)["input_ids"])
        config = GenerationConfig(40, sampler=Sampler(temperature=0.8), seed=seed)
        rounds = list(generate(model, drafter, prompt, config))
        ref = [t for r in generate(model, plain, prompt, config) for t in r.tokens]
        assert [t for r in rounds for t in r.tokens] == ref, (method, text)
        accepted += sum(r.accepted for r in rounds)
    assert accepted > 0


def test_fresh_complete_prints_code_offline():
    """`echo 'def fib(n):' | treegen complete -n 64`, as a new user types it."""
    env = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "PATH": "/usr/bin:/bin", "TREEGEN_PAIR": "demo"}
    proc = subprocess.run([sys.executable, "-m", "treegen.cli", "complete", "-n", "64"], input="def fib(n):\n",
                          capture_output=True, text=True, timeout=120, env=env, check=False)
    assert proc.returncode == 0, proc.stderr
    assert len(proc.stdout.strip()) > 20
    assert "Traceback" not in proc.stderr


@pytest.fixture(scope="module")
def ar_text():
    from click.testing import CliRunner

    from treegen.cli import cli

    result = CliRunner().invoke(cli, ["complete", "-p", PROMPTS[2], "-n", "24", "--method", "ar"])
    assert result.exit_code == 0
    return result.stdout


@pytest.mark.parametrize("method", ["pld", "dflash", "ddtree", "treeflash", "domino", "dartree", "d2sd"])
def test_every_method_runs_by_name_on_the_demo_pair(method, ar_text):
    """`--method NAME` alone picks the shipped checkpoint that method reads, and the output is ar's."""
    from click.testing import CliRunner

    from treegen.cli import cli

    result = CliRunner().invoke(cli, ["complete", "-p", PROMPTS[2], "-n", "24", "--method", method])
    assert result.exit_code == 0, result.output
    assert result.stdout == ar_text
