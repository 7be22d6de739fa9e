"""The drafter's vocabulary (drafters/vocab.py): the head over the frequent tokens and the context's scores
them as the whole head does and gives every other token -inf; a drafter built with it drafts from them only,
and the output stays the target's (T=0: plain decoding's tokens; T>0: the laws with zeros that
test_sampled_chain.py holds to the target's distribution)."""
from __future__ import annotations

import shutil

import pytest
import torch
from conftest import tiny_qwen3
from test_dflash import tiny_drafter_config

from treegen.drafters import MethodError, build_drafter, check_options, get_method
from treegen.drafters.vocab import VOCAB_FILE, DraftHead, frequent_tokens, load_vocab, save_vocab
from treegen.engine.generate import GenerationConfig, generate
from treegen.models.checkpoint import save_dflash
from treegen.models.dflash import DFlashDrafter


def test_frequent_tokens_by_count_then_id():
    stream = torch.tensor([5, 3, 5, 7, 3, 5, 9, 9, 9, 1])
    assert frequent_tokens(stream, 12, 3).tolist() == [5, 9, 3]
    assert frequent_tokens(stream, 12, 100).tolist() == [5, 9, 3, 1, 7]   # only tokens that occur


def test_the_head_scores_its_tokens_as_the_whole_head_and_no_others():
    torch.manual_seed(0)
    full = torch.nn.Linear(16, 40, bias=False)
    head = DraftHead(full, torch.tensor([3, 7, 1]))
    x = torch.randn(2, 5, 16)
    out = head(x)
    assert out.shape == (2, 5, 40)
    kept = torch.tensor([1, 3, 7])
    torch.testing.assert_close(out[..., kept], full(x)[..., kept])
    assert torch.isinf(out[..., [0, 2, 4, 39]]).all()
    head.admit([39, 3, 39])
    torch.testing.assert_close(head(x)[..., 39], full(x)[..., 39])
    head.reset()
    assert torch.isinf(head(x)[..., 39]).all() and head.weight is full.weight


def test_the_vocab_file_round_trips(tmp_path):
    assert load_vocab(tmp_path) is None and load_vocab(None) is None
    save_vocab(tmp_path, torch.tensor([4, 2, 9]))
    assert load_vocab(tmp_path).tolist() == [4, 2, 9]


def test_the_option_takes_auto_or_full_only():
    method = get_method("ddtree")
    assert check_options(method, {"vocab": "full"})["vocab"] == "full"
    with pytest.raises(MethodError):
        check_options(method, {"vocab": "most"})


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    target = tiny_qwen3(vocab=64, seed=2)
    folder = tmp_path_factory.mktemp("drafter")
    torch.manual_seed(1)
    save_dflash(DFlashDrafter(tiny_drafter_config(target)), folder)
    save_vocab(folder, torch.arange(10, 30))
    return target, folder


@pytest.mark.parametrize("method", ["dflash", "ddtree", "treeflash"])
def test_drafts_come_from_the_vocab_and_the_output_is_plain_decodings(pair, method, tmp_path):
    target, folder = pair
    if method == "treeflash":   # a TreeFlash checkpoint: the DFlash backbone and its (zero) head
        from treegen.models.checkpoint import load_dflash
        from treegen.models.treeflash import from_dflash, save_treeflash

        save_treeflash(from_dflash(load_dflash(str(folder))), tmp_path)
        shutil.copy(folder / VOCAB_FILE, tmp_path / VOCAB_FILE)
        folder = tmp_path
    prompt = torch.tensor([40, 41, 42, 12, 13, 14, 40, 41])
    drafter, drafted = build_drafter(method, target, str(folder)), set()
    propose = drafter.propose

    def recorded(state):
        tree = propose(state)
        drafted.update(tree.tokens.tolist())
        return tree

    drafter.propose = recorded
    rounds = list(generate(target, drafter, prompt, GenerationConfig(20)))
    allowed = set(range(10, 30)) | set(prompt.tolist()) | {t for r in rounds for t in r.tokens}
    assert drafted and drafted <= allowed
    out = [t for r in rounds for t in r.tokens]
    ref = target.generate(prompt[None], max_new_tokens=20, do_sample=False)[0, len(prompt):].tolist()
    assert out == ref
    whole = build_drafter(method, target, str(folder), {"vocab": "full"})
    assert [t for r in generate(target, whole, prompt, GenerationConfig(20)) for t in r.tokens] == ref


def test_a_head_that_is_not_a_plain_linear_scores_every_token(pair):
    """A quantized or biased head kept as the target's own module is left whole, not wrapped."""
    target, folder = pair
    drafter = build_drafter("ddtree", target, str(folder), {"vocab": "full"})
    odd = torch.nn.Linear(target.config.hidden_size, 64, bias=True)
    drafter.block.lm_head = odd
    drafter.restrict_vocab(torch.arange(10, 30))
    assert drafter.block.vocab is None and drafter.block.lm_head is odd


@pytest.mark.parametrize("method", ["dflash", "ddtree", "d2sd", "treeflash"])
def test_trees_built_over_the_heads_columns_are_the_whole_vocabularys_trees(pair, method, monkeypatch, tmp_path):
    """The fast path ranks the kept tokens' columns and maps the winners back; the reference widens every
    marginal to the whole vocabulary (-inf outside) first. Same trees, round by round, up to paths whose
    scores tie (the two softmaxes round their normalisers apart: what ties in one may not in the other, and
    a tie between two tokens breaks towards the lower id in one, the earlier column in the other). A head
    scaled up so that the drafts are not all ties."""
    from treegen.drafters.dflash import DFlashBlock
    from treegen.drafters.vocab import Scores

    _, folder = pair
    if method == "treeflash":   # the DFlash backbone and a head with random weights (a zero head is ddtree)
        from treegen.models.checkpoint import load_dflash
        from treegen.models.treeflash import from_dflash, save_treeflash

        torch.manual_seed(3)
        model = from_dflash(load_dflash(str(folder)))
        with torch.no_grad():
            for p in model.ar_approximation.parameters():
                p.normal_(0, 0.5)
        save_treeflash(model, tmp_path)
        shutil.copy(folder / VOCAB_FILE, tmp_path / VOCAB_FILE)
        folder = tmp_path
    target = tiny_qwen3(vocab=64, seed=2)
    with torch.no_grad():
        target.lm_head.weight.mul_(40)
    prompt = torch.tensor([40, 41, 42, 12, 13, 14, 40, 41])

    def trees() -> list:
        options = {"dtype": "fp32"}   # bf16 logits tie often, and a tie may break either way
        if method == "treeflash":      # ranks fewer tokens than the head keeps
            options.update(support=8, top_m=4, top_k=4)
        drafter, out = build_drafter(method, target, str(folder), options), []
        propose = drafter.propose
        drafter.propose = lambda state: out.append(propose(state)) or out[-1]
        list(generate(target, drafter, prompt, GenerationConfig(24)))
        return out

    fast = trees()
    columns = DFlashBlock.scores
    monkeypatch.setattr(DFlashBlock, "scores", lambda self, states: Scores(
        (s := columns(self, states)).widen(s.logits)))
    wide = trees()
    assert len(fast) == len(wide) > 3
    for a, b in zip(fast, wide):
        if not len(a):
            assert not len(b)
            continue
        pa, pb = scored_paths(a), scored_paths(b)
        assert len(pa) == len(pb)
        for path in pa.keys() & pb.keys():
            assert abs(pa[path] - pb[path]) < 1e-4
        only_a, only_b = (sorted(p[k] for k in p.keys() - q.keys()) for p, q in ((pa, pb), (pb, pa)))
        assert len(only_a) < len(pa) // 2 + 1 and all(abs(x - y) < 1e-4 for x, y in zip(only_a, only_b))
    assert any(len(t) > 1 for t in fast)


def scored_paths(tree) -> dict[tuple[int, ...], float]:
    """Each node's root path (its tokens) -> its score."""
    paths: list[tuple[int, ...]] = []
    for token, parent in zip(tree.tokens.tolist(), tree.parents.tolist()):
        paths.append((paths[parent] if parent >= 0 else ()) + (token,))
    return dict(zip(paths, tree.scores.tolist()))


def test_the_heads_columns_name_their_tokens():
    torch.manual_seed(0)
    full = torch.nn.Linear(16, 40, bias=False)
    head = DraftHead(full, torch.tensor([3, 7, 1]))
    head.admit([39, 3, 20])
    x = torch.randn(4, 16)
    scores = head.scores(x)
    assert scores.ids.tolist() == [3, 7, 1, 20, 39] and scores.vocab_size == 40
    torch.testing.assert_close(scores.logits, full(x)[:, scores.ids])
    assert scores.tokens(torch.tensor([0, 4])).tolist() == [3, 39]


@pytest.mark.slow
@pytest.mark.parametrize("method", ["dflash", "ddtree"])
def test_draws_over_the_heads_columns_keep_the_target_distribution(method, tmp_path):
    """At T > 0 a drawn tree is built over the head's columns and its laws widened with zeros: the first three
    tokens' joint law is still the target's (the distribution harness, its real 1-layer Qwen3), and every
    draft and every law's mass lies on the tokens the head scored that round."""
    from test_d2sd import random_drafter
    from test_sampling_distribution import CONFIGS, VOCAB, chi_square, exact_joint, first_three

    model = tiny_qwen3(vocab=VOCAB, hidden=16, layers=1, seed=2)   # as the harness's hf_target
    g = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.copy_(torch.randn(p.shape, generator=g) * 2 / p.shape[1] ** 0.5)
    folder = random_drafter(model, tmp_path / "d", seed=6, block_size=6, layer_ids=(0,))
    save_vocab(folder, torch.tensor([0, 2]))   # and the context's tokens, as they come
    drafter = build_drafter(method, model, folder, {"draws": 2} if method == "ddtree" else {})
    assert drafter.block.vocab is not None
    propose, checked = drafter.propose, []

    def checking(state):
        tree = propose(state)
        kept = drafter.block.vocab.kept
        if len(tree) and tree.q is not None:
            checked.append(bool(kept[tree.tokens].all()) and bool((tree.q[:, ~kept] == 0).all()))
        return tree

    drafter.propose = checking
    sampler = CONFIGS["top_k"]
    counts, _ = first_three(model, drafter, sampler, 1_000, seed=3)
    stat, threshold = chi_square(counts, exact_joint(model, sampler))
    assert stat < threshold, (stat, threshold)
    assert checked and all(checked)
