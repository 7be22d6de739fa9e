"""`budget: auto`: the cost table, the acceptance calibration, the size choice, and exactness when trimming."""
from __future__ import annotations

import json

import pytest
import torch
from conftest import tiny_qwen3

from treegen.drafters import MethodError, auto_budget, build_drafter, check_options, get_method
from treegen.engine import budget as B
from treegen.engine import disk, kernels
from treegen.engine.generate import GenerationConfig, generate
from treegen.engine.tree import DraftTree
from treegen.models.checkpoint import save_dflash
from treegen.models.dflash import DFlashDrafter

FLAT = B.VerifyCost((1, 128), (0.010, 0.010))     # a GPU: rows are free up to 128
STEEP = B.VerifyCost((1, 2, 128), (0.010, 0.030, 2.0))  # every extra row costs more than a plain step


def test_cost_interpolates_and_extrapolates():
    cost = B.VerifyCost((1, 11, 21), (1.0, 2.0, 4.0))
    assert cost(torch.tensor([1, 6, 11, 16, 31])).tolist() == pytest.approx([1.0, 1.5, 2.0, 3.0, 6.0])
    assert cost(torch.tensor([0]))[0] == pytest.approx(1.0)   # below the table: the one-row time


def test_cost_table_reads_what_the_interpolation_gives():
    """Whole row counts read a table made once: the same float32 values the interpolation gives, in and past
    the measured range; other row counts (fractions, past the table) interpolate."""
    cost = B.VerifyCost((1, 2, 4, 8, 12, 16, 24, 32), (4.4, 4.4, 4.6, 6.3, 8.6, 11.1, 16.5, 21.6))
    rows = torch.arange(0, B.TABLE_ROWS + 1).numpy()
    assert (cost(rows) == cost.interpolate(rows)).all()
    assert cost.at(7) == float(cost.interpolate([7])[0]) and cost.at(B.TABLE_ROWS + 40) > cost.at(B.TABLE_ROWS)
    assert cost([2.5])[0] == pytest.approx(4.45)


def test_trim_of_a_best_first_tree_keeps_what_sorting_keeps():
    """A tree already in best-first order (a heap walk's) is trimmed to a prefix without sorting: the same nodes
    as the general path (argsort, then select), on random trees of both kinds."""
    gen = torch.Generator().manual_seed(3)
    for trial in range(40):
        n = int(torch.randint(1, 40, (1,), generator=gen))
        parents = [int(torch.randint(-1, i, (1,), generator=gen)) if i else -1 for i in range(n)]
        steps = -torch.rand(n, generator=gen)
        scores = torch.zeros(n)
        for i, p in enumerate(parents):
            scores[i] = steps[i] + (scores[p] if p >= 0 else 0.0)
        if trial % 2:   # best-first: sorted, parents before children (a child's path score is lower)
            scores = -torch.arange(n, dtype=torch.float32) * 0.3
        tree = DraftTree(torch.arange(n) + 10, torch.tensor(parents), scores=scores)
        a, b = B.AutoBudget(B.VerifyCost((1, 64), (0.01, 0.02))), B.AutoBudget(B.VerifyCost((1, 64), (0.01, 0.02)))
        fast = a.trim(tree, 0.001)
        order = torch.argsort(-scores, stable=True)
        size = b.choose(scores[order].numpy())
        keep = torch.zeros(n, dtype=torch.bool)
        keep[order[:size]] = True
        slow = tree.select(keep)
        assert fast.tokens.tolist() == slow.tokens.tolist() and fast.parents.tolist() == slow.parents.tolist()
        assert a.verified == size and list(a.depths) == [int(slow.depth.max()) if size else 0]


def test_select_is_prefix_closed():
    tree = DraftTree(torch.tensor([5, 6, 7, 8, 9]), torch.tensor([-1, 0, 1, -1, 3]),
                     scores=torch.tensor([-0.1, -0.5, -0.9, -0.2, -0.3]))
    sub = tree.select(torch.tensor([False, False, True, False, True]))  # two deep nodes: ancestors come too
    assert sub.tokens.tolist() == [5, 6, 7, 8, 9] and sub.parents.tolist() == [-1, 0, 1, -1, 3]
    sub = tree.select(torch.tensor([True, False, False, False, True]))
    assert sub.tokens.tolist() == [5, 8, 9] and sub.parents.tolist() == [-1, -1, 1]
    assert sub.depth.tolist() == [1, 1, 2] and sub.scores.tolist() == pytest.approx([-0.1, -0.2, -0.3])


def test_select_on_host_equals_the_tensor_path():
    """A CPU tree is selected node by node in Python (cheaper for a few dozen nodes); an accelerator's with
    tensor ops. Both keep the same nodes, renumbered alike, on random trees and random picks."""
    gen = torch.Generator().manual_seed(0)
    for n in (1, 2, 5, 17, 64):
        parents = [-1] + [int(torch.randint(-1, i, (1,), generator=gen)) for i in range(1, n)]
        tree = DraftTree(torch.randint(100, (n,), generator=gen), torch.tensor(parents),
                         scores=-torch.rand(n, generator=gen), law=torch.full((n,), -1))
        for _ in range(5):
            keep = torch.rand(n, generator=gen) < 0.3
            host, device = tree.select(keep), tree._select_on_device(keep)
            for field in ("tokens", "parents", "depth", "scores", "law"):
                assert torch.equal(getattr(host, field), getattr(device, field)), field


def test_choice_follows_the_hardware():
    scores = torch.log(torch.linspace(0.9, 0.05, 64))  # sorted best first
    flat, steep = B.AutoBudget(FLAT), B.AutoBudget(STEEP)
    assert flat.choose(scores) == 64     # free rows: verify everything that may be accepted
    assert steep.choose(scores) == 0     # each node costs two plain steps: not worth it
    mid = B.AutoBudget(B.VerifyCost((1, 17, 65), (0.011, 0.020, 0.031)))  # this CPU, demo target
    assert 0 < mid.choose(scores) < 64


def test_the_rounds_other_work_counts_in_the_choice():
    """A round's seconds besides drafting and the forward (trim, walk, commit) make each node's share of the
    round smaller: with more of it, the choice keeps more nodes. round_done learns it from each round."""
    scores = torch.log(torch.linspace(0.5, 0.001, 32))
    cost = B.VerifyCost((1, 33), (0.010, 0.026))
    lean, busy = B.AutoBudget(cost), B.AutoBudget(cost)
    busy.overhead = 0.010
    assert lean.choose(scores) < busy.choose(scores)
    tree = DraftTree(torch.tensor([5, 6, 7, 8]), torch.tensor([-1, 0, -1, 2]),
                     scores=torch.tensor([-0.1, -0.2, -0.3, -0.4]))
    auto = B.AutoBudget(cost)
    for _ in range(30):
        kept = len(auto.trim(tree, t_draft=0.002))
        auto.round_done(2, 0.002 + float(cost(torch.tensor([kept + 1]))[0]) + 0.004, drafted=True)
    assert auto.overhead == pytest.approx(0.004, rel=0.05)


def test_calibration_learns_from_rounds():
    model = B.AcceptanceModel()
    scores = torch.tensor([-0.1, -0.1, -3.0])
    before = model.probability(scores)
    assert float(before[0]) == pytest.approx(float(torch.exp(torch.tensor(-0.25))), rel=1e-4)  # the prior: exp(bin centre)
    for _ in range(50):  # a drafter that is confident and always wrong at the top, right deep down
        model.observe(scores, torch.tensor([False, False, True]))
    after = model.probability(scores)
    assert after[0] < 0.1 and after[2] > 0.8


def test_trim_keeps_the_best_nodes_in_score_order():
    auto = B.AutoBudget(B.VerifyCost((1, 3, 4, 128), (0.01, 0.01, 1.0, 9.0)))  # up to 2 nodes are free
    tree = DraftTree(torch.tensor([5, 6, 7, 8]), torch.tensor([-1, 0, -1, 2]),
                     scores=torch.tensor([-0.1, -0.2, -0.3, -0.4]))
    out = auto.trim(tree, t_draft=0.0)
    assert out.tokens.tolist() == [5, 6] and out.parents.tolist() == [-1, 0]


def test_cap_asks_for_twice_the_recent_sizes():
    """cap(): none until CAP_WINDOW trims are seen, then twice the largest size they kept (>= CAP_FLOOR);
    a drafter builds min(budget, cap) nodes, and a drawn tree (T > 0) keeps its budget."""
    auto = B.AutoBudget(B.VerifyCost((1, 3, 4, 128), (0.01, 0.01, 1.0, 9.0)))   # keeps 2 of these 4 nodes
    tree = DraftTree(torch.tensor([5, 6, 7, 8]), torch.tensor([-1, 0, -1, 2]),
                     scores=torch.tensor([-0.1, -0.2, -0.3, -0.4]))
    for _ in range(B.CAP_WINDOW - 1):
        auto.trim(tree, t_draft=0.0)
    assert auto.cap() is None
    auto.trim(tree, t_draft=0.0)
    assert auto.cap() == B.CAP_FLOOR
    auto.chosen.append(40)
    assert auto.cap() == 80


def test_a_tree_drafter_builds_at_most_the_cap(pair):
    target, drafter_dir = pair
    drafter = build_drafter("ddtree", target, drafter_dir, {"budget": 48})
    assert drafter.nodes == 48
    drafter.max_nodes = 20
    assert drafter.nodes == 20 and len(drafter.tree(torch.randn(6, 64).log_softmax(-1))) == 20
    drafter.law = object()   # drawing (T > 0): the engine trims drawn trees by depth, not by count
    assert drafter.nodes == 48


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    from test_dflash import tiny_drafter_config

    target = tiny_qwen3(vocab=64, seed=1)
    torch.manual_seed(2)
    model = DFlashDrafter(tiny_drafter_config(target))
    for p in model.parameters():
        p.data.normal_(0, 0.3 if p.dim() == 2 else 1.0)
    out = tmp_path_factory.mktemp("dflash-auto")
    save_dflash(model, out)
    return target, str(out)


@pytest.mark.parametrize("cost", [FLAT, STEEP, B.VerifyCost((1, 9, 33), (0.01, 0.012, 0.03))])
def test_auto_budget_is_exact(pair, cost):
    target, drafter_dir = pair
    gen = torch.Generator().manual_seed(7)
    for i in range(8):
        prompt = torch.randint(0, 63, (int(torch.randint(2, 20, (1,), generator=gen)),), generator=gen)
        ref = target.generate(prompt[None], max_new_tokens=20, do_sample=False)[0, prompt.numel():].tolist()
        drafter = build_drafter("ddtree", target, drafter_dir, {"budget": 32})
        rounds = list(generate(target, drafter, prompt, GenerationConfig(20, verify_cost=cost)))
        assert [t for r in rounds for t in r.tokens] == ref, f"prompt {i}"
        if cost is STEEP:
            assert all(r.drafted == 0 for r in rounds)


def test_cost_is_measured_once_and_cached(tmp_path, monkeypatch):
    target = tiny_qwen3(vocab=64, seed=1)
    path = tmp_path / "cost.json"
    monkeypatch.setattr(disk, "BUSY_SHARE", float("inf"))   # kept however busy the machine running the tests is
    monkeypatch.setattr(B, "MEASURED_ROWS", (1, 4))
    first = B.verify_cost(target, path)
    assert len(first.rows) == len(B.MEASURED_ROWS) and all(s > 0 for s in first.seconds)
    assert B.cost_key(target) in json.loads(path.read_text())
    monkeypatch.setattr(B.VerifyCost, "measure", classmethod(lambda cls, model: pytest.fail("measured twice")))
    assert B.verify_cost(target, path) == first
    monkeypatch.setattr(kernels, "tag", lambda: "another-version")   # new kernels: their cost is measured anew
    assert B.cost_key(target) not in json.loads(path.read_text())
    path.write_text("{not json")  # a broken cache file is measured again, not a crash
    monkeypatch.undo()
    monkeypatch.setattr(disk, "BUSY_SHARE", float("inf"))
    monkeypatch.setattr(B, "MEASURED_ROWS", (1, 2))
    assert B.verify_cost(target, path).rows == (1, 2)
    # an entry where more rows cost less (an older version's median on a busy machine) is measured again
    path.write_text(json.dumps({B.cost_key(target): {"rows": [1, 2, 4], "seconds": [0.09, 0.02, 0.12]}}))
    again = B.verify_cost(target, path)
    assert again.rows == (1, 2) and again.plausible


def test_measured_cost_never_falls_with_rows():
    """The fastest of the repeats per size, then a running max: a busy moment cannot make a size look cheap
    (the poisoned entry this replaced: 1 row 89 ms, 8 rows 20 ms, measured beside a test run)."""
    assert B.steady([[0.089, 0.005], [0.053, 0.006], [0.123, 0.004], [0.020, 0.009]]) == (0.005, 0.006, 0.006, 0.009)
    assert B.VerifyCost.measure(tiny_qwen3(vocab=64, seed=1), rows=(1, 4, 16), context=8, repeats=2).plausible


def test_auto_is_a_budget_value():
    opts = check_options(get_method("ddtree"), {"budget": "auto"})
    assert opts["budget"] == "auto" and auto_budget({"budget": "auto"}) and not auto_budget({"budget": 64})
    with pytest.raises(MethodError, match="has no option 'budget'"):
        check_options(get_method("dflash"), {"budget": "auto"})
    with pytest.raises(MethodError, match="must be int"):
        check_options(get_method("ddtree"), {"budget": "automatic"})



def test_cli_budget_auto_on_the_demo_pair_equals_ar():
    """`--method-option budget=auto` end to end: measured once (into the test cache), output = ar's."""
    from click.testing import CliRunner

    from treegen.cli import cli

    args = ["complete", "-p", "def fib(n):\n", "-n", "24", "--stats-json", "-"]
    ar = CliRunner().invoke(cli, args + ["--method", "ar"])
    auto = CliRunner().invoke(cli, args + ["--method", "ddtree", "--method-option", "budget=auto"])
    assert ar.exit_code == 0 and auto.exit_code == 0, auto.output
    ar_stats, auto_stats = json.loads(ar.stdout), json.loads(auto.stdout)
    assert auto_stats["text"] == ar_stats["text"]
    assert 0 <= auto_stats["mean_tree_size"] <= 128 and B.cache_file().exists()


def test_rests_when_drafting_cannot_pay():
    """Drafting rounds slower than plain decoding: rest 1, 2, 4 .. rounds between tries; back once it pays."""
    auto = B.AutoBudget(B.VerifyCost((1, 65), (0.010, 0.011)))   # plain: 100 tokens/s
    rests = []
    for _ in range(B.REST_AFTER + 3):
        auto.round_done(2, 0.050, drafted=True)                     # 40 tokens/s
        rests.append(auto.rest)
        if auto.rest:
            while auto.resting():
                auto.round_done(1, 0.010, drafted=False)
            auto.round_done(2, 0.080, drafted=True)                 # the catch-up round: not counted
    assert rests == [0] * (B.REST_AFTER - 1) + [1, 2, 4, 8]
    for _ in range(10):
        auto.round_done(6, 0.030, drafted=True)                     # 200 tokens/s: drafting pays again
    assert auto.rest == 0 and auto.backoff == 1


def test_rests_only_when_sampling(pair):
    """A drafter that never pays: when sampling, most rounds skip the drafter; at T=0 it drafts every round
    (the output there is the target's own, as always)."""
    from treegen.engine.sampling import Sampler

    target, drafter_dir = pair
    slow = B.VerifyCost((1, 33), (0.0001, 0.5))   # a one-row forward far cheaper than any drafter pass
    prompt = torch.tensor([5, 9, 11, 5, 9])
    calls = []
    for sampler in (Sampler(), Sampler(temperature=1.0)):
        drafter = build_drafter("ddtree", target, drafter_dir, {"budget": 32})
        propose = drafter.propose
        drafter.propose = lambda state, f=propose, s=sampler: calls.append(s.greedy) or f(state)
        rounds = list(generate(target, drafter, prompt, GenerationConfig(40, sampler=sampler, seed=1, verify_cost=slow)))
        assert sum(len(r.tokens) for r in rounds) == 40
        if sampler.greedy:
            ref = target.generate(prompt[None], max_new_tokens=40, do_sample=False)[0, prompt.numel():].tolist()
            assert [t for r in rounds for t in r.tokens] == ref
            assert calls.count(True) == len(rounds) - 1
        else:
            assert calls.count(False) <= (len(rounds) - 1) // 2


def test_a_generators_budget_carries_from_generation_to_generation():
    """A chat's next turn starts with what `budget: auto` learned so far (calibration, rates, backoff): one
    budget per sampler, kept by the Generator; a generation that ended resting starts resting."""
    from treegen import Generator

    g = Generator(target="demo", method="ddtree", drafter="demo/dflash", method_options={"budget": "auto"})
    first = g.generate("def add(a, b):", max_new_tokens=16)
    (greedy,) = g.budgets.values()
    learned = float(greedy.model.drafted.sum())
    assert learned > 0 and greedy.t_draft is not None
    again = g.generate("def add(a, b):", max_new_tokens=16)
    assert again.token_ids == first.token_ids and g.budgets[next(iter(g.budgets))] is greedy
    assert float(greedy.model.drafted.sum()) > learned * B.FORGET ** 32   # the counts went on, not from zero
    g.generate("def add(a, b):", max_new_tokens=8, temperature=0.7, seed=1)
    assert len(g.budgets) == 2 and g.with_method("ddtree", "demo/dflash", {"budget": "auto"}).budgets == {}


def test_a_carried_budget_that_was_not_paying_starts_resting():
    auto = B.AutoBudget(B.VerifyCost((1, 65), (0.010, 0.011)))   # plain: 100 tokens/s
    for _ in range(B.REST_AFTER):
        auto.round_done(2, 0.050, drafted=True)                     # 40 tokens/s
    auto.rest = 0
    assert auto.next_generation().rest == auto.backoff >= 1
    greedy = B.AutoBudget(B.VerifyCost((1, 65), (0.010, 0.011)), rests=False)
    assert greedy.next_generation().rest == 0


def test_plain_speed_is_measured_in_resting_rounds():
    """Resting rounds are plain decoding as this machine runs it: their measured speed, not the cost table's
    one-row forward, is what drafting rounds are held against."""
    auto = B.AutoBudget(B.VerifyCost((1, 65), (0.010, 0.011)))   # the table says plain is 100 tokens/s
    for _ in range(B.REST_AFTER):
        auto.round_done(2, 0.050, drafted=True)                     # 40 tokens/s: rest
    assert auto.rest
    while auto.resting():
        auto.round_done(1, 0.040, drafted=False)                    # but plain rounds here run at 25 tokens/s
    assert auto.plain == pytest.approx(25.0)
    auto.round_done(2, 0.080, drafted=True)                         # the catch-up round
    auto.round_done(2, 0.050, drafted=True)
    assert auto.rest == 0                                           # 40 tokens/s pays against 25
