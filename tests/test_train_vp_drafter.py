"""`treegen train vp-drafter`: the visible-prefix law, the loss it shares with DFlash, the command end to end."""
from __future__ import annotations

import json

import pytest
import torch
from click.testing import CliRunner
from conftest import tiny_qwen3
from test_d2sd import random_drafter

from treegen.cli import cli
from treegen.models.checkpoint import load_dflash
from treegen.models.vp_drafter import is_variable_prefix
from treegen.train.dflash import block_loss, dflash_loss, sample_anchors
from treegen.train.vp_drafter import sample_visible, visible_law


def test_visible_law_is_beta_to_the_i_on_2_to_b_minus_1():
    law = visible_law(16, 0.9)
    assert law[:2].sum() == 0 and law[2:].sum() == pytest.approx(1.0)
    assert law[3] / law[2] == pytest.approx(0.9) and law[15] > 0
    v = sample_visible(64, 32, 16, 0.9, torch.Generator().manual_seed(0))
    assert v.min() >= 2 and v.max() <= 15 and (v == 2).float().mean() > (v == 10).float().mean()


def test_loss_counts_only_positions_after_the_prefix(tmp_path):
    target = tiny_qwen3(vocab=64, seed=1)
    drafter = load_dflash(random_drafter(target, tmp_path, seed=2))
    ids = torch.randint(0, 63, (2, 40), generator=torch.Generator().manual_seed(1))
    anchors = sample_anchors(2, 40, 3, 8, torch.Generator().manual_seed(2))
    with torch.no_grad():
        plain, _ = dflash_loss(drafter, target, ids, anchors, 4.0)
        ones, _ = block_loss(drafter, target, ids, anchors, torch.ones_like(anchors), 4.0)
        last, acc = block_loss(drafter, target, ids, anchors, torch.full_like(anchors, 7), 4.0)
    assert plain == ones
    assert acc[1:].sum() == 0  # with 7 of 8 positions shown, only offset 0 is scored
    assert torch.isfinite(last)


def test_train_resume_and_heldout(tiny_model_dir, tmp_path):
    from transformers import AutoConfig

    t = AutoConfig.from_pretrained(tiny_model_dir)
    init = random_drafter(tiny_qwen3(vocab=t.vocab_size), tmp_path / "init", seed=3)
    data = tmp_path / "stream.pt"
    torch.save(torch.randint(0, t.vocab_size - 1, (3000,), dtype=torch.int32), data)
    out = tmp_path / "vp"
    args = ["train", "vp-drafter", "--target", str(tiny_model_dir), "--init", init, "--data", str(data), "--out", str(out),
            "--batch", "2", "--seq-len", "48", "--anchors", "3"]
    result = CliRunner().invoke(cli, args + ["--steps", "2"])
    assert result.exit_code == 0, result.output
    result = CliRunner().invoke(cli, args + ["--steps", "4", "--resume", "--heldout", str(data),
                                               "--heldout-prompts", "2"])
    assert result.exit_code == 0, result.output
    assert torch.load(out / "train_state.pt", weights_only=False)["step"] == 4
    assert is_variable_prefix(load_dflash(str(out)).config)
    report = json.loads((out / "heldout.json").read_text())
    assert {"dflash", "d2sd[untrained]", "d2sd[trained]"} <= set(report)


def test_bad_input_is_one_line(tiny_model_dir, tmp_path):
    from transformers import AutoConfig

    other = random_drafter(tiny_qwen3(vocab=64, hidden=48), tmp_path / "other", seed=4)
    fits = random_drafter(tiny_qwen3(vocab=AutoConfig.from_pretrained(tiny_model_dir).vocab_size), tmp_path / "f", 5)
    bad = tmp_path / "floats.pt"
    torch.save(torch.randn(100), bad)
    for extra, says in ((["--init", other, "--data", str(bad)], "does not fit the target"),
                        (["--init", fits, "--data", str(bad)], "1-D integer tensor"),
                        (["--init", "demo", "--data", str(bad), "--gamma", "0"], "--gamma")):
        result = CliRunner().invoke(cli, ["train", "vp-drafter", "--target", str(tiny_model_dir), "--out",
                                            str(tmp_path / "o"), *extra])
        assert result.exit_code != 0 and says in result.output, result.output
        assert len(result.output.strip().splitlines()) == 1
