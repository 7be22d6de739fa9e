"""`treegen train domino`: the teacher-forced head is the inference head, the loss mixes as published, and the
command writes a resumable run and Domino's published layout."""
from __future__ import annotations

import json

import pytest
import torch
from click.testing import CliRunner
from test_dflash import tiny_drafter_config

from treegen.models.checkpoint import save_dflash
from treegen.models.dflash import DFlashDrafter
from treegen.models.domino import DominoHead, HeadConfig, HeadTables, load_domino
from treegen.train.cli import train
from treegen.train.dflash import dflash_loss, sample_anchors
from treegen.train.domino import DominoTrainConfig, domino_loss, new_head


def test_teacher_forcing_matches_the_inference_cell():
    """Row i of the training pass == the per-step path the drafters take (GRU cell from the anchor's state)."""
    torch.manual_seed(0)
    vocab, hidden = 40, 12
    embed = torch.randn(vocab, hidden)
    head = DominoHead(hidden, vocab, HeadConfig(emb_dim=6, gru_hidden_dim=10))
    tokens, z = torch.randint(0, vocab, (5,)), torch.randn(5, hidden)
    with torch.no_grad():
        trained = head.teacher_forced(z[None], embed[tokens][None])[0]
    t = HeadTables(head, embed)
    h = t.root_state(tokens[:1])
    for i in range(5):
        step = t.hidden_part(z[i:i + 1] @ t.w_z.T, h) @ t.w2.T
        torch.testing.assert_close(step[0], trained[i], atol=1e-5, rtol=1e-5)
        if i + 1 < 5:
            h = t.gru_step(tokens[i + 1:i + 2], h)


@pytest.fixture(scope="module")
def target():
    from conftest import tiny_qwen3
    return tiny_qwen3(vocab=64, seed=1)


@pytest.mark.parametrize("shift", [False, True])
def test_loss_starts_at_dflash_and_mixes_lambda(target, shift):
    torch.manual_seed(1)
    backbone = DFlashDrafter(tiny_drafter_config(target))
    head = new_head(backbone, DominoTrainConfig(emb_dim=8, gru_hidden_dim=8, shift_label=shift))
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 63, (2, 32), generator=gen)
    anchors = sample_anchors(2, 32, 4, 8 + shift, gen)
    with torch.no_grad():
        at_zero, acc = domino_loss(backbone, head, target, ids, anchors, 4.0, 0.0, False)
        assert acc.shape == (8 if shift else 7,)
        if not shift:  # a zero last layer: the corrected logits are DFlash's, so is the loss
            torch.testing.assert_close(at_zero, dflash_loss(backbone, target, ids, anchors, 4.0)[0])
        head.embed_proj[2].weight.normal_()
        corrected = domino_loss(backbone, head, target, ids, anchors, 4.0, 0.0, False)[0]
        base = domino_loss(backbone, head, target, ids, anchors, 4.0, 1.0, False)[0]
        half = domino_loss(backbone, head, target, ids, anchors, 4.0, 0.5, False)[0]
    torch.testing.assert_close(base, at_zero)
    torch.testing.assert_close(half, (corrected + base) / 2)


def test_soft_mixes_the_kl_to_the_targets_own_law(target):
    """soft: (1 - soft) * hard CE + soft * KL(target || corrected) over the same positions; the KL term is the
    hard CE against the target's own row minus its entropy, checked here from the target's forward alone."""
    from treegen.train.dflash import soft_mix, target_features, target_pass

    torch.manual_seed(3)
    backbone = DFlashDrafter(tiny_drafter_config(target))
    head = new_head(backbone, DominoTrainConfig(emb_dim=8, gru_hidden_dim=8))
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 63, (2, 32), generator=gen)
    anchors = sample_anchors(2, 32, 4, 8, gen)
    with torch.no_grad():
        hard = domino_loss(backbone, head, target, ids, anchors, 4.0, 0.0, False)[0]
        full = domino_loss(backbone, head, target, ids, anchors, 4.0, 0.0, False, soft=1.0)[0]
        half = domino_loss(backbone, head, target, ids, anchors, 4.0, 0.0, False, soft=0.5)[0]
        torch.testing.assert_close(half, (hard + full) / 2)
        last = target.config.num_hidden_layers - 1   # the same law from the cached last-layer states
        features = target_features(target, ids, backbone.config.target_layer_ids)
        cached = domino_loss(backbone, head, target, ids, anchors, 4.0, 0.0, False, features, soft=1.0,
                             final=target_features(target, ids, (last,)))[0]
        torch.testing.assert_close(cached, full, atol=1e-5, rtol=1e-5)
        _, logits = target_pass(target, ids, backbone.config.target_layer_ids)
        rows = (anchors[..., None] + torch.arange(7)).flatten(1)                 # row anchor + k predicts label k
        own = logits.gather(1, rows[..., None].expand(-1, -1, 64)).view(2, 4, 7, 64)
        weights = torch.exp(-torch.arange(7).float() / 4.0)
        zero = soft_mix(torch.tensor(0.0), own, own, weights, 1.0)  # the target's own law: KL 0
    torch.testing.assert_close(zero, torch.tensor(0.0), atol=1e-5, rtol=0)
    assert full > 0


@pytest.fixture
def dflash_dir(tiny_model_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    target = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    save_dflash(DFlashDrafter(tiny_drafter_config(target)), tmp_path / "dflash")
    return tmp_path / "dflash"


@pytest.mark.parametrize("recipe", ["head", "joint"])
def test_cli_trains_resumes_and_writes_the_published_layout(recipe, tiny_model_dir, dflash_dir, tmp_path):
    stream = tmp_path / "stream.pt"
    torch.save(torch.randint(0, 250, (3000,), dtype=torch.int32), stream)
    out = tmp_path / "out"
    args = ["domino", "--target", str(tiny_model_dir), "--dflash", str(dflash_dir), "--data", str(stream),
            "--out", str(out), "--recipe", recipe, "--emb-dim", "8", "--gru-dim", "12", "--batch", "2",
            "--seq-len", "32", "--anchors", "4", "--shift-label"]
    first = CliRunner().invoke(train, [*args, "--steps", "2"])
    assert first.exit_code == 0, first.output
    assert torch.load(out / "train_state.pt", weights_only=False)["step"] == 2
    again = CliRunner().invoke(train, [*args, "--steps", "4", "--resume"])
    assert again.exit_code == 0, again.output
    assert torch.load(out / "train_state.pt", weights_only=False)["step"] == 4
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["dflash_config"]["projector_type"] == "domino" and cfg["dflash_config"]["shift_label"] is True
    _, head = load_domino(str(out))
    assert head.config == HeadConfig(8, 12, True, 0) and head.embed_proj[2].weight.abs().sum() > 0


def test_cli_bad_input_is_one_line(tiny_model_dir, tmp_path):
    result = CliRunner().invoke(train, ["domino", "--target", str(tiny_model_dir), "--dflash", str(tmp_path),
                                        "--data", str(tmp_path / "x.pt"), "--out", str(tmp_path / "o")])
    assert result.exit_code == 1 and "no config.json" in result.output and "Traceback" not in result.output
