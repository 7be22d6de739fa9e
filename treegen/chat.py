"""`treegen chat`: a REPL over the tokenizer's chat template, with a plain fallback for base models.

History: every user message and every reply (a reply stopped with Ctrl-C stays, as far as it got, so the
conversation is what the user saw). When the conversation outgrows the target's context, the oldest
exchanges are left out of the prompt (they stay in the history); /clear starts over.
"""
from __future__ import annotations

import sys
from collections import Counter
from contextlib import closing
from dataclasses import dataclass, field, fields, replace

from .engine.disk import held_notices
from .engine.prefix import PrefixCache
from .ui import is_terminal, make_view, quiet_keys, summary

PROMPT, MORE = ">>> ", "... "
PASTE_START, PASTE_END = "\x1b[200~", "\x1b[201~"   # bracketed paste's marks, when a terminal sends them
PASTE_S = 0.03   # more input this soon after Enter is the rest of a paste: no one types that fast
FALLBACK_NOTICE = "treegen: the tokenizer has no chat template; using a plain 'User: / Assistant:' template"
FALLBACK_STOP = ("\nUser:",)   # a base model tends to go on with the user's next line; cut it there
HELP = """\
/help              this help
/clear             forget the conversation (the system prompt stays)
/stats             statistics of the last reply and of the session
/set KEY VALUE     change a sampling value: temperature, top_k, top_p, min_p, max_new_tokens (n), seed
/set               show the sampling values
/save FILE         write the conversation to FILE (JSON messages if it ends in .json, else plain text)
/save! FILE        the same, replacing FILE if it exists
/exit, /quit       leave (so does Ctrl-D)
A pasted block of lines is one message. End a line with \\ to go on on the next line; start it with // to
send a message that begins with /.
Ctrl-C stops the current reply (what came so far stays in the history); at the prompt it clears the line."""


class ChatFormat:
    """Turns messages into prompt text: the tokenizer's chat template, or the plain fallback."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.native = bool(getattr(tokenizer, "chat_template", None))
        self.stop = () if self.native else FALLBACK_STOP

    def render(self, messages: list[dict]) -> str:
        if self.native:
            return self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return fallback_render(messages)


def fallback_render(messages: list[dict]) -> str:
    """System text, then 'User: ...' / 'Assistant: ...' blocks, ending where the assistant speaks next."""
    names = {"user": "User", "assistant": "Assistant"}
    parts = [m["content"] if m["role"] == "system" else f"{names[m['role']]}: {m['content']}" for m in messages]
    return "\n\n".join(parts + ["Assistant:"])


@dataclass
class Conversation:
    system: str | None = None
    turns: list[dict] = field(default_factory=list)   # user and assistant messages, alternating
    start: int = 0                                    # first turn still in the prompt (context limit)

    def messages(self, start: int | None = None) -> list[dict]:
        head = [{"role": "system", "content": self.system}] if self.system else []
        return head + self.turns[self.start if start is None else start:]

    def add(self, role: str, content: str) -> None:
        self.turns.append({"role": role, "content": content})

    def clear(self) -> None:
        self.turns.clear()
        self.start = 0


def fit(conversation: Conversation, render, encode, budget: int | None) -> list[int]:
    """Prompt ids for the newest turns that fit the budget, leaving the oldest exchanges out if needed."""
    start = conversation.start
    ids = encode(render(conversation.messages(start)))
    while budget is not None and len(ids) > budget and start + 2 < len(conversation.turns):
        start += 2  # one user message and its reply
        ids = encode(render(conversation.messages(start)))
    conversation.start = start
    return ids


def transcript(messages: list[dict]) -> str:
    """Plain text: a 'System:' / 'User:' / 'Assistant:' block per message."""
    return "".join(f"{m['role'].capitalize()}: {m['content']}\n\n" for m in messages)


def method_label(gen) -> str:
    """The method and the options that change how it drafts: "treeflash (budget auto, lookup)",
    "ddtree (budget 2, 3 at T > 0)"."""
    options = getattr(gen, "method_options", None) or {}
    budget = f"budget {options['budget']}" if "budget" in options else ""
    if budget and options.get("sampled_budget") and options["sampled_budget"] != options["budget"]:
        budget += f", {options['sampled_budget']} at T > 0"
    shown = [budget, "lookup" if options.get("lookup") else ""]
    shown = [s for s in shown if s]
    return f"{gen.method} ({', '.join(shown)})" if shown else gen.method


def plural(n: int, word: str, words: str) -> str:
    return f"{n} {word if n == 1 else words}"


def valid_utf8(text: str) -> bool:
    """False for text holding undecodable bytes (surrogate escapes from a terminal or a pipe)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


class ChatREPL:
    """Reads lines, runs commands, streams replies; the generator and the sampling values come in."""

    def __init__(self, generator, sampling: dict, *, system: str | None = None, live: bool = True,
                 quiet: bool = False, stdin=None, stdout=None, stderr=None, color: bool | None = None):
        self.gen, self.sampling = generator, dict(sampling)
        self.live, self.quiet, self.color = live, quiet, color
        self.stdin, self.stdout, self.stderr = stdin or sys.stdin, stdout or sys.stdout, stderr or sys.stderr
        self.format = ChatFormat(generator.tokenizer)
        self.conversation = Conversation(system)
        self.prefix = PrefixCache()   # each turn prefills only what the last one's cache does not hold
        self.last, self.session, self.replies, self.measured = None, None, 0, 0   # measured: replies with stats
        self.last_prompt = self.prompt_total = 0
        self.finishes: Counter = Counter()   # how the session's replies ended
        self.seed: tuple[int | None, bool] = (None, False)   # the last reply's seed, and whether it was drawn

    def say(self, text: str) -> None:
        print(text, file=self.stderr, flush=True)

    def run(self) -> None:
        if self.stdin is sys.stdin and is_terminal(sys.stdin):
            import readline  # noqa: F401  (line editing and an input history for input())
        if hasattr(self.stdin, "reconfigure"):  # undecodable bytes arrive as text we can refuse, not a crash
            self.stdin.reconfigure(errors="surrogateescape")
        if not self.format.native and not self.quiet:
            self.say(FALLBACK_NOTICE)
        if not self.quiet:
            from .assets import target_label

            self.say(f"treegen chat: {method_label(self.gen)} on {target_label(self.gen.target)} "
                     f"({self.gen.weights} weights). /help for commands, Ctrl-D to exit.")
        while True:
            line = self.read_message()
            if line is None:
                return
            if line and not self.handle(line):
                return

    def read_message(self) -> str | None:
        """One message: lines ending in \\ continue it, and so do lines pasted with it (on a terminal, lines
        already waiting when Enter is read); None at end of input."""
        lines, prompt = [], PROMPT
        while True:
            try:
                line = self.read_line(prompt)
            except KeyboardInterrupt:
                print(file=self.stdout, flush=True)
                lines, prompt = [], PROMPT   # Ctrl-C at the prompt clears the line, as in a shell
                continue
            if line is None:
                return "\n".join(lines) if lines else None
            line = line.replace(PASTE_START, "").replace(PASTE_END, "")
            if line.endswith("\\"):
                lines.append(line[:-1])
            elif self.pasting():
                lines.append(line)
            else:
                return "\n".join(lines + [line]).strip()
            prompt = MORE

    def pasting(self) -> bool:
        """Whether more typed input is already waiting: the rest of a paste (a terminal sends it at once)."""
        if not (self.stdin is sys.stdin and is_terminal(sys.stdin)):
            return False
        import select

        return bool(select.select([sys.stdin], [], [], PASTE_S)[0])

    def read_line(self, prompt: str) -> str | None:
        if self.stdin is sys.stdin and is_terminal(sys.stdin):
            try:
                return input(prompt)
            except EOFError:
                print(file=self.stdout, flush=True)
                return None
        line = self.stdin.readline()
        return line.rstrip("\n") if line else None

    def handle(self, line: str) -> bool:
        """A command or a message; False means leave. No error in one line ends the session."""
        if not valid_utf8(line):
            self.say("treegen: error: the message is not valid UTF-8; not sent (the conversation is unchanged)")
            return True
        try:
            if line.startswith("/") and not line.startswith("//") and "\n" not in line:  # a command is one line
                return self.command(line)
            self.reply(line[1:] if line.startswith("//") else line)
        except BrokenPipeError:
            raise
        except KeyboardInterrupt:  # Ctrl-C before the reply began streaming (a stream catches its own)
            self.say("(interrupted; the conversation is unchanged)")
        except Exception as err:  # noqa: BLE001 (a bug or a bad value must not take the conversation)
            from .cli_errors import one_line

            self.say(f"treegen: error: {one_line(err)}")
        return True

    def command(self, line: str) -> bool:
        name, _, arg = line.partition(" ")
        if name in ("/exit", "/quit"):
            return False
        command = {"/help": self.help, "/clear": self.clear, "/stats": self.stats, "/set": self.set,
                   "/save": self.save, "/save!": self.save_over}.get(name)
        if command is None:
            self.say(f"unknown command {name}; /help lists them")
        else:
            command(arg.strip())
        return True

    def help(self, _: str) -> None:
        self.say(HELP)

    def clear(self, _: str) -> None:
        self.conversation.clear()
        self.prefix.clear()
        self.say("(conversation cleared)")

    def set(self, arg: str) -> None:
        """/set KEY VALUE, checked by the same definition as the flags (treegen.validate); /set alone shows
        the values."""
        from .validate import ALIASES, SAMPLING, OptionError, did_you_mean

        key, _, value = arg.partition(" ")
        name = ALIASES.get(key, key)
        if not key:
            self.say(", ".join(f"{k} = {'none' if v is None else v}" for k, v in self.sampling.items()))
            return
        if name not in SAMPLING:
            self.say(f"/set: unknown key {key!r}{did_you_mean(key, list(SAMPLING) + list(ALIASES))}; keys: "
                     f"{', '.join(SAMPLING)} (n = max_new_tokens, temp = temperature)")
            return
        if not value.strip():
            self.say(f"/set: usage: /set {key} VALUE, with {key} {SAMPLING[name].describe()} "
                     f"(now {self.sampling.get(name)})")
            return
        try:
            parsed = SAMPLING[name].parse(value, name)
            if name == "max_new_tokens" and parsed == 0:
                raise OptionError("max_new_tokens must be >= 1 in a chat (a reply of no tokens says nothing)")
        except OptionError as err:
            now = self.sampling.get(name)
            self.say(f"/set: {err}; {name} stays {'unset' if now is None else now}")
            return
        self.sampling[name] = parsed
        self.say(f"({name} = {self.sampling[name]})")

    def save_over(self, arg: str) -> None:
        self.save(arg, force=True)

    def save(self, arg: str, force: bool = False) -> None:
        """/save FILE: the whole conversation (also what no longer fits the context), written atomically;
        an existing FILE is replaced only by /save! FILE."""
        import json
        import os
        from pathlib import Path

        if not arg:
            self.say("/save: usage: /save FILE (/save! FILE replaces an existing file)")
            return
        path = Path(arg).expanduser()
        if path.is_dir():
            self.say(f"/save: {arg} is a folder; give a file name (nothing written)")
            return
        if path.exists() and not force:
            self.say(f"/save: {arg} exists; /save! {arg} replaces it (nothing written)")
            return
        messages = self.conversation.messages(0)
        text = json.dumps(messages, ensure_ascii=False, indent=1) + "\n" if path.suffix == ".json" \
            else transcript(messages)
        tmp = path.with_name(f".{path.name}.tmp")
        try:
            tmp.write_text(text, encoding="utf-8")
            os.replace(tmp, path)
        except OSError as err:
            if tmp.parent.is_dir():
                tmp.unlink(missing_ok=True)
            self.say(f"/save: cannot write {arg}: {err.strerror or err}; the conversation is unchanged")
            return
        self.say(f"(saved {plural(len(self.conversation.turns), 'message', 'messages')} to {path})")

    def stats(self, _: str) -> None:
        replies = sum(turn["role"] == "assistant" for turn in self.conversation.turns)
        messages = plural(len(self.conversation.turns), "message", "messages")
        self.say(f"conversation: {messages} ({plural(replies, 'reply', 'replies')})")
        if self.last is None:
            return
        seed, drawn = self.seed
        self.say("last reply:\n" + summary(self.last, method=self.gen.method, prompt_tokens=self.last_prompt,
                                           seed=seed, seed_drawn=drawn))
        ends = ", ".join(f"{why} {n}" for why, n in sorted(self.finishes.items()))
        self.say(f"session ({plural(self.replies, 'reply', 'replies')}):\n"
                 + summary(self.session, method=self.gen.method, prompt_tokens=self.prompt_total,
                           prefills=self.measured, finish=ends or None))

    # ---- a reply ----------------------------------------------------------------------------------------

    def budget(self) -> int | None:
        """Prompt tokens that still leave room to answer (at most half the context is kept for the answer)."""
        from .loading import context_length

        limit = context_length(self.gen.model)
        if limit is None:
            return None
        return limit - min(self.sampling.get("max_new_tokens") or limit, limit // 2)

    def prompt_ids(self) -> list[int]:
        before = self.conversation.start
        ids = fit(self.conversation, self.format.render, self.gen.encode, self.budget())
        if self.conversation.start > before:
            self.say(f"(the oldest {self.conversation.start} messages no longer fit the context; left out)")
        return ids

    def reply(self, text: str) -> None:
        self.conversation.add("user", text)
        try:
            ids = self.prompt_ids()
            parts, stopped, finish = self.stream(ids)
        except BrokenPipeError:
            raise
        except BaseException:  # the engine's own checks (prompt too long, ...), Ctrl-C: the message is not kept
            self.conversation.turns.pop()
            raise
        text = "".join(parts).strip()
        self.conversation.add("assistant", text)
        if stopped:
            self.say("(reply stopped; what came so far stays in the history)")
        elif finish == "length":
            self.say(f"(cut at the {self.sampling.get('max_new_tokens')}-token limit; /set n N for longer replies)")
        elif finish == "context":
            self.say("(cut: the conversation fills the target's context; /clear starts over)")
        elif not text:
            self.say("(the model's reply is empty)")

    def stream(self, ids: list[int]) -> tuple[list[str], bool, str | None]:
        """Stream one reply; (its text parts, whether Ctrl-C stopped it, how it ended)."""
        chunks = self.gen.stream(ids, stop=self.format.stop, prefix=self.prefix, **self.reply_sampling())
        view = make_view(self.stdout, live=self.live, end="\n", color=self.color)
        parts, stats, stopped = [], None, False
        with held_notices():   # a measurement's notice waits for the reply's end instead of splitting it
            try:
                with quiet_keys(self.stdin if self.live else None), closing(chunks):
                    for chunk in chunks:
                        parts.append(chunk.text)
                        view.update(chunk)
                        stats = chunk.stats
            except KeyboardInterrupt:
                stopped = True
                if stats is not None:
                    stats.finish = "interrupted"
            finally:
                view.close()
        self.record(stats, len(ids))
        return parts, stopped, None if stats is None else stats.finish

    def reply_sampling(self) -> dict:
        """The sampling values of one reply: when sampling without a seed, one drawn for it (shown by /stats)."""
        from .validate import draw_seed, effective_seed

        values = dict(self.sampling)
        drawn = bool(values.get("temperature")) and effective_seed(values.get("seed")) is None
        if drawn:
            values["seed"] = draw_seed()
        self.seed = (values.get("seed") if values.get("temperature") else None, drawn)
        return values

    def record(self, stats, prompt_tokens: int) -> None:
        self.replies += 1
        if stats is not None:
            self.finishes[stats.finish or "?"] += 1
            self.measured += 1
            self.last, self.last_prompt = stats, prompt_tokens
            self.session = combined(self.session, stats)
            self.prompt_total += prompt_tokens


def combined(total, stats):
    """A new Stats with the counts and times of both (the finish of the newer)."""
    if total is None:
        return replace(stats, accept_histogram=stats.accept_histogram.copy())
    sums = {f.name: getattr(total, f.name) + getattr(stats, f.name) for f in fields(stats) if f.name != "finish"}
    return replace(stats, **sums)
