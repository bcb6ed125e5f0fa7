"""The chat REPL, used as a person would: the real `python -m mlxlocal.chat` in a pty.

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
from pathlib import Path

import pytest
from conftest import FAMILY_CONFIGS, build_tiny
from rich.console import Console

from mlxlocal.chat import (
    ChatRepl,
    block_is_open,
    default_history_file,
    format_footer,
    human_bytes,
    human_count,
    parse_saved,
    sigint_sets,
    unwrap_block,
)
from mlxlocal.engine import GenerationStats, PagedEngine, SamplingParams, open_engine

pexpect = pytest.importorskip("pexpect")

FOOTER = re.compile(r"(\d+) prompt tokens \((\d+) cached\) · (\d+) tokens")
PROMPT = ">>>"  # prompt_toolkit draws the trailing space as a cursor move
TIMEOUT = 60


@pytest.fixture(scope="session")
def chat_model_dir(tmp_path_factory) -> Path:
    # A long context: a reply must run long enough to be interrupted with Ctrl-C.
    cfg = dict(FAMILY_CONFIGS["qwen3"], max_position_embeddings=4096)
    return build_tiny(tmp_path_factory.mktemp("chat_model") / "tiny-chat", cfg)


# --- driving the real program ---------------------------------------------------------------
class Chat:
    """One `python -m mlxlocal.chat` in a pty, with helpers that wait for what a user sees."""

    def __init__(self, model: Path | str, home: Path, *args: str, max_tokens: int = 12):
        env = dict(os.environ, TERM="xterm-256color", PROMPT_TOOLKIT_NO_CPR="1", COLUMNS="200",
                   LINES="50", MLXLOCAL_HOME=str(home), HF_HUB_OFFLINE="1", PYTHONIOENCODING="utf-8")
        argv = ["-m", "mlxlocal.chat", "--model", str(model), "--max-tokens", str(max_tokens),
                "--temp", "0", *args]
        self.child = pexpect.spawn(sys.executable, argv, env=env, cwd=str(home), dimensions=(50, 200),
                                   encoding="utf-8", codec_errors="replace", timeout=TIMEOUT)

    def expect(self, pattern: str | re.Pattern[str]) -> re.Match[str]:
        self.child.expect(pattern)
        return self.child.match

    def prompt(self) -> None:
        self.child.expect_exact(PROMPT)

    def ask(self, text: str) -> tuple[int, int, int]:
        """Send a message; return (prompt tokens, cached tokens, completion tokens) from its footer."""
        self.child.send(text + "\r")
        m = self.expect(FOOTER)
        self.prompt()
        return int(m[1]), int(m[2]), int(m[3])

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

    def start(*args: str, model: Path | str | None = None, max_tokens: int = 12) -> Chat:
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
    prompt1, cached1, completion1 = c.ask("hello world")
    assert cached1 == 0 and 0 < completion1 <= 12
    prompt2, cached2, _ = c.ask("tell me more about the fox")
    # Turn two re-renders the whole conversation; the session already holds turn one.
    assert prompt2 > prompt1 and cached2 >= prompt1 - 1 and cached2 < prompt2
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
    prompt, cached, _ = c.ask("and then?")
    assert prompt > 20 and cached < prompt  # the prefix cache may still hold its first blocks
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


def test_ctrl_c_stops_reply_and_keeps_the_repl(chat, tmp_path):
    c = chat(max_tokens=3000)
    c.prompt()
    c.child.send("hello world\r")
    c.child.expect_exact("…")  # the reply view is up: generation has started
    time.sleep(0.5)
    c.child.sendintr()
    c.child.expect_exact("[interrupted]")
    m = c.expect(FOOTER)
    assert int(m[3]) < 3000
    c.child.expect_exact("finish: cancelled")
    c.prompt()
    # Ctrl-C at the prompt clears the line instead of exiting.
    c.child.send("half typed")
    c.child.sendintr()
    c.prompt()
    saved = tmp_path / "cut.json"
    c.command(f"/save {saved}", "saved 2 messages")
    partial = json.loads(saved.read_text())["messages"][1]
    assert partial["role"] == "assistant" and partial["content"]  # the partial reply is kept
    c.child.send("/clear\r")
    c.child.expect_exact("conversation cleared")  # not "half typed/clear": the line was cleared
    c.prompt()
    c.child.send("and again\r")
    c.child.expect_exact("…")
    c.child.sendintr()
    c.child.expect_exact("[interrupted]")
    c.prompt()
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
    from mlxlocal.loader import load_from_dir

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
    assert [m["role"] for m in repl.messages] == ["user", "assistant"] * 2
    assert repl.conversation()[0] == {"role": "system", "content": "be brief"}


def test_context_overflow_is_reported_and_forgotten(engine, monkeypatch):
    repl, out = make_repl(engine)
    monkeypatch.setattr(engine.loaded.info, "context_length", 40)
    repl.turn("the quick brown fox jumps over the lazy dog " * 10)
    assert "context length is 40" in out.getvalue() and "/clear" in out.getvalue()
    assert repl.messages == []  # the message that did not fit is not kept


def test_commands_in_process(engine, tmp_path):
    repl, out = make_repl(engine)
    assert repl.command("/help") and "/model SPEC" in out.getvalue()
    assert repl.command("/nope") and "unknown command /nope" in out.getvalue()
    assert repl.command("/save") and "usage: /save FILE" in out.getvalue()
    assert repl.command("/system [bold]x[/bold]") and repl.system == "[bold]x[/bold]"
    for name in ("/exit", "/quit", "/bye", "/EXIT"):
        assert repl.command(name) is False


# --- helpers --------------------------------------------------------------------------------
def test_footer_format():
    stats = GenerationStats(prompt_tokens=120, cached_tokens=100, completion_tokens=42, ttft_s=0.0345,
                            prefill_tps=580.0, decode_tps=61.25, peak_memory_bytes=3 * 1024**3,
                            finish_reason="stop")
    assert format_footer(stats) == (
        "61.2 tok/s · prompt 580.0 tok/s · 120 prompt tokens (100 cached) · 42 tokens · "
        "TTFT 34 ms · peak 3.0 GiB"
    )
    stats.finish_reason, stats.ttft_s = "length", 2.5
    assert format_footer(stats).endswith("TTFT 2.50 s · peak 3.0 GiB · finish: length")


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
