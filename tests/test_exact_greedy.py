"""T=0 exactness: every drafter's output is token for token transformers' own greedy decoding (fp32).

Covers ar and pld on tiny random Qwen3 and Llama targets, prompts with long repeated spans (pld accepts)
and random ones, a hand-built branching tree drafter (duplicate siblings, trees deeper than allowed),
EOS stops and max_new_tokens cuts inside a round.
"""
from __future__ import annotations

import random

import pytest
import torch
from conftest import tiny_llama, tiny_qwen3

from treegen.drafters import build_drafter
from treegen.engine.drafter import Drafter
from treegen.engine.generate import GenerationConfig, _Loop, generate
from treegen.engine.tree import DraftTree

VOCAB = 96
N = 32
EXTRA = 12  # reference tokens past N, so oracle trees stay deeper than the engine allows near the end


def _prompts() -> list[list[int]]:
    rng = random.Random(0)
    out = []
    for i in range(10):  # long repeated spans: prompt lookup finds matches everywhere
        span = [rng.randrange(VOCAB) for _ in range(rng.randint(4, 9))]
        out.append([rng.randrange(VOCAB) for _ in range(i % 3)] + span * rng.randint(3, 5))
    for i in range(10):  # random tokens: few or no matches
        out.append([rng.randrange(VOCAB) for _ in range(rng.randint(1, 30))])
    return out


PROMPTS = _prompts()


@pytest.fixture(scope="module", params=["qwen3", "llama"])
def model(request):
    m = {"qwen3": tiny_qwen3, "llama": tiny_llama}[request.param](vocab=VOCAB)
    m.generation_config.eos_token_id = None  # Llama's default EOS (2) would stop transformers early
    m.generation_config.pad_token_id = 0
    return m


@pytest.fixture(scope="module")
def references(model):
    """transformers' greedy continuation of every prompt, N + EXTRA tokens, no EOS."""
    return [hf_greedy(model, p, N + EXTRA) for p in PROMPTS]


def hf_greedy(model, prompt: list[int], n: int, eos: int | None = None) -> list[int]:
    ids = torch.tensor([prompt])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=n,
                         eos_token_id=eos, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def run(model, drafter, prompt: list[int], n: int = N, eos: frozenset[int] = frozenset()):
    rounds = list(generate(model, drafter, torch.tensor(prompt), GenerationConfig(n, eos_token_ids=eos)))
    return [t for r in rounds for t in r.tokens], rounds


class FixedTreeDrafter(Drafter):
    """The same hand-built tree every round: every token of the vocabulary under the anchor (so one draft
    is always accepted), duplicate siblings with their own subtrees, and a chain deeper than any limit."""
    name = "fixed-tree"

    def __init__(self):
        tokens, parents = list(range(VOCAB)), [-1] * VOCAB
        for t in range(10):                      # duplicates of depth-1 nodes, each with a child
            tokens += [t, (t + 1) % VOCAB]
            parents += [-1, len(tokens) - 2]
        for t in range(VOCAB):                   # one fixed guess under each depth-1 node
            tokens.append((7 * t + 3) % VOCAB)
            parents.append(t)
        node = 0
        for d in range(20):                      # a chain 21 deep under token 0
            tokens.append((5 * d) % VOCAB)
            parents.append(node)
            node = len(tokens) - 1
        self.tree = DraftTree(torch.tensor(tokens), torch.tensor(parents))

    def begin(self, prompt, features) -> None:
        pass

    def commit(self, tokens, features) -> None:
        pass

    def propose(self, state) -> DraftTree:
        return self.tree


class OracleTreeDrafter(FixedTreeDrafter):
    """A branching tree around the true continuation: at each level a wrong sibling, its duplicate (which
    dedup merges into it, subtree and all), then the true token, corrupted now and then; EXTRA levels deep."""
    name = "oracle-tree"

    def __init__(self, full: list[int], seed: int = 0, corrupt: float = 0.15):
        self.full, self.rng, self.corrupt = full, random.Random(seed), corrupt

    def propose(self, state) -> DraftTree:
        truth = self.full[state.tokens.numel():][:EXTRA]
        tokens, parents, node = [], [], -1

        def add(tok: int, parent: int) -> int:
            tokens.append(tok)
            parents.append(parent)
            return len(tokens) - 1

        for tok in truth:
            wrong = (tok + 1 + self.rng.randrange(VOCAB - 1)) % VOCAB
            add(tok, add(wrong, node))               # a wrong branch that continues with the true token
            add((wrong + 1) % VOCAB, add(wrong, node))  # its duplicate, with a different child
            guess = wrong if self.rng.random() < self.corrupt else tok
            true_node = add(guess, node)
            add(wrong, add(guess, node))             # a duplicate of the guess: merged into the guess
            node = true_node
        return DraftTree(torch.tensor(tokens, dtype=torch.long), torch.tensor(parents, dtype=torch.long))


@pytest.mark.parametrize("method", ["ar", "pld"])
def test_drafters_match_transformers_greedy(model, references, method):
    accepted_on_repeats = deep_rounds = 0
    for i, (prompt, ref) in enumerate(zip(PROMPTS, references)):
        out, rounds = run(model, build_drafter(method, model), prompt)
        assert out == ref[:N], f"{method} prompt {i}"
        assert rounds[-1].finish == "length"
        if i < 10:
            accepted_on_repeats += sum(r.accepted for r in rounds)
            deep_rounds += sum(r.accepted >= 3 for r in rounds)
    if method == "pld":  # the test must exercise acceptance, not only rejection
        assert accepted_on_repeats > 2 * N and deep_rounds > 5, (accepted_on_repeats, deep_rounds)


def test_fixed_branching_tree_matches_greedy(model, references):
    drafter = FixedTreeDrafter()
    for prompt, ref in zip(PROMPTS[::3], references[::3]):
        out, rounds = run(model, drafter, prompt)
        assert out == ref[:N]
        assert all(r.accepted >= 1 for r in rounds[1:-1]), "every token sits under the anchor: one must be taken"
        assert all(r.drafted < len(drafter.tree) for r in rounds[1:]), "duplicates were not merged"


def test_oracle_tree_matches_greedy(model, references):
    for i, (prompt, ref) in enumerate(zip(PROMPTS, references)):
        out, rounds = run(model, OracleTreeDrafter(prompt + ref, seed=i), prompt)
        assert out == ref[:N]
        assert max(r.accepted for r in rounds) >= 4
        assert len(rounds) < N // 2, "the tree should carry most tokens"


def test_eos_stops_like_transformers(model, references):
    checked = 0
    for i, (prompt, ref) in enumerate(zip(PROMPTS, references)):
        k = next((k for k in range(4, N) if ref[k] not in ref[:k]), None)
        if k is None:
            continue
        eos = ref[k]
        hf = hf_greedy(model, prompt, N, eos=eos)
        assert hf == ref[:k + 1]
        for drafter in (build_drafter("ar", model), build_drafter("pld", model),
                        OracleTreeDrafter(prompt + ref, seed=i)):
            out, rounds = run(model, drafter, prompt, eos=frozenset({eos, VOCAB + 5}))
            assert out == hf, drafter.name
            assert rounds[-1].finish == "eos" and all(r.finish is None for r in rounds[:-1])
        checked += 1
    assert checked >= 10


def test_eos_inside_an_accepted_run_cuts_the_round(model, references):
    """With an oracle tree, the EOS token usually arrives mid-round, followed by accepted drafts."""
    cut_mid_round = 0
    for i, (prompt, ref) in enumerate(zip(PROMPTS, references)):
        k = next((k for k in range(4, N) if ref[k] not in ref[:k]), None)
        if k is None:
            continue
        out, rounds = run(model, OracleTreeDrafter(prompt + ref, seed=i, corrupt=0.0), prompt,
                          eos=frozenset({ref[k]}))
        assert out == ref[:k + 1]
        cut_mid_round += rounds[-1].accepted + 1 > len(rounds[-1].tokens)
    assert cut_mid_round >= 5


@pytest.mark.parametrize("n", [1, 2, 3, 5, 8, 13])
def test_max_new_tokens_cuts_deep_trees(model, references, n):
    for i, (prompt, ref) in enumerate(zip(PROMPTS[:10], references[:10])):
        for drafter in (build_drafter("pld", model), OracleTreeDrafter(prompt + ref, seed=i, corrupt=0.0)):
            out, rounds = run(model, drafter, prompt, n=n)
            assert out == ref[:n] and len(out) == n
            assert rounds[-1].finish == "length"
            done = 1
            for r in rounds[1:]:  # no tree deeper than what may still be committed
                assert r.depth <= n - done - 1
                done += len(r.tokens)
        if n > 1:  # the oracle proposes EXTRA levels: the last round's tree was cut to exactly the room left
            assert rounds[-1].depth == n - (done - len(rounds[-1].tokens)) - 1


def test_append_cuts_before_looking_for_eos(qwen3):
    """A round's tokens past max_new_tokens are dropped before EOS is looked for."""
    loop = _Loop(qwen3, build_drafter("ar", qwen3), torch.tensor([1, 2, 3]),
                 GenerationConfig(3, eos_token_ids=frozenset({9})))
    assert loop.append([4, 5]) == ([4, 5], None)
    assert loop.append([6, 9, 7]) == ([6], "length")
    loop = _Loop(qwen3, build_drafter("ar", qwen3), torch.tensor([1]),
                 GenerationConfig(5, eos_token_ids=frozenset({9})))
    assert loop.append([4, 9, 7]) == ([4, 9], "eos")
