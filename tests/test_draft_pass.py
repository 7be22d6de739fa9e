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
FREQUENT = 1024   # a restricted head (the demo drafters ship none): the pass serves only with one


@pytest.fixture(scope="module")
def demo():
    from treegen.api import Generator

    return Generator(target="demo", method="ar", dtype="fp32")


def block_drafting(demo, method: str = "ddtree"):
    from treegen.assets import pair_drafter_for

    g = demo.with_method(method, str(pair_drafter_for("demo", method)), {"dtype": "q4"})
    g.draft_model.restrict_vocab(torch.arange(FREQUENT))
    return g


def test_one_call_gives_the_per_call_paths_logits_and_cache(demo):
    g = block_drafting(demo)
    block = g.draft_model.block
    g.generate(PROMPT, max_new_tokens=12)   # a context, features pending, the prompt's other tokens admitted
    with torch.inference_mode():   # as in a generation: the cache is written in place
        assert block.compiled_pass() is not None and block.pending is not None and len(block.vocab.extra) > 0
        compare_passes(block, anchor=17)


def compare_passes(block, anchor: int) -> None:
    for depth in (1, 2, block.block_size - 1, 3):   # the first with new context rows, the rest without
        before = copy.deepcopy(block.cache), block.pending
        fast = block.compiled_marginal(anchor, depth)
        after = block.cache
        block.cache, block.pending = copy.deepcopy(before[0]), before[1]
        slow = block.scores(block.hidden(anchor, length=depth + 1)[1:1 + depth]).logits
        assert fast.shape == slow.shape == (depth, FREQUENT + len(block.vocab.extra))
        assert torch.equal(fast[:, :FREQUENT], slow[:, :FREQUENT])
        # the context's own tokens: a fp32 dot rounded to bf16 where torch's bf16 product sums in its own order
        torch.testing.assert_close(fast[:, FREQUENT:], slow[:, FREQUENT:], rtol=1e-2, atol=1e-2)
        assert after.lengths == block.cache.lengths and block.pending is None
        end = after.length + depth + 1
        for mine, theirs in zip(after.keys + after.values, block.cache.keys + block.cache.values):
            assert torch.equal(mine[..., :end, :], theirs[..., :end, :])


def test_it_serves_only_where_its_forms_are(demo):
    from treegen.assets import pair_drafter_for

    path = str(pair_drafter_for("demo", "ddtree"))
    restricted, whole = block_drafting(demo).draft_model.block, demo.with_method("ddtree", path, {"dtype": "q4"})
    in_bf16 = demo.with_method("ddtree", path, {"dtype": "bf16"})
    in_bf16.draft_model.restrict_vocab(torch.arange(FREQUENT))
    assert restricted.compiled_pass() is None   # autograd on: training's path
    with torch.inference_mode():
        assert restricted.compiled_pass() is not None
        assert whole.draft_model.block.compiled_pass() is None     # the whole vocabulary: the per-call path
        assert in_bf16.draft_model.block.compiled_pass() is None   # bf16 products: the per-call path


@pytest.mark.parametrize("method", ["ddtree", "dflash"])
def test_drafting_through_it_keeps_greedy_output(demo, method, monkeypatch):
    from treegen.drafters.dflash import DFlashBlock

    g = block_drafting(demo, method)
    calls = []
    compiled = DFlashBlock.compiled_marginal
    monkeypatch.setattr(DFlashBlock, "compiled_marginal",
                        lambda self, anchor, depth: calls.append(depth) or compiled(self, anchor, depth))
    accepted = 0
    for prompt in (PROMPT, "    for key, value in sorted(items.items()):\n"):
        out = g.generate(prompt, max_new_tokens=32)
        assert out.token_ids == demo.generate(prompt, max_new_tokens=32).token_ids
        accepted += out.stats.accepted_drafts
    assert calls and accepted > 0
