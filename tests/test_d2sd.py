"""D2SD: rejection points, the prefix-tree merge, the batched VP pass, exactness (T=0 and T>0), bad input."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import tiny_qwen3
from test_dflash import tiny_drafter_config
from test_sampling_distribution import CONFIGS, VOCAB, chi_square, exact_joint, first_three, hf_target  # noqa: F401

from treegen.drafters import build_drafter
from treegen.drafters.base import DraftState
from treegen.drafters.d2sd import alternative_points, keep_best, rejection_points
from treegen.engine.generate import GenerationConfig, generate
from treegen.engine.tree import DraftTree, merge_paths
from treegen.models.checkpoint import CheckpointError, load_dflash, save_dflash
from treegen.models.dflash import DFlashDrafter
from treegen.models.vp_drafter import is_variable_prefix, save_vp_drafter


def random_drafter(target, out, seed, vp=False, **config):
    torch.manual_seed(seed)
    model = DFlashDrafter(tiny_drafter_config(target, **config))
    for p in model.parameters():
        p.data.normal_(0, 0.3 if p.dim() == 2 else 1.0)
    (save_vp_drafter if vp else save_dflash)(model, out)
    return str(out)


@pytest.fixture(scope="module")
def target():
    return tiny_qwen3(vocab=64, seed=1)


@pytest.fixture(scope="module")
def dflash_dir(target, tmp_path_factory):
    return random_drafter(target, tmp_path_factory.mktemp("dflash"), seed=2)


@pytest.fixture(scope="module")
def vp_dir(target, tmp_path_factory):
    return random_drafter(target, tmp_path_factory.mktemp("vp"), seed=3, vp=True)


# --- pieces --------------------------------------------------------------------------------------------

def paths_of(tree: DraftTree) -> set[tuple[int, ...]]:
    """Every root-to-node token sequence of the tree."""
    toks, parents = tree.tokens.tolist(), tree.parents.tolist()
    seqs: list[tuple[int, ...]] = []
    for t, p in zip(toks, parents):
        seqs.append((seqs[p] if p >= 0 else ()) + (t,))
    return set(seqs)


def no_duplicate_siblings(tree: DraftTree) -> bool:
    pairs = list(zip(tree.parents.tolist(), tree.tokens.tolist()))
    return len(pairs) == len(set(pairs))


def test_merge_paths_shares_prefixes_once():
    tokens = torch.tensor([[5, 6, 7, 8], [5, 6, 9, 9], [5, 6, 7, 1], [3, 6, 7, 8], [5, 6, 7, 8]])
    lengths = torch.tensor([4, 4, 3, 4, 2])
    scores = -torch.arange(20, dtype=torch.float).view(5, 4) / 10
    scores[2] += 1  # path 2 rates the shared [5, 6, 7] higher
    tree = merge_paths(tokens, lengths, scores)
    assert len(tree) == 4 + 2 + 4  # 5-6-7-8, then -9-9 under 5-6, then a new root 3-6-7-8
    assert tree.tokens[:4].tolist() == [5, 6, 7, 8] and tree.parents[:4].tolist() == [-1, 0, 1, 2]
    assert no_duplicate_siblings(tree) and (tree.parents < torch.arange(len(tree))).all()
    want = {tuple(row[:n]) for row, n in zip(tokens.tolist(), lengths.tolist())}
    assert want <= paths_of(tree)
    assert tree.depth.tolist() == [1, 2, 3, 4, 3, 4, 1, 2, 3, 4]
    torch.testing.assert_close(tree.scores[:4], torch.tensor([0.2, 0.1, 0.0, -0.3]))  # best of the sharers


def test_keep_best_is_parent_closed():
    tree = merge_paths(torch.tensor([[1, 2, 3], [1, 4, 5], [6, 7, 8]]), torch.tensor([3, 3, 3]),
                       torch.tensor([[-0.1, -0.2, -0.9], [-0.1, -0.3, -0.4], [-0.15, -0.5, -0.6]]))
    kept = keep_best(tree, 4)
    assert kept.tokens.tolist() == [1, 2, 4, 6] and kept.parents.tolist() == [-1, 0, 0, -1]
    assert keep_best(tree, 0) is tree


def test_rejection_points_are_the_top_r():
    conf = torch.tensor([0.9, 0.5, 0.95, 0.2, 0.99, 0.6])
    r = [float(torch.prod(conf[:i]) * (1 - conf[i])) for i in range(len(conf))]
    want = sorted(sorted(range(len(r)), key=lambda i: -r[i])[:3])
    assert rejection_points(conf, 3).tolist() == want
    assert rejection_points(conf, 10).tolist() == list(range(6))


def test_alternative_points_rank_position_token_pairs():
    probs = torch.tensor([[0.7, 0.2, 0.1, 0.0], [0.4, 0.3, 0.2, 0.1], [0.1, 0.1, 0.1, 0.7]])
    conf, draft = probs.max(dim=-1)
    points, alts, alt_probs = alternative_points(probs, conf, 3)
    # gains: reach (1, .7, .28) x the non-draft probabilities: (0,1)->.2, (1,1)->.21, (1,2)->.14, (0,2)->.1 ...
    assert list(zip(points.tolist(), alts.tolist())) == [(0, 1), (1, 1), (1, 2)]
    torch.testing.assert_close(alt_probs, torch.tensor([0.2, 0.3, 0.2]))
    assert not (alts == draft[points]).any()


def test_batched_branches_equal_separate_passes(target, vp_dir):
    """P branches in one pass over the shared context cache == each branch alone with its own cache."""
    from treegen.drafters.dflash import DFlashBlock

    model = load_dflash(vp_dir)
    feats = torch.randn(9, 2 * 32)
    blocks = torch.randint(0, 63, (3, 12))
    together = DFlashBlock(model, target)
    together.begin(feats)
    with torch.no_grad():
        out = together.run(blocks)
        for p in range(3):
            alone = DFlashBlock(model, target)
            alone.begin(feats)
            torch.testing.assert_close(out[p], alone.run(blocks[p:p + 1])[0], atol=1e-5, rtol=1e-5)
    assert together.cache.length == 9  # the context went in once


def recorder(f, log: list):
    def wrapped(*args):
        log.append(f(*args))
        return log[-1]
    return wrapped


@pytest.mark.parametrize("branch", ["point", "token"])
def test_every_branch_is_in_the_tree(target, dflash_dir, vp_dir, branch):
    for b2 in (8, 14):
        drafter = build_drafter("d2sd", target, dflash_dir, {"vp_drafter": vp_dir, "k": 3, "b2": b2, "branch": branch})
        prompt = torch.randint(0, 63, (11,), generator=torch.Generator().manual_seed(b2))
        with torch.no_grad():
            feats = torch.cat([h[0] for h in target(prompt[None], output_hidden_states=True).hidden_states[1:3]], -1)
            drafter.begin(prompt, feats)
            seen = []
            drafter.branches = recorder(drafter.branches, seen)
            tree = drafter.propose(DraftState(prompt, 100))
        tokens = seen[0][0]
        assert tokens.shape == (3 + (b2 > 8), b2 - 1)
        assert {tuple(row) for row in tokens.tolist()} <= paths_of(tree)
        assert no_duplicate_siblings(tree) and int(tree.depth.max()) == b2 - 1


# --- exactness -----------------------------------------------------------------------------------------

@pytest.mark.parametrize("options, prompts", [({}, 20), ({"b2": 13, "k": 2}, 10),
                                              ({"k": 1, "budget": 9, "skip_rejected": False}, 6),
                                              ({"branch": "token", "k": 5}, 20),
                                              ({"branch": "token", "k": 3, "b2": 13}, 8)])
def test_greedy_exact(target, dflash_dir, vp_dir, options, prompts):
    drafter = build_drafter("d2sd", target, dflash_dir, {"vp_drafter": vp_dir, **options})
    gen = torch.Generator().manual_seed(3)
    for i in range(prompts):
        n = int(torch.randint(1, 30, (1,), generator=gen))
        prompt = torch.randint(0, 63, (n,), generator=gen)
        if i % 3 == 0:  # repeated spans: the target's greedy output loops, the drafters get some right
            prompt = prompt.repeat(3)
        ref = target.generate(prompt[None], max_new_tokens=24, do_sample=False)[0, prompt.numel():].tolist()
        rounds = list(generate(target, drafter, prompt, GenerationConfig(24)))
        assert [t for r in rounds for t in r.tokens] == ref, f"prompt {i}"
        assert all(r.drafted <= options.get("budget", 10 ** 6) for r in rounds)


@pytest.mark.slow
@pytest.mark.parametrize("branch", ["point", "token"])
def test_sampling_follows_the_target(hf_target, tmp_path, branch):  # noqa: F811 (the harness's fixture)
    """T>0 through the distribution harness: the first three tokens' joint law on a real 1-layer Qwen3."""
    model = hf_target
    kw = {"block_size": 6, "layer_ids": (0,)}
    first = random_drafter(model, tmp_path / "first", seed=6, **kw)  # seeds whose drafts the target often takes
    vp = random_drafter(model, tmp_path / "vp", seed=7, vp=True, **kw)
    drafter = build_drafter("d2sd", model, first, {"vp_drafter": vp, "k": 2, "b2": 8, "branch": branch})
    assert drafter.first.model.config.mask_token_id == VOCAB - 1
    sampler = CONFIGS["top_k"]
    counts, deep = first_three(model, drafter, sampler, 1_000, seed=3)
    stat, threshold = chi_square(counts, exact_joint(model, sampler))
    assert deep > 150 and stat < threshold, (deep, stat, threshold)  # measured: deep ~300


# --- bad input -----------------------------------------------------------------------------------------

def test_bad_options_and_checkpoints(target, dflash_dir, vp_dir, tmp_path, capsys):
    with pytest.raises(ValueError, match="option .k. must be >= 1, got 0"):   # checked before any checkpoint loads
        build_drafter("d2sd", target, dflash_dir, {"vp_drafter": vp_dir, "k": 0})
    with pytest.raises(ValueError, match="b2 must be 0"):
        build_drafter("d2sd", target, dflash_dir, {"vp_drafter": vp_dir, "b2": 4})
    with pytest.raises(ValueError, match="option .branch. must be one of point, token"):
        build_drafter("d2sd", target, dflash_dir, {"vp_drafter": vp_dir, "branch": "tokens"})
    other = tiny_qwen3(vocab=64, hidden=48, seed=1)
    with pytest.raises(CheckpointError, match="hidden size"):
        build_drafter("d2sd", target, dflash_dir, {"vp_drafter": random_drafter(other, tmp_path / "o", 6, True)})
    with pytest.raises(CheckpointError, match="reads target layers \\[1\\]"):
        build_drafter("d2sd", target, dflash_dir,
                      {"vp_drafter": random_drafter(target, tmp_path / "l", 7, True, layer_ids=(1,))})
    capsys.readouterr()
    drafter = build_drafter("d2sd", target, dflash_dir, {"vp_drafter": dflash_dir})  # allowed, with a note
    assert "plain DFlash drafter" in capsys.readouterr().err and drafter.vp.model is drafter.first.model


def test_cli_bad_input_is_one_line(tiny_model_dir, tmp_path):
    from click.testing import CliRunner

    from treegen.cli import cli

    model = tiny_qwen3(vocab=300)  # the tiny_model_dir target's shape: its weights do not matter here
    drafter = random_drafter(model, tmp_path / "d", seed=8)
    for options, says, status in (({"k": 0}, "option 'k' must be >= 1, got 0", 2),   # usage: before loading
                                  ({"vp_drafter": str(tmp_path / "none")}, "no such drafter folder", 1)):
        preset = tmp_path / "p.yaml"
        preset.write_text(json.dumps({"target": str(tiny_model_dir), "drafter": drafter, "method": "d2sd",
                                      "method_options": options}))
        result = CliRunner().invoke(cli, ["complete", "--preset", str(preset), "-n", "4", "-"], input="def f(x):")
        assert result.exit_code == status and says in result.output, result.output
        assert "Traceback" not in result.output and len(result.output.strip().splitlines()) == 1


def test_vp_marker_round_trip(vp_dir, dflash_dir, tmp_path):
    cfg = json.loads((Path(vp_dir) / "config.json").read_text())
    assert cfg["dflash_config"]["variable_prefix"] is True and cfg["architectures"] == ["DFlashDraftModel"]
    assert is_variable_prefix(load_dflash(vp_dir).config) and not is_variable_prefix(load_dflash(dflash_dir).config)
    save_dflash(load_dflash(vp_dir), tmp_path / "copy")  # a plain rewrite keeps the marker
    assert is_variable_prefix(load_dflash(str(tmp_path / "copy")).config)


@pytest.mark.parametrize("name", ["d2sd", "d2sd-32", "d2sd-token"])
def test_demo_presets_exact_and_drafting(name):
    """The shipped presets: both drafters of the demo pair load, and the output is the target's greedy one."""
    from treegen import presets
    from treegen.assets import DEMO_TARGET
    from treegen.loading import eos_ids, load_target

    preset = presets.load(name)
    model, tok = load_target(str(DEMO_TARGET), dtype="fp32", device="cpu")
    drafter = build_drafter(preset.method, model, preset.drafter, dict(preset.method_options))
    assert is_variable_prefix(drafter.vp.model.config) and drafter.vp.model is not drafter.first.model
    prompt = torch.tensor(tok("class Stack:\n    def __init__(self):\n")["input_ids"])
    ref = model.generate(prompt[None], max_new_tokens=40, do_sample=False)[0, prompt.numel():].tolist()
    rounds = list(generate(model, drafter, prompt, GenerationConfig(40, eos_token_ids=eos_ids(model, tok))))
    assert [t for r in rounds for t in r.tokens] == ref
    assert sum(r.accepted for r in rounds) > 0
