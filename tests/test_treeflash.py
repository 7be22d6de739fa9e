"""TreeFlash: the shared best-first builder, the published layout, the zero-head reduction to ddtree,
exactness at T=0 (vs HF greedy) and T>0 (the distribution harness), bad checkpoints, and training."""
from __future__ import annotations

import itertools
import json
import re

import pytest
import torch
from click.testing import CliRunner
from conftest import tiny_qwen3
from test_dflash import Z_LAB_KEYS, tiny_drafter_config
from test_sampling_distribution import CONFIGS, chi_square, exact_joint, first_three, hf_target  # noqa: F401

from treegen.drafters import build_drafter
from treegen.drafters.best_first import best_first, marginal_tree
from treegen.drafters.ddtree import DDTreeDrafter
from treegen.drafters.dflash import DFlashBlock
from treegen.drafters.treeflash import TreeFlashDrafter
from treegen.engine.generate import GenerationConfig, generate
from treegen.models.checkpoint import CheckpointError, save_dflash
from treegen.models.dflash import DFlashDrafter
from treegen.models.treeflash import TreeFlashModel, load_treeflash, save_treeflash

HEAD_KEYS = {"ar_approximation.ug.weight", "ar_approximation.ug.bias", "ar_approximation.d.weight",
             "ar_approximation.norm.weight"}


# --- the shared best-first builder ---------------------------------------------------------------------

def brute_force(logp, tokens, links, budget):
    """Every path through the linked tables, scored; the `budget` best prefixes as (token path) tuples."""
    depth_n, _, k = logp.shape
    paths = []

    def walk(d, row, score, toks):
        for rank in range(k):
            s, t = score + float(logp[d, row, rank]), toks + (int(tokens[d, row, rank]),)
            paths.append((s, t))
            nxt = int(links[d, row, rank])
            if d + 1 < depth_n and nxt >= 0:
                walk(d + 1, nxt, s, t)

    walk(0, 0, 0.0, ())
    return {t for _, t in sorted(paths, key=lambda p: -p[0])[:budget]}


def tree_paths(tree):
    toks, pars, out = tree.tokens.tolist(), tree.parents.tolist(), []
    for i in range(len(toks)):
        path, j = [], i
        while j >= 0:
            path.append(toks[j])
            j = pars[j]
        out.append(tuple(reversed(path)))
    return out


@pytest.mark.parametrize("rows, seed", [(1, 0), (3, 1), (4, 2)])
def test_best_first_is_the_exact_top_budget(rows, seed):
    g = torch.Generator().manual_seed(seed)
    depth_n, k = 4, 3
    logp = torch.log_softmax(torch.randn(depth_n, rows, 8, generator=g) * 2, -1).topk(k, -1).values
    tokens = torch.stack([torch.randperm(8, generator=g)[:k] for _ in range(depth_n * rows)]).view(depth_n, rows, k)
    links = torch.randint(-1, rows, (depth_n, rows, k), generator=g)
    for budget in (1, 5, 17, 40):
        tree = best_first(logp, tokens, links, budget)
        paths = tree_paths(tree)
        assert len(paths) == len(set(paths)) == min(budget, len(brute_force(logp, tokens, links, 10**6)))
        assert set(paths) == brute_force(logp, tokens, links, budget)
        assert all(p < i for i, p in enumerate(tree.parents.tolist()))


def test_marginal_tree_is_the_one_row_case():
    g = torch.Generator().manual_seed(4)
    top = torch.log_softmax(torch.randn(5, 20, generator=g), -1).topk(6, -1)
    tree = marginal_tree(top.values, top.indices, 30)
    ones = torch.zeros(5, 1, 6, dtype=torch.long)
    assert set(tree_paths(tree)) == brute_force(top.values[:, None], top.indices[:, None], ones, 30)


@pytest.mark.parametrize("depth_n, k, budget", [(5, 6, 30), (2, 2, 2), (3, 3, 3), (1, 4, 2), (4, 1, 9)])
def test_marginal_tree_on_host_lists_is_best_first(depth_n, k, budget):
    # a small tree is built from host lists (no tables): the very nodes, order and scores of the general builder
    g = torch.Generator().manual_seed(depth_n * 10 + k)
    top = torch.log_softmax(torch.randn(depth_n, 20, generator=g), -1).topk(k, -1)
    values = top.values.clone()
    values[-1, -1] = -torch.inf   # a token the head does not score: never a node
    fast = marginal_tree(values, top.indices, budget)
    general = best_first(values[:, None], top.indices[:, None], torch.zeros(depth_n, 1, k, dtype=torch.long), budget)
    for name in ("tokens", "parents", "depth", "scores"):
        assert torch.equal(getattr(fast, name), getattr(general, name)), name


# --- the model, its layout and the drafter on tiny real models -------------------------------------------

@pytest.fixture(scope="module")
def target():
    return tiny_qwen3(vocab=64, seed=1)


def random_treeflash(target, seed: int, zero_d: bool = False, block_size: int = 8) -> TreeFlashModel:
    torch.manual_seed(seed)
    model = TreeFlashModel(tiny_drafter_config(target, block_size))
    for name, p in model.named_parameters():  # random norms and a non-zero d: a wrong key cannot hide
        p.data.normal_(0, 0.3 if p.dim() == 2 else 1.0)
    if zero_d:
        model.ar_approximation.d.weight.data.zero_()
    return model.eval()


@pytest.fixture(scope="module")
def tf_dir(target, tmp_path_factory):
    out = tmp_path_factory.mktemp("treeflash")
    save_treeflash(random_treeflash(target, 2), out)
    return out


def test_soft_head_loss_from_cached_last_layer_states_is_the_one_from_a_forward(target):
    """The head's soft term (train/treeflash.py) reads the target's law from a feature store's last-layer
    states, where it took a target forward before: the same loss, and soft mixes linearly."""
    from treegen.train.dflash import sample_anchors, target_features
    from treegen.train.treeflash import treeflash_loss

    model = random_treeflash(target, 3)
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 63, (2, 32), generator=gen)
    anchors = sample_anchors(2, 32, 4, model.config.block_size, gen)
    features = target_features(target, ids, model.model.config.target_layer_ids)
    final = target_features(target, ids, (target.config.num_hidden_layers - 1,))
    with torch.no_grad():
        hard = treeflash_loss(model, target, ids, anchors, 4.0, 0.0, features)[0]
        forward = treeflash_loss(model, target, ids, anchors, 4.0, 1.0, features)[0]
        cached = treeflash_loss(model, target, ids, anchors, 4.0, 1.0, features, final)[0]
        half = treeflash_loss(model, target, ids, anchors, 4.0, 0.5, features, final)[0]
    torch.testing.assert_close(cached, forward, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(half, (hard + cached) / 2)


def test_published_layout_and_round_trip(tf_dir, tmp_path):
    from safetensors import safe_open

    cfg = json.loads((tf_dir / "config.json").read_text())
    assert cfg["treeflash_config"] == {"ar_approximation": "swiglu", "candidate_tokens": 16}
    assert cfg["architectures"] == ["TreeFlashDraftModel"] and cfg["dflash_config"]["mask_token_id"] == 63
    with safe_open(tf_dir / "model.safetensors", "pt") as f:
        assert set(f.keys()) == {"model." + k for k in Z_LAB_KEYS} | HEAD_KEYS
        assert f.get_tensor("ar_approximation.ug.weight").shape == (2 * 64, 2 * 32)
    a = load_treeflash(str(tf_dir))
    save_treeflash(a, tmp_path)
    b = load_treeflash(str(tmp_path))
    assert a.ar_approximation.d.weight.abs().sum() > 0
    h, e = torch.randn(5, 32), torch.randn(5, 32)
    assert torch.equal(a.corrected(h, e), b.corrected(h, e))
    block, ctx = torch.randn(1, 8, 32), torch.randn(1, 5, 32)
    pos_b, pos_c = torch.arange(5, 13)[None], torch.arange(5)[None]
    assert torch.equal(a.model(block, pos_b, ctx, pos_c), b.model(block, pos_b, ctx, pos_c))


@pytest.mark.parametrize("support", [0, 40])
def test_zero_head_builds_ddtrees_tree(target, support):
    """The paper's reduction: with d = 0 every conditional is the marginal, so the tree is ddtree's (with as
    many candidates a depth as children kept, top_m = top_k, every child links on as ddtree's do)."""
    model = random_treeflash(target, 3, zero_d=True)
    block = DFlashBlock(model.model, target)
    tf = TreeFlashDrafter(block, model, budget=40, top_m=16, support=support)
    dd = DDTreeDrafter(block, budget=40, top_k=16)
    g = torch.Generator().manual_seed(5)
    for anchor in range(6):
        hidden = torch.randn(7, 32, generator=g) * 3
        a = best_first(*tf.tables(hidden, anchor), 40)
        b = dd.tree(torch.log_softmax(target.get_output_embeddings()(model.model.norm(hidden)), -1))
        assert a.tokens.tolist() == b.tokens.tolist() and a.parents.tolist() == b.parents.tolist()
        torch.testing.assert_close(a.scores, b.scores, atol=1e-4, rtol=1e-5)


def test_trained_head_changes_the_tree_and_links_only_top_m(target, tf_dir):
    model = load_treeflash(str(tf_dir))
    block = DFlashBlock(model.model, target)
    tf = TreeFlashDrafter(block, model, budget=40, top_m=4, top_k=6, support=0)
    hidden = torch.randn(7, 32, generator=torch.Generator().manual_seed(6)) * 3
    logp, tokens, links = tf.tables(hidden, 5)
    assert logp.shape == tokens.shape == links.shape == (7, 4, 6)
    assert not torch.equal(tokens[1, 0], tokens[1, 1])      # rows differ: conditioned on the previous token
    top_m = target.get_output_embeddings()(model.model.norm(hidden)).topk(4, -1).indices
    for d, r, c in itertools.product(range(6), range(4), range(6)):
        link = int(links[d, r, c])
        assert (link >= 0) == (int(tokens[d, r, c]) in top_m[d].tolist())
        assert link < 0 or int(top_m[d, link]) == int(tokens[d, r, c])
    assert (links[-1] == -1).all()
    dd = DDTreeDrafter(block, budget=40)
    marg = dd.tree(torch.log_softmax(target.get_output_embeddings()(model.model.norm(hidden)), -1))
    assert tree_paths(best_first(logp, tokens, links, 40)) != tree_paths(marg)


@pytest.fixture(scope="module")
def greedy_refs(target):
    """20 prompts (every third a repeated span, so the target loops and drafts get accepted) and HF greedy."""
    gen, out = torch.Generator().manual_seed(3), []
    for i in range(20):
        prompt = torch.randint(0, 63, (int(torch.randint(1, 30, (1,), generator=gen)),), generator=gen)
        prompt = prompt.repeat(3) if i % 3 == 0 else prompt
        out.append((prompt, target.generate(prompt[None], max_new_tokens=24, do_sample=False)[0, prompt.numel():]))
    return out


@pytest.mark.parametrize("support", [0, 24])
def test_greedy_exact_with_a_nonzero_head(target, tf_dir, greedy_refs, support):
    drafter = build_drafter("treeflash", target, str(tf_dir), {"budget": 24, "support": support})
    branched = 0
    for i, (prompt, ref) in enumerate(greedy_refs):
        rounds = list(generate(target, drafter, prompt, GenerationConfig(24)))
        assert [t for r in rounds for t in r.tokens] == ref.tolist(), f"prompt {i}"
        assert all(r.drafted <= 24 for r in rounds)
        branched += sum(r.drafted > r.depth for r in rounds[1:])
    assert branched > 0


@pytest.mark.parametrize("name, options, deep_min", [("top_k", {}, 200),
                                                     ("temperature", {"top_m": 2, "top_k": 2, "support": 4}, 40)])
def test_sampling_follows_the_target_distribution(hf_target, name, options, deep_min):  # noqa: F811 (imported fixture)
    """T > 0 through the enumeration harness of test_sampling_distribution, on its real 1-layer Qwen3; with a
    plain temperature and a support smaller than the vocabulary the drawn chain takes linked_chain's path."""
    torch.manual_seed(7)
    model = TreeFlashModel(tiny_drafter_config(hf_target, block_size=4, layer_ids=(0,)))
    for p in model.parameters():
        p.data.normal_(0, 0.5 if p.dim() == 2 else 1.0)
    drafter = TreeFlashDrafter(DFlashBlock(model.model.eval(), hf_target), model.eval(), budget=48, **options)
    drafter.draws = 2
    sampler = CONFIGS[name]
    counts, deep = first_three(hf_target, drafter, sampler, 800, seed=3)
    stat, threshold = chi_square(counts, exact_joint(hf_target, sampler))
    assert deep > deep_min and stat < threshold, (deep, stat, threshold)


def test_linked_chain_draws_from_the_law_it_reports():
    """The linked drawn chain (plain temperature, a support): the first depth's law depends on the anchor alone,
    so its draws over many rounds must follow the q it reports (the law verification divides by)."""
    from treegen.api import Generator
    from treegen.engine.drafter import DraftState
    from treegen.engine.sampling import Sampler

    drafter = Generator(target="demo", method="treeflash").draft_model
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        weight = drafter.block.embed.weight
        hidden = torch.randn(6, weight.shape[1], generator=g).to(weight.dtype)
        parts = drafter.parts(hidden)
        for t in (1.0, 0.6):
            drafter.law = DraftState(torch.tensor([5]), 8, Sampler(temperature=t), g)
            counts, q = torch.zeros(parts[0].logits.shape[-1], dtype=torch.float64), None
            for _ in range(2000):
                tree = drafter.drawn_chain(hidden, 5, parts)
                counts[tree.tokens[0]] += 1
                q = tree.q[0] if q is None else q
            stat, threshold = chi_square(counts, q.double())
            assert stat < threshold, f"T={t}: chi-square {stat:.1f} >= {threshold:.1f}"


# --- bad input -------------------------------------------------------------------------------------------

def edit_checkpoint(src, dst, drop=None, reshape=None, config=None):
    from safetensors.torch import load_file, save_file

    dst.mkdir()
    state = load_file(src / "model.safetensors")
    if drop:
        del state[drop]
    if reshape:
        state[reshape] = state[reshape][:-1]
    save_file(state, dst / "model.safetensors")
    cfg = json.loads((src / "config.json").read_text())
    (dst / "config.json").write_text(json.dumps(config(cfg) if config else cfg))
    return dst


def test_bad_checkpoints_fail_in_one_line(target, tf_dir, tmp_path):
    cases = {
        "missing": (edit_checkpoint(tf_dir, tmp_path / "a", drop="ar_approximation.d.weight"),
                    "weights missing for 1 tensors, e.g. ar_approximation.d.weight"),
        "shape": (edit_checkpoint(tf_dir, tmp_path / "b", reshape="ar_approximation.ug.bias"),
                  "ar_approximation.ug.bias has shape (127,), config says (128,)"),
        "no head config": (edit_checkpoint(tf_dir, tmp_path / "c", config=lambda c: {
            k: v for k, v in c.items() if k != "treeflash_config"}), "not a TreeFlash checkpoint"),
    }
    for name, (folder, phrase) in cases.items():
        with pytest.raises(CheckpointError, match=re.escape(phrase)) as err:
            build_drafter("treeflash", target, str(folder))
        assert "\n" not in str(err.value), name
    other = tiny_qwen3(vocab=64, hidden=48, seed=1)
    with pytest.raises(CheckpointError, match="TreeFlash drafter does not fit the target: hidden size 32 != target's 48"):
        build_drafter("treeflash", other, str(tf_dir))
    dflash_dir = tmp_path / "dflash"
    save_dflash(DFlashDrafter(tiny_drafter_config(target)), dflash_dir)
    with pytest.raises(CheckpointError, match="no treeflash_config"):
        build_drafter("treeflash", target, str(dflash_dir))


@pytest.mark.parametrize("options, phrase", [({"budget": 0}, "budget'? must be >= 1"),
                                             ({"support": 4}, "support must be 0"),
                                             ({"temperature": 0.0}, "temperature must be > 0"),
                                             ({"support": "all"}, "support must be an integer")])
def test_bad_options(target, tf_dir, options, phrase):
    with pytest.raises(ValueError, match=phrase):
        build_drafter("treeflash", target, str(tf_dir), options)


def test_cli_refuses_a_checkpoint_for_another_target(tiny_model_dir, tf_dir):
    from treegen.cli import cli

    result = CliRunner().invoke(cli, ["complete", "-", "--target", str(tiny_model_dir), "--method", "treeflash",
                                      "--drafter", str(tf_dir), "-n", "4"], input="def f(x):\n")
    assert result.exit_code == 1 and result.stderr.count("\n") == 1, result.output
    assert "TreeFlash drafter does not fit the target" in result.stderr and "Traceback" not in result.output


def test_token_table_equals_direct_head(target, tf_dir):
    model = load_treeflash(str(tf_dir))
    block = DFlashBlock(model.model, target)
    fast, slow = (TreeFlashDrafter(block, model, support=0) for _ in range(2))
    slow.table = None
    hidden = torch.randn(7, 32, generator=torch.Generator().manual_seed(8)) * 3
    for a, b in zip(fast.tables(hidden, 3), slow.tables(hidden, 3)):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    assert fast.table is not None


# --- training --------------------------------------------------------------------------------------------

def test_train_command_writes_the_layout_and_resumes(tiny_model_dir, tmp_path):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from treegen.train.cli import train

    small = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    backbone = DFlashDrafter(tiny_drafter_config(small))
    save_dflash(backbone, tmp_path / "dflash")
    data = tmp_path / "corpus.txt"
    data.write_text("def add(a, b):\n    return a + b\n" * 40)
    out = tmp_path / "tf"
    args = ["treeflash", "--target", str(tiny_model_dir), "--drafter", str(tmp_path / "dflash"), "--data", str(data),
            "--out", str(out), "--batch", "2", "--seq-len", "48", "--anchors", "2", "--heldout", str(data),
            "--prompts", "1", "--budgets", "6"]
    first = CliRunner().invoke(train, args + ["--steps", "2"])
    assert first.exit_code == 0, first.output
    again = CliRunner().invoke(train, args + ["--steps", "4", "--resume"])
    assert again.exit_code == 0 and "trained 4 steps" in again.output, again.output
    assert "budget 6 treeflash support=64" in again.output and (out / "heldout.json").exists()
    state = load_file(out / "model.safetensors")
    assert set(state) == {"model." + k for k in backbone.state_dict()} | HEAD_KEYS
    for k, v in backbone.state_dict().items():  # the backbone is frozen: written back unchanged
        assert torch.equal(state["model." + k], v), k
    assert state["ar_approximation.d.weight"].abs().sum() > 0   # the head learned
    bad = CliRunner().invoke(train, args[:-2] + ["--budgets", "x"])
    assert bad.exit_code == 1 and "--budgets takes" in bad.output


def test_ddtree_runs_on_a_treeflash_checkpoints_backbone(target, tf_dir):
    """The same backbone with and without the head: ddtree reads a TreeFlash checkpoint too."""
    dd = build_drafter("ddtree", target, str(tf_dir), {"dtype": "fp32"})   # as loaded: no drafting precision cast
    assert torch.equal(dd.block.model.fc.weight, load_treeflash(str(tf_dir)).model.fc.weight)


# --- the shipped demo checkpoint ---------------------------------------------------------------------------

def test_shipped_demo_head_is_exact_and_keeps_the_demo_backbone():
    from test_demo_pair import PROMPTS

    from treegen.assets import DEMO_DRAFTER, DEMO_TARGET, pair_asset
    from treegen.loading import eos_ids, load_target
    from treegen.models.checkpoint import load_dflash

    folder = pair_asset("demo/treeflash")
    cfg = json.loads((folder / "config.json").read_text())
    assert cfg["treeflash_config"]["ar_approximation"] == "swiglu" and cfg["dtype"] == "float16"
    shipped, demo = load_treeflash(str(folder), torch.float16), load_dflash(str(DEMO_DRAFTER), torch.float16)
    assert all(torch.equal(shipped.model.state_dict()[k], v) for k, v in demo.state_dict().items())
    model, tok = load_target(str(DEMO_TARGET), dtype="fp32", device="cpu")
    prompts = [torch.tensor(tok(text)["input_ids"]) for text in PROMPTS]
    refs = [model.generate(p[None], max_new_tokens=32, do_sample=False)[0, p.numel():].tolist() for p in prompts]
    accepted = {}
    for method in ("ddtree", "treeflash"):
        drafter = build_drafter(method, model, str(folder))
        accepted[method] = 0
        for text, prompt, ref in zip(PROMPTS, prompts, refs):
            rounds = list(generate(model, drafter, prompt, GenerationConfig(32, eos_token_ids=eos_ids(model, tok))))
            assert [t for r in rounds for t in r.tokens] == ref, (method, text)
            accepted[method] += sum(r.accepted for r in rounds)
    assert accepted["treeflash"] > 0 and accepted["ddtree"] > 0, accepted


def test_demo_names_resolve_to_shipped_checkpoints():
    from treegen.models.checkpoint import resolve_checkpoint

    assert resolve_checkpoint("demo/treeflash").name == "treeflash"
    with pytest.raises(CheckpointError, match="no such shipped demo checkpoint"):
        resolve_checkpoint("demo/nothing")
