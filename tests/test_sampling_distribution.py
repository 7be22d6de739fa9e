"""T > 0 exactness: tokens from generate() with a branching draft tree follow the target's own distribution.

A vocabulary of 8 makes the joint law of the first three tokens (512 cells) small enough to enumerate
exactly from the target's processed probabilities and to check with a chi-square test. The same test
must fail for two known wrong verifiers, which shows it can see the bias it is meant to catch.

Speed: a transformers forward costs ~2 ms here even at 1 layer, so the 20k-sample checks run on
TinyCausalLM, a one-attention-layer model that takes the engine's forward exactly as transformers does
(DynamicCache, position_ids, 4D additive mask); 1-2 ms a sample, most of it the engine. One smaller check
runs on a real 1-layer Qwen3. That the tree rows of real models see the right context is shown
logit by logit in test_cache_compaction.py; here it is the sampling and the verification rule.
"""
from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from conftest import tiny_qwen3
from transformers import PretrainedConfig

import treegen.engine.generate as engine
from treegen.engine.drafter import Drafter
from treegen.engine.generate import GenerationConfig, generate
from treegen.engine.sampling import Sampler
from treegen.engine.tree import DraftTree
from treegen.engine.verify import Verdict

VOCAB = 8
PROMPT = [3, 1, 4, 1, 5]
SAMPLES = 20_000
Z_1E6 = 4.7534  # one-sided standard normal quantile at p = 1e-6: a false alarm is practically impossible

CONFIGS = {
    "temperature": Sampler(temperature=0.9),
    "top_k": Sampler(temperature=1.0, top_k=3),
    "top_p": Sampler(temperature=1.1, top_p=0.85),
    "min_p": Sampler(temperature=1.0, min_p=0.1),
}


class TinyCausalLM(torch.nn.Module):
    """One attention layer over token + position embeddings: next-token laws that depend on the whole
    context, through the same forward contract the engine uses with transformers models."""

    def __init__(self, vocab: int = VOCAB, hidden: int = 16, max_pos: int = 64, seed: int = 0):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.config = PretrainedConfig(num_hidden_layers=1, vocab_size=vocab)  # DynamicCache reads it
        self.emb = torch.nn.Parameter(torch.randn(vocab, hidden, generator=g))
        self.pos = torch.nn.Parameter(torch.randn(max_pos, hidden, generator=g))
        self.qkv = torch.nn.Parameter(torch.randn(hidden, 3 * hidden, generator=g) / hidden ** 0.5)
        self.head = torch.nn.Parameter(torch.randn(hidden, vocab, generator=g) * 2 / hidden ** 0.5)
        self.dtype, self.device = torch.float32, torch.device("cpu")

    def forward(self, input_ids, position_ids=None, attention_mask=None, cache=None, use_cache=True,
                output_hidden_states=False):
        n, past = input_ids.shape[1], cache.get_seq_length() if cache is not None else 0
        if position_ids is None:
            position_ids = torch.arange(past, past + n)[None]
        x = self.emb[input_ids] + self.pos[position_ids]
        q, k, v = (x @ self.qkv).chunk(3, dim=-1)
        if cache is not None:
            k, v = (t[:, 0] for t in cache.update(k[:, None], v[:, None], 0))
        if attention_mask is None:  # the engine's prefill: plain causal, as transformers builds it
            assert past == 0
            h = x + F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=0.25)
        else:
            h = x + F.scaled_dot_product_attention(q, k, v, attn_mask=attention_mask[:, 0], scale=0.25)
        return SimpleNamespace(logits=h @ self.head, hidden_states=(x, h))


@pytest.fixture(scope="module")
def target():
    return TinyCausalLM().eval()


@pytest.fixture(scope="module")
def hf_target():
    """A real 1-layer Qwen3, weights redrawn at a large scale so its laws are peaked and context-dependent."""
    model = tiny_qwen3(vocab=VOCAB, hidden=16, layers=1, seed=2)
    g = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.copy_(torch.randn(p.shape, generator=g) * 2 / p.shape[1] ** 0.5)
    return model


def prefix_logits(model) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Raw logits of y1 [V], y2 | y1 [V, V] and y3 | y1, y2 [V, V, V], from one plain forward (no cache)."""
    pairs = torch.cartesian_prod(torch.arange(VOCAB), torch.arange(VOCAB))
    ids = torch.cat([torch.tensor(PROMPT).expand(len(pairs), -1), pairs], dim=1)
    with torch.no_grad():
        logits = model(input_ids=ids).logits.float()
    l1 = logits[0, -3]
    l2 = logits[:, -2].view(VOCAB, VOCAB, VOCAB)[:, 0]
    l3 = logits[:, -1].view(VOCAB, VOCAB, VOCAB)
    return l1, l2, l3


def exact_joint(model, sampler: Sampler) -> torch.Tensor:
    """P(y1, y2, y3) [V**3] under plain sampling with `sampler`, enumerated prefix by prefix."""
    l1, l2, l3 = prefix_logits(model)
    p1, p2, p3 = (sampler.probs(x).double() for x in (l1, l2, l3))
    return (p1[:, None, None] * p2[:, :, None] * p3).flatten()


class ContextFreeDrafter(Drafter):
    """A test drafter that keeps no context: begin and commit do nothing."""

    def begin(self, prompt, features) -> None:
        pass

    def commit(self, tokens, features) -> None:
        pass


class TableTreeDrafter(ContextFreeDrafter):
    """A fixed, hand-built tree per context: the target's two likeliest tokens under each node, two levels
    deep, plus a duplicate sibling (with its own subtree, merged) and a third level the engine must cut off."""
    name = "table-tree"

    def __init__(self, model):
        _, l2, l3 = prefix_logits(model)
        self.top2 = l2.topk(2, dim=-1).indices.tolist()       # [y1] -> two guesses for y2
        self.top2_3 = l3.topk(2, dim=-1).indices.tolist()     # [y1][y2] -> two guesses for y3

    def propose(self, state) -> DraftTree:
        done = state.tokens.tolist()[len(PROMPT):]
        tokens, parents = [], []

        def add(tok: int, parent: int) -> int:
            tokens.append(tok)
            parents.append(parent)
            return len(tokens) - 1

        if len(done) == 1:
            y1 = done[0]
            for c in self.top2[y1]:
                node = add(c, -1)
                for g in self.top2_3[y1][c]:
                    add((g + 1) % VOCAB, add(g, node))  # the (g + 1) grandchild is one level too deep
            dup = add(self.top2[y1][0], -1)              # duplicate sibling: dedup merges it, child and all
            add(self.top2_3[y1][self.top2[y1][0]][0] ^ 1, dup)
        elif len(done) == 2:
            for c in self.top2_3[done[0]][done[1]]:
                add(c, -1)
        return DraftTree(torch.tensor(tokens, dtype=torch.long), torch.tensor(parents, dtype=torch.long))


def first_three(model, drafter, sampler: Sampler, n: int, seed: int, verify_cost=None) -> tuple[torch.Tensor, int]:
    """Counts [V**3] of the first three tokens over n generations, and how many took both depth-2 drafts.
    verify_cost: trim each tree as `budget: auto` does, by these forward times."""
    torch.manual_seed(seed)  # seed=None below: every generation draws from this one global stream
    config = GenerationConfig(max_new_tokens=4, sampler=sampler, verify_cost=verify_cost)
    counts, deep = torch.zeros(VOCAB ** 3, dtype=torch.float64), 0
    for _ in range(n):
        out, rounds = [], generate(model, drafter, torch.tensor(PROMPT), config)
        for r in rounds:  # stop once three tokens are in: later rounds would only cost time
            out += r.tokens
            deep += r.index == 1 and r.accepted == 2
            if len(out) >= 3:
                break
        rounds.close()
        counts[(out[0] * VOCAB + out[1]) * VOCAB + out[2]] += 1
    return counts, deep


def chi_square(counts: torch.Tensor, probs: torch.Tensor) -> tuple[float, float]:
    """(statistic, threshold at p = 1e-6). Cells expecting < 5 are pooled; the threshold is the
    Wilson-Hilferty chi-square quantile, accurate to a few percent at these degrees of freedom."""
    n = counts.sum()
    expected = probs * n
    assert (counts[probs == 0] == 0).all(), "a token the processed distribution excludes was generated"
    big = expected >= 5
    obs = torch.cat([counts[big], counts[~big].sum()[None]])
    exp = torch.cat([expected[big], expected[~big].sum()[None]])
    keep = exp > 0
    stat = float(((obs[keep] - exp[keep]) ** 2 / exp[keep]).sum())
    df = int(keep.sum()) - 1
    threshold = df * (1 - 2 / (9 * df) + Z_1E6 * math.sqrt(2 / (9 * df))) ** 3
    return stat, threshold


@pytest.mark.slow
@pytest.mark.parametrize("name", list(CONFIGS))
def test_tree_sampling_matches_target_distribution(target, name):
    sampler = CONFIGS[name]
    counts, deep = first_three(target, TableTreeDrafter(target), sampler, SAMPLES, seed=17)
    stat, threshold = chi_square(counts, exact_joint(target, sampler))
    assert deep > SAMPLES // 5, f"the tree took both drafts only {deep} times: the test would not exercise it"
    assert stat < threshold, f"{name}: chi-square {stat:.1f} >= {threshold:.1f}"


def test_real_transformers_target(hf_target):
    """The same check on a real Qwen3 (fewer samples: its forwards are slower)."""
    sampler = CONFIGS["top_k"]
    counts, deep = first_three(hf_target, TableTreeDrafter(hf_target), sampler, 3_000, seed=3)
    stat, threshold = chi_square(counts, exact_joint(hf_target, sampler))
    assert deep > 600 and stat < threshold, (deep, stat, threshold)


def test_plain_decoding_matches_target_distribution(target):
    """The same check without drafts (prefill and empty trees only): the reference path is right too."""
    from treegen.drafters.ar import ARDrafter

    sampler = CONFIGS["top_p"]
    counts, _ = first_three(target, ARDrafter(), sampler, 3_000, seed=5)
    stat, threshold = chi_square(counts, exact_joint(target, sampler))
    assert stat < threshold, f"chi-square {stat:.1f} >= {threshold:.1f}"


# --- test of the test: two classic wrong verifiers must fail the same check ---------------------------

def _children(tree: DraftTree) -> dict[int, list[int]]:
    kids: dict[int, list[int]] = {}
    for i, p in enumerate(tree.parents.tolist()):
        kids.setdefault(p, []).append(i)
    return kids


def dense(logits) -> torch.Tensor:
    """[n+1, V] from what the engine passes a verifier (engine/target.py Logits, eager or lazy)."""
    if isinstance(logits, torch.Tensor):
        return logits
    return torch.cat([logits.row(i) for i in range(len(logits))])


def verify_draw_per_child(tree, logits, sampler, generator=None) -> Verdict:
    """WRONG: a fresh draw for every child tried, accepting the child if the draw equals it."""
    logits = dense(logits)
    probs, kids, toks = sampler.probs(logits), _children(tree), tree.tokens.tolist()
    path, node = [], -1
    while True:
        for k in kids.get(node, []):
            if int(torch.multinomial(probs[node + 1], 1, generator=generator)) == toks[k]:
                path.append(k)
                node = k
                break
        else:
            bonus = int(torch.multinomial(probs[node + 1], 1, generator=generator))
            return Verdict(path, [toks[i] for i in path] + [bonus], bonus)


def verify_raw_walk(tree, logits, sampler, generator=None) -> Verdict:
    """WRONG: the walk draws from softmax(logits / T) ignoring top-k/p/min-p; only the bonus is processed."""
    logits = dense(logits)
    raw = Sampler(temperature=sampler.temperature)
    draws, toks = raw.sample(logits, generator).tolist(), tree.tokens.tolist()
    index = {(p, t): i for i, (p, t) in enumerate(zip(tree.parents.tolist(), toks))}
    path, node = [], -1
    while (node, draws[node + 1]) in index:
        node = index[(node, draws[node + 1])]
        path.append(node)
    bonus = int(sampler.sample(logits[node + 1:node + 2], generator)[0])
    return Verdict(path, [toks[i] for i in path] + [bonus], bonus)


@pytest.mark.parametrize("wrong, name", [(verify_draw_per_child, "temperature"), (verify_raw_walk, "top_k")])
def test_wrong_verifiers_fail_the_check(target, monkeypatch, wrong, name):
    monkeypatch.setattr(engine, "verify_tree", wrong)
    sampler = CONFIGS[name]
    counts, _ = first_three(target, TableTreeDrafter(target), sampler, 1_500, seed=11)
    try:
        stat, threshold = chi_square(counts, exact_joint(target, sampler))
    except AssertionError:   # it generated a token the processed distribution excludes: caught as well
        return
    assert stat > threshold, f"{wrong.__name__} passed (chi-square {stat:.1f} < {threshold:.1f}): the check is blind"


# --- the processed distribution is transformers' own ---------------------------------------------------

@pytest.mark.parametrize("t, k, p, m", [(0.7, 0, 1.0, 0.0), (1.3, 5, 1.0, 0.0), (1.0, 0, 0.8, 0.0),
                                         (0.9, 0, 1.0, 0.1), (0.8, 10, 0.9, 0.05), (1.0, 1, 1.0, 0.0),
                                         (1.0, 0, 0.01, 0.0), (2.0, 49, 0.99, 0.3)])
def test_sampler_probs_match_transformers_warpers(t, k, p, m):
    from transformers import MinPLogitsWarper, TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

    logits = torch.randn(64, 50, generator=torch.Generator().manual_seed(0)) * 3
    warpers = [TemperatureLogitsWarper(t)]  # transformers' order: temperature, top-k, top-p, min-p
    warpers += [TopKLogitsWarper(k)] if k else []
    warpers += [TopPLogitsWarper(p)] if p < 1 else []
    warpers += [MinPLogitsWarper(m)] if m else []
    scores, ids = logits.clone(), torch.zeros(64, 1, dtype=torch.long)
    for w in warpers:
        scores = w(ids, scores)
    ours = Sampler(t, k, p, m).probs(logits)
    assert torch.equal(torch.isfinite(scores), ours > 0), "the kept tokens differ"
    torch.testing.assert_close(ours, torch.softmax(scores, dim=-1), atol=1e-6, rtol=1e-5)


def test_sampler_draws_follow_probs():
    """Sampler.sample draws from exactly Sampler.probs (20k draws of 3 rows of 6 tokens)."""
    logits = torch.randn(3, 6, generator=torch.Generator().manual_seed(1)) * 2
    sampler = Sampler(temperature=0.8, top_k=4, min_p=0.05)
    g = torch.Generator().manual_seed(2)
    draws = torch.stack([sampler.sample(logits, g) for _ in range(20_000)])
    for row in range(3):
        counts = torch.bincount(draws[:, row], minlength=6).double()
        stat, threshold = chi_square(counts, sampler.probs(logits[row]).double())
        assert stat < threshold


def test_lookup_router_keeps_the_distribution(target):
    """`lookup: true`: whichever way a round takes (prompt lookup's drafts, the tree, plain), the first three
    tokens follow the target's distribution."""
    from treegen.drafters.lookup import LookupFirst

    sampler = CONFIGS["top_k"]
    router = LookupFirst(TableTreeDrafter(target))
    counts, _ = first_three(target, router, sampler, 4_000, seed=29)
    stat, threshold = chi_square(counts, exact_joint(target, sampler))
    assert {way for (_, way), arm in router.arms.items() if arm.rounds} == {"lookup", "tree", "plain"}
    assert stat < threshold, f"chi-square {stat:.1f} >= {threshold:.1f}"
