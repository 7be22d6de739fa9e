"""PrefixCache: a generation that starts from the cache rows the last one left (a chat's next turn) prefills
only the new suffix, and decodes exactly what a full prefill would, for every method."""
from __future__ import annotations

import pytest
import torch

from treegen.assets import DEMO_TARGET, pair_drafter_for
from treegen.drafters import METHODS, build_drafter
from treegen.engine.generate import GenerationConfig, generate
from treegen.engine.prefix import PrefixCache
from treegen.loading import load_target

TURN1 = "def fib(n):\n"
TURN2 = "\n\nclass Stack:\n    def push(self, item):\n"


@pytest.fixture(scope="module")
def demo():
    model, tok = load_target(str(DEMO_TARGET), dtype="fp32", device="cpu")
    return model, tok


def tokens(rounds) -> list[int]:
    return [t for r in rounds for t in r.tokens]


def drafter(model, method):
    path = pair_drafter_for("demo", method)
    return build_drafter(method, model, str(path) if path else None)


@pytest.mark.parametrize("method", sorted(METHODS))
def test_the_second_turn_reuses_the_first_and_decodes_the_same(demo, method):
    model, tok = demo
    config = GenerationConfig(24)
    first = torch.tensor(tok(TURN1)["input_ids"])
    prefix, d = PrefixCache(), drafter(model, method)
    reply = tokens(generate(model, d, first, config, prefix))
    second = torch.cat([first, torch.tensor(reply), torch.tensor(tok(TURN2)["input_ids"])])
    rounds = list(generate(model, d, second, config, prefix))
    # every row the first generation cached is reused: its prompt and all of its reply but the last token
    assert rounds[0].reused == first.numel() + len(reply) - 1
    fresh = list(generate(model, drafter(model, method), second, config))
    assert tokens(rounds) == tokens(fresh) and fresh[0].reused == 0


def test_only_the_common_prefix_is_reused(demo):
    model, tok = demo
    config, prefix, d = GenerationConfig(8), PrefixCache(), drafter(model, "ddtree")
    first = torch.tensor(tok(TURN1 + TURN2)["input_ids"])
    list(generate(model, d, first, config, prefix))
    edited = first.clone()
    edited[5] = (edited[5] + 1) % 100   # an earlier message changed: rows from there on are stale
    rounds = list(generate(model, d, edited, config, prefix))
    assert rounds[0].reused == 5
    assert tokens(rounds) == tokens(generate(model, d, edited, config))
    # the same prompt again: all but its last token come from the cache (that forward gives the first token)
    again = list(generate(model, d, edited, config, prefix))
    assert again[0].reused == edited.numel() - 1 and tokens(again) == tokens(rounds)


def test_a_stream_closed_early_leaves_its_cache_and_a_failed_one_leaves_none(demo):
    model, tok = demo
    config, prefix, d = GenerationConfig(32), PrefixCache(), drafter(model, "dflash")
    prompt = torch.tensor(tok(TURN1)["input_ids"])
    stream = generate(model, d, prompt, config, prefix)
    got = tokens([next(stream), next(stream)])
    stream.close()   # Ctrl-C between rounds, a closed pipe: the cache is whole
    longer = torch.cat([prompt, torch.tensor(got)])
    rounds = list(generate(model, d, longer, GenerationConfig(1), prefix))
    assert rounds[0].reused == longer.numel() - 1

    def broken(*args, **kwargs):
        raise KeyboardInterrupt   # Ctrl-C inside a round's forward: its cache may hold half a round
    stream = generate(model, d, prompt, config, prefix)
    next(stream)
    d.propose = broken
    with pytest.raises(KeyboardInterrupt):
        next(stream)
    assert prefix.cache is None
    del d.propose
    rounds = list(generate(model, d, prompt, config, prefix))
    assert rounds[0].reused == 0


def test_another_drafters_features_are_not_mixed_in(demo):
    """A method whose drafter reads other target layers (or none) starts from a fresh prefill."""
    model, tok = demo
    prefix = PrefixCache()
    prompt = torch.tensor(tok(TURN1)["input_ids"])
    list(generate(model, drafter(model, "ar"), prompt, GenerationConfig(4), prefix))
    rounds = list(generate(model, drafter(model, "dflash"), prompt, GenerationConfig(4), prefix))
    assert rounds[0].reused == 0


def test_the_api_takes_shipped_names_and_a_prefix_cache():
    from treegen import Generator
    from treegen import PrefixCache as Exported

    g = Generator(target="demo", method="treeflash", drafter="demo/treeflash")
    assert g.drafter.endswith("treeflash") and Exported is PrefixCache
    prefix = PrefixCache()
    first = g.generate(TURN1, max_new_tokens=12, prefix=prefix)
    second = g.generate(TURN1 + first.text + TURN2, max_new_tokens=12, prefix=prefix)
    assert first.stats.prompt_reused == 0 and second.stats.prompt_reused > len(first.prompt_token_ids)
    assert second.text == g.generate(TURN1 + first.text + TURN2, max_new_tokens=12).text
