"""`treegen train dflash` on a tiny target: the recipe's pieces, and that training raises acceptance."""
from __future__ import annotations

import json

import torch
from click.testing import CliRunner
from conftest import TINY_CORPUS

from treegen.drafters.vocab import DRAFT_VOCAB, load_vocab
from treegen.train.cli import train
from treegen.train.dflash import block_lengths, block_mask, sample_anchors


def test_block_mask_sees_context_before_anchor_and_own_block():
    anchors = torch.tensor([[2, 5]])
    mask = block_mask(anchors, seq_len=8, block=3)[0, 0]          # [6, 8 + 6]
    assert mask[0, :8].tolist() == [True, True] + [False] * 6     # first block: context before position 2
    assert mask[3, :8].tolist() == [True] * 5 + [False] * 3       # second block: before position 5
    assert mask[0, 8:].tolist() == [True] * 3 + [False] * 3       # own block only, both directions
    assert mask[5, 8:].tolist() == [False] * 3 + [True] * 3


def test_a_shorter_block_hides_its_rows_past_its_end():
    mask = block_mask(torch.tensor([[2, 5]]), seq_len=8, block=3, lengths=torch.tensor([[2, 3]]))[0, 0]
    assert mask[0, 8:].tolist() == [True, True] + [False] * 4     # the first block is 2 long
    assert mask[2, 8:].tolist() == [True, True] + [False] * 4     # its row past the end sees the same keys
    assert mask[5, 8:].tolist() == [False] * 3 + [True] * 3       # the second is whole
    lengths = block_lengths(64, 16, 10, 0.5, torch.Generator().manual_seed(0))
    assert lengths.min() >= 2 and lengths.max() == 10 and 0.3 < (lengths < 10).float().mean() < 0.7


def test_training_a_cut_block_is_drafting_a_short_one():
    """A block cut to length L in training (--short-blocks) computes what drafting's L-row block computes
    (drafters/dflash.py runs only a tree's depths), and cutting no block leaves the loss as it was."""
    import dataclasses

    from conftest import tiny_qwen3
    from test_dflash import tiny_drafter_config

    from treegen.models.dflash import DFlashDrafter
    from treegen.train.dflash import block_pass, dflash_loss

    target = tiny_qwen3()
    torch.manual_seed(2)
    config = tiny_drafter_config(target)
    drafter = DFlashDrafter(config)
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 95, (2, 32), generator=gen)
    anchors = sample_anchors(2, 32, 3, config.block_size, gen)
    short = DFlashDrafter(dataclasses.replace(config, block_size=3))
    short.load_state_dict(drafter.state_dict())
    with torch.no_grad():
        cut, _ = block_pass(drafter, target, ids, anchors, lengths=torch.full((2, 3), 3))
        alone, _ = block_pass(short, target, ids, anchors)
        torch.testing.assert_close(cut[:, :, :3], alone, atol=1e-5, rtol=1e-5)
        whole = torch.full((2, 3), config.block_size)
        torch.testing.assert_close(dflash_loss(drafter, target, ids, anchors, 4.0, lengths=whole)[0],
                                   dflash_loss(drafter, target, ids, anchors, 4.0)[0])


def test_anchors_leave_room_for_context_and_labels():
    a = sample_anchors(4, 32, 8, 16, torch.Generator().manual_seed(0))
    assert a.min() >= 1 and a.max() <= 32 - 16 and a.shape == (4, 8)
    assert all(len(set(row)) == 8 for row in a.tolist())


def learned_target(folder, text: str, steps: int = 150):
    """The tiny target after a short fit to the corpus: a random target has nothing a drafter could learn."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from treegen.train.common import encode_corpus
    from treegen.train.target import train_target

    tok = AutoTokenizer.from_pretrained(tiny_model_dir_of(folder))
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir_of(folder))
    train_target(model, encode_corpus([text], tok), folder / "state", batch=8, seq_len=64, lr=1e-2,
                 max_steps=steps, device="cpu", precision="fp32")
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder


def tiny_model_dir_of(folder):
    return folder.parent / "source"


def test_training_raises_heldout_acceptance(tiny_model_dir, tmp_path):
    """A few hundred steps on the target's own continuations: acceptance well above untrained."""
    import shutil

    data = tmp_path / "corpus.txt"
    data.write_text("".join(TINY_CORPUS))
    shutil.copytree(tiny_model_dir, tmp_path / "source")
    target = learned_target(tmp_path / "target", data.read_text())
    out = tmp_path / "drafter"
    args = ["dflash", "--target", str(target), "--data", str(data), "--out", str(out),
            "--layers", "1", "--block-size", "8", "--steps", "300", "--batch", "8", "--seq-len", "64",
            "--anchors", "8", "--lr", "3e-3", "--regenerate", "64", "--heldout", str(data), "--dtype", "fp32"]
    result = CliRunner().invoke(train, args)
    assert result.exit_code == 0, result.output
    lines = [ln for ln in result.output.splitlines() if ln.startswith("held-out acceptance")]
    before, after = (json.loads(ln.split(": ", 1)[1].replace("'", '"')) for ln in lines)
    assert before["T=0"] < 1.2
    assert after["T=0"] >= before["T=0"] + 0.3, (before, after)  # measured: 1.02 -> 1.42
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == ["DFlashDraftModel"] and cfg["block_size"] == 8
    frequent = load_vocab(out)   # the tokens its head scores when drafting: the data's most frequent
    assert frequent is not None and 0 < len(frequent) <= DRAFT_VOCAB and len(set(frequent.tolist())) == len(frequent)

    # --init continues that drafter (its shape wins over --layers), on a saved stream plus text
    cont = tmp_path / "continued"
    args = ["dflash", "--target", str(target), "--init", str(out), "--data", str(out / "regenerated.pt"),
            "--data", str(data), "--out", str(cont), "--layers", "3", "--steps", "3", "--batch", "2",
            "--seq-len", "64", "--anchors", "4", "--heldout-windows", "2", "--draft-vocab", "7"]
    result = CliRunner().invoke(train, args)
    assert result.exit_code == 0, result.output
    assert "held-out loss" in result.output   # the kept-out windows are scored (here at the end)
    assert "saved to best/" in result.output and (cont / "best" / "config.json").exists()   # the best kept apart
    assert (cont / "best" / "draft_vocab.safetensors").exists()   # a whole published folder, its vocabulary too
    assert len(load_vocab(cont)) == 7   # --draft-vocab: the stream's 7 most frequent
    assert json.loads((cont / "best" / "heldout.json").read_text())["loss"] > 0
    cfg = json.loads((cont / "config.json").read_text())
    assert cfg["block_size"] == 8 and cfg["num_hidden_layers"] == 1


def test_candidate_loss_is_the_full_loss_when_it_covers_the_vocabulary_and_renumbers_labels():
    import torch.nn.functional as F
    from conftest import tiny_qwen3

    from treegen.train.dflash import candidate_logits, frequent_tokens

    target = tiny_qwen3()
    hidden, labels = torch.randn(2, 3, 32), torch.tensor([[5, 7, 5], [90, 1, 7]])
    full, same, none = candidate_logits(target, hidden, labels, None)
    every, renumbered, _ = candidate_logits(target, hidden, labels, torch.arange(96))
    torch.testing.assert_close(F.cross_entropy(every.flatten(0, 1), renumbered.flatten()),
                               F.cross_entropy(full.flatten(0, 1), same.flatten()))
    few, ids, subset = candidate_logits(target, hidden, labels, torch.tensor([3, 5]))   # subset {1, 3, 5, 7, 90}
    assert none is None and subset.tolist() == [1, 3, 5, 7, 90]
    assert few.shape[-1] == 5 and ids.tolist() == [[2, 3, 2], [4, 0, 3]]
    torch.testing.assert_close(few[..., 2], full[..., 5])
    assert frequent_tokens(torch.tensor([4, 4, 4, 9, 9, 2]), 2).tolist() == [4, 9]


def test_soft_loss_from_the_last_layer_states_is_the_one_from_a_forward():
    """dflash's soft term: the target's law from its cached last-layer states (what a feature store keeps)
    equals the one from a forward, over the whole vocabulary and over a candidate subset; soft mixes linearly."""
    from conftest import tiny_qwen3
    from test_dflash import tiny_drafter_config

    from treegen.models.dflash import DFlashDrafter
    from treegen.train.dflash import dflash_loss, target_features

    target = tiny_qwen3()
    torch.manual_seed(1)
    drafter = DFlashDrafter(tiny_drafter_config(target))
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 95, (2, 32), generator=gen)
    anchors = sample_anchors(2, 32, 4, drafter.config.block_size, gen)
    layers, last = drafter.config.target_layer_ids, target.config.num_hidden_layers - 1
    features, final = target_features(target, ids, layers), target_features(target, ids, (last,))
    with torch.no_grad():
        for candidates in (None, torch.tensor([2, 3, 5, 8, 13, 21, 34])):
            hard = dflash_loss(drafter, target, ids, anchors, 4.0, features, candidates)[0]
            forward = dflash_loss(drafter, target, ids, anchors, 4.0, None, candidates, soft=1.0)[0]
            cached = dflash_loss(drafter, target, ids, anchors, 4.0, features, candidates, soft=1.0, final=final)[0]
            half = dflash_loss(drafter, target, ids, anchors, 4.0, features, candidates, soft=0.5, final=final)[0]
            torch.testing.assert_close(cached, forward, atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(half, (hard + cached) / 2)
            assert cached > 0


def test_soft_weight_outside_zero_to_one_is_a_usage_error(tmp_path):
    for command in ("dflash", "treeflash", "domino"):
        args = [command, "--target", "demo", "--data", "x.txt", "--out", str(tmp_path / "o"), "--soft", "1.5"]
        if command == "treeflash":
            args += ["--drafter", "demo"]
        result = CliRunner().invoke(train, args)
        assert result.exit_code == 2 and "--soft" in result.output, result.output
