"""Drawn trees (`draw_shape: tree`): every drawn node's children are drawn from the law its own token
selects, and the engine's recursive rejection sampling keeps the target's distribution exactly; the shape
never depends on the draws; on the demo pair each method's drawn nodes carry the laws they came from."""
from __future__ import annotations

import pytest
import torch
from test_sampled_chain import SampledChainDrafter, t1_trees
from test_sampling_distribution import CONFIGS, PROMPT, chi_square, exact_joint, first_three

from treegen.drafters.base import with_spine
from treegen.drafters.drawn import Level, drawn_tree, first_draws
from treegen.engine.tree import DraftTree
from treegen.engine.tree import drawn_shape as shape


def test_shape_halves_children_per_rank_and_cuts_breadth_first():
    nodes = shape((4, 2, 2), 100)
    parents = [p for p, _, _ in nodes]
    assert parents[:4] == [-1] * 4                       # the anchor's 4 draws
    assert parents[4:7] == [0, 0, 1]                      # rank 0 gets 2 children, rank 1 gets 1, later none
    assert parents[7:] == [4, 4, 5, 6]                    # rank sums 0, 0 -> 2; 1 -> 1; 1 -> 1
    assert all(p < i for i, (p, _, _) in enumerate(nodes))
    assert shape((4, 2, 2), 5) == nodes[:5]               # a budget keeps a breadth-first prefix
    assert [j for p, _, j in nodes if p == 0] == [0, 1]   # a node's children are its first draws, in order


def test_drawn_tree_asks_each_parent_its_law_and_drops_what_a_law_cannot_draw():
    """Depth 1 from the anchor's law; depth 2: a parent's law depends on its token; a law of one token
    gives one child, the rest of that parent's slots are dropped, and their would-be children too."""
    laws = {-1: [0.5, 0.3, 0.2, 0.0], 0: [0.0, 1.0, 0.0, 0.0], 1: [0.25, 0.25, 0.25, 0.25], 2: [0.0, 0.0, 0.0, 1.0]}
    asked = []

    def expand(d, parents, width, up):
        asked.append((d, parents.tolist(), width, up.tolist()))
        q = torch.tensor([laws[int(p)] for p in parents])
        order = q.argsort(dim=-1, descending=True, stable=True)[:, :width]   # a fixed "draw" order: the test's
        return Level(order, q.log().gather(1, order), q)

    tree = drawn_tree(expand, -1, 3, 4, None, "cpu")
    # widths 4, 2, 1: the anchor's 4th draw (q 0) is dropped; depth-1 ranks 0 and 1 get 2 and 1 children,
    # token 0's second draw is dropped (q 0); only the rank-0 chain reaches depth 3
    assert asked == [(0, [-1], 4, [0]), (1, [0, 1], 2, [0, 0]), (2, [1], 1, [0])]
    assert tree.tokens.tolist() == [0, 1, 2, 1, 0, 0]
    assert tree.parents.tolist() == [-1, -1, -1, 0, 1, 3]
    assert tree.law.tolist() == [0, 0, 0, 1, 2, 3] and torch.equal(tree.q[1], torch.tensor(laws[0]))
    assert torch.allclose(tree.scores.exp(), torch.tensor([0.5, 0.3, 0.2, 0.5, 0.075, 0.125]))


class DrawnTreeDrafter(SampledChainDrafter):
    """After the first token: a depth-2 drawn tree (4 draws from q2, then 2 / 1 drawn children by rank); a
    child's law depends on its parent when the parent is one of q2's two likeliest tokens (links), else one
    shared law; `siblings` adds the deterministic nodes of SampledChainDrafter behind it."""
    name = "drawn-tree"
    draw_shape = "tree"   # what `budget: auto` costs the drawn part by

    def propose(self, state) -> DraftTree:
        done = state.tokens.tolist()[len(PROMPT):]
        if len(done) != 1:
            return DraftTree.empty()
        y1 = done[0]
        q2 = self.law(self.l2[y1], self.noise2[y1])
        linked = q2.topk(2).indices
        q3 = torch.stack([self.law(self.l3[y1, a], self.noise3[y1, a]) for a in linked.tolist()]
                         + [self.law(self.l3[y1].mean(0), self.noise3[y1, 0])])
        rows = dict(zip(linked.tolist(), q3[:2]))

        def expand(d, parents, width, up):   # depth 1: q2; depth 2: the parent's own law, or the shared one
            q = torch.stack([q2 if d == 0 else rows.get(int(p), q3[2]) for p in parents])
            return first_draws(q, state, width)

        tree = drawn_tree(expand, y1, 2, 4, None, "cpu")
        if not self.siblings:
            return tree
        tokens, parents, scores = self.top_two(y1)
        det = DraftTree(torch.tensor(tokens), torch.tensor(parents), None, torch.tensor(scores))
        return with_spine(tree, det)


@pytest.mark.parametrize("name, siblings", [("temperature", False), ("top_k", True), ("top_p", True)])
def test_drawn_tree_matches_target_distribution(name, siblings):
    from test_sampling_distribution import TinyCausalLM
    target = TinyCausalLM().eval()
    sampler = CONFIGS[name]
    counts, deep = first_three(target, DrawnTreeDrafter(target, siblings), sampler, 8_000, seed=43)
    stat, threshold = chi_square(counts, exact_joint(target, sampler))
    assert deep > 800, f"depth 2 accepted only {deep} times: the test would not exercise the tree"
    assert stat < threshold, f"{name}: chi-square {stat:.1f} >= {threshold:.1f}"


def test_auto_budget_costs_a_drawn_tree_by_its_shape_and_keeps_the_distribution():
    """`budget: auto` cuts a drawn tree by depth (never by what was drawn), costing each depth by the shape's
    nodes, and the output keeps the target's distribution."""
    from test_sampled_chain import TRIMMING
    from test_sampling_distribution import TinyCausalLM

    from treegen.engine.budget import nominal_counts
    assert nominal_counts(4, 3, "chain") == [4, 2, 1] and nominal_counts(4, 3, "tree") == [4, 3, 1]
    target = TinyCausalLM().eval()
    sampler = CONFIGS["temperature"]
    counts, _ = first_three(target, DrawnTreeDrafter(target, True), sampler, 8_000, seed=47, verify_cost=TRIMMING)
    stat, threshold = chi_square(counts, exact_joint(target, sampler))
    assert stat < threshold, f"chi-square {stat:.1f} >= {threshold:.1f}"


@pytest.mark.parametrize("method, drafter", [("ddtree", "demo"), ("treeflash", "demo/treeflash"),
                                             ("dartree", "demo/domino"), ("d2sd", "demo")])
def test_demo_methods_draw_trees(method, drafter, monkeypatch):
    """On the shipped pair with `draw_shape: tree`: T=0 unchanged (equal to ar); at T=1 drawn nodes below
    depth 1 hang under more than one parent, each draft possible under its law, scores its path log q."""
    trees = t1_trees(method, drafter, {"draw_shape": "tree"}, monkeypatch)
    for tree in (t for t in trees if t.drawn > 16):
        n = tree.drawn
        drawn, parents = tree.tokens[:n], tree.parents[:n]
        assert bool((tree.q[tree.law[:n]].gather(1, drawn[:, None]) > 0).all())
        assert len(set(parents[tree.depth[:n] == 2].tolist())) > 1
        logq = tree.q[tree.law[:n]].gather(1, drawn[:, None])[:, 0].log()
        own = tree.scores[:n] - torch.where(parents >= 0, tree.scores[:n][parents.clamp(min=0)], 0.0)
        assert torch.allclose(own, logq, atol=1e-3)
    assert any(t.drawn > 16 for t in trees)


def test_treeflash_support_draws_are_draws_from_the_laws_it_reports():
    """TreeFlash's drawn tree under a plain temperature over a support (synthetic tables: 3 depths, 6
    tokens, support 3, 2 candidates): at a branching depth a node's first two draws follow its reported law
    q and q's second draw without replacement; in the tail (the tables' rows, the rest by Gumbel-max) its
    one draw follows q too, for a parent inside and outside the top-m."""
    from types import SimpleNamespace

    from treegen.drafters.treeflash import Scored, TreeFlashDrafter
    from treegen.engine.drafter import DraftState
    from treegen.engine.sampling import Sampler

    g = torch.Generator().manual_seed(3)
    depth, vocab, hidden = 3, 6, 4
    marginal = torch.randn(depth, vocab, generator=g) * 1.5
    logp = marginal.log_softmax(-1)
    support = marginal.topk(3, dim=-1).indices
    scored = Scored(marginal.topk(2, dim=-1).indices, support, torch.randn(depth, 2, 3, generator=g))
    lm_head, embed = torch.randn(vocab, hidden, generator=g), torch.randn(vocab, hidden, generator=g)
    state = DraftState(torch.tensor([0]), 4, Sampler(temperature=0.8), torch.Generator().manual_seed(5))
    me = SimpleNamespace(law=state, draws=2, block=SimpleNamespace(lm_head=SimpleNamespace(weight=lm_head), vocab=None))
    me.tail_draws = lambda *a: TreeFlashDrafter.tail_draws(me, *a)
    me.outside = lambda support: TreeFlashDrafter.outside(me, support)

    def states(d, prev):
        return embed[prev] + d

    outside = next(t for t in range(vocab) if t not in scored.top_m[0].tolist())
    cases = [(0, 4, 2), (1, int(scored.top_m[0, 1]), 1), (1, outside, 1)]   # (depth, parent token, draws)
    n = 12_000
    for d, parent, width in cases:
        first, pairs = torch.zeros(vocab, dtype=torch.float64), torch.zeros(vocab * vocab, dtype=torch.float64)
        for _ in range(n):
            expand, stack = TreeFlashDrafter.support_draws(me, states, scored, logp)
            level = expand(d, torch.tensor([parent]), width, torch.tensor([0]))
            drawn = level.tokens[0].tolist()
            first[drawn[0]] += 1
            if width == 2:
                pairs[drawn[0] * vocab + drawn[1]] += 1
        q = stack([level.q])[0].double()
        assert torch.allclose(level.logq[0].double(), q[level.tokens[0]].log(), atol=1e-5)
        checks = [(first, q)]
        if width == 2:
            second = q[:, None] * q[None] / (1 - q[:, None])
            checks.append((pairs, second.fill_diagonal_(0).flatten()))
        for counts, probs in checks:
            stat, threshold = chi_square(counts, probs)
            assert stat < threshold, f"depth {d}, parent {parent}: chi-square {stat:.1f} >= {threshold:.1f}"


def test_auto_budget_narrows_a_drawn_tree_to_each_parents_first_draws_and_keeps_the_distribution(monkeypatch):
    """`budget: auto` also picks the drawn part's width: each parent keeps a prefix of its draw order (its law's
    first draws, by rank, never by what was drawn), here narrower than the drafted 4 in most rounds; the
    output keeps the target's distribution."""
    from test_sampled_chain import TRIMMING
    from test_sampling_distribution import TinyCausalLM

    from treegen.engine import budget

    widths = []
    within = budget.within_shape
    monkeypatch.setattr(budget, "within_shape", lambda *a: widths.append(a[3]) or within(*a))
    target = TinyCausalLM().eval()
    sampler = CONFIGS["top_k"]
    counts, _ = first_three(target, DrawnTreeDrafter(target, True), sampler, 8_000, seed=53, verify_cost=TRIMMING)
    stat, threshold = chi_square(counts, exact_joint(target, sampler))
    assert stat < threshold, f"chi-square {stat:.1f} >= {threshold:.1f}"
    assert sum(w < 4 for w in widths) > len(widths) // 2


def test_within_shape_keeps_a_prefix_of_each_parents_draws():
    from treegen.engine.budget import within_shape

    # anchor -> drawn a0 a1 a2 a3 (depth 1); a0 -> b0 b1, a1 -> c0 (depth 2); a deterministic node d under the anchor
    parents = [-1, -1, -1, -1, 0, 0, 1, -1]
    drawn = [True] * 7 + [False]
    depth = [1, 1, 1, 1, 2, 2, 2, 1]
    assert within_shape(parents, drawn, depth, 4, 2) == [True] * 7 + [False]
    assert within_shape(parents, drawn, depth, 2, 2) == [True, True, False, False, True, False, False, False]
    assert within_shape(parents, drawn, depth, 2, 1) == [True, True, False, False, False, False, False, False]
    assert within_shape(parents, drawn, depth, 1, 2) == [True, False, False, False, True, False, False, False]
