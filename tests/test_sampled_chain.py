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

from treegen.engine import verify
from treegen.engine.tree import DraftTree
from treegen.engine.verify import Verdict


class SampledChainDrafter(ContextFreeDrafter):
    """After the first token: a 2-token chain, each drawn from a law q that mixes the target's own with noise
    and never proposes token 0, the second drawn given the first (as Domino's head draws)."""
    name = "sampled-chain"

    def __init__(self, model, siblings: bool = False):
        _, self.l2, self.l3 = prefix_logits(model)
        self.siblings = siblings   # add deterministic children: the target's top 2 under the anchor, 2 under each
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
        if not self.siblings:
            return DraftTree.chain(torch.tensor([y2, y3]), q=torch.stack([q2, q3]))
        tokens, parents = [y2, y3], [-1, 0]
        for a in self.l2[y1].topk(2).indices.tolist():   # may repeat y2: dedup merges it into the drawn node
            tokens.append(a), parents.append(-1)
            node = len(tokens) - 1
            for b in self.l3[y1, a].topk(2).indices.tolist():
                tokens.append(b), parents.append(node)
        tokens.append(int(self.l3[y1, y2].argmax())), parents.append(0)   # a deterministic sibling of y3
        return DraftTree(torch.tensor(tokens), torch.tensor(parents), q=torch.stack([q2, q3]))


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
    assert torch.equal(chain.truncate_depth(2).q, torch.eye(4)[1:3])
    # a spine of 2 and deterministic nodes, one a twin of the spine's first: its subtree moves under the spine
    tree = DraftTree(torch.tensor([1, 2, 1, 3, 0]), torch.tensor([-1, 0, -1, 2, -1]), q=torch.eye(4)[1:3])
    kept = tree.dedup()
    assert kept.tokens.tolist() == [1, 2, 3, 0] and kept.parents.tolist() == [-1, 0, 0, -1]
    assert torch.equal(kept.q, tree.q)


@pytest.mark.parametrize("method, drafter", [("dflash", "demo"), ("domino", "demo/domino"), ("ddtree", "demo"),
                                             ("treeflash", "demo/treeflash"), ("dartree", "demo/domino"),
                                             ("d2sd", "demo")])
def test_demo_methods_draw_at_t1_and_not_at_t0(method, drafter, monkeypatch):
    """On the shipped pair: T=0 with `sample` drafts as before (equal to ar); at T=1 every tree leads with a
    drawn chain that carries its laws, each draft possible under its own law, deterministic nodes after."""
    import treegen.engine.generate as engine
    from treegen.api import Generator

    ar = Generator(target="demo", method="ar")
    gen = ar.with_method(method, drafter, {"sample": True})
    prompt = "def parse_header(line):\n"
    greedy = ar.generate(prompt, max_new_tokens=24, temperature=0).token_ids
    assert gen.generate(prompt, max_new_tokens=24, temperature=0).token_ids == greedy
    trees = []

    def recording(tree, logits, sampler, generator=None):
        trees.append(tree)
        return verify.verify_tree(tree, logits, sampler, generator)
    monkeypatch.setattr(engine, "verify_tree", recording)
    out = gen.generate(prompt, max_new_tokens=24, temperature=1.0, seed=5)
    assert len(out.token_ids) == 24 and trees
    for tree in (t for t in trees if len(t)):
        assert tree.q is not None and len(tree.q) >= 1
        drawn = tree.tokens[:len(tree.q)]
        assert bool((tree.q.gather(1, drawn[:, None]) > 0).all())
