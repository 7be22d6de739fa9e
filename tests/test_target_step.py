"""engine/target.py: the lazy lm_head (CPU) gives the eager forward's logits, reads only the walked rows,
and generation through either is token-for-token the same."""
from __future__ import annotations

import torch
from conftest import tiny_qwen3

from treegen.drafters import build_drafter
from treegen.engine.cache import new_cache
from treegen.engine.generate import GenerationConfig, generate
from treegen.engine.sampling import Sampler
from treegen.engine.target import Logits, Projection, TargetStep, lazy_logits_supported
from treegen.engine.tree import DraftTree, verification_inputs
from treegen.engine.verify import verify_tree


def step_both(model, tree: DraftTree):
    ids = torch.arange(3, 40)[None]
    out = []
    for lazy in (True, False):
        cache = new_cache(model)
        with torch.inference_mode():
            model(input_ids=ids, cache=cache, use_cache=True)
            inputs = verification_inputs(7, tree, ids.shape[1], model.dtype)
            out.append(TargetStep(model, (0, 1), lazy=lazy)(*inputs, cache))
    return out


def test_lazy_rows_equal_eager_rows(qwen3):
    tree = DraftTree(torch.tensor([5, 6, 7, 8]), torch.tensor([-1, -1, 0, 2]))
    (lazy, lazy_feats), (eager, eager_feats) = step_both(qwen3, tree)
    assert not lazy.eager and eager.eager and len(lazy) == len(eager) == 5
    for i in range(5):
        torch.testing.assert_close(lazy.row(i), eager.row(i), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lazy_feats, eager_feats)


def test_walk_projects_only_its_path(qwen3):
    tree = DraftTree(torch.arange(10, 26), torch.full((16,), -1))   # 16 children of the anchor
    (lazy, _), (eager, _) = step_both(qwen3, tree)
    verdict = verify_tree(tree, lazy, Sampler())
    assert verdict == verify_tree(tree, eager, Sampler())
    assert len(lazy.made) == len(verdict.path) + 1 <= 2   # a one-level tree: the anchor's row, maybe one more


def test_logit_transforms_keep_the_models_forward():
    model = tiny_qwen3()
    assert lazy_logits_supported(model)
    model.config.final_logit_softcapping = 30.0
    assert not lazy_logits_supported(model) and not TargetStep(model).lazy


def test_generation_is_the_same_either_way(qwen3, monkeypatch):
    prompt = torch.tensor([3, 9, 27, 17, 5, 3, 9])
    ddtree = build_drafter("pld", qwen3)
    outs = []
    for lazy in (True, False):
        monkeypatch.setattr("treegen.engine.target.TargetStep.__init__.__defaults__", ((), lazy))
        for sampler, seed in ((Sampler(), None), (Sampler(temperature=0.8, top_p=0.9), 4)):
            rounds = generate(qwen3, ddtree, prompt, GenerationConfig(40, sampler=sampler, seed=seed))
            outs.append([t for r in rounds for t in r.tokens])
    assert outs[0] == outs[2]   # T=0: identical
    assert len(outs[1]) == len(outs[3]) == 40


def run_pld(model, sampler, seed, monkeypatch, whole: bool) -> list[int]:
    """pld (trees of repeated text) with every forward projected whole, or never."""
    def prepare(self, logits):
        self.learn()
        self.last, self.forwards = logits, self.forwards + 1
        if whole and len(logits) > 1:
            logits.project_all()
    monkeypatch.setattr(Projection, "prepare", prepare)
    prompt = torch.tensor([3, 9, 27, 17, 5, 3, 9, 27, 17, 5, 3, 9])
    rounds = generate(model, build_drafter("pld", model), prompt, GenerationConfig(40, sampler=sampler, seed=seed))
    return [t for r in rounds for t in r.tokens]


def test_projecting_all_rows_changes_no_token(qwen3, monkeypatch):
    """The walk reads the same rows and draws the same random numbers whichever way rows were projected:
    T=0 and a seeded T>0 give the same tokens."""
    for sampler, seed in ((Sampler(), None), (Sampler(temperature=0.8, top_p=0.9), 4)):
        assert run_pld(qwen3, sampler, seed, monkeypatch, True) == run_pld(qwen3, sampler, seed, monkeypatch, False)


def test_projection_rule(qwen3, monkeypatch):
    """All rows at once exactly when a * (rows read - 1) > b * (rows - 1), once a round has been seen;
    a is learnt from rows projected alone only, the rows read from the rounds with rows to choose from (not
    the prefill, not a one-row round), as a slow mean kept across generations."""
    head = qwen3.get_output_embeddings()
    key = id(head.weight)
    for table in (Projection._cold, Projection._warm, Projection._reads):
        monkeypatch.setitem(table, key, 0.0)
        del table[key]
    projection = Projection(head, key)
    hidden = torch.zeros(9, qwen3.config.hidden_size)

    def forward(reads: int, rows: int = 9) -> Logits:
        logits = Logits(hidden[:rows], head)
        projection.prepare(logits)
        for i in range(reads):
            logits.row(i)
        return logits

    assert not forward(1).whole                      # the prefill: nothing is known
    assert not forward(4).whole and projection.reads == 1.0   # the prefill's one row is not a round
    assert not forward(1, rows=1).whole and projection.reads == 4.0   # the first round's reads, as they are
    assert projection.key in Projection._cold        # a: from the rows projected alone
    projection.learn()
    assert projection.reads == 4.0                   # a one-row forward is not folded in
    Projection._cold[key], Projection._warm[key] = 1.0, 0.1
    projection.last, Projection._reads[key] = None, 1.7   # 1.0 * 0.7 < 0.1 * 8: alone
    assert not forward(2).whole
    projection.last, Projection._reads[key] = None, 2.0   # 1.0 * 1.0 > 0.1 * 8: at once
    whole = forward(3)
    assert whole.whole and len(whole.made) == 9
    projection.learn()
    assert Projection._cold[key] == 1.0 and projection.reads == 2.1   # rows read 3, weight 0.1
    later = Projection(head, key)                    # the next generation starts from the mean
    assert later.reads == 2.1
