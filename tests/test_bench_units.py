"""treegen bench without models: prompt parsing, built-in sets, --methods resolution, interleaving, metrics."""
from __future__ import annotations

import json
import re
import sys
from dataclasses import asdict
from pathlib import Path

import pytest

from treegen.bench import prompts as P
from treegen.bench.defaults import WARMUP_TOKENS
from treegen.bench.methods import MethodSpecError, resolve, split_list
from treegen.bench.metrics import pooled, result, speedup
from treegen.bench.runner import Output, Run, Settings, run_all
from treegen.engine.generate import Round
from treegen.engine.stats import Stats

# ---- prompts ---------------------------------------------------------------------------------------------

def test_text_prompts_split_on_blank_lines(tmp_path):
    path = tmp_path / "p.txt"
    path.write_text("\n\ndef f(x):\n    return x\n\n   \n\nimport os\nimport sys\n\n\n\nlast\n")
    prompts = P.load_prompts(str(path))
    assert [p.text for p in prompts] == ["def f(x):\n    return x", "import os\nimport sys", "last"]
    assert [p.id for p in prompts] == ["1", "2", "3"] and {p.category for p in prompts} == {P.DEFAULT_CATEGORY}


def test_jsonl_prompts_with_defaults(tmp_path):
    path = tmp_path / "p.jsonl"
    lines = [{"prompt": "a", "id": "x", "category": "math"}, {"prompt": "b"}, {"prompt": "c", "id": 7}]
    path.write_text("\n".join(json.dumps(r) for r in lines[:2]) + "\n\n" + json.dumps(lines[2]) + "\n")
    prompts = P.load_prompts(str(path), limit=2)
    assert prompts == [P.Prompt("x", "a", "math"), P.Prompt("2", "b", P.DEFAULT_CATEGORY)]
    assert P.load_prompts(str(path))[2] == P.Prompt("7", "c", P.DEFAULT_CATEGORY)


@pytest.mark.parametrize("line, message", [
    ('{"prompt": "a"', "p.jsonl:2: not valid JSON"),
    ('["a"]', "p.jsonl:2: expected an object"),
    ('{"text": "a"}', 'p.jsonl:2: "prompt" must be a non-empty string'),
    ('{"prompt": "a", "id": "one"}', "prompt id 'one' appears twice"),
])
def test_malformed_jsonl_names_the_line(tmp_path, line, message):
    path = tmp_path / "p.jsonl"
    path.write_text('{"prompt": "x", "id": "one"}\n' + line + "\n")
    with pytest.raises(P.PromptError, match="^.*" + message.replace("[", r"\[").replace("(", r"\(")):
        P.load_prompts(str(path))


def test_missing_source_lists_the_built_in_sets():
    with pytest.raises(P.PromptError, match="no such file, nor a built-in set.*chat, prose, stdlib-heldout, thirdparty-code"):
        P.load_prompts("nope.jsonl")


def test_built_in_sets():
    code, chat = P.load_prompts("stdlib-heldout"), P.load_prompts("chat")
    assert 16 <= len(code) <= 24 and {p.category for p in code} == {"function", "class", "module"}
    assert 12 <= len(chat) <= 16 and {p.category for p in chat} == {"math", "writing", "reasoning"}
    assert len({p.category for p in code[:3]}) == 3   # kinds interleaved: --limit keeps a mix
    code_chat = P.load_prompts("code-chat")
    assert len(code_chat) == 14 and [p.category for p in code_chat[:3]] == ["write", "explain", "fix"]
    assert all(P.MIN_CHARS <= len(p.text) <= P.MAX_CHARS for p in code)


def test_built_in_sets_off_the_training_distribution():
    code, prose = P.load_prompts("thirdparty-code"), P.load_prompts("prose")
    assert len(code) == 20 and {p.category for p in code} == {"function", "class", "module"}
    assert len({p.id.split(":")[1].split("/")[0] for p in code}) >= 6   # many packages, none dominating
    assert len(prose) == P.PROSE_COUNT and all(P.is_prose(p.text) for p in prose)


@pytest.mark.skipif(f"{sys.version_info[0]}.{sys.version_info[1]}" != P.BUILT_WITH_PYTHON,
                    reason="the held-out split is of this Python's stdlib")
def test_committed_stdlib_set_is_what_the_builder_makes(tmp_path):
    out = tmp_path / "s.jsonl"
    P.write_jsonl(P.build_stdlib_heldout(), out)
    assert out.read_text() == (P.BUILTIN_DIR / "stdlib-heldout.jsonl").read_text()


def test_function_prompt_ends_with_its_docstring():
    fn = next(p for p in P.load_prompts("stdlib-heldout") if p.category == "function")
    assert fn.text.rstrip().endswith(('"""', "'''")) and re.search(r"^(async )?def ", fn.text, re.MULTILINE)


# ---- --methods -------------------------------------------------------------------------------------------

def test_methods_and_presets_get_unique_labels_and_an_ar_baseline(tmp_path):
    for folder, budget in (("a", 8), ("b", 16)):
        (tmp_path / folder).mkdir()
        (tmp_path / folder / "tree.yaml").write_text(f"method: ddtree\nmethod_options: {{budget: {budget}}}\n")
    names = ["pld", str(tmp_path / "a" / "tree.yaml"), str(tmp_path / "b" / "tree.yaml")]
    specs = resolve(names, "some/target", "some/drafter")
    assert [s.label for s in specs] == ["ar", "pld", "tree", "tree#2"]
    assert [dict(s.options) for s in specs[2:]] == [{"budget": 8}, {"budget": 16}]
    assert {s.target for s in specs} == {"some/target"} and specs[1].drafter is None  # pld takes no drafter


@pytest.mark.parametrize("text, message", [
    ("ar,nope", "unknown method or preset 'nope'; methods: ar, pld"),
    ("ar,,pld", "an empty name"),
    ("pld,pld", "'pld' is listed twice"),
    ("dflash", "needs a drafter"),
    ("x/none.yaml", "no such preset file"),
])
def test_bad_methods(text, message):
    with pytest.raises(MethodSpecError, match=message):
        resolve(split_list(text), "some/target", None)


# ---- interleaving ----------------------------------------------------------------------------------------

class Recorder:
    has_rounds, target = True, None

    def __init__(self, label, log):
        self.label, self.log = label, log

    def encode(self, text):
        return [len(text)]

    def run(self, ids, max_new_tokens, temperature, seed):
        self.log.append((self.label, ids[0], max_new_tokens, seed))
        return Output([1] * max_new_tokens, Stats(new_tokens=max_new_tokens, wall_time=0.01))


def test_runs_are_interleaved_after_one_warm_up_each():
    log = []
    contestants = [Recorder(name, log) for name in ("ar", "pld", "hf-generate")]
    prompts = [P.Prompt("a", "x"), P.Prompt("b", "yy")]
    runs = run_all(contestants, prompts, Settings(5, 0.7, repeats=2, seed=10))
    assert log[:3] == [(name, 1, WARMUP_TOKENS, 10) for name in ("ar", "pld", "hf-generate")]
    names = ["ar", "pld", "hf-generate"]
    # each (repeat, prompt) group starts one contestant further along: each takes every place in turn
    expected = [(c, p, r) for r in range(2) for p in range(2)
                for c in names[(2 * r + p) % 3:] + names[:(2 * r + p) % 3]]
    assert [(r.label, r.prompt, r.repeat) for r in runs] == expected
    # every contestant gets the same seed for one (prompt, repeat), a new one for the next
    assert [s for *_, s in log[3:]] == [10] * 3 + [11] * 3 + [12] * 3 + [13] * 3


# ---- metrics ---------------------------------------------------------------------------------------------

def stats_of(accepted: list[int], wall: float) -> Stats:
    s = Stats()
    s.add(Round(0, [1], 0, 0, 0, 0.0, 0.001, 0.0))
    for i, a in enumerate(accepted, 1):
        s.add(Round(i, [1] * (a + 1), 4, 4, a, 0.001, 0.002, 0.0))
    s.wall_time = wall
    return s


def runs_of(label, walls, accepted=(0, 0), tokens=None):
    return [Run(label, p, r, Output(tokens or [1, 2], stats_of(list(accepted), walls[r][p])))
            for r in range(len(walls)) for p in range(len(walls[0]))]


def test_acceptance_is_pooled_over_every_round():
    s = pooled([stats_of([3, 0], 1.0), stats_of([1], 1.0)])
    assert s.rounds == 3 and s.mean_accepted_length == (3 + 0 + 1 + 3) / 3
    assert s.acceptance_per_position == [2 / 3, 1 / 3, 1 / 3] and s.wall_time == 2.0


def test_speedup_of_the_baseline_is_exactly_one_and_brackets_the_median():
    ar = runs_of("ar", [[0.31, 0.17], [0.23, 0.29], [0.37, 0.19]])
    fast = runs_of("x", [[0.1, 0.2], [0.05, 0.3], [0.2, 0.1]])
    assert asdict(speedup(ar, ar)) == {"median": 1.0, "min": 1.0, "max": 1.0}
    s = speedup(fast, ar)
    assert s.min <= s.median <= s.max and s.min < s.max


def test_identity_per_category_and_null_when_sampling():
    ar = runs_of("ar", [[1.0, 1.0]], tokens=[5, 6, 7])
    other = runs_of("x", [[1.0, 1.0]], tokens=[5, 6, 7])
    other[1] = Run("x", 1, 0, Output([5, 9], other[1].output.stats))
    r = result("x", {}, other, ar, True, True, ["p0", "p1"], ["code", "chat"])
    assert r.overall.identical_to_ar is False and r.failed_identity
    assert r.categories["code"].identical_to_ar is True and r.categories["chat"].identical_to_ar is False
    assert [(m.prompt, m.first_difference) for m in r.overall.mismatches] == [("p1", 1)]
    sampled = result("x", {}, other, ar, False, False, ["p0", "p1"], ["code", "chat"])
    assert sampled.overall.identical_to_ar is None and sampled.overall.mean_accepted_length is None


def test_prompts_of_the_package_are_shipped():
    assert {p.name for p in Path(P.BUILTIN_DIR).glob("*.jsonl")} == {"chat.jsonl", "stdlib-heldout.jsonl",
                                                                      "thirdparty-code.jsonl", "prose.jsonl",
                                                                      "code-chat.jsonl"}


def test_chat_prompts_go_through_the_chat_template_and_plain_ones_do_not():
    from types import SimpleNamespace

    from treegen.bench.runner import encode_for
    from treegen.bench.session import chat_prompts

    template = "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}<assistant>"
    tok = SimpleNamespace(chat_template=template, apply_chat_template=lambda msgs, **kw: "".join(
        f"<{m['role']}>{m['content']}" for m in msgs) + "<assistant>")
    gen = SimpleNamespace(tokenizer=tok, encode=lambda text: list(text))
    assert "".join(encode_for(gen, "hi", chat=True)) == "<user>hi<assistant>"
    assert encode_for(gen, "hi", chat=False) == ["h", "i"]
    assert chat_prompts({"chat": None, "prompts": "chat"}) and not chat_prompts({"chat": None, "prompts": None})
    assert not chat_prompts({"chat": False, "prompts": "chat"}) and chat_prompts({"chat": True, "prompts": "x"})
