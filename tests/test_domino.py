"""Domino and DARTree: the published head layout, exactness at T=0 (both shift_label values) and T>0,
reduction to dflash / marginal scores with a zero head, and one-line refusals of bad checkpoints."""
from __future__ import annotations

import json

import pytest
import torch
from click.testing import CliRunner
from conftest import tiny_qwen3
from test_dflash import Z_LAB_KEYS, tiny_drafter_config

from treegen.drafters import MethodError, build_drafter
from treegen.drafters.base import DraftState
from treegen.engine.generate import GenerationConfig, generate
from treegen.models.checkpoint import CheckpointError, save_dflash
from treegen.models.dflash import DFlashDrafter
from treegen.models.domino import DominoHead, HeadConfig, load_domino, save_domino
from treegen.train.dflash import target_features

HEAD_KEYS = {"prefix_gru.weight_ih_l0", "prefix_gru.weight_hh_l0", "embed_proj.0.weight", "embed_proj.2.weight"}
TREES = [("dartree", {"budget": 16, "width": 4}), ("dartree", {"variant": "fixed", "budget": 24})]


def random_domino(target, out, head: HeadConfig, seed: int = 2, zero_head: bool = False, block_size: int = 8,
                  layer_ids=(0, 1)):
    """A random drafter and head (norms too, so a wrong key mapping cannot hide) in the published layout."""
    torch.manual_seed(seed)
    backbone = DFlashDrafter(tiny_drafter_config(target, block_size, layer_ids))
    h = DominoHead(target.config.hidden_size, target.config.vocab_size, head)
    for p in [*backbone.parameters(), *h.parameters()]:
        p.data.normal_(0, 0.3 if p.dim() == 2 else 1.0)
    if zero_head:
        h.embed_proj[2].weight.data.zero_()
    save_domino(backbone, h, out)
    return out


@pytest.fixture(scope="module")
def target():
    return tiny_qwen3(vocab=64, seed=1)


@pytest.fixture(scope="module", params=[False, True], ids=["shift0", "shift1"])
def domino_dir(request, target, tmp_path_factory):
    shift = request.param  # the published 8B head: shift_label true, one pure-draft prefix token
    head = HeadConfig(emb_dim=16, gru_hidden_dim=24, shift_label=shift, pure_draft_prefix_len=int(shift))
    return random_domino(target, tmp_path_factory.mktemp("domino"), head)


def test_published_layout_and_round_trip(domino_dir, tmp_path):
    from safetensors import safe_open

    cfg = json.loads((domino_dir / "config.json").read_text())
    extra = cfg["dflash_config"]
    assert extra["projector_type"] == "domino" and extra["emb_dim"] == cfg["emb_dim"] == 16
    assert extra["gru_hidden_dim"] == 24 and {"shift_label", "pure_draft_prefix_len"} <= set(extra)
    with safe_open(domino_dir / "model.safetensors", "pt") as f:
        assert set(f.keys()) == Z_LAB_KEYS | HEAD_KEYS
        assert f.get_tensor("embed_proj.0.weight").shape == (16, 32 + 24)
        assert f.get_tensor("prefix_gru.weight_hh_l0").shape == (3 * 24, 24)
    backbone, head = load_domino(str(domino_dir))
    save_domino(backbone, head, tmp_path)
    again_b, again_h = load_domino(str(tmp_path))
    assert again_h.config == head.config
    for a, b in zip([*backbone.state_dict().items(), *head.state_dict().items()],
                    [*again_b.state_dict().items(), *again_h.state_dict().items()]):
        assert a[0] == b[0] and torch.equal(a[1], b[1])


@pytest.fixture(scope="module")
def greedy_refs(target):
    """20 prompts and the target's own greedy continuations (HF generate, fp32)."""
    gen, refs = torch.Generator().manual_seed(3), []
    for i in range(20):
        n = int(torch.randint(1, 30, (1,), generator=gen))
        prompt = torch.randint(0, 63, (n,), generator=gen)
        if i % 3 == 0:  # repeated spans: the target loops, the drafter gets some right
            prompt = prompt.repeat(3)
        ref = target.generate(prompt[None], max_new_tokens=24, do_sample=False)[0, prompt.numel():]
        refs.append((prompt, ref.tolist()))
    return refs


@pytest.mark.parametrize("method, options", [("domino", {})] + TREES)
def test_greedy_exact(method, options, target, domino_dir, greedy_refs):
    drafter = build_drafter(method, target, str(domino_dir), options)
    for i, (prompt, ref) in enumerate(greedy_refs):
        out = [t for r in generate(target, drafter, prompt, GenerationConfig(24)) for t in r.tokens]
        assert out == ref, f"prompt {i}"


def proposal(drafter, target, prompt: torch.Tensor, max_depth: int = 99):
    """The first tree the drafter proposes after a prefill of `prompt`."""
    feats = target_features(target, prompt[None], drafter.target_layer_ids)[0]
    drafter.begin(prompt[:-1], feats[:-1])
    with torch.no_grad():
        return drafter.propose(DraftState(prompt, max_depth))


def tree_paths_in_order(tree) -> list[tuple[int, ...]]:
    """Each node's token path from the anchor, in node order."""
    out, toks, par = [], tree.tokens.tolist(), tree.parents.tolist()
    for i in range(len(toks)):
        out.append((out[par[i]] if par[i] >= 0 else ()) + (toks[i],))
    return out


def paths(tree) -> set[tuple[int, ...]]:
    return set(tree_paths_in_order(tree))


@pytest.fixture(scope="module")
def zero_dir(target, tmp_path_factory):
    return random_domino(target, tmp_path_factory.mktemp("zero"), HeadConfig(16, 24), zero_head=True)


def test_zero_head_gives_the_dflash_chain(target, zero_dir):
    domino, dflash = build_drafter("domino", target, str(zero_dir)), build_drafter("dflash", target, str(zero_dir))
    for seed in range(4):
        prompt = torch.randint(0, 63, (12,), generator=torch.Generator().manual_seed(seed))
        a, b = proposal(domino, target, prompt), proposal(dflash, target, prompt)
        assert a.tokens.tolist() == b.tokens.tolist() and a.parents.tolist() == b.parents.tolist()
        torch.testing.assert_close(a.scores, b.scores)


def test_zero_head_gives_marginal_scores_and_ddtree(target, zero_dir):
    """Support = the whole vocabulary: every path score is the sum of its marginal log-probs, and the pruned
    tree with width = budget and no depth bonus is exactly DDTree's best-first top-budget."""
    opts = {"candidates": 64, "width": 20, "budget": 20, "depth_bonus": 0.0}
    for seed in range(4):
        prompt = torch.randint(0, 63, (12,), generator=torch.Generator().manual_seed(seed))
        block = build_drafter("ddtree", target, str(zero_dir), {"budget": 20})
        tree = proposal(build_drafter("dartree", target, str(zero_dir), opts), target, prompt)
        ref = proposal(block, target, prompt)
        assert paths(tree) == paths(ref)
        feats = target_features(target, prompt[None], block.target_layer_ids)[0]
        block.begin(prompt[:-1], feats[:-1])
        with torch.no_grad():
            marg = torch.log_softmax(block.block.marginal_logits(int(prompt[-1]), 7), -1)
        for path, score in zip(tree_paths_in_order(tree), tree.scores.tolist()):
            expected = sum(float(marg[d, t]) for d, t in enumerate(path))
            assert abs(score - expected) < 1e-4
        fixed = proposal(build_drafter("dartree", target, str(zero_dir), {"variant": "fixed", "budget": 21}),
                         target, prompt)
        assert len(fixed) == 21 and fixed.depth.bincount().tolist()[1:] == [3] * 7  # ceil(remaining / depths)


def test_dartree_respects_budget_and_branches(target, domino_dir):
    for options, budget in (({"budget": 10}, 10), ({"variant": "fixed", "budget": 30}, 30)):
        drafter = build_drafter("dartree", target, str(domino_dir), options)
        rounds = list(generate(target, drafter, torch.arange(10), GenerationConfig(16)))
        assert all(r.drafted <= budget for r in rounds)
        assert any(r.drafted > r.depth for r in rounds[1:])
    tree = proposal(build_drafter("dartree", target, str(domino_dir)), target, torch.arange(9))
    assert len(paths(tree)) == len(tree) == 64 and (tree.parents < torch.arange(64)).all()


@pytest.mark.parametrize("options, phrase", [({"variant": "wide"}, "option .variant. must be one of"),
                                              ({"width": 0}, "width'? must be >= 1"),
                                              ({"depth_bonus": 0.5}, "depth_bonus must be <= 0"),
                                              ({"budget": "many"}, "option 'budget' must be int")])
def test_bad_options(target, domino_dir, options, phrase):
    with pytest.raises((ValueError, MethodError), match=phrase):
        build_drafter("dartree", target, str(domino_dir), options)


def test_bad_checkpoints(target, domino_dir, tmp_path):
    from safetensors.torch import load_file, save_file

    dflash_only = tmp_path / "dflash"
    save_dflash(DFlashDrafter(tiny_drafter_config(target)), dflash_only)
    with pytest.raises(CheckpointError, match="without a Domino head"):
        build_drafter("dartree", target, str(dflash_only))
    no_gru = tmp_path / "no-gru"
    no_gru.mkdir()
    (no_gru / "config.json").write_text((domino_dir / "config.json").read_text())
    state = load_file(domino_dir / "model.safetensors")
    save_file({k: v for k, v in state.items() if not k.startswith("prefix_gru")}, no_gru / "model.safetensors")
    with pytest.raises(CheckpointError, match="weights missing for 2 tensors, e.g. prefix_gru.weight_hh_l0"):
        build_drafter("domino", target, str(no_gru))
    with pytest.raises(CheckpointError, match="hidden size 32 != target's 48"):
        build_drafter("domino", tiny_qwen3(vocab=64, hidden=48, seed=1), str(domino_dir))
    with pytest.raises(CheckpointError, match="vocabulary 64 != target's 80"):
        build_drafter("dartree", tiny_qwen3(vocab=80, seed=1), str(domino_dir))


def test_cli_refuses_a_dflash_checkpoint_for_dartree(tiny_model_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    from treegen.cli import cli

    target = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    save_dflash(DFlashDrafter(tiny_drafter_config(target)), tmp_path / "dflash")
    args = ["complete", "-", "--target", str(tiny_model_dir), "--method", "dartree", "--drafter",
            str(tmp_path / "dflash"), "-n", "4"]
    result = CliRunner().invoke(cli, args, input="def f(x):\n")
    assert result.exit_code == 1 and result.stderr.count("\n") == 1, result.output
    assert "without a Domino head" in result.stderr and "Traceback" not in result.output


# --- T > 0: the distribution harness of test_sampling_distribution, with a Domino tree ---------------------

def test_sampling_matches_target_distribution(tmp_path):
    from test_sampling_distribution import CONFIGS, VOCAB, chi_square, exact_joint, first_three

    model = tiny_qwen3(vocab=VOCAB, hidden=16, layers=1, seed=2)
    g = torch.Generator().manual_seed(2)
    with torch.no_grad():  # peaked, context-dependent laws, as the harness's real-Qwen3 check uses
        for p in model.parameters():
            if p.dim() == 2:
                p.copy_(torch.randn(p.shape, generator=g) * 2 / p.shape[1] ** 0.5)
    head = HeadConfig(emb_dim=8, gru_hidden_dim=8, shift_label=True, pure_draft_prefix_len=0)
    folder = random_domino(model, tmp_path, head, block_size=4, layer_ids=(0,))
    drafter = build_drafter("dartree", model, str(folder), {"budget": 6, "width": 3})
    sampler = CONFIGS["top_k"]
    counts, deep = first_three(model, drafter, sampler, 1_000, seed=3)
    stat, threshold = chi_square(counts, exact_joint(model, sampler))
    assert deep > 60 and stat < threshold, (deep, stat, threshold)


# --- the shipped demo checkpoint -----------------------------------------------------------------------------

@pytest.mark.parametrize("method, options", [("domino", {}), ("dartree", {"width": 24})])
def test_shipped_demo_head_is_exact_and_drafts_well(method, options):
    from test_demo_pair import PROMPTS

    from treegen.assets import pair_asset
    from treegen.loading import eos_ids, load_target

    model, tok = load_target(str(pair_asset("demo/target")), dtype="fp32", device="cpu")
    drafter = build_drafter(method, model, str(pair_asset("demo/domino")), options)
    tokens = rounds = 0
    for text in PROMPTS:
        prompt = torch.tensor(tok(text)["input_ids"])
        ref = model.generate(prompt[None], max_new_tokens=32, do_sample=False)[0, prompt.numel():].tolist()
        out = list(generate(model, drafter, prompt, GenerationConfig(32, eos_token_ids=eos_ids(model, tok))))
        assert [t for r in out for t in r.tokens] == ref, text
        tokens, rounds = tokens + sum(r.accepted for r in out[1:]), rounds + len(out) - 1
    assert tokens / rounds > 0.25  # drafts are accepted (held-out tau is measured by the trainer, not here)
