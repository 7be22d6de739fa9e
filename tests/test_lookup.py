"""`lookup: true`: prompt-lookup rounds inside any drafter's method. Exact at T=0 (ar's output) whichever
arm runs; the router tries each arm, then keeps the faster and retries the slower now and then."""
from __future__ import annotations

import pytest
import torch

from treegen.assets import DEMO_TARGET, pair_drafter_for
from treegen.drafters import METHODS, MethodError, build_drafter, get_method
from treegen.drafters.lookup import RETRY_EVERY, TRIES, LookupFirst
from treegen.engine.generate import GenerationConfig, generate
from treegen.loading import load_target

# repeats itself (lookup matches) and goes on past what it repeats (the drafter's tree has work too)
PROMPT = ("def area(width, height):\n    return width * height\n\n\n"
          "def perimeter(width, height):\n    return 2 * (width + height)\n\n\ndef")


@pytest.fixture(scope="module")
def demo():
    return load_target(str(DEMO_TARGET), dtype="fp32", device="cpu")


def run(model, drafter, prompt, n=128):
    return [t for r in generate(model, drafter, prompt, GenerationConfig(n)) for t in r.tokens]


@pytest.mark.parametrize("method, options", [("dflash", {}), ("ddtree", {"budget": "auto"}),
                                             ("treeflash", {"budget": 24}), ("dartree", {})])
def test_lookup_rounds_are_exact(demo, method, options):
    model, tok = demo
    prompt = torch.tensor(tok(PROMPT)["input_ids"])
    ref = run(model, build_drafter("ar", model), prompt)
    drafter = build_drafter(method, model, str(pair_drafter_for("demo", method)), {**options, "lookup": True})
    assert isinstance(drafter, LookupFirst)
    assert run(model, drafter, prompt) == ref
    ran = {way for (context, way), arm in drafter.arms.items() if arm.rounds}
    assert ran == {"lookup", "tree", "plain"}   # every way really ran


def test_the_router_keeps_the_fastest_way_and_retries_the_others():
    router = LookupFirst(build_drafter("ar", None))
    speed = {"lookup": 3.0, "tree": 2.0, "plain": 1.0}   # tokens per round at one round a second
    ways = tuple(speed)

    def pick(context="match3"):
        way = router.choose(context, ways)
        router.arms[(context, way)].observe(speed[way], 1.0)
        return way
    picks = [pick() for _ in range(3 * TRIES)]
    assert sorted(picks) == sorted(ways * TRIES)
    picks = [pick() for _ in range(RETRY_EVERY + 2)]
    fresh = RETRY_EVERY - TRIES   # tree last ran TRIES rounds before the tries ended
    assert picks[:fresh] == ["lookup"] * fresh
    assert {"tree", "plain"} <= set(picks[fresh:])   # each retried once, when it went stale
    assert pick("match1") == "lookup" and router.arms[("match1", "lookup")].rounds == 1   # contexts apart


def test_the_option_is_offered_to_drafter_methods_only():
    for method in METHODS.values():
        assert ("lookup" in method.options) == method.needs_drafter
    with pytest.raises(MethodError, match="lookup"):
        build_drafter("pld", None, None, {"lookup": True})
    with pytest.raises(MethodError, match="must be bool"):
        build_drafter("dflash", None, "x", {"lookup": 1})
    assert get_method("ddtree").options["lookup"] is False


def test_the_stats_count_the_rounds_of_each_way():
    from treegen import Generator
    from treegen.ui import summary

    g = Generator(target="demo", method="dflash", method_options={"lookup": True})
    stats = g.generate(PROMPT, max_new_tokens=96).stats
    assert sum(stats.ways.values()) == stats.rounds and set(stats.ways) <= {"lookup", "tree", "plain"}
    assert stats.to_dict()["ways"] == dict(sorted(stats.ways.items()))
    assert "rounds by way = " in summary(stats, method="dflash", prompt_tokens=10)
    plain = Generator(target="demo", method="dflash").generate(PROMPT, max_new_tokens=8).stats
    assert not plain.ways and "rounds by way" not in summary(plain, method="dflash", prompt_tokens=10)
