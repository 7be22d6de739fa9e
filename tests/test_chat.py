"""Chat: templates (native and fallback), the context window, and the REPL's commands and history."""
from __future__ import annotations

import io
from types import SimpleNamespace

import pytest

from treegen.api import Chunk
from treegen.chat import FALLBACK_NOTICE, ChatFormat, ChatREPL, Conversation, fallback_render, fit
from treegen.engine.generate import Round
from treegen.engine.stats import Stats

MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"},
            {"role": "assistant", "content": "hello"}, {"role": "user", "content": "bye"}]


def test_fallback_template():
    assert fallback_render(MESSAGES) == "Be brief.\n\nUser: hi\n\nAssistant: hello\n\nUser: bye\n\nAssistant:"


def test_native_template_is_used_when_the_tokenizer_has_one(tiny_model_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    assert not ChatFormat(tok).native and ChatFormat(tok).stop
    tok.chat_template = ("{% for m in messages %}<{{ m.role }}>{{ m.content }}\n{% endfor %}"
                         "{% if add_generation_prompt %}<assistant>{% endif %}")
    fmt = ChatFormat(tok)
    assert fmt.native and fmt.stop == ()
    assert fmt.render(MESSAGES[:2]) == "<system>Be brief.\n<user>hi\n<assistant>"


def test_fit_leaves_the_oldest_exchanges_out_but_keeps_them():
    conv = Conversation("sys")
    for i in range(3):
        conv.add("user", f"question {i}")
        conv.add("assistant", f"answer {i}")
    conv.add("user", "last")
    ids = fit(conv, fallback_render, lambda text: list(text), budget=60)
    assert len(ids) <= 60 and conv.start == 6 and len(conv.turns) == 7
    assert "sys" in "".join(ids) and "question 2" not in "".join(ids)


class FakeGenerator:
    """Streams a fixed reply round by round; raises KeyboardInterrupt at a chosen round like Ctrl-C would."""

    method, target, weights = "fake", "fake-target", "float32"

    def __init__(self, interrupt_at: int | None = None, context: int = 10_000):
        self.tokenizer = SimpleNamespace(chat_template=None)
        self.model = SimpleNamespace(config=SimpleNamespace(max_position_embeddings=context))
        self.interrupt_at, self.prompts, self.texts = interrupt_at, [], []

    def encode(self, text):
        self.texts.append(text)
        return list(range(len(text)))

    def stream(self, ids, stop=(), prefix=None, **sampling):
        self.prompts.append((ids, stop, sampling))
        stats = Stats()
        for i, word in enumerate(["one ", "two ", "three"]):
            if i == self.interrupt_at:
                raise KeyboardInterrupt
            r = Round(i, [i], 2, 2, 1 if i else 0, 0.0, 0.01, 0.0, "length" if i == 2 else None)
            stats.add(r)
            stats.wall_time += 0.01
            yield Chunk(word, r, stats, r.finish)


def run_repl(text: str, gen=None, **kw):
    gen = gen or FakeGenerator()
    out, err = io.StringIO(), io.StringIO()
    repl = ChatREPL(gen, {"max_new_tokens": 16, "temperature": 0.0}, stdin=io.StringIO(text), stdout=out,
                    stderr=err, live=False, **kw)
    repl.run()
    return repl, out.getvalue(), err.getvalue()


def test_turns_history_and_stats():
    repl, out, err = run_repl("hello\nmore\n/stats\n", system="Be brief.")
    assert out == "one two three\n" * 2
    assert err.count(FALLBACK_NOTICE) == 1
    assert "conversation: 4 messages (2 replies)" in err and "mean acceptance length" in err
    assert repl.conversation.turns[-1] == {"role": "assistant", "content": "one two three"}
    _, stop, sampling = repl.gen.prompts[-1]
    assert stop == ("\nUser:",) and sampling["max_new_tokens"] == 16
    assert repl.session.new_tokens == 6 and repl.session.rounds == 4


def test_ctrl_c_keeps_the_partial_reply_and_the_conversation():
    repl, out, err = run_repl("tell me\n/stats\n", gen=FakeGenerator(interrupt_at=2))
    assert out == "one two \n"
    assert "reply stopped" in err and "conversation: 2 messages" in err
    assert repl.conversation.turns == [{"role": "user", "content": "tell me"},
                                       {"role": "assistant", "content": "one two"}]


def test_commands():
    repl, _, err = run_repl("/help\n/set n 5\n/set temp x\n/set nope 1\n/bogus\n//slash\n/clear\n/stats\n"
                              "/exit\nnever sent\n")
    assert "/clear" in err and "(max_new_tokens = 5)" in err and "temperature must be a number" in err
    assert "/set: unknown key 'nope'; keys: max_new_tokens, temperature" in err and "unknown command /bogus" in err
    assert "(conversation cleared)" in err
    assert "conversation: 0 messages (0 replies)" in err
    assert repl.gen.prompts[0][2]["max_new_tokens"] == 5
    assert repl.gen.texts[-1].endswith("User: /slash\n\nAssistant:") and len(repl.gen.prompts) == 1


def test_continued_lines_make_one_message():
    repl, _, _ = run_repl("first \\\nsecond\n")
    assert repl.conversation.turns[0]["content"] == "first \nsecond"


def test_a_prompt_too_long_is_reported_and_not_kept():
    gen = FakeGenerator()

    def too_long(*a, **k):
        raise ValueError("the prompt is 900 tokens; the target's context holds 512")

    gen.stream = too_long
    repl, _, err = run_repl("hi\n", gen=gen)
    assert "treegen: error: the prompt is 900 tokens" in err and repl.conversation.turns == []


@pytest.mark.parametrize("quiet", [True, False])
def test_quiet_hides_the_banner(quiet):
    _, _, err = run_repl("", quiet=quiet)
    assert ("Ctrl-D to exit" in err) is not quiet


def test_save_writes_the_whole_conversation_and_survives_a_bad_path(tmp_path):
    import json

    text_file, json_file = tmp_path / "talk.txt", tmp_path / "talk.json"
    repl, _, err = run_repl(f"tell me\n/save {text_file}\n/save {json_file}\n/save {tmp_path}/no/such/dir/x\n"
                            "/save\nagain\n")
    assert text_file.read_text() == "User: tell me\n\nAssistant: one two three\n\n"
    assert json.loads(json_file.read_text())[:2] == [{"role": "user", "content": "tell me"},
                                                     {"role": "assistant", "content": "one two three"}]
    assert "(saved 2 messages to" in err and "/save: cannot write" in err and "usage: /save FILE" in err
    assert len(repl.conversation.turns) == 4   # a failed save ends nothing: the next message was answered


def test_save_never_replaces_a_file_unless_told(tmp_path):
    mine = tmp_path / "code.py"
    mine.write_text("print('mine')\n")
    _, _, err = run_repl(f"tell me\n/save {mine}\n/save {tmp_path}\n")
    assert mine.read_text() == "print('mine')\n"
    assert f"/save: {mine} exists; /save! {mine} replaces it (nothing written)" in err
    assert "is a folder" in err
    run_repl(f"tell me\n/save! {mine}\n")
    assert mine.read_text().startswith("User: tell me")


# /set cases: (line, a phrase of what it says); none ends the session or changes a value it refuses
SET_CASES = {
    "alone shows every value": ("/set", "max_new_tokens = 16, temperature = 0.0"),
    "unknown key named, keys listed": ("/set foo 1", "/set: unknown key 'foo'; keys: max_new_tokens, temperature"),
    "near key suggested": ("/set temprature 1", "(did you mean temperature?)"),
    "no value": ("/set top_p", "/set: usage: /set top_p VALUE, with top_p a number in (0, 1] (now None)"),
    "n 0 refused": ("/set n 0", "max_new_tokens must be >= 1 in a chat"),
    "huge n taken": ("/set n 2147483647", "(max_new_tokens = 2147483647)"),
    "n past the bound": ("/set n 2147483648", "max_new_tokens must be an integer in [0, 2147483647]"),
}


@pytest.mark.parametrize("case", sorted(SET_CASES))
def test_set(case):
    line, phrase = SET_CASES[case]
    repl, _, err = run_repl(f"{line}\nhello\n")
    assert phrase in err, err
    assert [t["role"] for t in repl.conversation.turns] == ["user", "assistant"]   # the session went on
    assert repl.conversation.turns[1]["content"] == "one two three"


def test_a_reply_cut_by_the_limit_is_marked_and_ctrl_c_is_its_finish():
    _, _, err = run_repl("hello\n")
    assert "(cut at the 16-token limit; /set n N for longer replies)" in err
    _, _, err = run_repl("tell me\nagain\n/stats\n", gen=FakeGenerator(interrupt_at=2))
    last, session = err.split("last reply:")[1].split("session (2 replies):")
    assert "finish = interrupted" in last and "finish = interrupted 2" in session


def test_sampling_without_a_seed_draws_one_per_reply_and_shows_it():
    gen = FakeGenerator()
    out, err = io.StringIO(), io.StringIO()
    repl = ChatREPL(gen, {"max_new_tokens": 16, "temperature": 0.7, "seed": None}, stdin=io.StringIO("a\nb\n/stats\n"),
                    stdout=out, stderr=err, live=False)
    repl.run()
    seeds = [sampling["seed"] for _, _, sampling in gen.prompts]
    assert all(isinstance(seed, int) for seed in seeds) and seeds[0] != seeds[1]
    assert f"seed = {seeds[1]} (drawn: --seed {seeds[1]} repeats this run)" in err.getvalue()
    assert repl.sampling["seed"] is None          # the next reply draws again


def test_the_banner_names_the_options_that_change_drafting():
    from treegen.chat import method_label

    gen = SimpleNamespace(method="treeflash", method_options={"budget": "auto", "lookup": True, "top_k": 8})
    assert method_label(gen) == "treeflash (budget auto, lookup)"
    assert method_label(SimpleNamespace(method="ar", method_options={})) == "ar"
    sampled = SimpleNamespace(method="ddtree", method_options={"budget": 2, "sampled_budget": 3, "sample": False})
    assert method_label(sampled) == "ddtree (budget 2, 3 at T > 0)"
