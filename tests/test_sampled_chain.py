"""Sampled chains (`sample: true` of dflash and domino, and the sampled spine of a tree): drafts drawn from
laws q and verified by speculative sampling keep the target's distribution exactly, whatever q is,
including tokens q never proposes, alone or with deterministic siblings tried on the residual draw; the
check fails for the classic mistake (drawing a rejection's bonus from p instead of norm(max(p - q, 0))).
At T=0 the option changes nothing: the argmax chain, equal to plain decoding."""
from __future__ import annotations

import pytest
import torch
from test_sampling_distribution import (
    CONFIGS,
    PROMPT,
    VOCAB,
    ContextFreeDrafter,
    chi_square,
    exact_joint,
    first_three,
    prefix_logits,
)

from treegen.drafters.base import widths, with_siblings
from treegen.engine import budget, verify
from treegen.engine.tree import DraftTree
from treegen.engine.verify import Verdict


class SampledChainDrafter(ContextFreeDrafter):
    """After the first token: a 2-token chain, each drawn from a law q that mixes the target's own with noise
    and never proposes token 0, the second drawn given the first (as Domino's head draws); `draws` > 1 adds
    drawn siblings (base.with_siblings), `siblings` deterministic nodes, all with path scores for trimming."""
    name = "sampled-chain"

    def __init__(self, model, siblings: bool = False, draws: int = 1):
        _, self.l2, self.l3 = prefix_logits(model)
        self.siblings, self.draws = siblings, draws
        g = torch.Generator().manual_seed(7)
        self.noise2, self.noise3 = torch.rand(VOCAB, VOCAB, generator=g), torch.rand(VOCAB, VOCAB, VOCAB, generator=g)

    @staticmethod
    def law(logits: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
        q = 0.5 * logits.softmax(-1) + 0.5 * noise / noise.sum()
        q[0] = 0.0
        return q / q.sum()

    def propose(self, state) -> DraftTree:
        done = state.tokens.tolist()[len(PROMPT):]
        if len(done) != 1:
            return DraftTree.empty()
        y1 = done[0]
        q2 = self.law(self.l2[y1], self.noise2[y1])
        y2 = int(torch.multinomial(q2, 1, generator=state.generator))
        q3 = self.law(self.l3[y1, y2], self.noise3[y1, y2])
        y3 = int(torch.multinomial(q3, 1, generator=state.generator))
        logq = torch.stack([q2[y2], q3[y3]]).log().cumsum(0)
        spine = with_siblings(DraftTree.chain(torch.tensor([y2, y3]), logq, torch.stack([q2, q3])), state, self.draws)
        if not self.siblings:
            return spine
        tokens, parents, scores = self.top_two(y1, shift=len(spine))
        logp2, logp3 = self.l2[y1].log_softmax(-1), self.l3[y1].log_softmax(-1)
        tokens.append(int(logp3[y2].argmax())), parents.append(0)   # a deterministic sibling of y3
        scores.append(float(logp2[y2] + logp3[y2].max()))
        n = len(tokens)
        return DraftTree(torch.cat([spine.tokens, torch.tensor(tokens)]),
                         torch.cat([spine.parents, torch.tensor(parents)]), None,
                         torch.cat([spine.scores, torch.tensor(scores)]), spine.q,
                         torch.cat([spine.law, torch.full((n,), -1)]))

    def top_two(self, y1: int, shift: int = 0) -> tuple[list[int], list[int], list[float]]:
        """Deterministic nodes (tokens, parents, path scores): the target's top 2 under the anchor, 2 under
        each, numbered from `shift`; they may repeat a drawn token, and dedup merges them into the drawn node."""
        tokens, parents, scores = [], [], []
        logp2, logp3 = self.l2[y1].log_softmax(-1), self.l3[y1].log_softmax(-1)
        for a in logp2.topk(2).indices.tolist():
            tokens.append(a), parents.append(-1), scores.append(float(logp2[a]))
            node = shift + len(tokens) - 1
            for b in logp3[a].topk(2).indices.tolist():
                tokens.append(b), parents.append(node), scores.append(float(logp2[a] + logp3[a, b]))
        return tokens, parents, scores


@pytest.fixture(scope="module")
def target():
    from test_sampling_distribution import TinyCausalLM
    return TinyCausalLM().eval()


@pytest.mark.parametrize("name, siblings", [("temperature", False), ("top_k", False), ("top_p", True),
                                            ("min_p", True)])
def test_sampled_chain_matches_target_distribution(target, name, siblings):
    sampler = CONFIGS[name]
    counts, deep = first_three(target, SampledChainDrafter(target, siblings), sampler, 8_000, seed=23)
    stat, threshold = chi_square(counts, exact_joint(target, sampler))
    assert deep > 800, f"both drafts accepted only {deep} times: the test would not exercise the chain"
    assert stat < threshold, f"{name}: chi-square {stat:.1f} >= {threshold:.1f}"


def bonus_from_p(tree, logits, sampler, generator) -> Verdict:
    """WRONG: a rejected draft's bonus drawn from p itself, which counts p's mass where q already won twice."""
    tokens, path = tree.tokens.tolist(), []
    for i, x in enumerate(tokens):
        p, q = sampler.probs(logits.row(i))[0], tree.q[i]
        if torch.rand(()) * q[x] < p[x]:
            path.append(i)
            continue
        bonus = int(torch.multinomial(p, 1))
        return Verdict(path, tokens[:i] + [bonus], bonus)
    bonus = int(sampler.sample(logits.row(len(tokens)), generator)[0])
    return Verdict(path, tokens + [bonus], bonus)


def test_the_check_sees_a_wrong_residual(target, monkeypatch):
    monkeypatch.setattr(verify, "_walk_with_laws", bonus_from_p)
    sampler = CONFIGS["temperature"]
    counts, _ = first_three(target, SampledChainDrafter(target), sampler, 3_000, seed=31)
    stat, threshold = chi_square(counts, exact_joint(target, sampler))
    assert stat > threshold, f"the wrong residual passed (chi-square {stat:.1f} < {threshold:.1f})"


def test_sampled_nodes_are_a_leading_chain():
    with pytest.raises(ValueError, match="chain"):
        DraftTree(torch.tensor([1, 2]), torch.tensor([-1, -1]), q=torch.full((2, 4), 0.25))
    with pytest.raises(ValueError, match=r"s <= n"):
        DraftTree.chain(torch.tensor([1, 2]), q=torch.full((3, 4), 0.25))
    chain = DraftTree.chain(torch.tensor([1, 2, 3]), torch.tensor([-1.0, -2.0, -3.0]), q=torch.eye(4)[1:4])
    cut = chain.truncate_depth(2)
    assert cut.law.tolist() == [0, 1] and torch.equal(cut.q, chain.q)   # q stays whole; the laws index it
    # a spine of 2 and deterministic nodes, one a twin of the spine's first: its subtree moves under the spine
    tree = DraftTree(torch.tensor([1, 2, 1, 3, 0]), torch.tensor([-1, 0, -1, 2, -1]), q=torch.eye(4)[1:3])
    kept = tree.dedup()
    assert kept.tokens.tolist() == [1, 2, 3, 0] and kept.parents.tolist() == [-1, 0, 0, -1]
    assert torch.equal(kept.q, tree.q) and kept.law.tolist() == [0, 1, -1, -1]
    with pytest.raises(ValueError, match="drawn nodes first"):
        DraftTree(torch.tensor([1, 2]), torch.tensor([-1, -1]), q=torch.eye(4)[:1], law=torch.tensor([-1, 0]))
    with pytest.raises(ValueError, match="share one law"):
        DraftTree(torch.tensor([1, 2]), torch.tensor([-1, -1]), q=torch.eye(4)[:2], law=torch.tensor([0, 1]))


def test_siblings_are_later_draws_of_the_same_law():
    """draws=4: 4 drawn children at depth 1, 2 at depth 2, 1 after; each a distinct token of its law's support,
    listed after the chain in draw order; a law with a small support gets no more draws than it has tokens."""
    from treegen.drafters.base import DraftState
    assert widths(4, 4) == [4, 2, 1, 1] and widths(1, 2) == [1, 1] and widths(3, 3) == [3, 1, 1]
    q = torch.full((3, 8), 1 / 8)
    q[1] = torch.tensor([0.5, 0.5, 0, 0, 0, 0, 0, 0])   # two tokens: one sibling at most
    chain = DraftTree.chain(torch.tensor([3, 1, 5]), torch.tensor([-2.0, -2.7, -4.8]), q)
    tree = with_siblings(chain, DraftState(torch.tensor([0]), 8, None, torch.Generator().manual_seed(0)), 4)
    assert tree.drawn == len(tree) == 3 + 3 + 1
    assert tree.law.tolist() == [0, 1, 2, 0, 0, 0, 1] and tree.parents.tolist() == [-1, 0, 1, -1, -1, -1, 0]
    first = [t for t, law in zip(tree.tokens.tolist(), tree.law.tolist()) if law == 0]
    assert len(set(first)) == 4 and tree.tokens[6] == 0   # without replacement; depth 2's other token
    assert torch.allclose(tree.scores[3:6], torch.full((3,), -2.0794), atol=1e-3)
    state = DraftState(torch.tensor([0]), 8, None, torch.Generator().manual_seed(1))
    for nodes, shape in ((6, [-1, 0, -1, -1, -1, 0]), (5, [-1, -1, -1, -1]), (2, [-1, -1]), (3, [-1, 0, 1])):
        cut = with_siblings(chain, state, 4 if nodes != 3 else 1, nodes)   # whole depths that fit, >= 1
        assert cut.parents.tolist() == shape and len(cut) <= nodes


@pytest.mark.parametrize("name", ["temperature", "top_p"])
def test_drawn_siblings_match_target_distribution(target, name):
    """Four drawn children at depth 1, two at depth 2, deterministic nodes beside them: recursive rejection
    sampling over draws without replacement keeps p, and the siblings do get taken."""
    sampler = CONFIGS[name]
    drafter = SampledChainDrafter(target, siblings=True, draws=4)
    counts, deep = first_three(target, drafter, sampler, 8_000, seed=29)
    stat, threshold = chi_square(counts, exact_joint(target, sampler))
    assert deep > 800, f"two drafts accepted only {deep} times: the test would not exercise the siblings"
    assert stat < threshold, f"{name}: chi-square {stat:.1f} >= {threshold:.1f}"


# forward times that make `budget: auto` keep some nodes and drop others, round by round
TRIMMING = budget.VerifyCost((1, 2, 3, 5, 64), (1.0, 1.15, 1.3, 1.9, 60.0))


def test_auto_budget_trim_keeps_the_distribution_of_drawn_trees(target):
    """`budget: auto` at T > 0 drops deterministic nodes by score and drawn ones only by depth."""
    sampler = CONFIGS["temperature"]
    drafter = SampledChainDrafter(target, siblings=True, draws=2)
    counts, _ = first_three(target, drafter, sampler, 8_000, seed=37, verify_cost=TRIMMING)
    stat, threshold = chi_square(counts, exact_joint(target, sampler))
    assert stat < threshold, f"chi-square {stat:.1f} >= {threshold:.1f}"


def trim_drawn_by_score(self, tree, shape="chain"):
    """WRONG: drawn nodes trimmed by path score like deterministic ones: a draft kept for being likely."""
    scores, order = torch.sort(tree.scores.float().cpu(), descending=True, stable=True)
    keep = torch.zeros(len(tree), dtype=torch.bool)
    keep[order[:self.choose(scores)]] = True
    return tree.select(keep)


def test_the_check_sees_drawn_nodes_trimmed_by_score(target, monkeypatch):
    monkeypatch.setattr(budget.AutoBudget, "trim_drawn", trim_drawn_by_score)
    sampler = CONFIGS["temperature"]
    counts, _ = first_three(target, SampledChainDrafter(target), sampler, 4_000, seed=41, verify_cost=TRIMMING)
    stat, threshold = chi_square(counts, exact_joint(target, sampler))
    assert stat > threshold, f"trimming drawn nodes by score passed (chi-square {stat:.1f} < {threshold:.1f})"


@pytest.mark.parametrize("method, drafter", [("dflash", "demo"), ("domino", "demo/domino"), ("ddtree", "demo"),
                                             ("treeflash", "demo/treeflash"), ("dartree", "demo/domino"),
                                             ("d2sd", "demo")])
def test_demo_methods_draw_at_t1_and_not_at_t0(method, drafter, monkeypatch):
    """On the shipped pair: T=0 with `sample` drafts as before (equal to ar); at T=1 every tree leads with its
    drawn nodes, which carry their laws, each draft possible under its own law, deterministic nodes after; a
    tree method draws 16 children of the anchor by default (`draws`), a chain method one."""
    trees = t1_trees(method, drafter, {"sample": True}, monkeypatch)
    for tree in (t for t in trees if len(t)):
        assert tree.q is not None and tree.drawn >= 1
        drawn = tree.tokens[:tree.drawn]
        assert bool((tree.q[tree.law[:tree.drawn]].gather(1, drawn[:, None]) > 0).all())
        first = int((tree.law == tree.law[0]).sum())   # the drawn children of the anchor
        assert first == (1 if method in ("dflash", "domino") else 16), f"{method}: {first} drawn at depth 1"


def t1_trees(method: str, drafter: str, options: dict, monkeypatch) -> list[DraftTree]:
    """The method on the shipped pair: its T=0 output must equal ar's; the trees it verified at T=1."""
    import treegen.engine.generate as engine
    from treegen.api import Generator

    ar = Generator(target="demo", method="ar")
    gen = ar.with_method(method, drafter, options)
    prompt = "def parse_header(line):\n"
    greedy = ar.generate(prompt, max_new_tokens=24, temperature=0).token_ids
    assert gen.generate(prompt, max_new_tokens=24, temperature=0).token_ids == greedy
    trees = []

    def recording(tree, logits, sampler, generator=None):
        trees.append(tree)
        return verify.verify_tree(tree, logits, sampler, generator)
    monkeypatch.setattr(engine, "verify_tree", recording)
    assert len(gen.generate(prompt, max_new_tokens=24, temperature=1.0, seed=5).token_ids) == 24 and trees
    return trees
