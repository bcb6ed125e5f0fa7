"""The chat REPL, used as a person would: the real `python -m mlxlocal.repl` in a pty.

Plus unit tests of its helpers and an in-process REPL on a non-terminal console.
"""

from __future__ import annotations

import io
import json
import os
import re
import signal
import sys
import threading
import time
from dataclasses import replace
from pathlib import Path
from typing import NamedTuple

import pytest
from conftest import FAMILY_CONFIGS, build_tiny
from rich.console import Console

from mlxlocal.agents.conversation import parse_saved
from mlxlocal.engine import GenerationStats, PagedEngine, SamplingParams, SimpleEngine, open_engine
from mlxlocal.engine.base import EngineBase
from mlxlocal.repl.chat import (
    ChatRepl,
    block_is_open,
    default_history_file,
    sigint_sets,
    unwrap_block,
)
from mlxlocal.repl.view import format_footer, human_count
from mlxlocal.source.loader import load_from_dir
from mlxlocal.units import human_bytes

pexpect = pytest.importorskip("pexpect")

# The footer up to its end; the last group is the finish reason when it is not "stop". The
# line must end (newline or the escape that ends its colour) so "finish" is never cut off.
FOOTER = re.compile(r"prompt (\d+) tokens \((\d+) cached\) · reply (\d+) tokens · TTFT [^·]+ · "
                    r"peak [\d.]+ \w+(?: · finish: ([a-z]+))?[\x1b\r\n]")
PROMPT = ">>>"  # prompt_toolkit draws the trailing space as a cursor move
TIMEOUT = 60


@pytest.fixture(scope="session")
def chat_model_dir(tmp_path_factory) -> Path:
    # A long context: a reply must run long enough to be interrupted with Ctrl-C.
    cfg = dict(FAMILY_CONFIGS["qwen3"], max_position_embeddings=4096)
    return build_tiny(tmp_path_factory.mktemp("chat_model") / "tiny-chat", cfg)


# --- driving the real program ---------------------------------------------------------------
class Footer(NamedTuple):
    prompt: int
    cached: int
    reply: int
    finish: str

    @classmethod
    def of(cls, m: re.Match[str]) -> Footer:
        return cls(int(m[1]), int(m[2]), int(m[3]), m[4] or "stop")


class Chat:
    """One `python -m mlxlocal.repl` in a pty, with helpers that wait for what a user sees."""

    def __init__(self, model: Path | str, home: Path, *args: str, max_tokens: int | None = 12):
        env = dict(os.environ, TERM="xterm-256color", PROMPT_TOOLKIT_NO_CPR="1", COLUMNS="200",
                   LINES="50", MLXLOCAL_HOME=str(home), HF_HUB_OFFLINE="1", PYTHONIOENCODING="utf-8")
        limit = ["--max-tokens", str(max_tokens)] if max_tokens is not None else []
        argv = ["-m", "mlxlocal.repl", "--model", str(model), *limit, "--temp", "0", *args]
        self.child = pexpect.spawn(sys.executable, argv, env=env, cwd=str(home), dimensions=(50, 200),
                                   encoding="utf-8", codec_errors="replace", timeout=TIMEOUT)

    def expect(self, pattern: str | re.Pattern[str]) -> re.Match[str]:
        self.child.expect(pattern)
        return self.child.match

    def prompt(self) -> None:
        self.child.expect_exact(PROMPT)

    def ask(self, text: str) -> Footer:
        """Send a message; return its footer's numbers."""
        self.child.send(text + "\r")
        footer = Footer.of(self.expect(FOOTER))
        self.prompt()
        return footer

    def command(self, line: str, expect: str) -> None:
        self.child.send(line + "\r")
        self.child.expect_exact(expect)
        self.prompt()

    def finish(self) -> int:
        self.child.expect(pexpect.EOF)
        self.child.close()
        assert "Traceback" not in (self.child.before or "")
        return self.child.exitstatus

    def exit(self) -> int:
        self.child.send("/exit\r")
        return self.finish()


@pytest.fixture
def chat(chat_model_dir, tmp_path):
    chats: list[Chat] = []

    def start(*args: str, model: Path | str | None = None, max_tokens: int | None = 12) -> Chat:
        c = Chat(model or chat_model_dir, tmp_path, *args, max_tokens=max_tokens)
        chats.append(c)
        return c

    yield start
    for c in chats:  # never leave a child behind, even when a test fails
        if c.child.isalive():
            c.child.terminate(force=True)


def test_two_turns_reuse_prefix_help_and_exit(chat, chat_model_dir):
    c = chat()
    c.child.expect_exact("tiny-chat")
    c.child.expect_exact("context 4096 tokens")
    c.child.expect_exact("/help")
    c.prompt()
    first = c.ask("hello world")
    assert first.cached == 0 and first.reply <= 12
    second = c.ask("tell me more about the fox")
    # Turn two extends turn one's ids; the session already holds all but their last token.
    assert second.prompt > first.prompt + first.reply and second.cached >= first.prompt + first.reply - 1
    c.command("/help", "/save FILE")
    c.command("/frobnicate", "unknown command /frobnicate")
    c.command("/stats", "4 messages")
    assert c.exit() == 0


def test_system_save_load_roundtrip(chat, tmp_path):
    c = chat()
    c.prompt()
    c.command("/system You are a terse assistant.", "system prompt set")
    c.ask("hello world")
    saved = tmp_path / "conv.json"
    c.command(f"/save {saved}", "saved 2 messages")
    data = json.loads(saved.read_text())
    assert data["model"] == "tiny-chat"
    assert data["system"] == "You are a terse assistant."
    assert [m["role"] for m in data["messages"]] == ["user", "assistant"]
    assert data["messages"][0]["content"] == "hello world"

    c.command("/clear", "conversation cleared")
    c.command("/stats", "0 messages")
    c.command(f"/load {tmp_path / 'missing.json'}", "no such file")
    (tmp_path / "bad.json").write_text("{not json")
    c.command(f"/load {tmp_path / 'bad.json'}", "is not a saved chat")
    c.command(f"/load {saved}", "loaded 2 messages")
    c.command("/stats", "2 messages")
    # The restored conversation is what the model sees: the next prompt holds all of it.
    after_load = c.ask("and then?")
    # The prefix cache may still hold its first blocks.
    assert after_load.prompt > 20 and after_load.cached < after_load.prompt
    c.command(f"/save {saved}", "saved 4 messages")
    again = json.loads(saved.read_text())
    assert again["system"] == data["system"] and again["messages"][:2] == data["messages"]
    c.command("/model /no/such/model", "still using tiny-chat")
    c.ask("still here?")
    assert c.exit() == 0


def test_multiline_input(chat, tmp_path):
    c = chat()
    c.prompt()
    for line in ['"""', "line one", "line two", '"""']:
        c.child.send(line + "\r")
    c.expect(FOOTER)
    c.prompt()
    c.child.send("first\x1b\rsecond\r")  # Esc+Enter (what Alt+Enter sends) adds a line
    c.expect(FOOTER)
    c.prompt()
    saved = tmp_path / "multi.json"
    c.command(f"/save {saved}", "saved 4 messages")
    users = [m["content"] for m in json.loads(saved.read_text())["messages"] if m["role"] == "user"]
    assert users == ["line one\nline two", "first\nsecond"]
    assert c.exit() == 0


def test_cached_tokens_are_all_but_the_new_ones(chat, tiny_model):
    """Random weights reply with text that re-encodes to other ids; the chat keeps the ids
    the model produced, so every later turn reuses the whole conversation from the cache."""
    c = chat(model=tiny_model, max_tokens=64)
    c.prompt()
    turns = [c.ask(text) for text in ("hello world", "tell me more about the fox",
                                      "what did the dog do?", "thanks, that is all")]
    assert turns[0].cached == 0
    for before, now in zip(turns, turns[1:]):
        # The KV cache holds every token fed to the model: the last prompt and the reply. A
        # reply cut by --max-tokens ("length") ends in a token that was sampled but never fed
        # (its K/V would only be computed by a next step); a reply that ended at the
        # end-of-turn token had all of its tokens fed (the end-of-turn token is not one of
        # them). Nothing else may be recomputed: the new prompt starts with exactly those ids.
        unfed = 1 if before.finish == "length" else 0
        assert now.cached == before.prompt + before.reply - unfed, turns
        assert now.prompt > before.prompt + before.reply  # plus the new user turn
    assert c.exit() == 0


def test_ctrl_c_stops_reply_and_keeps_the_repl(chat, tmp_path):
    c = chat(max_tokens=3000)
    c.prompt()
    c.child.send("hello world\r")
    c.child.expect_exact("…")  # the reply view is up: generation has started
    time.sleep(0.5)
    c.child.sendintr()
    c.child.expect_exact("[interrupted]")
    cut = Footer.of(c.expect(FOOTER))
    assert cut.finish == "cancelled" and 0 < cut.reply < 3000
    c.prompt()
    # Ctrl-C at the prompt clears the line instead of exiting.
    c.child.send("half typed")
    c.child.sendintr()
    c.prompt()
    saved = tmp_path / "cut.json"
    c.command(f"/save {saved}", "saved 2 messages")
    partial = json.loads(saved.read_text())["messages"][1]
    assert partial["role"] == "assistant" and partial["content"]  # the partial reply is kept
    # The next turn continues from the cut reply's ids: the cache holds them (all, or all but
    # the last when the engine had not fed it yet), and only the new turn is prefilled.
    c.child.send("/clear\r")
    c.child.expect_exact("conversation cleared")  # not "half typed/clear": the line was cleared
    c.prompt()
    c.child.send("and again\r")
    c.child.expect_exact("…")
    time.sleep(0.3)
    c.child.sendintr()
    c.child.expect_exact("[interrupted]")
    again = Footer.of(c.expect(FOOTER))
    c.prompt()
    c.child.send("go on\r")
    c.child.expect_exact("…")
    time.sleep(0.3)
    c.child.sendintr()
    c.child.expect_exact("[interrupted]")
    go_on = Footer.of(c.expect(FOOTER))
    c.prompt()
    assert again.prompt + again.reply - 1 <= go_on.cached <= again.prompt + again.reply
    assert c.exit() == 0


def test_type_ahead_is_not_echoed_into_a_reply_and_waits_for_the_prompt(chat):
    c = chat(max_tokens=3000)
    c.prompt()
    c.child.send("hello world\r")
    c.child.expect_exact("…")  # the reply streams
    time.sleep(0.3)
    c.child.send("/clear\r")  # typed ahead, Enter included
    time.sleep(0.3)
    c.child.sendintr()
    c.child.expect_exact("[interrupted]")
    streamed = c.child.before
    assert "/clear" not in streamed and "^C" not in streamed, streamed[-500:]
    c.expect(FOOTER)
    c.child.expect_exact("conversation cleared")  # the typed line ran at the next prompt
    c.prompt()
    assert c.exit() == 0


def test_random_weights_are_said_and_replies_kept_short(chat):
    c = chat(model="synthetic:tiny", max_tokens=None)
    c.child.expect_exact("random weights: replies are gibberish on purpose")
    c.child.expect_exact("they stop at 128 tokens (--max-tokens)")
    c.prompt()
    assert c.ask("hello").reply <= 128
    assert c.exit() == 0


def test_history_persists_across_runs(chat, tmp_path):
    first = chat()
    first.prompt()
    first.ask("remember this line")
    assert first.exit() == 0
    assert "remember this line" in (tmp_path / "chat_history").read_text()

    second = chat()
    second.prompt()
    second.child.send("\x1b[A\x1b[A")  # Up twice: past "/exit" to the message
    second.child.expect_exact("remember this line")
    second.child.send("\r")
    second.expect(FOOTER)
    second.prompt()
    second.child.sendeof()  # Ctrl-D on an empty line exits
    assert second.finish() == 0


def test_unknown_model_is_a_clean_error(chat):
    c = chat(model="/no/such/model")
    c.child.expect_exact("error: unknown model")
    assert c.finish() == 1


# --- the REPL in process, on a console that is not a terminal ---------------------------------
@pytest.fixture(scope="module")
def engine(chat_model_dir) -> PagedEngine:
    from mlxlocal.source.loader import load_from_dir

    return open_engine(load_from_dir(chat_model_dir))


def make_repl(engine: PagedEngine, **kw) -> tuple[ChatRepl, io.StringIO]:
    out = io.StringIO()
    repl = ChatRepl(engine, Console(file=out, width=200), params=SamplingParams(max_tokens=8), **kw)
    return repl, out


def test_plain_output_when_not_a_terminal(engine):
    repl, out = make_repl(engine, system="be brief")
    repl.turn("hello world")
    repl.turn("more please")
    text = out.getvalue()
    assert "\x1b[" not in text  # no Live region, no colours
    footers = FOOTER.findall(text)
    assert len(footers) == 2 and int(footers[0][1]) == 0 and int(footers[1][1]) > 0
    assert [m["role"] for m in repl.conv.messages] == ["user", "assistant"] * 2
    assert repl.conv.rendered()[0] == {"role": "system", "content": "be brief"}


def test_context_overflow_is_reported_and_forgotten(engine, monkeypatch):
    repl, out = make_repl(engine)
    monkeypatch.setattr(engine.loaded.info, "context_length", 40)
    repl.turn("the quick brown fox jumps over the lazy dog " * 10)
    assert "context length is 40" in out.getvalue() and "/clear" in out.getvalue()
    assert repl.conv.messages == []  # the message that did not fit is not kept


def test_commands_in_process(engine, tmp_path):
    repl, out = make_repl(engine)
    assert repl.command("/help") and "/model SPEC" in out.getvalue()
    assert repl.command("/nope") and "unknown command /nope" in out.getvalue()
    assert repl.command("/save") and "usage: /save FILE" in out.getvalue()
    assert repl.command("/system [bold]x[/bold]") and repl.conv.system == "[bold]x[/bold]"
    for name in ("/exit", "/quit", "/bye", "/EXIT"):
        assert repl.command(name) is False


# --- token ids kept across turns, and Ctrl-C at either end of a reply -----------------------
@pytest.fixture(scope="module")
def simple_engine(chat_model_dir) -> SimpleEngine:
    # Prefill in chunks of 4: the simple engine checks for a cancel between chunks.
    return SimpleEngine(load_from_dir(chat_model_dir), max_step_tokens=4)


class Interrupting:
    """An engine whose next reply gets a Ctrl-C (its cancel event set) before the first
    token ("prefill") or as soon as one arrives ("decode"); all else is the real engine."""

    def __init__(self, engine: PagedEngine | SimpleEngine, when: str | None = None):
        self.engine, self.when = engine, when
        self.tokens: list[int] = []  # the token ids the last reply streamed

    def __getattr__(self, name: str):
        return getattr(self.engine, name)

    def generate(self, prompt, params=None, session=None, cancel=None):
        when, self.when = self.when, None
        if when == "prefill":
            cancel.set()
        chunks = self.engine.generate(prompt, params, session=session, cancel=cancel)
        return self._watch(chunks, cancel if when == "decode" else None)

    def _watch(self, chunks, cancel):
        self.tokens = []
        for chunk in chunks:
            if chunk.token is not None:
                self.tokens.append(chunk.token)
                if cancel is not None:
                    cancel.set()
            yield chunk


def footers(out: io.StringIO) -> list[Footer]:
    return [Footer.of(m) for m in FOOTER.finditer(out.getvalue())]


@pytest.mark.parametrize("kind", ["paged", "simple"])
def test_ctrl_c_before_the_first_token_keeps_nothing(kind, engine, simple_engine):
    real = engine if kind == "paged" else simple_engine
    wrapped = Interrupting(real)
    repl, out = make_repl(wrapped)
    repl.turn("hello world")
    ids, messages, stats = list(repl.conv.ids), list(repl.conv.messages), repl.last_stats
    first_prompt = real.encode_chat(messages[:1])
    assert ids[: len(first_prompt)] == first_prompt and len(ids) > len(first_prompt)
    wrapped.when = "prefill"
    repl.turn("a question that never gets an answer, " * 4)
    assert "cancelled before the first token" in out.getvalue()
    assert "[interrupted]" not in out.getvalue() and len(footers(out)) == 1  # no footer of zeros
    assert repl.conv.ids == ids and repl.conv.messages == messages and repl.last_stats is stats
    # The next turn follows turn one as if the cancelled one had never been sent.
    user = {"role": "user", "content": "and now?"}
    repl.turn(user["content"])
    first, now = footers(out)
    assert now.prompt == len(ids) + len(real.encode_continuation(messages[:1], [user]))
    assert repl.conv.ids[: len(ids)] == ids and [m["role"] for m in repl.conv.messages] == ["user", "assistant"] * 2
    unfed = 1 if first.finish == "length" else 0
    if kind == "paged":  # nothing of the cancelled prompt was computed
        assert now.cached == len(ids) - unfed
    else:  # the first prefill chunk of the cancelled prompt ran; its shared start is reused
        assert len(ids) - unfed <= now.cached < now.prompt


@pytest.mark.parametrize("kind", ["paged", "simple"])
def test_ctrl_c_during_decode_keeps_the_partial_reply(kind, engine, simple_engine):
    real = engine if kind == "paged" else simple_engine
    wrapped = Interrupting(real, "decode")
    repl, out = make_repl(wrapped)
    repl.params = SamplingParams(max_tokens=500)  # long enough that the Ctrl-C lands mid-reply
    repl.turn("hello world")
    assert "[interrupted]" in out.getvalue()
    (cut,) = footers(out)
    assert cut.finish == "cancelled" and cut.reply == len(wrapped.tokens) and 1 <= cut.reply < 500
    assert repl.conv.ids == real.encode_chat([{"role": "user", "content": "hello world"}]) + wrapped.tokens
    assert [m["role"] for m in repl.conv.messages] == ["user", "assistant"]
    kept = len(repl.conv.ids)
    repl.params = SamplingParams(max_tokens=8)
    repl.turn("go on")
    _, now = footers(out)
    # All the cut reply's ids are reused, but maybe its last: an engine may not have fed it.
    assert kept - 1 <= now.cached <= kept < now.prompt and len(repl.conv.messages) == 4


def test_thinking_budget_closes_the_block_and_keeps_the_marker(engine):
    """--thinking-budget: the engine closes the think block in the same reply; the kept ids
    hold the marker it wrote, so the next turn reuses the whole conversation."""
    from server_util import thinks_until_stopped

    repl, out = make_repl(engine)
    repl.params = SamplingParams(max_tokens=40, think_budget=8)
    done = len(engine.tokenizer.encode("Done", add_special_tokens=False))
    marker = len(engine.tokenizer.encode("\n</think>\n\n", add_special_tokens=False))
    with thinks_until_stopped(engine.tokenizer, "Done"):
        repl.turn("think hard")
        kept = len(repl.conv.ids)
        repl.turn("and now?")
    first, second = footers(out)
    assert first.reply == 8 + done and first.finish == "stop"  # the marker is not counted
    assert repl.conv.messages[1]["content"] == "<think>" + "x" * 7 + "\n</think>\n\nDone"
    assert kept == first.prompt + first.reply + marker
    assert second.cached == kept


def test_thinking_budget_option_is_checked(capsys):
    from mlxlocal.repl.chat import main

    with pytest.raises(SystemExit) as e:
        main(["--model", "unused", "--thinking-budget", "0"])
    assert e.value.code == 2 and "think_budget" in capsys.readouterr().err


@pytest.mark.parametrize("family", ["qwen3", "llama", "mistral"])
def test_each_template_reuses_the_whole_conversation(family, tiny_models):
    eng = open_engine(load_from_dir(tiny_models[family]), max_num_seqs=1)
    try:
        repl, out = make_repl(eng)
        # Replies long enough that their text, encoded again, gives other ids than the model's.
        repl.params = SamplingParams(max_tokens=48)
        for text in ("hello world", "tell me about the fox", "and the dog?"):
            repl.turn(text)
        turns = footers(out)
        assert len(turns) == 3
        for before, now in zip(turns, turns[1:]):
            assert now.cached == before.prompt + before.reply - (before.finish == "length")
        # The kept ids are the last prompt and its reply; the messages hold the text.
        assert len(repl.conv.ids) == turns[-1].prompt + turns[-1].reply
        assert [m["content"] for m in repl.conv.messages[::2]] == ["hello world", "tell me about the fox", "and the dog?"]
    finally:
        eng.shutdown()


# --- the chat template's continuation after an assistant reply ---------------------------------
END_OF_TURN = {"qwen3": "<|im_end|>", "llama": "<|eot_id|>", "mistral": "</s>"}
GENERATION_PROMPT = {"qwen3": "<|im_start|>assistant\n", "llama": "<|start_header_id|>assistant<|end_header_id|>\n\n",
                     "mistral": "[/INST]"}


# Mistral's template with a system prompt is test_encode_continuation_falls_back.
@pytest.mark.parametrize("family, system", [("qwen3", None), ("qwen3", "be brief"), ("llama", None),
                                            ("llama", "be brief"), ("mistral", None)])
def test_encode_continuation_matches_a_full_encode(family, system, tiny_models):
    eng = EngineBase(load_from_dir(tiny_models[family]))
    messages = ([{"role": "system", "content": system}] if system else []) + [
        {"role": "user", "content": "hello world"}]
    reply = "the quick brown fox"  # plain words: the same ids alone and inside the chat
    new = [{"role": "user", "content": "and the dog?"}]
    prompt = eng.encode_chat(messages)
    continuation = eng.encode_continuation(messages, new)
    full = eng.encode_chat(messages + [{"role": "assistant", "content": reply}] + new)
    # Mistral's template puts a space before the reply; that belongs to the reply's text.
    reply_text = " " + reply if family == "mistral" else reply
    assert full == prompt + eng.tokenizer.encode(reply_text, add_special_tokens=False) + continuation
    # It starts with the end-of-turn token as its special id (not its characters), adds no
    # BOS, and ends with the generation prompt.
    tok = eng.tokenizer
    assert continuation[0] == tok.convert_tokens_to_ids(END_OF_TURN[family])
    assert tok.bos_token_id is None or tok.bos_token_id not in continuation
    ending = tok.encode(GENERATION_PROMPT[family], add_special_tokens=False)
    assert continuation[-len(ending):] == ending


def test_encode_continuation_falls_back(tiny_models):
    mistral = EngineBase(load_from_dir(tiny_models["mistral"]))
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello"}]
    # Mistral's template moves the system prompt into the last user turn: what the model saw
    # is no longer a prefix of the longer chat, so the caller must encode all of it again.
    assert mistral.encode_continuation(messages, [{"role": "user", "content": "more"}]) is None
    assert mistral.encode_continuation(messages[1:], [{"role": "user", "content": "more"}]) is not None
    loaded = load_from_dir(tiny_models["qwen3"])
    loaded.chat_format = replace(loaded.chat_format, chat_template=None)  # as a template-less model's
    plain = EngineBase(loaded)
    assert plain.encode_continuation(messages[1:], [{"role": "user", "content": "more"}]) is None


# --- helpers --------------------------------------------------------------------------------
def test_footer_format():
    stats = GenerationStats(prompt_tokens=1047, cached_tokens=1015, completion_tokens=64, ttft_s=0.0854,
                            prefill_tps=450.2, decode_tps=12.34, peak_memory_bytes=int(1.2 * 1024**3),
                            finish_reason="stop")
    assert format_footer(stats) == (
        "decode 12.3 tok/s · prefill 450 tok/s · prompt 1047 tokens (1015 cached) · reply 64 tokens · "
        "TTFT 85 ms · peak 1.2 GiB"
    )
    stats.finish_reason, stats.ttft_s = "length", 2.5
    assert format_footer(stats).endswith("TTFT 2.50 s · peak 1.2 GiB · finish: length")
    stats.truncated_by = "context"  # the context window, not max_tokens, ended the reply
    assert format_footer(stats).endswith("· finish: length (context full)")
    stats.finish_reason, stats.truncated_by = "cancelled", None
    assert format_footer(stats).endswith("· finish: cancelled")


def test_human_units():
    assert human_bytes(512) == "512 B"
    assert human_bytes(1536) == "1.5 KiB"
    assert human_bytes(5 * 1024**2) == "5.0 MiB"
    assert human_count(950) == "950" and human_count(99_700) == "99.7K"
    assert human_count(7_610_000_000) == "7.6B"


def test_block_parsing():
    assert block_is_open('"""') and block_is_open('"""\nline')
    assert not block_is_open('"""\nline\n"""') and not block_is_open("plain") and not block_is_open('say """')
    assert unwrap_block('"""\na\nb\n"""') == "a\nb"
    assert unwrap_block('"""\na') == "a"  # input ended inside the block
    assert unwrap_block("a\nb") == "a\nb"


def test_parse_saved_validates():
    system, messages = parse_saved({"system": None, "messages": [{"role": "user", "content": "hi", "x": 1}]})
    assert system is None and messages == [{"role": "user", "content": "hi"}]
    for bad in ([], {"messages": "no"}, {"messages": [{"role": "robot", "content": "x"}]},
                {"messages": [{"role": "user", "content": 3}]}, {"system": 1, "messages": []}):
        with pytest.raises(ValueError):
            parse_saved(bad)


def test_default_history_file(monkeypatch, tmp_path):
    monkeypatch.setenv("MLXLOCAL_HOME", str(tmp_path))
    assert default_history_file() == tmp_path / "chat_history"
    monkeypatch.delenv("MLXLOCAL_HOME")
    assert default_history_file() == Path.home() / ".local/state/mlxlocal/chat_history"


def test_sigint_sets_event_and_restores_handler():
    before = signal.getsignal(signal.SIGINT)
    event = threading.Event()
    with sigint_sets(event):
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(0.05)  # let the handler run
        assert event.is_set()
    assert signal.getsignal(signal.SIGINT) is before


def test_ctrl_c_during_prefill_keeps_nothing_and_the_repl(chat, tmp_path_factory):
    # A long context and an 18k-token prompt: prefill runs in 512-token chunks for seconds,
    # so a Ctrl-C right after the reply view appears lands before the first token.
    cfg = dict(FAMILY_CONFIGS["qwen3"], max_position_embeddings=32768)
    model = build_tiny(tmp_path_factory.mktemp("long_chat") / "long-chat", cfg)
    c = chat(model=model, max_tokens=8)
    c.prompt()
    first = c.ask("hello there")
    # Pasted as a terminal does (bracketed paste): one edit, not 100k keystrokes.
    c.child.send("\x1b[200~" + " ".join(["the cat sat"] * 2000) + "\x1b[201~\r")
    c.child.expect_exact("…")  # the request is in the engine: prefill has started
    c.child.sendintr()
    c.child.expect_exact("cancelled before the first token")
    c.prompt()
    saved = tmp_path_factory.mktemp("saved") / "chat.json"
    c.command(f"/save {saved}", "saved 2 messages")  # the cancelled turn left nothing behind
    again = c.ask("and now?")
    # The conversation continues from the first turn: its prompt and reply are still cached
    # (plus the few end-of-turn tokens the cancelled prompt shared with this one).
    assert first.prompt + first.reply - 1 <= again.cached < again.prompt
    assert again.prompt < first.prompt + first.reply + 30  # the long message is gone
    assert c.exit() == 0
