"""The compiled drafting pass (fused.FusedStack.draft, row_decoder.c's draft_bf16): one call for the context
projection, the DFlash stack and the head gives the logits the per-call path gives (hidden(), then scores()),
bit for bit over the frequent tokens' rows, and leaves the drafter's cache as that path does; drafting through
it keeps greedy output equal to plain decoding."""
from __future__ import annotations

import copy

import pytest
import torch

from treegen.engine import fused

pytestmark = pytest.mark.skipif(not fused.available(True), reason="the compiled stack in 4-bit blocks needs "
                                                                    "AVX512-BF16 and AVX512-VNNI")
PROMPT = "def parse(line):\n    fields = line.split(',')\n    return"
FREQUENT = 1024   # a restricted head's frequent tokens (the demo drafters ship no list)


@pytest.fixture(scope="module")
def demo():
    from treegen.api import Generator

    return Generator(target="demo", method="ar", dtype="fp32")


def block_drafting(demo, method: str = "ddtree", restricted: bool = True):
    from treegen.assets import pair_drafter_for

    g = demo.with_method(method, str(pair_drafter_for("demo", method)), {"dtype": "q4"})
    if restricted:   # the head over the frequent tokens' Q8_0 rows and the context's own
        g.draft_model.restrict_vocab(torch.arange(FREQUENT))
    return g


@pytest.mark.parametrize("restricted", [True, False])
def test_one_call_gives_the_per_call_paths_logits_and_cache(demo, restricted):
    g = block_drafting(demo, restricted=restricted)
    block = g.draft_model.block
    g.generate(PROMPT, max_new_tokens=12)   # a context, features pending, the prompt's other tokens admitted
    with torch.inference_mode():   # as in a generation: the cache is written in place
        assert block.compiled_pass() is not None and block.pending is not None
        assert not restricted or len(block.vocab.extra) > 0
        compare_passes(block, anchor=17)


def compare_passes(block, anchor: int) -> None:
    for depth in (1, 2, block.block_size - 1, 3):   # the first with new context rows, the rest without
        before = copy.deepcopy(block.cache), block.pending

        def rewind(before=before):
            block.cache, block.pending = copy.deepcopy(before[0]), before[1]

        fast, states = block.compiled_marginal(anchor, depth, states=True)
        after = block.cache
        rewind()
        alone, none = block.compiled_marginal(anchor, depth)   # without the states: the same logits
        assert none is None and torch.equal(alone.logits, fast.logits)
        rewind()
        prenorm = block.hidden(anchor, normed=False, length=depth + 1)[1:1 + depth]
        rewind()
        normed = block.hidden(anchor, length=depth + 1)[1:1 + depth]
        assert torch.equal(states[0], prenorm) and torch.equal(states[1], normed)
        fast, slow = fast.logits, block.scores(normed).logits
        head = FREQUENT if block.vocab is not None else slow.shape[1]
        assert fast.shape == slow.shape and fast.shape[0] == depth
        assert torch.equal(fast[:, :head], slow[:, :head])
        # the context's own tokens: a fp32 dot rounded to bf16 where torch's bf16 product sums in its own order
        torch.testing.assert_close(fast[:, head:], slow[:, head:], rtol=1e-2, atol=1e-2)
        assert after.lengths == block.cache.lengths and block.pending is None
        end = after.length + depth + 1
        for mine, theirs in zip(after.keys + after.values, block.cache.keys + block.cache.values):
            assert torch.equal(mine[..., :end, :], theirs[..., :end, :])


def test_it_serves_only_where_its_forms_are(demo):
    from treegen.assets import pair_drafter_for

    path = str(pair_drafter_for("demo", "ddtree"))
    restricted, whole = block_drafting(demo).draft_model.block, block_drafting(demo, restricted=False)
    in_bf16 = demo.with_method("ddtree", path, {"dtype": "bf16"})
    in_bf16.draft_model.restrict_vocab(torch.arange(FREQUENT))
    assert restricted.compiled_pass() is None   # autograd on: training's path
    with torch.inference_mode():
        assert restricted.compiled_pass()[3] is True                   # Q8_0 rows of the frequent tokens
        assert whole.draft_model.block.compiled_pass()[3] is False     # the whole head in 4-bit blocks
        assert in_bf16.draft_model.block.compiled_pass() is None       # bf16 products: the per-call path


@pytest.mark.parametrize("method,restricted", [("ddtree", True), ("dflash", True), ("ddtree", False),
                                               ("treeflash", True), ("treeflash", False)])
def test_drafting_through_it_keeps_greedy_output(demo, method, restricted, monkeypatch):
    from treegen.drafters.dflash import DFlashBlock

    g = block_drafting(demo, method, restricted)
    calls = []
    compiled = DFlashBlock.compiled_marginal
    monkeypatch.setattr(DFlashBlock, "compiled_marginal",
                        lambda self, anchor, depth, states=False: calls.append(depth)
                        or compiled(self, anchor, depth, states))
    accepted = 0
    for prompt in (PROMPT, "    for key, value in sorted(items.items()):\n"):
        out = g.generate(prompt, max_new_tokens=32)
        assert out.token_ids == demo.generate(prompt, max_new_tokens=32).token_ids
        accepted += out.stats.accepted_drafts
    assert calls and accepted > 0


@pytest.mark.parametrize("table", [True, False])
def test_treeflash_head_in_one_call_is_the_per_call_heads(demo, table, monkeypatch):
    """TreeFlash's (depth, candidate) rows through one compiled call (fused.FusedStack.treeflash_head) score the
    same support as the per-call ops, close (its own SiLU and norms), with or without the token table."""
    from treegen.drafters.treeflash import TreeFlashDrafter

    g = block_drafting(demo, "treeflash")
    drafter = g.draft_model
    if not table:   # SmolLM2's case: the vocabulary is too large for a table
        drafter.table = None
    g.generate(PROMPT, max_new_tokens=12)
    with torch.inference_mode():
        marginal, (hidden, normed) = drafter.block.compiled_marginal(17, 4, states=True)
        parts = drafter.parts_of(marginal, normed)
        assert drafter.compiled_head(hidden) is not None
        fast = drafter.scored(hidden, 17, parts)
        monkeypatch.setattr(TreeFlashDrafter, "compiled_head", lambda self, hidden: None)
        slow = drafter.scored(hidden, 17, parts)
    assert torch.equal(fast.top_m, slow.top_m) and torch.equal(fast.support, slow.support)
    assert torch.equal(fast.share, slow.share) and fast.logits.shape == slow.logits.shape
    finite = slow.logits.isfinite()
    assert torch.equal(fast.logits.isfinite(), finite)
    torch.testing.assert_close(fast.logits[finite], slow.logits[finite], rtol=0.05, atol=0.25)
